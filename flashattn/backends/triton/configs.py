"""Tile shapes, warps and pipeline stages of the shipped kernels, as data.

``flashattn/backends/triton/health.py`` compiles every entry here for sm_80 and sm_90 and fails a test if one
spills registers or exceeds shared memory; tune here, then rerun it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Keyed by the padded head dim (the next power of two >= 16). A 128 x 128 tile at head dim 128 with 4 warps
# spills; these are the conservative FlashAttention-2 shapes.
FORWARD: dict[int, KernelConfig] = {
    16: KernelConfig(128, 64, 4, 3),
    32: KernelConfig(128, 64, 4, 3),
    64: KernelConfig(128, 64, 4, 3),
    128: KernelConfig(128, 64, 8, 2),
    256: KernelConfig(64, 32, 4, 2),
}
BACKWARD: dict[int, KernelConfig] = {
    16: KernelConfig(64, 64, 4, 2),
    32: KernelConfig(64, 64, 4, 2),
    64: KernelConfig(64, 64, 4, 2),
    128: KernelConfig(64, 64, 8, 1),
    256: KernelConfig(32, 32, 4, 1),
}
# Under TRITON_INTERPRET=1 every program runs in Python: small square tiles keep test shapes cheap.
INTERPRETER = KernelConfig(32, 32, 1, 1)
PREPROCESS_BLOCK_M = 64


def padded_head_dim(d: int) -> int:
    return max(16, 1 << (max(d, 1) - 1).bit_length())
