// Pieces shared by the CPU forward and backward kernels (cpu_forward.h, cpu_backward.h): the problem description,
// how a task's query rows are chosen, the one score-tile transform (softcap, ALiBi, user mask, band), the dropout
// generator's use, the BLAS call and the scheduler. The arithmetic of a row lives in cpu_vec.h.
#pragma once

// ATen's pieces, not <ATen/ATen.h> (every operator's declaration: seconds of each translation unit's build).
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <ATen/native/CPUBlas.h>
#include <c10/core/InferenceMode.h>

#include "cpu_dropout.h"
#include "cpu_fp8.h"
#include "cpu_fpenv.h"
#include "cpu_score_rows.h"
#include "cpu_vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <numeric>
#include <vector>

// Fortran BLAS from the library torch links (MKL, OpenBLAS): weak, so a torch without them still loads the module
// and takes at::mm instead.
extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*, const int*,
            const float*, const int*, const float*, float*, const int*) __attribute__((weak));
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*, const double*, const int*,
            const double*, const int*, const double*, double*, const int*) __attribute__((weak));
}

namespace flash_cpu {

// C (m x n, ldc) [+]= A (m x k, lda) B (k x n, ldb), all row-major fp32, on oneDNN's brgemm (ATen's cpublas) in
// AVX-512 builds: its kernels read the operands where they lie, where the BLAS's sgemm copies both operands of every
// call into its panels first (15 % of the fp32 backward's time). It compiles a kernel per shape and leading
// dimensions, so callers take it for full tiles only (the same few shapes all call long) and gemm() elsewhere.
#if defined(__AVX512F__) && defined(CPUBLAS_BRGEMM_F32F32F32)
constexpr bool kBrgemmF32 = true;
inline void brgemm_f32(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
                       bool add, float* c, int64_t ldc) {
  at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, add, a, b, c, /*is_vnni=*/false);
}
#else
constexpr bool kBrgemmF32 = false;
inline void brgemm_f32(int64_t, int64_t, int64_t, const float*, int64_t, const float*, int64_t, bool, float*,
                       int64_t) {}
#endif

// C (m x n, row-major, leading dim ldc) = beta * C + op(A) op(B), A (m x k) or with trans_a (k x m), B (k x n) or
// with trans_b (n x k), all row-major. Single-threaded inside a parallel region (the BLAS sees it is nested).
template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b,
          int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  // Row-major C is column-major C^T = op(B)^T op(A)^T.
  const char ta = trans_b ? 'T' : 'N', tb = trans_a ? 'T' : 'N';
  const int M = static_cast<int>(n), N = static_cast<int>(m), K = static_cast<int>(k);
  const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
  const T one = 1;
  if constexpr (std::is_same_v<T, float>) {
    if (sgemm_ != nullptr) return sgemm_(&ta, &tb, &M, &N, &K, &one, b, &la, a, &lb, &beta, c, &lc);
  } else {
    if (dgemm_ != nullptr) return dgemm_(&ta, &tb, &M, &N, &K, &one, b, &la, a, &lb, &beta, c, &lc);
  }
  const auto opts = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  at::Tensor ta_ = trans_a ? at::from_blob(const_cast<T*>(a), {k, m}, {lda, 1}, opts).t()
                           : at::from_blob(const_cast<T*>(a), {m, k}, {lda, 1}, opts);
  at::Tensor tb_ = trans_b ? at::from_blob(const_cast<T*>(b), {n, k}, {ldb, 1}, opts).t()
                           : at::from_blob(const_cast<T*>(b), {k, n}, {ldb, 1}, opts);
  at::Tensor tc = at::from_blob(c, {m, n}, {ldc, 1}, opts);
  if (beta == T(0)) {
    at::mm_out(tc, ta_, tb_);
  } else {
    at::addmm_out(tc, tc, ta_, tb_, beta, 1);
  }
}

