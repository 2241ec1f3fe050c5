"""Tile shapes, warps and pipeline stages of the shipped kernels, as data.

Keyed by (padded head dim, weight): "light" calls use at most the causal/window band, softcap and ALiBi; "heavy"
ones add dropout (Philox costs registers per score element) or a user mask tile; the "fp32-" weights serve fp32
inputs (IEEE fp32 matmuls: twice the bytes per tile, no tensor cores, so small tiles). Each entry is the
largest tile that compiles without register spills on sm_80 and sm_90, within shared memory, and (sm_90) on
wgmma (HGMMA) where a 64-row warpgroup tile fits: measured with ``python -m flashattn.backends.triton.health``,
which a test reruns. Tune here, then rerun it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


WEIGHTS = ("light", "heavy", "fp32-light", "fp32-heavy")


def _table(rows: dict[int, tuple[KernelConfig, ...]]) -> dict[tuple[int, str], KernelConfig]:
    """{head_dim: (light, heavy, fp32-light, fp32-heavy)} -> {(head_dim, weight): config}."""
    return {(d, weight): cfg for d, cfgs in rows.items() for weight, cfg in zip(WEIGHTS, cfgs, strict=True)}


C = KernelConfig
FORWARD = _table({
    16: (C(128, 64, 4, 3), C(128, 64, 8, 2), C(64, 32, 8, 1), C(64, 32, 8, 1)),
    32: (C(128, 64, 4, 3), C(128, 64, 8, 2), C(128, 16, 4, 3), C(64, 32, 4, 2)),
    64: (C(128, 64, 8, 3), C(128, 64, 8, 2), C(32, 32, 8, 1), C(32, 32, 4, 2)),
    128: (C(128, 64, 8, 1), C(64, 32, 4, 2), C(16, 32, 8, 3), C(16, 16, 4, 1)),
    256: (C(64, 32, 8, 2), C(64, 32, 8, 2), C(64, 16, 8, 1), C(16, 32, 4, 1)),
})
BACKWARD_DKDV = _table({
    16: (C(64, 64, 4, 2), C(64, 32, 4, 3), C(32, 16, 4, 3), C(32, 32, 4, 2)),
    32: (C(64, 64, 4, 2), C(64, 32, 8, 1), C(16, 32, 4, 3), C(16, 32, 4, 1)),
    64: (C(64, 32, 4, 2), C(64, 32, 8, 1), C(16, 64, 4, 1), C(64, 16, 8, 2)),
    128: (C(64, 32, 8, 1), C(64, 32, 8, 1), C(16, 64, 8, 1), C(16, 64, 8, 2)),
    256: (C(32, 64, 8, 1), C(32, 32, 8, 1), C(16, 16, 4, 1), C(16, 16, 4, 1)),
})
BACKWARD_DQ = _table({
    16: (C(64, 64, 4, 2), C(64, 64, 8, 2), C(64, 32, 4, 2), C(64, 32, 4, 1)),
    32: (C(64, 64, 4, 2), C(64, 64, 8, 2), C(128, 16, 8, 3), C(128, 16, 4, 3)),
    64: (C(128, 32, 8, 3), C(64, 32, 4, 2), C(64, 32, 8, 1), C(128, 16, 8, 3)),
    128: (C(128, 32, 8, 1), C(128, 16, 8, 3), C(64, 16, 4, 3), C(32, 32, 8, 1)),
    256: (C(32, 32, 8, 1), C(32, 64, 8, 1), C(16, 16, 4, 3), C(16, 16, 4, 1)),
})
# Few query rows (a decode step, or its GQA group walked as rows): 16-row tiles, the smallest tensor-core tile, and
# long key tiles with deep pipelines, since the kernel is bound by reading K and V. Below wgmma's 64 rows, so
# sm_90 runs these on mma.sync: exempt from the HGMMA check.
DECODE = _table({
    16: (C(16, 128, 4, 3), C(16, 64, 2, 3), C(16, 64, 4, 2), C(16, 32, 4, 2)),
    32: (C(16, 128, 4, 3), C(16, 64, 4, 2), C(16, 64, 4, 3), C(16, 32, 2, 3)),
    64: (C(16, 128, 4, 3), C(16, 64, 4, 2), C(16, 64, 4, 3), C(16, 32, 4, 3)),
    128: (C(16, 64, 4, 3), C(16, 64, 4, 2), C(16, 16, 4, 3), C(16, 32, 4, 3)),
    256: (C(16, 32, 4, 3), C(16, 32, 4, 3), C(16, 32, 4, 1), C(16, 16, 4, 1)),
})
DECODE_MAX_ROWS = 16
del C
# Under TRITON_INTERPRET=1 every program runs in Python: small square tiles keep test shapes cheap.
INTERPRETER = KernelConfig(32, 32, 1, 1)
PREPROCESS_BLOCK_M = 64
MERGE_BLOCK_M = 16


def split_heuristic(programs: int, multiprocessors: int, key_blocks: int, max_splits: int = 128) -> int:
    """How many key splits (flash-decoding) a forward launch of ``programs`` programs should use.

    Splitting helps only when the launch cannot fill the GPU: then pick the fewest splits whose waves of programs
    fill the multiprocessors within 85% of the best achievable, skipping counts that leave the keys per split
    unchanged (the same work, more merging). The rule of flash_attn's ``num_splits_heuristic``.

    Example::

        >>> split_heuristic(programs=4, multiprocessors=132, key_blocks=512)  # batch 1, 4 kv heads
        29
        >>> split_heuristic(programs=512, multiprocessors=132, key_blocks=512)
        1
    """
    if programs >= 0.8 * multiprocessors:
        return 1
    max_splits = max(1, min(max_splits, multiprocessors, key_blocks))

    def efficiency(splits: int) -> float:
        waves = programs * splits / multiprocessors
        return waves / math.ceil(waves)

    def useful(splits: int) -> bool:
        return splits == 1 or math.ceil(key_blocks / splits) != math.ceil(key_blocks / (splits - 1))

    best = max(efficiency(s) for s in range(1, max_splits + 1) if useful(s))
    return next(s for s in range(1, max_splits + 1) if useful(s) and efficiency(s) >= 0.85 * best)


def padded_head_dim(d: int) -> int:
    return max(16, 1 << (max(d, 1) - 1).bit_length())
