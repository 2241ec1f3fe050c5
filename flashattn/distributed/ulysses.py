"""Ulysses (DeepSpeed) context parallelism: an all-to-all turns sequence shards into head shards, each rank runs
ordinary attention on the whole sequence for its heads, and a second all-to-all turns the output back.

Two all-to-alls of q, k, v and out per layer, independent of the mask, and any local attention inside; the
number of heads (and of key/value heads) must divide by the world size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import checks
from ..ops import attention
from .collectives import all_to_all
from .common import check, head_spec


class _AllToAll(torch.autograd.Function):
    """Split ``x`` into world chunks along ``scatter_dim``, send chunk j to rank j, and concatenate what arrives
    along ``gather_dim``. Its gradient is the opposite all-to-all."""

    @staticmethod
    def forward(ctx, x, scatter_dim: int, gather_dim: int, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        world = dist.get_world_size(group)
        sends = [c.contiguous() for c in x.chunk(world, scatter_dim)]
        received = [torch.empty_like(sends[0]) for _ in range(world)]
        all_to_all(received, sends, group)
        return torch.cat(received, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _AllToAll.apply(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def ulysses_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None,  # noqa: PLR0913 (flash_attn's)
                            causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                            deterministic=False, return_attn_probs=False, group=None, learnable_sink=None):
    """``flash_attn_func`` over a contiguously sharded sequence by head parallelism (all-to-all). Same arguments
    and returns as ``ring_flash_attn_func``; nheads and nheads_k must be multiples of the world size."""
    fn = "ulysses_flash_attn_func"
    options = checks.flash_arguments(
        dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, deterministic=deterministic, return_attn_probs=return_attn_probs)
    call = check(fn, q, k, v, group=group, learnable_sink=learnable_sink,
                 **options)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    checks.check_head_parallel(fn, nheads=call.q.shape[2], nheads_k=call.k.shape[2], world=world)
    qh, kh, vh = (_AllToAll.apply(t, 2, 1, group) for t in (call.q, call.k, call.v))
    per = call.q.shape[2] // world
    out, lse, _ = attention(qh, kh, vh, head_spec(call.spec, slice(rank * per, (rank + 1) * per)))
    out = _AllToAll.apply(out, 1, 2, group)
    lse = _AllToAll.apply(lse, 2, 1, group)
    return (out, lse, None) if return_attn_probs else out
