"""The numerics of merging partial attention results by their log-sum-exp, shared by the backends' split-KV
paths, context parallelism and the public ``flashattn.merge_attention_states`` (which adds argument checks)."""

from __future__ import annotations

import torch
from torch import Tensor

from .spec import accumulation_dtype


def merge_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """out (..., seqlen, nheads, headdim) and lse (..., nheads, seqlen) of the union of two disjoint key sets;
    see ``flashattn.merge_attention_states``."""
    acc = accumulation_dtype(torch.promote_types(out_a.dtype, lse_a.dtype))
    la, lb = lse_a.to(acc), lse_b.to(acc)
    hi = torch.maximum(la, lb)
    lo = torch.minimum(la, lb)
    empty = hi == float("-inf")
    hi_safe = torch.where(empty, torch.zeros_like(hi), hi)
    # log(e^hi + e^lo) = hi + log1p(e^{lo - hi}), with lo - hi <= 0: no overflow, and exact when lo = -inf.
    lse = torch.where(empty, hi, hi_safe + torch.log1p(torch.exp(lo - hi_safe)))
    # The weights e^{lse_a - lse} and e^{lse_b - lse} are sigmoid(+-(lse_a - lse_b)): from the difference alone,
    # so they keep full precision even when |lse| is large (e^{x - lse} would lose digits to lse's rounding).
    diff = torch.where(empty, torch.zeros_like(la), la - lb)
    wa = torch.where(empty, torch.zeros_like(diff), torch.sigmoid(diff))
    wb = torch.where(empty, torch.zeros_like(diff), torch.sigmoid(-diff))
    out = wa.transpose(-1, -2).unsqueeze(-1) * out_a.to(acc) + wb.transpose(-1, -2).unsqueeze(-1) * out_b.to(acc)
    return out.to(out_a.dtype), lse


def with_sink(out: Tensor, lse: Tensor, sink: Tensor) -> tuple[Tensor, Tensor]:
    """(out, lse) with learnable sink logits (nheads,) joined to the denominator: the sink is a partial result
    whose value is 0 and whose lse is the sink, so it merges like any other. out (..., seqlen, nheads, headdim),
    lse (..., nheads, seqlen)."""
    return merge_states(out, lse, torch.zeros_like(out), sink.to(lse.dtype)[:, None].expand_as(lse))
