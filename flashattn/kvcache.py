"""The in-place append of new keys and values to a KV cache (dense or paged), before attending it.

Plain torch ops on the new tokens, on any device; the attention itself is ``flashattn.ops.attention`` with
``AttentionSpec.cache`` set, and rotary embeddings are in ``flashattn.rotary``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .quantize import to_fp8
from .rotary import positions


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
