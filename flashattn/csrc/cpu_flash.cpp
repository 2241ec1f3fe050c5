// FlashAttention-2 on CPU, forward (cpu_forward.h) and backward (cpu_backward.h): one parallel region per call,
// tasks pulled by the threads longest first, tile products in one of two policies (cpu_tiles.h), the softmax
// fused and vectorised over the tile. Built at first use by flashattn/backends/cpu_build.py and registered as
// typed operators (TORCH_LIBRARY) in a namespace named after the build, called by flashattn/backends/cpu.py.
//
// Layout: q (Bq, Nq, H, D), k (Bk, Nk, Hk, D) or paged (pages, page_size, Hk, D), v likewise with Dv; any strides
// with a unit last one; H % Hk == 0. out (Bq, Nq, H, Dv) and lse (Bq, H, Nq) are written in place. Sequence s is
// the row (q batch, q start, nq, k batch, k start, nk, diagonal) of `seqs` (S, 7): a dense batch entry, a varlen
// sequence or a KV-cache entry. Row i of s sees key j where -left <= j - i - diagonal <= right.
// fp16/bf16/fp32 accumulate in fp32, fp64 in fp64; `tiles` says how bf16/fp16 tiles are multiplied: "fp32"
// (converted, sgemm) or on the dot-product instructions, "onednn" (ATen's brgemm) or "avx512bf16" (ours).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include "cpu_backward.h"

namespace {

using at::Tensor;
using c10::optional;
using flash_cpu::Engine;
using flash_cpu::Problem;

// The options both operators take, after their tensors; the schema's names, in its order.
#define FLASHATTN_OPTIONS                                                                                        \
  "Tensor? seqs, Tensor? block_table, int diagonal, float scale, float softcap, int left, int right, "          \
  "int block_m, int block_n, Tensor? alibi, Tensor? sink, float dropout_p, int seed, int counter_rows, "         \
  "int counter_cols, Tensor? mask, Tensor? tile_kind, Tensor? partial_id, Tensor? partial_masks, str tiles"

struct Options {
  optional<Tensor> seqs, block_table;
  int64_t diagonal;
  double scale, softcap;
  int64_t left, right, block_m, block_n;
  optional<Tensor> alibi, sink;
  double dropout_p;
  int64_t seed, counter_rows, counter_cols;
  optional<Tensor> mask, tile_kind, partial_id, partial_masks;
  c10::string_view tiles;
};

Engine engine_of(c10::string_view tiles) {
  const Engine engine = tiles == "onednn" ? Engine::onednn : tiles == "avx512bf16" ? Engine::avx512bf16 : Engine::fp32;
  TORCH_CHECK(engine != Engine::fp32 || tiles == "fp32",
              "flashattn cpu kernel: tiles must be fp32, onednn or avx512bf16, got ", tiles);
  return engine;
}

void check_layout(const Tensor& q, const Tensor& k, const Tensor& v) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be 4-D");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "the head dim must be contiguous");
  TORCH_CHECK(q.size(2) % k.size(2) == 0, "query heads must be a multiple of key/value heads");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "k and v dtypes differ");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() || k.scalar_type() == at::kByte,
              "q, k, v dtypes differ (k and v may be FP8 bytes)");
}

