// The wide tile products (cpu_tiles.h says what the policies are): every tile converted to fp32 (fp64 for fp64),
// on oneDNN's brgemm for fp32 full tiles in AVX-512 builds and the BLAS torch ships (sgemm/dgemm) elsewhere.
//
// brgemm reads row-major operands where they lie, where sgemm copies both operands of every call into its panels
// (15 % of the fp32 backward's time at d = 64), but it takes no transposed operand, and compiles a kernel for each
// shape and leading dimensions (0.3-0.7 ms each, a bounded cache per thread). So the backward reads K and V as
// column panels (KeyPanels: K^T and V^T, leading dimension block_n whatever N is, transposed once per call) and
// accumulates dK^T += Q^T dS and dV^T += dO^T P into panels of the same shape, written back to dK/dV rows at the
// end: no transpose inside the tile loop. Partial tiles take sgemm on the same layouts.
#pragma once

#include "cpu_tiles.h"

namespace flash_cpu {

#if defined(__AVX512F__)
// dst (16 x 16, leading dimension ldd) = src (16 x 16, lds)^T: pairs of rows interleaved, then pairs of pairs, then
// 128-bit lanes twice.
inline void transpose16(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + j + 4], 0xDD);
    }
  }
  for (int j = 0; j < 8; ++j) {
    _mm512_storeu_ps(dst + j * ldd, _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88));
    _mm512_storeu_ps(dst + (j + 8) * ldd, _mm512_shuffle_f32x4(t[j], t[j + 8], 0xDD));
  }
}
#endif

// dst (cols x rows, leading dimension ldd) = src (rows x cols, lds)^T: 16 x 16 blocks through registers on AVX-512
// (the fp32 backward's P^T and dS^T, a tile's K^T and V^T), the edges element by element.
template <typename T>
inline void transpose_tile(const T* src, int64_t lds, int64_t rows, int64_t cols, T* dst, int64_t ldd) {
  int64_t r0 = 0, c0 = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    for (r0 = 0; r0 + 16 <= rows; r0 += 16) {
      for (c0 = 0; c0 + 16 <= cols; c0 += 16) transpose16(src + r0 * lds + c0, lds, dst + c0 * ldd + r0, ldd);
    }
    c0 = cols - cols % 16;
  }
#endif
  for (int64_t r = 0; r < rows; ++r) {  // what the blocks left: the rows below them, and their right edge
    for (int64_t c = r < r0 ? c0 : 0; c < cols; ++c) dst[c * ldd + r] = src[r * lds + c];
  }
}

// Every key tile of every kv head as panels, for fp32 tiles on brgemm, packed once per call. Backward: K^T
// (D x BN) and V^T (DV x BN), K's rows again (BN x D: dQ = dS K reads them, and a power-of-two row stride in the
// tensor made brgemm 7 % slower than sgemm's own copy), and per split the tile's dK^T and dV^T (zeroed, then
// accumulated). Forward: K^T and V's rows (BN x DV), which sgemm copied again for every query block. Tiles start
// at multiples of block_n in their sequence (Problem::for_each_tile).
template <typename scalar_t>
struct KeyPanels {
  Workspace inputs, grads;  // reused between calls (cpu_common.h)
  std::vector<int64_t> first;  // per sequence: the index of its first tile
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (sequence, first key) of each tile
  int64_t kv_heads = 0, D = 0, DV = 0, BN = 1;
  bool backward = false;

