"""Tensor descriptors for Hopper's tensor memory accelerator (TMA): whole tiles copied by one instruction.

A descriptor here is 2-D, rows by the head dim, which is what keeps the loaded tile a plain operand of wgmma (a
3-D or 4-D one needs a reshape that sends the operand through registers). A (batch, seqlen, heads, dim) tensor
fits one of two ways:

- heads side by side in a row (the flash layout, heads contiguous): row = b * (stride_b / stride_n) + n, column
  = h * stride_h; the tile's columns must be exactly the head dim, or they would read the next head;
- heads one after another in rows (PyTorch's (batch, heads, L, E) seen transposed): row = b * (stride_b /
  stride_n) + h * (stride_h / stride_n) + n, columns 0..D (a head dim below the tile's is zero-filled).

A tile that runs past a sequence reads the next sequence's rows (or zeros at the tensor's end): the kernels mask
those keys and never store those queries. TMA needs sm_90 or later, 16-byte aligned bases and row pitches, and 32-bit
coordinates; anything else keeps the pointer loads. ``use(True/False)`` forces the choice, so the interpreter tests
run the descriptor path too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import NamedTuple

import torch

from .families import family

_forced: ContextVar[bool | None] = ContextVar("flashattn_tma", default=None)


@contextmanager
def use(enabled: bool) -> Iterator[None]:
    """Force tensor descriptors on or off inside the block (on: where a tensor's layout allows them)."""
    token = _forced.set(enabled)
    try:
        yield
    finally:
        _forced.reset(token)


def forced() -> bool | None:
    """What ``use`` forces, if anything (part of a launch plan's key)."""
    return _forced.get()


WGMMA_ROWS = 64  # a warpgroup's wgmma tile: programs whose matmuls have fewer rows run on mma.sync


def enabled(arch: int | str, *, matmul_rows: int = WGMMA_ROWS) -> bool:
    """Descriptors by default on the families whose matmuls are warpgroup-wide (``families.Family.tma``: sm_90,
    sm_100; ``arch``: the target Triton compiles for, ``launch.target_arch()``, 0 under the interpreter) for programs
    whose matmuls have ``matmul_rows`` >= 64 rows; forced by ``use``.
    Below 64 rows the matmuls run on mma.sync, whose operands a descriptor-loaded, transposed tile reaches through
    registers: the d=256 dK/dV of 16 keys needs 210 registers with pointer loads and spills with descriptors."""
    forced = _forced.get()
    if forced is not None:
        return forced
    return arch != 0 and family(arch).tma and matmul_rows >= WGMMA_ROWS


class View(NamedTuple):
    """A descriptor and where a (batch, head)'s rows and columns start in it: row b * rows[0] + h * rows[1],
    column h * column."""

    desc: object
    rows: tuple[int, int]
    column: int


def view(t: torch.Tensor, strides: tuple[int, int, int, int], sizes: tuple[int, int, int, int],
         block: tuple[int, int]) -> View | None:
    """A 2-D descriptor of ``t`` read as (batch, seqlen, heads, dim) with ``strides`` and ``sizes`` (a packed
    varlen tensor: batch stride 0, one batch of all rows), tiles of ``block`` = (rows, padded head dim); None when
    the layout does not allow one."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    sb, sn, sh, sd = strides
    batches, n, heads, d = sizes
    size = t.element_size()
    if sd != 1 or sn <= 0 or t.dtype not in (torch.float16, torch.bfloat16) or t.data_ptr() % 16:
        return None
    if (sn * size) % 16 or sb % sn:
        return None
    row_b = sb // sn
    if sh % sn == 0 and sh > 0:  # heads in rows
        rows = (batches - 1) * row_b + (heads - 1) * (sh // sn) + n
        shape, row_h, column = [rows, d], sh // sn, 0
    elif d == block[1] and (heads - 1) * sh + d <= sn:  # heads side by side in a row
        rows = (batches - 1) * row_b + n
        shape, row_h, column = [rows, (heads - 1) * sh + d], 0, sh
    else:
        return None
    if rows >= 2**31 or shape[1] * size < 16:
        return None
    return View(TensorDescriptor(t, shape=shape, strides=[sn, 1], block_shape=list(block)), (row_b, row_h), column)


def kernel_args(name: str, found: View | None) -> dict:
    """``{name}_desc`` (None: pointer loads) and ``{name}_tma`` = (rows per batch, rows per head, columns per head)
    as the kernels take them."""
    if found is None:
        return {f"{name}_desc": None, f"{name}_tma": (0, 0, 0)}
    return {f"{name}_desc": found.desc, f"{name}_tma": (*found.rows, found.column)}
