// Tile products on 16-bit operands with fp32 accumulation, on the CPU's dot-product instructions: C (M x N, fp32,
// row-major) = [C +] A B, A (M x K, bf16 or fp16, row-major), B (K x N) VNNI-packed: [K/2][ldb][2], the two
// elements of a k-pair side by side, so one 32-bit lane holds what one dot-product lane multiplies. K is even
// (callers zero-pad it). Two engines, chosen per call by the Python side after a self-test:
//   onednn: ATen's cpublas::brgemm, oneDNN's brgemm micro-kernel (AMX where present, else AVX512_BF16);
//   avx512bf16: our own register-blocked _mm512_dpbf16_ps loop (bf16 only), for torch builds without the former.
// Also the packings the kernels need (VNNI from rows, VNNI from transposed rows, transposed rows).
#pragma once

#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace flash_cpu {

enum class Engine : int64_t { fp32 = 0, onednn = 1, avx512bf16 = 2 };

inline constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Rows of a product as the engines see them: exact up to 16 (decode's few rows cost what they are), else a
// multiple of 16. oneDNN compiles a kernel per shape and caches it per thread, so the shapes must stay few.
inline constexpr int64_t product_rows(int64_t n) { return n <= 16 ? n : round_up(n, 16); }
// Columns of a key tile, and K of the products that reduce over keys: a multiple of 32 (zero-padded).
inline constexpr int64_t key_columns(int64_t n) { return round_up(std::max<int64_t>(n, 1), 32); }

inline bool has_onednn() {
#ifdef CPUBLAS_BRGEMM_BF16BF16F32
  return true;
#else
  return false;
#endif
}

inline bool has_avx512bf16() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

#ifdef __AVX512BF16__
// C rows [0, MR) x columns [0, 16 NV) (the last vector masked by `tail`) += A B over k-pairs [0, K2).
template <int MR, int NV>
inline void dot_block(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b, int64_t ldb, float* c,
                      int64_t ldc, int64_t k2, bool add, __mmask16 tail) {
  __m512 acc[MR][NV];
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < NV; ++v) {
      const __mmask16 mask = v == NV - 1 ? tail : __mmask16(0xFFFF);
      acc[m][v] = add ? _mm512_maskz_loadu_ps(mask, c + m * ldc + 16 * v) : _mm512_setzero_ps();
    }
  }
  for (int64_t kk = 0; kk < k2; ++kk) {
    __m512bh bv[NV];
    for (int v = 0; v < NV; ++v) {
      const __mmask16 mask = v == NV - 1 ? tail : __mmask16(0xFFFF);
      bv[v] = (__m512bh)_mm512_maskz_loadu_epi32(mask, b + kk * 2 * ldb + 32 * v);
    }
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, a + m * lda + 2 * kk, sizeof(pair));
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], av, bv[v]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < NV; ++v) {
      const __mmask16 mask = v == NV - 1 ? tail : __mmask16(0xFFFF);
      _mm512_mask_storeu_ps(c + m * ldc + 16 * v, mask, acc[m][v]);
    }
  }
}

template <int NV>
inline void dot_rows(int64_t m, const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b, int64_t ldb, float* c,
                     int64_t ldc, int64_t k2, bool add, __mmask16 tail) {
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) dot_block<4, NV>(a + r * lda, lda, b, ldb, c + r * ldc, ldc, k2, add, tail);
  switch (m - r) {
    case 3: return dot_block<3, NV>(a + r * lda, lda, b, ldb, c + r * ldc, ldc, k2, add, tail);
    case 2: return dot_block<2, NV>(a + r * lda, lda, b, ldb, c + r * ldc, ldc, k2, add, tail);
    case 1: return dot_block<1, NV>(a + r * lda, lda, b, ldb, c + r * ldc, ldc, k2, add, tail);
    default: return;
  }
}

// Column panels of 64 (4 x 16 fp32 lanes: 16 accumulators for 4 rows, the B panel re-read from L1 per row block).
inline void avx512bf16_gemm(int64_t m, int64_t n, int64_t k, const c10::BFloat16* a, int64_t lda,
                            const c10::BFloat16* b, int64_t ldb, float* c, int64_t ldc, bool add) {
  for (int64_t c0 = 0; c0 < n; c0 += 64) {
    const int64_t cols = std::min<int64_t>(64, n - c0), vectors = (cols + 15) / 16, rest = cols - 16 * (vectors - 1);
    const __mmask16 tail = static_cast<__mmask16>((1u << rest) - 1u);
    const c10::BFloat16* bp = b + 2 * c0;
    float* cp = c + c0;
    switch (vectors) {
      case 4: dot_rows<4>(m, a, lda, bp, ldb, cp, ldc, k / 2, add, tail); break;
      case 3: dot_rows<3>(m, a, lda, bp, ldb, cp, ldc, k / 2, add, tail); break;
      case 2: dot_rows<2>(m, a, lda, bp, ldb, cp, ldc, k / 2, add, tail); break;
      default: dot_rows<1>(m, a, lda, bp, ldb, cp, ldc, k / 2, add, tail); break;
    }
  }
}
#endif