  int64_t unit(int64_t seq, int64_t hk, int64_t c0) const { return (first[seq] + c0 / BN) * kv_heads + hk; }
  int64_t units() const { return static_cast<int64_t>(tiles.size()) * kv_heads; }
  int64_t input_size() const { return (backward ? 2 * D + DV : D + DV) * BN; }
  bool empty() const { return !inputs.defined(); }
  const float* kt(int64_t seq, int64_t hk, int64_t c0) const {
    return inputs.as<float>() + unit(seq, hk, c0) * input_size();
  }
  const float* v(int64_t seq, int64_t hk, int64_t c0) const { return kt(seq, hk, c0) + D * BN; }  // forward
  const float* vt(int64_t seq, int64_t hk, int64_t c0) const { return kt(seq, hk, c0) + D * BN; }  // backward
  const float* k(int64_t seq, int64_t hk, int64_t c0) const { return vt(seq, hk, c0) + DV * BN; }
  float* dkt(int64_t part, int64_t seq, int64_t hk, int64_t c0) const {
    return grads.as<float>() + (part * units() + unit(seq, hk, c0)) * (D + DV) * BN;
  }
  float* dvt(int64_t part, int64_t seq, int64_t hk, int64_t c0) const { return dkt(part, seq, hk, c0) + D * BN; }

  KeyPanels(const Problem& p, const Rows<scalar_t>& kr, const Rows<scalar_t>& vr, int64_t splits, bool for_backward)
      : kv_heads(p.kv_heads), D(p.dim), DV(p.dim_v), BN(p.block_n), backward(for_backward) {
    for (int64_t si = 0; si < static_cast<int64_t>(p.seqs.size()); ++si) {
      first.push_back(static_cast<int64_t>(tiles.size()));
      for (int64_t c0 = 0; c0 < p.seqs[si].nk; c0 += BN) tiles.emplace_back(si, c0);
    }
    inputs = Workspace(units() * input_size() * static_cast<int64_t>(sizeof(float)));
    if (backward) grads = Workspace(splits * units() * (D + DV) * BN * static_cast<int64_t>(sizeof(float)));
    at::parallel_for(0, units(), 1, [&](int64_t begin, int64_t end) {
      Buffer<float> rows(BN * std::max(D, DV));  // converted rows, where the inputs are not fp32 already
      for (int64_t u = begin; u < end; ++u) {
        const auto [si, c0] = tiles[u / kv_heads];
        const int64_t hk = u % kv_heads, cols = std::min(BN, p.seqs[si].nk - c0);
        float* out = inputs.as<float>() + u * input_size();
        for (int64_t part = 0; backward && part < splits; ++part) {  // the accumulators start at zero
          std::fill_n(grads.as<float>() + (part * units() + u) * (D + DV) * BN, (D + DV) * BN, 0.0f);
        }
        int64_t ld;
        const float* k = key_tile(KeyRows<scalar_t>::of(p, kr, si, p.seqs[si], hk, c0), cols, D, rows.data(), &ld);
        transpose_tile(k, ld, cols, D, out, BN);
        if (backward) {
          for (int64_t j = 0; j < cols; ++j) std::copy(k + j * ld, k + j * ld + D, out + (D + DV) * BN + j * D);
        }
        const float* v = key_tile(KeyRows<scalar_t>::of(p, vr, si, p.seqs[si], hk, c0), cols, DV, rows.data(), &ld);
        if (backward) {
          transpose_tile(v, ld, cols, DV, out + D * BN, BN);
        } else {
          for (int64_t j = 0; j < cols; ++j) std::copy(v + j * ld, v + j * ld + DV, out + D * BN + j * DV);
        }
      }
    });
  }
  KeyPanels() = default;

