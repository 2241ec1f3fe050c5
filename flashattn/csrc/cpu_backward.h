// FlashAttention-2 backward on CPU, deterministic and without atomics. A task is (sequence, kv head, split): it
// owns dQ of its query rows (every head of the group) and its own partial dK/dV of the sequence's keys, reduced in
// a fixed order afterwards (one split unless there are fewer (sequence, kv head) pairs than threads). Per tile it
// recomputes P from the saved lse, then dV += P^T dO, dP = dO V^T, dS = P (dP - delta), dQ += dS K, dK += dS^T Q
// (the products in cpu_tiles.h).
#pragma once

#include "cpu_forward.h"

namespace flash_cpu {

// The backward's pass over a row: P = 2^(s - lse) (lse in log2 units, +inf for a row that saw no key: P = 0),
// then s = P z (dropped, for dV; z = nullptr: no dropout) and dp = P (dp z - delta) (dS before softcap's factor).
template <typename T>
inline void backward_row(T* s, T* dp, int64_t n, T lse, T delta, const T* z) {
  for (int64_t j = 0; j < n; ++j) {
    const T pj = exp2_neg(s[j] - lse);
    s[j] = z != nullptr ? pj * z[j] : pj;
    dp[j] = pj * ((z != nullptr ? dp[j] * z[j] : dp[j]) - delta);
  }
}

#if defined(__AVX512F__)
template <>
inline void backward_row<float>(float* s, float* dp, int64_t n, float lse, float delta, const float* z) {
  const __m512 shift = _mm512_set1_ps(-lse), d = _mm512_set1_ps(delta);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 keep = tail_mask(n - j);
    const __m512 pj = exp2_or_zero(_mm512_add_ps(_mm512_maskz_loadu_ps(keep, s + j), shift));
    __m512 g = _mm512_maskz_loadu_ps(keep, dp + j);
    __m512 kept = pj;
    if (z != nullptr) {
      const __m512 zj = _mm512_maskz_loadu_ps(keep, z + j);
      g = _mm512_mul_ps(g, zj);
      kept = _mm512_mul_ps(pj, zj);
    }
    _mm512_mask_storeu_ps(s + j, keep, kept);
    _mm512_mask_storeu_ps(dp + j, keep, _mm512_mul_ps(pj, _mm512_sub_ps(g, d)));
  }
}
#endif

template <typename Tiles>
struct BackwardScratch {
  using acc_t = typename Tiles::acc_t;
  Tiles tiles;
  Buffer<acc_t> tanh, dq, z, delta, lse;
  Buffer<int64_t> g, i;
  BackwardScratch(const Problem& p, Engine engine)
      : tiles(p, true, engine), tanh(p.softcap > 0 ? p.block_m * p.block_n : 0),
        dq(product_rows(p.block_m) * p.dim), z(p.block_n), delta(p.block_m), lse(p.block_m), g(p.block_m),
        i(p.block_m) {}
};

// What the backward reads and writes besides q, k, v. dK and dV: fp32 tiles on brgemm write them from their panels
// (dk times dk_factor); other tiles write partials (splits, B, Nk, Hk, D) in acc_t, zeroed, that the caller sums.
struct BackwardIo {
  const at::Tensor &out, &dout, &lse;
  const at::Tensor* dlse;  // or nullptr
  at::Tensor &dq, &dk, &dv, &dk_part, &dv_part;  // the partials: undefined where the tiles write dk and dv
  at::Tensor* dmask;  // (B, H, Nq, Nk) in acc_t, zeroed; or nullptr
};

