// The backward operator's body (cpu_backward.h's kernel for every dtype and tile policy); registered by
// cpu_flash.cpp.
#include "cpu_backward.h"
#include "cpu_ops.h"

namespace __attribute__((visibility("hidden"))) flash_cpu_ops {

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

}  // namespace flash_cpu_ops
