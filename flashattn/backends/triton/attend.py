"""The ``triton`` path's entry points: a call's forward and backward as launches of the kernels in ``kernels/``.

Inputs are passed by strides, never copied; fp16/bf16/fp32 inputs accumulate in fp32 (fp32 matmuls in IEEE
precision, not TF32). Every kernel is launched with keyword arguments built by name (``launch.py``); a feature a
call does not use is passed as None and compiled out. What the path serves is declared in ``__init__.py``
(``serves``), which the choice of a path reads before anything here runs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import torch

from ...quantize import amax_scales
from ..spec import AttentionSpec, Saved, output_dtype, per_row
from . import NAME, configs, hopper, interpreting, plans
from .call_plans import CachePlan, VarlenPlan
from .fit import launch_fitting
from .kernels import (
    attention_backward_dkdv_kernel,
    attention_backward_dq_convert_kernel,
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
    cache_keys,
    compiling_only,
    config,
    empty,
    forward_kwargs,
    fp8_dout_strides,
    launch,
    sparse_blocks,
    sparse_tiles,
    split_count,
    target_arch,
    weight_of,
)
from .tickets import tickets

__all__ = ["NAME", "backward", "forward", "fp8_backward"]


_FORWARD_PLANS = plans.PlanCache()
_BACKWARD_PLANS = plans.PlanCache()
FORWARD_PLANS, BACKWARD_PLANS = _FORWARD_PLANS, _BACKWARD_PLANS  # for callers that replay plans themselves


def _planned(spec: AttentionSpec, *tensors: torch.Tensor | None) -> bool:
    """Whether a call goes through its launch plan (``plans.py``): compiled kernels, a plannable spec, no empty
    input, and every tensor the backward reads as a dense array already dense (else a copy would be made)."""
    return (not interpreting() and not compiling_only() and plans.plannable(spec)
            and all(t is None or (t.numel() > 0 and t.is_contiguous()) for t in tensors))


def on_tensors_device(fn):
    """``fn`` (a path entry point whose first argument is a tensor of the call) run with that tensor's GPU current:
    Triton launches on the current device, and a model spread over GPUs in one process (``device_map="auto"``)
    calls with tensors on the others. Plans record and replay under it (their context holds the device), so a call
    off the current device never takes a fast path's entry, learned outside it."""

    @functools.wraps(fn)
    def run(first, *args, **kwargs):
        if first.is_cuda and first.device.index != torch.cuda.current_device():
            with torch.cuda.device(first.device):
                return fn(first, *args, **kwargs)
        return fn(first, *args, **kwargs)

    return run


@on_tensors_device
def forward(q, k, v, spec: AttentionSpec, *, return_probs: bool = False):
    """The call's launches by its plan where it has one (``plans.py``), else ``_forward``'s."""
    planned = None if return_probs else _forward_signature(q, k, v, spec)
    if planned is None:
        return _forward(q, k, v, spec, return_probs=return_probs)
    signature, inputs = planned
    out, lse = _FORWARD_PLANS.run(signature, inputs, q.device, lambda: _forward(q, k, v, spec)[:2])
    return out, lse, q.new_empty(0)


def _forward_signature(q, k, v, spec: AttentionSpec) -> tuple[tuple, tuple] | None:
    """(the forward plan's key, its inputs) for a call that goes through a plan, else None."""
    if not _planned(spec) or q.numel() == 0 or k.numel() == 0:
        return None
    tensors, scalars = plans.spec_tensors(spec, cache_keys=None if spec.cache is None else cache_keys(
        spec.cache.max_seqlen_k, k, spec.cache.block_table))
    inputs = (q, k, v, *tensors)
    return plans.key("forward", inputs, scalars), inputs


def forward_plan(q, k, v, spec: AttentionSpec) -> plans.Plan | None:
    """The plan ``forward`` replays for this call (without probabilities) once one is recorded, else None: for
    a caller that keeps it and replays it itself (``flashattn.fastpath``), counting ``FORWARD_PLANS.replays``
    and checking ``plan_context`` each time."""
    planned = _forward_signature(q, k, v, spec)
    return None if planned is None else _FORWARD_PLANS.get(planned[0])


def backward_plan(dout, dlse, saved: Saved, spec: AttentionSpec) -> plans.Plan | None:
    """The plan ``backward`` replays for this call once one is recorded, else None (as ``forward_plan``)."""
    planned = _backward_signature(dout, dlse, saved, spec)
    return None if planned is None else _BACKWARD_PLANS.get(planned[0])


