// What the C++ kernel's translation units share: the options both operators take, the problem built from them,
// the dispatch to a tile policy by dtype and engine. The registration is cpu_flash.cpp's; the operators' bodies
// are cpu_flash_forward.cpp's and cpu_flash_backward.cpp's, compiled side by side (the first use's build).
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

#include "cpu_wide_tiles.h"

// Hidden: two builds (an AVX2 one beside the native one) may live in one process, each calling its own.
namespace __attribute__((visibility("hidden"))) flash_cpu_ops {

using at::Tensor;
using c10::optional;
using flash_cpu::Engine;
using flash_cpu::Problem;


// The options both operators take, after their tensors, in the schema's order (cpu_flash.cpp).
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

inline Engine engine_of(c10::string_view tiles) {
  const Engine engine = tiles == "onednn"       ? Engine::onednn
                        : tiles == "avx512bf16" ? Engine::avx512bf16
                        : tiles == "amx"        ? Engine::amx
                                                : Engine::fp32;
  TORCH_CHECK(engine != Engine::fp32 || tiles == "fp32",
              "flashattn cpu kernel: tiles must be fp32, onednn, avx512bf16 or amx, got ", tiles);
  TORCH_CHECK(engine != Engine::amx || flash_cpu::amx_usable(),
              "flashattn cpu kernel: tiles=amx, but this CPU or its OS offers this process no AMX tiles");
  return engine;
}

inline void check_layout(const Tensor& q, const Tensor& k, const Tensor& v) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be 4-D");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "the head dim must be contiguous");
  TORCH_CHECK(q.size(2) % k.size(2) == 0, "query heads must be a multiple of key/value heads");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "k and v dtypes differ");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() || k.scalar_type() == at::kByte,
              "q, k, v dtypes differ (k and v may be FP8 bytes)");
}

// `keep` holds the tensors the problem points into (converted ALiBi slopes, mask, page table) alive.
inline Problem make_problem(const Options& o, const Tensor& q, const Tensor& k, const Tensor& v, std::vector<Tensor>& keep) {
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
    p.keep_threshold = flash_cpu::dropout_threshold(p.dropout_p);
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

// The operators' bodies, one translation unit each (compiled in parallel): cpu_flash_forward.cpp and
// cpu_flash_backward.cpp.
void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse, const Options& o,
             int64_t kv_format, const optional<Tensor>& v_descale, const optional<Tensor>& qk_descale);
void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout,
              const Tensor& lse, const optional<Tensor>& dlse, Tensor& dq, Tensor& dk, Tensor& dv,
              optional<Tensor> dmask, const Options& o);

}  // namespace flash_cpu_ops