// `keep` holds the tensors the problem points into (converted ALiBi slopes, mask, page table) alive.
Problem make_problem(const Options& o, const Tensor& q, const Tensor& k, const Tensor& v, std::vector<Tensor>& keep) {
  Problem p;
  p.heads = q.size(2);
  p.kv_heads = k.size(2);
  p.group = p.heads / p.kv_heads;
  p.dim = q.size(3);
  p.dim_v = v.size(3);
  if (o.seqs) {
    const Tensor rows = o.seqs->to(at::kLong).contiguous();
    TORCH_CHECK(rows.dim() == 2 && rows.size(1) == 7, "seqs must be (S, 7)");
    const int64_t* sp = rows.data_ptr<int64_t>();
    for (int64_t s = 0; s < rows.size(0); ++s, sp += 7) p.seqs.push_back({sp[0], sp[1], sp[2], sp[3], sp[4], sp[5], sp[6]});
  } else {  // a dense batch: entry b is sequence b, one diagonal for all
    for (int64_t b = 0; b < q.size(0); ++b) p.seqs.push_back({b, 0, q.size(1), b, 0, k.size(1), o.diagonal});
  }
  p.scale = o.scale;
  p.softcap = o.softcap;
  p.left = o.left;
  p.right = o.right;
  // Tiles no larger than the call needs (decode: the group's rows by the keys), so small calls allocate little.
  int64_t rows = 1, cols = 1;
  for (const auto& s : p.seqs) rows = std::max(rows, s.nq * p.group), cols = std::max(cols, s.nk);
  p.block_m = std::min(o.block_m, rows);
  p.block_n = std::min(o.block_n, cols);
  if (o.block_table) {
    keep.push_back(o.block_table->to(at::kLong).contiguous());
    p.block_table = keep.back().data_ptr<int64_t>();
    p.block_table_stride = keep.back().size(1);
    p.page_size = k.size(1);
  }
  if (o.alibi) {
    keep.push_back(o.alibi->to(at::kFloat).contiguous());
    p.alibi = keep.back().data_ptr<float>();
    p.alibi_stride = keep.back().size(0) > 1 ? keep.back().stride(0) : 0;
  }
  if (o.sink) {
    const Tensor values = o.sink->to(at::kDouble).contiguous();
    TORCH_CHECK(values.numel() == p.heads, "sink must have one logit per query head");
    p.sink.assign(values.data_ptr<double>(), values.data_ptr<double>() + p.heads);
  }
  p.dropout_p = static_cast<float>(o.dropout_p);
  if (o.dropout_p > 0) {
    p.dropout_scale = 1.0 / (1.0 - o.dropout_p);
    p.seed = static_cast<uint64_t>(o.seed);
    p.counter_rows = o.counter_rows;
    p.counter_cols = o.counter_cols;
  }
  if (o.tile_kind) {  // (S or 1, H or 1, query blocks, key blocks); the block mask's blocks are the tiles
    const Tensor &kind = *o.tile_kind, &id = o.partial_id.value(), &masks = o.partial_masks.value();
    TORCH_CHECK(kind.dim() == 4 && kind.scalar_type() == at::kByte && id.scalar_type() == at::kInt &&
                    masks.scalar_type() == at::kBool && kind.strides() == id.strides() && masks.is_contiguous(),
                "tile_kind, partial_id and partial_masks must be uint8, int32 and bool with matching layouts");
    keep.insert(keep.end(), {kind, id, masks});
    p.tile_kind = kind.data_ptr<uint8_t>();
    p.partial_id = id.data_ptr<int32_t>();
    p.partial_masks = masks.data_ptr<bool>();
    for (int d = 0; d < 4; ++d) p.tile_stride[d] = kind.size(d) > 1 ? kind.stride(d) : 0;
    p.tile_rows = o.block_m;
    p.tile_cols = o.block_n;
  }
  if (o.mask) {  // (S, H, Nq, Nk), broadcast dims with stride 0
    TORCH_CHECK(o.mask->dim() == 4, "mask must be 4-D");
    keep.push_back(*o.mask);
    p.mask = o.mask->data_ptr();
    p.mask_is_bool = o.mask->scalar_type() == at::kBool;
    for (int d = 0; d < 4; ++d) p.mask_stride[d] = o.mask->stride(d);
  }
  return p;
}

template <typename T>
struct Policy {
  using type = T;
};

// Runs fn(Policy<Tiles>{}) with the tile policy of q's dtype and the engine.
template <typename Fn>
void dispatch_tiles(const Tensor& q, Engine engine, const Fn& fn) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "flashattn_cpu", [&] {
    if constexpr (std::is_same_v<scalar_t, at::BFloat16> || std::is_same_v<scalar_t, at::Half>) {
      if (engine != Engine::fp32) return fn(Policy<flash_cpu::NativeTiles<scalar_t>>{});
    }
    return fn(Policy<flash_cpu::WideTiles<scalar_t, at::opmath_type<scalar_t>>>{});
  });
}

// Key tiles of decode-like forwards, whose tasks read every kv head's rows: a tile of K and V rows, read ahead,
// stays within L2.
constexpr int64_t kShortQueryKeys = 64;

// kv_format 0: k and v have q's dtype; 1 or 2: they are FP8 (e4m3fn, e5m2) bytes, widened tile by tile. FP8
// inputs' descales, (S, Hk) float32 each: qk_descale (q's times k's) scales the scores, v_descale the output.
void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse, const Options& o,
             int64_t kv_format, const optional<Tensor>& v_descale, const optional<Tensor>& qk_descale) {
  check_layout(q, k, v);
  TORCH_CHECK((kv_format != 0) == (k.scalar_type() == at::kByte && q.scalar_type() != at::kByte),
              "kv_format must be 1 or 2 exactly when k and v are FP8 bytes");
  at::NoGradGuard no_grad;
  std::vector<Tensor> keep;
  Problem p = make_problem(o, q, k, v, keep);
  if (p.short_queries()) p.block_n = std::min(p.block_n, kShortQueryKeys);
  p.kv_format = static_cast<flash_cpu::KvFormat>(kv_format);
  const auto per_head = [&](const optional<Tensor>& scales, const char* name) -> const float* {
    if (!scales) return nullptr;
    keep.push_back(scales->to(at::kFloat).contiguous());
    TORCH_CHECK(keep.back().numel() == static_cast<int64_t>(p.seqs.size()) * p.kv_heads, name,
                " must be (sequences, kv heads)");
    return keep.back().data_ptr<float>();
  };
  p.v_descale = per_head(v_descale, "v_descale");
  p.qk_descale = per_head(qk_descale, "qk_descale");
  const Engine engine = engine_of(o.tiles);
  dispatch_tiles(q, engine, [&](auto policy) {
    using Tiles = typename decltype(policy)::type;
    if (kv_format != 0) {
      flash_cpu::forward_kernel<Tiles, uint8_t>(p, engine, q, k, v, out, lse);
    } else {
      flash_cpu::forward_kernel<Tiles>(p, engine, q, k, v, out, lse);
    }
  });
}

