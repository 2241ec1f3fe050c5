"""The value checks of ``values.py`` and ``on_device.py`` under ``torch.compile``: custom ops that run them when the
graph executes.

While a graph is traced, tensor values are unknown and reading them would break the graph. Each op here takes the
index tensors a call is about to use, checks their values with the same functions eager mode calls (so the same
errors: on the host for CPU tensors, by a kernel for a GPU's, with no copy to the host), and returns copies of
them, which the call then uses in their place: being in the data path, the check cannot be pruned from the graph
and always runs before the kernels and the in-place cache append.

Example (what ``flashattn.checks`` does when ``torch.compiler.is_compiling()``)::

    >>> cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    >>> cu_q, cu_k = checked_varlen("f", cu, cu, None, VarlenSizes(5, 5, 3, 3))
    >>> checked_varlen("f", cu, cu, None, VarlenSizes(5, 5, 2, 3))
    Traceback (most recent call last):
    ...
    flashattn.errors.ArgumentError: f: max_seqlen_q = 2 is smaller than the longest sequence, 3
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import on_device
from .on_device import values_on_host
from .values import CacheSizes, VarlenSizes, check_cache_values, check_varlen_values


# Schemas given, not inferred from the annotations: torch before 2.5 cannot read string annotations.
@torch.library.custom_op("flashattn::check_varlen", mutates_args=(), schema="(Tensor cu_seqlens_q, Tensor "
                         "cu_seqlens_k, Tensor? block_table, int[] sizes, str fn) -> Tensor[]")
def _check_varlen(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, block_table: Tensor | None, sizes: list[int],
                  fn: str) -> list[Tensor]:
    total_q, total_k, max_q, max_k, num_pages, page_size = sizes
    given = VarlenSizes(total_q, None if total_k < 0 else total_k, max_q, max_k, num_pages, page_size)
    if values_on_host(cu_seqlens_q, cu_seqlens_k, block_table):
        check_varlen_values(fn, cu_seqlens_q, cu_seqlens_k, block_table, given)
    else:
        on_device.check_varlen(fn, cu_seqlens_q, cu_seqlens_k, block_table, given)
    return [t.clone() for t in (cu_seqlens_q, cu_seqlens_k, block_table) if t is not None]


@_check_varlen.register_fake
def _(cu_seqlens_q, cu_seqlens_k, block_table, sizes, fn):
    return [torch.empty_like(t) for t in (cu_seqlens_q, cu_seqlens_k, block_table) if t is not None]


def checked_varlen(fn: str, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, block_table: Tensor | None,
                   sizes: VarlenSizes) -> tuple[Tensor, ...]:
    """(cu_seqlens_q, cu_seqlens_k[, block_table]) once their values are checked, as the call must use them."""
    total_k = -1 if sizes.total_k is None else sizes.total_k
    flat = [sizes.total_q, total_k, sizes.max_q, sizes.max_k, sizes.num_pages, sizes.page_size]
    return tuple(_check_varlen(cu_seqlens_q, cu_seqlens_k, block_table, flat, fn))


@torch.library.custom_op("flashattn::check_kvcache", mutates_args=(), schema="(Tensor? seqlens, Tensor? leftpad, "
                         "Tensor? batch_idx, Tensor? block_table, int[] sizes, str fn) -> Tensor[]")
def _check_kvcache(seqlens: Tensor | None, leftpad: Tensor | None, batch_idx: Tensor | None,
                   block_table: Tensor | None, sizes: list[int], fn: str) -> list[Tensor]:
    batch, capacity, new, rows, paged, pages, page_size, rotary, reach = sizes
    tensors = (seqlens, leftpad, batch_idx, block_table)
    given = CacheSizes(batch, capacity, new, rows, bool(paged), pages, page_size, None if rotary < 0 else rotary, reach)
    if values_on_host(*tensors):
        check_cache_values(fn, tensors, given)
    else:
        on_device.check_cache(fn, tensors, given)
    return [t.clone() for t in tensors if t is not None]


@_check_kvcache.register_fake
def _(seqlens, leftpad, batch_idx, block_table, sizes, fn):
    return [torch.empty_like(t) for t in (seqlens, leftpad, batch_idx, block_table) if t is not None]


def checked_cache(fn: str, tensors: tuple, sizes: CacheSizes) -> tuple:
    """``tensors`` = (cache_seqlens, cache_leftpad, cache_batch_idx, block_table) once their values are checked,
    None where absent, as the call must use them."""
    rotary = -1 if sizes.rotary_positions is None else sizes.rotary_positions
    flat = [sizes.batch, sizes.capacity, sizes.new, sizes.cache_rows, int(sizes.paged), sizes.num_pages,
            sizes.page_size, rotary, sizes.rotary_reach]
    checked = iter(_check_kvcache(*tensors, flat, fn))
    return tuple(None if t is None else next(checked) for t in tensors)