// Uninitialised scratch (a task writes before it reads): no zero-fill per thread and call. On 64 bytes, a cache
// line: the tiles' rows are whole lines, so no 64-byte access of the passes or the tile products straddles two
// (straddling ones cost the bf16 softmax pass ~15 % alone).
template <typename T>
struct Buffer {
  static_assert(std::is_trivially_destructible_v<T>, "Buffer holds raw memory: no destructors run");
  static constexpr std::align_val_t kLine{64};
  struct Free {
    void operator()(T* data) const { ::operator delete[](data, kLine); }
  };
  std::unique_ptr<T[], Free> data_;
  explicit Buffer(int64_t n)
      : data_(static_cast<T*>(::operator new[](sizeof(T) * std::max<int64_t>(n, 1), kLine))) {}
  T* data() const { return data_.get(); }
  T& operator[](int64_t j) const { return data_[j]; }
};

// Memory a call writes before it reads (its packed key tiles), kept for the next call: a fresh page costs a fault
// each (about 2 us on a virtual machine: a 1k-token bf16 forward's 2 MiB of packed keys were a fifth of its time),
// and glibc hands large blocks back to the system when they are freed. Two blocks are kept per build, each up to
// kKeptWorkspaceBytes (beyond it a call's quadratic work dwarfs the faults); a call that finds them taken (another
// thread's call) allocates its own.
constexpr int64_t kKeptWorkspaceBytes = int64_t{64} << 20;

class Workspace {
 public:
  Workspace() = default;
  explicit Workspace(int64_t bytes) {
    bytes = std::max<int64_t>(bytes, 64);
    {
      std::lock_guard<std::mutex> lock(kept().mutex);
      for (auto& block : kept().blocks) {
        if (block.defined() && block.numel() >= bytes) {
          block_ = std::move(block);
          break;
        }
      }
    }
    if (!block_.defined()) block_ = at::empty({bytes}, at::TensorOptions().dtype(at::kByte));
  }
  Workspace(Workspace&&) noexcept = default;
  Workspace& operator=(Workspace&& other) noexcept {
    give_back();
    block_ = std::move(other.block_);
    return *this;
  }
  ~Workspace() { give_back(); }

  bool defined() const { return block_.defined(); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(block_.data_ptr());
  }

 private:
  struct Kept {
    std::mutex mutex;
    at::Tensor blocks[2];
  };
  static Kept& kept() {
    static auto* blocks = new Kept();  // never destroyed: calls may run while the process exits
    return *blocks;
  }
  // Into an empty slot, else in place of a smaller block: the slots grow to the calls' largest.
  void give_back() {
    if (!block_.defined() || block_.numel() > kKeptWorkspaceBytes) return;
    std::lock_guard<std::mutex> lock(kept().mutex);
    at::Tensor* smallest = &kept().blocks[0];
    for (auto& block : kept().blocks) {
      if (!block.defined() || block.numel() < smallest->numel()) smallest = &block;
      if (!block.defined()) break;
    }
    if (!smallest->defined() || smallest->numel() < block_.numel()) *smallest = std::move(block_);
    block_.reset();
  }

  at::Tensor block_;
};

// One sequence of the call: its query rows q[qb, q0 : q0 + nq] and key rows k[kb, k0 : k0 + nk] (a dense batch
// entry, a varlen sequence or a KV-cache entry; with pages, key row p lives at the page table's entry).
struct Sequence {
  int64_t qb, q0, nq, kb, k0, nk, diagonal;
};

