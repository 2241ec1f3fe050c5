// The dropout generator of the CPU kernels, the same numbers as flashattn/backends/philox.py and the Triton kernels'
// dropout_keep: element (r, j) (row r of ncols key columns) takes the 16-bit half j & 1 of word (j >> 1) & 3 of
// Philox4x32-10 on counter r * ceil(ncols / 8) + (j >> 3) (Triton's tl.randint4x), and is kept when that draw /
// 2^16 >= p. One call serves eight columns of a row.
// In a scalar form, and on AVX2 and AVX-512 intrinsics where the compiler targets them (it needs 32x32->64-bit
// products): 32 calls side by side, their words laid out in the elements' order.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace flash_cpu {

constexpr uint32_t kPhiloxA = 0xD2511F53u, kPhiloxB = 0xCD9E8D57u, kKeyA = 0x9E3779B9u, kKeyB = 0xBB67AE85u;

// The four words of Philox4x32-10 on counter (call low, call high, 0, 0) with key seed, in the elements' order.
inline void philox_words(uint64_t seed, uint64_t call, uint32_t out[4]) {
  uint32_t c0 = static_cast<uint32_t>(call), c1 = static_cast<uint32_t>(call >> 32), c2 = 0, c3 = 0;
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
  out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

inline uint64_t calls_per_row(uint64_t ncols) { return (ncols + 7) / 8; }

// The draw of element (row, col): a 16-bit number (philox.py's dropout_draws).
inline uint32_t dropout_draw(uint64_t seed, uint64_t row, uint64_t ncols, uint64_t col) {
  uint32_t words[4];
  philox_words(seed, row * calls_per_row(ncols) + (col >> 3), words);
  return (words[(col >> 1) & 3] >> (16 * (col & 1))) & 0xFFFFu;
}

// The draws of the 8 * kCalls elements of calls first .. first + kCalls - 1, in the elements' order (16-bit words).
#if defined(__AVX512F__)
constexpr int64_t kCalls = 32;

// A 64-bit lane's high word in its low 32 bits: the two words swapped (vpshufd runs beside the multiplies, where a
// shift would queue behind them on the same port: a fifth off the generator on a Xeon).
inline __m512i high_word(__m512i x) { return _mm512_shuffle_epi32(x, _MM_PERM_CDAB); }

// Each call's state in a 64-bit lane, 8 calls a vector: vpmuludq reads the low 32 bits of a lane and writes the
// whole 64-bit product, so a product's high word is one swap away (high_word) and its low word is the product (the
// high 32 bits of a lane are never read as a word: every word is XORed, multiplied or stored from the low 32).
// G groups (up to four) interleaved so that one's products run under the others'.
template <int G>
__attribute__((always_inline)) inline void philox_groups(uint64_t seed, uint64_t first, uint16_t* draws) {
  __m512i c0[G], c1[G], c2[G], c3[G];
  const __m512i ma = _mm512_set1_epi64(kPhiloxA), mb = _mm512_set1_epi64(kPhiloxB);
  const __m512i lanes = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int g = 0; g < G; ++g) {
    const __m512i call = _mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(first + 8 * g)), lanes);
    const __m512i pa = _mm512_mul_epu32(call, ma);  // round 0 with c2 = c3 = 0: the B product is 0
    c0[g] = _mm512_xor_si512(_mm512_srli_epi64(call, 32), _mm512_set1_epi64(k0));
    c2[g] = _mm512_xor_si512(high_word(pa), _mm512_set1_epi64(k1));
    c1[g] = _mm512_setzero_si512();
    c3[g] = pa;
  }
  k0 += kKeyA;
  k1 += kKeyB;
  for (int round = 1; round < 10; ++round) {
    const __m512i key0 = _mm512_set1_epi64(k0), key1 = _mm512_set1_epi64(k1);
    for (int g = 0; g < G; ++g) {
      const __m512i pb = _mm512_mul_epu32(c2[g], mb), pa = _mm512_mul_epu32(c0[g], ma);
      c0[g] = _mm512_ternarylogic_epi32(high_word(pb), c1[g], key0, 0x96);  // three-way xor
      c2[g] = _mm512_ternarylogic_epi32(high_word(pa), c3[g], key1, 0x96);
      c1[g] = pb;
      c3[g] = pa;
    }
    k0 += kKeyA;
    k1 += kKeyB;
  }
  // Call c's words (c0, c1, c2, c3) side by side: (c0, c1) and (c2, c3) paired in 64-bit lanes (c1's low word
  // swapped into the odd dword by a masked shuffle), then the pairs of calls 0-3 and 4-7 interleaved: four uops for
  // 64 draws.
  const __m512i first_half = _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11);
  const __m512i second_half = _mm512_setr_epi64(4, 12, 5, 13, 6, 14, 7, 15);
  for (int g = 0; g < G; ++g) {
    const __m512i w01 = _mm512_mask_shuffle_epi32(c0[g], 0xAAAA, c1[g], _MM_PERM_CDAB);
    const __m512i w23 = _mm512_mask_shuffle_epi32(c2[g], 0xAAAA, c3[g], _MM_PERM_CDAB);
    _mm512_storeu_si512(draws + 64 * g, _mm512_permutex2var_epi64(w01, first_half, w23));
    _mm512_storeu_si512(draws + 64 * g + 32, _mm512_permutex2var_epi64(w01, second_half, w23));
  }
}
// The draws of at least `calls` calls from first on (up to kCalls): the groups of 8 calls they need.
inline void philox_draws(uint64_t seed, uint64_t first, uint16_t* draws, int64_t calls) {
  switch ((std::min<int64_t>(calls, kCalls) + 7) / 8) {
    case 1: return philox_groups<1>(seed, first, draws);
    case 2: return philox_groups<2>(seed, first, draws);
    case 3: return philox_groups<3>(seed, first, draws);
    default: return philox_groups<4>(seed, first, draws);
  }
}
#elif defined(__AVX2__)
constexpr int64_t kCalls = 32;

