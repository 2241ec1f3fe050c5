"""Counter-based dropout randomness: Philox4x32-10 in plain PyTorch integer ops.

Dropout in a fused attention kernel cannot store its N x N keep-mask, so the backward must *recompute* it. A
counter-based generator makes that free: the random number for element (b, h, i, j) is a pure function of a
seed, the element's row ``r = (b * H + h) * Nq + i`` and its key column ``j``, so any tile can be regenerated in
any order, on any backend.

One Philox4x32-10 call (Triton's ``tl.randint4x(seed, c)``: the 64-bit counter c split into words c0 = low 32
bits, c1 = high 32 bits, key = seed) gives four 32-bit words, eight 16-bit draws, for the eight columns
``8 (j >> 3) .. + 7`` of one row: ``c = r * ceil(Nk / 8) + (j >> 3)``, and column j takes word ``(j >> 1) & 3``,
its low half for even j and its high half for odd j, kept when that draw / 2^16 >= p (in float32). Which word
and half depend on the column alone, so a GPU tile selects them per column. Eight elements per call, not one: the
generator's ten rounds were most of a dropout call's time on the CPU (a bf16 forward took 4x its plain time); the
keep rate is 1 - p to within 2^-16 (flash_attn's: 1/256). The CPU kernel (``flashattn/csrc/cpu_dropout.h``), the
Triton kernels (``kernels/dropout.py``) and this module draw the same numbers, so every path drops exactly the same
elements.

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


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high 32 bits, low 32 bits) of the 64-bit product of constant ``a`` and uint32 values ``b``."""
    b_lo = b & 0xFFFF
    b_hi = b >> 16
    p0 = a * b_lo  # < 2**48
    p1 = a * b_hi  # < 2**48; the product is p0 + p1 * 2**16
    mid = p0 + ((p1 & 0xFFFF) << 16)  # < 2**49
    return (p1 >> 16) + (mid >> 32), mid & _MASK32


def philox_words(seed: int, counter: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The four output words of Philox4x32-10 for counters ``counter`` (int64, >= 0) and key ``seed`` (uint64),
    as Triton's ``tl.randint4x`` returns them: int64 values in [0, 2**32)."""
    c0 = counter & _MASK32
    c1 = (counter >> 32) & _MASK32
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
    return c0, c1, c2, c3


def calls_per_row(cols: int) -> int:
    """Philox calls per row of ``cols`` key columns: eight columns a call, a row's calls its own."""
    return (cols + 7) // 8


def dropout_draws(seed: int, row: torch.Tensor, col: torch.Tensor, cols: int) -> torch.Tensor:
    """The 16-bit draw of element (``row``, ``col``) (int64, broadcast together; rows of ``cols`` key columns),
    int64 in [0, 2**16).

    Example::

        >>> d = dropout_draws(1234, torch.arange(3)[:, None], torch.arange(16)[None, :], 16)
        >>> d.shape, bool(((d >= 0) & (d < 2**16)).all())
        (torch.Size([3, 16]), True)
    """
    # Each element runs its call (eight of them the same one): element-wise, as the Triton kernels do, so nothing
    # here depends on the indices' values (a GPU tensor's would need a host read).
    words = philox_words(seed, row * calls_per_row(cols) + (col >> 3))
    which = (col >> 1) & 3
    word = torch.where(which == 0, words[0], torch.where(which == 1, words[1], torch.where(which == 2, words[2],
                                                                                            words[3])))
    return (word >> ((col & 1) * 16)) & 0xFFFF


def dropout_keep(seed: int, row: torch.Tensor, col: torch.Tensor, cols: int, dropout_p: float) -> torch.Tensor:
    """Boolean keep-mask of elements (``row``, ``col``): each kept with probability ``1 - dropout_p`` (to within
    2^-16)."""
    draws = dropout_draws(seed, row, col, cols).to(torch.float32) * (1.0 / 65536)
    return draws >= torch.tensor(dropout_p, dtype=torch.float32)
