"""Tile shapes, warps and pipeline stages of the shipped kernels, as data.

Keyed by (padded head dim, weight): "light" calls use at most the causal/window band, softcap and ALiBi; "heavy"
ones add dropout (Philox costs registers per score element) or a user mask tile; the "fp32-" weights serve fp32
inputs (IEEE fp32 matmuls: twice the bytes per tile, no tensor cores, so small tiles). Each entry is the
largest tile that compiles without register spills on sm_80 and sm_90, within shared memory, and (sm_90) on
wgmma (HGMMA) where a 64-row warpgroup tile fits: measured with ``python -m flashattn.backends.triton.health``,
which a test reruns. Tune here, then rerun it.
"""

from __future__ import annotations

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
    32: (C(128, 64, 4, 3), C(128, 64, 8, 2), C(64, 32, 4, 2), C(64, 32, 4, 2)),
    64: (C(128, 64, 4, 3), C(128, 64, 8, 2), C(32, 32, 8, 1), C(32, 32, 4, 2)),
    128: (C(128, 64, 8, 2), C(64, 32, 4, 2), C(16, 32, 8, 1), C(16, 16, 4, 1)),
    256: (C(64, 32, 8, 2), C(64, 32, 8, 2), C(32, 32, 8, 1), C(16, 32, 4, 1)),
})
BACKWARD_DKDV = _table({
    16: (C(64, 64, 4, 2), C(64, 32, 4, 2), C(32, 16, 4, 1), C(32, 32, 4, 2)),
    32: (C(64, 64, 4, 2), C(64, 32, 8, 1), C(16, 32, 4, 1), C(16, 32, 4, 1)),
    64: (C(64, 32, 4, 2), C(64, 32, 8, 1), C(32, 32, 4, 1), C(32, 32, 8, 1)),
    128: (C(64, 32, 8, 1), C(64, 32, 8, 1), C(16, 64, 4, 1), C(32, 32, 8, 1)),
    256: (C(32, 64, 8, 1), C(32, 32, 8, 1), C(16, 16, 4, 1), C(16, 16, 4, 1)),
})
BACKWARD_DQ = _table({
    16: (C(64, 64, 4, 2), C(64, 64, 8, 2), C(64, 32, 4, 2), C(64, 32, 4, 2)),
    32: (C(64, 64, 4, 2), C(64, 64, 8, 2), C(64, 32, 4, 2), C(64, 32, 4, 2)),
    64: (C(64, 64, 8, 2), C(64, 32, 4, 2), C(64, 32, 8, 1), C(64, 32, 8, 1)),
    128: (C(128, 32, 8, 1), C(64, 64, 8, 2), C(32, 32, 8, 1), C(32, 32, 8, 1)),
    256: (C(32, 32, 8, 1), C(32, 64, 8, 1), C(16, 16, 4, 1), C(16, 16, 4, 1)),
})
del C
# Under TRITON_INTERPRET=1 every program runs in Python: small square tiles keep test shapes cheap.
INTERPRETER = KernelConfig(32, 32, 1, 1)
PREPROCESS_BLOCK_M = 64


def padded_head_dim(d: int) -> int:
    return max(16, 1 << (max(d, 1) - 1).bit_length())
