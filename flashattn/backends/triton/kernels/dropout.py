"""Dropout's draws inside the kernels: the keep-mask of a tile, from Philox4x32-10 with one call per eight columns
of a row, the numbers ``flashattn.backends.philox`` and the CPU kernel draw for the same elements."""

from __future__ import annotations

import triton
import triton.language as tl

# Philox4x32's multipliers and key increments (Random123; the same as Triton's and flashattn.backends.philox).
PHILOX_ROUND_A: tl.constexpr = tl.constexpr(0xD2511F53)
PHILOX_ROUND_B: tl.constexpr = tl.constexpr(0xCD9E8D57)
PHILOX_KEY_A: tl.constexpr = tl.constexpr(0x9E3779B9)
PHILOX_KEY_B: tl.constexpr = tl.constexpr(0xBB67AE85)


@triton.jit
def dropout_keep(dropout, i, j):
    """Keep-mask of the tile as ``dropout`` (a ``Dropout``) draws it: element (row0 + i, j) takes the 16-bit half
    j & 1 of word (j >> 1) & 3 of ``tl.randint4x(seed, (row0 + i) * ceil(NK / 8) + (j >> 3))``, kept when it /
    2^16 >= p (``flashattn.backends.philox``). ``i`` and ``j`` broadcast to the tile, as in ``band_mask``; the word
    and half are chosen by ``j`` alone, so their selectors stay vectors."""
    # The counter's words from the row's first call (a vector) and the column's call: no 64-bit tile.
    row_call = (dropout.row0 + i.to(tl.int64)) * ((dropout.seqlen_k + 7) // 8)
    row_low = row_call.to(tl.uint32)
    low = row_low + (j >> 3).to(tl.uint32)
    high = (row_call >> 32).to(tl.uint32) + (low < row_low).to(tl.uint32)  # the low word's carry
    word = philox_word(dropout.b_seed, low, high, (j >> 1) & 3)
    draw = (word >> ((j & 1) * 16).to(tl.uint32)) & 0xFFFF
    return draw.to(tl.float32) * (1.0 / 65536) >= dropout.p


@triton.jit
def philox_word(seed, low, high, which):
    """Word ``which`` (0-3) of Philox4x32-10 on counters (``low``, ``high``, 0, 0) (uint32) with key ``seed``, as
    ``tl.randint4x`` would return it for the 64-bit counter high * 2^32 + low: nine rounds, then of the last only
    the product the word comes from, so the tile holds one word, not four, once the rounds are done."""
    c0 = low
    c1 = high
    c2 = c0 * 0
    c3 = c2
    seed = seed.to(tl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = (seed >> 32).to(tl.uint32)
    for _ in tl.static_range(9):
        a0, a2 = c0, c2
        c0 = tl.math.umulhi(PHILOX_ROUND_B, a2) ^ c1 ^ k0
        c2 = tl.math.umulhi(PHILOX_ROUND_A, a0) ^ c3 ^ k1
        c1 = tl.mul(PHILOX_ROUND_B, a2, sanitize_overflow=False)
        c3 = tl.mul(PHILOX_ROUND_A, a0, sanitize_overflow=False)
        k0 = tl.add(k0, PHILOX_KEY_A, sanitize_overflow=False)
        k1 = tl.add(k1, PHILOX_KEY_B, sanitize_overflow=False)
    first_pair = which < 2  # words 0 and 1 come from B * c2 (and c1), words 2 and 3 from A * c0 (and c3)
    operand = tl.where(first_pair, c2, c0)
    other = tl.where(first_pair, c1 ^ k0, c3 ^ k1)
    factor = tl.where(first_pair, PHILOX_ROUND_B, PHILOX_ROUND_A).to(tl.uint32)
    low = tl.mul(factor, operand, sanitize_overflow=False)
    return tl.where((which & 1) == 1, low, tl.math.umulhi(factor, operand) ^ other)
