// The CPU forward's tasks: what a task is (and the backward's unit of work), the scratch each thread keeps for
// its tasks, how a call is cut into tasks (ForwardPlan), and the store of a finished output row. The task loop
// itself is cpu_forward.h.
#pragma once

#include "cpu_wide_tiles.h"

namespace flash_cpu {

// Query block `block` of sequence `seq`, kv heads [hk0, hk0 + heads), keys [lo, hi); `piece` >= 0 when the key
// range of the sequence is split (its partial result goes to slot `piece`).
struct ForwardTask {
  int64_t seq, block, hk0, heads, lo, hi, piece;
};

// Unit of work of the backward: (sequence, kv head, split).
struct Task {
  int64_t seq, kv_head, part;
};

template <typename Tiles>
struct ForwardScratch {
  using scalar_t = typename Tiles::scalar_t;
  using acc_t = typename Tiles::acc_t;
  Tiles tiles;
  Buffer<acc_t> acc, row_max, row_sum;  // one slab per kv head of the task
  Buffer<uint16_t> draws;  // dropout's, for a row of a tile
  // Each row's running sum is row_sum plus its 16 lanes (exp2_scaled_round_lanes), where the fused pass keeps it.
  Buffer<float> lanes;
  Buffer<int64_t> g, i;
  // FP8 keys and values widened before the products: the tile's rows, one slab per kv head of the task (one
  // only where the packing of several heads widens them itself: tasks of one head).
  Buffer<scalar_t> wide_k, wide_v;
  std::vector<KeyRows<scalar_t>> keys_of, values_of;  // the tile's rows per kv head of the task
  std::vector<std::array<int64_t, 4>> strips;  // (first row, end row, first key, end key) of a trimmed tile
  ForwardScratch(const Problem& p, Engine engine, int64_t heads)
      : tiles(p, false, engine, heads), acc(heads * product_rows(p.block_m) * p.dim_v),
        row_max(heads * p.block_m), row_sum(heads * p.block_m), draws(dropout_draws_room(p.block_n)),
        lanes(kLanes ? heads * p.block_m * 16 : 0),
        g(p.block_m), i(p.block_m),
        wide_k(p.kv_format == KvFormat::same ? 0 : widened_heads(heads) * p.block_n * p.dim),
        wide_v(p.kv_format == KvFormat::same ? 0 : widened_heads(heads) * p.block_n * p.dim_v) {}
  static int64_t widened_heads(int64_t heads) { return Tiles::kPacksFp8 ? 1 : heads; }
  static constexpr bool kLanes = kLaneSums && std::is_same_v<acc_t, float>;
};

// How a forward is cut into tasks: decode-like calls (every sequence's query rows of a kv head fit one block, no
// block mask) take several kv heads per task, as many as 256 KiB of packed tiles hold, so each task reads runs of
// whole cache rows in order (a head's slice of every row, head after head, is a strided read that the memory
// serves at half speed), and split long key ranges into pieces until the threads have work; other calls take one
// kv head per task and the whole key range.
constexpr int64_t kStageBytes = 256 * 1024;
constexpr int64_t kAhead = 8;  // FP8 rows asked for ahead of their widening

struct ForwardPlan {
  int64_t heads = 1, pieces = 1, piece_len = 0;

  ForwardPlan(const Problem& p, int64_t threads, int64_t element_size) {
    if (!p.short_queries()) return;
    int64_t longest = 0;
    for (const auto& s : p.seqs) longest = std::max(longest, s.nk);
    const int64_t tile_bytes = p.block_n * (p.dim + p.dim_v) * element_size;  // one head's K and V tile
    heads = std::max<int64_t>(1, std::min(p.kv_heads, kStageBytes / tile_bytes));
    const int64_t sequences = std::max<int64_t>(1, static_cast<int64_t>(p.seqs.size()));
    const int64_t wanted = (2 * threads + sequences - 1) / sequences;  // pieces per sequence for 2 tasks a thread
    pieces = std::max<int64_t>(1, std::min(wanted, longest / (4 * p.block_n)));
    piece_len = round_up((longest + pieces - 1) / pieces, p.block_n);
    const int64_t groups = (p.kv_heads + heads - 1) / heads;
    if (sequences * pieces * groups < threads) heads = 1;  // short and few: parallel over heads instead
  }
};

// An output row, dst = x * f rounded to dst's type: 16 lanes at a time where store_weights keeps every value (its
// bf16 rounding without AVX512_BF16 is for finite values, and a row may hold NaN); bf16 then rounds as the weights
// do (to nearest even, an fp32 denormal to 0). A few percent of a short bf16 forward, whose stores miss the cache.
#ifdef __AVX512BF16__
constexpr bool kBf16Lanes = true;
#else
constexpr bool kBf16Lanes = false;
#endif
template <typename out_t, typename acc_t>
inline void store_scaled_row(out_t* dst, const acc_t* x, int64_t n, acc_t f) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<acc_t, float> && (kBf16Lanes || !std::is_same_v<out_t, c10::BFloat16>)) {
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 keep = tail_mask(n - j);
      store_weights(dst + j, _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, x + j), _mm512_set1_ps(f)), keep);
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<out_t>(x[j] * f);
}

}  // namespace flash_cpu
