// FlashAttention-2 on CPU, forward (cpu_forward.h) and backward (cpu_backward.h): one parallel region per call,
// tasks pulled by the threads longest first, tile matmuls on the BLAS torch ships, the softmax fused and
// vectorised over the tile. Built at first use by flashattn/backends/cpu_kernel.py, which also builds `options`.
//
// Layout: q (Bq, Nq, H, D), k (Bk, Nk, Hk, D) or paged (pages, page_size, Hk, D), v likewise with Dv; any strides
// with a unit last one; H % Hk == 0. out (Bq, Nq, H, Dv) and lse (Bq, H, Nq) are written in place. Sequence s is
// the row (q batch, q start, nq, k batch, k start, nk, diagonal) of options["seqs"] (S, 7): a dense batch entry,
// a varlen sequence or a KV-cache entry. Row i of s sees key j where -left <= j - i - diagonal <= right.
// fp16/bf16/fp32 compute in fp32, fp64 in fp64.
#include "cpu_backward.h"

namespace {

using flash_cpu::Problem;

template <typename T>
T option(const pybind11::dict& o, const char* name) {
  TORCH_CHECK(o.contains(name), "flashattn cpu kernel: missing option ", name);
  return o[name].cast<T>();
}

c10::optional<at::Tensor> tensor_option(const pybind11::dict& o, const char* name) {
  if (!o.contains(name) || o[name].is_none()) return c10::nullopt;
  return o[name].cast<at::Tensor>();
}

void check_layout(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be 4-D");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "the head dim must be contiguous");
  TORCH_CHECK(q.size(2) % k.size(2) == 0, "query heads must be a multiple of key/value heads");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "q, k, v dtypes differ");
}

// `keep` holds the tensors the problem points into (converted ALiBi slopes, mask, page table) alive.
Problem make_problem(const pybind11::dict& o, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     std::vector<at::Tensor>& keep) {
  Problem p;
  p.heads = q.size(2);
  p.kv_heads = k.size(2);
  p.group = p.heads / p.kv_heads;
  p.dim = q.size(3);
  p.dim_v = v.size(3);
  if (auto seqs = tensor_option(o, "seqs")) {
    const at::Tensor rows = seqs->to(at::kLong).contiguous();
    TORCH_CHECK(rows.dim() == 2 && rows.size(1) == 7, "seqs must be (S, 7)");
    const int64_t* sp = rows.data_ptr<int64_t>();
    for (int64_t s = 0; s < rows.size(0); ++s, sp += 7) p.seqs.push_back({sp[0], sp[1], sp[2], sp[3], sp[4], sp[5], sp[6]});
  } else {  // a dense batch: entry b is sequence b, one diagonal for all
    const int64_t diagonal = option<int64_t>(o, "diagonal");
    for (int64_t b = 0; b < q.size(0); ++b) p.seqs.push_back({b, 0, q.size(1), b, 0, k.size(1), diagonal});
  }
  p.scale = option<double>(o, "scale");
  p.softcap = option<double>(o, "softcap");
  p.left = option<int64_t>(o, "left");
  p.right = option<int64_t>(o, "right");
  // Tiles no larger than the call needs (decode: the group's rows by the keys), so small calls allocate little.
  int64_t rows = 1, cols = 1;
  for (const auto& s : p.seqs) rows = std::max(rows, s.nq * p.group), cols = std::max(cols, s.nk);
  p.block_m = std::min(option<int64_t>(o, "block_m"), rows);
  p.block_n = std::min(option<int64_t>(o, "block_n"), cols);
  if (auto table = tensor_option(o, "block_table")) {
    keep.push_back(table->to(at::kLong).contiguous());
    p.block_table = keep.back().data_ptr<int64_t>();
    p.block_table_stride = keep.back().size(1);
    p.page_size = k.size(1);
  }
  if (auto alibi = tensor_option(o, "alibi")) {
    keep.push_back(alibi->to(at::kFloat).contiguous());
    p.alibi = keep.back().data_ptr<float>();
    p.alibi_stride = keep.back().size(0) > 1 ? keep.back().stride(0) : 0;
  }
  if (auto sink = tensor_option(o, "sink")) {
    const at::Tensor values = sink->to(at::kDouble).contiguous();
    TORCH_CHECK(values.numel() == p.heads, "sink must have one logit per query head");
    p.sink.assign(values.data_ptr<double>(), values.data_ptr<double>() + p.heads);
  }
  const double dropout_p = option<double>(o, "dropout_p");
  p.dropout_p = static_cast<float>(dropout_p);
  if (dropout_p > 0) {
    p.dropout_scale = 1.0 / (1.0 - dropout_p);
    p.seed = static_cast<uint64_t>(option<int64_t>(o, "seed"));
    p.counter_rows = option<int64_t>(o, "counter_rows");
    p.counter_cols = option<int64_t>(o, "counter_cols");
  }
  if (auto kind = tensor_option(o, "tile_kind")) {  // (S or 1, H or 1, query blocks, key blocks)
    const at::Tensor id = *tensor_option(o, "partial_id"), masks = *tensor_option(o, "partial_masks");
    TORCH_CHECK(kind->dim() == 4 && kind->scalar_type() == at::kByte && id.scalar_type() == at::kInt &&
                    masks.scalar_type() == at::kBool && kind->strides() == id.strides() && masks.is_contiguous(),
                "tile_kind, partial_id and partial_masks must be uint8, int32 and bool with matching layouts");
    keep.insert(keep.end(), {*kind, id, masks});
    p.tile_kind = kind->data_ptr<uint8_t>();
    p.partial_id = id.data_ptr<int32_t>();
    p.partial_masks = masks.data_ptr<bool>();
    for (int d = 0; d < 4; ++d) p.tile_stride[d] = kind->size(d) > 1 ? kind->stride(d) : 0;
    p.tile_rows = option<int64_t>(o, "block_m");
    p.tile_cols = option<int64_t>(o, "block_n");
  }
  if (auto mask = tensor_option(o, "mask")) {  // (S, H, Nq, Nk), broadcast dims with stride 0
    TORCH_CHECK(mask->dim() == 4, "mask must be 4-D");
    keep.push_back(*mask);
    p.mask = mask->data_ptr();
    p.mask_is_bool = mask->scalar_type() == at::kBool;
    for (int d = 0; d < 4; ++d) p.mask_stride[d] = mask->stride(d);
  }
  return p;
}

