// Row arithmetic of the CPU kernels: exp2 for the softmax, max and exp-sum passes (and the forward's fused pass),
// scaling and rounding a row, each in a scalar form and, for float, on ATen's at::vec::Vectorized (16 lanes where
// the build targets AVX-512, 8 on AVX2: cpu_build.py defines CPU_CAPABILITY to match the host) or AVX-512
// intrinsics. The dropout generator (and KeepDraws, its draws as the forward's pass reads them) is in
// cpu_dropout.h; a mask's row and softcap's tanh in cpu_score_rows.h.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "cpu_dropout.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace flash_cpu {

constexpr double kLog2e = 1.4426950408889634;
constexpr double kLn2 = 0.6931471805599453;  // 1 / kLog2e
using fVec = at::vec::Vectorized<float>;
using iVec = at::vec::Vectorized<int32_t>;

// 2^x for x <= 0 (a score minus its row maximum); exactly 0 below 2^-126 and for -inf. Relative error below 3e-7;
// no calls or branches, so the loops that use it vectorize. (At -126 the product is subnormal: the kernels run
// with subnormals flushed, cpu_fpenv.h.)
inline float exp2_neg(float x) {
  const float xc = x >= -126.0f ? x : -126.0f;  // NaN too: its result is replaced below
  const float xi = std::floor(xc);
  const float f = xc - xi;
  float p = 1.8775767e-3f;
  p = p * f + 8.9893397e-3f;
  p = p * f + 5.5826318e-2f;
  p = p * f + 2.4015361e-1f;
  p = p * f + 6.9315308e-1f;
  p = p * f + 9.9999994e-1f;
  const int32_t bits = (static_cast<int32_t>(xi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x >= -126.0f ? p * scale : (x < -126.0f ? 0.0f : x);  // a NaN score stays NaN, not a weight of 0
}

inline double exp2_neg(double x) { return std::exp2(x); }

// exp2_neg on a vector: the same polynomial, 2^floor(x) built in the exponent bits.
inline fVec exp2_neg(fVec x) {
  const fVec lowest(-126.0f);
  const fVec xc = at::vec::maximum(x, lowest);
  const fVec xi = xc.floor();
  const fVec f = xc - xi;
  fVec p = at::vec::fmadd(f, fVec(1.8775767e-3f), fVec(8.9893397e-3f));
  p = at::vec::fmadd(p, f, fVec(5.5826318e-2f));
  p = at::vec::fmadd(p, f, fVec(2.4015361e-1f));
  p = at::vec::fmadd(p, f, fVec(6.9315308e-1f));
  p = at::vec::fmadd(p, f, fVec(9.9999994e-1f));
  // (xi + 127) * 2^23 is an exact float; as an int it is 2^xi's bit pattern.
  const iVec bits = at::vec::convert_to_int_of_same_size(at::vec::fmadd(xi, fVec(8388608.0f), fVec(1065353216.0f)));
  const fVec r = p * at::vec::cast<float>(bits);
  return fVec::blendv(r, fVec(0.0f), x < lowest);  // NaN compares false: it stays NaN
}

#if defined(__AVX512F__)
// ------------------------------------------------------------------------------------------ AVX-512 primitives
// The lanes [0, left) of a 16-lane step (all 16 when left >= 16): the masked tail of a row.
inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}

// 2^x by 2^floor(x) times a polynomial of the fraction, through vscalefps: exactly 0 far below -126, NaN kept.
// Degree 5: relative error below 1e-7 (fp32 weights); degree 4: below 3e-6, for weights rounded to 16 bits (bf16
// keeps 8 bits; the fp32 sum of the weights then errs by 3e-6 at most, as PyTorch's exp_u20 does).
template <int kDegree = 5>
inline __m512 exp2_clamped(__m512 x) {
#ifdef __AVX512DQ__  // x - floor(x) in one instruction; vscalefps floors its exponent operand itself
  const __m512 fr = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC), xi = x;
#else
  const __m512 xi = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 fr = _mm512_sub_ps(x, xi);
#endif
  __m512 q;
  if constexpr (kDegree == 4) {
    q = _mm512_fmadd_ps(fr, _mm512_set1_ps(1.35347741e-2f), _mm512_set1_ps(5.20121194e-2f));
    q = _mm512_fmadd_ps(q, fr, _mm512_set1_ps(2.41440862e-1f));
    q = _mm512_fmadd_ps(q, fr, _mm512_set1_ps(6.93004668e-1f));
    q = _mm512_fmadd_ps(q, fr, _mm512_set1_ps(1.00000250e+0f));
  } else {
    q = _mm512_fmadd_ps(fr, _mm512_set1_ps(1.8775767e-3f), _mm512_set1_ps(8.9893397e-3f));
    q = _mm512_fmadd_ps(q, fr, _mm512_set1_ps(5.5826318e-2f));
    q = _mm512_fmadd_ps(q, fr, _mm512_set1_ps(2.4015361e-1f));
    q = _mm512_fmadd_ps(q, fr, _mm512_set1_ps(6.9315308e-1f));
    q = _mm512_fmadd_ps(q, fr, _mm512_set1_ps(9.9999994e-1f));
  }
  return _mm512_scalef_ps(q, xi);
}

