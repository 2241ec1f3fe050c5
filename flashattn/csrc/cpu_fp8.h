// FP8 keys and values (an FP8 KV cache): each tile's rows are widened into the queries' 16-bit (or fp32) type as
// they are read, never the whole cache. e4m3fn and e5m2 values are exact in bf16, fp16 and fp32, so the widening
// loses nothing; the descales are applied outside the tile products (k's folded into q by the caller, v's on each
// output row). Plain loops of integer operations that the compiler vectorises.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

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

template <KvFormat F, typename scalar_t>
void widen_fp8_as(const uint8_t* src, scalar_t* dst, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    uint16_t* out = reinterpret_cast<uint16_t*>(dst);
    for (int64_t j = 0; j < n; ++j) out[j] = fp8_bf16_bits<F>(src[j]);
  } else if constexpr (std::is_same_v<scalar_t, c10::Half> && F == KvFormat::e5m2) {  // fp16's top byte
    uint16_t* out = reinterpret_cast<uint16_t*>(dst);
    for (int64_t j = 0; j < n; ++j) out[j] = static_cast<uint16_t>(static_cast<uint16_t>(src[j]) << 8);
  } else {
    for (int64_t j = 0; j < n; ++j) {
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
