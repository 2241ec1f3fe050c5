"""Checks of ``scaled_dot_product_attention``: PyTorch's layout (batch, heads, L, E), its mask and flags."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..backends.spec import AttentionSpec
from ._base import (
    fail,
    validate_bool,
    validate_dropout,
    validate_head_dim,
    validate_heads,
    validate_scale,
    validate_tensor,
)
from .block_mask import is_block_mask, validate_block_mask
from .flash import CheckedCall
from .kinds import is_causal_bias, validate_plain

SDPA_OPTIONS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _validate_mask(fn: str, mask: object, q: torch.Tensor, shape: tuple[int, ...]):
    """A boolean or additive mask that broadcasts to ``shape`` = (..., L, S); additive in q's dtype or float32, as
    PyTorch takes it (a float32 mask with 16-bit q is added in float32, where the kernels add every mask)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise fail(fn, f"attn_mask must be a torch.Tensor, a CausalBias, a flex_attention BlockMask or None, got "
                       f"{type(mask).__name__}", TypeError)
    validate_plain(fn, "attn_mask", mask)
    if mask.dtype not in (torch.bool, torch.float32, q.dtype):
        raise fail(fn, f"Expected attn_mask dtype to be bool or float or to match query dtype, but got "
                       f"attn_mask.dtype: {mask.dtype} and query.dtype: {q.dtype} instead (attn_mask must be "
                       f"boolean, float32 or of the query's dtype)", TypeError)
    if mask.device != q.device:
        raise fail(fn, f"attn_mask is on {mask.device} but query is on {q.device}")
    # An index loop: torch 2.7's Dynamo, under vmap, can inline neither any(generator) nor zip(strict=False).
    broadcasts = mask.dim() <= len(shape)
    for i in range(1, min(mask.dim(), len(shape)) + 1):
        broadcasts = broadcasts and mask.shape[-i] in (1, shape[-i])
    if not broadcasts:
        raise fail(fn, f"attn_mask of shape {tuple(mask.shape)} does not broadcast to (..., L, S) = {shape}")
    return mask


def _causal_bias(fn: str, bias, *, is_causal: bool, lengths: tuple[int, int]) -> bool:
    """PyTorch's ``CausalBias`` (``causal_upper_left(L, S)``, ``causal_lower_right(L, S)``) for what it means:
    causal attention aligned to the top-left corner (as ``is_causal=True``) or to the bottom-right one (as
    ``flash_attn_func``'s ``causal=True``). Returns whether the diagonal is the bottom-right one. Its sizes must be
    the call's (L, S): one built for other lengths is a mistake that PyTorch would silently ignore."""
    if is_causal:
        raise fail(fn, "CausalBias should not be used with causal=True (attn_mask is a CausalBias and is_causal is "
                       "True: pass one of them)")
    if (bias.seq_len_q, bias.seq_len_kv) != lengths:
        raise fail(fn, f"attn_mask is a CausalBias for (L, S) = ({bias.seq_len_q}, {bias.seq_len_kv}) but query and "
                       f"key have (L, S) = {lengths}; build it for the call's lengths")
    return bias.variant.name == "LOWER_RIGHT"


