// FlashAttention-2 on CPU, forward (cpu_forward.h) and backward (cpu_backward.h), each compiled in a translation unit
// of its own (cpu_flash_forward.cpp, cpu_flash_backward.cpp; this one registers them): one parallel region per call,
// tasks pulled by the threads longest first, tile products in one of two policies (cpu_tiles.h), the softmax
// fused and vectorised over the tile. Built at first use by flashattn/backends/cpu_build.py and registered as
// typed operators (TORCH_LIBRARY) in a namespace named after the build, called by flashattn/backends/cpu.py.
//
// Layout: q (Bq, Nq, H, D), k (Bk, Nk, Hk, D) or paged (pages, page_size, Hk, D), v likewise with Dv; any strides
// with a unit last one; H % Hk == 0. out (Bq, Nq, H, Dv) and lse (Bq, H, Nq) are written in place. Sequence s is
// the row (q batch, q start, nq, k batch, k start, nk, diagonal) of `seqs` (S, 7): a dense batch entry, a varlen
// sequence or a KV-cache entry. Row i of s sees key j where -left <= j - i - diagonal <= right.
// fp16/bf16/fp32 accumulate in fp32, fp64 in fp64; `tiles` says how bf16/fp16 tiles are multiplied: "fp32"
// (converted, sgemm) or on the dot-product instructions, "onednn" (ATen's brgemm), "avx512bf16" or "amx" (ours).
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "cpu_ops.h"

namespace {

using at::Tensor;
using c10::optional;
using flash_cpu_ops::Options;

// The options both operators take, after their tensors; the schema's names, in its order.
#define FLASHATTN_OPTIONS                                                                                        \
  "Tensor? seqs, Tensor? block_table, int diagonal, float scale, float softcap, int left, int right, "          \
  "int block_m, int block_n, Tensor? alibi, Tensor? sink, float dropout_p, int seed, int counter_rows, "         \
  "int counter_cols, Tensor? mask, Tensor? tile_kind, Tensor? partial_id, Tensor? partial_masks, str tiles"

void forward_op(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                const optional<Tensor>& seqs, const optional<Tensor>& block_table, int64_t diagonal, double scale,
                double softcap, int64_t left, int64_t right, int64_t block_m, int64_t block_n,
                const optional<Tensor>& alibi, const optional<Tensor>& sink, double dropout_p, int64_t seed,
                int64_t counter_rows, int64_t counter_cols, const optional<Tensor>& mask,
                const optional<Tensor>& tile_kind, const optional<Tensor>& partial_id,
                const optional<Tensor>& partial_masks, c10::string_view tiles, int64_t kv_format,
                const optional<Tensor>& v_descale, const optional<Tensor>& qk_descale) {
  flash_cpu_ops::forward(q, k, v, out, lse,
                         Options{seqs, block_table, diagonal, scale, softcap, left, right, block_m, block_n, alibi,
                                 sink, dropout_p, seed, counter_rows, counter_cols, mask, tile_kind, partial_id,
                                 partial_masks, tiles},
                         kv_format, v_descale, qk_descale);
}

void backward_op(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout,
                 const Tensor& lse, const optional<Tensor>& dlse, Tensor& dq, Tensor& dk, Tensor& dv,
                 const optional<Tensor>& dmask, const optional<Tensor>& seqs, const optional<Tensor>& block_table,
                 int64_t diagonal, double scale, double softcap, int64_t left, int64_t right, int64_t block_m,
                 int64_t block_n, const optional<Tensor>& alibi, const optional<Tensor>& sink, double dropout_p,
                 int64_t seed, int64_t counter_rows, int64_t counter_cols, const optional<Tensor>& mask,
                 const optional<Tensor>& tile_kind, const optional<Tensor>& partial_id,
                 const optional<Tensor>& partial_masks, c10::string_view tiles) {
  flash_cpu_ops::backward(q, k, v, out, dout, lse, dlse, dq, dk, dv, dmask,
                          Options{seqs, block_table, diagonal, scale, softcap, left, right, block_m, block_n, alibi,
                                  sink, dropout_p, seed, counter_rows, counter_cols, mask, tile_kind, partial_id,
                                  partial_masks, tiles});
}

// FP8 values (src: uint8 bytes of `format`) into out's 16-bit (or fp32) type, exactly: FP8 queries, and keys and
// values widened once. PyTorch's own FP8 conversion on the CPU takes about 3 ns an element, this one a tenth.
void widen_op(const Tensor& src, Tensor& out, int64_t format) {
  TORCH_CHECK(src.scalar_type() == at::kByte, "widen: uint8 src");
  TORCH_CHECK(src.is_contiguous() && out.is_contiguous() && out.numel() == src.numel(),
              "widen: contiguous tensors, out as large as src");
  TORCH_CHECK(format == 1 || format == 2, "widen: format 1 (e4m3fn) or 2 (e5m2), got ", format);
  const auto kv_format = static_cast<flash_cpu::KvFormat>(format);
  constexpr int64_t kChunk = 16384;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "widen", [&] {
    const uint8_t* from = src.data_ptr<uint8_t>();
    scalar_t* to = out.data_ptr<scalar_t>();
    at::parallel_for(0, (src.numel() + kChunk - 1) / kChunk, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        const int64_t at = c * kChunk;
        flash_cpu::widen_fp8(from + at, to + at, std::min(kChunk, src.numel() - at), kv_format);
      }
    });
  });
}

// The tile-product engines this build has ("onednn": the torch it was built against declares ATen's brgemm;
// "avx512bf16": the compiler targets AVX512_BF16; "amx": the CPU has AMX bf16 and the OS grants this process its
// tile state). Whether they run is for the caller's self-test to say.
std::vector<std::string> engines() {
  std::vector<std::string> names;
  if (flash_cpu::amx_usable()) names.emplace_back("amx");
  if (flash_cpu::has_onednn()) names.emplace_back("onednn");
  if (flash_cpu::has_avx512bf16()) names.emplace_back("avx512bf16");
  return names;
}

}  // namespace

// The namespace is the build's name (TORCH_EXTENSION_NAME), so two builds can live in one process. The macros
// expand it before TORCH_LIBRARY pastes it into names.
#define FLASHATTN_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define FLASHATTN_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)
FLASHATTN_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("forward(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!) lse, " FLASHATTN_OPTIONS
        ", int kv_format=0, Tensor? v_descale=None, Tensor? qk_descale=None) -> ()");
  m.def("backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor dout, Tensor lse, Tensor? dlse, Tensor(a!) dq, "
        "Tensor(b!) dk, Tensor(c!) dv, Tensor(d!)? dmask, *, " FLASHATTN_OPTIONS ") -> ()");
  m.def("engines() -> str[]", &engines);
  m.def("widen(Tensor src, Tensor(a!) out, int format) -> ()");
}

FLASHATTN_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CPU, m) {
  m.impl("forward", &forward_op);
  m.impl("backward", &backward_op);
  m.impl("widen", &widen_op);
}
