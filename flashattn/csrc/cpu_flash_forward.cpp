// The forward operator's body (cpu_forward.h's kernel for every dtype and tile policy); registered by
// cpu_flash.cpp.
#include "cpu_forward.h"
#include "cpu_ops.h"

namespace __attribute__((visibility("hidden"))) flash_cpu_ops {

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

}  // namespace flash_cpu_ops
