"""Merging partial attention results through their log-sum-exp.

Attention over keys K_a u K_b equals a weighted mix of attention over K_a and over K_b: with lse_x the
log-sum-exp of the scores against K_x,

    lse = log(e^{lse_a} + e^{lse_b}),    out = e^{lse_a - lse} out_a + e^{lse_b - lse} out_b.

Split-KV decoding, ring and context-parallel attention all reduce partial results this way.
"""

from __future__ import annotations

from torch import Tensor

from . import checks
from .backends.merge import merge_states


def merge_attention_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two partial attention results over disjoint key sets into the result over their union.

    Shapes follow ``flash_attn_func``'s returns: out (..., seqlen, nheads, headdim) and lse (..., nheads, seqlen)
    (also the varlen layout: out (total, nheads, headdim), lse (nheads, total)). Computed in float32 (float64
    for float64 inputs) in the stable form lse = max + log1p(exp(-|lse_a - lse_b|)), weights
    sigmoid(+-(lse_a - lse_b)), so nothing overflows; a row empty on both sides (lse -inf twice) gives out 0
    and lse -inf. Differentiable.

    Returns (out in out_a's dtype, lse in float32 or float64).

    Example::

        >>> import torch
        >>> q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 10, 2, 8), torch.randn(1, 10, 2, 8)
        >>> from flashattn import flash_attn_func
        >>> oa, la, _ = flash_attn_func(q, k[:, :6], v[:, :6], return_attn_probs=True)
        >>> ob, lb, _ = flash_attn_func(q, k[:, 6:], v[:, 6:], return_attn_probs=True)
        >>> out, lse = merge_attention_states(oa, la, ob, lb)
        >>> torch.allclose(out, flash_attn_func(q, k, v), atol=1e-6)
        True
    """
    checks.check_merge("merge_attention_states", out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)
    return merge_states(out_a, lse_a, out_b, lse_b)
