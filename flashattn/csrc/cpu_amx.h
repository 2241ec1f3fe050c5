// Tile products on AMX in the kernel's own loop (the `amx` engine of cpu_gemm16.h): C (M x N fp32, row-major)
// [+]= A B, A (M x K bf16, row-major), B VNNI-packed [K/2][ldb][2], as the other engines. Eight tile registers,
// one configuration for the whole loop: four 16 x 16 fp32 accumulators (a 32 x 32 block of C), two 16 x 32 A tiles,
// two 16-pair x 16 B tiles, so each B tile is read for 32 rows and each A tile for 32 columns. Ragged edges (rows
// or columns past a multiple of 16, K past a multiple of 32) go through zero-padded staging tiles, so no tile load
// reads past an operand or multiplies a stale NaN. Written as inline assembly with the tile numbers spelled out,
// so the build needs no AMX compiler flag: whether the engine runs is decided at run time (amx_usable: the CPU's
// AMX-TILE and AMX-BF16, and the Linux permission for the tile state, asked once per process). Against oneDNN's
// brgemm through ATen (the `onednn` engine) it saves the per-call dispatch (ATen's kernel cache, its hardware
// context): ~0.5 us a product, 176 products in a causal N = 1k forward of four heads.
#pragma once

#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#define FLASHATTN_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace flash_cpu {

#ifdef FLASHATTN_AMX
// The CPU has AMX-TILE and AMX-BF16 (CPUID 7.0 EDX bits 24 and 22) and Linux lets this process use the tile data
// state (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; kernels before 5.16 refuse it, and so does a VM that hides it).
inline bool amx_usable() {
  static const bool usable = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
    if (((d >> 24) & 1u) == 0 || ((d >> 22) & 1u) == 0) return false;
    constexpr long kRequestPermission = 0x1023, kTileData = 18;
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return usable;
}

// The instructions as bytes (VEX encodings, tile numbers filled in by the assembler's expressions; base in rax,
// stride in rdx), so an assembler older than AMX (binutils before 2.36) still builds the kernel. The memory
// clobbers keep the compiler from moving the operands' stores past a tile load, or C's reads before a tile store,
// and keep every tile instruction in program order.
#define FLASHATTN_TILE_LOAD(t, base, stride)                                              \
  asm volatile(".byte 0xc4, 0xe2, 0x7b, 0x4b, 0x04 | (" #t " << 3), 0x10" /* tileloadd */ \
               ::"a"(base), "d"(static_cast<int64_t>(stride)) : "memory")
#define FLASHATTN_TILE_STORE(t, base, stride)                                              \
  asm volatile(".byte 0xc4, 0xe2, 0x7a, 0x4b, 0x04 | (" #t " << 3), 0x10" /* tilestored */ \
               ::"a"(base), "d"(static_cast<int64_t>(stride)) : "memory")
