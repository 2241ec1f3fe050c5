// FP8 keys and values (an FP8 KV cache): each tile's rows are widened into the queries' 16-bit (or fp32) type as
// they are read, never the whole cache. e4m3fn and e5m2 values are exact in bf16, fp16 and fp32, so the widening
// loses nothing; the descales are applied outside the tile products (q's and k's to the scores, v's to each output
// row). Vector code on x86 (AVX-512 or AVX2 with F16C), exact integer code elsewhere and for tails.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace flash_cpu {

enum class KvFormat : int { same = 0, e4m3fn = 1, e5m2 = 2 };

// The fp32 bits of an FP8 byte, branch-free so that the loops below vectorise, and without a float operation on
// a subnormal operand (an x86 core takes a microcode assist for each, ~100 cycles): a normal value's exponent is
// rebiased with an integer add; a subnormal one (exponent 0) is its mantissa, converted, times 2^(1 - bias - m).
template <KvFormat F>
inline uint32_t fp8_float_bits(uint32_t byte) {
  constexpr bool kE4M3 = F == KvFormat::e4m3fn;
  constexpr int kMantissa = kE4M3 ? 3 : 2, kBias = kE4M3 ? 7 : 15;
  constexpr uint32_t kExponentMask = kE4M3 ? 0x78u : 0x7cu;
  constexpr float kSubnormalUnit = kE4M3 ? 0x1p-9f : 0x1p-16f;  // 2^(1 - bias - mantissa bits)
  const uint32_t magnitude = byte & 0x7fu;
  const uint32_t normal = (magnitude << (23 - kMantissa)) + (static_cast<uint32_t>(127 - kBias) << 23);
  const float small = static_cast<float>(static_cast<int32_t>(magnitude)) * kSubnormalUnit;  // exact
  uint32_t small_bits;
  std::memcpy(&small_bits, &small, sizeof(float));
  uint32_t bits = (byte & kExponentMask) == 0 ? small_bits : normal;
  if constexpr (kE4M3) {  // s eeee mmm: 0x7f is NaN, there is no inf
    bits = magnitude == 0x7fu ? 0x7fc00000u : bits;
  } else {  // s eeeee mm (fp16's top byte): exponent 31 is inf (mantissa 0) or NaN
    bits = (byte & 0x7cu) == 0x7cu ? ((byte & 0x03u) != 0 ? 0x7fc00000u : 0x7f800000u) : bits;
  }
  return bits | ((byte & 0x80u) << 24);
}

// The bf16 bits of an FP8 byte in 16-bit integer operations only (twice the lanes of the fp32 route): a normal
// value's exponent rebiased, a subnormal one (mantissa m, exponent 0) normalised by comparisons on m.
template <KvFormat F>
inline uint16_t fp8_bf16_bits(uint16_t byte) {
  constexpr bool kE4M3 = F == KvFormat::e4m3fn;
  const uint16_t sign = static_cast<uint16_t>((byte & 0x80u) << 8), magnitude = byte & 0x7fu;
  uint16_t bits;
  if constexpr (kE4M3) {  // bias 7 -> 127: +120 in the exponent; subnormal m * 2^-9
    const uint16_t normal = static_cast<uint16_t>((magnitude << 4) + (120u << 7));
    const uint16_t m = magnitude & 0x07u;
    const uint16_t small = m >= 4 ? static_cast<uint16_t>((120u << 7) | ((m - 4u) << 5))
                           : m >= 2 ? static_cast<uint16_t>((119u << 7) | ((m - 2u) << 6))
                           : m == 1 ? static_cast<uint16_t>(118u << 7) : uint16_t(0);
    bits = (magnitude & 0x78u) == 0 ? small : normal;
    bits = magnitude == 0x7fu ? uint16_t(0x7fc0u) : bits;  // NaN; there is no inf
  } else {  // bias 15 -> 127: +112; subnormal m * 2^-16; exponent 31: inf or NaN
    const uint16_t normal = static_cast<uint16_t>((magnitude << 5) + (112u << 7));
    const uint16_t m = magnitude & 0x03u;
    const uint16_t small = m >= 2 ? static_cast<uint16_t>((112u << 7) | ((m - 2u) << 6))
                           : m == 1 ? static_cast<uint16_t>(111u << 7) : uint16_t(0);
    bits = (magnitude & 0x7cu) == 0 ? small : normal;
    bits = (magnitude & 0x7cu) == 0x7cu ? static_cast<uint16_t>(0x7f80u | ((magnitude & 0x03u) << 5)) : bits;
  }
  return static_cast<uint16_t>(bits | sign);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FLASHATTN_FP8_TABLE 1
// AVX-512: FP8 to 16 bits by table: the 16-bit bits of every magnitude 0..127 in four vectors of 32 words, two
// permutations (vpermi2w, 64 entries each) and a blend per 32 elements, the sign bit put back on top. Exact for
// every byte, NaN and subnormals included, and about 7 instructions per 32 elements; fp32 is bf16's bits shifted.
template <KvFormat F, typename scalar_t>
struct Fp8Table {
  __m512i part[4];
  Fp8Table() {
    alignas(64) uint16_t bits[128];
    for (uint16_t m = 0; m < 128; ++m) {
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        bits[m] = fp8_bf16_bits<F>(m);
      } else {
        const uint32_t wide = fp8_float_bits<F>(m);
        float value;
        std::memcpy(&value, &wide, sizeof(float));
        const c10::Half half(value);  // exact
        std::memcpy(&bits[m], &half, sizeof(uint16_t));
      }
    }
    for (int i = 0; i < 4; ++i) part[i] = _mm512_load_si512(bits + 32 * i);
  }
};
template <KvFormat F, typename scalar_t>
const Fp8Table<F, scalar_t>& fp8_table() {
  static const Fp8Table<F, scalar_t> table;
  return table;
}
// 32 FP8 bytes as 32 16-bit elements of scalar_t.
template <KvFormat F, typename scalar_t>
__attribute__((always_inline)) inline __m512i fp8_words(__m256i bytes, const Fp8Table<F, scalar_t>& table) {
  const __m512i w = _mm512_cvtepu8_epi16(bytes);
  const __m512i low = _mm512_permutex2var_epi16(table.part[0], w, table.part[1]);  // index bits 0-5
  const __m512i high = _mm512_permutex2var_epi16(table.part[2], w, table.part[3]);
  const __m512i magnitude = _mm512_mask_mov_epi16(low, _mm512_test_epi16_mask(w, _mm512_set1_epi16(0x40)), high);
  return _mm512_ternarylogic_epi32(magnitude, _mm512_slli_epi16(w, 8), _mm512_set1_epi16(-0x8000), 0xf8);
}