// exp2_neg on 16 lanes: 2^y, exactly 0 below 2^-126 (and for -inf, a masked score), NaN kept.
inline __m512 exp2_or_zero(__m512 y) {
  const __m512 lowest = _mm512_set1_ps(-126.0f);
  const __mmask16 under = _mm512_cmp_ps_mask(y, lowest, _CMP_LT_OQ);
  // vmaxps returns its second operand where either is NaN: a NaN stays NaN.
  return _mm512_mask_mov_ps(exp2_clamped<5>(_mm512_max_ps(lowest, y)), under, _mm512_setzero_ps());
}

// The largest of x[0, n): four running maxima, so the loop is not one chain of dependent maxima. vmaxps drops a
// NaN against a number (max_raw_checked says what that means).
inline float max_raw_avx512(const float* x, int64_t n) {
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m0 = lowest, m1 = lowest, m2 = lowest, m3 = lowest;
  int64_t j = 0;
  for (; j + 64 <= n; j += 64) {
    m0 = _mm512_max_ps(_mm512_loadu_ps(x + j), m0);
    m1 = _mm512_max_ps(_mm512_loadu_ps(x + j + 16), m1);
    m2 = _mm512_max_ps(_mm512_loadu_ps(x + j + 32), m2);
    m3 = _mm512_max_ps(_mm512_loadu_ps(x + j + 48), m3);
  }
  for (; j < n; j += 16) m0 = _mm512_max_ps(_mm512_mask_loadu_ps(lowest, tail_mask(n - j), x + j), m0);
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
}
#endif

// The largest of a row's scores x[0, n), for the passes that take NaN through the exp after it (a NaN score gives
// a NaN weight there): NaN where the row holds a NaN and nothing above -inf, so that its output is NaN, not 0.
template <typename T>
inline T max_raw_checked(const T* x, int64_t n) {
  T m = -std::numeric_limits<T>::infinity();
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    m = max_raw_avx512(x, n);
  } else {
    for (int64_t j = 0; j < n; ++j) m = x[j] > m ? x[j] : m;
  }
#else
  for (int64_t j = 0; j < n; ++j) m = x[j] > m ? x[j] : m;
#endif
  if (m == -std::numeric_limits<T>::infinity()) {  // (every score of a masked tile: a tenth of a masked forward)
    int64_t j = 0;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>) {
      for (; j + 16 <= n && _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), _mm512_loadu_ps(x + j), _CMP_UNORD_Q) == 0;
           j += 16) {
      }
    }
#elif defined(__AVX2__)
    if constexpr (std::is_same_v<T, float>) {
      for (; j + 8 <= n && _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(x + j),
                                                             _CMP_UNORD_Q)) == 0;
           j += 8) {
      }
    }
#endif
    for (; j < n; ++j) {
      if (std::isnan(x[j])) return x[j];
    }
  }
  return m;
}