def cache_plan(q, k_cache, v_cache, spec: AttentionSpec) -> CachePlan | None:
    """``forward_plan`` for a ``flash_attn_with_kvcache`` call (``spec.cache`` set), as a ``CachePlan``."""
    plan = forward_plan(q, k_cache, v_cache, spec)
    return None if plan is None else CachePlan(plan, spec)


def varlen_plan(q, k, v, spec: AttentionSpec) -> VarlenPlan | None:
    """``forward_plan`` for a packed call (``spec.varlen`` set; a paged K/V's too), as a ``VarlenPlan``."""
    plan = forward_plan(q, k, v, spec) if spec.varlen is not None else None
    return None if plan is None else VarlenPlan(plan, spec)


def plan_context() -> tuple | None:
    """What besides a call's arguments decides whether it is planned and how (``plans.context``); None where no
    call is (the interpreter, ``compile_only``, plans off). A kept plan is replayed only while this is unchanged."""
    if interpreting() or compiling_only():
        return None
    return plans.context_if_enabled()


def _forward(q, k, v, spec: AttentionSpec, *, return_probs: bool = False):
    """Same contract as every path's forward (``flashattn.backends.Backend``): (out, lse, probs), keys dense,
    packed or cached. FP8 inputs (``spec.descale``): q, k and v all float8_e4m3fn on FP8 tensor cores are
    multiplied as they are (FlashAttention-3's FP8 forward, ``fp8_matmuls``): q's and k's descales scale the
    scores (``Descale.score_scales``) and P is rounded to FP8 for P V. Otherwise the kernel widens FP8 keys and
    values to q's 16-bit dtype tile by tile (``_attend`` in kernels/forward.py), k's descale folded into q
    (``Descale.folded_queries``). v's descale scales the fp32 output, rounded once."""
    scales = spec.descale
    rows = None if spec.varlen is None else spec.varlen.cu_seqlens_q  # a packed q: each row's sequence's scales
    interleaved = False
    if scales is not None and not fp8_matmuls(q, k, v, spec):
        q, spec = scales.folded_queries(q, rows), dataclasses.replace(spec, descale=None)
    elif scales is not None and spec.cache is None:  # a cache stays as it is: a decode step would copy it whole
        interleaved = spec.varlen is None  # packed sequences' groups would not start at their first keys
        v = interleaved_values(v) if interleaved else keys_contiguous(v)
    if k.dtype == torch.float8_e4m3fn and e4m3_as_bytes():
        k, v = k.view(torch.uint8), v.view(torch.uint8)  # widened by the kernel's integer code (tiles.widened)
    shape = CallShape(q, k, v, spec)
    out = empty(shape.out_shape, q.dtype if scales is None else torch.float32, q.device)
    lse = plans.scratch(torch.empty(spec.lse_shape(q.shape), dtype=torch.float32, device=q.device))
    probs = empty((shape.b, shape.h, shape.nq, shape.nk), q.dtype, q.device).zero_() if return_probs else q.new_empty(0)
    if out.numel() == 0 or shape.nq == 0 or shape.nk == 0:  # no key: out 0, lse -inf (the sink with one)
        lse.fill_(-math.inf)
        if spec.sink is not None:
            lse.copy_(spec.sink[:, None].expand_as(lse))
        out.zero_()
    else:
        _attend(q, k, v, (out, lse, probs if return_probs else None), spec, shape, values_interleaved=interleaved)
    out = as_dtype(out, q.dtype) if scales is None else scales.scale_values(out, output_dtype(q.dtype), rows)
    return out, lse, as_dtype(probs, q.dtype)


def keys_contiguous(v: torch.Tensor) -> torch.Tensor:
    """v (B, Nk, Hk, D), or packed (total, Hk, D), copied so that its keys are contiguous: the same tensor with
    other strides. An FP8 matmul takes its operands with the k dimension contiguous only, and P V's is the keys: one
    pass over v here spares the kernel a transpose through shared memory in every tile (sm_90: 64 STS and 64 PRMT
    a trip). A KV cache is left as it is (a decode step would copy the whole cache).

        >>> keys_contiguous(torch.zeros(2, 5, 3, 4)).stride()
        (60, 1, 20, 5)
    """
    order = (0, 2, 3, 1) if v.dim() == 4 else (1, 2, 0)
    return v.permute(order).contiguous().permute(tuple(order.index(i) for i in range(v.dim())))


VALUE_GROUP = 32  # kernels/tiles.py's: the keys an FP8 P V matmul step takes


