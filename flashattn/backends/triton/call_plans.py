"""Launch plans whose calls bring tensors besides q, k and v: a decode step's cache bounds (``CachePlan``) and a
packed batch's offsets (``VarlenPlan``), each put where the recorded plan takes them among the spec's tensors
(``plans.spec_tensors``). The triton path hands them out (``attend.cache_plan``, ``attend.varlen_plan``) to the
fast paths that replay them (``flashattn.fastdecode``, ``flashattn.fastpath``).
"""

from __future__ import annotations

import torch

from ..spec import AttentionSpec
from . import plans


def plan_tensors(spec: AttentionSpec) -> list:
    """The spec's tensors as a forward plan takes them after q, k and v (``plans.spec_tensors``)."""
    return plans.spec_tensors(spec)[0]


def plan_slot(field: str) -> int:
    """Where the spec's tensor ``field`` (e.g. "cache_k_end") sits among a forward plan's inputs."""
    return 3 + plans.tensor_slot(field)


class CachePlan:
    """A KV-cache call's forward plan, each call's cache bounds (``checks.kvcache.CacheBounds``) put where the
    plan takes them among its inputs: the same launches for every step of a generation."""

    __slots__ = ("inputs", "plan", "slots")

    def __init__(self, plan: plans.Plan, spec: AttentionSpec):
        self.plan = plan
        self.slots = tuple(map(plan_slot, ("cache_k_start", "cache_k_end", "cache_batch_idx", "cache_block_table")))
        self.inputs = plan_tensors(spec)
        for slot in self.slots:  # brought by each call, none kept
            self.inputs[slot - 3] = None

    def run(self, q, k_cache, v_cache, bounds) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = [q, k_cache, v_cache, *self.inputs]
        start, end, rows, pages = self.slots
        inputs[start], inputs[end], inputs[rows], inputs[pages] = (bounds.k_start, bounds.k_end, bounds.batch_idx,
                                                                   bounds.block_table)
        return self.plan.run(inputs, q.device)


class VarlenPlan:
    """A ``flash_attn_varlen_func`` call's forward plan: each call brings its offsets (and with a paged K/V its key
    counts and block table), put where the plans (the forward's, and the backward's after the saved tensors) take
    them among the spec's tensors (``inputs``)."""

    __slots__ = ("plan", "slots", "tensors")
    FIELDS = ("varlen_cu_seqlens_q", "varlen_cu_seqlens_k", "cache_k_end", "cache_block_table")

    def __init__(self, plan: plans.Plan, spec: AttentionSpec):
        self.plan = plan
        self.slots = tuple(map(plans.tensor_slot, self.FIELDS[:2 if spec.cache is None else 4]))
        self.tensors = plan_tensors(spec)
        for slot in self.slots:  # brought by each call, none kept
            self.tensors[slot] = None

    def inputs(self, head: tuple, offsets: tuple) -> tuple:
        """A plan's inputs: ``head`` (q, k, v; or dout, dlse and the saved tensors), then the spec's tensors with
        ``offsets`` = (cu_seqlens_q, cu_seqlens_k[, the key counts, block_table]) in their places."""
        tensors = self.tensors.copy()
        for slot, tensor in zip(self.slots, offsets, strict=True):
            tensors[slot] = tensor
        return (*head, *tensors)

    def run(self, inputs: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return self.plan.run(inputs, device)