#define FLASHATTN_TILE_ZERO(t) asm volatile(".byte 0xc4, 0xe2, 0x7b, 0x49, 0xc0 | (" #t " << 3)" ::: "memory")
// tdpbf16ps: tmm[c] += tmm[a] tmm[b] (b in VEX.vvvv, inverted; c in ModRM.reg, a in ModRM.rm).
#define FLASHATTN_TILE_DOT(c, a, b) \
  asm volatile(".byte 0xc4, 0xe2, 0x02 | ((~" #b " & 15) << 3), 0x5c, 0xc0 | (" #c " << 3) | " #a ::: "memory")

// Accumulator (t, u) is tmm[2t + u]: row tile t, column tile u of the 32 x 32 block; A tile t is tmm[4 + t], B
// tile u tmm[6 + u]. The switches fold away where t and u are constants (the unrolled block loops).
inline void accumulator_load(int idx, const void* at, int64_t stride) {
  switch (idx) {
    case 0: FLASHATTN_TILE_LOAD(0, at, stride); break;
    case 1: FLASHATTN_TILE_LOAD(1, at, stride); break;
    case 2: FLASHATTN_TILE_LOAD(2, at, stride); break;
    default: FLASHATTN_TILE_LOAD(3, at, stride); break;
  }
}
inline void accumulator_zero(int idx) {
  switch (idx) {
    case 0: FLASHATTN_TILE_ZERO(0); break;
    case 1: FLASHATTN_TILE_ZERO(1); break;
    case 2: FLASHATTN_TILE_ZERO(2); break;
    default: FLASHATTN_TILE_ZERO(3); break;
  }
}
inline void accumulator_store(int idx, void* at, int64_t stride) {
  switch (idx) {
    case 0: FLASHATTN_TILE_STORE(0, at, stride); break;
    case 1: FLASHATTN_TILE_STORE(1, at, stride); break;
    case 2: FLASHATTN_TILE_STORE(2, at, stride); break;
    default: FLASHATTN_TILE_STORE(3, at, stride); break;
  }
}
inline void operand_load(int idx, const void* at, int64_t stride) {  // A tiles 4, 5; B tiles 6, 7
  switch (idx) {
    case 4: FLASHATTN_TILE_LOAD(4, at, stride); break;
    case 5: FLASHATTN_TILE_LOAD(5, at, stride); break;
    case 6: FLASHATTN_TILE_LOAD(6, at, stride); break;
    default: FLASHATTN_TILE_LOAD(7, at, stride); break;
  }
}
inline void accumulate(int t, int u) {
  switch (2 * t + u) {
    case 0: FLASHATTN_TILE_DOT(0, 4, 6); break;
    case 1: FLASHATTN_TILE_DOT(1, 4, 7); break;
    case 2: FLASHATTN_TILE_DOT(2, 5, 6); break;
    default: FLASHATTN_TILE_DOT(3, 5, 7); break;
  }
}

// Every thread that runs the engine loads this once (amx_configure) and gives the state back at the end of its
// tasks (amx_release, from release_engine when its NativeTiles goes): every product on the engine must run on a
// thread whose tiles object is alive, or ATen's or oneDNN's next product there may release or replace the
// configuration while amx_configured still says ours is loaded. ATen's brgemm keeps a per-thread note of the
// configuration it loaded last; releasing it first makes its next call load its own again instead of running on
// ours.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};
static_assert(sizeof(TileConfig) == 64 && offsetof(TileConfig, colsb) == 16 && offsetof(TileConfig, rows) == 48,
              "the tile configuration's layout is the ISA's");
inline thread_local bool amx_configured = false;
inline void amx_configure() {
  if (amx_configured) return;
#ifdef CPUBLAS_BRGEMM_BF16BF16F32
  at::native::cpublas::brgemm_release(true);
#endif
  static const TileConfig config;
  asm volatile(".byte 0xc4, 0xe2, 0x78, 0x49, 0x00" /* ldtilecfg (%%rax) */ ::"a"(&config) : "memory");
  amx_configured = true;
}
inline void amx_release() {
  if (!amx_configured) return;
  asm volatile(".byte 0xc4, 0xe2, 0x78, 0x49, 0xc0" /* tilerelease */ ::: "memory");
  amx_configured = false;
}

// A zero-padded copy of an edge tile, 64-byte rows (staging for ragged edges).
struct alignas(64) StagedTile {
  uint8_t bytes[16 * 64];
};

// rows x bytes of src (rows `stride` bytes apart) into a zeroed staging tile of 64-byte rows.
inline const void* stage(StagedTile& tile, const void* src, int64_t stride, int64_t rows, int64_t bytes) {
  std::memset(tile.bytes, 0, sizeof(StagedTile));
  const auto* from = static_cast<const uint8_t*>(src);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(tile.bytes + 64 * r, from + r * stride, bytes);
  return tile.bytes;
}

// fn(t, u, accumulator) for each accumulator tile of an MT x NT block, unrolled.
template <int MT, int NT, typename Fn>
inline void each_accumulator(const Fn& fn) {
#pragma GCC unroll 2
  for (int t = 0; t < MT; ++t) {
#pragma GCC unroll 2
    for (int u = 0; u < NT; ++u) fn(t, u, 2 * t + u);
  }
}

// One block of C: MT x NT tiles (1 or 2 each) at rows i0, columns j0, over K in chunks of 32.
template <int MT, int NT>
void amx_block(int64_t m, int64_t n, int64_t k, const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b,
               int64_t ldb, float* c, int64_t ldc, bool add, int64_t i0, int64_t j0) {
  StagedTile staged_c[4], staged_a[2], staged_b[2];
  int64_t rows[2], cols[2];
  for (int t = 0; t < MT; ++t) rows[t] = std::min<int64_t>(16, m - i0 - 16 * t);
  for (int u = 0; u < NT; ++u) cols[u] = std::min<int64_t>(16, n - j0 - 16 * u);
  const auto tile_of_c = [&](int t, int u) { return c + (i0 + 16 * t) * ldc + j0 + 16 * u; };
  each_accumulator<MT, NT>([&](int t, int u, int idx) {
    if (!add) {
      accumulator_zero(idx);
    } else if (rows[t] == 16 && cols[u] == 16) {
      accumulator_load(idx, tile_of_c(t, u), ldc * 4);
    } else {
      accumulator_load(idx, stage(staged_c[idx], tile_of_c(t, u), ldc * 4, rows[t], cols[u] * 4), 64);
    }
  });
  for (int64_t k0 = 0; k0 < k; k0 += 32) {
    const int64_t kw = std::min<int64_t>(32, k - k0);  // even
    const auto load_a = [&](int t) {
      const c10::BFloat16* at = a + (i0 + 16 * t) * lda + k0;
      if (rows[t] == 16 && kw == 32) return operand_load(4 + t, at, lda * 2);
      operand_load(4 + t, stage(staged_a[t], at, lda * 2, rows[t], kw * 2), 64);
    };
    const auto load_b = [&](int u) {
      const c10::BFloat16* at = b + k0 * ldb + 2 * (j0 + 16 * u);  // pair row k0 / 2
      if (cols[u] == 16 && kw == 32) return operand_load(6 + u, at, ldb * 4);
      operand_load(6 + u, stage(staged_b[u], at, ldb * 4, kw / 2, cols[u] * 4), 64);
    };
    // Each load just before the first product that reads it: the registers are not renamed, so a load waits for
    // the last product before it that read its register, and with all four loads first the second A tile's (read
    // last) held up both B tiles'. A product of P V's shape at d = 128 alone: 1.13 -> 0.82 ticks a score; whole
    // forwards and training steps: within 1 % either way.
    load_b(0);
    load_a(0);
    accumulate(0, 0);
    if constexpr (MT == 2) {
      load_a(1);
      accumulate(1, 0);
    }
    if constexpr (NT == 2) {
      load_b(1);
      accumulate(0, 1);
      if constexpr (MT == 2) accumulate(1, 1);
    }
  }
  each_accumulator<MT, NT>([&](int t, int u, int idx) {
    float* at = tile_of_c(t, u);
    if (rows[t] == 16 && cols[u] == 16) return accumulator_store(idx, at, ldc * 4);
    const float* s = reinterpret_cast<const float*>(staged_c[idx].bytes);
    accumulator_store(idx, staged_c[idx].bytes, 64);
    for (int64_t r = 0; r < rows[t]; ++r) std::memcpy(at + r * ldc, s + 16 * r, cols[u] * 4);
  });
}

// A product, C = [C +] A B (K even, as the callers pad it), and its 32 x 32 blocks of C.
struct AmxProduct {
  int64_t m, n, k;
  const c10::BFloat16 *a, *b;
  int64_t lda, ldb;
  float* c;
  int64_t ldc;
  bool add;

  int64_t blocks() const { return ((m + 31) / 32) * ((n + 31) / 32); }
  void block(int64_t index) const {
    const int64_t per_row = (n + 31) / 32, i0 = index / per_row * 32, j0 = index % per_row * 32;
    const bool two_rows = m - i0 > 16, two_cols = n - j0 > 16;
    if (two_rows && two_cols) {
      amx_block<2, 2>(m, n, k, a, lda, b, ldb, c, ldc, add, i0, j0);
    } else if (two_rows) {
      amx_block<2, 1>(m, n, k, a, lda, b, ldb, c, ldc, add, i0, j0);
    } else if (two_cols) {
      amx_block<1, 2>(m, n, k, a, lda, b, ldb, c, ldc, add, i0, j0);
    } else {
      amx_block<1, 1>(m, n, k, a, lda, b, ldb, c, ldc, add, i0, j0);
    }
  }
};

// Single-threaded, inside the kernel's parallel region.
inline void amx_gemm(int64_t m, int64_t n, int64_t k, const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b,
                     int64_t ldb, float* c, int64_t ldc, bool add) {
  TORCH_CHECK(k % 2 == 0, "flashattn cpu kernel: AMX tile products take an even K (VNNI pairs), got ", k);
  amx_configure();
  const AmxProduct product{m, n, k, a, b, lda, ldb, c, ldc, add};
  for (int64_t index = 0, count = product.blocks(); index < count; ++index) product.block(index);
}

#else
inline bool amx_usable() { return false; }
inline void amx_release() {}
#endif

}  // namespace flash_cpu