def interleaved_values(v: torch.Tensor) -> torch.Tensor:
    """Dense v (B, Nk, Hk, D) copied as the FP8 matmul forward reads it (``VALUES_INTERLEAVED``): keys contiguous
    (as ``keys_contiguous``), zero keys appended up to whole groups of 32, and within each group key
    16h + 8g + 2c + l stored at 16h + 4c + 2g + l (h, g, l < 2, c < 4), the order in which the kernel hands P to
    the P V matmul without moving it between threads (``tiles.fp8_operand_order``). One pass over v,
    as ``keys_contiguous``; (B, Nk rounded up to 32, Hk, D) with keys contiguous.

        >>> v = torch.arange(40.0).view(1, 40, 1, 1)
        >>> interleaved_values(v)[0, :8, 0, 0].tolist()
        [0.0, 1.0, 8.0, 9.0, 2.0, 3.0, 10.0, 11.0]
        >>> interleaved_values(v).shape, interleaved_values(v)[0, 32:40, 0, 0].tolist()
        (torch.Size([1, 64, 1, 1]), [32.0, 33.0, 0.0, 0.0, 34.0, 35.0, 0.0, 0.0])
    """
    b, n, hk, d = v.shape
    whole, rest = divmod(n, VALUE_GROUP)
    groups = whole + (rest > 0)
    out = v.new_empty(b, hk, d, groups, 2, 4, 2, 2)  # (b, hk, d, group, h, c, g, l): keys last, in the kernel's order

    def place(keys: torch.Tensor, first: int) -> None:  # keys (b, whole groups, hk, d) from group ``first`` on
        count = keys.shape[1] // VALUE_GROUP
        grouped = keys.reshape(b, count, 2, 2, 4, 2, hk, d)  # (b, group, h, g, c, l, hk, d)
        out[:, :, :, first:first + count] = grouped.permute(0, 6, 7, 1, 2, 4, 3, 5)

    if whole:
        place(v[:, :whole * VALUE_GROUP], 0)
    if rest:  # the last group, completed with zero keys: one group's copy, not another pass over v
        tail = v.new_zeros(b, VALUE_GROUP, hk, d)
        tail[:, :rest] = v[:, whole * VALUE_GROUP:]
        place(tail, whole)
    return out.view(b, hk, d, groups * VALUE_GROUP).permute(0, 3, 1, 2)


NATIVE_E4M3 = 89  # the first NVIDIA architecture (Ada) Triton converts float8_e4m3fn on


def e4m3_as_bytes() -> bool:
    """Whether float8_e4m3fn keys and values reach the kernels as bytes, widened by integer code: NVIDIA GPUs
    before ``NATIVE_E4M3``, where Triton has no conversion for the type."""
    arch = target_arch()
    return isinstance(arch, int) and 0 < arch < NATIVE_E4M3


FP8_MATMUL_K = 32  # an FP8 tensor-core matmul's k step: the head dims and the key tiles must reach it
FP8_MATMUL_ARCH = 89  # Ada: the first NVIDIA GPUs with FP8 tensor cores


def fp8_matmuls(q, k, v, spec: AttentionSpec) -> bool:
    """Whether the forward multiplies FP8 q, k and v as they are, on FP8 tensor cores: all three float8_e4m3fn
    (e5m2 would round P to 2 mantissa bits), NVIDIA sm_89 or newer (or the interpreter), padded head dims and the
    forward's and decode's key tiles of ``FP8_MATMUL_K`` or more."""
    if not q.dtype == k.dtype == v.dtype == torch.float8_e4m3fn:
        return False
    arch = target_arch()
    if not interpreting() and (not isinstance(arch, int) or arch < FP8_MATMUL_ARCH):
        return False
    shape = CallShape(q, k, v, spec)
    if min(configs.padded_head_dim(shape.d), configs.padded_head_dim(shape.dv)) < FP8_MATMUL_K:
        return False
    heavy = spec.attn_mask is not None
    return all(config(kernel, q, shape, spec, heavy=heavy).block_n >= FP8_MATMUL_K for kernel in ("forward", "decode"))