// The two passes of the online softmax over a row: its maximum, then x = 2^(x - m) with their sum. The float
// versions are written on vectors: the compiler does not vectorize a max reduction that must keep -inf and NaN
// semantics.
template <typename T>
inline T max_of(const T* x, int64_t n, T m) {
  for (int64_t j = 0; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

template <typename T>
inline T exp2_shift_sum(T* x, int64_t n, T m) {
  T sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    x[j] = exp2_neg(x[j] - m);
    sum += x[j];
  }
  return sum;
}

#if defined(__AVX512F__)
// On AVX-512: four running maxima; a NaN reaches the exp pass after it as a NaN weight.
template <>
inline float max_of<float>(const float* x, int64_t n, float m) {
  if (n <= 0) return m;
  const float top = max_raw_checked(x, n);
  return std::isnan(top) || std::isnan(m) ? std::numeric_limits<float>::quiet_NaN() : std::max(m, top);
}

// 2^(x - m) in place with the sum.
template <>
inline float exp2_shift_sum<float>(float* x, int64_t n, float m) {
  const __m512 shift = _mm512_set1_ps(-m);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512 e0 = exp2_or_zero(_mm512_add_ps(_mm512_loadu_ps(x + j), shift));
    const __m512 e1 = exp2_or_zero(_mm512_add_ps(_mm512_loadu_ps(x + j + 16), shift));
    _mm512_storeu_ps(x + j, e0);
    _mm512_storeu_ps(x + j + 16, e1);
    acc0 = _mm512_add_ps(acc0, e0);
    acc1 = _mm512_add_ps(acc1, e1);
  }
  for (; j < n; j += 16) {
    const __mmask16 keep = tail_mask(n - j);
    const __m512 e = _mm512_maskz_mov_ps(keep, exp2_or_zero(_mm512_add_ps(_mm512_maskz_loadu_ps(keep, x + j), shift)));
    _mm512_mask_storeu_ps(x + j, keep, e);
    acc0 = _mm512_add_ps(acc0, e);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}
#else
template <>
inline float max_of<float>(const float* x, int64_t n, float m) {
  fVec acc(m);
  int64_t j = 0;
  for (; j + fVec::size() <= n; j += fVec::size()) acc = at::vec::maximum(acc, fVec::loadu(x + j));
  if (j < n) acc = at::vec::maximum(acc, fVec::set(fVec(m), fVec::loadu(x + j, n - j), n - j));
  return at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return at::vec::maximum(a, b); }, acc);
}

template <>
inline float exp2_shift_sum<float>(float* x, int64_t n, float m) {
  fVec acc(0.0f);
  const fVec top(m);
  int64_t j = 0;
  for (; j + fVec::size() <= n; j += fVec::size()) {
    const fVec e = exp2_neg(fVec::loadu(x + j) - top);
    e.store(x + j);
    acc = acc + e;
  }
  if (j < n) {
    const fVec e = exp2_neg(fVec::loadu(x + j, n - j) - top);
    e.store(x + j, n - j);
    acc = acc + fVec::set(fVec(0.0f), e, n - j);
  }
  return at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, acc);
}
#endif

// The forward's softmax pass over a row of raw scores x whose visible columns are [0, n), when nothing transforms
// them: e = 2^(x f - m) with f the factor into log2 units and m a reference in those units (the row's maximum, or
// a running one below it), 0 where dropout drops it, written to out (fp32, or rounded to 16 bits); returns the sum
// of e (undropped, unrounded: the denominator). One pass where scaling, exp-sum and rounding took three over the
// tile.
template <typename scalar_t>
inline float exp2_scaled_round(const float* x, int64_t n, float f, float m, KeepDraws keep, scalar_t* out) {
  float sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    const float e = exp2_neg(x[j] * f - m);
    sum += e;
    out[j] = static_cast<scalar_t>(!keep || keep.kept(j) ? e : 0.0f);
  }
  return sum;
}

