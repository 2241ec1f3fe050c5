"""Checks of FP8 inputs (FlashAttention-3's interface): which dtypes may meet, and the descale tensors.

q, k and v (or the caches) in ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``, with ``q_descale``,
``k_descale``, ``v_descale`` of shape (batch, nheads_k), float32, None meaning 1: the call attends
``x.float() * descale``. The output is bfloat16 when q is FP8. A KV cache in FP8 may also be read by 16-bit
queries (then only ``k_descale`` and ``v_descale`` apply). The training mode (``fp8=True``) takes 16-bit q, k, v
and quantizes them itself.

    >>> q = torch.randn(1, 3, 4, 16).to(torch.float8_e4m3fn)
    >>> descale(
    ...     "f", inputs={"q": q, "k": q, "v": q}, given={"q_descale": None, "k_descale": None, "v_descale": None},
    ...     batch=1, nheads_k=4).k.tolist()
    [[1.0, 1.0, 1.0, 1.0]]
"""

from __future__ import annotations

import dataclasses

import torch

from ..backends.spec import FP8_DTYPES, AttentionSpec, Descale
from ._base import fail, validate_flag, validate_same
from .kinds import validate_plain

SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def is_fp8(t: torch.Tensor | None) -> bool:
    return t is not None and t.dtype in FP8_DTYPES


def validate_fp8_forward(fn: str, q: torch.Tensor, **options) -> None:
    """What FP8 inputs do not go with: gradients (the FP8 forward has no backward), dropout and the returned
    probabilities."""
    if q.requires_grad:
        raise fail(fn, "FP8 inputs are forward only: q requires grad")
    if options.get("dropout_p"):
        raise fail(fn, f"dropout_p must be 0 with FP8 inputs, got {options['dropout_p']}")
    if options.get("return_attn_probs"):
        raise fail(fn, "return_attn_probs is not available with FP8 inputs")


def with_fp8(fn: str, spec: AttentionSpec, *, inputs: dict[str, torch.Tensor], given: dict[str, object],
             training: object, batch: int, nheads_k: int, options: dict) -> AttentionSpec:
    """``spec`` with the call's FP8 settings: the ``descale`` of FP8 inputs (``given`` the caller's descales), or
    the training mode when ``training`` (the ``fp8`` flag) is set; ``options`` are the call's other keyword
    arguments (dropout_p, return_attn_probs, ...)."""
    scales = descale(fn, inputs=inputs, given=given, batch=batch, nheads_k=nheads_k)
    q = next(iter(inputs.values()))
    training = validate_flag(fn, "fp8", training)
    if scales is not None:
        if training:
            raise fail(fn, "fp8=True quantizes float16 or bfloat16 q, k and v itself; FP8 inputs are attended as "
                           "they are (pass fp8=False, with q_descale, k_descale, v_descale)", TypeError)
        validate_fp8_forward(fn, q, **options)
        return dataclasses.replace(spec, descale=scales)
    if not training:
        return spec
    if q.dtype not in SIXTEEN_BIT:
        raise fail(fn, f"fp8=True quantizes float16 or bfloat16 q, k and v, got {q.dtype}", TypeError)
    if options.get("dropout_p"):
        raise fail(fn, f"dropout_p must be 0 with fp8=True, got {options['dropout_p']}")
    if options.get("return_attn_probs"):
        raise fail(fn, "return_attn_probs is not available with fp8=True")
    return dataclasses.replace(spec, fp8_training=True)


def descale(fn: str, *, inputs: dict[str, torch.Tensor], given: dict[str, object], batch: int,
            nheads_k: int) -> Descale | None:
    """The ``Descale`` of a call whose q, k, v are ``inputs`` (by the names the caller used), from the ``given``
    ``q_descale``, ``k_descale``, ``v_descale`` (each (batch, nheads_k) float32 on the inputs' device, or None);
    None when no input is FP8. A descale for an input that is not FP8 is an error naming both."""
    fp8 = [is_fp8(t) for t in inputs.values()]
    for (name, t), (scale_name, scale) in zip(inputs.items(), given.items(), strict=True):
        if scale is not None and not is_fp8(t):
            raise fail(fn, f"{scale_name} scales FP8 inputs, but {name} has dtype {t.dtype}")
    if not any(fp8):
        return None
    ref = next(iter(inputs.values()))
    scales = []
    for (scale_name, scale), in_fp8 in zip(given.items(), fp8, strict=True):
        if scale is None or not in_fp8:
            scales.append(torch.ones(batch, nheads_k, dtype=torch.float32, device=ref.device))
            continue
        if not isinstance(scale, torch.Tensor):
            raise fail(fn, f"{scale_name} must be a float32 torch.Tensor of shape (batch, nheads_k) = "
                           f"{(batch, nheads_k)} or None, got {type(scale).__name__}", TypeError)
        validate_plain(fn, scale_name, scale)
        if scale.dtype != torch.float32:
            raise fail(fn, f"{scale_name} must have dtype torch.float32, got {scale.dtype}", TypeError)
        if tuple(scale.shape) != (batch, nheads_k):
            raise fail(fn, f"{scale_name} must have shape (batch, nheads_k) = {(batch, nheads_k)}, got "
                           f"{tuple(scale.shape)}")
        if scale.device != ref.device:
            raise fail(fn, f"{scale_name} is on {scale.device} but the inputs are on {ref.device}")
        scales.append(scale.contiguous())
    return Descale(*scales)


def validate_cache_dtypes(fn: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The caches share a dtype and device (``validate_same``), q's device; q has their dtype, or they are FP8 and
    q is 16-bit."""
    validate_same(fn, {"k_cache": k_cache, "v_cache": v_cache})
    if q.device != k_cache.device:
        raise fail(fn, f"k_cache is on {k_cache.device} but q is on {q.device}; all must be on one device")
    if q.dtype == k_cache.dtype or (is_fp8(k_cache) and q.dtype in SIXTEEN_BIT):
        return
    allowed = "the caches' dtype" + (", float16 or bfloat16" if is_fp8(k_cache) else "")
    raise fail(fn, f"q has dtype {q.dtype} but the caches have {k_cache.dtype}; q must have {allowed}", TypeError)


def validate_new_keys_dtype(fn: str, k_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """New keys and values share a dtype and the caches' device: the caches' dtype, or, for an FP8 cache, a 16-bit
    or float32 one that is quantized into it."""
    validate_same(fn, {"k": k, "v": v})
    if k.device != k_cache.device:
        raise fail(fn, f"k is on {k.device} but k_cache is on {k_cache.device}; all must be on one device")
    if k.dtype == k_cache.dtype or (is_fp8(k_cache) and k.dtype in (*SIXTEEN_BIT, torch.float32)):
        return
    allowed = "the caches' dtype" + (", float16, bfloat16 or float32" if is_fp8(k_cache) else "")
    raise fail(fn, f"k and v have dtype {k.dtype} but the caches have {k_cache.dtype}; they must have {allowed}",
               TypeError)
