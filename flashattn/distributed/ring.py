"""Ring attention: K/V blocks travel around the ring of ranks while each rank attends its own queries to them.

Step s of the forward: rank r holds the K/V of rank r - s, attends its queries to it (skipping blocks the causal
or window mask hides entirely), merges the partial result by log-sum-exp, and meanwhile passes the block on
(``batch_isend_irecv``, overlapped with the compute). The backward walks the ring again with (K, V, dK, dV): each
rank adds its queries' share of dK/dV to the travelling accumulators, which arrive home after a full turn.
The zigzag layout is the same ring over ranks holding two chunks each (one early, one late).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .. import checks
from ..backends import choose
from ..backends.merge import with_sink
from ..backends.spec import AttentionSpec, Saved, accumulation_dtype
from ..ops import attention_backward
from .common import Partial, block_spec, check, exchange, sink_grad_of, visible
from .layout import segments


def _pairs(layout, rank, src, world, n, spec):
    """(query slice, key slice, block spec) for every visible pair of this rank's and rank src's token runs."""
    for gq, sq, lq in segments(layout, rank, world, n):
        for gk, sk, lk in segments(layout, src, world, n):
            bspec = block_spec(spec, gq, gk)
            if visible(bspec, lq, lk):
                yield slice(sq, sq + lq), slice(sk, sk + lk), bspec


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, spec: AttentionSpec, layout: str, group):
        spec = dataclasses.replace(spec, sink=None)  # the sink joins once, after every block has merged
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        n = q.shape[1]
        backend = choose(q, k, v, spec)  # one path for every block, forward and backward
        runs = {sq: Partial(backend) for _, sq, _ in segments(layout, rank, world, n)}
        kv = [k, v]
        for step in range(world):
            pending = exchange(kv, group) if step < world - 1 else None
            for qs, ks, bspec in _pairs(layout, rank, (rank - step) % world, world, n, spec):
                runs[qs.start].add(q[:, qs], kv[0][:, ks], kv[1][:, ks], bspec)
            if pending is not None:
                kv, requests = pending
                for r in requests:
                    r.wait()
        parts = [runs[sq].result(q[:, sq : sq + lq], v.shape[-1]) for _, sq, lq in segments(layout, rank, world, n)]
        out = torch.cat([o for o, _ in parts], 1)
        lse = torch.cat([lse for _, lse in parts], 2).to(accumulation_dtype(q.dtype))
        if sink is not None:
            out, lse = with_sink(out, lse, sink)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.spec, ctx.layout, ctx.group, ctx.backend = spec, layout, group, backend
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        spec, layout, group = ctx.spec, ctx.layout, ctx.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        n = q.shape[1]
        acc = accumulation_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        held = [k, v, torch.zeros(k.shape, dtype=acc, device=k.device),
                torch.zeros(v.shape, dtype=acc, device=v.device)]
        for step in range(world):
            kc, vc, dk, dv = held
            for qs, ks, bspec in _pairs(layout, rank, (rank - step) % world, world, n, spec):
                saved = Saved(q[:, qs], kc[:, ks], vc[:, ks], out[:, qs], lse[:, :, qs])
                g = attention_backward(dout[:, qs], None if dlse is None else dlse[:, :, qs], saved, bspec,
                                       backend=ctx.backend)
                dq[:, qs] += g[0]
                dk[:, ks] += g[1]
                dv[:, ks] += g[2]
            # Pass the block and its gradient accumulators on; after the last step only dK/dV travel, home.
            travelling = held if step < world - 1 else [dk, dv]
            received, requests = exchange(travelling, group)
            for r in requests:
                r.wait()
            held = received if step < world - 1 else [None, None, *received]
        dsink = sink_grad_of(ctx, 3, dout, dlse, out, lse, sink)
        return dq.to(q.dtype), held[2].to(k.dtype), held[3].to(v.dtype), dsink, None, None, None


def _ring(fn: str, layout: str, q, k, v, *, group, **options):
    call = check(fn, q, k, v, group=group, layout=layout, **options)
    out, lse = _RingAttention.apply(call.q, call.k, call.v, call.spec.sink, call.spec, layout, group)
    return (out, lse, None) if options["return_attn_probs"] else out


def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,  # noqa: PLR0913 (flash_attn's)
                         window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                         return_attn_probs=False, group=None, learnable_sink=None):
    """``flash_attn_func`` over a sequence sharded contiguously across ``group`` (rank r holds tokens
    [r N/w, (r + 1) N/w) of q, k and v; ``flashattn.distributed.shard``), by ring attention.

    Args are those of ``flash_attn_func`` (dropout_p must be 0) plus ``group`` (default: the whole world).
    ``learnable_sink`` (nheads,) joins every row's denominator once; its gradient on each rank is the share of this
    rank's rows: summed over the group, as DDP and FSDP do for replicated parameters, it is one device's.
    Returns this rank's rows of the output, or (out, softmax_lse (batch, nheads, local_len), None) with
    ``return_attn_probs``: exactly what one device computes for these rows. Differentiable.
    """
    options = checks.flash_arguments(
        dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, deterministic=deterministic, return_attn_probs=return_attn_probs)
    return _ring("ring_flash_attn_func", "contiguous", q, k, v, group=group, learnable_sink=learnable_sink,
                 **options)


def zigzag_ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None,  # noqa: PLR0913 (flash_attn's)
                                causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                deterministic=False, return_attn_probs=False, group=None, learnable_sink=None):
    """``ring_flash_attn_func`` on the zigzag layout (``shard(x, "zigzag")``: rank r holds chunks r and
    2w - 1 - r of 2w), which gives every rank the same causal work."""
    options = checks.flash_arguments(
        dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, deterministic=deterministic, return_attn_probs=return_attn_probs)
    return _ring("zigzag_ring_flash_attn_func", "zigzag", q, k, v, group=group, learnable_sink=learnable_sink,
                 **options)
