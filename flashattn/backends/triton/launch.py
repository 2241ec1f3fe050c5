"""How a call becomes kernel arguments: shapes, strides and options by name, one dict per launch.

Every argument of a kernel is named here exactly once (``forward_kwargs``, ``backward_kwargs``); strides come
from ``Layout.strides(name, tensor)`` as ``stride_<name><dim>``; an absent feature is None, which the kernels
compile out.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import NamedTuple

import torch

from ..spec import AttentionSpec
from . import configs
from .kernels import merge_splits_kernel


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class Compiled(NamedTuple):
    """One launch compiled instead of run (``compile_only``): the kernel's name, grid, arguments and binary."""

    name: str
    grid: tuple[int, ...]
    kwargs: dict
    kernel: object  # triton.compiler.CompiledKernel


_compile_only: ContextVar[list[Compiled] | None] = ContextVar("flashattn_triton_compile_only", default=None)


@contextmanager
def compile_only() -> Iterator[list[Compiled]]:
    """Inside the block, every launch compiles its kernel for the active Triton target with exactly the arguments
    a real call passes (so with the runtime's specialization: aligned pointers, unit strides, divisible sizes) and
    records it instead of running it; CPU tensors are accepted. The kernel health report is built on this."""
    token = _compile_only.set([])
    try:
        yield _compile_only.get()
    finally:
        _compile_only.reset(token)


def compiling_only() -> bool:
    return _compile_only.get() is not None