#if defined(__AVX512F__)
// 16 fp32 lanes stored as they are (fp32 P for the BLAS) or rounded to 16 bits (to nearest even): bf16 by
// AVX512_BF16 where the build has it (else by the rounding bias on the bit pattern), fp16 by vcvtps2ph.
template <typename out_t>
inline void store_weights(out_t* out, __m512 v, __mmask16 keep) {
  if constexpr (std::is_same_v<out_t, float>) {
    _mm512_mask_storeu_ps(out, keep, v);
  } else {
    __m256i h;
    if constexpr (std::is_same_v<out_t, c10::Half>) {
      h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {
#ifdef __AVX512BF16__
      h = (__m256i)_mm512_cvtneps_pbh(v);
#else
      const __m512i bits = _mm512_castps_si512(v);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
      h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(
          _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16));  // finite values only
#endif
    }
    _mm256_mask_storeu_epi16(out, keep, h);
  }
}

// fp32 weights take the degree-5 exp, 16-bit ones degree 4. No clamp: vscalefps gives 2^x exactly 0 far below the
// reference, and NaN stays NaN.
template <typename scalar_t, int kDegree = std::is_same_v<scalar_t, float> ? 5 : 4>
inline __m512 exp2_scaled_round_avx512(const float* x, int64_t n, float f, float m, KeepDraws keep, scalar_t* out) {
  const __m512 factor = _mm512_set1_ps(f), shift = _mm512_set1_ps(-m);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t j = 0;
  // Two vectors a step: two sums, no chain of adds through one register. Unrolled once more: the step alone ran
  // ~15 % slower (its loop counter, the constants' copies for the FMAs that overwrite them).
#pragma GCC unroll 2
  for (; j + 32 <= n; j += 32) {
    const __m512 x0 = _mm512_loadu_ps(x + j), x1 = _mm512_loadu_ps(x + j + 16);
    const __m512 e0 = exp2_clamped<kDegree>(_mm512_fmadd_ps(x0, factor, shift));
    const __m512 e1 = exp2_clamped<kDegree>(_mm512_fmadd_ps(x1, factor, shift));
    acc0 = _mm512_add_ps(acc0, e0);
    acc1 = _mm512_add_ps(acc1, e1);
    const __mmask32 kept = keep ? keep.kept32(j) : ~__mmask32(0);
    store_weights(out + j, _mm512_maskz_mov_ps(static_cast<__mmask16>(kept), e0), 0xFFFF);
    store_weights(out + j + 16, _mm512_maskz_mov_ps(static_cast<__mmask16>(kept >> 16), e1), 0xFFFF);
  }
  for (; j < n; j += 16) {
    const __mmask16 lanes = tail_mask(n - j);
    const __m512 x0 = _mm512_maskz_loadu_ps(lanes, x + j);
    const __m512 e = _mm512_maskz_mov_ps(lanes, exp2_clamped<kDegree>(_mm512_fmadd_ps(x0, factor, shift)));
    acc0 = _mm512_add_ps(acc0, e);
    store_weights(out + j, _mm512_maskz_mov_ps(keep ? keep.kept16(j, lanes) : lanes, e), lanes);
  }
  return _mm512_add_ps(acc0, acc1);
}