template <typename Fn>
void dispatch(at::ScalarType t, const Fn& fn) {
  switch (t) {
    case at::kFloat: return fn(float{}, float{});
    case at::kDouble: return fn(double{}, double{});
    case at::kBFloat16: return fn(at::BFloat16{}, float{});
    case at::kHalf: return fn(at::Half{}, float{});
    default: TORCH_CHECK(false, "flashattn cpu kernel: unsupported dtype ", t);
  }
}

void forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
             const pybind11::dict& options) {
  check_layout(q, k, v);
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> keep;
  const Problem p = make_problem(options, q, k, v, keep);
  dispatch(q.scalar_type(), [&](auto scalar, auto acc) {
    flash_cpu::forward_kernel<decltype(scalar), decltype(acc)>(p, q, k, v, out, lse);
  });
}

// Writes dq, dk, dv (the inputs' dtypes) and, if given, dmask (B, H, Nq, Nk) in the accumulation dtype, zeroed.
void backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
              const at::Tensor& dout, const at::Tensor& lse, const c10::optional<at::Tensor>& dlse, at::Tensor& dq,
              at::Tensor& dk, at::Tensor& dv, c10::optional<at::Tensor> dmask, const pybind11::dict& options) {
  check_layout(q, k, v);
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> keep;
  const Problem p = make_problem(options, q, k, v, keep);
  TORCH_CHECK(p.block_table == nullptr, "no backward through a paged cache");
  const auto acc_type = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  // Fewer (sequence, kv head) pairs than threads: split each one's query blocks, and its dK/dV into partials.
  const int64_t units = std::max<int64_t>(1, static_cast<int64_t>(p.seqs.size()) * p.kv_heads);
  const int64_t splits = std::max<int64_t>(1, std::min<int64_t>(8, (2 * at::get_num_threads() + units - 1) / units - 1));
  at::Tensor dk_part = at::zeros({splits, k.size(0), k.size(1), k.size(2), k.size(3)}, k.options().dtype(acc_type));
  at::Tensor dv_part = at::zeros({splits, v.size(0), v.size(1), v.size(2), v.size(3)}, v.options().dtype(acc_type));
  c10::optional<at::Tensor> dlse_acc;
  if (dlse.has_value()) dlse_acc = dlse->to(acc_type).contiguous();
  const flash_cpu::BackwardIo io{out, dout, lse, dlse_acc ? &*dlse_acc : nullptr, dq, dk_part, dv_part,
                                 dmask ? &*dmask : nullptr};
  dispatch(q.scalar_type(), [&](auto scalar, auto acc) {
    flash_cpu::backward_kernel<decltype(scalar), decltype(acc)>(p, q, k, v, io, splits);
  });
  // The kernel accumulated dS^T (Q in the kernel's units): back to d/dk of the natural score.
  const double k_factor = p.softcap > 0 ? p.softcap : 1.0 / flash_cpu::kLog2e;
  dk.copy_(splits > 1 ? dk_part.sum(0).mul_(k_factor) : dk_part[0].mul_(k_factor));
  dv.copy_(splits > 1 ? dv_part.sum(0) : dv_part[0]);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "FlashAttention-2 forward on CPU (writes out and lse)");
  m.def("backward", &backward, "FlashAttention-2 backward on CPU (writes dq, dk, dv and dmask)");
}
