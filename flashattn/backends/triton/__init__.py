"""Triton backend: fused FlashAttention-2 kernels for NVIDIA GPUs (and CPU tensors under TRITON_INTERPRET=1).

It satisfies ``flashattn.backends.Backend``. Inputs are passed by strides, never copied; fp16/bf16/fp32 inputs
accumulate in fp32 (fp32 matmuls in IEEE precision, not TF32). Every kernel is launched with keyword arguments
built by name (``launch.py``); a feature a call does not use is passed as None and compiled out.
"""

from __future__ import annotations

import math

import torch

from .. import TRITON_BLOCK_MULTIPLE
from .. import TRITON_MAX_HEAD_DIM as MAX_HEAD_DIM
from ..spec import AttentionSpec, Saved
from . import configs
from .kernels import (
    attention_backward_dkdv_kernel,
    attention_backward_dq_kernel,
    attention_backward_preprocess_kernel,
    attention_forward_kernel,
)
from .launch import (
    CallShape,
    QueryRows,
    as_dtype,
    backward_descriptors,
    backward_kwargs,
    compiling_only,
    config,
    empty,
    forward_kwargs,
    interpreting,
    launch,
    merge_splits,
    sparse_blocks,
    sparse_tiles,
    split_count,
)

NAME = "triton"

__all__ = ["NAME", "backward", "forward", "interpreting", "unsupported"]


def unsupported(q, k, v, spec: AttentionSpec, *, return_probs: bool = False) -> str | None:
    """Why the kernels cannot run the call: not CUDA (and not interpreting), float64, or head dims over 256."""
    if q.device.type != "cuda" and not (interpreting() or compiling_only()):
        return f"it needs CUDA tensors (or TRITON_INTERPRET=1), got {q.device}"
    if q.dtype == torch.float64:
        return "it supports float16, bfloat16 and float32; use the cpu backend for float64"
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        return f"it supports head dims up to {MAX_HEAD_DIM}, got {max(q.shape[-1], v.shape[-1])}"
    blocks = spec.block_sparse
    if blocks is not None and (blocks.q_block % TRITON_BLOCK_MULTIPLE or blocks.kv_block % TRITON_BLOCK_MULTIPLE):
        return (f"its tiles must divide the block mask's blocks, which must be multiples of "
                f"{TRITON_BLOCK_MULTIPLE}, got {blocks.q_block} x {blocks.kv_block}")
    return None


def _check(q, k, v, spec: AttentionSpec) -> None:
    reason = unsupported(q, k, v, spec)
    if reason is not None:
        raise (TypeError if q.dtype == torch.float64 else ValueError)(f"the triton backend: {reason}")


def forward(q, k, v, spec: AttentionSpec, *, return_probs: bool = False):
    """Same contract as ``flashattn.backends.cpu.forward``: (out, lse, probs), keys dense, packed or cached."""
    _check(q, k, v, spec)
    shape = CallShape(q, k, v, spec)
    out = empty(shape.out_shape, q.dtype, q.device)
    lse = torch.empty(shape.lse_shape, dtype=torch.float32, device=q.device)
    probs = empty((shape.b, shape.h, shape.nq, shape.nk), q.dtype, q.device).zero_() if return_probs else q.new_empty(0)
    if out.numel() == 0 or shape.nq == 0 or shape.nk == 0:  # no key: out 0, lse -inf (the sink with one)
        lse.fill_(-math.inf)
        if spec.sink is not None:
            lse.copy_(spec.sink[:, None].expand_as(lse))
        return as_dtype(out.zero_(), q.dtype), lse, as_dtype(probs, q.dtype)
    _attend(q, k, v, (out, lse, probs if return_probs else None), spec, shape)
    return as_dtype(out, q.dtype), lse, as_dtype(probs, q.dtype)


