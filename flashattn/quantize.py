"""FP8 quantization with one scale per (sequence, kv head), the granularity of FlashAttention-3's descales: what
an FP8 KV cache stores (``kvcache.append``) and what the training mode (``flash_attn_func(..., fp8=True)``)
attends.

A tensor x is stored as ``to_fp8(x, descale)`` = x / descale, saturated to the format's largest finite value, and
read as ``x8.float() * descale``. The training mode takes descale = amax / 448 over each (sequence, kv head)'s
values (a query head's scale is its kv head's, so q's descale has k's shape, as FlashAttention-3 asks), so each
group's largest value lands on e4m3's largest.

Example::

    >>> x = torch.tensor([[[[2.0], [-7.0]]]])  # (B, N, H, D) = (1, 1, 2, 1), one kv head
    >>> scale = amax_scales(x, heads_k=1)  # 7 / 448
    >>> scale.tolist(), to_fp8(x, scale).float().flatten().tolist()
    ([[0.015625]], [128.0, -448.0])
"""

from __future__ import annotations

import torch
from torch import Tensor

from .backends.spec import AttentionSpec, Descale, per_row

E4M3 = torch.float8_e4m3fn


def to_fp8(x: Tensor, descale: Tensor, dtype: torch.dtype = E4M3, cu_seqlens: Tensor | None = None) -> Tensor:
    """``x`` (B, N, H, D), or packed (total, H, D) with its ``cu_seqlens``, in the FP8 ``dtype`` with ``descale``
    (B, Hk) (query heads take their kv head's): x / descale, saturated to the format's largest finite value (448
    for e4m3fn, 57344 for e5m2); NaN stays NaN."""
    largest = torch.finfo(dtype).max
    return (x.float() / per_row(descale, x, cu_seqlens)).clamp(-largest, largest).to(dtype)


def from_fp8(x8: Tensor, descale: Tensor, dtype: torch.dtype, cu_seqlens: Tensor | None = None) -> Tensor:
    """What ``x8`` stands for, ``x8.float() * descale`` per (sequence, kv head), in ``dtype``."""
    return (x8.float() * per_row(descale, x8, cu_seqlens)).to(dtype)


def amax_scales(x: Tensor, *, heads_k: int, cu_seqlens: Tensor | None = None, dtype: torch.dtype = E4M3) -> Tensor:
    """(B, Hk) float32: the largest magnitude of each (sequence, kv head)'s values of ``x`` (B, N, H, D), or packed
    (total, H, D) with its ``cu_seqlens`` (rows past the last sequence ignored), over the format's largest value; 1
    where they are all zero. Non-finite values make their group's scale non-finite (the output NaN)."""
    per_head = x.detach().abs().amax(dim=-1)  # (B, N, H) or (total, H)
    grouped = per_head.unflatten(-1, (heads_k, -1)).amax(dim=-1).float()  # (B, N, Hk) or (total, Hk)
    if cu_seqlens is None:
        amax = grouped.amax(dim=1) if grouped.shape[1] else grouped.new_zeros(grouped.shape[0], heads_k)
    else:
        rows = torch.arange(grouped.shape[0], device=x.device)
        owner = torch.searchsorted(cu_seqlens[1:].to(rows.dtype), rows, right=True)
        batch = cu_seqlens.numel() - 1
        inside = owner < batch
        amax = grouped.new_zeros(batch, heads_k).scatter_reduce(
            0, owner.clamp_max(max(batch - 1, 0))[:, None].expand_as(grouped), grouped * inside[:, None], "amax")
    return torch.where(amax > 0, amax / torch.finfo(dtype).max, torch.ones_like(amax))


def quantized_inputs(q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec) -> tuple[Tensor, Tensor, Tensor, Descale]:
    """The training mode's FP8 inputs: q, k, v in e4m3 with amax scales per (sequence, kv head), and their
    ``Descale``."""
    heads_k = k.shape[-2]
    cu_q = spec.varlen.cu_seqlens_q if spec.varlen is not None else None
    cu_k = spec.varlen.cu_seqlens_k if spec.varlen is not None else None
    scales = (amax_scales(q, heads_k=heads_k, cu_seqlens=cu_q), amax_scales(k, heads_k=heads_k, cu_seqlens=cu_k),
              amax_scales(v, heads_k=heads_k, cu_seqlens=cu_k))
    q8, k8, v8 = (to_fp8(x, s, cu_seqlens=cu) for x, s, cu in zip((q, k, v), scales, (cu_q, cu_k, cu_k), strict=True))
    return q8, k8, v8, Descale(*scales)


def read_back(q8: Tensor, k8: Tensor, v8: Tensor, descale: Descale, spec: AttentionSpec,
              dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """``quantized_inputs``' q8, k8, v8 as the values they stand for, in ``dtype``: what the training mode's
    backward differentiates attention at (the straight-through rule) on paths without FP8 matmuls there."""
    cu_q = spec.varlen.cu_seqlens_q if spec.varlen is not None else None
    cu_k = spec.varlen.cu_seqlens_k if spec.varlen is not None else None
    return (from_fp8(q8, descale.q, dtype, cu_q), from_fp8(k8, descale.k, dtype, cu_k),
            from_fp8(v8, descale.v, dtype, cu_k))
