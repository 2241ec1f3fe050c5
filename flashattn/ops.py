"""The one autograd op behind every entry point, registered with ``torch.library``.

``flashattn::attention`` computes (out, lse, probs) and ``flashattn::attention_backward`` its gradients. Being
custom ops with fake (meta) implementations, they are opaque leaves to ``torch.compile(fullgraph=True)``: traced
without graph breaks, dispatched to a backend at run time. All entry points (``flash_attn_*`` and
``scaled_dot_product_attention``) reach them through ``attention`` below, in the flash layout
(batch, seqlen, heads, headdim).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import backends
from .backends.spec import AttentionSpec


def _spec(scale, window_left, window_right, bottom_right, softcap, dropout_p, seed, deterministic) -> AttentionSpec:
    return AttentionSpec(
        scale=scale,
        window_left=window_left,
        window_right=window_right,
        bottom_right=bottom_right,
        softcap=softcap,
        dropout_p=dropout_p,
        seed=seed,
        deterministic=deterministic,
    )


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@torch.library.custom_op("flashattn::attention", mutates_args=())
def _attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    alibi_slopes: Tensor | None,
    attn_mask: Tensor | None,
    seed: Tensor | None,
    scale: float,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    softcap: float,
    dropout_p: float,
    deterministic: bool,
    return_probs: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    spec = _spec(scale, window_left, window_right, bottom_right, softcap, dropout_p, seed, deterministic)
    return backends.select(q, v).forward(q, k, v, alibi_slopes, attn_mask, spec, return_probs)


@_attention.register_fake
def _(q, k, v, alibi_slopes, attn_mask, seed, scale, window_left, window_right, bottom_right, softcap,
      dropout_p, deterministic, return_probs):
    b, nq, h, _ = q.shape
    out = q.new_empty(b, nq, h, v.shape[-1])
    lse = q.new_empty(b, h, nq, dtype=_lse_dtype(q))
    probs = q.new_empty(b, h, nq, k.shape[1]) if return_probs else q.new_empty(0)
    return out, lse, probs


@torch.library.custom_op("flashattn::attention_backward", mutates_args=())
def _attention_backward(
    dout: Tensor,
    dlse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    alibi_slopes: Tensor | None,
    attn_mask: Tensor | None,
    seed: Tensor | None,
    scale: float,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    softcap: float,
    dropout_p: float,
    deterministic: bool,
    mask_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    spec = _spec(scale, window_left, window_right, bottom_right, softcap, dropout_p, seed, deterministic)
    dq, dk, dv, dmask = backends.select(q, v).backward(
        dout, dlse, q, k, v, out, lse, alibi_slopes, attn_mask, spec, mask_grad
    )
    return dq, dk, dv, (dmask if dmask is not None else q.new_empty(0))


@_attention_backward.register_fake
def _(dout, dlse, q, k, v, out, lse, alibi_slopes, attn_mask, seed, scale, window_left, window_right,
      bottom_right, softcap, dropout_p, deterministic, mask_grad):
    dmask = torch.empty_like(attn_mask) if mask_grad else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dmask


_SCALARS = ("scale", "window_left", "window_right", "bottom_right", "softcap", "dropout_p", "deterministic")


def _setup_context(ctx, inputs, output):
    q, k, v, alibi_slopes, attn_mask, seed, *scalars, _return_probs = inputs
    out, lse, probs = output
    ctx.scalars = dict(zip(_SCALARS, scalars, strict=True))
    ctx.mask_grad = attn_mask is not None and attn_mask.requires_grad
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, attn_mask, seed)
    ctx.mark_non_differentiable(probs)


def _backward(ctx, dout, dlse, _dprobs):
    q, k, v, out, lse, alibi_slopes, attn_mask, seed = ctx.saved_tensors
    dq, dk, dv, dmask = _attention_backward(
        dout, dlse, q, k, v, out, lse, alibi_slopes, attn_mask, seed,
        **ctx.scalars, mask_grad=ctx.mask_grad,
    )
    return dq, dk, dv, None, (dmask if ctx.mask_grad else None), None, *([None] * (len(_SCALARS) + 1))


_attention.register_autograd(_backward, setup_context=_setup_context)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spec: AttentionSpec,
    *,
    alibi_slopes: Tensor | None = None,
    attn_mask: Tensor | None = None,
    seed: Tensor | None = None,
    return_probs: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Run the op on checked inputs in the flash layout: q (B, Nq, H, D), k (B, Nk, Hk, D), v (B, Nk, Hk, Dv).

    Returns (out (B, Nq, H, Dv), lse (B, H, Nq), probs (B, H, Nq, Nk) or an empty tensor).
    """
    return _attention(
        q, k, v, alibi_slopes, attn_mask, seed, spec.scale, spec.window_left, spec.window_right,
        spec.bottom_right, spec.softcap, spec.dropout_p, spec.deterministic, return_probs,
    )
