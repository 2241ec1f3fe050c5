// Row arithmetic of the CPU kernels: exp2 for the softmax, max and exp-sum passes, tanh for softcap, scaling and
// rounding a row, and the dropout generator, each in a scalar form and, for float, on ATen's at::vec::Vectorized
// (16 lanes where the build targets AVX-512, 8 on AVX2: cpu_build.py defines CPU_CAPABILITY to match the host);
// Philox on AVX2 intrinsics where the compiler targets them, since it needs 32x32->64-bit products.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace flash_cpu {

constexpr double kLog2e = 1.4426950408889634;
using fVec = at::vec::Vectorized<float>;
using iVec = at::vec::Vectorized<int32_t>;

// 2^x for x <= 0 (a score minus its row maximum); exactly 0 below 2^-126 and for -inf. Relative error below 3e-7;
// no calls or branches, so the loops that use it vectorize.
inline float exp2_neg(float x) {
  const float xc = std::max(x, -126.0f);
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
  return x >= -126.0f ? p * scale : 0.0f;
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
  return fVec::blendv(fVec(0.0f), r, x >= lowest);
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

// x *= factor over a row.
inline void scale_row(float* x, int64_t n, float factor) {
  at::vec::map([factor](fVec v) { return v * fVec(factor); }, x, x, n);
}

// A row of fp32 values rounded to 16 bits (to nearest even, as the GPU kernels round P and dS).
template <typename scalar_t>
inline void round_row(const float* x, int64_t n, scalar_t* out) {
  at::vec::convert(x, out, n);
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

// Triton's tl.rand(seed, offset): Philox4x32-10 on counter (offset low, offset high, 0, 0), first word, folded to
// a non-negative int32 and scaled into [0, 1). The same function as flashattn/backends/philox.py.
constexpr uint32_t kPhiloxA = 0xD2511F53u, kPhiloxB = 0xCD9E8D57u, kKeyA = 0x9E3779B9u, kKeyB = 0xBB67AE85u;

inline float philox_uniform(uint64_t seed, uint64_t offset) {
  uint32_t c0 = static_cast<uint32_t>(offset), c1 = static_cast<uint32_t>(offset >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t pb = static_cast<uint64_t>(kPhiloxB) * c2;
    const uint64_t pa = static_cast<uint64_t>(kPhiloxA) * c0;
    const uint32_t n0 = static_cast<uint32_t>(pb >> 32) ^ c1 ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(pa >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(pb);
    c3 = static_cast<uint32_t>(pa);
    c0 = n0;
    c2 = n2;
    k0 += kKeyA;
    k1 += kKeyB;
  }
  const int32_t x = static_cast<int32_t>(c0);
  return static_cast<float>(x < 0 ? ~x : x) * 4.6566127342e-10f;  // ~x = -x - 1 without overflow
}

#ifdef __AVX2__
// (high, low) 32 bits of the products m * c, lane by lane: vpmuludq on the even lanes, then the odd ones.
inline void mul_hi_lo8(__m256i c, __m256i m, __m256i* hi, __m256i* lo) {
  const __m256i even = _mm256_mul_epu32(c, m);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(c, 32), m);
  *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

// philox_uniform for the 8 * G counters offset .. offset + 8G - 1 into u. G independent groups interleave, so
// the rounds' multiply latency is hidden (one group alone waits on each round).
template <int G>
inline void philox_uniform8(uint64_t seed, uint64_t offset, float* u) {
  __m256i c0[G], c1[G], c2[G], c3[G];
  const __m256i ma = _mm256_set1_epi32(static_cast<int>(kPhiloxA)), mb = _mm256_set1_epi32(static_cast<int>(kPhiloxB));
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  const bool no_carry = (offset & 0xFFFFFFFFu) + 8 * G - 1 <= 0xFFFFFFFFu;  // the low words do not wrap
  for (int g = 0; g < G; ++g) {
    if (no_carry) {
      c0[g] = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset + 8 * g))),
                               _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      c1[g] = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset >> 32)));
    } else {
      alignas(32) uint32_t lo[8], hi[8];
      for (int l = 0; l < 8; ++l) {
        const uint64_t c = offset + 8 * g + l;
        lo[l] = static_cast<uint32_t>(c), hi[l] = static_cast<uint32_t>(c >> 32);
      }
      c0[g] = _mm256_load_si256(reinterpret_cast<const __m256i*>(lo));
      c1[g] = _mm256_load_si256(reinterpret_cast<const __m256i*>(hi));
    }
    // Round 0 with c2 = c3 = 0: the B product is 0, so one multiply.
    __m256i ha, la;
    mul_hi_lo8(c0[g], ma, &ha, &la);
    c0[g] = _mm256_xor_si256(c1[g], _mm256_set1_epi32(static_cast<int>(k0)));
    c2[g] = _mm256_xor_si256(ha, _mm256_set1_epi32(static_cast<int>(k1)));
    c1[g] = _mm256_setzero_si256();
    c3[g] = la;
  }
  k0 += kKeyA;
  k1 += kKeyB;
  for (int round = 1; round < 10; ++round) {
    const __m256i key0 = _mm256_set1_epi32(static_cast<int>(k0)), key1 = _mm256_set1_epi32(static_cast<int>(k1));
    for (int g = 0; g < G; ++g) {
      __m256i hb, lb, ha, la;
      mul_hi_lo8(c2[g], mb, &hb, &lb);
      mul_hi_lo8(c0[g], ma, &ha, &la);
      c0[g] = _mm256_xor_si256(_mm256_xor_si256(hb, c1[g]), key0);
      c2[g] = _mm256_xor_si256(_mm256_xor_si256(ha, c3[g]), key1);
      c1[g] = lb;
      c3[g] = la;
    }
    k0 += kKeyA;
    k1 += kKeyB;
  }
  for (int g = 0; g < G; ++g) {
    const __m256i folded = _mm256_xor_si256(c0[g], _mm256_srai_epi32(c0[g], 31));  // x < 0 -> ~x
    _mm256_storeu_ps(u + 8 * g, _mm256_mul_ps(_mm256_cvtepi32_ps(folded), _mm256_set1_ps(4.6566127342e-10f)));
  }
}
#endif

// z[j] = keep (1 / (1 - p)) where counter base + j survives dropout p, else 0.
template <typename T>
inline void dropout_factors(uint64_t seed, uint64_t base, int64_t n, float p, T keep, T* z) {
  int64_t j = 0;
#ifdef __AVX2__
  alignas(32) float u[32];
  for (; j + 32 <= n; j += 32) {
    philox_uniform8<4>(seed, base + j, u);
    for (int l = 0; l < 32; ++l) z[j + l] = u[l] >= p ? keep : T(0);
  }
  for (; j + 8 <= n; j += 8) {
    philox_uniform8<1>(seed, base + j, u);
    for (int l = 0; l < 8; ++l) z[j + l] = u[l] >= p ? keep : T(0);
  }
#endif
  for (; j < n; ++j) z[j] = philox_uniform(seed, base + j) >= p ? keep : T(0);
}

}  // namespace flash_cpu