// Writes dq, dk, dv (the inputs' dtypes) and, if given, dmask (B, H, Nq, Nk) in the accumulation dtype, zeroed.
void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout,
              const Tensor& lse, const optional<Tensor>& dlse, Tensor& dq, Tensor& dk, Tensor& dv,
              optional<Tensor> dmask, const Options& o) {
  check_layout(q, k, v);
  at::NoGradGuard no_grad;
  std::vector<Tensor> keep;
  const Problem p = make_problem(o, q, k, v, keep);
  TORCH_CHECK(p.block_table == nullptr, "no backward through a paged cache");
  const Engine engine = engine_of(o.tiles);
  const auto acc_type = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  // Fewer (sequence, kv head) pairs than threads: split each one's query blocks, and its dK/dV into partials.
  const int64_t units = std::max<int64_t>(1, static_cast<int64_t>(p.seqs.size()) * p.kv_heads);
  const int64_t splits = std::max<int64_t>(1, std::min<int64_t>(8, (2 * at::get_num_threads() + units - 1) / units - 1));
  optional<Tensor> dlse_acc;
  if (dlse.has_value()) dlse_acc = dlse->to(acc_type).contiguous();
  TORCH_CHECK(dk.stride(3) == 1 && dv.stride(3) == 1, "backward: dk and dv need a contiguous head dim");
  dispatch_tiles(q, engine, [&](auto policy) {
    using Tiles = typename decltype(policy)::type;
    // fp32 tiles on brgemm write dK and dV from their panels (cpu_wide_tiles.h); the others write partials.
    Tensor dk_part, dv_part;
    if constexpr (Tiles::kRowMajor) {
      int64_t covered = 0;
      for (const auto& s : p.seqs) covered += s.nk;
      if (covered < k.size(0) * k.size(1)) dk.zero_(), dv.zero_();  // keys no sequence reads: gradient 0
    } else {
      dk_part = at::zeros({splits, k.size(0), k.size(1), k.size(2), k.size(3)}, k.options().dtype(acc_type));
      dv_part = at::zeros({splits, v.size(0), v.size(1), v.size(2), v.size(3)}, v.options().dtype(acc_type));
    }
    const flash_cpu::BackwardIo io{out, dout, lse, dlse_acc ? &*dlse_acc : nullptr, dq, dk, dv, dk_part, dv_part,
                                   dmask ? &*dmask : nullptr};
    flash_cpu::backward_kernel<Tiles>(p, engine, q, k, v, io, splits);
    if constexpr (!Tiles::kRowMajor) {
      const double k_factor = Tiles::dk_factor(p);
      dk.copy_(splits > 1 ? dk_part.sum(0).mul_(k_factor) : dk_part[0].mul_(k_factor));
      dv.copy_(splits > 1 ? dv_part.sum(0) : dv_part[0]);
    }
  });
}

void forward_op(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                const optional<Tensor>& seqs, const optional<Tensor>& block_table, int64_t diagonal, double scale,
                double softcap, int64_t left, int64_t right, int64_t block_m, int64_t block_n,
                const optional<Tensor>& alibi, const optional<Tensor>& sink, double dropout_p, int64_t seed,
                int64_t counter_rows, int64_t counter_cols, const optional<Tensor>& mask,
                const optional<Tensor>& tile_kind, const optional<Tensor>& partial_id,
                const optional<Tensor>& partial_masks, c10::string_view tiles, int64_t kv_format,
                const optional<Tensor>& v_descale, const optional<Tensor>& qk_descale) {
  forward(q, k, v, out, lse,
          Options{seqs, block_table, diagonal, scale, softcap, left, right, block_m, block_n, alibi, sink, dropout_p,
                  seed, counter_rows, counter_cols, mask, tile_kind, partial_id, partial_masks, tiles},
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
  backward(q, k, v, out, dout, lse, dlse, dq, dk, dv, dmask,
           Options{seqs, block_table, diagonal, scale, softcap, left, right, block_m, block_n, alibi, sink, dropout_p,
                   seed, counter_rows, counter_cols, mask, tile_kind, partial_id, partial_masks, tiles});
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
// "avx512bf16": the compiler targets AVX512_BF16). Whether they run is for the caller's self-test to say.
std::vector<std::string> engines() {
  std::vector<std::string> names;
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
  m.def("forward(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!) lse, *, " FLASHATTN_OPTIONS
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