// (high, low) 32 bits of the products m * c, lane by lane: vpmuludq on the even lanes, then the odd ones.
inline void mul_hi_lo8(__m256i c, __m256i m, __m256i* hi, __m256i* lo) {
  const __m256i even = _mm256_mul_epu32(c, m);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(c, 32), m);
  *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

// 8 lanes a group, four groups interleaved (the multiplies' latency); the words transposed through memory. All 32
// calls whatever `calls` says (the AVX2 build serves hosts without AVX-512 alone).
inline void philox_draws(uint64_t seed, uint64_t first, uint16_t* draws, int64_t /*calls*/) {
  constexpr int G = 4;
  __m256i c0[G], c1[G], c2[G], c3[G];
  const __m256i ma = _mm256_set1_epi32(static_cast<int>(kPhiloxA)), mb = _mm256_set1_epi32(static_cast<int>(kPhiloxB));
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int g = 0; g < G; ++g) {
    alignas(32) uint32_t lo[8], hi[8];
    for (int l = 0; l < 8; ++l) {
      const uint64_t call = first + 8 * g + l;
      lo[l] = static_cast<uint32_t>(call), hi[l] = static_cast<uint32_t>(call >> 32);
    }
    __m256i ha, la;  // round 0 with c2 = c3 = 0: the B product is 0, so one multiply
    mul_hi_lo8(_mm256_load_si256(reinterpret_cast<const __m256i*>(lo)), ma, &ha, &la);
    c0[g] = _mm256_xor_si256(_mm256_load_si256(reinterpret_cast<const __m256i*>(hi)),
                             _mm256_set1_epi32(static_cast<int>(k0)));
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
  alignas(32) uint32_t words[4][8];
  uint32_t* out = reinterpret_cast<uint32_t*>(draws);
  for (int g = 0; g < G; ++g) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(words[0]), c0[g]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(words[1]), c1[g]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(words[2]), c2[g]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(words[3]), c3[g]);
    for (int l = 0; l < 8; ++l) {
      for (int w = 0; w < 4; ++w) out[(8 * g + l) * 4 + w] = words[w][l];
    }
  }
}
#else
constexpr int64_t kCalls = 1;

inline void philox_draws(uint64_t seed, uint64_t first, uint16_t* draws, int64_t /*calls*/) {
  uint32_t words[4];
  philox_words(seed, first, words);
  std::memcpy(draws, words, sizeof(words));  // little-endian: each word's low half first
}
#endif

// An element survives dropout p when its draw >= 2^16 p, i.e. at least this (exact: p is a float; 65536 where p
// rounds up to 1: nothing survives).
inline uint32_t dropout_threshold(float p) {
  const double scaled = std::ceil(static_cast<double>(p) * 65536.0);
  return scaled <= 0 ? 0u : static_cast<uint32_t>(std::min(scaled, 65536.0));
}

// Room for the draws of n columns from any first column: whole batches of kCalls calls.
inline constexpr int64_t dropout_draws_room(int64_t n) {
  return (n + 7 + 8 * kCalls - 1) / (8 * kCalls) * 8 * kCalls;
}