def _attend(q, k, v, results, spec: AttentionSpec, shape: CallShape) -> None:
    """Launch the forward kernel (and, with split-KV, the merge kernel) writing ``results`` = (out, lse, probs)."""
    out, lse, probs = results
    plain = (spec.alibi_slopes is None and spec.attn_mask is None and spec.block_sparse is None and probs is None
             and spec.dropout_p == 0)
    rows = QueryRows(q, out, lse, shape, spec, plain=plain)
    heavy = spec.dropout_p > 0 or spec.attn_mask is not None or probs is not None
    cfg = config("decode" if rows.nq <= configs.DECODE_MAX_ROWS else "forward", q, shape, rows.spec, heavy=heavy)
    cfg = sparse_tiles(cfg, spec)
    splits, split_keys = split_count(shape, rows, cfg, q.device)
    if splits == 1:
        targets = (out, lse)
    else:
        # Partial results in fp32, laid out as the kernel walks the rows (the merge writes the real layout).
        batch, rows_total = (1, q.shape[0]) if shape.q_packed else (shape.b, rows.nq)
        targets = (torch.empty(splits, batch, rows_total, rows.h, shape.dv, dtype=torch.float32, device=q.device),
                   torch.empty(splits, batch, rows.h, rows_total, dtype=torch.float32, device=q.device))
    kwargs = forward_kwargs(q, k, v, (*targets, probs), spec=rows.spec, shape=shape, rows=rows, cfg=cfg)
    grid = (-(-rows.nq // cfg.block_m) * shape.b * rows.h, 1, splits)
    launch(attention_forward_kernel, grid, **kwargs, split_keys=split_keys, BLOCK_M=cfg.block_m,
           BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if splits > 1:
        merge_splits(targets, (out, lse), shape=shape, rows=rows)


def backward(dout, dlse, saved: Saved, spec: AttentionSpec, *, mask_grad: bool = False):
    """Same contract as ``flashattn.backends.cpu.backward``; deterministic (no atomics) in every mode."""
    q, k, v, out, lse = saved
    # The kernels read lse and delta (allocated dense) at the same offsets: lse must be dense too (a block of a
    # longer sequence may hand over a slice of one).
    lse = lse.contiguous()
    if mask_grad:
        raise ValueError("the triton backend does not compute gradients for attn_mask; detach the mask or use "
                         "the cpu backend (flashattn.use_backend('cpu'))")
    if spec.cache is not None:
        raise NotImplementedError("the triton backend has no backward through keys in a KV cache")
    _check(q, k, v, spec)
    shape = CallShape(q, k, v, spec)
    dq, dk, dv = (empty(t.shape, t.dtype, t.device) for t in (q, k, v))
    if q.numel() == 0 or k.numel() == 0 or shape.nq == 0 or shape.nk == 0:
        return as_dtype(dq.zero_(), q.dtype), as_dtype(dk.zero_(), k.dtype), as_dtype(dv.zero_(), v.dtype), None
    delta = _delta(dout, dlse, out, shape)
    heavy = spec.dropout_p > 0 or spec.attn_mask is not None
    common = backward_kwargs(q, k, v, (dout, lse, delta), spec=spec, shape=shape)
    cfg = sparse_tiles(config("dkdv", q, shape, spec, heavy=heavy), spec)
    launch(attention_backward_dkdv_kernel, (-(-shape.nk // cfg.block_n) * shape.b * shape.hk,),
           **common, blocks=sparse_blocks(spec, by_keys=True), dk=dk, dv=dv, **shape.strides("dk", dk),
           **shape.strides("dv", dv), num_heads_k=shape.hk,
           **backward_descriptors(q, k, v, dout, shape=shape, blocks=(cfg.block_m, cfg.block_n),
                                  matmul_rows=cfg.block_n),
           BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    cfg = sparse_tiles(config("dq", q, shape, spec, heavy=heavy), spec)
    launch(attention_backward_dq_kernel, (-(-shape.nq // cfg.block_m) * shape.b * shape.h,),
           **common, blocks=sparse_blocks(spec, by_keys=False), dq=dq, **shape.strides("dq", dq),
           **backward_descriptors(q, k, v, dout, shape=shape, blocks=(cfg.block_m, cfg.block_n),
                                  matmul_rows=cfg.block_m),
           BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return as_dtype(dq, q.dtype), as_dtype(dk, k.dtype), as_dtype(dv, v.dtype), None


def _delta(dout, dlse, out, shape: CallShape) -> torch.Tensor:
    """delta_i = rowsum(dO_i * O_i) - dlse_i, per row: a packed varlen batch is one long sequence to it."""
    delta = torch.empty(shape.lse_shape, dtype=torch.float32, device=out.device)
    dense = (lambda t: t[None]) if shape.q_packed else (lambda t: t)
    out4, dout4 = dense(out), dense(dout)
    rows, heads = out4.shape[1], out4.shape[2]
    launch(
        attention_backward_preprocess_kernel, (-(-rows // configs.PREPROCESS_BLOCK_M) * out4.shape[0] * heads,),
        out=out4, dout=dout4,
        # dlse is read as a dense array; it is small, and autograd may hand it over expanded.
        dlse=None if dlse is None else dense(dlse.contiguous()), delta=dense(delta),
        **shape.strides("o", out4, "bnhd"), **shape.strides("do", dout4, "bnhd"),
        num_heads=heads, seqlen_q=rows, head_dim_v=shape.dv,
        BLOCK_M=configs.PREPROCESS_BLOCK_M, BLOCK_DV=configs.padded_head_dim(shape.dv),
    )
    return delta