  // dK (times k_factor) and dV rows of their tiles, in their dtype (B, Nk, Hk, D) from the panels' splits.
  void write_back(const Problem& p, int64_t splits, double k_factor, at::Tensor& dk, at::Tensor& dv) const {
    at::parallel_for(0, units(), 1, [&](int64_t begin, int64_t end) {
      Buffer<float> rows(BN * std::max(D, DV));  // transposed, where the gradients are not fp32
      for (int64_t u = begin; u < end; ++u) {
        const auto [si, c0] = tiles[u / kv_heads];
        const Sequence& s = p.seqs[si];
        const int64_t hk = u % kv_heads, cols = std::min(BN, s.nk - c0);
        float* sum = grads.as<float>() + u * (D + DV) * BN;
        for (int64_t part = 1; part < splits; ++part) {
          const float* other = sum + part * units() * (D + DV) * BN;
          for (int64_t e = 0; e < (D + DV) * BN; ++e) sum[e] += other[e];
        }
        for (int64_t e = 0; e < D * BN; ++e) sum[e] *= static_cast<float>(k_factor);
        const auto write = [&](const float* panel, int64_t width, at::Tensor& grad) {
          scalar_t* dst = grad.data_ptr<scalar_t>() + s.kb * grad.stride(0) + (s.k0 + c0) * grad.stride(1) +
                          hk * grad.stride(2);
          if constexpr (std::is_same_v<scalar_t, float>) {
            transpose_tile(panel, BN, width, cols, dst, grad.stride(1));
          } else {
            transpose_tile(panel, BN, width, cols, rows.data(), width);
            for (int64_t j = 0; j < cols; ++j) {
              for (int64_t d = 0; d < width; ++d) dst[j * grad.stride(1) + d] = scalar_t(rows[j * width + d]);
            }
          }
        };
        write(sum, D, dk);
        write(sum + D * BN, DV, dv);
      }
    });
  }
};

template <typename scalar_t_, typename acc_t_>
struct WideTiles {
  using scalar_t = scalar_t_;
  using acc_t = acc_t_;
  // fp32 tiles on brgemm (cpu_common.h) where a call's tiles are read by several query blocks, from KeyPanels (a
  // K^T per query block, or V's rows read in place, cost more than sgemm's copies); the backward accumulates
  // dK^T and dV^T.
  static constexpr bool kRowMajor = kBrgemmF32 && std::is_same_v<acc_t, float>;
  int64_t D, DV, BM, BN, BNc;
  Buffer<acc_t> q, dout, s_tile, dp_tile, k, v, p_tile, q_trans, dout_trans;
  const acc_t *kt = nullptr, *vt = nullptr;  // the current tile's keys and values (in place or in k/v)
  int64_t ldk = 0, ldv = 0;

  std::vector<KeyRows<scalar_t>> head_keys, head_values;  // a multi-head task's tile, per head

  WideTiles(const Problem& p, bool backward, Engine, int64_t heads = 1)
      : D(p.dim), DV(p.dim_v), BM(p.block_m), BN(p.block_n), BNc(key_columns(p.block_n)), q(p.block_m * p.dim),
        dout(backward ? p.block_m * p.dim_v : 0), s_tile(p.block_m * p.block_n),
        dp_tile(backward ? p.block_m * p.block_n : 0), k(p.block_n * p.dim), v(p.block_n * p.dim_v),
        p_tile(backward || !kWritesProbs ? 0 : p.block_m * key_columns(p.block_n)),
        q_trans(kRowMajor && backward ? p.dim * BM : 0),
        dout_trans(kRowMajor && backward ? p.dim_v * BM : 0), head_keys(heads), head_values(heads) {}
  int64_t ld() const { return BN; }
  // The backward's dK accumulates dS^T (Q scaled into log2 units): back to the natural score's units.
  static double dk_factor(const Problem& p) { return p.softcap > 0 ? p.softcap : 1.0 / kLog2e; }
  bool full(int64_t cols, int64_t n) const { return kRowMajor && cols == BN && n == BM; }

