// Tile products on 16-bit operands with fp32 accumulation, on the CPU's dot-product instructions: C (M x N, fp32,
// row-major) = [C +] A B, A (M x K, bf16 or fp16, row-major), B (K x N) VNNI-packed: [K/2][ldb][2], the two
// elements of a k-pair side by side, so one 32-bit lane holds what one dot-product lane multiplies. K is even
// (callers zero-pad it). Three engines, chosen per call by the Python side after a self-test:
//   amx: our own AMX tile loop (bf16 only; cpu_amx.h), where the CPU and the OS offer AMX;
//   onednn: ATen's cpublas::brgemm, oneDNN's brgemm micro-kernel (AMX where present, else AVX512_BF16);
//   avx512bf16: our own register-blocked _mm512_dpbf16_ps loop (bf16 only), for torch builds without the former.
// Also the packings the kernels need (VNNI from rows, VNNI from transposed rows, transposed rows); on AVX-512 they
// read 16-bit rows as they are or FP8 rows widened in registers (a cache's FP8 tile packed in one pass).
#pragma once

#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "cpu_amx.h"
#include "cpu_fp8.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace flash_cpu {

enum class Engine : int64_t { fp32 = 0, onednn = 1, avx512bf16 = 2, amx = 3 };

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
// C rows [0, MR) x columns [0, 16 NV) += A B over k-pairs [0, K2); with TAIL the last vector is masked by `tail`
// (unmasked loads and stores where the columns fill whole vectors: masked ones halve the speed on Zen 4).
template <int MR, int NV, bool TAIL>
inline void dot_block(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b, int64_t ldb, float* c,
                      int64_t ldc, int64_t k2, bool add, __mmask16 tail) {
  __m512 acc[MR][NV];
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < NV; ++v) {
      if (!add) {
        acc[m][v] = _mm512_setzero_ps();
      } else if (TAIL && v == NV - 1) {
        acc[m][v] = _mm512_maskz_loadu_ps(tail, c + m * ldc + 16 * v);
      } else {
        acc[m][v] = _mm512_loadu_ps(c + m * ldc + 16 * v);
      }
    }
  }
  for (int64_t kk = 0; kk < k2; ++kk) {
    __m512bh bv[NV];
    for (int v = 0; v < NV; ++v) {
      const c10::BFloat16* at = b + kk * 2 * ldb + 32 * v;
      bv[v] = (__m512bh)(TAIL && v == NV - 1 ? _mm512_maskz_loadu_epi32(tail, at) : _mm512_loadu_si512(at));
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
      if (TAIL && v == NV - 1) {
        _mm512_mask_storeu_ps(c + m * ldc + 16 * v, tail, acc[m][v]);
      } else {
        _mm512_storeu_ps(c + m * ldc + 16 * v, acc[m][v]);
      }
    }
  }
}

template <int NV, bool TAIL>
inline void dot_rows(int64_t m, const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b, int64_t ldb, float* c,
                     int64_t ldc, int64_t k2, bool add, __mmask16 tail) {
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) dot_block<4, NV, TAIL>(a + r * lda, lda, b, ldb, c + r * ldc, ldc, k2, add, tail);
  switch (m - r) {
    case 3: return dot_block<3, NV, TAIL>(a + r * lda, lda, b, ldb, c + r * ldc, ldc, k2, add, tail);
    case 2: return dot_block<2, NV, TAIL>(a + r * lda, lda, b, ldb, c + r * ldc, ldc, k2, add, tail);
    case 1: return dot_block<1, NV, TAIL>(a + r * lda, lda, b, ldb, c + r * ldc, ldc, k2, add, tail);
    default: return;
  }
}

template <bool TAIL>
inline void dot_panel(int64_t vectors, int64_t m, const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b,
                      int64_t ldb, float* c, int64_t ldc, int64_t k2, bool add, __mmask16 tail) {
  switch (vectors) {
    case 4: return dot_rows<4, TAIL>(m, a, lda, b, ldb, c, ldc, k2, add, tail);
    case 3: return dot_rows<3, TAIL>(m, a, lda, b, ldb, c, ldc, k2, add, tail);
    case 2: return dot_rows<2, TAIL>(m, a, lda, b, ldb, c, ldc, k2, add, tail);
    default: return dot_rows<1, TAIL>(m, a, lda, b, ldb, c, ldc, k2, add, tail);
  }
}

