// The kernels' floating-point environment. Inside their parallel regions subnormal results are flushed to zero
// and subnormal inputs read as zero (MXCSR's FTZ and DAZ, as torch.set_flush_denormal(True) sets them), the
// caller's two bits put back at the end. A product or sum with a subnormal result otherwise takes a microcode
// assist of ~100 cycles: every masked score (its exp taken at -126, 2^-126 * 0.99999994, before the lane is
// zeroed) made a causal backward's diagonal tiles 13x slower and a padding-masked forward 2x, and scores 87 nats
// or more below their row's maximum (weights under 2^-126) the fp32 and bf16 forwards 6-18x, with nothing to
// gain: such a weight is below any fp32 sum's last bit.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

namespace flash_cpu {

class FlushSubnormals {
 public:
#if defined(__x86_64__) || defined(_M_X64)
  FlushSubnormals() : saved_(_mm_getcsr() & kBits) { _mm_setcsr(_mm_getcsr() | kBits); }
  ~FlushSubnormals() { _mm_setcsr((_mm_getcsr() & ~kBits) | saved_); }  // (the status flags raised stay raised)

 private:
  static constexpr unsigned kBits = 0x8040;  // FTZ (bit 15) and DAZ (bit 6)
  unsigned saved_;
#else
  FlushSubnormals() = default;
  ~FlushSubnormals() = default;
#endif

 public:
  FlushSubnormals(const FlushSubnormals&) = delete;
  FlushSubnormals& operator=(const FlushSubnormals&) = delete;
};

}  // namespace flash_cpu