// Everything a task reads besides q/k/v: the options, in the log2 units the kernels compute in.
struct Problem {
  int64_t heads, kv_heads, group, dim, dim_v;
  std::vector<Sequence> seqs;
  const int64_t* block_table = nullptr;  // (S, pages per sequence) with paged keys
  int64_t block_table_stride = 0, page_size = 0;
  double scale = 1, softcap = 0;
  int64_t left = -1, right = -1;
  const float* alibi = nullptr;  // (1 or S, H)
  int64_t alibi_stride = 0;
  std::vector<double> sink;  // (H,) learnable sink logits, natural units; empty without
  float dropout_p = 0;  // a float, as the Triton kernels take it: the draws are compared with 2^16 p (cpu_dropout.h)
  double dropout_scale = 1;  // 1 / (1 - p) from the caller's double p
  uint32_t keep_threshold = 0;  // dropout_threshold(dropout_p)
  uint64_t seed = 0;
  // FP8 inputs (cpu_fp8.h): the keys' and values' format, and per (sequence, kv head) q's descale times k's,
  // applied to the scores, and v's, applied to out.
  KvFormat kv_format = KvFormat::same;
  const float* qk_descale = nullptr;
  const float* v_descale = nullptr;
  int64_t counter_rows = 0, counter_cols = 0;  // dropout row (s * H + h) * rows + i, of cols columns
  const void* mask = nullptr;  // (S, H, Nq, Nk) broadcast view, bool or the accumulation type
  bool mask_is_bool = false;
  int64_t mask_stride[4] = {0, 0, 0, 0};
  int64_t block_m = 128, block_n = 256;
  // A block mask: per (sequence, head, query block, key block) tile, 0 empty (skipped), 1 partial (its element
  // mask is partial_masks[partial_id]), 2 full; broadcast dims have stride 0. block_m/block_n are its tiles.
  const uint8_t* tile_kind = nullptr;
  const int32_t* partial_id = nullptr;
  const bool* partial_masks = nullptr;
  int64_t tile_stride[4] = {0, 0, 0, 0};
  int64_t tile_rows = 1, tile_cols = 1;

  // Columns [lo, hi) row i of sequence s may see, clipped to [0, nk).
  void visible(const Sequence& s, int64_t i, int64_t* lo, int64_t* hi) const {
    *lo = left < 0 ? 0 : std::max<int64_t>(0, i + s.diagonal - left);
    *hi = right < 0 ? s.nk : std::min<int64_t>(s.nk, i + s.diagonal + right + 1);
  }

  // Every sequence's query rows of a kv head fit one block (decode, and short prefills), without a block mask.
  bool short_queries() const {
    if (tile_kind != nullptr) return false;
    for (const auto& s : seqs) {
      if (s.nq * group > block_m) return false;
    }
    return true;
  }

  // Query heads of one kv head packed per block: short sequences (decode) share each K/V tile among the group.
  int64_t heads_per_block(const Sequence& s) const {
    if (tile_kind != nullptr) return 1;  // a block mask's tiles are one head's
    return s.nq == 0 ? 1 : std::max<int64_t>(1, std::min<int64_t>(group, block_m / s.nq));
  }
  int64_t blocks(const Sequence& s) const {
    if (s.nq == 0) return 0;
    const int64_t hp = heads_per_block(s);
    return hp > 1 ? (group + hp - 1) / hp : group * ((s.nq + block_m - 1) / block_m);
  }
  // Rows of block `blk` of (sequence s, one kv head): query head in the group and row index; returns the count.
  int64_t block_rows(const Sequence& s, int64_t blk, int64_t* g, int64_t* i) const {
    const int64_t hp = heads_per_block(s);
    int64_t n = 0;
    if (hp > 1) {
      for (int64_t gg = blk * hp; gg < std::min(group, (blk + 1) * hp); ++gg) {
        for (int64_t ii = 0; ii < s.nq; ++ii, ++n) g[n] = gg, i[n] = ii;
      }
      return n;
    }
    const int64_t per_head = (s.nq + block_m - 1) / block_m, gg = blk / per_head, i0 = (blk % per_head) * block_m;
    for (int64_t ii = i0; ii < std::min(s.nq, i0 + block_m); ++ii, ++n) g[n] = gg, i[n] = ii;
    return n;
  }
  // Key columns [lo, hi) any row of the block may see (rows come in increasing i per head).
  void block_columns(const Sequence& s, const int64_t* i, int64_t n, int64_t* lo, int64_t* hi) const {
    int64_t imin = i[0], imax = i[0];
    for (int64_t r = 1; r < n; ++r) imin = std::min(imin, i[r]), imax = std::max(imax, i[r]);
    int64_t unused;
    visible(s, imin, lo, &unused);
    visible(s, imax, &unused, hi);
  }

