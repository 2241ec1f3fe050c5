// The tile products of the CPU kernels, in two policies with one interface, so cpu_forward.h and cpu_backward.h
// hold the attention loop once:
//   WideTiles<scalar_t, acc_t> (cpu_wide_tiles.h): tiles converted to fp32 (fp64 for fp64), on oneDNN's brgemm and
//     the BLAS torch ships (sgemm/dgemm);
//   NativeTiles<scalar_t>: bf16/fp16 operands on the dot-product instructions (cpu_gemm16.h), fp32 accumulation,
//     with FlashAttention's GPU numerics: S = Q K^T from 16-bit operands, P rounded to 16 bits for P V; in the
//     backward dS rounded to 16 bits for dQ = dS K and dK = dS^T Q.
// Both hand the attention loop S in the kernels' log2 units (q.k * scale * log2e, or q.k * scale / softcap).
#pragma once

#include "cpu_common.h"
#include "cpu_gemm16.h"

#include <array>

namespace flash_cpu {

// The row of the query-side tensor (q, dO) of block row (query head g of kv head hk, position i).
template <typename scalar_t>
const scalar_t* query_row(const Problem& p, const Rows<scalar_t>& src, const Sequence& s, int64_t hk, int64_t g,
                          int64_t i) {
  return src.data + s.qb * src.batch_stride + (s.q0 + i) * src.row_stride + (hk * p.group + g) * src.head_stride;
}

// The block's rows of the query-side tensor, converted and scaled into dst (n x width, leading dimension ld).
template <typename scalar_t, typename acc_t>
void load_rows(const Problem& p, const Rows<scalar_t>& src, const Sequence& s, int64_t hk, const int64_t* g,
               const int64_t* i, int64_t n, acc_t factor, acc_t* dst, int64_t width, int64_t ld) {
  for (int64_t r = 0; r < n; ++r) {
    const scalar_t* row = query_row(p, src, s, hk, g[r], i[r]);
    for (int64_t d = 0; d < width; ++d) dst[r * ld + d] = static_cast<acc_t>(row[d]) * factor;
  }
}

// S's factor into log2 units.
template <typename acc_t>
acc_t score_factor(const Problem& p) {
  return static_cast<acc_t>(p.softcap > 0 ? p.scale / p.softcap : p.scale * kLog2e);
}

// ------------------------------------------------------------------------------------------------ packed keys
// Every key tile of every kv head in the 16-bit products' layouts, packed once before the tasks: the query blocks of
// a head (its query heads' blocks under GQA too) all read the same tiles, and each used to pack them again, 8 to 32
// times over at N = 4096. Forward: K^T (for Q K^T) and V (P V). Backward: K^T, V^T (dP = dO V^T) and K (dQ = dS K).
// Tiles start at multiples of block_n (Problem::for_each_tile).
template <typename scalar_t>
struct PackedKeys {
  Workspace storage;  // reused between calls (cpu_common.h)
  std::vector<int64_t> first;  // per sequence: the index of its first tile
  bool backward = false;
  int64_t kv_heads = 0, kt_size = 0, v_size = 0, k_size = 0, block_n = 1;

  bool empty() const { return !storage.defined(); }
  const scalar_t* kt(int64_t seq, int64_t hk, int64_t c0) const {
    return storage.as<scalar_t>() + ((first[seq] + c0 / block_n) * kv_heads + hk) * (kt_size + v_size + k_size);
  }
  const scalar_t* v(int64_t seq, int64_t hk, int64_t c0) const { return kt(seq, hk, c0) + kt_size; }  // V or V^T
  const scalar_t* k(int64_t seq, int64_t hk, int64_t c0) const { return v(seq, hk, c0) + v_size; }  // backward

  // Worth it where some sequence's tiles are read by two query blocks or more.
  static bool worth_it(const Problem& p) {
    if (p.short_queries()) return false;  // decode-like forward tasks pack several heads' tiles at once (pack_heads)
    for (const auto& s : p.seqs) {
      if (p.blocks(s) > 1) return true;
    }
    return false;
  }