// The draws of columns c0 .. c0 + n of `row` (16-bit, in the columns' order): the calls from the one holding
// column c0 on, written to buf (dropout_draws_room(n) entries); returns where column c0's draw lies in it. The
// forward compares them with the threshold inside its softmax pass (no factors stored and read back).
inline const uint16_t* dropout_draws(uint64_t seed, uint64_t row, uint64_t ncols, uint64_t c0, int64_t n,
                                     uint16_t* buf) {
  const uint64_t first = row * calls_per_row(ncols) + (c0 >> 3);
  const int64_t calls = (static_cast<int64_t>(c0 & 7) + n + 7) / 8;
  for (int64_t done = 0; done < calls; done += kCalls) {
    philox_draws(seed, first + static_cast<uint64_t>(done), buf + 8 * done, calls - done);
  }
  return buf + (c0 & 7);
}

// Dropout in the forward's pass: column j of a row is kept where draws[j] >= threshold (dropout_draws and
// dropout_threshold); no draws: no dropout. The pass writes a kept weight as it is and a dropped one as
// 0, and the forward scales its output by 1 / (1 - p) once per row: a compare and a zero-masking on the draws in
// place of a factor per element stored, read back and multiplied (a sixth of a bf16 forward's time with dropout).
struct KeepDraws {
  const uint16_t* draws = nullptr;
  uint32_t threshold = 0;

  explicit operator bool() const { return draws != nullptr; }
  bool kept(int64_t j) const { return draws[j] >= threshold; }
  KeepDraws operator+(int64_t j) const { return draws == nullptr ? *this : KeepDraws{draws + j, threshold}; }
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  // Lanes j .. j + 31 (j .. j + 15) kept; a threshold of 65536 keeps none.
  __mmask32 kept32(int64_t j) const {
    if (threshold > 0xFFFFu) return 0;
    return _mm512_cmpge_epu16_mask(_mm512_loadu_si512(draws + j), _mm512_set1_epi16(static_cast<short>(threshold)));
  }
  __mmask16 kept16(int64_t j, __mmask16 lanes) const {
    if (threshold > 0xFFFFu) return 0;
    return _mm256_mask_cmpge_epu16_mask(lanes, _mm256_maskz_loadu_epi16(lanes, draws + j),
                                        _mm256_set1_epi16(static_cast<short>(threshold)));
  }
#elif defined(__AVX512F__)
  __mmask32 kept32(int64_t j) const {
    uint32_t bits = 0;
    for (int l = 0; l < 32; ++l) bits |= static_cast<uint32_t>(kept(j + l)) << l;
    return bits;
  }
  __mmask16 kept16(int64_t j, __mmask16 lanes) const {
    uint32_t bits = 0;
    for (int l = 0; l < 16; ++l) bits |= static_cast<uint32_t>((lanes >> l) & 1 && kept(j + l)) << l;
    return static_cast<__mmask16>(bits);
  }
#endif
};

// z[j] = keep (1 / (1 - p)) where element (row, c0 + j) survives dropout p, else 0 (the backward's factors: its
// pass reads each twice): the draws of 8 kCalls columns at a time, compared as the forward's pass compares them.
template <typename T>
inline void dropout_factors(uint64_t seed, uint64_t row, uint64_t ncols, uint64_t c0, int64_t n, float p, T keep,
                            T* z) {
  constexpr int64_t kChunk = 8 * kCalls;
  alignas(64) uint16_t buf[dropout_draws_room(kChunk)];
  const uint32_t threshold = dropout_threshold(p);
  for (int64_t j = 0; j < n; j += kChunk) {
    const int64_t count = std::min(kChunk, n - j);
    const KeepDraws draws{dropout_draws(seed, row, ncols, c0 + static_cast<uint64_t>(j), count, buf), threshold};
    int64_t e = 0;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>) {
      const __m512 kept = _mm512_set1_ps(keep);
      for (; e + 32 <= count; e += 32) {
        const __mmask32 survives = draws.kept32(e);
        _mm512_storeu_ps(z + j + e, _mm512_maskz_mov_ps(static_cast<__mmask16>(survives), kept));
        _mm512_storeu_ps(z + j + e + 16, _mm512_maskz_mov_ps(static_cast<__mmask16>(survives >> 16), kept));
      }
    }
#endif
    for (; e < count; ++e) z[j + e] = draws.kept(e) ? keep : T(0);
  }
}

}  // namespace flash_cpu
