"""What every distributed layout shares: argument checks, the per-block options, and ring exchanges."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .. import checks
from ..backends.combine import merge_states
from ..backends.spec import AttentionSpec
from ..ops import attention


def check(fn: str, q, k, v, group, *, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
          deterministic) -> checks.CheckedCall:
    """The ``flash_attn_func`` checks on the local shards, plus what context parallelism needs: self-attention
    (q and k/v shards of the same length) of equal length on every rank, and no dropout."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{fn}: torch.distributed is not initialised; call torch.distributed.init_process_group")
    call = checks.check_flash(fn, q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                              window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                              deterministic=deterministic, return_attn_probs=False)
    if call.spec.dropout_p > 0:
        raise ValueError(f"{fn}: dropout_p must be 0: a dropout mask drawn per block would not match one device's "
                         "and could repeat across blocks; apply dropout outside attention or use one device")
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"{fn}: context parallelism shards one sequence for q, k and v alike; got local lengths "
                         f"{q.shape[1]} (q) and {k.shape[1]} (k)")
    mine = torch.tensor([q.shape[1]], device=q.device)
    parts = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    lengths = [int(p) for p in parts]
    if len(set(lengths)) != 1:
        raise ValueError(f"{fn}: every rank must hold the same number of tokens, got {lengths}; shard with "
                         "flashattn.distributed.shard (pad the sequence to a multiple)")
    return call


def block_spec(spec: AttentionSpec, q_start: int, k_start: int) -> AttentionSpec:
    """Options for queries starting at global token ``q_start`` against keys starting at ``k_start``: the
    causal/window diagonal (self-attention: top-left = bottom-right) moved by the distance between the two."""
    return dataclasses.replace(spec, bottom_right=False, offset=q_start - k_start)


def visible(spec: AttentionSpec, nq: int, nk: int) -> bool:
    lo, hi = spec.band(nq, nk).key_range(0, nq, nk)
    return hi > lo


class Partial:
    """The running (out, lse) of one query run, merged block by block in float32 (float64 stays float64)."""

    def __init__(self):
        self.out = self.lse = None

    def add(self, q, k, v, spec, alibi) -> None:
        out, lse, _ = attention(q, k, v, spec, alibi_slopes=alibi)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        out, lse = out.to(acc), lse.to(acc)
        if self.out is None:
            self.out, self.lse = out, lse
        else:
            self.out, self.lse = merge_states(self.out, self.lse, out, lse)

    def result(self, q: torch.Tensor, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.out is None:  # no key visible at all
            b, n, h, _ = q.shape
            acc = torch.float64 if q.dtype == torch.float64 else torch.float32
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