  PackedKeys(const Problem& p, const Rows<scalar_t>& kr, const Rows<scalar_t>& vr, bool for_backward)
      : backward(for_backward), kv_heads(p.kv_heads), block_n(p.block_n) {
    const int64_t bnc = key_columns(p.block_n);
    kt_size = round_up(p.dim, 2) * bnc;
    v_size = backward ? round_up(p.dim_v, 2) * bnc : bnc * p.dim_v;
    k_size = backward ? bnc * p.dim : 0;
    std::vector<std::pair<int64_t, int64_t>> tiles;  // (sequence, first key) of each tile
    for (int64_t si = 0; si < static_cast<int64_t>(p.seqs.size()); ++si) {
      first.push_back(static_cast<int64_t>(tiles.size()));
      for (int64_t c0 = 0; c0 < p.seqs[si].nk; c0 += p.block_n) tiles.emplace_back(si, c0);
    }
    const int64_t units = static_cast<int64_t>(tiles.size()) * kv_heads, unit = kt_size + v_size + k_size;
    storage = Workspace(units * unit * static_cast<int64_t>(sizeof(scalar_t)));
    at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
      for (int64_t u = begin; u < end; ++u) {
        const auto [si, c0] = tiles[u / kv_heads];
        const int64_t hk = u % kv_heads;
        const Sequence& s = p.seqs[si];
        const int64_t cols = std::min(p.block_n, s.nk - c0);
        scalar_t* out = storage.as<scalar_t>() + u * unit;
        const auto keys = KeyRows<scalar_t>::of(p, kr, si, s, hk, c0);
        const auto values = KeyRows<scalar_t>::of(p, vr, si, s, hk, c0);
        pack_transposed(keys, cols, p.dim, out, bnc);
        if (backward) {
          pack_transposed(values, cols, p.dim_v, out + kt_size, bnc);
          pack_rows(keys, cols, 32, p.dim, out + kt_size + v_size, p.dim);
        } else {
          pack_rows(values, cols, 32, p.dim_v, out + kt_size, p.dim_v);
        }
      }
    });
  }
  PackedKeys() = default;
};

// A key tile of a block's rows cut into strips of kStripRows rows, each with the key columns [lo, hi) of the tile
// its rows see (multiples of kStripColumns: oneDNN compiles a kernel per shape), as (first row, end row, lo, hi):
// true where some strip sees less than the whole tile (causal's diagonal, a window's edges), the strips that see
// nothing left out (their rows' pass would change nothing). i: the rows' query positions.
constexpr int64_t kStripRows = 64, kStripColumns = 64;
inline bool trim_strips(const Problem& p, const Sequence& s, int64_t c0, int64_t cols, int64_t n, const int64_t* i,
                        std::vector<std::array<int64_t, 4>>& strips) {
  if (p.left < 0 && p.right < 0) return false;
  strips.clear();
  const int64_t cols_c = key_columns(cols);
  bool trimmed = false;
  for (int64_t r0 = 0; r0 < n; r0 += kStripRows) {
    const int64_t r1 = std::min(n, r0 + kStripRows);
    int64_t lo = cols, hi = 0;
    for (int64_t r = r0; r < r1; ++r) {
      int64_t j0, j1;
      p.visible(s, i[r], &j0, &j1);
      j0 = std::clamp<int64_t>(j0 - c0, 0, cols);
      j1 = std::clamp<int64_t>(j1 - c0, 0, cols);
      if (j0 < j1) lo = std::min(lo, j0), hi = std::max(hi, j1);
    }
    if (lo >= hi) {
      trimmed = true;
      continue;
    }
    lo = lo / kStripColumns * kStripColumns;
    hi = std::min(cols_c, round_up(hi, kStripColumns));
    trimmed = trimmed || lo > 0 || hi < cols_c;
    strips.push_back({r0, r1, lo, hi});
  }
  return trimmed;
}

// -------------------------------------------------------------------------------------------------- native tiles
// Operand layouts (element counts): the rows of a product are padded to product_rows(), key tiles to
// key_columns() (both zero-padded where a product reduces over them), head dims to even (VNNI pairs).
template <typename scalar_t_>
struct NativeTiles {
  using scalar_t = scalar_t_;
  using acc_t = float;
  Engine engine;
  int64_t D, Dp, DV, DVp, BNc, rows;
  Buffer<scalar_t> q, dout, kt, vt, kv, rounded, qv, dov, p_trans, ds_trans;
  Buffer<float> s_tile, dp_tile;
  Buffer<scalar_t> heads_kt, heads_vt;  // a multi-head task's packed K^T and V, one slab per head
  const scalar_t* key_rows = nullptr;  // the backward's current tile of K rows (in kv, or packed before the tasks)

