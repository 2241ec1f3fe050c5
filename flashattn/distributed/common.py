"""What every distributed layout shares: argument checks, the per-block options, and ring exchanges."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .. import checks
from ..backends.merge import merge_states
from ..backends.spec import AttentionSpec, accumulation_dtype
from ..ops import attention, sink_grad


def check(fn: str, q, k, v, *, group, layout: str = "contiguous", **options) -> checks.CheckedCall:
    """``checks.check_context_parallel`` on the local shards, plus the lengths of every rank's shard (one small
    all-gather)."""
    call = checks.check_context_parallel(fn, q, k, v, layout=layout, **options)
    mine = torch.tensor([call.q.shape[1]], device=call.q.device)
    parts = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    checks.check_shard_lengths(fn, [int(p) for p in parts])
    return call


def block_spec(spec: AttentionSpec, q_start: int, k_start: int) -> AttentionSpec:
    """Options for queries starting at global token ``q_start`` against keys starting at ``k_start``: the
    causal/window diagonal (self-attention: top-left = bottom-right) moved by the distance between the two."""
    return dataclasses.replace(spec, bottom_right=False, diagonal_offset=q_start - k_start)


def head_spec(spec: AttentionSpec, heads: slice) -> AttentionSpec:
    """Options for the query heads ``heads`` alone (their ALiBi slopes and sinks)."""
    alibi, sink = spec.alibi_slopes, spec.sink
    return dataclasses.replace(spec, alibi_slopes=None if alibi is None else alibi[:, heads].contiguous(),
                               sink=None if sink is None else sink[heads].contiguous())


def sink_grad_of(ctx, index: int, dout, dlse, out, lse, sink) -> torch.Tensor | None:
    """The gradient of the sink logits from this rank's rows (or None when input ``index`` needs none): each rank
    holds its share, and summing over the group, as DDP and FSDP do for every replicated parameter, gives the
    whole."""
    if sink is None or not ctx.needs_input_grad[index]:
        return None
    return sink_grad(dout, dlse, out, lse, sink)


def visible(spec: AttentionSpec, nq: int, nk: int) -> bool:
    lo, hi = spec.band(nq, nk).key_range(0, nq, nk)
    return hi > lo


class Partial:
    """The running (out, lse) of one query run, merged block by block in float32 (float64 stays float64)."""

    def __init__(self, backend: str):
        self.backend = backend
        self.out = self.lse = None

    def add(self, q, k, v, spec: AttentionSpec) -> None:
        out, lse, _ = attention(q, k, v, spec, backend=self.backend)
        acc = accumulation_dtype(q.dtype)
        out, lse = out.to(acc), lse.to(acc)
        if self.out is None:
            self.out, self.lse = out, lse
        else:
            self.out, self.lse = merge_states(self.out, self.lse, out, lse)

    def result(self, q: torch.Tensor, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.out is None:  # no key visible at all
            b, n, h, _ = q.shape
            acc = accumulation_dtype(q.dtype)
            return (q.new_zeros(b, n, h, dv, dtype=acc), q.new_full((b, h, n), float("-inf"), dtype=acc))
        return self.out, self.lse


def exchange(tensors: list[torch.Tensor], group) -> tuple[list[torch.Tensor], list]:
    """Send ``tensors`` to the next rank and receive the previous rank's into fresh buffers, asynchronously
    (``batch_isend_irecv``); returns the buffers and the requests to wait on before reading them."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:  # a ring of one: the block is already home
        return list(tensors), []
    nxt = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
    prv = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, prv, group) for r in received]
    return received, dist.batch_isend_irecv(ops)
