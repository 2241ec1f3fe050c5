// Row arithmetic of the CPU kernels: exp2 for the softmax, max and exp-sum passes, tanh for softcap, and the
// dropout generator, each in a scalar form and, for float, on 8-wide vectors (GCC/Clang vector extensions for any
// target; Philox on AVX2 intrinsics where the compiler targets them, since it needs 32x32->64-bit products).
#pragma once

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

// The two passes of the online softmax over a row: its maximum, then x = 2^(x - m) with their sum. The float
// versions are written on 8-wide vectors (GCC/Clang vector extensions, any target): the compiler does not
// vectorize a max reduction that must keep -inf and NaN semantics.
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

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline f32x8 exp2_neg8(f32x8 x) {  // exp2_neg on 8 lanes
  const f32x8 xc = x > -126.0f ? x : f32x8{} - 126.0f;
  f32x8 xi = __builtin_convertvector(__builtin_convertvector(xc, i32x8), f32x8);  // truncation, then floor
  xi += __builtin_convertvector(xi > xc, f32x8);  // true is -1
  const f32x8 f = xc - xi;
  f32x8 p = f * 1.8775767e-3f + 8.9893397e-3f;
  p = p * f + 5.5826318e-2f;
  p = p * f + 2.4015361e-1f;
  p = p * f + 6.9315308e-1f;
  p = p * f + 9.9999994e-1f;
  const i32x8 bits = (__builtin_convertvector(xi, i32x8) + 127) << 23;
  const f32x8 r = p * reinterpret_cast<const f32x8&>(bits);
  return reinterpret_cast<f32x8>(reinterpret_cast<const i32x8&>(r) & (x >= -126.0f));
}

template <>
inline float max_of<float>(const float* x, int64_t n, float m) {
  f32x8 acc = f32x8{} + m;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const f32x8 v = load8(x + j);
    acc = v > acc ? v : acc;
  }
  for (int u = 0; u < 8; ++u) m = std::max(m, acc[u]);
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

template <>
inline float exp2_shift_sum<float>(float* x, int64_t n, float m) {
  f32x8 acc{};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const f32x8 e = exp2_neg8(load8(x + j) - m);
    std::memcpy(x + j, &e, sizeof(e));
    acc += e;
  }
  float sum = 0;
  for (int u = 0; u < 8; ++u) sum += acc[u];
  for (; j < n; ++j) {
    x[j] = exp2_neg(x[j] - m);
    sum += x[j];
  }
  return sum;
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

inline f32x8 tanh8(f32x8 x) {
  const f32x8 a = x < 0.0f ? -x : x;
  const f32x8 e = exp2_neg8(a * -2.8853900817779268f);  // -2 log2(e)
  const f32x8 r = (1.0f - e) / (1.0f + e);
  return x < 0.0f ? -r : r;
}

template <>
inline void tanh_scaled<float>(float* s, float* t, int64_t n, float cap) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const f32x8 v = tanh8(load8(s + j));
    if (t != nullptr) std::memcpy(t + j, &v, sizeof(v));
    const f32x8 out = v * cap;
    std::memcpy(s + j, &out, sizeof(out));
  }
  for (; j < n; ++j) {
    const f32x8 v = tanh8(f32x8{} + s[j]);
    if (t != nullptr) t[j] = v[0];
    s[j] = cap * v[0];
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
