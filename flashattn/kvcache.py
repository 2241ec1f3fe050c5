"""The in-place append of new keys and values to a KV cache (dense or paged), before attending it.

On a GPU (with triton) one kernel launch (``kvcache_kernel.py``); elsewhere, and for an FP8 cache fed 16-bit keys
(quantized on the way), plain torch ops on the new tokens. The attention itself is ``flashattn.ops.attention``
with ``AttentionSpec.cache`` set, and rotary embeddings are in ``flashattn.rotary``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .backends import direct
from .backends.triton import installed, interpreting, stubbed_device
from .quantize import to_fp8
from .rotary import apply_rotary, positions


class Rotary(NamedTuple):
    """A call's rotary embedding: the (positions, rotary_dim / 2) tables, GPT-J pairs or GPT-NeoX halves, and
    whether query t sits at position at[b] + t (``advance``) or at at[b]."""

    cos: Tensor
    sin: Tensor
    interleaved: bool
    advance: bool


def rotate_and_append(call) -> Tensor:
    """``prepare`` for a checked ``flash_attn_with_kvcache`` call (``checks.KVCacheCall``)."""
    cache, scales = call.spec.cache, call.spec.descale
    rotary = None if call.rotary is None else Rotary(*call.rotary, call.rotary_interleaved, call.q_positions_advance)
    return prepare((call.q, call.k_cache, call.v_cache, call.k, call.v),
                   (call.cache_seqlens, cache.batch_idx, cache.block_table), rotary=rotary,
                   descale=None if scales is None else (scales.k, scales.v))


def prepare(tensors: tuple, indices: tuple, *, rotary: Rotary | None, descale: tuple | None) -> Tensor:
    """For ``tensors`` = (q, k_cache, v_cache, k, v) (k, v None: nothing to append) and ``indices`` = (at,
    batch_idx, block_table): q rotated (``rotary``; else q), after the new keys (rotated too) and values are
    appended to the caches in place at positions at[b] + t (``append``). With rotary, on a GPU one launch of
    ``rotary_append_kernel`` where it serves the call (``rotary_kernel_serves``), else torch ops."""
    q, k_cache, v_cache, k, v = tensors
    at, batch_idx, block_table = indices
    if rotary is not None:
        tables = rotary.cos, rotary.sin
        if rotary_kernel_serves(q, k_cache, v_cache, k, v, *tables, descale=descale):
            return rotary_by_kernel(tensors, indices, tables, interleaved=rotary.interleaved, advance=rotary.advance)
        q = apply_rotary(q, *tables, positions(at, q.shape[1], advance=rotary.advance), interleaved=rotary.interleaved)
        if k is not None:
            k = apply_rotary(k, *tables, positions(at, k.shape[1]), interleaved=rotary.interleaved)
    if k is not None:
        append(k_cache, v_cache, k, v, at=at, batch_idx=batch_idx, block_table=block_table, descale=descale)
    return q


_ROTATED = (torch.float16, torch.bfloat16, torch.float32)  # rotated in float32, as apply_rotary rotates them


def rotary_kernel_serves(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None, v: Tensor | None,
                         cos: Tensor, sin: Tensor, *, descale) -> bool:
    """Whether ``rotary_append_kernel`` rotates (and appends) a call: a GPU's caches (``_kernel_serves``), q of
    16 or 32 bits, new keys of the caches' dtypes (an FP8 cache quantizes them on the way: torch ops), contiguous
    tables of one layout, something to rotate."""
    return (_kernel_serves(k_cache) and q.dtype in _ROTATED and descale is None and q.numel() > 0
            and (k is None or (k.dtype == k_cache.dtype and v.dtype == v_cache.dtype))
            and cos.is_contiguous() and sin.is_contiguous() and cos.shape[0] > 0)


def rotary_by_kernel(tensors: tuple, indices: tuple, tables: tuple, *, interleaved: bool, advance: bool) -> Tensor:
    """q rotated, and k (rotated) and v appended in place, by one launch of ``rotary_append_kernel``: ``tensors`` =
    (q, k_cache, v_cache, k, v) (k, v None: q alone), ``indices`` = (at, batch_idx, block_table), ``tables`` =
    (cos, sin); query t of entry b at position at[b] + t where ``advance``, else at[b]."""
    from .kvcache_kernel import rotary_append_kernel

    grid, args = _rotary_launch(tensors, indices, tables, interleaved=interleaved, advance=advance)
    direct.launch(rotary_append_kernel, grid, args, device=tensors[0].device, constants=6)
    return args[1]


def _rotary_launch(tensors: tuple, indices: tuple, tables: tuple, *, interleaved: bool,
                   advance: bool) -> tuple[tuple, tuple]:
    """(grid, arguments) of ``rotary_append_kernel`` for ``tensors`` = (q, k_cache, v_cache, k, v) (k, v None:
    queries alone), ``indices`` = (at, batch_idx, block_table), ``tables`` = (cos, sin): its first
    ``Appender.ROTARY_COUNT`` arguments are the call's tensors (the rotated queries second, allocated here), its last
    six its constants."""
    q, k_cache, v_cache, k, v = tensors
    batch, nq, heads_q, _ = q.shape
    cos, sin = tables
    rotated = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # apply_rotary's layout: contiguous
    _, append_args = _append_launch(k_cache, v_cache, k, v, *indices)
    new = 0 if k is None else k.shape[1]
    args = (q, rotated, *append_args[:7], cos, sin, *q.stride(), *rotated.stride(), cos.stride(0), batch, nq,
            heads_q, cos.shape[0], cos.shape[1], *append_args[7:-3], advance, interleaved, _power_of_two(heads_q),
            *append_args[-3:])
    return (batch * (new + nq), 1, 1), args


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


def _append_launch(k_cache: Tensor, v_cache: Tensor, k: Tensor | None, v: Tensor | None, at: Tensor,
                   batch_idx: Tensor | None, block_table: Tensor | None) -> tuple[tuple, tuple]:
    """(grid, arguments) of the append kernel; its first ``Appender.COUNT`` arguments are the call's tensors, its
    last three its constants. Without new keys (k None: ``rotary_append_kernel``'s queries alone) none is read."""
    batch, new, heads, head_dim = (0, 0, k_cache.shape[2], k_cache.shape[3]) if k is None else k.shape
    paged = block_table is not None
    capacity = k_cache.shape[1] * (block_table.shape[1] if paged else 1)
    k_strides, v_strides = ((0,) * 4, (0,) * 4) if k is None else (k.stride(), v.stride())
    args = (k, v, k_cache, v_cache, at, None if paged else batch_idx, block_table, *k_strides, *v_strides,
            *k_cache.stride(), *v_cache.stride(), block_table.stride(0) if paged else 0, new, heads, head_dim,
            v_cache.shape[3], capacity, k_cache.shape[0], k_cache.shape[1],
            _power_of_two(heads), _power_of_two(head_dim), _power_of_two(v_cache.shape[3]))
    return (batch * new, 1, 1), args


class Appender:
    """``prepare`` for the calls of one ``flash_attn_with_kvcache`` signature (``flashattn.fastdecode``: shapes,
    strides, dtypes, devices and ``rotary``'s flags fixed): where a kernel rotates or appends, the first call
    launches it as ``prepare`` does and keeps the compiled kernel's launcher, which the next calls call with their
    tensors alone."""

    __slots__ = ("run",)
    COUNT = 7  # the append kernel's: k, v, k_cache, v_cache, at, batch_idx, block_table
    ROTARY_COUNT = 11  # rotary_append_kernel's: q, the rotated queries, the append's seven, cos, sin

    def __init__(self):
        self.run = None

    def __call__(self, tensors: tuple, indices: tuple, rotary: Rotary | None) -> Tensor:
        """``prepare(tensors, indices, rotary=rotary, descale=None)``."""
        if self.run is not None:
            return self.run(tensors, indices, rotary)
        with torch.no_grad():
            out = prepare(tensors, indices, rotary=rotary, descale=None)
        q, k_cache, v_cache, k, v = tensors
        if rotary is not None and rotary_kernel_serves(q, k_cache, v_cache, k, v, rotary.cos, rotary.sin,
                                                       descale=None):
            from .kvcache_kernel import rotary_append_kernel

            grid, args = _rotary_launch(tensors, indices, (rotary.cos, rotary.sin), interleaved=rotary.interleaved,
                                        advance=rotary.advance)
            launch = direct.prepared(rotary_append_kernel, grid, args, device=q.device, constants=6,
                                     count=self.ROTARY_COUNT)
            if launch is not None:
                self.run = _rotating(launch)
        elif (rotary is None and k is not None and k.dtype == k_cache.dtype and v.dtype == v_cache.dtype
              and k.numel() and _kernel_serves(k_cache)):
            from .kvcache_kernel import append_kernel

            grid, args = _append_launch(k_cache, v_cache, k, v, *indices)
            launch = direct.prepared(append_kernel, grid, args, device=k.device, constants=3, count=self.COUNT)
            if launch is not None:
                self.run = _appending(launch)
        return out


def _rotating(launch):
    def run(tensors: tuple, indices: tuple, rotary: Rotary) -> Tensor:
        q, k_cache, v_cache, k, v = tensors
        at, batch_idx, table = indices
        rotated = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        launch((q, rotated, k, v, k_cache, v_cache, at, None if table is not None else batch_idx, table, rotary.cos,
                rotary.sin))
        return rotated

    return run


def _appending(launch):
    def run(tensors: tuple, indices: tuple, rotary: None) -> Tensor:
        q, k_cache, v_cache, k, v = tensors
        at, batch_idx, table = indices
        launch((k, v, k_cache, v_cache, at, None if table is not None else batch_idx, table))
        return q

    return run


def _power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