#ifdef __AVX512BF16__
// bf16 weights: two vectors rounded by one vcvtne2ps2bf16 and stored as one, the dropped ones zeroed by its mask
// (the sum is of the undropped weights).
template <bool kDropout>
inline __m512 exp2_scaled_round_bf16(const float* x, int64_t n, float f, float m, KeepDraws keep,
                                     c10::BFloat16* out) {
  const __m512 factor = _mm512_set1_ps(f), shift = _mm512_set1_ps(-m);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t j = 0;
#pragma GCC unroll 2  // (as exp2_scaled_round_avx512's)
  for (; j + 32 <= n; j += 32) {
    const __m512 x0 = _mm512_loadu_ps(x + j), x1 = _mm512_loadu_ps(x + j + 16);
    const __m512 e0 = exp2_clamped<4>(_mm512_fmadd_ps(x0, factor, shift));
    const __m512 e1 = exp2_clamped<4>(_mm512_fmadd_ps(x1, factor, shift));
    acc0 = _mm512_add_ps(acc0, e0);
    acc1 = _mm512_add_ps(acc1, e1);
    if constexpr (kDropout) {
      _mm512_storeu_si512(out + j, (__m512i)_mm512_maskz_cvtne2ps_pbh(keep.kept32(j), e1, e0));
    } else {
      _mm512_storeu_si512(out + j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
  }
  for (; j < n; j += 16) {
    const __mmask16 lanes = tail_mask(n - j);
    const __m512 x0 = _mm512_maskz_loadu_ps(lanes, x + j);
    const __m512 e = _mm512_maskz_mov_ps(lanes, exp2_clamped<4>(_mm512_fmadd_ps(x0, factor, shift)));
    acc0 = _mm512_add_ps(acc0, e);
    store_weights(out + j, kDropout ? _mm512_maskz_mov_ps(keep.kept16(j, lanes), e) : e, lanes);
  }
  return _mm512_add_ps(acc0, acc1);
}
#endif

// The weights' sum in 16 lanes: exp2_scaled_round reduces them, exp2_scaled_round_lanes adds them to a row's.
template <typename scalar_t>
inline __m512 exp2_scaled_round_vector(const float* x, int64_t n, float f, float m, KeepDraws keep, scalar_t* out) {
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    return keep ? exp2_scaled_round_bf16<true>(x, n, f, m, keep, out)
                : exp2_scaled_round_bf16<false>(x, n, f, m, keep, out);
  }
#endif
  return exp2_scaled_round_avx512(x, n, f, m, keep, out);
}
template <>
inline float exp2_scaled_round<c10::BFloat16>(const float* x, int64_t n, float f, float m, KeepDraws keep,
                                              c10::BFloat16* out) {
  return _mm512_reduce_add_ps(exp2_scaled_round_vector(x, n, f, m, keep, out));
}
template <>
inline float exp2_scaled_round<float>(const float* x, int64_t n, float f, float m, KeepDraws keep, float* out) {
  return _mm512_reduce_add_ps(exp2_scaled_round_vector(x, n, f, m, keep, out));
}
template <>
inline float exp2_scaled_round<c10::Half>(const float* x, int64_t n, float f, float m, KeepDraws keep,
                                          c10::Half* out) {
  return _mm512_reduce_add_ps(exp2_scaled_round_vector(x, n, f, m, keep, out));
}

// A row's running sum of weights kept in 16 lanes (`lanes`, 16 floats) while its maximum holds: the horizontal
// sum, a chain of dependent shuffles and adds, then runs once per row (take_lanes) instead of once per tile (a
// few percent of a d=64 forward on AMX). exp2_scaled_round_lanes writes the weights and adds their sum to the lanes,
// unless a lane of the tile's sum passes 2^60 (16 of them: exp2_scaled_round's 2^64) or is NaN: then it returns
// false, the lanes unchanged, and the caller takes its two-pass way.
constexpr bool kLaneSums = true;
template <typename scalar_t>
inline bool exp2_scaled_round_lanes(const float* x, int64_t n, float f, float m, KeepDraws keep, scalar_t* out,
                                    float* lanes) {
  const __m512 sum = exp2_scaled_round_vector(x, n, f, m, keep, out);
  if (_mm512_cmp_ps_mask(sum, _mm512_set1_ps(1152921504606846976.0f), _CMP_LE_OQ) != 0xFFFF) return false;
  _mm512_storeu_ps(lanes, _mm512_add_ps(_mm512_loadu_ps(lanes), sum));
  return true;
}
inline float take_lanes(float* lanes) {
  const float sum = _mm512_reduce_add_ps(_mm512_loadu_ps(lanes));
  _mm512_storeu_ps(lanes, _mm512_setzero_ps());
  return sum;
}
#else
constexpr bool kLaneSums = false;
template <typename scalar_t>
inline bool exp2_scaled_round_lanes(const float*, int64_t, float, float, KeepDraws, scalar_t*, float*) {
  return false;
}
inline float take_lanes(float*) { return 0; }
#endif

// x *= factor over a row.
inline void scale_row(float* x, int64_t n, float factor) {
  at::vec::map([factor](fVec v) { return v * fVec(factor); }, x, x, n);
}

// A row of fp32 values rounded to 16 bits (to nearest even, as the GPU kernels round P and dS).
template <typename scalar_t>
inline void round_row(const float* x, int64_t n, scalar_t* out) {
  at::vec::convert(x, out, n);
}

}  // namespace flash_cpu
