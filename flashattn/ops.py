"""The one autograd op behind every entry point, registered with ``torch.library``.

``flashattn::attention`` computes (out, lse, probs) and ``flashattn::attention_backward`` its gradients;
``flashattn::attention_cache`` is the forward-only variant whose keys live in a (possibly paged) KV cache. Being
custom ops with fake (meta) implementations, they are opaque leaves to ``torch.compile(fullgraph=True)``: traced
without graph breaks, dispatched to a backend at run time. All entry points (``flash_attn_*`` and
``scaled_dot_product_attention``) reach them through ``attention`` below, in the flash layout
(batch, seqlen, heads, headdim).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import backends
from .backends.spec import AttentionSpec, KeyCache, Varlen


def _spec(scale, window_left, window_right, bottom_right, diag_offset, softcap, dropout_p, seed,
          deterministic) -> AttentionSpec:
    return AttentionSpec(
        scale=scale,
        window_left=window_left,
        window_right=window_right,
        bottom_right=bottom_right,
        offset=diag_offset,
        softcap=softcap,
        dropout_p=dropout_p,
        seed=seed,
        deterministic=deterministic,
    )


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> Varlen | None:
    return None if cu_seqlens_q is None else Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


@torch.library.custom_op("flashattn::attention", mutates_args=())
def _attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    alibi_slopes: Tensor | None,
    attn_mask: Tensor | None,
    seed: Tensor | None,
    cu_seqlens_q: Tensor | None,
    cu_seqlens_k: Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    diag_offset: int,
    softcap: float,
    dropout_p: float,
    deterministic: bool,
    return_probs: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    spec = _spec(scale, window_left, window_right, bottom_right, diag_offset, softcap, dropout_p, seed,
                 deterministic)
    varlen = _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return backends.select(q, v).forward(q, k, v, alibi_slopes, attn_mask, spec, return_probs, varlen)


@_attention.register_fake
def _(q, k, v, alibi_slopes, attn_mask, seed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
      window_left, window_right, bottom_right, diag_offset, softcap, dropout_p, deterministic, return_probs):
    if cu_seqlens_q is None:
        b, nq, h, _ = q.shape
        nk, lse_shape = k.shape[1], (b, h, nq)
    else:  # packed: q (total_q, H, D); lse (H, total_q); probs padded to the maxima
        b, nq, h, nk = cu_seqlens_q.shape[0] - 1, max_seqlen_q, q.shape[1], max_seqlen_k
        lse_shape = (h, q.shape[0])
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    lse = q.new_empty(lse_shape, dtype=_lse_dtype(q))
    probs = q.new_empty(b, h, nq, nk) if return_probs else q.new_empty(0)
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
    cu_seqlens_q: Tensor | None,
    cu_seqlens_k: Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    diag_offset: int,
    softcap: float,
    dropout_p: float,
    deterministic: bool,
    mask_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    spec = _spec(scale, window_left, window_right, bottom_right, diag_offset, softcap, dropout_p, seed,
                 deterministic)
    varlen = _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    dq, dk, dv, dmask = backends.select(q, v).backward(
        dout, dlse, q, k, v, out, lse, alibi_slopes, attn_mask, spec, mask_grad, varlen
    )
    return dq, dk, dv, (dmask if dmask is not None else q.new_empty(0))


@_attention_backward.register_fake
def _(dout, dlse, q, k, v, out, lse, alibi_slopes, attn_mask, seed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
      max_seqlen_k, scale, window_left, window_right, bottom_right, diag_offset, softcap, dropout_p, deterministic,
      mask_grad):
    dmask = torch.empty_like(attn_mask) if mask_grad else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dmask


_SCALARS = ("max_seqlen_q", "max_seqlen_k", "scale", "window_left", "window_right", "bottom_right", "diag_offset",
            "softcap",
            "dropout_p", "deterministic")


def _setup_context(ctx, inputs, output):
    q, k, v, alibi_slopes, attn_mask, seed, cu_seqlens_q, cu_seqlens_k, *scalars, _return_probs = inputs
    out, lse, probs = output
    ctx.scalars = dict(zip(_SCALARS, scalars, strict=True))
    ctx.mask_grad = attn_mask is not None and attn_mask.requires_grad
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, attn_mask, seed, cu_seqlens_q, cu_seqlens_k)
    ctx.mark_non_differentiable(probs)


def _backward(ctx, dout, dlse, _dprobs):
    q, k, v, out, lse, alibi_slopes, attn_mask, seed, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv, dmask = _attention_backward(
        dout, dlse, q, k, v, out, lse, alibi_slopes, attn_mask, seed, cu_seqlens_q, cu_seqlens_k,
        **ctx.scalars, mask_grad=ctx.mask_grad,
    )
    no_grad = [None] * (3 + len(_SCALARS) + 1)  # seed, cu_seqlens_q/k, the scalars, return_probs
    return dq, dk, dv, None, (dmask if ctx.mask_grad else None), *no_grad


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
    varlen: Varlen | None = None,
    return_probs: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Run the op on checked inputs in the flash layout: q (B, Nq, H, D), k (B, Nk, Hk, D), v (B, Nk, Hk, Dv),
    or packed (total, H, D) with ``varlen``.

    Returns (out (B, Nq, H, Dv), lse (B, H, Nq), probs (B, H, Nq, Nk) or an empty tensor); varlen: out
    (total_q, H, Dv), lse (H, total_q), probs (B, H, max_seqlen_q, max_seqlen_k).
    """
    cu_q, cu_k, max_q, max_k = (None, None, 0, 0) if varlen is None else (
        varlen.cu_seqlens_q, varlen.cu_seqlens_k, varlen.max_seqlen_q, varlen.max_seqlen_k)
    return _attention(
        q, k, v, alibi_slopes, attn_mask, seed, cu_q, cu_k, max_q, max_k, spec.scale, spec.window_left,
        spec.window_right, spec.bottom_right, spec.offset, spec.softcap, spec.dropout_p, spec.deterministic,
        return_probs,
    )