  NativeTiles(const Problem& p, bool backward, Engine engine_, int64_t heads = 1)
      : engine(engine_), D(p.dim), Dp(round_up(p.dim, 2)), DV(p.dim_v), DVp(round_up(p.dim_v, 2)),
        BNc(key_columns(p.block_n)), rows(product_rows(p.block_m)),
        q(rows * Dp), dout(backward ? rows * DVp : 0), kt(Dp * BNc), vt(backward ? DVp * BNc : BNc * DV),
        kv(backward ? BNc * D : 0), rounded(rows * BNc), qv(backward ? key_columns(p.block_m) * D : 0),
        dov(backward ? key_columns(p.block_m) * DV : 0), p_trans(backward ? p.block_n * key_columns(p.block_m) : 0),
        ds_trans(backward ? p.block_n * key_columns(p.block_m) : 0), s_tile(rows * BNc),
        dp_tile(backward ? rows * BNc : 0), heads_kt(heads > 1 ? heads * Dp * BNc : 0),
        heads_vt(heads > 1 ? heads * BNc * DV : 0) {}
  ~NativeTiles() { release_engine(engine); }
  NativeTiles(NativeTiles&&) = default;
  int64_t ld() const { return BNc; }
  static double dk_factor(const Problem& p) { return p.scale; }

  // Rows [0, n) of the query-side tensor into dst (product_rows(n) x width_p): the pad column and rows zero.
  void copy_rows(const Problem& p, const Rows<scalar_t>& src, const Sequence& s, int64_t hk, const int64_t* g,
                 const int64_t* i, int64_t n, int64_t width, int64_t width_p, scalar_t* dst) const {
    for (int64_t r = 0; r < n; ++r) {
      std::memcpy(dst + r * width_p, query_row(p, src, s, hk, g[r], i[r]), width * sizeof(scalar_t));
      if (width_p > width) dst[r * width_p + width] = scalar_t(0);
    }
    std::fill(dst + n * width_p, dst + product_rows(n) * width_p, scalar_t(0));
  }

  void load_queries(const Problem& p, const Rows<scalar_t>& qr, const Sequence& s, int64_t hk, const int64_t* g,
                    const int64_t* i, int64_t n) {
    copy_rows(p, qr, s, hk, g, i, n, D, Dp, q.data());
  }

  // S = Q K^T, then scaled into log2 units over the tile's valid columns (raw: left unscaled, for the fused
  // softmax pass that scales, exponentiates and rounds P in one go: probs, add_probs_values).
  float* scores(const Problem& p, const KeyRows<scalar_t>& keys, int64_t cols, int64_t n, bool raw = false) {
    pack_transposed(keys, cols, D, kt.data(), BNc);
    return product_scores(p, kt.data(), cols, n, raw);
  }

  // The fused pass's P: row r of the 16-bit tile P V reads (columns up to key_columns(cols), zero past the
  // visible ones).
  static constexpr bool kPacksKeys = true;  // PackedKeys, and S left raw for the fused pass (scores' `raw`)
  static constexpr bool kRowMajor = false;  // (WideTiles' brgemm layouts)
  static constexpr bool kWritesProbs = true;
  scalar_t* probs(int64_t r) { return rounded.data() + r * BNc; }
  // acc += P V with P written through probs() (rows [0, n)).
  void add_probs_values(const KeyRows<scalar_t>& values, int64_t cols, int64_t n, float* acc) {
    pack_rows(values, cols, 32, DV, vt.data(), DV);
    probs_times(vt.data(), cols, n, acc);
  }
  void add_packed_probs_values(int64_t h, int64_t cols, int64_t n, float* acc) {
    probs_times(heads_vt.data() + h * BNc * DV, cols, n, acc);
  }

  void add_values(const Problem&, const KeyRows<scalar_t>& values, int64_t cols, int64_t n, float* acc) {
    pack_rows(values, cols, 32, DV, vt.data(), DV);
    product_values(vt.data(), cols, n, acc);
  }

