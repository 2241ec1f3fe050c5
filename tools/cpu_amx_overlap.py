"""Does the AMX tile unit multiply while the vector units run other work? The measurement behind the decision not
to interleave the CPU forward's tile products with its softmax pass (benchmarks/NOTES.md, "The own AMX tiles").

One 32 x 32 block of C over K = 64 on the kernel's own AMX loop (``flashattn/csrc/cpu_amx.h``: eight tile products),
a stretch of vector work, and the two back to back in one loop; the vector work either stays in registers (FMA
chains) or loads and stores as the softmax pass does (two loads and a store per FMA, all in L1). Where the tile unit
runs beside the vector units, "both" takes about the longer of the two; where it does not, their sum. Then the
forward's own shape of work: a strip's products issued a block at a time between the rows of the previous strip's
pass, against the products and then the pass. Times are time-stamp-counter ticks, the best of five runs.

    python -m tools.cpu_amx_overlap            # needs a CPU with AMX-BF16 and a C++ compiler
"""

from __future__ import annotations

import sys
from pathlib import Path

SOURCE = r"""
#include "cpu_amx.h"
#include <immintrin.h>
#include <torch/extension.h>

namespace {
float scratch[4096];

__attribute__((noinline)) __m512 in_registers(__m512 x, int n) {
  __m512 a = x, b = x, c = x, d = x;
  const __m512 f = _mm512_set1_ps(0.999f);
  for (int i = 0; i < n; ++i) {
    a = _mm512_fmadd_ps(a, f, f), b = _mm512_fmadd_ps(b, f, f), c = _mm512_fmadd_ps(c, f, f);
    d = _mm512_fmadd_ps(d, f, f);
  }
  return _mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(c, d));
}

__attribute__((noinline)) __m512 through_memory(__m512 x, int n) {
  __m512 a = x, b = x;
  const __m512 f = _mm512_set1_ps(0.999f);
  for (int i = 0; i < n; ++i) {
    a = _mm512_fmadd_ps(_mm512_loadu_ps(scratch + (i * 16) % 2048), f, a);
    b = _mm512_fmadd_ps(_mm512_loadu_ps(scratch + 2048 + (i * 16) % 1024), f, b);
    _mm512_storeu_ps(scratch + 3072 + (i * 16) % 1024, a);
  }
  return _mm512_add_ps(a, b);
}
// One row of the softmax pass over 256 scores: 2^(s f - m) by a polynomial and vscalefps, its sum, P in bf16.
__attribute__((noinline)) float pass_row(const float* s, c10::BFloat16* p) {
  __m512 sum = _mm512_setzero_ps();
  for (int j = 0; j < 256; j += 16) {
    __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(s + j), _mm512_set1_ps(0.1f), _mm512_set1_ps(1.0f));
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 whole = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF), part = _mm512_sub_ps(x, whole);
    __m512 poly = _mm512_fmadd_ps(_mm512_set1_ps(0.0558f), part, _mm512_set1_ps(0.2402f));
    poly = _mm512_fmadd_ps(_mm512_fmadd_ps(poly, part, _mm512_set1_ps(0.6931f)), part, _mm512_set1_ps(1.0f));
    const __m512 e = _mm512_scalef_ps(poly, whole);
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
  }
  return _mm512_reduce_add_ps(sum);
}
}  // namespace

// The forward's shape of work: 256 query rows in strips of 32 against 256 keys at d = 64, S (256 KiB) and P as the
// kernel keeps them. mode 0: the strips' products (S = Q K^T) alone, 1: the pass alone, 2: strip s + 1's products
// a 32 x 32 block at a time between the rows of strip s's pass, 3: each strip's products, then its pass. Ticks a
// score.
double measure_strips(int64_t mode) {
  TORCH_CHECK(flash_cpu::amx_usable(), "this CPU or its OS offers this process no AMX tiles");
  constexpr int64_t D = 64, N = 256, M = 256, R = 32, kReps = 100;
  std::vector<c10::BFloat16> q(M * D, c10::BFloat16(0.01f)), kt(D * N, c10::BFloat16(0.02f)), p(M * N);
  std::vector<float> s(M * N);
  flash_cpu::amx_configure();
  float sink = 0;
  uint64_t best = ~uint64_t(0);
  for (int run = 0; run < 5; ++run) {
    const uint64_t start = __rdtsc();
    for (int64_t rep = 0; rep < kReps; ++rep) {
      for (int64_t r0 = 0; r0 < M; r0 += R) {
        const int64_t next = (r0 + R) % M;
        const flash_cpu::AmxProduct strip{R, N, D, q.data() + next * D, kt.data(), D, N, s.data() + next * N, N, false};
        int64_t block = 0;
        if (mode == 0 || mode == 3) {
          for (; block < strip.blocks(); ++block) strip.block(block);
        }
        for (int64_t r = r0; r < r0 + R && mode != 0; ++r) {
          sink += pass_row(s.data() + r * N, p.data() + r * N);
          if (mode == 2 && block < strip.blocks()) strip.block(block++);
        }
        for (; mode == 2 && block < strip.blocks(); ++block) strip.block(block);
      }
    }
    best = std::min<uint64_t>(best, __rdtsc() - start);
  }
  flash_cpu::amx_release();
  return double(best) / (kReps * M * N) + (sink == 12345.0f ? 1 : 0);
}

// mode: 0 tiles, 1 registers, 2 tiles + registers, 3 memory, 4 tiles + memory. Ticks per iteration.
double measure(int64_t mode) {
  TORCH_CHECK(flash_cpu::amx_usable(), "this CPU or its OS offers this process no AMX tiles");
  std::vector<c10::BFloat16> a(32 * 64, c10::BFloat16(0.01f)), b(64 * 32, c10::BFloat16(0.01f));
  std::vector<float> c(32 * 32);
  const flash_cpu::AmxProduct block{32, 32, 64, a.data(), b.data(), 64, 32, c.data(), 32, false};
  flash_cpu::amx_configure();
  __m512 x = _mm512_set1_ps(1.0f);
  uint64_t best = ~uint64_t(0);
  for (int run = 0; run < 5; ++run) {
    const uint64_t start = __rdtsc();
    for (int i = 0; i < 2000; ++i) {
      if (mode == 0 || mode == 2 || mode == 4) block.block(0);
      if (mode == 1 || mode == 2) x = in_registers(x, 40);
      if (mode == 3 || mode == 4) x = through_memory(x, 60);
    }
    best = std::min<uint64_t>(best, __rdtsc() - start);
  }
  flash_cpu::amx_release();
  float keep[16];
  _mm512_storeu_ps(keep, x);
  return double(best) / 2000 + (keep[0] == 12345.0f ? 1 : 0);
}
"""