def _attend(q, k, v, results, spec: AttentionSpec, shape: CallShape, *, values_interleaved: bool) -> None:
    """Launch the forward kernel writing ``results`` = (out, lse, probs) (with split-KV, through workspaces its last
    split's programs merge); ``values_interleaved``: v is ``interleaved_values``'s."""
    out, lse, probs = results
    if hopper.declines(q, k, v, spec, probs=probs is not None, values_interleaved=values_interleaved) is None:
        descale = None if spec.descale is None else spec.descale.score_scales()
        hopper.launch_forward(q, k, v, out, lse, spec, descale=descale)
        return
    plain = (spec.alibi_slopes is None and spec.attn_mask is None and spec.block_sparse is None and probs is None
             and spec.dropout_p == 0)
    rows = QueryRows(q, out, lse, shape, spec, plain=plain)
    # FP8 bytes widened by integer code (e4m3_as_bytes) hold more registers: the heavy weight's smaller tiles
    # (sm_80's 128 x 64 plain forward spilled 6 KB, its 64 x 32 heavy one none).
    heavy = spec.dropout_p > 0 or spec.attn_mask is not None or probs is not None or k.dtype == torch.uint8
    kernel = "decode" if rows.nq <= configs.DECODE_MAX_ROWS else "forward"

    def launch_forward(cfg: configs.KernelConfig) -> None:
        cfg = sparse_tiles(cfg, spec)
        splits, split_keys = split_count(shape, rows, cfg, q.device)
        grid = (-(-rows.nq // cfg.block_m) * shape.b * rows.h, 1, splits)
        targets, merged = (out, lse), None
        if splits > 1:
            # Partial results in fp32, laid out as the kernel walks the rows (the merge writes the real layout).
            batch, rows_total = (1, q.shape[0]) if shape.q_packed else (shape.b, rows.nq)
            targets = (plans.scratch(torch.empty(splits, batch, rows_total, rows.h, shape.dv, dtype=torch.float32,
                                                 device=q.device)),
                       plans.scratch(torch.empty(splits, batch, rows.h, rows_total, dtype=torch.float32,
                                                 device=q.device)))
            merged = (out, lse, plans.counters(tickets(q.device, grid[0]), grid[0]))
        kwargs = forward_kwargs(q, k, v, (*targets, probs), spec=rows.spec, shape=shape, rows=rows, cfg=cfg,
                                merged=merged)
        launch(attention_forward_kernel, grid, **kwargs, split_keys=split_keys, VALUES_INTERLEAVED=values_interleaved,
               BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    launch_fitting(config(kernel, q, shape, rows.spec, heavy=heavy), launch_forward, kernel=kernel,
                   what=_what(kernel, q, shape))


def _what(kernel: str, q: torch.Tensor, shape: CallShape) -> tuple:
    """What a kernel's shared memory depends on, as the launch guard remembers it (formatted only to log)."""
    return (kernel, q.dtype, shape.d, shape.dv, q.device)


FP8_BACKWARD_ENV = "FLASHATTN_FP8_BACKWARD"


def fp8_backward(q, k, v, spec: AttentionSpec) -> bool:
    """Whether the backward of e4m3 q, k, v (the FP8 training mode's, ``spec.descale`` their scales) runs S and dP
    on FP8 tensor cores (the kernels' FP8 mode, kernels/backward.py): asked for (``FLASHATTN_FP8_BACKWARD=1``),
    where the forward multiplies them so (``fp8_matmuls``), not through bytes. Opt-in until a GPU has timed it:
    compiled offline, its main loops are longer than the 16-bit backward's (the dO and q/k conversions)."""
    if os.environ.get(FP8_BACKWARD_ENV, "0").strip() != "1":
        return False
    return spec.descale is not None and fp8_matmuls(q, k, v, spec) and not e4m3_as_bytes()


@on_tensors_device
def backward(dout, dlse, saved: Saved, spec: AttentionSpec, *, mask_grad: bool = False):
    """Same contract as every path's backward; deterministic (no atomics) in every mode. ``mask_grad`` is never
    set: ``serves`` declines the calls that would need it. e4m3 q, k, v with ``spec.descale`` (``fp8_backward``):
    the gradients of attention at ``x.float() * descale``, in dout's dtype, dO rounded to e4m3 for dP."""
    if mask_grad:  # never asked for: serves() sends such calls to another path
        raise NotImplementedError("the triton path does not compute the gradient of attn_mask")
    planned = _backward_signature(dout, dlse, saved, spec)
    if planned is None:
        return _backward(dout, dlse, saved, spec)
    signature, inputs = planned
    dq, dk, dv = _BACKWARD_PLANS.run(signature, inputs, saved.q.device,
                                     lambda: _backward(dout, dlse, saved, spec)[:3])
    return dq, dk, dv, None


def _backward_signature(dout, dlse, saved: Saved, spec: AttentionSpec) -> tuple[tuple, tuple] | None:
    """(the backward plan's key, its inputs) for a call that goes through a plan, else None."""
    q, k, v, out, lse = saved
    if not _planned(spec, lse, dlse) or spec.descale is not None or q.numel() == 0 or k.numel() == 0:
        return None
    tensors, scalars = plans.spec_tensors(spec)
    inputs = (dout, dlse, q, k, v, out, lse, *tensors)
    return plans.key("backward", inputs, scalars), inputs


def _backward(dout, dlse, saved: Saved, spec: AttentionSpec):
    """``backward``'s full Python: the launches of one call, worked out from its arguments."""
    q, k, v, out, lse = saved
    fp8 = spec.descale is not None
    if fp8 and not fp8_backward(q, k, v, spec):
        raise NotImplementedError("the triton path's backward takes FP8 inputs on FP8 tensor cores only")
    # The kernels read lse and delta (allocated dense) at the same offsets: lse must be dense too (a block of a
    # longer sequence may hand over a slice of one).
    lse = lse.contiguous()
    shape = CallShape(q, k, v, spec)
    dtypes = [dout.dtype if fp8 else t.dtype for t in (q, k, v)]
    dq, dk, dv = (empty(t.shape, dtype, t.device) for t, dtype in zip((q, k, v), dtypes, strict=True))
    if q.numel() == 0 or k.numel() == 0 or shape.nq == 0 or shape.nk == 0:
        return (*(as_dtype(g.zero_(), dtype) for g, dtype in zip((dq, dk, dv), dtypes, strict=True)), None)
    # FP8: dO in e4m3 (written by the preprocess) with its descale per (sequence, head), for the kernels' dP.
    fp8_dout = (torch.empty(dout.shape, dtype=torch.float8_e4m3fn, device=dout.device),
                _dout_scales(dout, lse, spec)) if fp8 else None
    heavy = spec.dropout_p > 0 or spec.attn_mask is not None
    # The Hopper tier's one-pass backward (FLASHATTN_TRITON_TIER=hopper), else the portable kernels' one or two.
    tier = hopper.backward_declines(q, k, v, dout, spec) is None
    one_pass = tier or configs.one_pass_backward(
        target_arch(), deterministic=spec.deterministic, special=fp8 or spec.block_sparse is not None,
        entry=(configs.table_key(shape.d, shape.dv), weight_of(q, spec, heavy=heavy)))
    # One pass: dQ summed in fp32 with atomics, into dq itself where it is fp32, zeroed by the preprocess.
    dq_sum = None if not one_pass else dq if dq.dtype == torch.float32 else plans.scratch(
        torch.empty(dq.shape, dtype=torch.float32, device=dq.device))
    delta, neg_lse2 = _delta(dout, dlse, out, lse, packed=shape.q_packed, dims=(shape.d, shape.dv),
                             fp8_dout=fp8_dout, dq_sum=dq_sum)
    common = backward_kwargs(q, k, v, (dout, neg_lse2, delta, fp8_dout), spec=spec, shape=shape)

    def launch_dkdv(cfg: configs.KernelConfig) -> None:
        cfg = sparse_tiles(cfg, spec)
        if one_pass and cfg.split_d > 1:  # dQ's sums need each tile's dS once: one program per key block
            cfg = dataclasses.replace(cfg, split_d=1)
        launch(attention_backward_dkdv_kernel, (-(-shape.nk // cfg.block_n) * shape.b * shape.hk * cfg.split_d,),
               **common, blocks=sparse_blocks(spec, by_keys=True), dk=dk, dv=dv, **shape.strides("dk", dk),
               **shape.strides("dv", dv), num_heads_k=shape.hk, dq=dq_sum, **_dq_strides(dq_sum),
               **backward_descriptors(q, k, v, dout, shape=shape, blocks=(cfg.block_m, cfg.block_n),
                                      matmul_rows=cfg.block_n),
               BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT_D=cfg.split_d, num_warps=cfg.num_warps,
               num_stages=cfg.num_stages)

    def launch_dq(cfg: configs.KernelConfig) -> None:
        cfg = sparse_tiles(cfg, spec)
        launch(attention_backward_dq_kernel, (-(-shape.nq // cfg.block_m) * shape.b * shape.h,),
               **common, blocks=sparse_blocks(spec, by_keys=False), dq=dq, **shape.strides("dq", dq),
               **backward_descriptors(q, k, v, dout, shape=shape, blocks=(cfg.block_m, cfg.block_n),
                                      matmul_rows=cfg.block_m),
               BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    dkdv = "dkdv_one_pass" if one_pass else "dkdv"
    if tier:
        hopper.launch_backward(q, k, v, dout, (neg_lse2, delta), (dq_sum, dk, dv), spec)
    else:
        launch_fitting(config(dkdv, q, shape, spec, heavy=heavy), launch_dkdv, kernel=dkdv,
                       what=_what(dkdv, q, shape))
    if not one_pass:
        launch_fitting(config("dq", q, shape, spec, heavy=heavy), launch_dq, kernel="dq", what=_what("dq", q, shape))
    elif dq_sum is not dq:
        launch(attention_backward_dq_convert_kernel, (-(-dq.numel() // configs.CONVERT_BLOCK),), dq_sum=dq_sum,
               dq=dq, numel=dq.numel(), BLOCK=configs.CONVERT_BLOCK)
    return (*(as_dtype(g, dtype) for g, dtype in zip((dq, dk, dv), dtypes, strict=True)), None)


def _dout_scales(dout, lse, spec: AttentionSpec) -> torch.Tensor:
    """dO's descale per (sequence, query head), its amax / 448 (``quantize.amax_scales``), repeated to every row in
    lse's layout (dense), as the FP8 backward's kernels read it beside delta."""
    cu_seqlens = None if spec.varlen is None else spec.varlen.cu_seqlens_q
    scales = amax_scales(dout, heads_k=dout.shape[-2], cu_seqlens=cu_seqlens)
    rows = per_row(scales, dout, cu_seqlens)  # (B, 1, H, 1), or (total, H, 1) packed
    if spec.packed:
        return rows[:, :, 0].t().contiguous()
    return rows[:, 0, :, :].expand(lse.shape).contiguous()


def _dq_strides(dq_sum: torch.Tensor | None) -> dict:
    """The kernels' strides of the one-pass backward's dQ sums (q's shape; packed: no batch), None without them."""
    if dq_sum is None:
        return dict(stride_dqb=None, stride_dqn=None, stride_dqh=None, stride_dqd=None)
    return CallShape.strides("dq", dq_sum)


def _delta(dout, dlse, out, lse, *, packed: bool, dims: tuple[int, int], fp8_dout: tuple | None = None,
           dq_sum: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(delta, neg_lse2) in lse's layout (dense): delta_i = rowsum(dO_i * O_i) - dlse_i, and -lse in log2 units as
    the backward kernels read it (``attention_backward_preprocess_kernel``). With ``fp8_dout`` = (dout8, its
    descale in lse's layout), dO is quantized into dout8 and delta taken from it, as the FP8 backward's dP sees it.
    A packed varlen batch is one long sequence to it. ``dq_sum`` (the one-pass backward's fp32 dQ, q's shape, dense)
    is zeroed by the same launch. ``dims``: q's and v's head dims."""
    dout8, do_descale = fp8_dout if fp8_dout is not None else (None, None)
    d, dv = dims
    delta, neg_lse2 = plans.scratch(torch.empty_like(lse)), plans.scratch(torch.empty_like(lse))
    dense = (lambda t: t[None]) if packed else (lambda t: t)
    out4, dout4 = dense(out), dense(dout)
    rows, heads = out4.shape[1], out4.shape[2]
    launch(
        attention_backward_preprocess_kernel, (-(-rows // configs.PREPROCESS_BLOCK_M) * out4.shape[0] * heads,),
        out=out4, dout=dout4,
        # dlse is read as a dense array; it is small, and autograd may hand it over expanded.
        dlse=None if dlse is None else dense(dlse.contiguous()), lse=dense(lse), delta=dense(delta),
        neg_lse2=dense(neg_lse2), do_descale=None if do_descale is None else dense(do_descale), dout8=dout8,
        **fp8_dout_strides(dout8), dq=None if dq_sum is None else dense(dq_sum),
        **_dq_strides(None if dq_sum is None else dense(dq_sum)),
        **CallShape.strides("o", out4, "bnhd"), **CallShape.strides("do", dout4, "bnhd"),
        num_heads=heads, seqlen_q=rows, head_dim=d, head_dim_v=dv,
        BLOCK_M=configs.PREPROCESS_BLOCK_M, BLOCK_D=configs.padded_head_dim(d), BLOCK_DV=configs.padded_head_dim(dv),
        UPCAST=interpreting() and dout.dtype != torch.float32,
    )
    return delta, neg_lse2
