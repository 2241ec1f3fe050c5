"""Triton backend: fused FlashAttention-2 kernels for NVIDIA GPUs (and CPU tensors under TRITON_INTERPRET=1).

``forward`` and ``backward`` have the signatures of ``flashattn.backends.cpu``. Inputs are passed by strides,
never copied; fp16/bf16/fp32 inputs accumulate in fp32 (fp32 matmuls in IEEE precision, not TF32).
"""

from __future__ import annotations

import os

import torch
import triton

from .. import TRITON_MAX_HEAD_DIM as MAX_HEAD_DIM
from ..spec import AttentionSpec, Varlen
from . import configs
from .kernels import (
    MASK_ADD,
    MASK_BOOL,
    MASK_NONE,
    attention_backward_dkdv_kernel,
    attention_backward_dq_kernel,
    attention_backward_preprocess_kernel,
    attention_forward_kernel,
)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer. The interpreter converts fp32 to bf16 by truncation (the GPU rounds to nearest), so
    there bf16 outputs are written in fp32 and rounded by torch in ``_as``."""
    if dtype == torch.bfloat16 and interpreting():
        dtype = torch.float32
    return torch.empty(shape, dtype=dtype, device=device)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _mask_args(mask: torch.Tensor | None, q: torch.Tensor):
    if mask is None:
        return q, (0, 0, 0, 0), MASK_NONE
    # Broadcast dimensions (size 1) get stride 0, so the kernel reads the same element for every index.
    strides = tuple(0 if n == 1 else s for n, s in zip(mask.shape, mask.stride(), strict=True))
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8), strides, MASK_BOOL
    return mask, strides, MASK_ADD


def _flags(spec: AttentionSpec, alibi, mask_kind: int, q, interp: bool) -> dict:
    upcast = interp and q.dtype != torch.float32  # the interpreter's tl.dot is wrong on bf16: compute in fp32
    return dict(
        HAS_LEFT=spec.window_left >= 0,
        HAS_RIGHT=spec.window_right >= 0,
        HAS_SOFTCAP=spec.softcap > 0,
        HAS_ALIBI=alibi is not None,
        MASK_KIND=mask_kind,
        HAS_DROPOUT=spec.dropout_p > 0,
        UPCAST=upcast,
        FP32_DOT=upcast or q.dtype == torch.float32,
    )


def _scalars(spec: AttentionSpec) -> tuple:
    # The band's diagonal shift is per sequence (Nk - Nq for the bottom-right corner): the kernels compute it.
    left = max(spec.window_left, 0)
    right = max(spec.window_right, 0)
    return (int(spec.bottom_right), left, right, spec.scale, spec.softcap or 1.0, spec.dropout_p)


class _Layout:
    """Shapes and strides of a dense (B, N, H, D) or packed varlen (total, H, D) call, as the kernels take them.

    ``nq``/``nk`` are the dense lengths or the varlen maxima: they size the grid and lay out the dropout counters
    and the probabilities. lse (and delta) are (B, H, Nq) dense, (H, total_q) varlen.
    """

    def __init__(self, q, k, v, varlen: Varlen | None):
        self.varlen = varlen
        self.h, self.d = q.shape[-2], q.shape[-1]
        self.hk, self.dv = k.shape[-2], v.shape[-1]
        if varlen is None:
            self.b, self.nq, self.nk = q.shape[0], q.shape[1], k.shape[1]
            self.lse_shape = (self.b, self.h, self.nq)
            self.cu = (q, q)  # never read: IS_VARLEN is off (an unused pointer argument, not an allocation)
        else:
            self.b, self.nq, self.nk = varlen.batch, varlen.max_seqlen_q, varlen.max_seqlen_k
            self.lse_shape = (self.h, q.shape[0])
            self.cu = (varlen.cu_seqlens_q, varlen.cu_seqlens_k)

    def strides(self, t: torch.Tensor) -> tuple[int, ...]:
        return tuple(t.stride()) if t.dim() == 4 else (0, *t.stride())

    def lse_strides(self, lse: torch.Tensor) -> tuple[int, int]:
        return tuple(lse.stride()[:2]) if self.varlen is None else (0, lse.stride(0))

    def out_shape(self, dv: int) -> tuple[int, ...]:
        return (self.b, self.nq, self.h, dv) if self.varlen is None else (self.lse_shape[1], self.h, dv)


def _check(q: torch.Tensor, v: torch.Tensor) -> None:
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(f"the triton backend needs CUDA tensors (or TRITON_INTERPRET=1), got {q.device}")
    if q.dtype == torch.float64:
        raise TypeError("the triton backend supports float16, bfloat16 and float32; use the cpu backend for float64")
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        raise ValueError(f"the triton backend supports head dims up to {MAX_HEAD_DIM}, got {q.shape[-1]}")


def _config(table: dict, q: torch.Tensor, d: int, dv: int, heavy: bool) -> configs.KernelConfig:
    if interpreting():
        return configs.INTERPRETER
    weight = ("fp32-" if q.dtype == torch.float32 else "") + ("heavy" if heavy else "light")
    return table[(configs.padded_head_dim(max(d, dv)), weight)]


def forward(q, k, v, alibi, mask, spec: AttentionSpec, return_probs: bool = False, varlen: Varlen | None = None):
    """Same contract as ``flashattn.backends.cpu.forward``."""
    _check(q, v)
    lay = _Layout(q, k, v, varlen)
    out = _empty(lay.out_shape(lay.dv), q.dtype, q.device)
    lse = torch.empty(lay.lse_shape, dtype=torch.float32, device=q.device)
    probs = _empty((lay.b, lay.h, lay.nq, lay.nk), q.dtype, q.device).zero_() if return_probs else q.new_empty(0)
    if out.numel() == 0 or lay.nq == 0:
        lse.fill_(float("-inf"))
        return _as(out.zero_(), q.dtype), lse, _as(probs, q.dtype)
    cfg = _config(configs.FORWARD, q, lay.d, lay.dv, heavy=spec.dropout_p > 0 or mask is not None or return_probs)
    mask_t, mask_strides, mask_kind = _mask_args(mask, q)
    grid = (triton.cdiv(lay.nq, cfg.block_m), lay.b * lay.h)
    attention_forward_kernel[grid](
        q, k, v, out, lse, probs, alibi if alibi is not None else q, mask_t, _seed(spec, q), *lay.cu,
        *lay.strides(q), *lay.strides(k), *lay.strides(v), *lay.strides(out), *lay.lse_strides(lse),
        *(_alibi_strides(alibi)), *mask_strides,
        lay.h, lay.h // lay.hk, lay.nq, lay.nk, lay.d, lay.dv, *_scalars(spec),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=configs.padded_head_dim(lay.d),
        BLOCK_DV=configs.padded_head_dim(lay.dv), WRITE_PROBS=return_probs, IS_VARLEN=varlen is not None,
        **_flags(spec, alibi, mask_kind, q, interpreting()),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return _as(out, q.dtype), lse, _as(probs, q.dtype)


def _alibi_strides(alibi: torch.Tensor | None) -> tuple[int, int]:
    if alibi is None:
        return (0, 0)
    return (0 if alibi.shape[0] == 1 else alibi.stride(0), alibi.stride(1))


def _seed(spec: AttentionSpec, q: torch.Tensor) -> torch.Tensor:
    # Without dropout the kernels never load it: any pointer will do, so no allocation on the launch path.
    return spec.seed if spec.seed is not None else q


def backward(dout, dlse, q, k, v, out, lse, alibi, mask, spec: AttentionSpec, mask_grad: bool = False,
             varlen: Varlen | None = None):
    """Same contract as ``flashattn.backends.cpu.backward``; deterministic (no atomics) in every mode."""
    if mask_grad:
        raise ValueError("the triton backend does not compute gradients for attn_mask; detach the mask or use "
                         "the cpu backend (flashattn.use_backend('cpu'))")
    _check(q, v)
    lay = _Layout(q, k, v, varlen)
    dq, dk, dvv = (_empty(t.shape, t.dtype, t.device) for t in (q, k, v))
    if q.numel() == 0 or k.numel() == 0 or lay.nq == 0 or lay.nk == 0:
        return _as(dq.zero_(), q.dtype), _as(dk.zero_(), k.dtype), _as(dvv.zero_(), v.dtype), None
    interp = interpreting()
    # delta_i = rowsum(dO_i * O_i) - dlse_i is per row: a packed varlen batch is one long sequence to it.
    delta = torch.empty(lay.lse_shape, dtype=torch.float32, device=q.device)
    dense = (lambda t: t) if varlen is None else (lambda t: t[None])
    pre_out, pre_dout, pre_delta = dense(out), dense(dout), dense(delta)
    # dlse is read as a dense array; it is small, and autograd may hand it over expanded.
    pre_dlse = dense(dlse.contiguous()) if dlse is not None else pre_delta
    rows, heads = pre_out.shape[1], pre_out.shape[2]
    attention_backward_preprocess_kernel[(triton.cdiv(rows, configs.PREPROCESS_BLOCK_M), pre_out.shape[0] * heads)](
        pre_out, pre_dout, pre_dlse, pre_delta, *pre_out.stride(), *pre_dout.stride(), heads, rows, lay.dv,
        BLOCK_M=configs.PREPROCESS_BLOCK_M, BLOCK_DV=configs.padded_head_dim(lay.dv), HAS_DLSE=dlse is not None,
    )
    heavy = spec.dropout_p > 0 or mask is not None
    mask_t, mask_strides, mask_kind = _mask_args(mask, q)
    common = dict(BLOCK_D=configs.padded_head_dim(lay.d), BLOCK_DV=configs.padded_head_dim(lay.dv),
                  IS_VARLEN=varlen is not None, **_flags(spec, alibi, mask_kind, q, interp))
    tensors = (alibi if alibi is not None else q, mask_t, _seed(spec, q), *lay.cu)
    strides_in = (*lay.strides(q), *lay.strides(k), *lay.strides(v), *lay.strides(dout))
    strides_tail = (*lay.lse_strides(lse), *_alibi_strides(alibi), *mask_strides)

    cfg = _config(configs.BACKWARD_DKDV, q, lay.d, lay.dv, heavy)
    attention_backward_dkdv_kernel[(triton.cdiv(lay.nk, cfg.block_n), lay.b * lay.hk)](
        q, k, v, dout, lse, delta, dk, dvv, *tensors,
        *strides_in, *lay.strides(dk), *lay.strides(dvv), *strides_tail,
        lay.h, lay.hk, lay.h // lay.hk, lay.nq, lay.nk, lay.d, lay.dv, *_scalars(spec),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **common, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    cfg = _config(configs.BACKWARD_DQ, q, lay.d, lay.dv, heavy)
    attention_backward_dq_kernel[(triton.cdiv(lay.nq, cfg.block_m), lay.b * lay.h)](
        q, k, v, dout, lse, delta, dq, *tensors,
        *strides_in, *lay.strides(dq), *strides_tail,
        lay.h, lay.h // lay.hk, lay.nq, lay.nk, lay.d, lay.dv, *_scalars(spec),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **common, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return _as(dq, q.dtype), _as(dk, k.dtype), _as(dvv, v.dtype), None