// Column panels of 64 (4 x 16 fp32 lanes: 16 accumulators for 4 rows, the B panel re-read from L1 per row block).
inline void avx512bf16_gemm(int64_t m, int64_t n, int64_t k, const c10::BFloat16* a, int64_t lda,
                            const c10::BFloat16* b, int64_t ldb, float* c, int64_t ldc, bool add) {
  for (int64_t c0 = 0; c0 < n; c0 += 64) {
    const int64_t cols = std::min<int64_t>(64, n - c0), vectors = (cols + 15) / 16, rest = cols - 16 * (vectors - 1);
    const __mmask16 tail = static_cast<__mmask16>((1u << rest) - 1u);
    if (rest == 16) {
      dot_panel<false>(vectors, m, a, lda, b + 2 * c0, ldb, c + c0, ldc, k / 2, add, tail);
    } else {
      dot_panel<true>(vectors, m, a, lda, b + 2 * c0, ldb, c + c0, ldc, k / 2, add, tail);
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
#ifdef FLASHATTN_AMX
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (engine == Engine::amx) return amx_gemm(m, n, k, a, lda, b, ldb, c, ldc, add);
  }
#endif
#ifdef CPUBLAS_BRGEMM_BF16BF16F32
  if (engine == Engine::onednn) return at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, add, a, b, c, true);
#endif
  TORCH_CHECK(false, "flashattn cpu kernel: tile products engine ", static_cast<int64_t>(engine),
              " is not built for ", c10::CppTypeToScalarType<scalar_t>::value);
}

// What an engine needs at the end of a thread's tasks (the AMX ones: give back the tile state).
inline void release_engine(Engine engine) {
  if (engine == Engine::amx) amx_release();
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

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define FLASHATTN_PACK_AVX512 1
// Rows r[0..16) of 16 32-bit words each, transposed in place: r[j] word i = the input's r[i] word j.
__attribute__((always_inline)) inline void transpose_words(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  __m512i u[16];  // u[4i + k], 128-bit lane L: rows 4i..4i+3 at column 4L + k
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // column 4L + k gathers lane L of u[k], u[4 + k], u[8 + k], u[12 + k]
    const __m512i x0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x44), x1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x44);
    const __m512i y1 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xEE);
    r[k] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[4 + k] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    r[8 + k] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

// 16 words from 16 elements of a and of b: word c = (a[c], b[c]).
__attribute__((always_inline)) inline __m512i interleave16(__m256i a, __m256i b) {
  const __m512i index = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(index, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
}

inline __mmask32 first32(int64_t n) { return n >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1u << n) - 1u); }
inline __mmask16 first16(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u); }

// 16 fp32 values rounded to 16 bits (to nearest even), as 16 elements.
template <typename scalar_t>
inline __m256i round16(__m512 x);
#ifdef __AVX512BF16__
template <>
inline __m256i round16<c10::BFloat16>(__m512 x) {
  return (__m256i)_mm512_cvtneps_pbh(x);
}
#endif
template <>
inline __m256i round16<c10::Half>(__m512 x) {
  return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
template <typename scalar_t>
constexpr bool can_round16() {
#ifdef __AVX512BF16__
  return true;
#else
  return std::is_same_v<scalar_t, c10::Half>;
#endif
}
#endif

// How a packing reads its rows' elements: 16-bit ones as they are, or (WidenedWords) FP8 bytes widened to 16 bits
// by table. The scalar packings (no AVX-512) read 16-bit rows only.
struct PlainWords {
#ifdef FLASHATTN_PACK_AVX512
  template <typename T>
  __m512i load32(const T* at, __mmask32 m) const {
    return _mm512_maskz_loadu_epi16(m, at);
  }
  template <typename T>
  __m256i load16(const T* at, __mmask16 m) const {
    return _mm256_maskz_loadu_epi16(m, at);
  }
#endif
};
#if defined(FLASHATTN_PACK_AVX512) && defined(FLASHATTN_FP8_TABLE)
template <KvFormat F, typename scalar_t>
struct WidenedWords {
  const Fp8Table<F, scalar_t>& table = fp8_table<F, scalar_t>();
  __m512i load32(const uint8_t* at, __mmask32 m) const {
    return fp8_words<F>(_mm256_maskz_loadu_epi8(m, at), table);
  }
  __m256i load16(const uint8_t* at, __mmask16 m) const {
    return _mm512_castsi512_si256(fp8_words<F>(_mm256_castsi128_si256(_mm_maskz_loadu_epi8(m, at)), table));
  }
};
#endif

// VNNI B operand from rows: rows [0, rows) of `width` elements each (row r at row(r)), to out [rows_e/2][ldb][2]
// (rows_e = rows rounded up to `rows_to`, the missing rows zero; columns [width, ldb) untouched). For V in P V,
// K in dS K, Q and dO in the backward's dK and dV. `words` reads the rows (FP8 rows need it, and AVX-512).
template <typename scalar_t, typename RowFn, typename Words = PlainWords>
void pack_rows(const RowFn& row, int64_t rows, int64_t rows_to, int64_t width, scalar_t* out, int64_t ldb,
               const Words& words = {}) {
  (void)words;  // read by the AVX-512 packing only
  uint16_t* o = reinterpret_cast<uint16_t*>(out);
  const int64_t rows_e = round_up(std::max<int64_t>(rows, 1), rows_to);
  for (int64_t r = 0; r < rows_e; r += 2) {
    uint16_t* dst = o + r * ldb;  // pair r/2 starts at (r/2) * 2 * ldb
    if (r >= rows) {
      std::fill_n(dst, 2 * width, uint16_t(0));
      continue;
    }
#ifdef FLASHATTN_PACK_AVX512
    const auto* a = row(r);
    const auto* b = r + 1 < rows ? row(r + 1) : nullptr;
    for (int64_t c = 0; c < width; c += 16) {
      const __mmask16 m = first16(width - c);
      const __m256i va = words.load16(a + c, m);
      const __m256i vb = b != nullptr ? words.load16(b + c, m) : _mm256_setzero_si256();
      _mm512_mask_storeu_epi32(dst + 2 * c, m, interleave16(va, vb));
    }
#else
    const uint16_t* a = reinterpret_cast<const uint16_t*>(row(r));
    const uint16_t* b = r + 1 < rows ? reinterpret_cast<const uint16_t*>(row(r + 1)) : nullptr;
    for (int64_t c = 0; c < width; ++c) dst[2 * c] = a[c], dst[2 * c + 1] = b != nullptr ? b[c] : 0;
#endif
  }
}

// VNNI B operand of a transposed row block: rows [0, rows) of `width` elements (row r at row(r)) become the
// columns of B (width x rows), out [width_e/2][ldb][2] with width_e = width rounded up to even (a zero element).
// For K^T in Q K^T and V^T in dO V^T: each pair of a row's elements is one 32-bit word, so this is a transpose of
// 32-bit words; columns [rows, round_up(rows, 16)) of out are written zero.
template <typename scalar_t, typename RowFn, typename Words = PlainWords>
void pack_transposed(const RowFn& row, int64_t rows, int64_t width, scalar_t* out, int64_t ldb,
                     const Words& words = {}) {
  (void)words;
  uint32_t* o = reinterpret_cast<uint32_t*>(out);
  const int64_t pairs = (width + 1) / 2;
#ifdef FLASHATTN_PACK_AVX512
  // Fully unrolled so the 16 rows stay in registers (a block spilled to the stack and read back as 512-bit words
  // waits on store forwarding).
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    decltype(row(0)) src[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) src[r] = row(std::min(r0 + r, rows - 1));
    for (int64_t w0 = 0; w0 < pairs; w0 += 16) {
      const __mmask32 m = first32(width - 2 * w0);
      __m512i block[16];
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) block[r] = words.load32(src[r] + 2 * w0, r0 + r < rows ? m : 0);
      transpose_words(block);
      const int64_t count = std::min<int64_t>(16, pairs - w0);
#pragma GCC unroll 16
      for (int w = 0; w < 16; ++w) {
        if (w < count) _mm512_storeu_si512(o + (w0 + w) * ldb + r0, block[w]);
      }
    }
  }
