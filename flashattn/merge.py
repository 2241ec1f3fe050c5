"""Merging partial attention results through their log-sum-exp.

Attention over keys K_a u K_b equals a weighted mix of attention over K_a and over K_b: with lse_x the
log-sum-exp of the scores against K_x,

    lse = log(e^{lse_a} + e^{lse_b}),    out = e^{lse_a - lse} out_a + e^{lse_b - lse} out_b.

Split-KV decoding, ring and context-parallel attention all reduce partial results this way.
"""

from __future__ import annotations

from torch import Tensor

from .backends.combine import merge_states


def _check(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    fn = "merge_attention_states"
    for name, t in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{fn}: {name} must be floating point, got {t.dtype}")
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
        raise ValueError(f"{fn}: out_a/out_b shapes {tuple(out_a.shape)}/{tuple(out_b.shape)} and lse_a/lse_b "
                         f"shapes {tuple(lse_a.shape)}/{tuple(lse_b.shape)} must match pairwise")
    expected = (*out_a.shape[:-3], out_a.shape[-2], out_a.shape[-3]) if out_a.dim() >= 3 else None
    if expected is None or tuple(lse_a.shape) != expected:
        raise ValueError(f"{fn}: out (..., seqlen, nheads, headdim) = {tuple(out_a.shape)} needs lse of shape "
                         f"(..., nheads, seqlen) = {expected}, got {tuple(lse_a.shape)}")


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
    _check(out_a, lse_a, out_b, lse_b)
    return merge_states(out_a, lse_a, out_b, lse_b)