  // Forward: the block's queries, scaled into log2 units (S needs no pass of its own).
  void load_queries(const Problem& p, const Rows<scalar_t>& qr, const Sequence& s, int64_t hk, const int64_t* g,
                    const int64_t* i, int64_t n) {
    load_rows(p, qr, s, hk, g, i, n, score_factor<acc_t>(p), q.data(), D, D);
  }
  // S (n x cols, leading dimension ld()) of the key tile `keys` (cols rows).
  acc_t* scores(const Problem&, const KeyRows<scalar_t>& keys, int64_t cols, int64_t n) {
    kt = key_tile(keys, cols, D, k.data(), &ldk);
    gemm<acc_t>(false, true, n, cols, D, q.data(), D, kt, ldk, acc_t(0), s_tile.data(), BN);
    return s_tile.data();
  }
  // acc (n x DV) += P V, P (n x cols, leading dimension ldp).
  void probs_times_values(const acc_t* probs, int64_t ldp, const KeyRows<scalar_t>& values, int64_t cols, int64_t n,
                          acc_t* acc) {
    vt = key_tile(values, cols, DV, v.data(), &ldv);
    gemm<acc_t>(false, false, n, DV, cols, probs, ldp, vt, ldv, acc_t(1), acc, DV);
  }
  // acc (n x DV) += P V, P (n x cols) in s_tile.
  void add_values(const Problem&, const KeyRows<scalar_t>& values, int64_t cols, int64_t n, acc_t* acc) {
    probs_times_values(s_tile.data(), BN, values, cols, n, acc);
  }

  // A multi-head task's tile: the BLAS reads each head's rows where they are.
  template <typename KeyFn, typename ValueFn>
  void pack_heads(int64_t heads, int64_t, const KeyFn& keys, const ValueFn& values) {
    for (int64_t h = 0; h < heads; ++h) head_keys[h] = keys(h), head_values[h] = values(h);
  }
  static constexpr bool kPacksFp8 = false;  // FP8 rows are widened before (cpu_forward.h)
  static constexpr bool kPacksKeys = false;  // PackedKeys is the 16-bit tiles' (KeyPanels: kRowMajor)
  // The forward's fused softmax pass (cpu_forward.h) writes fp32 P into p_tile (fp64 keeps its passes); the
  // scores come in log2 units already (Q is scaled as it is loaded).
#ifdef __AVX512F__
  static constexpr bool kWritesProbs = std::is_same_v<acc_t, float>;
#else  // the AVX2 build keeps at::vec's passes (the fused one is written for AVX-512)
  static constexpr bool kWritesProbs = false;
#endif
  acc_t* probs(int64_t r) { return p_tile.data() + r * BNc; }
  void add_probs_values(const KeyRows<scalar_t>& values, int64_t cols, int64_t n, acc_t* acc) {
    probs_times_values(p_tile.data(), BNc, values, cols, n, acc);
  }
  void add_packed_probs_values(int64_t h, int64_t cols, int64_t n, acc_t* acc) {
    add_probs_values(head_values[h], cols, n, acc);
  }
  acc_t* packed_scores(const Problem& p, int64_t h, int64_t cols, int64_t n) {
    return scores(p, head_keys[h], cols, n);
  }
  void add_packed_values(const Problem& p, int64_t h, int64_t cols, int64_t n, acc_t* acc) {
    add_values(p, head_values[h], cols, n, acc);
  }

  // Forward from the tile's panels (kRowMajor): S = Q K^T from K^T, acc (n x DV) += P V from V's rows and p_tile.
  acc_t* panel_scores(const float* k_trans, int64_t cols, int64_t n) {
    if (full(cols, n)) {
      brgemm_f32(n, cols, D, q.data(), D, k_trans, BN, false, s_tile.data(), BN);
    } else {
      gemm<acc_t>(false, false, n, cols, D, q.data(), D, k_trans, BN, acc_t(0), s_tile.data(), BN);
    }
    return s_tile.data();
  }
  void add_panel_probs_values(const float* v_rows, int64_t cols, int64_t n, acc_t* acc) {
    if (full(cols, n)) return brgemm_f32(n, DV, cols, p_tile.data(), BNc, v_rows, DV, true, acc, DV);
    gemm<acc_t>(false, false, n, DV, cols, p_tile.data(), BNc, v_rows, DV, acc_t(1), acc, DV);
  }

