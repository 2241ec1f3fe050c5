"""The checks that read argument values on the host: varlen offsets and maxima, KV-cache lengths and rows, page
ids, the reach of a rotary table. A bad value here would make a kernel or an in-place append read or write stray
memory, so they are checked before anything trusts them. These checks read the values on the host: CPU tensors and
int arguments; a GPU's are checked on the GPU by the same rules (``on_device.py``), with no copy to the host.

In eager mode the checkers call these directly, before the op. Under ``torch.compile`` a host read cannot run while
the graph is traced, so ``deferred.py`` runs the same functions inside a custom op when the graph executes: the
same errors, raised a moment later.
"""

from __future__ import annotations

from itertools import pairwise
from typing import NamedTuple

import torch

from ._base import fail


class VarlenSizes(NamedTuple):
    """The host-side facts a varlen call's offsets must agree with. ``total_k`` is None for a paged K/V."""

    total_q: int
    total_k: int | None
    max_q: int
    max_k: int
    num_pages: int = 0
    page_size: int = 1


class CacheSizes(NamedTuple):
    """The host-side facts ``flash_attn_with_kvcache``'s lengths must agree with: positions per sequence
    (``capacity``), new keys appended, cache rows, pages and page size when paged, and the positions a rotary table
    covers with the reach past ``cache_seqlens`` the call needs (``rotary_positions`` None without rotary)."""

    batch: int
    capacity: int
    new: int
    cache_rows: int
    paged: bool
    num_pages: int = 0
    page_size: int = 1
    rotary_positions: int | None = None
    rotary_reach: int = 0


def host_lists(*tensors: torch.Tensor | None) -> list[list[int] | None]:
    """The values of small index tensors on the host, in one device-to-host copy (None for an absent tensor)."""
    present = [t for t in tensors if t is not None]
    flat = torch.cat([t.reshape(-1).long() for t in present]).tolist() if present else []
    out, i = [], 0
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        out.append(flat[i : i + t.numel()])
        i += t.numel()
    return out


def _offsets(fn: str, name: str, values: list[int], total: int | None) -> list[int]:
    """Per-sequence lengths of cumulative offsets ``values``, which start at 0, never decrease and (when given)
    end at ``total``."""
    if values[0] != 0:
        raise fail(fn, f"{name} must start at 0, got {values[0]}")
    drops = [i for i in range(1, len(values)) if values[i] < values[i - 1]]
    if drops:
        i = drops[0]
        raise fail(fn, f"{name} must be non-decreasing, but {name}[{i}] = {values[i]} < {name}[{i - 1}] = "
                       f"{values[i - 1]}")
    if total is not None and values[-1] != total:
        raise fail(fn, f"{name}[-1] = {values[-1]} must equal the number of packed rows, {total}")
    return [b - a for a, b in pairwise(values)]


def same_batch(fn: str, offsets_q: int, offsets_k: int) -> None:
    if offsets_q != offsets_k:
        raise fail(fn, f"cu_seqlens_q and cu_seqlens_k must describe the same batch, got lengths {offsets_q} and "
                       f"{offsets_k}")


def _at_least_longest(fn: str, name: str, value: int, lengths: list[int]) -> None:
    longest = max(lengths, default=0)
    if value < longest:
        raise fail(fn, f"{name} = {value} is smaller than the longest sequence, {longest}")


def check_varlen_values(fn: str, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                        block_table: torch.Tensor | None, sizes: VarlenSizes) -> list[int]:
    """The offsets of a varlen call and the maxima, and for a paged K/V the page ids its keys use; returns the key
    lengths."""
    cq, ck = host_lists(cu_seqlens_q, cu_seqlens_k)
    lengths_q = _offsets(fn, "cu_seqlens_q", cq, sizes.total_q)
    lengths_k = _offsets(fn, "cu_seqlens_k", ck, sizes.total_k)
    same_batch(fn, len(cq), len(ck))
    _at_least_longest(fn, "max_seqlen_q", sizes.max_q, lengths_q)
    _at_least_longest(fn, "max_seqlen_k", sizes.max_k, lengths_k)
    if block_table is not None:
        check_pages(fn, block_table, lengths_k, num_pages=sizes.num_pages, page_size=sizes.page_size)
    return lengths_k