  // Calls fn(c0, tile mask or nullptr) for each key tile [c0, c0 + block_n) among columns [lo, hi) that the query
  // block of head h starting at row i0 visits: every tile, or with a block mask its non-empty ones (a full tile
  // has no mask of its own); given the block's `rows`, not the tiles a boolean mask hides from all of them (a
  // key-padding mask's padded tiles). The one tile walk of the forward and the backward.
  template <typename Fn>
  void for_each_tile(int64_t s_idx, int64_t h, int64_t i0, int64_t lo, int64_t hi, const Fn& fn,
                     const BlockRows* rows = nullptr) const {
    const bool dense_mask = rows != nullptr && mask != nullptr && mask_is_bool;
    for (int64_t kj = std::max<int64_t>(lo, 0) / block_n; kj * block_n < hi; ++kj) {
      const bool* tile = nullptr;
      if (tile_kind != nullptr) {
        const int64_t at = s_idx * tile_stride[0] + h * tile_stride[1] + (i0 / tile_rows) * tile_stride[2] +
                           kj * tile_stride[3];
        if (tile_kind[at] == 0) continue;
        if (tile_kind[at] == 1) tile = partial_masks + static_cast<int64_t>(partial_id[at]) * tile_rows * tile_cols;
      }
      const int64_t c_lo = std::max(kj * block_n, lo), c_hi = std::min((kj + 1) * block_n, hi);
      if (dense_mask && mask_hides(static_cast<const unsigned char*>(mask), mask_stride, group, s_idx, *rows, c_lo,
                                   c_hi)) {
        continue;
      }
      fn(kj * block_n, tile);
    }
  }
  // Row i's part of a tile mask from for_each_tile (nullptr stays nullptr).
  const bool* tile_row(const bool* tile, int64_t i) const {
    return tile == nullptr ? nullptr : tile + (i % tile_rows) * tile_cols;
  }
  // Key columns the query block visits, for the scheduler's cost.
  int64_t visited_columns(int64_t s_idx, int64_t h, int64_t i0, int64_t lo, int64_t hi) const {
    int64_t n = 0;
    for_each_tile(s_idx, h, i0, lo, hi, [&](int64_t, const bool*) { n += block_n; });
    return n;
  }

