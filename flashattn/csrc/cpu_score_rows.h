// Row helpers of the score transform (Problem::transform_row, cpu_common.h): a boolean mask's row and softcap's
// tanh, each in a scalar form and on vectors where the build targets them; and whether a boolean mask hides a key
// tile from a whole query block (Problem::for_each_tile).
#pragma once

#include <cstring>

#include "cpu_vec.h"

namespace flash_cpu {

// A query block's rows as a tile walk sees them: kv heads [hk0, hk0 + heads), rows (group member g[r], query i[r]).
struct BlockRows {
  int64_t hk0, heads;
  const int64_t* g;
  const int64_t* i;
  int64_t n;
};

// Whether a boolean mask (bytes at `mask`, strides st over sequence, head, query and key) hides every key of
// columns [c_lo, c_hi) from every row of the block: such a tile adds nothing (P = 0 wherever the mask is false: a
// row's max, sum and acc stay as they were, and dS = P (dP - delta) = 0). Consecutive rows reading one mask row
// (broadcast over queries or heads) test it once; a row stops at its first visible key.
inline bool mask_hides(const unsigned char* mask, const int64_t* st, int64_t group, int64_t s_idx,
                       const BlockRows& rows, int64_t c_lo, int64_t c_hi) {
  int64_t last = -1;
  for (int64_t slab = 0; slab < rows.heads; ++slab) {
    for (int64_t r = 0; r < rows.n; ++r) {
      const int64_t base = s_idx * st[0] + ((rows.hk0 + slab) * group + rows.g[r]) * st[1] + rows.i[r] * st[2];
      if (base == last) continue;
      last = base;
      const unsigned char* row = mask + base + c_lo * st[3];  // any nonzero byte is true, as mask_row reads it
      int64_t j = 0;
      if (st[3] == 1) {
        for (uint64_t word; j + 8 <= c_hi - c_lo; j += 8) {
          std::memcpy(&word, row + j, 8);
          if (word != 0) return false;
        }
      }
      for (; j < c_hi - c_lo; ++j) {
        if (row[j * st[3]] != 0) return false;
      }
    }
  }
  return true;
}

// x[j] = -inf where keep[j] is false, j in [0, n): a boolean mask's row.
template <typename T>
inline void mask_row(T* x, const bool* keep, int64_t n) {
  constexpr T kMinusInf = -std::numeric_limits<T>::infinity();
  int64_t j = 0;
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  if constexpr (std::is_same_v<T, float>) {
    for (; j + 16 <= n; j += 16) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(keep + j));
      const __mmask16 kept = _mm_test_epi8_mask(bytes, _mm_set1_epi8(-1));
      _mm512_mask_storeu_ps(x + j, static_cast<__mmask16>(~kept), _mm512_set1_ps(kMinusInf));
    }
  }
#elif defined(__AVX2__)
  if constexpr (std::is_same_v<T, float>) {
    for (; j + 8 <= n; j += 8) {
      const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(keep + j)));
      const __m256 hidden = _mm256_castsi256_ps(_mm256_cmpeq_epi32(bytes, _mm256_setzero_si256()));
      _mm256_storeu_ps(x + j, _mm256_blendv_ps(_mm256_loadu_ps(x + j), _mm256_set1_ps(kMinusInf), hidden));
    }
  }
#endif
  for (; j < n; ++j) x[j] = keep[j] ? x[j] : kMinusInf;
}

// s = cap * tanh(s) over a row, keeping tanh in `t` (if not null) for the backward's chain rule. tanh from
// exp2_neg: tanh|x| = (1 - e) / (1 + e), e = 2^(-2 |x| log2e), absolute error below 3e-7.
template <typename T>
inline void tanh_scaled(T* s, T* t, int64_t n, T cap) {
  for (int64_t j = 0; j < n; ++j) {
    const T v = std::tanh(s[j]);
    if (t != nullptr) t[j] = v;
    s[j] = cap * v;
  }
}

inline fVec tanh_vec(fVec x) {
  const fVec a = x.abs();
  const fVec e = exp2_neg(a * fVec(-2.8853900817779268f));  // -2 log2(e)
  const fVec r = (fVec(1.0f) - e) / (fVec(1.0f) + e);
  return fVec::blendv(r, fVec(0.0f) - r, x < fVec(0.0f));
}

template <>
inline void tanh_scaled<float>(float* s, float* t, int64_t n, float cap) {
  for (int64_t j = 0; j < n; j += fVec::size()) {
    const int64_t count = std::min<int64_t>(fVec::size(), n - j);
    const fVec v = tanh_vec(fVec::loadu(s + j, count));
    if (t != nullptr) v.store(t + j, count);
    (v * fVec(cap)).store(s + j, count);
  }
}

}  // namespace flash_cpu