def main() -> int:
    import torch.utils.cpp_extension as cpp

    csrc = Path(__file__).resolve().parents[1] / "flashattn" / "csrc"
    module = cpp.load_inline("flashattn_amx_overlap", cpp_sources=SOURCE, functions=["measure", "measure_strips"],
                             extra_cflags=["-O2", "-march=native", "-std=c++17"], extra_include_paths=[str(csrc)])
    ticks = {name: module.measure(mode) for mode, name in enumerate(
        ("tiles", "registers", "tiles + registers", "memory", "tiles + memory"))}
    for alone, together in (("registers", "tiles + registers"), ("memory", "tiles + memory")):
        longer, total = max(ticks["tiles"], ticks[alone]), ticks["tiles"] + ticks[alone]
        overlap = (total - ticks[together]) / (total - longer) if total > longer else 0.0
        print(f"tiles {ticks['tiles']:6.0f}  vector work in {alone:9s} {ticks[alone]:6.0f}  both {ticks[together]:6.0f}"
              f"  ticks: {100 * overlap:3.0f} % of the shorter hidden")
    strips = [module.measure_strips(mode) for mode in range(4)]
    print(f"a forward's strips, ticks a score: products {strips[0]:.3f}, pass {strips[1]:.3f}, products between "
          f"the pass's rows {strips[2]:.3f}, products then pass {strips[3]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
