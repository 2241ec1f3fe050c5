"""``S_dmask`` as flash_attn scales it. flashattn's ``return_attn_probs`` gives the attention weights themselves
(negated where dropout dropped them); flash_attn's CUDA kernels store, for each block of ``_get_block_size_n`` keys,
``exp(score - m)`` with ``m`` the running maximum of the row when that block was reached (its kernels walk the key
blocks from the last), and its own tests undo exactly that scaling. Under flash_attn's names (``install_as_flash_attn``)
the weights are handed out in that form: each block divided by the largest weight of the blocks from it to the end
of the row, which is the same thing computed from the weights instead of the scores.

Example::

    >>> p = torch.tensor([[[[0.5, 0.25, 0.25]]]])
    >>> flash_scaled(p, block=2)  # the first block over max(0.5, 0.25); the second over 0.25
    tensor([[[[1.0000, 0.5000, 1.0000]]]])
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
from torch import Tensor


def flash_scaled(probs: Tensor, *, block: int) -> Tensor:
    """``probs`` (..., seqlen_k), signed by dropout, rescaled block by block as flash_attn's ``S_dmask``."""
    blocks = probs.split(block, dim=-1)
    maxima = torch.stack([b.abs().amax(dim=-1) for b in blocks], dim=-1)
    running = maxima.flip(-1).cummax(dim=-1).values.flip(-1)  # the row's maximum as the kernel reaches each block
    running = torch.where(running > 0, running, torch.ones_like(running))  # a row that sees no key stays 0
    return torch.cat([b / m.unsqueeze(-1) for b, m in zip(blocks, running.unbind(-1), strict=True)], dim=-1)


def with_flash_probs(function: Callable, block_size: Callable[..., int]) -> Callable:
    """``function`` (a public ``flash_attn_*func``) whose ``S_dmask`` comes scaled as flash_attn's; the rest of
    its results and its signature unchanged. ``block_size(device, head_dim, is_dropout, is_causal)`` is
    ``_get_block_size_n``."""
    signature = inspect.signature(function)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        result = function(*args, **kwargs)
        if not isinstance(result, tuple) or len(result) != 3 or result[2] is None:
            return result
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        first = next(iter(bound.arguments.values()))  # q, or qkv: its last dim is q's head dim either way
        out, lse, probs = result
        block = block_size(probs.device, first.shape[-1], bound.arguments["dropout_p"] > 0, bound.arguments["causal"])
        return out, lse, flash_scaled(probs, block=block)

    return wrapper
