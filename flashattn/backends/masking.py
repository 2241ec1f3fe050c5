"""The one description of which keys a query may see, shared by every backend's forward and backward.

Causal and sliding-window attention are the same thing: query row i sees key column j iff

    -left <= j - i - diagonal <= right        (a bound of -1 means unbounded on that side)

where ``diagonal`` is the key column on query 0's diagonal: ``Nk - Nq`` for the bottom-right corner (the
``flash_attn`` convention, so the last query sees the last key) or 0 for the top-left corner (PyTorch's
``is_causal``), plus a ``diagonal_offset`` when the call is one block of a longer sequence. Causal is
``(left, right) = (-1, 0)``.

Tiled code asks two questions per (query block, key block) tile: can anything in it be visible (else skip the
tile), and is everything visible (else apply the element mask). Answering them per tile is what makes a mask
cost nothing on tiles where it cannot apply.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Band:
    """The visible band of the score matrix: ``-left <= j - i - diagonal <= right``; -1 means unbounded."""

    left: int = -1
    right: int = -1
    diagonal: int = 0

    @classmethod
    def of(cls, nq: int, nk: int, *, left: int, right: int, bottom_right: bool, diagonal_offset: int = 0) -> Band:
        """The band of an (nq x nk) score matrix whose diagonal is aligned bottom-right or top-left, then moved by
        ``diagonal_offset`` columns."""
        return cls(left=left, right=right, diagonal=(nk - nq if bottom_right else 0) + diagonal_offset)

    def key_range(self, r0: int, r1: int, nk: int) -> tuple[int, int]:
        """Columns [lo, hi) that any of the query rows [r0, r1) may see (hi <= lo when none)."""
        lo = 0 if self.left < 0 else max(0, r0 + self.diagonal - self.left)
        hi = nk if self.right < 0 else min(nk, r1 - 1 + self.diagonal + self.right + 1)
        return lo, hi

    def tile_is_full(self, r0: int, r1: int, c0: int, c1: int) -> bool:
        """True when every (i, j) in rows [r0, r1) x columns [c0, c1) is visible: no element mask needed."""
        dmin = c0 - (r1 - 1) - self.diagonal
        dmax = (c1 - 1) - r0 - self.diagonal
        return (self.right < 0 or dmax <= self.right) and (self.left < 0 or dmin >= -self.left)

    def visible(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Boolean (len(rows), len(cols)) mask of visible elements for integer index vectors."""
        d = cols[None, :] - rows[:, None] - self.diagonal
        keep = torch.ones_like(d, dtype=torch.bool)
        if self.right >= 0:
            keep &= d <= self.right
        if self.left >= 0:
            keep &= d >= -self.left
        return keep


def kernel_side(side: int, *, nq: int, nk: int, diagonal_offset: int) -> int:
    """A window side as a kernel reads it: -1 (unbounded) where it reaches past every key of every row anyway
    (|j - i - diagonal| < nq + nk + |nk - nq| + |diagonal_offset| for any alignment), so that a kernel's
    ``row + diagonal + side`` stays within 32 bits: ``window_size=(-1, 2**31 - 1)`` or ``sys.maxsize`` reads as
    unbounded, not as a wrapped negative. ``nq``, ``nk``: the longest query and key sequence of the call.

    >>> [kernel_side(side, nq=1024, nk=1024, diagonal_offset=0) for side in (2**31 - 1, 100, -1)]
    [-1, 100, -1]
    """
    return -1 if side >= nq + nk + abs(nk - nq) + abs(diagonal_offset) else side


def sum_to_shape(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Sum the broadcast dimensions of ``x`` away so it has ``shape`` (the reverse of broadcasting): how a mask's
    gradient, computed per score, reaches a mask that was broadcast over batch, heads, rows or columns."""
    dims = [i for i, (n, m) in enumerate(zip(x.shape, shape, strict=True)) if m == 1 and n != 1]
    return x.sum(dim=dims, keepdim=True) if dims else x