template <KvFormat F, typename scalar_t>
void widen_vector(const uint8_t* src, scalar_t* dst, int64_t n) {  // every element, the tail masked
  using word_t = std::conditional_t<std::is_same_v<scalar_t, float>, c10::BFloat16, scalar_t>;
  const Fp8Table<F, word_t>& table = fp8_table<F, word_t>();
  for (int64_t j = 0; j < n; j += 32) {
    const __mmask32 m = n - j >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1u << (n - j)) - 1u);
    const __m512i words = fp8_words<F>(_mm256_maskz_loadu_epi8(m, src + j), table);
    if constexpr (std::is_same_v<scalar_t, float>) {  // bf16's bits are fp32's top half
      const __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(words));
      const __m512i hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(words, 1));
      _mm512_mask_storeu_epi32(dst + j, static_cast<__mmask16>(m), _mm512_slli_epi32(lo, 16));
      _mm512_mask_storeu_epi32(dst + j + 16, static_cast<__mmask16>(m >> 16), _mm512_slli_epi32(hi, 16));
    } else {
      _mm512_mask_storeu_epi16(dst + j, m, words);
    }
  }
}
#elif defined(__AVX2__) && defined(__F16C__)
#define FLASHATTN_FP8_F16C 1
// AVX2 (x86-64-v3 has F16C): through fp16, whose conversion to fp32 the hardware does exactly, subnormals
// included: an e5m2 byte is fp16's top byte; an e4m3fn byte's magnitude shifted into fp16's exponent and mantissa
// fields is the value times 2^-8, the sign bit on top, and a multiply by 2^8 of the (then normal) fp32 restores
// it. 0x7f (NaN, which would read as 480) is patched.
template <KvFormat F>
__attribute__((always_inline)) inline __m256 fp8_lanes_to_float(__m128i bytes) {  // the low 8 bytes
  const __m128i w = _mm_cvtepu8_epi16(bytes);
  if constexpr (F == KvFormat::e5m2) {
    return _mm256_cvtph_ps(_mm_slli_epi16(w, 8));
  } else {
    const __m128i magnitude = _mm_and_si128(w, _mm_set1_epi16(0x7f));
    const __m128i half = _mm_or_si128(_mm_slli_epi16(magnitude, 7),
                                      _mm_and_si128(_mm_slli_epi16(w, 8), _mm_set1_epi16(-0x8000)));
    const __m256 x = _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.0f));
    const __m256 nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm_cmpeq_epi16(magnitude, _mm_set1_epi16(0x7f))));
    return _mm256_blendv_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan);
  }
}

template <KvFormat F, typename scalar_t>
void widen_vector(const uint8_t* src, scalar_t* dst, int64_t n) {  // whole groups of 8; returns before the tail
  for (int64_t j = 0; j + 8 <= n; j += 8) {
    const __m256 x = fp8_lanes_to_float<F>(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + j)));
    if constexpr (std::is_same_v<scalar_t, float>) {
      _mm256_storeu_ps(dst + j, x);
    } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {  // exact in bf16: its top half
      const __m256i top = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j),
                       _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1)));
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    }
  }
}
#endif

// n FP8 values from src into dst, exactly: vector code on x86 (the table on AVX-512, F16C on AVX2) for fp32, bf16
// and fp16, the integer code above for the rest (the AVX2 tail, other CPUs, fp64).
template <KvFormat F, typename scalar_t>
void widen_fp8_as(const uint8_t* src, scalar_t* dst, int64_t n) {
  int64_t j = 0;
#if defined(FLASHATTN_FP8_TABLE) || defined(FLASHATTN_FP8_F16C)
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16> ||
                std::is_same_v<scalar_t, c10::Half>) {
    widen_vector<F>(src, dst, n);
#if defined(FLASHATTN_FP8_TABLE)
    return;
#else
    j = n / 8 * 8;
#endif
  }
#endif
  for (; j < n; ++j) {
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      reinterpret_cast<uint16_t*>(dst)[j] = fp8_bf16_bits<F>(src[j]);
    } else {
      const uint32_t bits = fp8_float_bits<F>(src[j]);
      float value;
      std::memcpy(&value, &bits, sizeof(float));
      dst[j] = static_cast<scalar_t>(value);
    }
  }
}

// n FP8 values from src into dst, exactly (e4m3fn and e5m2 values are exact in bf16, fp16 and fp32).
template <typename scalar_t>
void widen_fp8(const uint8_t* src, scalar_t* dst, int64_t n, KvFormat format) {
  if (format == KvFormat::e4m3fn) {
    widen_fp8_as<KvFormat::e4m3fn>(src, dst, n);
  } else {
    widen_fp8_as<KvFormat::e5m2>(src, dst, n);
  }
}

}  // namespace flash_cpu
