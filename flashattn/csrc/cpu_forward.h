// FlashAttention-2 forward on CPU. A task is a block of query rows of one sequence, for one kv head or, when the
// queries are short (decode), for every kv head at once and a piece of the key range: each task runs its key loop
// with its tiles in cache: S = Q K^T (cpu_tiles.h: fp32 tiles on the BLAS, or 16-bit tiles on the dot-product
// instructions, the K/V tile packed once per task and tile), the online softmax (and dropout) in one vectorised
// pass over the tile, O += P V, and one division per row at the end. Pieces of a split key range are merged
// through their (max, sum) afterwards.
#pragma once

#include "cpu_forward_tasks.h"

namespace flash_cpu {

// out (B, Nq, H, Dv) in q's dtype; lse (B, H, Nq) in acc_t (rows that see no key: out 0, lse -inf). kv_t: the
// keys' and values' element type, q's, or uint8_t for FP8 ones (p.kv_format), widened tile by tile.
template <typename Tiles, typename kv_t = typename Tiles::scalar_t>
void forward_kernel(const Problem& p, Engine engine, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    at::Tensor& out, at::Tensor& lse) {
  using scalar_t = typename Tiles::scalar_t;
  using acc_t = typename Tiles::acc_t;
  constexpr bool kWiden = !std::is_same_v<kv_t, scalar_t>;
  const Rows<scalar_t> qr = rows_of<scalar_t>(q);
  const Rows<kv_t> kr = rows_of<kv_t>(k), vr = rows_of<kv_t>(v);
  const Rows<scalar_t> orows = rows_of<scalar_t>(out);
  acc_t* lse_p = lse.data_ptr<acc_t>();
  const int64_t lse_b = lse.stride(0), lse_h = lse.stride(1);
  const int64_t DV = p.dim_v, BN = p.block_n, MR = product_rows(p.block_m);
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  const ForwardPlan plan(p, at::get_num_threads(), sizeof(scalar_t));

  std::vector<ForwardTask> tasks;
  std::vector<int64_t> cost;
  {
    Buffer<int64_t> g(p.block_m), i(p.block_m);
    for (int64_t si = 0; si < static_cast<int64_t>(p.seqs.size()); ++si) {
      const Sequence& s = p.seqs[si];
      for (int64_t blk = 0; blk < p.blocks(s); ++blk) {
        const int64_t n = p.block_rows(s, blk, g.data(), i.data());
        int64_t lo, hi;
        p.block_columns(s, i.data(), n, &lo, &hi);
        for (int64_t hk = 0; hk < p.kv_heads; hk += plan.heads) {
          const int64_t heads = std::min(plan.heads, p.kv_heads - hk);
          for (int64_t piece = 0; piece < plan.pieces; ++piece) {
            const int64_t a = plan.pieces > 1 ? std::max(lo, piece * plan.piece_len) : lo;
            const int64_t b = plan.pieces > 1 ? std::min(hi, (piece + 1) * plan.piece_len) : hi;
            tasks.push_back({si, blk, hk, heads, a, std::max(a, b), plan.pieces > 1 ? piece : -1});
            const int64_t columns = a < b ? p.visited_columns(si, hk * p.group + g[0], i[0], a, b) : 0;
            cost.push_back(heads * n * std::max<int64_t>(columns, 1));
          }
        }
      }
    }
  }
  // Partial results of split key ranges: per (sequence, piece, head, row) the unnormalised output, max and sum.
  int64_t nq_max = 1;
  for (const auto& s : p.seqs) nq_max = std::max(nq_max, s.nq);
  at::Tensor partial = plan.pieces > 1 ? at::empty({static_cast<int64_t>(p.seqs.size()), plan.pieces, p.heads, nq_max,
                                                    DV + 2}, lse.options())
                                       : at::Tensor();
  acc_t* partial_p = plan.pieces > 1 ? partial.data_ptr<acc_t>() : nullptr;
  const auto slot = [&](int64_t seq, int64_t piece, int64_t h, int64_t i) {
    return partial_p + (((seq * plan.pieces + piece) * p.heads + h) * nq_max + i) * (DV + 2);
  };
  // Row i of head h, done: out = acc / l (a sink is one more score in the denominator, with no value), lse.
  const auto finish_row = [&](const Sequence& s, int64_t h, int64_t i, const acc_t* ar, acc_t m, acc_t l) {
    acc_t kept = 1;
    if (!p.sink.empty()) {
      const acc_t sink = static_cast<acc_t>(p.sink[h] * kLog2e);
      const acc_t top = std::max(m, sink);
      if (top != neg_inf) {
        kept = std::exp2(m - top);
        l = l * kept + std::exp2(sink - top);
        m = top;
      }
    }
    const acc_t v_scale = p.v_descale == nullptr
                              ? acc_t(1)
                              : static_cast<acc_t>(p.v_descale[(&s - p.seqs.data()) * p.kv_heads + h / p.group]);
    // Dropout's 1 / (1 - p): the weights in acc are the kept ones as they are (KeepDraws). A NaN sum passes on to
    // the row (a dropped NaN weight left acc finite: the row must not read as one that saw no key).
    const acc_t inv = l > 0 ? kept * v_scale * static_cast<acc_t>(p.dropout_scale) / l : std::isnan(l) ? l : acc_t(0);
    scalar_t* dst = const_cast<scalar_t*>(orows.data) + s.qb * orows.batch_stride + (s.q0 + i) * orows.row_stride +
                    h * orows.head_stride;
    store_scaled_row(dst, ar, DV, inv);
    // A product, not a division in double: the division's latency after log2's was a third of finishing a row.
    lse_p[s.qb * lse_b + h * lse_h + s.q0 + i] = l > 0 ? (m + std::log2(l)) * static_cast<acc_t>(kLn2) : neg_inf;
  };

  using Scratch = ForwardScratch<Tiles>;
  PackedKeys<scalar_t> keys;  // a prefill's K^T and V tiles packed once (16-bit tiles, keys not widened)
  if constexpr (Tiles::kPacksKeys && !kWiden) {
    if (PackedKeys<scalar_t>::worth_it(p)) keys = PackedKeys<scalar_t>(p, kr, vr, /*for_backward=*/false);
  }
  // Scores nothing transforms (no softcap, ALiBi, mask or FP8 descale; a block mask's partial tiles are checked
  // per tile): the softmax pass of a row reads the raw q.k and writes 16-bit P at once (exp2_scaled_round).
  const bool plain_scores = p.softcap == 0 && p.alibi == nullptr && p.mask == nullptr && p.qk_descale == nullptr &&
                            score_factor<acc_t>(p) > 0;
  KeyPanels<scalar_t> panels;  // fp32 tiles on brgemm: a prefill's K^T and V rows once (cpu_wide_tiles.h)
  if constexpr (Tiles::kRowMajor && Tiles::kWritesProbs && !kWiden) {
    if (plain_scores && PackedKeys<scalar_t>::worth_it(p)) {
      panels = KeyPanels<scalar_t>(p, kr, vr, /*splits=*/0, /*for_backward=*/false);
    }
  }
  // The 16-bit tiles leave S raw for the pass to scale; fp32 tiles scaled Q as they loaded it.
  const acc_t factor = Tiles::kPacksKeys ? score_factor<acc_t>(p) : acc_t(1);
  // Row r of the tile (query row i, head h), fused: one pass, the weights against a reference (the reference is
  // what the sum and acc are relative to, so out = acc / sum holds whatever it is), kept unless their sum exceeds
  // 2^64: weights that large are still exact to their type's precision in fp32 and bf16 alike, far from overflow,
  // and the pass needs no maximum of its own. The reference: the row's maximum so far, or on its first visible
  // tile the largest of that tile's first kFirstScores scores (a pass over the whole row for its maximum cost a
  // quarter of the tile's passes at N=1k). Else (a jump or a NaN) two passes: the visible columns' maximum (the
  // factor is positive, so the raw maximum scales to the scaled one), then P and its sum, acc rescaled to it.
  constexpr acc_t kLargestSum = acc_t(18446744073709551616.0);  // 2^64
  constexpr int64_t kFirstScores = 16;
  constexpr bool kLanes = ForwardScratch<Tiles>::kLanes;
  const auto fused_row = [&](auto& sc, const Sequence& s, int64_t seq, const acc_t* srow, int64_t r, int64_t h,
                             int64_t i, int64_t c0, int64_t cols, acc_t* acc_row, acc_t* row_max, acc_t* row_sum,
                             float* lanes) {
    int64_t j0, j1;
    p.visible(s, i, &j0, &j1);
    j0 = std::clamp<int64_t>(j0 - c0, 0, cols);
    j1 = std::clamp<int64_t>(j1 - c0, j0, cols);
    auto* prow = sc.tiles.probs(r);
    using prob_t = std::remove_pointer_t<decltype(prow)>;
    const int64_t cols_c = key_columns(cols);
    KeepDraws keep;
    if (p.dropout_p > 0 && j0 < j1) {  // (a row that sees none of the tile draws nothing)
      keep = p.dropout_keep(seq, h, i, c0, cols, sc.draws.data()) + j0;
    }
    const acc_t reference = *row_max == neg_inf && j0 < j1
                                ? max_raw_checked(srow + j0, std::min<int64_t>(kFirstScores, j1 - j0)) * factor
                                : *row_max;
    if (reference > neg_inf) {  // (not NaN either)
      if constexpr (kLanes) {
        if (exp2_scaled_round_lanes(srow + j0, j1 - j0, factor, reference, keep, prow + j0, lanes)) {
          std::fill(prow, prow + j0, prob_t(0));
          std::fill(prow + j1, prow + cols_c, prob_t(0));
          *row_max = reference;
          return;
        }
      } else {
        const acc_t sum = exp2_scaled_round(srow + j0, j1 - j0, factor, reference, keep, prow + j0);
        if (sum <= kLargestSum) {  // (not NaN either)
          std::fill(prow, prow + j0, prob_t(0));
          std::fill(prow + j1, prow + cols_c, prob_t(0));
          *row_sum += sum;
          *row_max = reference;
          return;
        }
      }
    }
    if constexpr (kLanes) *row_sum += take_lanes(lanes);  // before it is rescaled
    const acc_t top = j0 < j1 ? max_raw_checked(srow + j0, j1 - j0) * factor : neg_inf;
    const acc_t m = std::isnan(top) ? top : std::max(*row_max, top);
    if (m == neg_inf) {  // nothing visible yet: P = 0, acc stays 0
      std::fill(prow, prow + cols_c, prob_t(0));
      return;
    }
    const acc_t alpha = m == *row_max ? acc_t(1) : exp2_neg(*row_max - m);
    std::fill(prow, prow + j0, prob_t(0));
    const acc_t sum = exp2_scaled_round(srow + j0, j1 - j0, factor, m, keep, prow + j0);
    std::fill(prow + j1, prow + cols_c, prob_t(0));
    *row_sum = *row_sum * alpha + sum;  // the undropped weights: dropout acts on normalised probabilities
    *row_max = m;
    if (alpha != acc_t(1)) {
      for (int64_t d = 0; d < DV; ++d) acc_row[d] *= alpha;
    }
  };
  // Rows [r0, r1) of a tile (scores at srows, ld apart). Where each of them sees the whole tile (`whole`: no
  // column to clamp or fill), a row is its draws (with dropout) and its pass alone, against its maximum so far or
  // on its first tile fused_row's reference: fused_row's per-row work (the visible columns, the fills; a fifth of
  // the pass at d = 64) skipped. A row whose weights pass the lanes' bound (or NaN) takes fused_row, which writes
  // it again.
  const auto fused_rows = [&](auto& sc, const Sequence& s, int64_t seq, const acc_t* srows, int64_t ld, int64_t r0,
                              int64_t r1, const int64_t* g, const int64_t* i, int64_t hk, int64_t c0, int64_t cols,
                              bool whole, acc_t* acc, acc_t* row_max, acc_t* row_sum, float* lanes) {
    const bool lean = kLanes && whole && cols == key_columns(cols);
    for (int64_t r = r0; r < r1; ++r) {
      const acc_t* srow = srows + r * ld;
      if (lean) {
        const acc_t m = row_max[r] == neg_inf ? max_raw_checked(srow, std::min(kFirstScores, cols)) * factor
                                              : row_max[r];
        const KeepDraws keep = p.dropout_p > 0 ? p.dropout_keep(seq, hk * p.group + g[r], i[r], c0, cols,
                                                                sc.draws.data())
                                               : KeepDraws{};
        if (m > neg_inf && exp2_scaled_round_lanes(srow, cols, factor, m, keep, sc.tiles.probs(r), lanes + 16 * r)) {
          row_max[r] = m;
          continue;
        }
      }
      fused_row(sc, s, seq, srow, r, hk * p.group + g[r], i[r], c0, cols, acc + r * DV, row_max + r, row_sum + r,
                lanes + 16 * r);
    }
  };
  run_tasks(longest_first(cost), [&] { return Scratch(p, engine, plan.heads); }, [&](int64_t t, Scratch& sc) {
    const ForwardTask& task = tasks[t];
    const Sequence& s = p.seqs[task.seq];
    int64_t* g = sc.g.data();
    int64_t* i = sc.i.data();
    const int64_t n = p.block_rows(s, task.block, g, i);
    std::fill_n(sc.acc.data(), task.heads * MR * DV, acc_t(0));
    std::fill_n(sc.row_max.data(), task.heads * p.block_m, neg_inf);
    std::fill_n(sc.row_sum.data(), task.heads * p.block_m, acc_t(0));
    if constexpr (kLanes) std::fill_n(sc.lanes.data(), task.heads * p.block_m * 16, 0.0f);
    if (task.heads == 1) sc.tiles.load_queries(p, qr, s, task.hk0, g, i, n);
    const int64_t ld = sc.tiles.ld();
    int64_t seen_lo = 0, seen_hi = s.nk;  // keys [seen_lo, seen_hi): seen by every row of the block
    for (int64_t r = 0; r < n && (p.left >= 0 || p.right >= 0); ++r) {
      int64_t j0, j1;
      p.visible(s, i[r], &j0, &j1);
      seen_lo = std::max(seen_lo, j0), seen_hi = std::min(seen_hi, j1);
    }
    const auto visit = [&](int64_t c0, const bool* tile) {
      const int64_t cols = std::min(BN, s.nk - c0);
      const bool whole = seen_lo <= c0 && c0 + cols <= seen_hi;
      // The tile's rows of each kv head of the task, as the tile products read them. FP8 rows are widened first,
      // row by row across the task's heads (adjacent in memory), asking for the rows ahead as the packings do.
      const auto rows_of_heads = [&](const Rows<kv_t>& rows, Buffer<scalar_t>& wide, int64_t width,
                                     std::vector<KeyRows<scalar_t>>& out_rows) {
        out_rows.clear();
        if constexpr (kWiden) {
          const KeyRows<kv_t> first = KeyRows<kv_t>::of(p, rows, task.seq, s, task.hk0, c0);
          for (int64_t r = 0; r < cols; ++r) {
            if (r + kAhead < cols) prefetch_rows(first, r + kAhead, 1, task.heads * width);
            for (int64_t slab = 0; slab < task.heads; ++slab) {
              const kv_t* src = first(r) + slab * (rows.head_stride);
              widen_fp8(src, wide.data() + (slab * BN + r) * width, width, p.kv_format);
            }
          }
          for (int64_t slab = 0; slab < task.heads; ++slab) {
            out_rows.push_back(KeyRows<scalar_t>::uniform(wide.data() + slab * BN * width, width));
          }
        } else {
          for (int64_t slab = 0; slab < task.heads; ++slab) {
            out_rows.push_back(KeyRows<scalar_t>::of(p, rows, task.seq, s, task.hk0 + slab, c0));
          }
        }
      };
      const bool prepacked = !keys.empty() && task.heads == 1;
      bool packed = prepacked;
      if constexpr (kWiden && Tiles::kPacksFp8) {  // FP8 rows widened by the packing itself: one pass
        if (task.heads > 1) {
          const auto rows_of = [&](const Rows<kv_t>& rows) {
            return [&](int64_t slab) { return KeyRows<kv_t>::of(p, rows, task.seq, s, task.hk0 + slab, c0); };
          };
          sc.tiles.pack_fp8_heads(p.kv_format, task.heads, cols, rows_of(kr), rows_of(vr));
          packed = true;
        }
      }
      if (!packed) {
        rows_of_heads(kr, sc.wide_k, p.dim, sc.keys_of);
        rows_of_heads(vr, sc.wide_v, DV, sc.values_of);
        if (task.heads > 1) {  // every head's K and V of the tile packed first, the rows read in order
          sc.tiles.pack_heads(
              task.heads, cols, [&](int64_t slab) { return sc.keys_of[slab]; },
              [&](int64_t slab) { return sc.values_of[slab]; });
        }
      }
      for (int64_t slab = 0; slab < task.heads; ++slab) {
        const int64_t hk = task.hk0 + slab;
        acc_t *acc = sc.acc.data() + slab * MR * DV, *row_max = sc.row_max.data() + slab * p.block_m,
              *row_sum = sc.row_sum.data() + slab * p.block_m;
        float* lanes = sc.lanes.data() + (kLanes ? slab * p.block_m * 16 : 0);
        if (task.heads > 1) sc.tiles.load_queries(p, qr, s, hk, g, i, n);
        const bool fused = plain_scores && tile == nullptr;
        if constexpr (Tiles::kRowMajor && Tiles::kWritesProbs) {
          if (fused && !panels.empty() && task.heads == 1) {
            const acc_t* raw = sc.tiles.panel_scores(panels.kt(task.seq, hk, c0), cols, n);
            fused_rows(sc, s, task.seq, raw, ld, 0, n, g, i, hk, c0, cols, whole, acc, row_max, row_sum, lanes);
            sc.tiles.add_panel_probs_values(panels.v(task.seq, hk, c0), cols, n, acc);
            continue;
          }
        }
        acc_t* scores;
        if constexpr (Tiles::kPacksKeys) {
          if (prepacked && fused && !whole && trim_strips(p, s, c0, cols, n, i, sc.strips)) {
            const scalar_t* kt = keys.kt(task.seq, hk, c0);
            const scalar_t* v = keys.v(task.seq, hk, c0);
            for (const auto& [r0, r1, lo, hi] : sc.strips) {
              sc.tiles.strip_scores(kt, r0, r1 - r0, lo, hi);
              // The strip's rows as a tile of hi columns: P V reads no further, so their zeros stop there too.
              fused_rows(sc, s, task.seq, sc.tiles.s_tile.data(), ld, r0, r1, g, i, hk, c0, hi, false, acc,
                         row_max, row_sum, lanes);
            }
            sc.tiles.zero_probs_past(n, cols);
            for (const auto& [r0, r1, lo, hi] : sc.strips) sc.tiles.strip_probs_times(v, r0, r1 - r0, lo, hi, acc);
            continue;
          }
          if (prepacked) {
            scores = sc.tiles.product_scores(p, keys.kt(task.seq, hk, c0), cols, n, fused);
          } else {
            scores = task.heads > 1 ? sc.tiles.packed_scores(p, slab, cols, n, fused)
                                    : sc.tiles.scores(p, sc.keys_of[slab], cols, n, fused);
          }
        } else {
          scores = task.heads > 1 ? sc.tiles.packed_scores(p, slab, cols, n)
                                  : sc.tiles.scores(p, sc.keys_of[slab], cols, n);
        }
        const bool rows_fused = Tiles::kWritesProbs && fused;
        if constexpr (Tiles::kWritesProbs) {
          if (rows_fused) fused_rows(sc, s, task.seq, scores, ld, 0, n, g, i, hk, c0, cols, whole, acc, row_max,
                                     row_sum, lanes);
        }
        for (int64_t r = 0; r < n && !rows_fused; ++r) {  // rows the fused pass does not serve
          acc_t* srow = scores + r * ld;
          const int64_t h = hk * p.group + g[r];
          if constexpr (std::is_same_v<acc_t, float>) {  // FP8 inputs: before any transform (q.k's own scale)
            if (p.qk_descale != nullptr) scale_row(srow, cols, p.qk_descale[task.seq * p.kv_heads + hk]);
          }
          p.transform_row<acc_t>(task.seq, s, h, i[r], c0, cols, srow, nullptr, p.tile_row(tile, i[r]));
          const acc_t m = max_of(srow, cols, row_max[r]);
          if (m == neg_inf) {  // nothing visible yet: P = 0, acc stays 0
            std::fill(srow, srow + cols, acc_t(0));
            continue;
          }
          const acc_t alpha = exp2_neg(row_max[r] - m);
          const acc_t sum = exp2_shift_sum(srow, cols, m);
          // The denominator sums the undropped weights: dropout acts on normalised probabilities.
          if constexpr (kLanes) {  // a block mask's full tiles took the fused pass
            if (plain_scores) row_sum[r] += take_lanes(lanes + 16 * r);
          }
          row_sum[r] = row_sum[r] * alpha + sum;
          row_max[r] = m;
          if (p.dropout_p > 0) {
            const KeepDraws keep = p.dropout_keep(task.seq, h, i[r], c0, cols, sc.draws.data());
            for (int64_t j = 0; j < cols; ++j) srow[j] = keep.kept(j) ? srow[j] : acc_t(0);
          }
          if (alpha != acc_t(1)) {
            acc_t* ar = acc + r * DV;
            for (int64_t d = 0; d < DV; ++d) ar[d] *= alpha;
          }
        }
        if constexpr (Tiles::kPacksKeys) {
          if (prepacked) {
            sc.tiles.add_prepacked_values(keys.v(task.seq, hk, c0), cols, n, acc, fused);
            continue;
          }
        }
        if constexpr (Tiles::kWritesProbs) {
          if (fused) {
            if (task.heads > 1) {
              sc.tiles.add_packed_probs_values(slab, cols, n, acc);
            } else {
              sc.tiles.add_probs_values(sc.values_of[slab], cols, n, acc);
            }
            continue;
          }
        }
        if (task.heads > 1) {
          sc.tiles.add_packed_values(p, slab, cols, n, acc);
        } else {
          sc.tiles.add_values(p, sc.values_of[slab], cols, n, acc);
        }
      }
    };
    // An empty piece walks no tile (a walk starts at the tile holding lo, which the piece owning lo visits).
    const BlockRows rows{task.hk0, task.heads, g, i, n};
    if (task.lo < task.hi) p.for_each_tile(task.seq, task.hk0 * p.group + g[0], i[0], task.lo, task.hi, visit, &rows);
    for (int64_t slab = 0; slab < task.heads; ++slab) {
      const int64_t hk = task.hk0 + slab;
      for (int64_t r = 0; r < n; ++r) {
        const int64_t h = hk * p.group + g[r];
        const acc_t* ar = sc.acc.data() + (slab * MR + r) * DV;
        const acc_t m = sc.row_max[slab * p.block_m + r];
        acc_t l = sc.row_sum[slab * p.block_m + r];
        if constexpr (kLanes) l += take_lanes(sc.lanes.data() + (slab * p.block_m + r) * 16);
        if (task.piece < 0) {
          finish_row(s, h, i[r], ar, m, l);
        } else {
          acc_t* dst = slot(task.seq, task.piece, h, i[r]);
          std::copy(ar, ar + DV, dst);
          dst[DV] = m, dst[DV + 1] = l;
        }
      }
    }
  });
  if (plan.pieces == 1) return;
  // Merge the pieces: out = sum_c 2^(m_c - M) acc_c / sum_c 2^(m_c - M) l_c, M the largest m_c.
  const int64_t rows = static_cast<int64_t>(p.seqs.size()) * p.heads;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    const FlushSubnormals flush;
    std::vector<acc_t> acc(DV);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t seq = row / p.heads, h = row % p.heads;
      const Sequence& s = p.seqs[seq];
      for (int64_t i = 0; i < s.nq; ++i) {  // every row of the sequence: heads packed per block cover them all
        acc_t top = neg_inf, l = 0;
        for (int64_t c = 0; c < plan.pieces; ++c) top = std::max(top, slot(seq, c, h, i)[DV]);
        std::fill(acc.begin(), acc.end(), acc_t(0));
        for (int64_t c = 0; c < plan.pieces && top != neg_inf; ++c) {
          const acc_t* part = slot(seq, c, h, i);
          const acc_t w = exp2_neg(part[DV] - top);
          if (w == acc_t(0)) continue;
          for (int64_t d = 0; d < DV; ++d) acc[d] += w * part[d];
          l += w * part[DV + 1];
        }
        finish_row(s, h, i, acc.data(), top, l);
      }
    }
  });
}

}  // namespace flash_cpu
