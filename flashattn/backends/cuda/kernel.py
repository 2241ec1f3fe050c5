"""What ``flashattn/csrc/flash_fwd.cu`` is compiled with, stated once.

Python launches the kernel with these tile sizes and hands the same values to the compiler as ``-D`` defines;
the source has no defaults (it stops at ``#error`` without them), so the launch and the kernel cannot disagree.
Every compiler, NVRTC at run time and nvcc in the tests, takes its options from ``compile_options``:

    >>> v = Variant.of(torch.bfloat16, 128, causal=False)
    >>> str(v)
    'bf16_d128'
    >>> " ".join(compile_options(v))
    '-std=c++17 -DBLOCK_M=64 -DBLOCK_N=64 -DWARPS=4 -DHEAD_DIM=128 -DIS_BF16=1 -DIS_CAUSAL=0 -DSHARED_BYTES=81920'
    >>> len(VARIANTS)
    8

Why one compile per variant, each holding the one kernel ``ENTRY``, rather than eight named instantiations (or
NVRTC name expressions on a template): the name Python looks up never depends on the variant, the variant is plain
data (the key of the loaded-module table and part of the kernel store's key), the source has no instantiation
list to keep in step, and a first call compiles only the kernel it launches.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

SOURCE = "flash_fwd.cu"  # under flashattn/csrc
ENTRY = "flash_fwd_kernel"  # the one extern "C" kernel of every image; the tests read it back from the cubins
BLOCK_M = 64  # query rows per block: WARPS warps of 16 rows each
BLOCK_N = 64  # keys per K/V tile
WARPS = 4
HEAD_DIMS = (64, 128)
DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16"}
LANGUAGE = ("-std=c++17",)


class Variant(NamedTuple):
    """One specialisation of the kernel: element type ("f16" or "bf16"), head dim and causal masking."""

    dtype: str
    head_dim: int
    causal: bool

    @classmethod
    def of(cls, dtype: torch.dtype, head_dim: int, causal: bool) -> Variant:
        return cls(DTYPES[dtype], head_dim, causal)

    def __str__(self) -> str:
        return f"{self.dtype}_d{self.head_dim}" + ("_causal" if self.causal else "")


VARIANTS = tuple(Variant(dt, d, c) for dt in DTYPES.values() for d in HEAD_DIMS for c in (False, True))


def shared_bytes(head_dim: int) -> int:
    """Dynamic shared memory of a launch: the Q tile plus double-buffered K and V tiles, 2 bytes an element
    (the kernel checks its layout against this value, passed as ``SHARED_BYTES``)."""
    return 2 * head_dim * (BLOCK_M + 4 * BLOCK_N)


def compile_options(variant: Variant) -> list[str]:
    """The options, language and ``-D`` defines, that NVRTC and nvcc both accept; the architecture is separate
    because the two spell it differently."""
    defines = {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "WARPS": WARPS, "HEAD_DIM": variant.head_dim,
               "IS_BF16": int(variant.dtype == "bf16"), "IS_CAUSAL": int(variant.causal),
               "SHARED_BYTES": shared_bytes(variant.head_dim)}
    return [*LANGUAGE, *(f"-D{name}={value}" for name, value in defines.items())]
