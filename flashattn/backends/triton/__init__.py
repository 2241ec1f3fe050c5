"""Triton backend: fused FlashAttention-2 kernels for NVIDIA GPUs (and CPU tensors under TRITON_INTERPRET=1).

``forward``, ``backward`` and ``forward_cache`` have the signatures of ``flashattn.backends.cpu``. Inputs are
passed by strides, never copied; fp16/bf16/fp32 inputs accumulate in fp32 (fp32 matmuls in IEEE precision, not
TF32).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton

from .. import TRITON_MAX_HEAD_DIM as MAX_HEAD_DIM
from ..spec import AttentionSpec, KeyCache, Varlen
from . import configs
from .kernels import (
    MASK_ADD,
    MASK_BOOL,
    MASK_NONE,
    attention_backward_dkdv_kernel,
    attention_backward_dq_kernel,
    attention_backward_preprocess_kernel,
    attention_forward_kernel,
    merge_splits_kernel,
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
    # The band's diagonal shift is per sequence (Nk - Nq for the bottom-right corner, plus the offset): the
    # kernels compute it.
    left = max(spec.window_left, 0)
    right = max(spec.window_right, 0)
    return (int(spec.bottom_right), spec.offset, left, right, spec.scale, spec.softcap or 1.0, spec.dropout_p)


class _Layout:
    """Shapes and strides of one call as the kernels take them.

    q is dense (B, Nq, H, D) or packed varlen (total_q, H, D). Keys are dense (B, Nk, Hk, D), packed varlen
    (total_k, Hk, D), or a KV cache (``cache``: dense or paged). ``nq``/``nk`` are the dense lengths or the maxima:
    they size the grid and lay out the dropout counters and the probabilities. lse (and delta) are (B, H, Nq)
    for a dense q, (H, total_q) for a packed one.
    """

    def __init__(self, q, k, v, varlen: Varlen | None, cache: KeyCache | None = None):
        self.cache = cache
        self.h, self.d = q.shape[-2], q.shape[-1]
        self.hk, self.dv = k.shape[-2], v.shape[-1]
        self.q_packed = q.dim() == 3
        if self.q_packed:
            self.b, self.nq = varlen.batch, varlen.max_seqlen_q
            self.lse_shape = (self.h, q.shape[0])
            cu_q = varlen.cu_seqlens_q
        else:
            self.b, self.nq = q.shape[0], q.shape[1]
            self.lse_shape = (self.b, self.h, self.nq)
            cu_q = q  # never read (Q_PACKED is off): an unused pointer argument, not an allocation
        if cache is not None:
            self.nk, self.k_range = cache.max_seqlen_k, (cache.k_start, cache.k_end)
        elif varlen is not None:
            cu_k = varlen.cu_seqlens_k
            self.nk, self.k_range = varlen.max_seqlen_k, (cu_k[:-1], cu_k[1:])
        else:
            self.nk, self.k_range = k.shape[1], None
        self.cu = (cu_q, varlen.cu_seqlens_k if varlen is not None else q)  # the backward's offsets
        self.sequence = (cu_q, *(self.k_range or (q, q)))  # the forward's CuQ, KStart, KEnd

    def strides(self, t: torch.Tensor) -> tuple[int, ...]:
        return tuple(t.stride()) if t.dim() == 4 else (0, *t.stride())

    def lse_strides(self, lse: torch.Tensor) -> tuple[int, int]:
        return tuple(lse.stride()[:2]) if lse.dim() == 3 else (0, lse.stride(0))

    def out_shape(self, dv: int) -> tuple[int, ...]:
        return (self.b, self.nq, self.h, dv) if not self.q_packed else (self.lse_shape[1], self.h, dv)


def _check(q: torch.Tensor, v: torch.Tensor) -> None:
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(f"the triton backend needs CUDA tensors (or TRITON_INTERPRET=1), got {q.device}")
    if q.dtype == torch.float64:
        raise TypeError("the triton backend supports float16, bfloat16 and float32; use the cpu backend for float64")
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        raise ValueError(f"the triton backend supports head dims up to {MAX_HEAD_DIM}, got {q.shape[-1]}")


def _config(table: dict, q: torch.Tensor, d: int, dv: int, heavy: bool, decode: bool = False) -> configs.KernelConfig:
    if interpreting():
        return configs.INTERPRETER
    weight = ("fp32-" if q.dtype == torch.float32 else "") + ("heavy" if heavy else "light")
    return (configs.DECODE if decode else table)[(configs.padded_head_dim(max(d, dv)), weight)]


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
    _attend(q, k, v, out, lse, probs if return_probs else None, alibi, mask, spec, lay)
    return _as(out, q.dtype), lse, _as(probs, q.dtype)


def forward_cache(q, k_cache, v_cache, alibi, spec: AttentionSpec, cache: KeyCache, varlen: Varlen | None = None):
    """Same contract as ``flashattn.backends.cpu.forward_cache``: (out, lse) over a dense or paged KV cache."""
    _check(q, v_cache)
    lay = _Layout(q, k_cache, v_cache, varlen, cache)
    out = _empty(lay.out_shape(lay.dv), q.dtype, q.device)
    lse = torch.empty(lay.lse_shape, dtype=torch.float32, device=q.device)
    if out.numel() == 0 or lay.nq == 0 or lay.nk == 0:
        lse.fill_(float("-inf"))
        return _as(out.zero_(), q.dtype), lse
    _attend(q, k_cache, v_cache, out, lse, None, alibi, None, spec, lay)
    return _as(out, q.dtype), lse


class _QueryRows:
    """How the forward kernel walks the queries: heads, group size, rows per head, and the strides of q, out
    (batch, row, head, dim) and lse (batch, head; rows have unit stride).

    A decode step (one query per head) with GQA is walked with the G query heads of a key/value head as G rows
    of one head (flash_attn's "seqlen-ngroups swap"): the program loads each K/V tile once for the whole group
    instead of G times, and the tensor-core tile is G rows instead of 1 row padded to BLOCK_M. It is only a
    change of strides, valid when nothing depends on the query position (no left window, no ALiBi, no dropout or
    mask); a right window or causal mask is void for one bottom-right-aligned query.
    """

    def __init__(self, q, out, lse, lay: _Layout, spec: AttentionSpec, plain: bool):
        g = lay.h // lay.hk
        self.spec = spec
        self.swapped = (plain and not lay.q_packed and lay.nq == 1 and g > 1 and spec.window_left < 0
                        and spec.offset == 0 and (spec.bottom_right or spec.window_right < 0))
        if not self.swapped:
            self.h, self.g, self.nq = lay.h, g, lay.nq
            self.q, self.out = lay.strides(q), lay.strides(out)
            self.lse = lay.lse_strides(lse)
            return
        self.spec = dataclasses.replace(spec, window_left=-1, window_right=-1)
        self.h, self.g, self.nq = lay.hk, 1, g
        (qb, _, qh, qd), (ob, _, oh, od) = q.stride(), out.stride()
        self.q, self.out = (qb, qh, g * qh, qd), (ob, oh, g * oh, od)
        self.lse = (lse.stride(0), g * lse.stride(1))  # lse (B, H, 1): head h = kv head * G + row


def _split_count(lay: _Layout, rows: _QueryRows, block_m: int, block_n: int, device: torch.device) -> int:
    requested = lay.cache.num_splits if lay.cache is not None else 1
    key_blocks = triton.cdiv(lay.nk, block_n)
    if requested == 0:
        programs = lay.b * rows.h * triton.cdiv(rows.nq, block_m)
        requested = configs.split_heuristic(programs, _multiprocessors(device), key_blocks)
    return max(1, min(requested, key_blocks))


@functools.lru_cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs one program at a time
    return torch.cuda.get_device_properties(device).multi_processor_count


def _attend(q, k, v, out, lse, probs, alibi, mask, spec: AttentionSpec, lay: _Layout) -> None:
    """Launch the forward kernel (and, with split-KV, the merge kernel) writing out, lse and probs."""
    plain = alibi is None and mask is None and probs is None and spec.dropout_p == 0
    rows = _QueryRows(q, out, lse, lay, spec, plain)
    spec = rows.spec
    heavy = spec.dropout_p > 0 or mask is not None or probs is not None
    cfg = _config(configs.FORWARD, q, lay.d, lay.dv, heavy, decode=rows.nq <= configs.DECODE_MAX_ROWS)
    splits = _split_count(lay, rows, cfg.block_m, cfg.block_n, q.device)
    split_keys = triton.cdiv(triton.cdiv(lay.nk, cfg.block_n), splits) * cfg.block_n
    splits = triton.cdiv(lay.nk, split_keys)  # no split left without keys
    if splits == 1:
        target, out_strides, lse_strides = (out, lse), (0, *rows.out), (0, *rows.lse)
    else:
        # Partial results in fp32, laid out as the kernel walks the rows (the merge writes the real layout).
        batch = 1 if lay.q_packed else lay.b
        rows_total = q.shape[0] if lay.q_packed else rows.nq
        target = (torch.empty(splits, batch, rows_total, rows.h, lay.dv, dtype=torch.float32, device=q.device),
                  torch.empty(splits, batch, rows.h, rows_total, dtype=torch.float32, device=q.device))
        out_strides = _packed_batch(target[0].stride(), lay.q_packed)
        lse_strides = _packed_batch(target[1].stride()[:3], lay.q_packed)
    mask_t, mask_strides, mask_kind = _mask_args(mask, q)
    cache = lay.cache
    paged = cache is not None and cache.block_table is not None
    block_table = cache.block_table if paged else q
    batch_idx = cache.batch_idx if cache is not None and cache.batch_idx is not None else q
    attention_forward_kernel[(triton.cdiv(rows.nq, cfg.block_m), lay.b * rows.h, splits)](
        q, k, v, *target, probs if probs is not None else q, alibi if alibi is not None else q, mask_t,
        _seed(spec, q), *lay.sequence, batch_idx, block_table,
        *rows.q, *lay.strides(k), *lay.strides(v), *out_strides, *lse_strides,
        *(_alibi_strides(alibi)), *mask_strides,
        block_table.stride(0) if paged else 0, k.shape[1] if paged else 1, split_keys,
        rows.h, rows.g, rows.nq, lay.nk, lay.d, lay.dv, *_scalars(spec),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=configs.padded_head_dim(lay.d),
        BLOCK_DV=configs.padded_head_dim(lay.dv), WRITE_PROBS=probs is not None, Q_PACKED=lay.q_packed,
        K_RANGE=lay.k_range is not None, K_BATCH=cache is not None and cache.batch_idx is not None, PAGED=paged,
        **_flags(spec, alibi, mask_kind, q, interpreting()),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        _merge_splits(*target, out, lse, lay, rows, splits)


def _packed_batch(strides: tuple[int, ...], q_packed: bool) -> tuple[int, ...]:
    """Workspace strides (split, batch, ...) as the kernel takes them: a packed q has batch stride 0 (rows are
    found through the offsets)."""
    return (strides[0], 0, *strides[2:]) if q_packed else strides


def _merge_splits(out_acc, lse_acc, out, lse, lay: _Layout, rows: _QueryRows, splits: int) -> None:
    # Merging is row by row: a packed q is one batch entry of total_q rows.
    batch, nq = out_acc.shape[1], out_acc.shape[2]
    out_strides = rows.out if not lay.q_packed else (0, *rows.out[1:])
    merge_splits_kernel[(triton.cdiv(nq, configs.MERGE_BLOCK_M), batch * rows.h)](
        out_acc, lse_acc, out, lse, *out_acc.stride(), *lse_acc.stride()[:3], *out_strides, *rows.lse,
        rows.h, nq, lay.dv, splits,
        BLOCK_M=configs.MERGE_BLOCK_M, BLOCK_DV=configs.padded_head_dim(lay.dv),
    )


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