template <typename Tiles>
void backward_kernel(const Problem& p, Engine engine, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const BackwardIo& io, int64_t splits) {
  using scalar_t = typename Tiles::scalar_t;
  using acc_t = typename Tiles::acc_t;
  const Rows<scalar_t> qr = rows_of<scalar_t>(q), kr = rows_of<scalar_t>(k), vr = rows_of<scalar_t>(v);
  const Rows<scalar_t> orows = rows_of<scalar_t>(io.out), dorows = rows_of<scalar_t>(io.dout);
  const Rows<scalar_t> dqrows = rows_of<scalar_t>(io.dq);
  const acc_t* lse_p = io.lse.data_ptr<acc_t>();
  const acc_t* dlse_p = io.dlse != nullptr ? io.dlse->data_ptr<acc_t>() : nullptr;
  const int64_t lse_b = io.lse.stride(0), lse_h = io.lse.stride(1);
  const int64_t dlse_b = io.dlse != nullptr ? io.dlse->stride(0) : 0, dlse_h = io.dlse != nullptr ? io.dlse->stride(1) : 0;
  const int64_t D = p.dim, DV = p.dim_v, BN = p.block_n;
  const auto stride = [](const at::Tensor& t, int64_t dim) { return t.defined() ? t.stride(dim) : 0; };
  const int64_t part_split = stride(io.dk_part, 0), part_b = stride(io.dk_part, 1), part_row = stride(io.dk_part, 2);
  const int64_t vpart_split = stride(io.dv_part, 0), vpart_b = stride(io.dv_part, 1);
  const int64_t vpart_row = stride(io.dv_part, 2);
  acc_t* dk_p = io.dk_part.defined() ? io.dk_part.data_ptr<acc_t>() : nullptr;
  acc_t* dv_p = io.dv_part.defined() ? io.dv_part.data_ptr<acc_t>() : nullptr;
  acc_t* dmask_p = io.dmask != nullptr ? io.dmask->data_ptr<acc_t>() : nullptr;
  const int64_t nq_max = io.dmask != nullptr ? io.dmask->size(2) : 0, nk_max = io.dmask != nullptr ? io.dmask->size(3) : 0;
  const acc_t dq_factor = static_cast<acc_t>(p.scale);
  const acc_t l2e = static_cast<acc_t>(kLog2e), inf = std::numeric_limits<acc_t>::infinity();

  std::vector<Task> tasks;
  std::vector<int64_t> cost;
  {
    Buffer<int64_t> g(p.block_m), i(p.block_m);
    for (int64_t si = 0; si < static_cast<int64_t>(p.seqs.size()); ++si) {
      const Sequence& s = p.seqs[si];
      std::vector<int64_t> split_cost(splits, 0);
      for (int64_t blk = 0; blk < p.blocks(s); ++blk) {
        const int64_t n = p.block_rows(s, blk, g.data(), i.data());
        int64_t lo, hi;
        p.block_columns(s, i.data(), n, &lo, &hi);
        for (int64_t hk = 0; hk < p.kv_heads; ++hk) {
          split_cost[blk % splits] += n * std::max<int64_t>(p.visited_columns(si, hk * p.group + g[0], i[0], lo, hi), 1);
        }
      }
      for (int64_t hk = 0; hk < p.kv_heads; ++hk) {
        for (int64_t part = 0; part < splits; ++part) {
          tasks.push_back({si, hk, part});
          cost.push_back(split_cost[part]);
        }
      }
    }
  }
  using Scratch = BackwardScratch<Tiles>;
  PackedKeys<scalar_t> keys;  // 16-bit tiles: every tile's K^T, V^T and K packed once for all the query blocks
  if constexpr (Tiles::kPacksKeys) {
    if (PackedKeys<scalar_t>::worth_it(p)) keys = PackedKeys<scalar_t>(p, kr, vr, /*for_backward=*/true);
  }
  KeyPanels<scalar_t> panels;  // fp32 tiles on brgemm: K^T, V^T and the dK^T, dV^T accumulators (cpu_wide_tiles.h)
  if constexpr (Tiles::kRowMajor) panels = KeyPanels<scalar_t>(p, kr, vr, splits, /*for_backward=*/true);
  run_tasks(longest_first(cost), [&] { return Scratch(p, engine); }, [&](int64_t t, Scratch& sc) {
    const int64_t ld = sc.tiles.ld();
    const Task& task = tasks[t];
    const Sequence& s = p.seqs[task.seq];
    const int64_t hk = task.kv_head;
    int64_t* g = sc.g.data();
    int64_t* i = sc.i.data();
    acc_t* dk_seq = dk_p + task.part * part_split + s.kb * part_b + s.k0 * part_row + hk * D;
    acc_t* dv_seq = dv_p + task.part * vpart_split + s.kb * vpart_b + s.k0 * vpart_row + hk * DV;
    for (int64_t blk = task.part; blk < p.blocks(s); blk += splits) {
      const int64_t n = p.block_rows(s, blk, g, i);
      int64_t lo, hi;
      p.block_columns(s, i, n, &lo, &hi);
      sc.tiles.load_block(p, qr, dorows, s, hk, g, i, n);
      for (int64_t r = 0; r < n; ++r) {  // delta = rowsum(dO * O) - dlse; lse in log2 units, -inf -> +inf (P = 0)
        const int64_t h = hk * p.group + g[r];
        const scalar_t* o = query_row(p, orows, s, hk, g[r], i[r]);
        acc_t dot = 0;
        const scalar_t* dor = query_row(p, dorows, s, hk, g[r], i[r]);
        for (int64_t d = 0; d < DV; ++d) dot += static_cast<acc_t>(dor[d]) * static_cast<acc_t>(o[d]);
        const int64_t at = s.qb * lse_b + h * lse_h + s.q0 + i[r];  // lse and dlse may be views of longer rows
        sc.delta[r] = dot - (dlse_p != nullptr ? dlse_p[s.qb * dlse_b + h * dlse_h + s.q0 + i[r]] : acc_t(0));
        sc.lse[r] = lse_p[at] == -inf ? inf : lse_p[at] * l2e;
      }
      std::fill_n(sc.dq.data(), n * D, acc_t(0));
      const BlockRows rows{hk, 1, g, i, n};
      p.for_each_tile(task.seq, hk * p.group + g[0], i[0], lo, hi, [&](int64_t c0, const bool* tile) {
        const int64_t cols = std::min(BN, s.nk - c0);
        bool prepacked = false;
        if constexpr (Tiles::kRowMajor) {
          sc.tiles.panel_scores_and_dp(panels.kt(task.seq, hk, c0), panels.vt(task.seq, hk, c0),
                                       panels.k(task.seq, hk, c0), cols, n);
          prepacked = true;
        }
        if constexpr (Tiles::kPacksKeys) {
          if (!keys.empty()) {
            sc.tiles.prepacked_scores_and_dp(p, keys.kt(task.seq, hk, c0), keys.v(task.seq, hk, c0),
                                             keys.k(task.seq, hk, c0), cols, n);
            prepacked = true;
          }
        }
        if (!prepacked) {
          sc.tiles.scores_and_dp(p, KeyRows<scalar_t>::of(p, kr, task.seq, s, hk, c0),
                                 KeyRows<scalar_t>::of(p, vr, task.seq, s, hk, c0), cols, n);
        }
        for (int64_t r = 0; r < n; ++r) {
          const int64_t h = hk * p.group + g[r];
          acc_t* srow = sc.tiles.s_tile.data() + r * ld;
          acc_t* dprow = sc.tiles.dp_tile.data() + r * ld;
          acc_t* trow = p.softcap > 0 ? sc.tanh.data() + r * BN : nullptr;
          p.transform_row<acc_t>(task.seq, s, h, i[r], c0, cols, srow, trow, p.tile_row(tile, i[r]));
          // dV takes the dropped P (in s), dS the undropped one (in dp).
          if (p.dropout_p > 0) p.dropout_row<acc_t>(task.seq, h, i[r], c0, cols, sc.z.data());
          backward_row(srow, dprow, cols, sc.lse[r], sc.delta[r], p.dropout_p > 0 ? sc.z.data() : nullptr);
          if (dmask_p != nullptr) {  // an additive mask's gradient is dS itself
            acc_t* dm = dmask_p + ((task.seq * p.heads + h) * nq_max + i[r]) * nk_max + c0;
            std::copy(dprow, dprow + cols, dm);
          }
          if (trow != nullptr) {
            for (int64_t j = 0; j < cols; ++j) dprow[j] *= acc_t(1) - trow[j] * trow[j];
          }
        }
        if constexpr (Tiles::kRowMajor) {
          sc.tiles.add_panel_gradients(cols, n, sc.dq.data(), panels.dkt(task.part, task.seq, hk, c0),
                                       panels.dvt(task.part, task.seq, hk, c0));
        } else {
          sc.tiles.add_gradients(cols, n, sc.dq.data(), dk_seq + c0 * part_row, part_row, dv_seq + c0 * vpart_row,
                                 vpart_row);
        }
      }, &rows);
      for (int64_t r = 0; r < n; ++r) {
        scalar_t* dst = const_cast<scalar_t*>(query_row(p, dqrows, s, hk, g[r], i[r]));
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(sc.dq[r * D + d] * dq_factor);
      }
    }
  });
  if constexpr (Tiles::kRowMajor) panels.write_back(p, splits, Tiles::dk_factor(p), io.dk, io.dv);
}

}  // namespace flash_cpu