  // Backward: the block's queries (log2 units) and output gradients, transposed too on brgemm (for dK^T, dV^T).
  void load_block(const Problem& p, const Rows<scalar_t>& qr, const Rows<scalar_t>& dor, const Sequence& s,
                  int64_t hk, const int64_t* g, const int64_t* i, int64_t n) {
    load_queries(p, qr, s, hk, g, i, n);
    load_rows(p, dor, s, hk, g, i, n, acc_t(1), dout.data(), DV, DV);
    if constexpr (kRowMajor) {
      transpose_tile(q.data(), D, n, D, q_trans.data(), BM);
      transpose_tile(dout.data(), DV, n, DV, dout_trans.data(), BM);
    }
  }
  // S into s_tile and dP = dO V^T into dp_tile, both (n x cols) with leading dimension ld().
  void scores_and_dp(const Problem& p, const KeyRows<scalar_t>& keys, const KeyRows<scalar_t>& values, int64_t cols,
                     int64_t n) {
    scores(p, keys, cols, n);
    vt = key_tile(values, cols, DV, v.data(), &ldv);
    gemm<acc_t>(false, true, n, cols, DV, dout.data(), DV, vt, ldv, acc_t(0), dp_tile.data(), BN);
  }
  // The same from the tile's panels (kRowMajor): K^T and V^T (leading dimension BN), and K's rows for dQ.
  void panel_scores_and_dp(const float* k_trans, const float* v_trans, const float* k_rows, int64_t cols, int64_t n) {
    kt = k_rows, ldk = D;
    if (full(cols, n)) {
      brgemm_f32(n, cols, D, q.data(), D, k_trans, BN, false, s_tile.data(), BN);
      return brgemm_f32(n, cols, DV, dout.data(), DV, v_trans, BN, false, dp_tile.data(), BN);
    }
    gemm<acc_t>(false, false, n, cols, D, q.data(), D, k_trans, BN, acc_t(0), s_tile.data(), BN);
    gemm<acc_t>(false, false, n, cols, DV, dout.data(), DV, v_trans, BN, acc_t(0), dp_tile.data(), BN);
  }
  // With P (dropped) in s and dS in dp: dV += P^T dO, dQ += dS K, dK += dS^T Q (dk and dv: rows, ld_dk and ld_dv
  // apart).
  void add_gradients(int64_t cols, int64_t n, acc_t* dq, acc_t* dk, int64_t ld_dk, acc_t* dv, int64_t ld_dv) {
    gemm<acc_t>(true, false, cols, DV, n, s_tile.data(), BN, dout.data(), DV, acc_t(1), dv, ld_dv);
    gemm<acc_t>(false, false, n, D, cols, dp_tile.data(), BN, kt, ldk, acc_t(1), dq, D);
    gemm<acc_t>(true, false, cols, D, n, dp_tile.data(), BN, q.data(), D, acc_t(1), dk, ld_dk);
  }
  // The same into the tile's gradient panels (kRowMajor): dV^T += dO^T P, dK^T += Q^T dS (leading dimension BN).
  void add_panel_gradients(int64_t cols, int64_t n, float* dq, float* dk_trans, float* dv_trans) {
    if (full(cols, n)) {
      brgemm_f32(DV, cols, n, dout_trans.data(), BM, s_tile.data(), BN, true, dv_trans, BN);
      brgemm_f32(n, D, cols, dp_tile.data(), BN, kt, ldk, true, dq, D);
      return brgemm_f32(D, cols, n, q_trans.data(), BM, dp_tile.data(), BN, true, dk_trans, BN);
    }
    gemm<acc_t>(false, false, DV, cols, n, dout_trans.data(), BM, s_tile.data(), BN, acc_t(1), dv_trans, BN);
    gemm<acc_t>(false, false, n, D, cols, dp_tile.data(), BN, kt, ldk, acc_t(1), dq, D);
    gemm<acc_t>(false, false, D, cols, n, q_trans.data(), BM, dp_tile.data(), BN, acc_t(1), dk_trans, BN);
  }
};

}  // namespace flash_cpu
