// The dropout generator of the CPU kernels: Triton's tl.rand (Philox4x32-10) in a scalar form and on AVX2 and
// AVX-512 intrinsics where the compiler targets them (it needs 32x32->64-bit products), and the keep factors of a
// row drawn from it, bit-identical to the GPU kernels' masks.
#pragma once

#include <cstdint>
#include <type_traits>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace flash_cpu {

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

#if defined(__AVX512F__)
// mul_hi_lo8 on 16 lanes.
inline void mul_hi_lo16(__m512i c, __m512i m, __m512i* hi, __m512i* lo) {
  const __m512i even = _mm512_mul_epu32(c, m);
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(c, 32), m);
  *lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
  *hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
}

// philox_uniform8 on 16 lanes: the 16 G counters offset .. offset + 16G - 1 into u (the same numbers).
template <int G>
inline void philox_uniform16(uint64_t seed, uint64_t offset, float* u) {
  __m512i c0[G], c1[G], c2[G], c3[G];
  const __m512i ma = _mm512_set1_epi32(static_cast<int>(kPhiloxA)), mb = _mm512_set1_epi32(static_cast<int>(kPhiloxB));
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int g = 0; g < G; ++g) {
    const uint64_t first = offset + 16 * g;
    const __m512i first_low = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(first)));
    const __m512i first_high = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(first >> 32)));
    const __m512i low = _mm512_add_epi32(first_low, lanes);
    // A lane whose low word wrapped past 2^32 carries into the high word.
    const __mmask16 carried = _mm512_cmplt_epu32_mask(low, first_low);
    const __m512i high = _mm512_mask_add_epi32(first_high, carried, first_high, _mm512_set1_epi32(1));
    __m512i ha, la;  // round 0 with c2 = c3 = 0: the B product is 0, so one multiply
    mul_hi_lo16(low, ma, &ha, &la);
    c0[g] = _mm512_xor_si512(high, _mm512_set1_epi32(static_cast<int>(k0)));
    c2[g] = _mm512_xor_si512(ha, _mm512_set1_epi32(static_cast<int>(k1)));
    c1[g] = _mm512_setzero_si512();
    c3[g] = la;
  }
  k0 += kKeyA;
  k1 += kKeyB;
  for (int round = 1; round < 10; ++round) {
    const __m512i key0 = _mm512_set1_epi32(static_cast<int>(k0)), key1 = _mm512_set1_epi32(static_cast<int>(k1));
    for (int g = 0; g < G; ++g) {
      __m512i hb, lb, ha, la;
      mul_hi_lo16(c2[g], mb, &hb, &lb);
      mul_hi_lo16(c0[g], ma, &ha, &la);
      c0[g] = _mm512_ternarylogic_epi32(hb, c1[g], key0, 0x96);  // three-way xor
      c2[g] = _mm512_ternarylogic_epi32(ha, c3[g], key1, 0x96);
      c1[g] = lb;
      c3[g] = la;
    }
    k0 += kKeyA;
    k1 += kKeyB;
  }
  for (int g = 0; g < G; ++g) {
    const __m512i folded = _mm512_xor_si512(c0[g], _mm512_srai_epi32(c0[g], 31));  // x < 0 -> ~x
    _mm512_storeu_ps(u + 16 * g, _mm512_mul_ps(_mm512_cvtepi32_ps(folded), _mm512_set1_ps(4.6566127342e-10f)));
  }
}
#endif

// z[j] = keep (1 / (1 - p)) where counter base + j survives dropout p, else 0.
template <typename T>
inline void dropout_factors(uint64_t seed, uint64_t base, int64_t n, float p, T keep, T* z) {
  int64_t j = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    alignas(64) float u[64];
    const __m512 threshold = _mm512_set1_ps(p), kept = _mm512_set1_ps(keep);
    for (; j + 64 <= n; j += 64) {
      philox_uniform16<4>(seed, base + j, u);
      for (int l = 0; l < 64; l += 16) {
        const __mmask16 survives = _mm512_cmp_ps_mask(_mm512_load_ps(u + l), threshold, _CMP_GE_OQ);
        _mm512_storeu_ps(z + j + l, _mm512_maskz_mov_ps(survives, kept));
      }
    }
  }
#endif
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