  // A multi-head task's tile: every head's K^T and V packed, 16 rows at a time for all heads, so the rows are read
  // in order (decode's reads of the cache are its whole cost). `words` reads them (FP8 rows: pack_fp8_heads).
  template <typename KeyFn, typename ValueFn, typename Words = PlainWords>
  void pack_heads(int64_t heads, int64_t cols, const KeyFn& keys, const ValueFn& values, const Words& words = {}) {
    const int64_t cols_c = key_columns(cols);
    for (int64_t r0 = 0; r0 < cols; r0 += 16) {
      const int64_t count = std::min<int64_t>(16, cols - r0);
      prefetch_rows(keys(0), r0 + 16, std::min<int64_t>(16, cols - r0 - 16), heads * D);  // the next 16 rows
      prefetch_rows(values(0), r0 + 16, std::min<int64_t>(16, cols - r0 - 16), heads * DV);
      for (int64_t h = 0; h < heads; ++h) {
        const auto key = keys(h);
        const auto value = values(h);
        pack_transposed([&](int64_t r) { return key(r0 + r); }, count, D, heads_kt.data() + h * Dp * BNc + 2 * r0,
                        BNc, words);
        pack_rows([&](int64_t r) { return value(r0 + r); }, count, 2, DV, heads_vt.data() + h * BNc * DV + r0 * DV,
                  DV, words);
      }
    }
    const int64_t cols_e = round_up(cols, 2);
    for (int64_t h = 0; h < heads; ++h) {  // the padded keys of P V: zero values
      std::fill(heads_vt.data() + h * BNc * DV + cols_e * DV, heads_vt.data() + h * BNc * DV + cols_c * DV,
                scalar_t(0));
    }
  }
#if defined(FLASHATTN_PACK_AVX512) && defined(FLASHATTN_FP8_TABLE)
  // FP8 rows (KeyRows<uint8_t>) widened inside the packing, in registers: one pass over the cache's tile.
  static constexpr bool kPacksFp8 = true;
  template <typename KeyFn, typename ValueFn>
  void pack_fp8_heads(KvFormat format, int64_t heads, int64_t cols, const KeyFn& keys, const ValueFn& values) {
    if (format == KvFormat::e4m3fn) {
      pack_heads(heads, cols, keys, values, WidenedWords<KvFormat::e4m3fn, scalar_t>{});
    } else {
      pack_heads(heads, cols, keys, values, WidenedWords<KvFormat::e5m2, scalar_t>{});
    }
  }
#else
  static constexpr bool kPacksFp8 = false;
#endif
  float* packed_scores(const Problem& p, int64_t h, int64_t cols, int64_t n, bool raw = false) {
    return product_scores(p, heads_kt.data() + h * Dp * BNc, cols, n, raw);
  }
  void add_packed_values(const Problem&, int64_t h, int64_t cols, int64_t n, float* acc) {
    product_values(heads_vt.data() + h * BNc * DV, cols, n, acc);
  }

  // S = Q K^T from a packed K^T (ld BNc; one packed before the tasks: PackedKeys), scaled into log2 units over the
  // valid columns unless raw.
  float* product_scores(const Problem& p, const scalar_t* packed_kt, int64_t cols, int64_t n, bool raw) {
    gemm16(engine, product_rows(n), key_columns(cols), Dp, q.data(), Dp, packed_kt, BNc, s_tile.data(), BNc, false);
    if (!raw) scale_rows(s_tile.data(), n, cols, BNc, score_factor<float>(p));
    return s_tile.data();
  }
  // The same two products for rows [r0, r0 + m) of the block and key columns [lo, hi) of the tile alone (lo and
  // hi multiples of 32, hi at most key_columns(cols)): a strip of rows that sees only part of the tile (causal's
  // diagonal, a window's edges) multiplies only that part. The rows past the block's n are zero in q (copy_rows)
  // and must be in P (zero_probs_past).
  void strip_scores(const scalar_t* packed_kt, int64_t r0, int64_t m, int64_t lo, int64_t hi) {
    gemm16(engine, product_rows(m), hi - lo, Dp, q.data() + r0 * Dp, Dp, packed_kt + 2 * lo, BNc,
           s_tile.data() + r0 * BNc + lo, BNc, false);
  }
  void strip_probs_times(const scalar_t* packed_v, int64_t r0, int64_t m, int64_t lo, int64_t hi, float* acc) {
    gemm16(engine, product_rows(m), DV, hi - lo, rounded.data() + r0 * BNc + lo, BNc, packed_v + lo * DV, DV,
           acc + r0 * DV, DV, true);
  }
  void zero_probs_past(int64_t n, int64_t cols) {
    for (int64_t r = n; r < product_rows(n); ++r) std::fill(probs(r), probs(r) + key_columns(cols), scalar_t(0));
  }
  // acc += P V from a V packed before the tasks, P from the scores (rounded here) or written through probs().
  void add_prepacked_values(const scalar_t* packed_v, int64_t cols, int64_t n, float* acc, bool fused) {
    if (fused) {
      probs_times(packed_v, cols, n, acc);
    } else {
      product_values(packed_v, cols, n, acc);
    }
  }

