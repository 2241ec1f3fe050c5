"""Counter-based dropout randomness: Philox4x32-10 in plain PyTorch integer ops.

Dropout in a fused attention kernel cannot store its N x N keep-mask, so the backward must *recompute* it. A
counter-based generator makes that free: the random number for element (b, h, i, j) is a pure function of a
seed and the element's flat index ``((b * H + h) * Nq + i) * Nk + j``, so any tile can be regenerated in any
order, on any backend.

This is the same function as Triton's ``tl.rand(seed, offset)`` (Philox4x32 with 10 rounds, the 64-bit offset
split into counter words c0 = low 32 bits, c1 = high 32 bits, and the first output word mapped to [0, 1) by
``uint_to_uniform_float``), so the CPU path and a Triton kernel drop exactly the same elements.

All arithmetic is on int64 tensors holding unsigned 32-bit values; the 32x32-bit products are split into 16-bit
halves so nothing overflows int64 (signed overflow would be undefined behaviour in ATen's C++).
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_KEY_A = 0x9E3779B9
_KEY_B = 0xBB67AE85
_ROUND_A = 0xD2511F53
_ROUND_B = 0xCD9E8D57
_ROUNDS = 10
# Triton's scale: the largest float with (2**31 - 1) * scale < 1 in float32.
_UNIFORM_SCALE = 4.6566127342e-10


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high 32 bits, low 32 bits) of the 64-bit product of constant ``a`` and uint32 values ``b``."""
    b_lo = b & 0xFFFF
    b_hi = b >> 16
    p0 = a * b_lo  # < 2**48
    p1 = a * b_hi  # < 2**48; the product is p0 + p1 * 2**16
    mid = p0 + ((p1 & 0xFFFF) << 16)  # < 2**49
    return (p1 >> 16) + (mid >> 32), mid & _MASK32


def philox_uint32(seed: int, offset: torch.Tensor) -> torch.Tensor:
    """First output word of Philox4x32-10 for counters ``offset`` (int64, >= 0) and key ``seed`` (uint64).

    Returns int64 values in [0, 2**32).
    """
    c0 = offset & _MASK32
    c1 = (offset >> 32) & _MASK32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0 = seed & _MASK32
    k1 = (seed >> 32) & _MASK32
    for _ in range(_ROUNDS):
        hi_b, lo_b = _mul_hi_lo(_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _KEY_A) & _MASK32
        k1 = (k1 + _KEY_B) & _MASK32
    return c0


def philox_uniform(seed: int, offset: torch.Tensor) -> torch.Tensor:
    """Uniform float32 in [0, 1) for each counter in ``offset``, bit-identical to Triton's ``tl.rand``.

    Example::

        >>> u = philox_uniform(1234, torch.arange(4))
        >>> bool(((u >= 0) & (u < 1)).all())
        True
    """
    x = philox_uint32(seed, offset)
    # Triton reinterprets the word as int32 and folds negatives: x < 0 -> -x - 1.
    folded = torch.where(x >= 2**31, _MASK32 - x, x)
    return folded.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32)


def dropout_keep(seed: int, offset: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Boolean keep-mask: element kept with probability ``1 - dropout_p``."""
    return philox_uniform(seed, offset) >= dropout_p
