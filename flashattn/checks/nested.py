"""``scaled_dot_product_attention`` on nested (jagged) tensors, as PyTorch takes them: query (B, H, j, E), key
and value (B, Hk, j', E), ragged in the sequence dimension, become the packed call of the varlen path."""

from __future__ import annotations

import dataclasses

import torch

from ._base import fail, validate_bool
from .flash import CheckedCall, check_varlen

_NAMES = ("query", "key", "value")


def any_nested(*tensors: object) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_nested for t in tensors)


def _validate_jagged(fn: str, tensors: tuple) -> None:
    if not all(isinstance(t, torch.Tensor) and t.is_nested for t in tensors):
        nested = ", ".join(f"{n}.is_nested: {isinstance(t, torch.Tensor) and t.is_nested}"
                           for n, t in zip(_NAMES, tensors, strict=True))
        raise fail(fn, f"Expected query, key, and value to be nested tensors, but got {nested} instead", TypeError)
    for name, t in zip(_NAMES, tensors, strict=True):
        if t.layout != torch.jagged:
            raise fail(fn, f"{name} is a nested tensor of layout {t.layout}; nested tensors of layout torch.jagged "
                           "are taken (torch.nested.nested_tensor(..., layout=torch.jagged))", TypeError)
        if t.dim() != 4 or t._ragged_idx != 2:
            raise fail(fn, f"{name} is a nested tensor of shape {tuple(t.shape)}, ragged in dimension "
                           f"{t._ragged_idx}; (batch, heads, seqlen, headdim) ragged in seqlen (dimension 2) is "
                           "taken, e.g. torch.nested.nested_tensor(rows, layout=torch.jagged).transpose(1, 2) with "
                           "rows of shape (seqlen_i, heads, headdim)")
        if t.transpose(1, 2).lengths() is not None:
            raise fail(fn, f"{name} is a nested tensor with holes between its sequences (a view with lengths); "
                           "pass x.contiguous()")


def _packed(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(values (total, H, E), int32 offsets (B + 1,), the longest sequence) of a jagged (B, H, j, E)."""
    rows = t.transpose(1, 2)
    offsets = rows.offsets()
    longest = rows._maybe_max_seqlen
    if longest is None:
        longest = int((offsets[1:] - offsets[:-1]).max()) if offsets.numel() > 1 else 0
    return rows.values(), offsets.to(torch.int32), longest


def check_nested_sdpa(fn: str, query: torch.Tensor, key: object, value: object, **options) -> CheckedCall:
    """The varlen call of ``scaled_dot_product_attention`` on jagged query, key, value (``options``: its attn_mask,
    dropout_p, is_causal, scale, enable_gqa); causal aligned top-left in each sequence, as PyTorch's
    ``is_causal``. The output is (total_q, H, Ev), the rows of query's sequences."""
    tensors = (query, key, value)
    _validate_jagged(fn, tensors)
    if options["attn_mask"] is not None:
        raise fail(fn, "attn_mask is not taken with nested query, key and value (nor by PyTorch); mask by "
                       "building the sequences, or pass is_causal=True")
    if not validate_bool(fn, "enable_gqa", options["enable_gqa"]) and query.shape[1] != key.shape[1]:
        raise fail(fn, f"query has {query.shape[1]} heads but key has {key.shape[1]}; pass enable_gqa=True for "
                       "grouped-query attention")
    (q, cu_q, max_q), (k, cu_k, max_k), (v, _, _) = (_packed(t) for t in tensors)
    if key.transpose(1, 2).offsets() is not value.transpose(1, 2).offsets() and not torch.equal(
            key.transpose(1, 2).offsets(), value.transpose(1, 2).offsets()):
        raise fail(fn, "key and value must have the same sequence lengths")
    call = check_varlen(fn, q, k, v, names=_NAMES, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                        max_seqlen_k=max_k, dropout_p=options["dropout_p"], softmax_scale=options["scale"],
                        causal=validate_bool(fn, "is_causal", options["is_causal"]), window_size=(-1, -1), softcap=0.0,
                        alibi_slopes=None, deterministic=False, return_attn_probs=False)
    return dataclasses.replace(call, spec=dataclasses.replace(call.spec, bottom_right=False))
