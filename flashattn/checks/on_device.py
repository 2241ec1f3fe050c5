"""Index values checked where they live, so that a GPU call never synchronises with the host.

A KV-cache call's lengths, left padding, cache rows and page ids, and a varlen call's offsets, decide where its
kernels read and write. On the host (CPU tensors, int arguments) ``values.py`` checks them and raises a clear
error. On a GPU reading them costs a device-to-host copy that stalls the stream on every call (and cannot be
captured in a CUDA graph), so there one small kernel (``device_kernels.py``) checks the same rules in stream order
before any kernel uses the values: a broken rule stops the process with a device-side assertion naming the
function and the rule, as a bad index into a PyTorch CUDA op does. Independently, the kernels that read these
values clamp each one to the tensors they index, so no value can make them read or write outside memory.

Example (a GPU's tensors; the call returns at once)::

    if not values_on_host(cache_seqlens):
        check_cache("flash_attn_with_kvcache", (cache_seqlens, None, None, None), sizes)
"""

from __future__ import annotations

import torch

from ..backends.direct import launch, prepared
from ..backends.triton import stubbed_device  # the path's declaration only: no triton is loaded
from .values import CacheSizes, VarlenSizes


def values_on_host(*tensors: torch.Tensor | None) -> bool:
    """Whether the values of ``tensors`` can be read without a device-to-host copy: all on the CPU, outside a
    stubbed GPU (where CPU tensors stand for a GPU's: ``flashattn.backends.triton.stub``). True when all are
    None."""
    if stubbed_device() is not None:
        return all(t is None for t in tensors)
    return all(t is None or t.is_cpu for t in tensors)


def _block(n: int, low: int, high: int) -> int:
    return min(max(1 << max(0, n - 1).bit_length(), low), high)


def _cache_args(fn: str, tensors: tuple, sizes: CacheSizes, errors: torch.Tensor | None) -> tuple:
    table = tensors[3]
    rotary = -1 if sizes.rotary_positions is None else sizes.rotary_positions
    pages_per_seq = 0 if table is None else table.shape[1]
    return (*tensors, errors, sizes.batch, sizes.capacity, sizes.new, sizes.cache_rows, sizes.num_pages,
            sizes.page_size, pages_per_seq, 0 if table is None else table.stride(0), rotary, sizes.rotary_reach,
            fn, _block(sizes.batch, 16, 64), _block(pages_per_seq, 16, 64))


def check_cache(fn: str, tensors: tuple, sizes: CacheSizes, *, errors: torch.Tensor | None = None) -> None:
    """Launch the device check of ``flash_attn_with_kvcache``'s index values: ``tensors`` = (cache_seqlens (None:
    the whole cache), cache_leftpad, cache_batch_idx, block_table), None where absent. ``errors`` (int64 (4,)):
    where the kernel writes the first broken rule (``describe``)."""
    from . import device_kernels

    launch(device_kernels.check_cache_kernel, (1, 1, 1), _cache_args(fn, tensors, sizes, errors),
           device=next(t for t in tensors if t is not None).device, constants=3)


class CacheCheck:
    """``check_cache`` for the calls of one signature (``flashattn.fastpath``: their sizes, the block table's
    layout and the index tensors' kinds fixed): the first launches it as ``check_cache`` does, the next call the
    compiled check's launcher with their tensors alone (a decode step's host time: 11 -> 4 us stubbed)."""

    __slots__ = ("fn", "run", "sizes")
    COUNT = 4  # the arguments each call brings: cache_seqlens, cache_leftpad, cache_batch_idx, block_table

    def __init__(self, fn: str, sizes: CacheSizes | VarlenSizes):
        self.fn, self.sizes, self.run = fn, sizes, None

    def __call__(self, tensors: tuple) -> None:
        if self.run is not None:
            return self.run(tensors)
        from . import device_kernels

        kernel, args = self._arguments(device_kernels, tensors)
        device = next(t for t in tensors if t is not None).device
        launch(kernel, (1, 1, 1), args, device=device, constants=3)
        self.run = prepared(kernel, (1, 1, 1), args, device=device, constants=3, count=self.COUNT)
        return None

    def _arguments(self, kernels, tensors: tuple) -> tuple:
        return kernels.check_cache_kernel, _cache_args(self.fn, tensors, self.sizes, None)


