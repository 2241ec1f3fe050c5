"""Checks of ``scaled_dot_product_attention``: PyTorch's layout (batch, heads, L, E), its mask and flags."""

from __future__ import annotations

import torch

from ..backends.spec import AttentionSpec
from ._base import fail, validate_bool, validate_dropout, validate_heads, validate_same, validate_scale, validate_tensor
from .flash import CheckedCall


def _validate_mask(fn: str, mask: object, q: torch.Tensor, shape: tuple[int, int, int, int]):
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise fail(fn, f"attn_mask must be a torch.Tensor or None, got {type(mask).__name__}", TypeError)
    if mask.dtype != torch.bool and mask.dtype != q.dtype:
        raise fail(fn, f"attn_mask must be boolean or of the query's dtype {q.dtype}, got {mask.dtype}", TypeError)
    if mask.device != q.device:
        raise fail(fn, f"attn_mask is on {mask.device} but query is on {q.device}")
    if mask.dim() > 4 or any(m not in (1, n) for m, n in zip(mask.shape[::-1], shape[::-1], strict=False)):
        raise fail(fn, f"attn_mask of shape {tuple(mask.shape)} does not broadcast to (batch, heads, L, S) = "
                       f"{shape}")
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def _sdpa_layout(fn: str, query, key, value, enable_gqa: object) -> tuple[torch.Tensor, ...]:
    q = validate_tensor(fn, "query", query, 4, "(batch, heads, L, E)")
    k = validate_tensor(fn, "key", key, 4, "(batch, heads_kv, S, E)")
    v = validate_tensor(fn, "value", value, 4, "(batch, heads_kv, S, Ev)")
    validate_same(fn, {"query": q, "key": k, "value": v})
    if k.shape[:3] != v.shape[:3]:
        raise fail(fn, f"key and value must agree in (batch, heads, S), got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise fail(fn, f"query {tuple(q.shape)} and key {tuple(k.shape)} must agree in batch and E")
    enable_gqa = validate_bool(fn, "enable_gqa", enable_gqa)
    if q.shape[1] != k.shape[1]:
        if not enable_gqa:
            raise fail(fn, f"query has {q.shape[1]} heads but key has {k.shape[1]}; pass enable_gqa=True for "
                           "grouped-query attention")
        validate_heads(fn, q.shape[1], k.shape[1], ("query", "key"))
    return q, k, v


def check_sdpa(fn: str, query: object, key: object, value: object, **options) -> CheckedCall:
    """Validate ``scaled_dot_product_attention`` arguments (``options``: attn_mask, dropout_p, is_causal, scale,
    enable_gqa): layout (batch, heads, L, E) and (batch, heads, S, Ev), top-left causal alignment. Returns the
    call in the flash layout (transposed views, no copies)."""
    q, k, v = _sdpa_layout(fn, query, key, value, options.get("enable_gqa", False))
    is_causal = validate_bool(fn, "is_causal", options.get("is_causal", False))
    attn_mask = options.get("attn_mask")
    if is_causal and attn_mask is not None:
        raise fail(fn, "pass either attn_mask or is_causal=True, not both")
    spec = AttentionSpec(
        scale=validate_scale(fn, "scale", options.get("scale"), q.shape[3]),
        window_left=-1,
        window_right=0 if is_causal else -1,
        bottom_right=False,
        dropout_p=validate_dropout(fn, options.get("dropout_p", 0.0)),
        attn_mask=_validate_mask(fn, attn_mask, q, (q.shape[0], q.shape[1], q.shape[2], k.shape[2])),
    )
    return CheckedCall(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), spec)
