"""Tile shapes, warps and pipeline stages of the shipped kernels, as data.

Keyed by (padded head dim, weight): "light" calls use at most the causal/window band, softcap and ALiBi;
"heavy" ones add dropout (Philox costs registers per score element) or a user mask tile. Each entry is the
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


C = KernelConfig
FORWARD: dict[tuple[int, str], KernelConfig] = {
    (16, "light"): C(128, 64, 4, 3), (16, "heavy"): C(128, 64, 8, 2),
    (32, "light"): C(128, 64, 4, 3), (32, "heavy"): C(128, 64, 8, 2),
    (64, "light"): C(128, 64, 4, 3), (64, "heavy"): C(128, 64, 8, 2),
    (128, "light"): C(128, 64, 8, 2), (128, "heavy"): C(64, 32, 4, 2),
    (256, "light"): C(64, 32, 8, 2), (256, "heavy"): C(64, 32, 8, 2),
}
BACKWARD_DKDV: dict[tuple[int, str], KernelConfig] = {
    (16, "light"): C(64, 64, 4, 2), (16, "heavy"): C(64, 32, 4, 2),
    (32, "light"): C(64, 64, 4, 2), (32, "heavy"): C(64, 32, 8, 1),
    (64, "light"): C(64, 32, 4, 2), (64, "heavy"): C(64, 32, 8, 1),
    (128, "light"): C(64, 64, 8, 1), (128, "heavy"): C(64, 32, 8, 1),
    (256, "light"): C(32, 64, 8, 1), (256, "heavy"): C(32, 32, 8, 1),
}
BACKWARD_DQ: dict[tuple[int, str], KernelConfig] = {
    (16, "light"): C(64, 64, 4, 2), (16, "heavy"): C(64, 64, 8, 2),
    (32, "light"): C(64, 64, 4, 2), (32, "heavy"): C(64, 64, 8, 2),
    (64, "light"): C(64, 64, 8, 2), (64, "heavy"): C(64, 32, 4, 2),
    (128, "light"): C(64, 32, 8, 1), (128, "heavy"): C(64, 64, 8, 2),
    (256, "light"): C(32, 32, 8, 1), (256, "heavy"): C(32, 64, 8, 1),
}
del C
# Under TRITON_INTERPRET=1 every program runs in Python: small square tiles keep test shapes cheap.
INTERPRETER = KernelConfig(32, 32, 1, 1)
PREPROCESS_BLOCK_M = 64


def padded_head_dim(d: int) -> int:
    return max(16, 1 << (max(d, 1) - 1).bit_length())