  // The one score transform, forward and backward: row `srow` of the tile (columns c0 .. c0 + cols) holds
  // q.k * scale * log2e (with softcap: q.k * scale / softcap); afterwards it holds the score in log2 units, -inf
  // where row i may not look. With `tanh_row` the softcap's tanh is kept for the chain rule.
  template <typename acc_t>
  void transform_row(int64_t s_idx, const Sequence& s, int64_t h, int64_t i, int64_t c0, int64_t cols, acc_t* srow,
                     acc_t* tanh_row, const bool* block_row = nullptr) const {
    const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
    int64_t j0, j1;
    visible(s, i, &j0, &j1);
    j0 = std::clamp<int64_t>(j0 - c0, 0, cols);
    j1 = std::clamp<int64_t>(j1 - c0, j0, cols);
    if (softcap > 0) tanh_scaled(srow + j0, tanh_row != nullptr ? tanh_row + j0 : nullptr, j1 - j0,
                                 static_cast<acc_t>(softcap * kLog2e));
    if (alibi != nullptr) {  // -slope * |i + diagonal - j|
      const acc_t slope = static_cast<acc_t>(alibi[s_idx * alibi_stride + h] * kLog2e);
      const acc_t at = static_cast<acc_t>(i + s.diagonal - c0);
      for (int32_t j = static_cast<int32_t>(j0); j < static_cast<int32_t>(j1); ++j) {
        srow[j] -= slope * std::abs(at - static_cast<acc_t>(j));  // exact below 2^24 keys (fp32)
      }
    }
    if (mask != nullptr) {
      const int64_t base = s_idx * mask_stride[0] + h * mask_stride[1] + i * mask_stride[2] + c0 * mask_stride[3];
      const int64_t st = mask_stride[3];
      if (mask_is_bool) {  // (keys one apart, the usual layout: mask_row's vector loop)
        const bool* m = static_cast<const bool*>(mask) + base;
        if (st == 1) {
          mask_row(srow + j0, m + j0, j1 - j0);
        } else {
          for (int64_t j = j0; j < j1; ++j) srow[j] = m[j * st] ? srow[j] : neg_inf;
        }
      } else {
        const acc_t* m = static_cast<const acc_t*>(mask) + base;
        const acc_t l2e = static_cast<acc_t>(kLog2e);
        for (int64_t j = j0; j < j1; ++j) srow[j] += l2e * m[j * st];
      }
    }
    if (block_row != nullptr) mask_row(srow + j0, block_row + j0, j1 - j0);
    for (int64_t j = 0; j < j0; ++j) srow[j] = neg_inf;
    for (int64_t j = j1; j < cols; ++j) srow[j] = neg_inf;
    if (tanh_row != nullptr) {  // finite where P = 0, so the chain rule gives 0 there, not NaN
      std::fill(tanh_row, tanh_row + j0, acc_t(0));
      std::fill(tanh_row + j1, tanh_row + cols, acc_t(0));
    }
  }

  // The generator's row of query row i of head h in sequence s_idx.
  uint64_t dropout_counter_row(int64_t s_idx, int64_t h, int64_t i) const {
    return static_cast<uint64_t>((s_idx * heads + h) * counter_rows + i);
  }
  // Row i's dropout draws for columns c0 .. c0 + cols, in buf (dropout_draws_room(cols) entries): the forward's.
  KeepDraws dropout_keep(int64_t s_idx, int64_t h, int64_t i, int64_t c0, int64_t cols, uint16_t* buf) const {
    return {dropout_draws(seed, dropout_counter_row(s_idx, h, i), static_cast<uint64_t>(counter_cols),
                          static_cast<uint64_t>(c0), cols, buf),
            keep_threshold};
  }
  // Row i's dropout factors for columns c0 .. c0 + cols: 0 where dropped, 1 / (1 - p) where kept (the backward's).
  template <typename acc_t>
  void dropout_row(int64_t s_idx, int64_t h, int64_t i, int64_t c0, int64_t cols, acc_t* z) const {
    dropout_factors(seed, dropout_counter_row(s_idx, h, i), static_cast<uint64_t>(counter_cols),
                    static_cast<uint64_t>(c0), cols, dropout_p, static_cast<acc_t>(dropout_scale), z);
  }
};

// Row r of an (N, H, D) slab as a pointer: for key tiles the rows of a sequence, through the page table if paged.
template <typename scalar_t>
struct Rows {
  const scalar_t* data;
  int64_t batch_stride, row_stride, head_stride;

  const scalar_t* row(const Problem& p, int64_t s_idx, const Sequence& s, int64_t head, int64_t pos) const {
    if (p.block_table != nullptr) {
      const int64_t page = p.block_table[s_idx * p.block_table_stride + pos / p.page_size];
      return data + page * batch_stride + (pos % p.page_size) * row_stride + head * head_stride;
    }
    return data + s.kb * batch_stride + pos * row_stride + head * head_stride;
  }
};