def launch(kernel, grid: tuple[int, ...], **kwargs) -> None:
    """``kernel[grid](**kwargs)``, or, inside ``compile_only``, its compilation."""
    recorded = _compile_only.get()
    if recorded is None:
        kernel[grid](**kwargs)
    else:
        recorded.append(Compiled(kernel.fn.__name__, grid, kwargs, kernel.warmup(grid=grid, **kwargs)))


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer. The interpreter converts fp32 to bf16 by truncation (the GPU rounds to nearest), so
    there bf16 outputs are written in fp32 and rounded by torch in ``as_dtype``."""
    if dtype == torch.bfloat16 and interpreting():
        dtype = torch.float32
    return torch.empty(shape, dtype=dtype, device=device)


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


class Layout:
    """Shapes and strides of one call as the kernels take them.

    q is dense (B, Nq, H, D) or packed varlen (total_q, H, D). Keys are dense (B, Nk, Hk, D), packed varlen
    (total_k, Hk, D), or a KV cache (``spec.cache``: dense or paged). ``nq``/``nk`` are the dense lengths or the
    maxima: they size the grid and lay out the dropout counters and the probabilities. lse (and delta) are
    (B, H, Nq) for a dense q, (H, total_q) for a packed one.
    """

    def __init__(self, q, k, v, spec: AttentionSpec):
        self.h, self.d = q.shape[-2], q.shape[-1]
        self.hk, self.dv = k.shape[-2], v.shape[-1]
        self.q_packed = spec.packed
        varlen, cache = spec.varlen, spec.cache
        if self.q_packed:
            self.b, self.nq = varlen.batch, varlen.max_seqlen_q
            self.lse_shape = (self.h, q.shape[0])
            self.out_shape = (q.shape[0], self.h, self.dv)
        else:
            self.b, self.nq = q.shape[0], q.shape[1]
            self.lse_shape = (self.b, self.h, self.nq)
            self.out_shape = (self.b, self.nq, self.h, self.dv)
        self.cu_seqlens_q = varlen.cu_seqlens_q if varlen is not None else None
        self.cu_seqlens_k = varlen.cu_seqlens_k if varlen is not None else None
        if cache is not None:
            self.nk = cache.max_seqlen_k
            table = cache.block_table
            self.keys = dict(k_start=cache.k_start, k_end=cache.k_end, k_batch=cache.batch_idx, block_table=table,
                             stride_bt=0 if table is None else table.stride(0),
                             page_size=k.shape[1] if table is not None else 1)
        else:
            self.nk = varlen.max_seqlen_k if varlen is not None else k.shape[1]
            # Varlen keys: k_start = the offsets, whose next entry ends each sequence (k_end None).
            self.keys = dict(k_start=self.cu_seqlens_k, k_end=None, k_batch=None, block_table=None, stride_bt=0,
                             page_size=1)

    @staticmethod
    def strides(name: str, t: torch.Tensor, dims: str = "bnhd") -> dict[str, int]:
        """``{"stride_<name><dim>": stride}``; a tensor with fewer dims than ``dims`` (packed: no batch) gets
        stride 0 in the leading ones."""
        strides = (0,) * (len(dims) - t.dim()) + tuple(t.stride())
        return {f"stride_{name}{dim}": s for dim, s in zip(dims, strides, strict=True)}

    def lse_strides(self, lse: torch.Tensor) -> dict[str, int]:
        """(batch, head) strides of lse; query positions have unit stride."""
        b, h = (lse.stride(0), lse.stride(1)) if lse.dim() == 3 else (0, lse.stride(0))
        return {"stride_lb": b, "stride_lh": h}


class QueryRows:
    """How the forward kernel walks the queries: heads, group size, rows per head, and the strides of q, out
    (batch, row, head, dim) and lse (batch, head; rows have unit stride).

    A decode step (one query per head) with GQA is walked with the G query heads of a key/value head as G rows
    of one head (flash_attn's "seqlen-ngroups swap"): the program loads each K/V tile once for the whole group
    instead of G times, and the tensor-core tile is G rows instead of 1 row padded to BLOCK_M. It is only a
    change of strides, valid when nothing depends on the query position (no left window, no ALiBi, no dropout or
    mask); a right window or causal mask is void for one bottom-right-aligned query.
    """

    def __init__(self, q, out, lse, lay: Layout, spec: AttentionSpec, *, plain: bool):
        g = lay.h // lay.hk
        self.spec = spec
        self.swapped = (plain and not lay.q_packed and lay.nq == 1 and g > 1 and spec.window_left < 0
                        and spec.diagonal_offset == 0 and (spec.bottom_right or spec.window_right < 0))
        if not self.swapped:
            self.h, self.g, self.nq = lay.h, g, lay.nq
            self.q, self.out = Layout.strides("q", q), tuple(Layout.strides("o", out).values())
            self.lse = tuple(lay.lse_strides(lse).values())
            return
        self.spec = dataclasses.replace(spec, window_left=-1, window_right=-1)
        self.h, self.g, self.nq = lay.hk, 1, g
        (qb, _, qh, qd), (ob, _, oh, od) = q.stride(), out.stride()
        self.q = {"stride_qb": qb, "stride_qn": qh, "stride_qh": g * qh, "stride_qd": qd}
        self.out = (ob, oh, g * oh, od)
        self.lse = (lse.stride(0), g * lse.stride(1))  # lse (B, H, 1): head h = kv head * G + row


def config(table: dict, q: torch.Tensor, lay: Layout, *, heavy: bool, decode: bool = False) -> configs.KernelConfig:
    if interpreting():
        return configs.INTERPRETER
    weight = ("fp32-" if q.dtype == torch.float32 else "") + ("heavy" if heavy else "light")
    return (configs.DECODE if decode else table)[(configs.padded_head_dim(max(lay.d, lay.dv)), weight)]


@functools.lru_cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs one program at a time
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_count(lay: Layout, rows: QueryRows, cfg: configs.KernelConfig, device: torch.device) -> tuple[int, int]:
    """(splits, keys per split) of the forward launch: ``spec.cache.num_splits``, or the heuristic for 0."""
    cache = rows.spec.cache
    requested = cache.num_splits if cache is not None else 1
    key_blocks = -(-lay.nk // cfg.block_n)
    if requested == 0:
        programs = lay.b * rows.h * -(-rows.nq // cfg.block_m)
        requested = configs.split_heuristic(programs, _multiprocessors(device), key_blocks)
    splits = max(1, min(requested, key_blocks))
    split_keys = -(-key_blocks // splits) * cfg.block_n
    return -(-lay.nk // split_keys), split_keys  # no split left without keys


def _options(spec: AttentionSpec) -> dict:
    """The scalar options by kernel argument name; a window side or softcap that is off is None."""
    return dict(
        bottom_right=int(spec.bottom_right), diagonal_offset=spec.diagonal_offset,
        window_left=spec.window_left if spec.window_left >= 0 else None,
        window_right=spec.window_right if spec.window_right >= 0 else None,
        scale=spec.scale, softcap=spec.softcap if spec.softcap > 0 else None, dropout_p=spec.dropout_p,
    )


def _bias(spec: AttentionSpec) -> dict:
    """ALiBi slopes, the user mask and the dropout seed with their strides (broadcast dimensions get stride 0,
    so the kernel reads the same element for every index); a boolean mask is read as uint8."""
    alibi, mask = spec.alibi_slopes, spec.attn_mask
    args = dict(alibi=alibi, seed=spec.seed, stride_ab=0, stride_ah=0, mask=None, stride_mb=0, stride_mh=0,
                stride_mq=0, stride_mk=0)
    if alibi is not None:
        args.update(stride_ab=0 if alibi.shape[0] == 1 else alibi.stride(0), stride_ah=alibi.stride(1))
    if mask is not None:
        strides = (0 if n == 1 else s for n, s in zip(mask.shape, mask.stride(), strict=True))
        args.update(dict(zip(("stride_mb", "stride_mh", "stride_mq", "stride_mk"), strides, strict=True)))
        args["mask"] = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    return args


def _shapes(q, lay: Layout) -> dict:
    return dict(seqlen_q=lay.nq, seqlen_k=lay.nk, head_dim=lay.d, head_dim_v=lay.dv,
                BLOCK_D=configs.padded_head_dim(lay.d), BLOCK_DV=configs.padded_head_dim(lay.dv),
                # The interpreter's tl.dot is wrong on bf16 (and fp16 is slow there): compute in fp32.
                UPCAST=interpreting() and q.dtype != torch.float32)


def forward_kwargs(q, k, v, targets, *, probs, spec: AttentionSpec, lay: Layout, rows: QueryRows) -> dict:
    """Every argument of ``attention_forward_kernel`` but the tile sizes and ``split_keys``. ``targets`` = (out,
    lse), or the split workspaces (splits, batch, rows, heads, dv) and (splits, batch, heads, rows)."""
    out, lse = targets
    if out.dim() == 5:  # split workspaces: a packed q has batch stride 0 (rows are found through the offsets)
        so, sl = list(out.stride()), list(lse.stride()[:3])
        if lay.q_packed:
            so[1] = sl[1] = 0
        out_strides, lse_strides = tuple(so), tuple(sl)
    else:
        out_strides, lse_strides = (0, *rows.out), (0, *rows.lse)
    args = dict(
        q=q, k=k, v=v, out=out, lse=lse, probs=probs, cu_seqlens_q=lay.cu_seqlens_q, **lay.keys,
        **rows.q, **Layout.strides("k", k), **Layout.strides("v", v),
        **dict(zip(("stride_os", "stride_ob", "stride_on", "stride_oh", "stride_od"), out_strides, strict=True)),
        **dict(zip(("stride_ls", "stride_lb", "stride_lh"), lse_strides, strict=True)),
        **_bias(spec), **_options(spec), **_shapes(q, lay),
    )
    # The rows as the kernel walks them (a GQA decode step walks a head group as rows).
    args.update(num_heads=rows.h, group_size=rows.g, seqlen_q=rows.nq)
    return args


def backward_kwargs(q, k, v, stats, *, spec: AttentionSpec, lay: Layout) -> dict:
    """The arguments the dK/dV and dQ kernels share; ``stats`` = (dout, lse, delta)."""
    dout, lse, delta = stats
    return dict(
        q=q, k=k, v=v, dout=dout, lse=lse, delta=delta, cu_seqlens_q=lay.cu_seqlens_q, cu_seqlens_k=lay.cu_seqlens_k,
        **Layout.strides("q", q), **Layout.strides("k", k), **Layout.strides("v", v), **Layout.strides("d", dout),
        **lay.lse_strides(lse), **_bias(spec), **_options(spec), **_shapes(q, lay),
        num_heads=lay.h, group_size=lay.h // lay.hk,
    )


def merge_splits(partials, results, *, lay: Layout, rows: QueryRows) -> None:
    """Merge the split workspaces ``partials`` into ``results`` = (out, lse), row by row (a packed q is one
    batch entry of total_q rows)."""
    out_acc, lse_acc = partials
    out, lse = results
    batch, nq = out_acc.shape[1], out_acc.shape[2]
    out_strides = rows.out if not lay.q_packed else (0, *rows.out[1:])
    launch(
        merge_splits_kernel, (-(-nq // configs.MERGE_BLOCK_M), batch * rows.h),
        out_splits=out_acc, lse_splits=lse_acc, out=out, lse=lse,
        **Layout.strides("s", out_acc, "sbnhd"),
        **dict(zip(("stride_ls", "stride_lb", "stride_lh"), lse_acc.stride()[:3], strict=True)),
        **dict(zip(("stride_ob", "stride_on", "stride_oh", "stride_od"), out_strides, strict=True)),
        stride_rb=rows.lse[0], stride_rh=rows.lse[1],
        num_heads=rows.h, seqlen_q=nq, head_dim_v=lay.dv, n_splits=out_acc.shape[0],
        BLOCK_M=configs.MERGE_BLOCK_M, BLOCK_DV=configs.padded_head_dim(lay.dv),
    )