class VarlenCheck(CacheCheck):
    """``check_varlen`` for the calls of one varlen signature: ``tensors`` = (cu_seqlens_q, cu_seqlens_k,
    block_table or None), whose values each call brings."""

    __slots__ = ()
    COUNT = 3

    def _arguments(self, kernels, tensors: tuple) -> tuple:
        return kernels.check_varlen_kernel, _varlen_args(self.fn, *tensors, self.sizes, None)


def _varlen_args(fn: str, cu_seqlens_q, cu_seqlens_k, block_table, sizes: VarlenSizes, errors) -> tuple:
    batch = cu_seqlens_q.numel() - 1
    pages_per_seq = 0 if block_table is None else block_table.shape[1]
    return (cu_seqlens_q, cu_seqlens_k, block_table, errors, batch, sizes.total_q,
            -1 if sizes.total_k is None else sizes.total_k, sizes.max_q, sizes.max_k, sizes.num_pages,
            sizes.page_size, pages_per_seq, 0 if block_table is None else block_table.stride(0),
            fn, _block(batch + 1, 16, 64), _block(pages_per_seq, 16, 64))


def check_varlen(fn: str, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, block_table: torch.Tensor | None,
                 sizes: VarlenSizes, *, errors: torch.Tensor | None = None) -> None:
    """Launch the device check of a varlen call's offsets (and a paged K/V's pages in use)."""
    from . import device_kernels

    launch(device_kernels.check_varlen_kernel, (1, 1, 1),
           _varlen_args(fn, cu_seqlens_q, cu_seqlens_k, block_table, sizes, errors), device=cu_seqlens_q.device,
           constants=3)


def describe(fn: str, record: list[int]) -> str | None:
    """The broken rule a check kernel wrote to ``errors`` (code, row, column, value), in words; None if none."""
    from . import device_kernels

    code, row, column, value = record
    if code == 0:
        return None
    what = {
        "cache_length": f"cache_seqlens[{row}] = {value} plus the new keys does not fit the cache",
        "cache_leftpad": f"cache_leftpad[{row}] = {value} must be in [0, cache_seqlens[{row}]]",
        "cache_row": f"cache_batch_idx[{row}] = {value} is not a row of the cache",
        "cache_repeated_row": f"cache_batch_idx[{row}] = {value} is repeated: two sequences would append to one "
                              "cache row",
        "pages_short": f"sequence {row} needs {value} pages, more than block_table has per sequence",
        "page_id": f"block_table[{row}, {column}] = {value} is a page in use but not a page of the cache",
        "rotary_reach": f"sequence {row} reaches position {value}, past rotary_cos/rotary_sin",
        "q_start": f"cu_seqlens_q must start at 0, got {value}",
        "q_order": f"cu_seqlens_q must be non-decreasing, but cu_seqlens_q[{row}] = {value} is smaller than the one "
                   "before",
        "q_end": f"cu_seqlens_q[-1] = {value} must equal the number of packed rows",
        "k_start": f"cu_seqlens_k must start at 0, got {value}",
        "k_order": f"cu_seqlens_k must be non-decreasing, but cu_seqlens_k[{row}] = {value} is smaller than the one "
                   "before",
        "k_end": f"cu_seqlens_k[-1] = {value} must equal the number of packed rows",
        "q_longest": f"sequence {row} has {value} queries, more than max_seqlen_q",
        "k_longest": f"sequence {row} has {value} keys, more than max_seqlen_k",
    }[device_kernels.CODES[code - 1]]
    return f"{fn}: {what}"