template <typename scalar_t>
Rows<scalar_t> rows_of(const at::Tensor& t) {
  return {t.data_ptr<scalar_t>(), t.stride(0), t.stride(1), t.stride(2)};
}

// The rows [c0, c0 + cols) of one kv head of a key (or value) tile, as the tile products read them: uniformly
// strided (a dense or varlen tensor) or, in a paged cache, through the page table.
template <typename scalar_t>
struct KeyRows {
  const scalar_t* first = nullptr;  // uniform: row r at first + r * stride
  int64_t stride = 0;
  const Problem* p = nullptr;  // paged: row r at rows->row(*p, s_idx, *s, hk, pos0 + r)
  const Rows<scalar_t>* rows = nullptr;
  const Sequence* s = nullptr;
  int64_t s_idx = 0, hk = 0, pos0 = 0;

  static KeyRows uniform(const scalar_t* first, int64_t stride) { return {first, stride}; }
  static KeyRows of(const Problem& p, const Rows<scalar_t>& rows, int64_t s_idx, const Sequence& s, int64_t hk,
                    int64_t c0) {
    if (p.block_table == nullptr) return uniform(rows.row(p, s_idx, s, hk, s.k0 + c0), rows.row_stride);
    return {nullptr, 0, &p, &rows, &s, s_idx, hk, s.k0 + c0};
  }
  bool is_uniform() const { return first != nullptr; }
  const scalar_t* operator()(int64_t r) const {
    return first != nullptr ? first + r * stride : rows->row(*p, s_idx, *s, hk, pos0 + r);
  }
};

// Asks memory for `count` rows from row r0 of `rows`, `width` elements of each (several heads' worth from the
// first: a multi-head task's rows are read whole); the packings ask for the next rows while they pack these.
template <typename scalar_t>
void prefetch_rows(const KeyRows<scalar_t>& rows, int64_t r0, int64_t count, int64_t width) {
  for (int64_t r = r0; r < r0 + count; ++r) {
    const char* at = reinterpret_cast<const char*>(rows(r));
    for (int64_t b = 0; b < width * static_cast<int64_t>(sizeof(scalar_t)); b += 64) __builtin_prefetch(at + b);
  }
}

// Keys (or values) rows [0, cols) as a (cols x dim) matrix in the accumulation type: the rows in place when they
// already are one, else converted into `buffer`. Returns the leading dimension in *ld.
template <typename scalar_t, typename acc_t>
const acc_t* key_tile(const KeyRows<scalar_t>& rows, int64_t cols, int64_t dim, acc_t* buffer, int64_t* ld) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    if (rows.is_uniform()) {
      *ld = rows.stride;
      return rows.first;
    }
  }
  for (int64_t j = 0; j < cols; ++j) {
    const scalar_t* r = rows(j);
    for (int64_t d = 0; d < dim; ++d) buffer[j * dim + d] = static_cast<acc_t>(r[d]);
  }
  *ld = dim;
  return buffer;
}

// Runs task(t, scratch) for t in order[0..n) on at::parallel_for's threads, each with its own scratch (from
// make_scratch) and taking the next task when it finishes one: a thread slowed by another process takes fewer
// tasks instead of holding the others up.
template <typename MakeScratch, typename Fn>
void run_tasks(const std::vector<int64_t>& order, const MakeScratch& make_scratch, const Fn& task) {
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(order.size());
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    c10::InferenceMode inference_mode(inference);  // thread-local modes: the region's threads take the caller's
    at::NoGradGuard no_grad;
    const FlushSubnormals flush;  // (cpu_fpenv.h)
    auto scratch = make_scratch();
    for (int64_t t = next++; t < n; t = next++) task(order[t], scratch);
  });
}

// Task indices sorted by decreasing cost (longest first keeps the last tasks short).
inline std::vector<int64_t> longest_first(const std::vector<int64_t>& cost) {
  std::vector<int64_t> order(cost.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  return order;
}

}  // namespace flash_cpu
