"""The in-place append of new keys and values to a KV cache (dense or paged), before attending it.

On a GPU (with triton) one kernel launch (``kvcache_kernel.py``); elsewhere, and for an FP8 cache fed 16-bit keys
(quantized on the way), plain torch ops on the new tokens. The attention itself is ``flashattn.ops.attention``
with ``AttentionSpec.cache`` set, and rotary embeddings are in ``flashattn.rotary``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .backends import direct
from .backends.triton import installed, interpreting, stubbed_device
from .quantize import to_fp8
from .rotary import apply_rotary, positions


def rotate_and_append(call) -> Tensor:
    """A checked ``flash_attn_with_kvcache`` call's (``checks.KVCacheCall``) queries rotated (with its rotary
    tables), after its new keys (rotated too) and values are appended to the caches in place."""
    q, k = call.q, call.k
    if call.rotary is not None:
        cos, sin = call.rotary
        at = positions(call.cache_seqlens, q.shape[1], advance=call.q_positions_advance)
        q = apply_rotary(q, cos, sin, at, interleaved=call.rotary_interleaved)
        if k is not None:
            k = apply_rotary(k, cos, sin, positions(call.cache_seqlens, k.shape[1]),
                             interleaved=call.rotary_interleaved)
    if k is not None:
        cache, scales = call.spec.cache, call.spec.descale
        append(call.k_cache, call.v_cache, k, call.v, at=call.cache_seqlens, batch_idx=cache.batch_idx,
               block_table=cache.block_table, descale=None if scales is None else (scales.k, scales.v))
    return q


def append(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, *, at: Tensor, batch_idx: Tensor | None = None,
           block_table: Tensor | None = None, descale: tuple[Tensor, Tensor] | None = None) -> None:
    """Write the new k, v (B, N, Hk, D) into the caches in place at positions at_b .. at_b + N - 1 of sequence b:
    row ``batch_idx[b]`` (default b) of a dense cache, or the pages ``block_table[b]`` of a paged one. An FP8
    cache takes 16-bit or float32 k, v quantized with ``descale`` = (k_descale, v_descale), each (B, Hk)
    (``quantize.to_fp8``); FP8 ones are copied as they are.

    Example::

        >>> cache = torch.zeros(2, 4, 1, 1)
        >>> append(cache, cache, torch.ones(2, 1, 1, 1), torch.ones(2, 1, 1, 1), at=torch.tensor([0, 2]))
        >>> cache.flatten(1).tolist()
        [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]
    """
    if k.dtype == k_cache.dtype and v.dtype == v_cache.dtype and k.numel() and _kernel_serves(k_cache):
        append_by_kernel(k_cache, v_cache, k, v, at=at, batch_idx=batch_idx, block_table=block_table)
        return
    if (k.dtype == k_cache.dtype and v.dtype == v_cache.dtype and block_table is None and k_cache.is_cpu
            and not torch.compiler.is_compiling()):  # (compiled: the indexed write, which it fuses)
        append_rows(k_cache, v_cache, k, v, at=at.tolist(), batch_idx=batch_idx)
        return
    pos = positions(at, k.shape[1])
    if block_table is not None:
        page_size = k_cache.shape[1]
        index = (block_table.long().gather(1, pos // page_size), pos % page_size)
    else:
        rows = torch.arange(k.shape[0], device=k.device) if batch_idx is None else batch_idx.long()
        index = (rows[:, None].expand_as(pos), pos)
    if k.dtype != k_cache.dtype:  # checked: an FP8 cache and 16-bit or float32 new keys
        k, v = to_fp8(k, descale[0], k_cache.dtype), to_fp8(v, descale[1], v_cache.dtype)
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)


def append_rows(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, *, at: list[int],
                batch_idx: Tensor | None) -> None:
    """``append`` into a dense CPU cache of k's and v's dtypes as one copy of each sequence's new rows (its
    positions are consecutive, from ``at[b]``, checked): a decode step's few rows cost a tenth of ``index_put_``'s
    indexing."""
    new = k.shape[1]
    entries = range(k.shape[0]) if batch_idx is None else batch_idx.tolist()
    for b, (row, start) in enumerate(zip(entries, at, strict=True)):
        k_cache[row, start:start + new].copy_(k[b])
        v_cache[row, start:start + new].copy_(v[b])


def _kernel_serves(cache: Tensor) -> bool:
    """Whether the append kernel writes into ``cache``: a GPU's (or a stubbed one's) with triton, not its
    interpreter, in eager mode (torch.compile traces the torch ops, which it fuses itself)."""
    return (not torch.compiler.is_compiling() and (cache.is_cuda or stubbed_device() is not None)
            and not interpreting() and installed())


def append_by_kernel(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, *, at: Tensor,
                     batch_idx: Tensor | None = None, block_table: Tensor | None = None) -> None:
    """``append`` as one launch of ``kvcache_kernel.append_kernel`` (k, v of the caches' dtypes)."""
    from .kvcache_kernel import append_kernel

    grid, args = _append_launch(k_cache, v_cache, k, v, at, batch_idx, block_table)
    direct.launch(append_kernel, grid, args, device=k.device, constants=3)


def _append_launch(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, at: Tensor, batch_idx: Tensor | None,
                   block_table: Tensor | None) -> tuple[tuple, tuple]:
    """(grid, arguments) of the append kernel; its first ``Appender.COUNT`` arguments are the call's tensors."""
    batch, new, heads, head_dim = k.shape
    paged = block_table is not None
    capacity = k_cache.shape[1] * (block_table.shape[1] if paged else 1)
    args = (k, v, k_cache, v_cache, at, None if paged else batch_idx, block_table, *k.stride(), *v.stride(),
            *k_cache.stride(), *v_cache.stride(), block_table.stride(0) if paged else 0, new, heads, head_dim,
            v.shape[3], capacity, k_cache.shape[0], k_cache.shape[1],
            _power_of_two(heads), _power_of_two(head_dim), _power_of_two(v.shape[3]))
    return (batch * new, 1, 1), args


class Appender:
    """``append`` for the calls of one ``flash_attn_with_kvcache`` signature (``flashattn.fastdecode``: shapes,
    strides, dtypes and devices fixed): where the kernel appends, the first call launches it as ``append`` does
    and keeps the compiled kernel's launcher, which the next calls call with their tensors alone."""

    __slots__ = ("run",)
    COUNT = 7  # k, v, k_cache, v_cache, at, batch_idx, block_table

    def __init__(self):
        self.run = None

    def __call__(self, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, *, at: Tensor,
                 batch_idx: Tensor | None, block_table: Tensor | None) -> None:
        if self.run is not None:
            return self.run((k, v, k_cache, v_cache, at, None if block_table is not None else batch_idx,
                             block_table))
        with torch.no_grad():
            append(k_cache, v_cache, k, v, at=at, batch_idx=batch_idx, block_table=block_table)
        if k.dtype == k_cache.dtype and v.dtype == v_cache.dtype and k.numel() and _kernel_serves(k_cache):
            from .kvcache_kernel import append_kernel

            grid, args = _append_launch(k_cache, v_cache, k, v, at, batch_idx, block_table)
            self.run = direct.prepared(append_kernel, grid, args, device=k.device, constants=3, count=self.COUNT)
        return None


def _power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