  void load_block(const Problem& p, const Rows<scalar_t>& qr, const Rows<scalar_t>& dor, const Sequence& s,
                  int64_t hk, const int64_t* g, const int64_t* i, int64_t n) {
    copy_rows(p, qr, s, hk, g, i, n, D, Dp, q.data());
    copy_rows(p, dor, s, hk, g, i, n, DV, DVp, dout.data());
    pack_rows([&](int64_t r) { return q.data() + r * Dp; }, n, 32, D, qv.data(), D);
    pack_rows([&](int64_t r) { return dout.data() + r * DVp; }, n, 32, DV, dov.data(), DV);
  }

  void scores_and_dp(const Problem& p, const KeyRows<scalar_t>& keys, const KeyRows<scalar_t>& values, int64_t cols,
                     int64_t n) {
    pack_transposed(keys, cols, D, kt.data(), BNc);
    pack_transposed(values, cols, DV, vt.data(), BNc);
    pack_rows(keys, cols, 32, D, kv.data(), D);
    prepacked_scores_and_dp(p, kt.data(), vt.data(), kv.data(), cols, n);
  }
  // The same from a tile packed before the tasks (PackedKeys for the backward): K^T, V^T and K rows.
  void prepacked_scores_and_dp(const Problem& p, const scalar_t* packed_kt, const scalar_t* packed_vt,
                               const scalar_t* packed_k, int64_t cols, int64_t n) {
    product_scores(p, packed_kt, cols, n, false);
    gemm16(engine, product_rows(n), key_columns(cols), DVp, dout.data(), DVp, packed_vt, BNc, dp_tile.data(), BNc,
           false);
    key_rows = packed_k;
  }

  void add_gradients(int64_t cols, int64_t n, float* dq, float* dk, int64_t ld_dk, float* dv, int64_t ld_dv) {
    const int64_t rows_n = product_rows(n), cols_c = key_columns(cols), n_c = key_columns(n);
    round_transposed(s_tile.data(), BNc, n, n_c, cols, p_trans.data());
    round_transposed(dp_tile.data(), BNc, n, n_c, cols, ds_trans.data());
    round_rows(dp_tile.data(), n, rows_n, cols, cols_c, rounded.data());
    gemm16(engine, cols, DV, n_c, p_trans.data(), n_c, dov.data(), DV, dv, ld_dv, true);
    gemm16(engine, rows_n, D, cols_c, rounded.data(), BNc, key_rows, D, dq, D, true);
    gemm16(engine, cols, D, n_c, ds_trans.data(), n_c, qv.data(), D, dk, ld_dk, true);
  }

 private:
  // acc += P V, P's rows [0, n) written through probs(): the product's padding rows zeroed here.
  void probs_times(const scalar_t* packed_v, int64_t cols, int64_t n, float* acc) {
    const int64_t rows_n = product_rows(n), cols_c = key_columns(cols);
    for (int64_t r = n; r < rows_n; ++r) std::fill(probs(r), probs(r) + cols_c, scalar_t(0));
    gemm16(engine, rows_n, DV, cols_c, rounded.data(), BNc, packed_v, DV, acc, DV, true);
  }
  // acc += P V, P in s_tile rounded to 16 bits, V packed (ld DV, its padded rows zero).
  void product_values(const scalar_t* packed_v, int64_t cols, int64_t n, float* acc) {
    const int64_t rows_n = product_rows(n), cols_c = key_columns(cols);
    round_rows(s_tile.data(), n, rows_n, cols, cols_c, rounded.data());
    gemm16(engine, rows_n, DV, cols_c, rounded.data(), BNc, packed_v, DV, acc, DV, true);
  }
  void scale_rows(float* x, int64_t n, int64_t cols, int64_t ld, float factor) const {
    for (int64_t r = 0; r < n; ++r) scale_row(x + r * ld, cols, factor);
  }
  // x (n x cols fp32, ld BNc) rounded into out (rows_n x cols_c, ld BNc): padding zero.
  void round_rows(const float* x, int64_t n, int64_t rows_n, int64_t cols, int64_t cols_c, scalar_t* out) const {
    for (int64_t r = 0; r < n; ++r) {
      round_row(x + r * BNc, cols, out + r * BNc);
      std::fill(out + r * BNc + cols, out + r * BNc + cols_c, scalar_t(0));
    }
    for (int64_t r = n; r < rows_n; ++r) std::fill(out + r * BNc, out + r * BNc + cols_c, scalar_t(0));
  }
};

}  // namespace flash_cpu