@torch.library.custom_op("flashattn::attention_cache", mutates_args=())
def _attention_cache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    alibi_slopes: Tensor | None,
    cu_seqlens_q: Tensor | None,
    max_seqlen_q: int,
    k_start: Tensor,
    k_end: Tensor,
    max_seqlen_k: int,
    batch_idx: Tensor | None,
    block_table: Tensor | None,
    scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    num_splits: int,
) -> tuple[Tensor, Tensor]:
    spec = _spec(scale, window_left, window_right, True, 0, softcap, 0.0, None, False)
    cache = KeyCache(k_start, k_end, max_seqlen_k, batch_idx, block_table, num_splits)
    # A packed q's offsets; the Varlen's key side is unused (keys come from the cache).
    varlen = _varlen(cu_seqlens_q, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    return backends.select(q, v_cache).forward_cache(q, k_cache, v_cache, alibi_slopes, spec, cache, varlen)


@_attention_cache.register_fake
def _(q, k_cache, v_cache, alibi_slopes, cu_seqlens_q, max_seqlen_q, k_start, k_end, max_seqlen_k, batch_idx,
      block_table, scale, window_left, window_right, softcap, num_splits):
    lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if cu_seqlens_q is None else (q.shape[1], q.shape[0])
    return q.new_empty(*q.shape[:-1], v_cache.shape[-1]), q.new_empty(lse_shape, dtype=_lse_dtype(q))


def attention_cache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    spec: AttentionSpec,
    cache: KeyCache,
    *,
    alibi_slopes: Tensor | None = None,
    varlen: Varlen | None = None,
) -> tuple[Tensor, Tensor]:
    """Forward-only attention of q against a KV cache (``KeyCache`` says where each sequence's keys are).

    q (B, Nq, H, D) -> out (B, Nq, H, Dv), lse (B, H, Nq); or packed q (total_q, H, D) with ``varlen`` (its
    query offsets) -> out (total_q, H, Dv), lse (H, total_q). Causal and windows align bottom-right. No autograd.
    """
    cu_q, max_q = (None, 0) if varlen is None else (varlen.cu_seqlens_q, varlen.max_seqlen_q)
    return _attention_cache(
        q, k_cache, v_cache, alibi_slopes, cu_q, max_q, cache.k_start, cache.k_end, cache.max_seqlen_k,
        cache.batch_idx, cache.block_table, spec.scale, spec.window_left, spec.window_right, spec.softcap,
        cache.num_splits,
    )


def backward_block(dout: Tensor, dlse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   spec: AttentionSpec, alibi_slopes: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one block given the whole attention's ``out`` and ``lse`` (and their gradients): with the
    final statistics, P = exp(S - lse) of the block is exact, so the block's gradients are its exact share."""
    dq, dk, dv, _ = torch.ops.flashattn.attention_backward(
        dout, dlse, q, k, v, out, lse, alibi_slopes, None, None, None, None, 0, 0, spec.scale, spec.window_left,
        spec.window_right, spec.bottom_right, spec.offset, spec.softcap, 0.0, spec.deterministic, False,
    )
    return dq, dk, dv
