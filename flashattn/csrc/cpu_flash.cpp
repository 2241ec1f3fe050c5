// FlashAttention-2 forward on CPU: one parallel region per call over (batch, head, query block); each task runs
// its whole key loop with its tiles in cache. The two matmuls of a tile go to the BLAS torch ships (at::mm_out,
// single-threaded inside the region); the online softmax is one fused pass over the tile, written so the compiler
// vectorizes it (exp2 as a branch-free polynomial). Built at first use by flashattn/backends/cpu_kernel.py.
//
// Layout: q (B, Nq, H, D), k (B, Nk, Hk, D), v (B, Nk, Hk, Dv), any strides with a unit last one; H % Hk == 0.
// Visible keys of row i: -left <= j - i - diagonal <= right (-1: unbounded), as flashattn's Band.
// fp16/bf16/fp32 compute in fp32; fp64 in fp64.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr double kLog2e = 1.4426950408889634;

// 2^x for x <= 0 (a score minus its row maximum), -inf -> 0; relative error below 3e-7. No calls or branches,
// so the loops that use it vectorize.
inline float exp2_neg(float x) {
  x = std::max(x, -126.0f);
  const float xi = std::floor(x);
  const float f = x - xi;
  float p = 1.8775767e-3f;
  p = p * f + 8.9893397e-3f;
  p = p * f + 5.5826318e-2f;
  p = p * f + 2.4015361e-1f;
  p = p * f + 6.9315308e-1f;
  p = p * f + 9.9999994e-1f;
  const int32_t bits = (static_cast<int32_t>(xi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline double exp2_neg(double x) { return std::exp2(x); }

struct Options {
  double scale;
  double softcap;
  int64_t left, right, diagonal;
  int64_t block_m, block_n;
};

// Columns [lo, hi) row i may see, clipped to [0, nk).
inline void visible_columns(const Options& o, int64_t i, int64_t nk, int64_t* lo, int64_t* hi) {
  *lo = o.left < 0 ? 0 : std::max<int64_t>(0, i + o.diagonal - o.left);
  *hi = o.right < 0 ? nk : std::min<int64_t>(nk, i + o.diagonal + o.right + 1);
}

template <typename acc_t>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& alibi,
            const Options& o, at::Tensor& out, at::Tensor& lse) {
  const int64_t B = q.size(0), NQ = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t NK = k.size(1), HK = k.size(2), DV = v.size(3), G = H / HK;
  const auto acc_opts = q.options().dtype(c10::CppTypeToScalarType<acc_t>::value);
  const bool same_type = q.scalar_type() == acc_opts.dtype().toScalarType();
  const int64_t BM = o.block_m, BN = o.block_n;
  const int64_t qblocks = (NQ + BM - 1) / BM;
  // Scores in log2 units: exp2(s * log2e - m) = exp(s - m / log2e). With softcap the scale is applied first.
  const acc_t q_scale = static_cast<acc_t>(o.softcap > 0 ? o.scale / o.softcap : o.scale * kLog2e);
  const acc_t cap = static_cast<acc_t>(o.softcap * kLog2e);
  const bool has_alibi = alibi.defined();
  const float* alibi_p = has_alibi ? alibi.data_ptr<float>() : nullptr;
  const int64_t alibi_b = has_alibi && alibi.size(0) > 1 ? alibi.stride(0) : 0;
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  acc_t* lse_p = lse.data_ptr<acc_t>();

  // Grad and inference modes are thread-local: the region's threads take the caller's (the tiles are buffers).
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, B * H * qblocks, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode inference_mode(inference);
    at::NoGradGuard no_grad;
    at::Tensor qb = at::empty({BM, D}, acc_opts), s = at::empty({BM, BN}, acc_opts);
    at::Tensor acc = at::empty({BM, DV}, acc_opts);
    at::Tensor kb = same_type ? at::Tensor() : at::empty({BN, D}, acc_opts);
    at::Tensor vb = same_type ? at::Tensor() : at::empty({BN, DV}, acc_opts);
    std::vector<acc_t> row_max(BM), row_sum(BM);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t qblk = t % qblocks, bh = t / qblocks, b = bh / H, h = bh % H, hk = h / G;
      const int64_t r0 = qblk * BM, rows = std::min(BM, NQ - r0);
      at::Tensor q_rows = q.select(0, b).select(1, h).narrow(0, r0, rows);  // (rows, D)
      at::Tensor qv = qb.narrow(0, 0, rows);
      qv.copy_(q_rows).mul_(q_scale);  // scale the (rows x D) block in acc_t, not the (rows x cols) tile
      acc.zero_();
      std::fill(row_max.begin(), row_max.end(), neg_inf);
      std::fill(row_sum.begin(), row_sum.end(), acc_t(0));
      const acc_t slope = has_alibi ? static_cast<acc_t>(alibi_p[b * alibi_b + h] * kLog2e) : acc_t(0);
      int64_t lo, hi, lo_last, hi_last;
      visible_columns(o, r0, NK, &lo, &hi);
      visible_columns(o, r0 + rows - 1, NK, &lo_last, &hi_last);
      hi = std::max(hi, hi_last);
      const int64_t start = (lo / BN) * BN;
      acc_t* acc_p = acc.data_ptr<acc_t>();
      at::Tensor acc_v = acc.narrow(0, 0, rows);
      for (int64_t c0 = start; c0 < hi; c0 += BN) {
        const int64_t cols = std::min(BN, NK - c0);
        at::Tensor k_tile = k.select(0, b).select(1, hk).narrow(0, c0, cols);  // (cols, D)
        at::Tensor v_tile = v.select(0, b).select(1, hk).narrow(0, c0, cols);
        if (!same_type) {
          k_tile = kb.narrow(0, 0, cols).copy_(k_tile);
          v_tile = vb.narrow(0, 0, cols).copy_(v_tile);
        }
        at::Tensor s_v = s.narrow(0, 0, rows).narrow(1, 0, cols);
        at::mm_out(s_v, qv, k_tile.t());
        acc_t* s_p = s.data_ptr<acc_t>();
        for (int64_t i = 0; i < rows; ++i) {
          acc_t* si = s_p + i * BN;
          int64_t j0, j1;
          visible_columns(o, r0 + i, NK, &j0, &j1);
          j0 = std::clamp<int64_t>(j0 - c0, 0, cols);
          j1 = std::clamp<int64_t>(j1 - c0, j0, cols);
          if (o.softcap > 0) {
            for (int64_t j = j0; j < j1; ++j) si[j] = cap * std::tanh(si[j]);
          }
          if (has_alibi) {
            const int64_t at = r0 + i + o.diagonal - c0;  // ALiBi: -slope * |i + diagonal - j|
            for (int64_t j = j0; j < j1; ++j) si[j] -= slope * static_cast<acc_t>(std::abs(at - j));
          }
          acc_t m = row_max[i];
          for (int64_t j = j0; j < j1; ++j) m = std::max(m, si[j]);
          for (int64_t j = 0; j < j0; ++j) si[j] = 0;
          for (int64_t j = j1; j < cols; ++j) si[j] = 0;
          if (m == neg_inf) continue;  // nothing visible yet: P = 0 (zeroed above), acc stays 0
          const acc_t alpha = exp2_neg(row_max[i] - m);
          acc_t sum = 0;
          for (int64_t j = j0; j < j1; ++j) {
            si[j] = exp2_neg(si[j] - m);
            sum += si[j];
          }
          row_sum[i] = row_sum[i] * alpha + sum;
          row_max[i] = m;
          if (alpha != acc_t(1)) {
            acc_t* ai = acc_p + i * DV;
            for (int64_t d = 0; d < DV; ++d) ai[d] *= alpha;
          }
        }
        at::addmm_out(acc_v, acc_v, s_v, v_tile);
      }
      // Deferred normalisation; rows that saw no key give 0 and lse -inf.
      for (int64_t i = 0; i < rows; ++i) {
        const acc_t l = row_sum[i];
        const acc_t inv = l > 0 ? acc_t(1) / l : acc_t(0);
        acc_t* ai = acc_p + i * DV;
        for (int64_t d = 0; d < DV; ++d) ai[d] *= inv;
        const acc_t row_lse = static_cast<acc_t>((row_max[i] + std::log2(l)) / kLog2e);
        lse_p[(b * H + h) * NQ + r0 + i] = l > 0 ? row_lse : neg_inf;
      }
      out.select(0, b).select(1, h).narrow(0, r0, rows).copy_(acc_v);
    }
  });
}

}  // namespace

