"""All-gather context parallelism: each rank gathers the whole K/V, a few heads at a time, and attends its own
queries to it; in the backward the K/V gradients of the whole sequence are reduce-scattered back to their owners.

Simpler than the ring (two collectives per head group instead of world - 1 exchanges) and the better choice when
the layout is irregular; the price is a full-sequence K/V buffer for ``kv_heads_per_step`` heads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import checks
from ..backends import choose
from ..backends.spec import AttentionSpec, Saved, accumulation_dtype
from ..ops import attention, attention_backward
from .collectives import reduce_scatter
from .common import block_spec, check, head_spec, sink_grad_of, visible


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, 1)


def _head_groups(hk: int, step: int):
    for h0 in range(0, hk, step):
        yield h0, min(h0 + step, hk)


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, spec: AttentionSpec, heads_per_step: int, group):
        rank, n = dist.get_rank(group), q.shape[1]
        g = q.shape[2] // k.shape[2]
        bspec = block_spec(spec, rank * n, 0)
        backend = choose(q, k, v, bspec)  # one path for every head group, forward and backward
        acc = accumulation_dtype(q.dtype)
        out = q.new_zeros(*q.shape[:-1], v.shape[-1])
        lse = torch.full((q.shape[0], q.shape[2], n), float("-inf"), dtype=acc, device=q.device)
        if sink is not None:  # a head group that sees no key keeps out 0 and lse = the sink
            lse.copy_(sink.detach().to(acc)[None, :, None].expand_as(lse))
        for h0, h1 in _head_groups(k.shape[2], heads_per_step):
            kf, vf = _gather(k[:, :, h0:h1], group), _gather(v[:, :, h0:h1], group)
            if visible(bspec, n, kf.shape[1]):
                heads = slice(h0 * g, h1 * g)
                o, lse[:, heads], _ = attention(q[:, :, heads], kf, vf, head_spec(bspec, heads), backend=backend)
                out[:, :, heads] = o
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.spec, ctx.heads_per_step, ctx.group, ctx.backend = bspec, heads_per_step, group, backend
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        bspec, group = ctx.spec, ctx.group
        world, n = dist.get_world_size(group), q.shape[1]
        g = q.shape[2] // k.shape[2]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for h0, h1 in _head_groups(k.shape[2], ctx.heads_per_step):
            kf, vf = _gather(k[:, :, h0:h1], group), _gather(v[:, :, h0:h1], group)
            heads = slice(h0 * g, h1 * g)
            dkf, dvf = torch.zeros_like(kf), torch.zeros_like(vf)
            if visible(bspec, n, kf.shape[1]):
                saved = Saved(q[:, :, heads], kf, vf, out[:, :, heads], lse[:, heads])
                dq[:, :, heads], dkf, dvf = attention_backward(
                    dout[:, :, heads], None if dlse is None else dlse[:, heads], saved, head_spec(bspec, heads),
                    backend=ctx.backend)
            # Every rank holds a gradient for the whole sequence: sum them, each rank keeping its own chunk.
            for full, mine in ((dkf, dk), (dvf, dv)):
                part = torch.empty_like(mine[:, :, h0:h1])
                reduce_scatter(part, [c.contiguous() for c in full.chunk(world, 1)], group)
                mine[:, :, h0:h1] = part
        return dq, dk, dv, sink_grad_of(ctx, 3, dout, dlse, out, lse, sink), None, None, None


def allgather_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None,  # noqa: PLR0913 (flash_attn's)
                              causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, group=None, kv_heads_per_step=None,
                              learnable_sink=None):
    """``flash_attn_func`` over a contiguously sharded sequence by gathering K/V (``kv_heads_per_step`` key/value
    heads at a time; default all) instead of passing it around a ring. Same arguments and returns as
    ``ring_flash_attn_func``."""
    fn = "allgather_flash_attn_func"
    options = checks.flash_arguments(
        dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, deterministic=deterministic, return_attn_probs=return_attn_probs)
    call = check(fn, q, k, v, group=group, learnable_sink=learnable_sink,
                 **options)
    step = checks.check_heads_per_step(fn, kv_heads_per_step, default=call.k.shape[2])
    out, lse = _AllGatherAttention.apply(call.q, call.k, call.v, call.spec.sink, call.spec, step, group)
    return (out, lse, None) if return_attn_probs else out
