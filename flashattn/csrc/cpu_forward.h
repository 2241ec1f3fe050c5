// FlashAttention-2 forward on CPU. A task is (sequence, kv head, block of query rows); it runs its whole key loop
// with its tiles in cache: S = Q K^T (cpu_tiles.h: fp32 tiles on the BLAS, or 16-bit tiles on the dot-product
// instructions, the K/V tile packed once per task and tile), the online softmax (and dropout) in one vectorised
// pass over the tile, O += P V, and one division per row at the end.
#pragma once

#include "cpu_tiles.h"

namespace flash_cpu {

template <typename Tiles>
struct ForwardScratch {
  using acc_t = typename Tiles::acc_t;
  Tiles tiles;
  Buffer<acc_t> acc, z, row_max, row_sum;
  Buffer<int64_t> g, i;
  ForwardScratch(const Problem& p, Engine engine)
      : tiles(p, false, engine), acc(product_rows(p.block_m) * p.dim_v), z(p.block_n), row_max(p.block_m),
        row_sum(p.block_m), g(p.block_m), i(p.block_m) {}
};

// Unit of work of the forward and of the backward's dK/dV: (sequence, kv head, block or split).
struct Task {
  int64_t seq, kv_head, part;
};

// out (B, Nq, H, Dv) in q's dtype; lse (B, H, Nq) in acc_t (rows that see no key: out 0, lse -inf).
template <typename Tiles>
void forward_kernel(const Problem& p, Engine engine, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    at::Tensor& out, at::Tensor& lse) {
  using scalar_t = typename Tiles::scalar_t;
  using acc_t = typename Tiles::acc_t;
  const Rows<scalar_t> qr = rows_of<scalar_t>(q), kr = rows_of<scalar_t>(k), vr = rows_of<scalar_t>(v);
  const Rows<scalar_t> orows = rows_of<scalar_t>(out);
  acc_t* lse_p = lse.data_ptr<acc_t>();
  const int64_t lse_b = lse.stride(0), lse_h = lse.stride(1);
  const int64_t DV = p.dim_v, BN = p.block_n;
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();

  std::vector<Task> tasks;
  std::vector<int64_t> cost;
  {
    Buffer<int64_t> g(p.block_m), i(p.block_m);
    for (int64_t si = 0; si < static_cast<int64_t>(p.seqs.size()); ++si) {
      const Sequence& s = p.seqs[si];
      for (int64_t blk = 0; blk < p.blocks(s); ++blk) {
        const int64_t n = p.block_rows(s, blk, g.data(), i.data());
        int64_t lo, hi;
        p.block_columns(s, i.data(), n, &lo, &hi);
        for (int64_t hk = 0; hk < p.kv_heads; ++hk) {
          tasks.push_back({si, hk, blk});
          cost.push_back(n * std::max<int64_t>(p.visited_columns(si, hk * p.group + g[0], i[0], lo, hi), 1));
        }
      }
    }
  }
  using Scratch = ForwardScratch<Tiles>;
  run_tasks(longest_first(cost), [&] { return Scratch(p, engine); }, [&](int64_t t, Scratch& sc) {
    const Task& task = tasks[t];
    const Sequence& s = p.seqs[task.seq];
    const int64_t hk = task.kv_head;
    int64_t* g = sc.g.data();
    int64_t* i = sc.i.data();
    const int64_t n = p.block_rows(s, task.part, g, i);
    int64_t lo, hi;
    p.block_columns(s, i, n, &lo, &hi);
    sc.tiles.load_queries(p, qr, s, hk, g, i, n);
    std::fill_n(sc.acc.data(), n * DV, acc_t(0));
    std::fill_n(sc.row_max.data(), n, neg_inf);
    std::fill_n(sc.row_sum.data(), n, acc_t(0));
    const int64_t ld = sc.tiles.ld();
    p.for_each_tile(task.seq, hk * p.group + g[0], i[0], lo, hi, [&](int64_t c0, const bool* tile) {
      const int64_t cols = std::min(BN, s.nk - c0);
      acc_t* scores = sc.tiles.scores(p, kr, task.seq, s, hk, c0, cols, n);
      for (int64_t r = 0; r < n; ++r) {
        acc_t* srow = scores + r * ld;
        const int64_t h = hk * p.group + g[r];
        p.transform_row<acc_t>(task.seq, s, h, i[r], c0, cols, srow, nullptr, p.tile_row(tile, i[r]));
        const acc_t m = max_of(srow, cols, sc.row_max[r]);
        if (m == neg_inf) {  // nothing visible yet: P = 0, acc stays 0
          std::fill(srow, srow + cols, acc_t(0));
          continue;
        }
        const acc_t alpha = exp2_neg(sc.row_max[r] - m);
        const acc_t sum = exp2_shift_sum(srow, cols, m);
        // The denominator sums the undropped weights: dropout acts on normalised probabilities.
        sc.row_sum[r] = sc.row_sum[r] * alpha + sum;
        sc.row_max[r] = m;
        if (p.dropout_p > 0) {
          p.dropout_row<acc_t>(task.seq, h, i[r], c0, cols, sc.z.data());
          for (int64_t j = 0; j < cols; ++j) srow[j] *= sc.z[j];
        }
        if (alpha != acc_t(1)) {
          acc_t* ar = sc.acc.data() + r * DV;
          for (int64_t d = 0; d < DV; ++d) ar[d] *= alpha;
        }
      }
      sc.tiles.add_values(p, vr, task.seq, s, hk, c0, cols, n, sc.acc.data());
    });
    // Deferred normalisation: one division per row. A sink is one more score in the denominator, with no value.
    for (int64_t r = 0; r < n; ++r) {
      const int64_t h = hk * p.group + g[r];
      acc_t l = sc.row_sum[r], m = sc.row_max[r], kept = 1;
      if (!p.sink.empty()) {
        const acc_t sink = static_cast<acc_t>(p.sink[h] * kLog2e);
        const acc_t top = std::max(m, sink);
        if (top != neg_inf) {
          kept = std::exp2(m - top);
          l = l * kept + std::exp2(sink - top);
          m = top;
        }
      }
      const acc_t inv = l > 0 ? kept / l : acc_t(0);
      const acc_t* ar = sc.acc.data() + r * DV;
      scalar_t* dst = const_cast<scalar_t*>(orows.data) + s.qb * orows.batch_stride + (s.q0 + i[r]) * orows.row_stride +
                      h * orows.head_stride;
      for (int64_t d = 0; d < DV; ++d) dst[d] = static_cast<scalar_t>(ar[d] * inv);
      lse_p[s.qb * lse_b + h * lse_h + s.q0 + i[r]] =
          l > 0 ? static_cast<acc_t>((m + std::log2(l)) / kLog2e) : neg_inf;
    }
  });
}

}  // namespace flash_cpu