// out (B, Nq, H, Dv) in q's dtype and lse (B, H, Nq) (fp32, fp64 for fp64 inputs); window sides -1 = unbounded.
std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const c10::optional<at::Tensor>& alibi_slopes, double scale, double softcap,
                                int64_t window_left, int64_t window_right, int64_t diagonal, int64_t block_m,
                                int64_t block_n) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be (B, N, H, D)");
  at::NoGradGuard no_grad;  // a forward only: flashattn's op owns autograd (its tile matmuls write into buffers)
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "the head dim must be contiguous");
  TORCH_CHECK(q.size(2) % k.size(2) == 0, "query heads must be a multiple of key/value heads");
  const bool fp64 = q.scalar_type() == at::kDouble;
  const auto acc_type = fp64 ? at::kDouble : at::kFloat;
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
  at::Tensor lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(acc_type));
  at::Tensor alibi = alibi_slopes.has_value() ? alibi_slopes->to(at::kFloat).contiguous() : at::Tensor();
  const Options o{scale, softcap, window_left, window_right, diagonal, block_m, block_n};
  if (fp64) {
    attend<double>(q, k, v, alibi, o, out, lse);
  } else {
    attend<float>(q, k, v, alibi, o, out, lse);
  }
  return {out, lse};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("forward", &forward, "FlashAttention-2 forward on CPU"); }