def _broadcast(fn: str, named: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    try:
        return tuple(torch.broadcast_shapes(*named.values()))
    except RuntimeError:
        shapes = ", ".join(f"{name} {shape}" for name, shape in named.items())
        raise fail(fn, f"the leading (batch) dimensions must broadcast, got {shapes}") from None


class _Shapes(NamedTuple):
    """The leading dimensions of an SDPA call: ``batch`` (broadcast over q, k, v), query heads and key heads (equal
    unless grouped-query attention), so that q is (*batch, heads_q, L, E) and k, v (*batch, heads_k, S, E)."""

    batch: tuple[int, ...]
    heads_q: int
    heads_k: int
    output: tuple[int, ...]  # the output's leading dimensions: (*batch, heads_q), or none for (L, E) inputs


def _sdpa_shapes(fn: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> _Shapes:
    if k.shape[-2] != v.shape[-2]:
        raise fail(fn, f"key and value must have the same length S, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise fail(fn, f"query {tuple(q.shape)} and key {tuple(k.shape)} must agree in E")
    for name, t in (("query", q), ("value", v)):
        validate_head_dim(fn, name, t.shape[-1])
    lead = {"query": tuple(q.shape[:-2]), "key": tuple(k.shape[:-2]), "value": tuple(v.shape[:-2])}
    heads_q, heads_k = (q.shape[-3] if q.dim() > 2 else 1), (k.shape[-3] if k.dim() > 2 else 1)
    if heads_q != heads_k and enable_gqa:
        validate_heads(fn, nheads=heads_q, nheads_k=heads_k, names=("query", "key"))
        if v.dim() < 3 or v.shape[-3] != heads_k:
            raise fail(fn, f"key and value must have the same number of heads, got {tuple(k.shape)} and "
                           f"{tuple(v.shape)}")
        batch = _broadcast(fn, {name: shape[:-1] for name, shape in lead.items()})
        return _Shapes(batch, heads_q, heads_k, (*batch, heads_q))
    if 1 != heads_k != heads_q != 1:  # not a broadcast: grouped-query attention, which must be asked for
        raise fail(fn, f"query has {heads_q} heads but key has {heads_k}; pass enable_gqa=True for grouped-query "
                       "attention")
    full = _broadcast(fn, lead)
    if not full:
        return _Shapes((), 1, 1, ())
    return _Shapes(full[:-1], full[-1], full[-1], full)


def _as_four_dims(t: torch.Tensor, batch: tuple[int, ...], heads: int) -> torch.Tensor:
    """(*batch, heads, n, d) -> (prod(batch), heads, n, d): a view when nothing broadcasts (4-D inputs of equal
    batch, the common case), else an expanded copy."""
    t = t.expand(*batch, heads, *t.shape[-2:])
    return t.reshape(math.prod(batch), heads, *t.shape[-2:])


def _mask_four_dims(mask: torch.Tensor | None, shapes: _Shapes, lengths: tuple[int, int]) -> torch.Tensor | None:
    """The mask as (B or 1, H or 1, L or 1, S or 1), keeping its own size-1 dimensions where it can."""
    if mask is None:
        return None
    rank = len(shapes.batch) + 3
    mask = mask.reshape((1,) * (rank - mask.dim()) + tuple(mask.shape))
    if all(n == 1 for n in mask.shape[:-3]):
        return mask.reshape(1, *mask.shape[-3:])
    return mask.expand(*shapes.batch, *mask.shape[-3:]).reshape(-1, *mask.shape[-3:])


def _validate_alike(fn: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """One dtype and one device, in PyTorch's words."""
    if not q.dtype == k.dtype == v.dtype:
        raise fail(fn, f"Expected query, key, and value to have the same dtype, but got query.dtype: {q.dtype} "
                       f"key.dtype: {k.dtype} and value.dtype: {v.dtype} instead.", TypeError)
    if not q.device == k.device == v.device:
        raise fail(fn, f"Expected query, key, and value to have the same device type, but got query.device: "
                       f"{q.device} key.device: {k.device} and value.device: {v.device} instead.")


def check_sdpa(fn: str, query: object, key: object, value: object, **options) -> tuple[CheckedCall, tuple[int, ...]]:
    """Validate ``scaled_dot_product_attention`` arguments (``options``: attn_mask, dropout_p, is_causal, scale,
    enable_gqa), as PyTorch takes them: query (..., L, E), key (..., S, E), value (..., S, Ev) with leading
    dimensions that broadcast, the one before L the heads (grouped with ``enable_gqa``); top-left causal alignment.

    Returns the call in the flash layout (batch, seqlen, heads, dim) (transposed views, no copies for 4-D inputs of
    equal batch) and the leading shape of the output, which is (*leading, L, Ev).
    """
    if not set(options) <= set(SDPA_OPTIONS):  # a programming error inside the library, never the user's
        raise TypeError(f"check_sdpa: unexpected options {sorted(set(options) - set(SDPA_OPTIONS))}")
    q = validate_tensor(fn, "query", query, None, "(..., L, E)")
    k = validate_tensor(fn, "key", key, None, "(..., S, E)")
    v = validate_tensor(fn, "value", value, None, "(..., S, Ev)")
    _validate_alike(fn, q, k, v)
    enable_gqa = validate_bool(fn, "enable_gqa", options.get("enable_gqa", False))
    shapes = _sdpa_shapes(fn, q, k, v, enable_gqa)
    is_causal = validate_bool(fn, "is_causal", options.get("is_causal", False))
    attn_mask = options.get("attn_mask")
    length_q, length_k = q.shape[-2], k.shape[-2]
    bottom_right = False
    if is_causal_bias(attn_mask):
        bottom_right = _causal_bias(fn, attn_mask, is_causal=is_causal, lengths=(length_q, length_k))
        is_causal, attn_mask = True, None
    if is_causal and attn_mask is not None:
        raise fail(fn, "Explicit attn_mask should not be set when is_causal=True (pass either attn_mask or "
                       "is_causal=True, not both)")
    block_sparse = None
    if is_block_mask(attn_mask):  # FlexAttention's block-sparse mask: tiles skipped, unmasked or masked
        block_sparse = validate_block_mask(fn, "attn_mask", attn_mask, batch=math.prod(shapes.batch),
                                           nheads=shapes.heads_q, nq=length_q, nk=length_k, ref=q)
        attn_mask = None
    mask = _validate_mask(fn, attn_mask, q, (*shapes.batch, shapes.heads_q, length_q, length_k))
    spec = AttentionSpec(
        scale=validate_scale(fn, "scale", options.get("scale"), q.shape[-1]),
        window_left=-1,
        window_right=0 if is_causal else -1,
        bottom_right=bottom_right,
        dropout_p=validate_dropout(fn, options.get("dropout_p", 0.0)),
        attn_mask=_mask_four_dims(mask, shapes, (length_q, length_k)),
        block_sparse=block_sparse,
        deterministic=torch.are_deterministic_algorithms_enabled(),  # (PyTorch's global switch: SDPA has no flag)
    )
    q4 = _as_four_dims(q, shapes.batch, shapes.heads_q)
    k4, v4 = (_as_four_dims(t, shapes.batch, shapes.heads_k) for t in (k, v))
    return CheckedCall(q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2), spec), shapes.output