// C = [C +] A B as above. Single-threaded (inside the kernel's parallel region).
template <typename scalar_t>
void gemm16(Engine engine, int64_t m, int64_t n, int64_t k, const scalar_t* a, int64_t lda, const scalar_t* b,
            int64_t ldb, float* c, int64_t ldc, bool add) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (!add) for (int64_t r = 0; r < m; ++r) std::fill_n(c + r * ldc, n, 0.0f);
    return;
  }
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (engine == Engine::avx512bf16) return avx512bf16_gemm(m, n, k, a, lda, b, ldb, c, ldc, add);
  }
#endif
#ifdef CPUBLAS_BRGEMM_BF16BF16F32
  if (engine == Engine::onednn) return at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, add, a, b, c, true);
#endif
  TORCH_CHECK(false, "flashattn cpu kernel: tile products engine ", static_cast<int64_t>(engine),
              " is not built for ", c10::CppTypeToScalarType<scalar_t>::value);
}

// What an engine needs at the end of a thread's tasks (oneDNN: give back the AMX tile state).
inline void release_engine(Engine engine) {
#ifdef CPUBLAS_BRGEMM_BF16BF16F32
  if (engine == Engine::onednn) at::native::cpublas::brgemm_release(true);
#endif
}

// 16-bit elements moved as raw bits.
template <typename scalar_t>
inline uint16_t bits(scalar_t x) {
  uint16_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

// VNNI B operand from rows: rows [0, rows) of `width` elements each (row r at row(r)), to out [rows_e/2][ldb][2]
// (rows_e = rows rounded up to `rows_to`, the missing rows zero; columns [width, ldb) untouched). For V in P V,
// K in dS K, Q and dO in the backward's dK and dV.
template <typename scalar_t, typename RowFn>
void pack_rows(const RowFn& row, int64_t rows, int64_t rows_to, int64_t width, scalar_t* out, int64_t ldb) {
  uint16_t* o = reinterpret_cast<uint16_t*>(out);
  const int64_t rows_e = round_up(std::max<int64_t>(rows, 1), rows_to);
  for (int64_t r = 0; r < rows_e; r += 2) {
    uint16_t* dst = o + r * ldb;  // pair r/2 starts at (r/2) * 2 * ldb
    if (r + 1 < rows) {
      const uint16_t* a = reinterpret_cast<const uint16_t*>(row(r));
      const uint16_t* b = reinterpret_cast<const uint16_t*>(row(r + 1));
      for (int64_t c = 0; c < width; ++c) dst[2 * c] = a[c], dst[2 * c + 1] = b[c];
    } else if (r < rows) {
      const uint16_t* a = reinterpret_cast<const uint16_t*>(row(r));
      for (int64_t c = 0; c < width; ++c) dst[2 * c] = a[c], dst[2 * c + 1] = 0;
    } else {
      std::fill_n(dst, 2 * width, uint16_t(0));
    }
  }
}

// VNNI B operand of a transposed row block: rows [0, rows) of `width` elements (row r at row(r)) become the
// columns of B (width x rows), out [width_e/2][ldb][2] with width_e = width rounded up to even (a zero element).
// For K^T in Q K^T and V^T in dO V^T: each pair of a row's elements is one 32-bit word, so this is a transpose of
// 32-bit words.
template <typename scalar_t, typename RowFn>
void pack_transposed(const RowFn& row, int64_t rows, int64_t width, scalar_t* out, int64_t ldb) {
  uint32_t* o = reinterpret_cast<uint32_t*>(out);
  const int64_t pairs = width / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const scalar_t* src = row(r);
    for (int64_t w = 0; w < pairs; ++w) {
      uint32_t word;
      std::memcpy(&word, src + 2 * w, sizeof(word));
      o[w * ldb + r] = word;
    }
    if (width % 2 == 1) o[pairs * ldb + r] = bits(src[width - 1]);
  }
}

}  // namespace flash_cpu