#else
  for (int64_t r = 0; r < rows; ++r) {
    const scalar_t* src = row(r);
    for (int64_t w = 0; w < width / 2; ++w) {
      uint32_t word;
      std::memcpy(&word, src + 2 * w, sizeof(word));
      o[w * ldb + r] = word;
    }
    if (width % 2 == 1) o[(pairs - 1) * ldb + r] = bits(src[width - 1]);
  }
#endif
}

// x (n x cols fp32, ld ldx) rounded to 16 bits and transposed into out (cols x n_c, row-major): columns [n, n_c)
// zero. The backward's P^T and dS^T, the A operands of dV = P^T dO and dK = dS^T Q.
template <typename scalar_t>
void round_transposed(const float* x, int64_t ldx, int64_t n, int64_t n_c, int64_t cols, scalar_t* out) {
#ifdef FLASHATTN_PACK_AVX512
  if constexpr (can_round16<scalar_t>()) {
    // 32 rows x 16 columns at a time: row pairs rounded and interleaved into words, the words transposed.
    uint32_t* o = reinterpret_cast<uint32_t*>(out);
    const int64_t words = n_c / 2;
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
      const __mmask16 m = first16(cols - c0);
      const int64_t count = std::min<int64_t>(16, cols - c0);
      for (int64_t r0 = 0; r0 < n_c; r0 += 32) {
        __m512i block[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) {
          const int64_t r = r0 + 2 * i;
          const float* a = x + std::min(r, n - 1) * ldx + c0;
          const float* b = x + std::min(r + 1, n - 1) * ldx + c0;
          block[i] = interleave16(round16<scalar_t>(_mm512_maskz_loadu_ps(r < n ? m : 0, a)),
                                  round16<scalar_t>(_mm512_maskz_loadu_ps(r + 1 < n ? m : 0, b)));
        }
        transpose_words(block);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
          if (j < count) _mm512_storeu_si512(o + (c0 + j) * words + r0 / 2, block[j]);
        }
      }
    }
    return;
  }
#endif
  for (int64_t j = 0; j < cols; ++j) {
    scalar_t* o = out + j * n_c;
    for (int64_t r = 0; r < n; ++r) o[r] = static_cast<scalar_t>(x[r * ldx + j]);
    std::fill(o + n, o + n_c, scalar_t(0));
  }
}

}  // namespace flash_cpu