def check_pages(fn: str, table: torch.Tensor, ends: list[int], *, num_pages: int, page_size: int) -> None:
    """Sequence b's positions 0..ends[b] - 1 fit in ``table``'s pages, and the page ids in use name real pages.
    Only the pages in use are checked: serving engines pad the rest with any value."""
    needed = [-(-end // page_size) for end in ends]
    if max(needed, default=0) > table.shape[1]:
        b = max(range(len(ends)), key=lambda i: needed[i])
        raise fail(fn, f"sequence {b} reaches position {ends[b] - 1}, which needs {needed[b]} pages of "
                       f"{page_size}, but block_table has {table.shape[1]} per sequence")
    pages_in_use = torch.tensor(needed, device=table.device)[:, None]
    used = table[torch.arange(table.shape[1], device=table.device)[None, :] < pages_in_use]
    if used.numel():
        lo, hi = (int(x) for x in torch.aminmax(used))  # a host read: a bad page id would read stray memory
        if lo < 0 or hi >= num_pages:
            raise fail(fn, f"block_table holds page ids in [{lo}, {hi}] for the positions in use, but the cache "
                           f"has pages 0..{num_pages - 1}")


def check_cache_values(fn: str, tensors: tuple, sizes: CacheSizes, *, known_lengths: list[int] | None = None) -> int:
    """``flash_attn_with_kvcache``'s lengths, left padding, cache rows, pages and rotary reach; ``tensors`` =
    (cache_seqlens (None: the whole cache), cache_leftpad, cache_batch_idx, block_table), each None when absent.
    ``known_lengths`` are cache_seqlens already on the host (an int argument: no copy needed for them).

    Returns the most keys any sequence attends (its max_seqlen_k)."""
    seqlens, leftpad, batch_idx, table = tensors
    lengths, pads, rows = host_lists(None if known_lengths is not None else seqlens, leftpad, batch_idx)
    lengths = known_lengths or lengths or [sizes.capacity] * sizes.batch
    pads = pads or [0] * sizes.batch
    for b in range(sizes.batch):
        if lengths[b] < 0 or lengths[b] + sizes.new > sizes.capacity:
            pages = sizes.capacity // sizes.page_size
            room = (f"the {sizes.capacity} positions its block_table row gives it ({pages} page{'s' * (pages != 1)} "
                    f"of {sizes.page_size})" if sizes.paged else f"the cache's {sizes.capacity} positions")
            raise fail(fn, f"cache_seqlens[{b}] = {lengths[b]} plus {sizes.new} new keys does not fit {room}")
        if not 0 <= pads[b] <= lengths[b]:
            raise fail(fn, f"cache_leftpad[{b}] = {pads[b]} must be in [0, cache_seqlens[{b}] = {lengths[b]}]")
    if rows is not None:
        if any(not 0 <= r < sizes.cache_rows for r in rows):
            raise fail(fn, f"cache_batch_idx values must be in [0, {sizes.cache_rows}), got {rows}")
        if sizes.new and len(set(rows)) != len(rows):
            raise fail(fn, f"cache_batch_idx has repeated entries {rows}: two sequences would append to one cache "
                           "row")
    ends = [n + sizes.new for n in lengths]
    if table is not None:
        check_pages(fn, table, ends, num_pages=sizes.num_pages, page_size=sizes.page_size)
    needed = max((n + sizes.rotary_reach for n in lengths), default=0)
    if sizes.rotary_positions is not None and sizes.rotary_positions < needed:
        raise fail(fn, f"rotary_cos/rotary_sin cover {sizes.rotary_positions} positions but this call reaches "
                       f"position {needed - 1}")
    return max((e - p for e, p in zip(ends, pads, strict=True)), default=0)
