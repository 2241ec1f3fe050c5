"""How a call becomes kernel arguments: shapes, strides and options by name, one dict per launch.

Every argument of a kernel is named here exactly once (``forward_kwargs``, ``backward_kwargs``); strides come
from ``Layout.strides(name, tensor)`` as ``stride_<name><dim>``; an absent feature is None, which the kernels
compile out.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import NamedTuple

import torch

from ...errors import ArgumentError
from ..masking import kernel_side
from ..memo import PerTensor
from ..spec import AttentionSpec, BlockSparse, cache_launch_keys
from . import configs, interpreting, plans, stubbed_device, tma
from .kernels import BlockLists


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


GRID_LIMITS = (2**31 - 1, 65535, 65535)  # CUDA's programs per grid axis


def launch(kernel, grid: tuple[int, ...], **kwargs) -> None:
    """``kernel[grid](**kwargs)``, or, inside ``compile_only``, its compilation. A grid past CUDA's limits is a
    ValueError (and RuntimeError) here, not a launch failure that poisons the CUDA context."""
    if any(n > limit for n, limit in zip(grid, GRID_LIMITS, strict=False)):
        raise ArgumentError(f"{kernel.fn.__name__}: grid {grid} exceeds CUDA's {GRID_LIMITS} programs per axis; "
                            "split the batch into smaller calls")
    # Fused multiply-adds, said explicitly: Triton 3.9 warns that its default turns them off in 3.10, and the
    # configs were chosen (and their health checked) with them on.
    kwargs = {**kwargs, "enable_fp_fusion": True}
    recorded = _compile_only.get()
    if recorded is None:
        compiled = kernel[grid](**kwargs)  # Triton raises OutOfResources before running if the GPU lacks the shared
        plans.record(kernel, compiled, grid, kwargs)  # memory; a launch plan in the making keeps the launch
        return
    compiled = kernel.warmup(grid=grid, **kwargs)
    _check_shared_memory(compiled)
    recorded.append(Compiled(kernel.fn.__name__, grid, kwargs, compiled))


def _check_shared_memory(compiled) -> None:
    """Triton's check at a kernel's first launch, for the offline device of ``compile_only``."""
    from triton.runtime import driver
    from triton.runtime.errors import OutOfResources

    limit = driver.active.utils.get_device_properties(driver.active.get_current_device())["max_shared_mem"]
    if compiled.metadata.shared > limit:
        raise OutOfResources(compiled.metadata.shared, limit, "shared memory")


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer. The interpreter converts fp32 to bf16 by truncation (the GPU rounds to nearest), so
    there bf16 outputs are written in fp32 and rounded by torch in ``as_dtype``."""
    if dtype == torch.bfloat16 and interpreting():
        dtype = torch.float32
    return plans.scratch(torch.empty(shape, dtype=dtype, device=device))


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


class CallShape:
    """Shapes and strides of one call as the kernels take them.

    q is dense (B, Nq, H, D) or packed varlen (total_q, H, D). Keys are dense (B, Nk, Hk, D), packed varlen
    (total_k, Hk, D), or a KV cache (``spec.cache``: dense or paged). ``nq``/``nk`` are the dense lengths or the
    maxima: they size the grid and lay out the dropout counters and the probabilities (lse and delta follow
    ``AttentionSpec.lse_shape``). ``keys`` are the forward kernel's arguments that say
    where each sequence's keys are (None where the call has no such thing).
    """

    def __init__(self, q, k, v, spec: AttentionSpec):
        self.h, self.d = q.shape[-2], q.shape[-1]
        self.hk, self.dv = k.shape[-2], v.shape[-1]
        self.q_packed = spec.packed
        varlen, cache = spec.varlen, spec.cache
        if self.q_packed:
            self.b, self.nq = varlen.batch, varlen.max_seqlen_q
        else:
            self.b, self.nq = q.shape[0], q.shape[1]
        self.out_shape = (*q.shape[:-1], self.dv)
        self.cu_seqlens_q = varlen.cu_seqlens_q if self.q_packed else None
        # Keys from a cache are found through its bounds, not the varlen key offsets (paged varlen has both).
        self.cu_seqlens_k = varlen.cu_seqlens_k if self.q_packed and cache is None else None
        self.keys = dict(cu_seqlens_k=self.cu_seqlens_k, k_start=None, k_end=None, k_batch=None, block_table=None,
                         stride_bt=None, page_size=None, cache_entries=k.shape[0])
        # The kernels clamp the offsets and cache bounds they read to these (``tiles.sequence``).
        self.rows_q, self.rows_k = q.shape[0], k.shape[0]  # packed rows; a cache's: its positions per entry
        if cache is not None:
            self.rows_k = k.shape[1] * (cache.block_table.shape[1] if cache.block_table is not None else 1)
            self.nk = cache_keys(cache.max_seqlen_k, k, cache.block_table)
            self.keys.update(k_start=cache.k_start, k_end=cache.k_end, k_batch=cache.batch_idx)
            if cache.block_table is not None:
                self.keys.update(block_table=cache.block_table, stride_bt=cache.block_table.stride(0),
                                 page_size=k.shape[1])
        else:
            self.nk = varlen.max_seqlen_k if self.q_packed else k.shape[1]

    @staticmethod
    def strides(name: str, t: torch.Tensor, dims: str = "bnhd") -> dict[str, int]:
        """``{"stride_<name><dim>": stride}``; a tensor with fewer dims than ``dims`` (packed: no batch) gets
        stride 0 in the leading ones."""
        strides = (0,) * (len(dims) - t.dim()) + tuple(t.stride())
        return {f"stride_{name}{dim}": s for dim, s in zip(dims, strides, strict=True)}

    def lse_strides(self, lse: torch.Tensor, name: str = "l") -> dict[str, int]:
        """(batch, head) strides of lse or delta; query positions have unit stride."""
        b, h = (0, lse.stride(0)) if self.q_packed else (lse.stride(0), lse.stride(1))
        return {f"stride_{name}b": b, f"stride_{name}h": h}


def cache_keys(longest: int, k: torch.Tensor, block_table: torch.Tensor | None) -> int:
    """``spec.cache_launch_keys`` for the cache ``k`` (dense, or paged through ``block_table``)."""
    return cache_launch_keys(longest, k.shape[1] * (block_table.shape[1] if block_table is not None else 1))


class QueryRows:
    """How the forward kernel walks the queries: heads, group size, rows per head, and the strides of q, out
    (batch, row, head, dim) and lse (batch, head; rows have unit stride), by kernel argument name.

    A decode step (one query per head) with GQA is walked with the G query heads of a key/value head as G rows
    of one head (flash_attn's "seqlen-ngroups swap"): the program loads each K/V tile once for the whole group
    instead of G times, and the tensor-core tile is G rows instead of 1 row padded to BLOCK_M. It is only a
    change of strides, valid when nothing depends on the query position (no left window, no ALiBi, no dropout or
    mask); a right window or causal mask is void for one bottom-right-aligned query.
    """

    def __init__(self, q, out, lse, shape: CallShape, spec: AttentionSpec, *, plain: bool):
        g = shape.h // shape.hk
        self.spec = spec
        self.swapped = (plain and not shape.q_packed and shape.nq == 1 and g > 1 and spec.window_left < 0
                        and spec.diagonal_offset == 0 and (spec.bottom_right or spec.window_right < 0))
        if not self.swapped:
            self.h, self.g, self.nq = shape.h, g, shape.nq
            self.q, self.out = CallShape.strides("q", q), CallShape.strides("o", out)
            self.lse = shape.lse_strides(lse)
            return
        self.spec = dataclasses.replace(spec, window_left=-1, window_right=-1)
        self.h, self.g, self.nq = shape.hk, 1, g
        (qb, _, qh, qd), (ob, _, oh, od) = q.stride(), out.stride()
        self.q = {"stride_qb": qb, "stride_qn": qh, "stride_qh": g * qh, "stride_qd": qd}
        self.out = {"stride_ob": ob, "stride_on": oh, "stride_oh": g * oh, "stride_od": od}
        # lse (B, H, 1): head h = kv head * G + row.
        self.lse = {"stride_lb": lse.stride(0), "stride_lh": g * lse.stride(1)}

    def sink(self, sink: torch.Tensor | None) -> dict:
        """The sink logits (H,) and how a program finds its rows' (head h, row m: h * stride_sh + m * stride_sm;
        swapped, the rows are the group's query heads)."""
        return {"sink": sink, "stride_sh": self.nq if self.swapped else 1, "stride_sm": 1 if self.swapped else 0}


def target_arch() -> int | str:
    """The architecture Triton compiles for (the offline target under ``compile_only``): 10 x major + minor on
    NVIDIA, the gfx name on AMD ("gfx942"); 0 under the interpreter or on another backend."""
    if interpreting():
        return 0
    from triton.runtime import driver  # at call time: the active driver is the GPU's, or the offline one

    target = driver.active.get_current_target()
    if target.backend == "hip":
        return str(target.arch).split(":")[0]  # "gfx942:sramecc+:xnack-" names its features after the chip
    return int(target.arch) if target.backend == "cuda" else 0


def config(kernel: str, q: torch.Tensor, shape: CallShape, spec: AttentionSpec, *,
           heavy: bool) -> configs.KernelConfig:
    """The tile of ``kernel`` (a ``configs.KERNELS`` name) for this call: ``configs.use``'s if forced, small
    square tiles under the interpreter, else the target family's entry for the call's weight: "heavy" with dropout
    or a mask tile, "plain" when the scores need no softcap or ALiBi (``plain_scores``), else "light"; fp32 inputs
    have their own two."""
    forced = configs.forced(kernel)
    if forced is not None:
        return forced
    if interpreting():
        return configs.INTERPRETER
    # Measured entries time 16-bit q, k and v: FP8 inputs hold other registers and shared memory.
    return configs.lookup(kernel, target_arch(), configs.table_key(shape.d, shape.dv), weight_of(q, spec, heavy=heavy),
                          block_mask=spec.block_sparse is not None,
                          measured=takes_measured(spec) and q.dtype.itemsize == 2)


def weight_of(q: torch.Tensor, spec: AttentionSpec, *, heavy: bool) -> str:
    """The table weight of a call (``configs.WEIGHTS``), as ``config`` describes it."""
    if q.dtype == torch.float32:
        return "fp32-heavy" if heavy else "fp32-light"
    return "heavy" if heavy else "plain" if plain_scores(spec) else "light"


def takes_measured(spec: AttentionSpec) -> bool:
    """Whether a call may take its family's measured config (``configs.lookup``): the tuning sweep times q, k and v
    dense, and packed sequences or a KV cache compile to other loops."""
    return spec.varlen is None and spec.cache is None


@functools.lru_cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs one program at a time
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_count(shape: CallShape, rows: QueryRows, cfg: configs.KernelConfig,
                device: torch.device) -> tuple[int, int]:
    """(splits, keys per split) of the forward launch: ``spec.cache.num_splits``, or the heuristic for 0."""
    cache = rows.spec.cache
    requested = cache.num_splits if cache is not None else 1
    key_blocks = -(-shape.nk // cfg.block_n)
    if requested == 0:
        programs = shape.b * rows.h * -(-rows.nq // cfg.block_m)
        stubbed = stubbed_device()  # CPU tensors standing for a GPU's
        multiprocessors = stubbed.multiprocessors if stubbed is not None else _multiprocessors(device)
        requested = configs.split_heuristic(programs, multiprocessors, key_blocks)
    splits = max(1, min(requested, key_blocks))
    split_keys = -(-key_blocks // splits) * cfg.block_n
    return -(-shape.nk // split_keys), split_keys  # no split left without keys


def _options(spec: AttentionSpec, shape: CallShape) -> dict:
    """The scalar options by kernel argument name; a window side or softcap that is off (a side past every key
    too: ``masking.kernel_side``) is None."""
    left, right = (kernel_side(side, nq=shape.nq, nk=shape.nk, diagonal_offset=spec.diagonal_offset)
                   for side in (spec.window_left, spec.window_right))
    return dict(
        bottom_right=int(spec.bottom_right), diagonal_offset=spec.diagonal_offset,
        window_left=left if left >= 0 else None, window_right=right if right >= 0 else None,
        scale=spec.scale, softcap=spec.softcap if spec.softcap > 0 else None, dropout_p=spec.dropout_p,
    )


def _optional_tensors(spec: AttentionSpec) -> dict:
    """ALiBi slopes, the user mask and the dropout seed, None where absent, with the strides of the first two
    (broadcast dimensions get stride 0, so the kernel reads the same element for every index); a boolean mask
    is read as uint8."""
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


def sparse_blocks(spec: AttentionSpec, *, by_keys: bool) -> BlockLists | None:
    """A block mask as the kernels walk it (``bundles.BlockLists``), or None without one: per query block the full
    and the partial key blocks (forward, dQ), or with ``by_keys`` per key block the query blocks (dK/dV), as counts
    and index lists, with the partial blocks' ids and element masks. Broadcast batch or head dims get stride 0.
    Kept per tile map (``PerTensor``): the layers sharing a mask, and a forward and its dQ, build the lists once."""
    blocks = spec.block_sparse
    if blocks is None:
        return None
    return _SPARSE_LISTS.get(blocks.tile_kind, by_keys, lambda: _sparse_lists(blocks, by_keys))


_SPARSE_LISTS = PerTensor()


def _sparse_lists(blocks: BlockSparse, by_keys: bool) -> BlockLists:
    kind = blocks.tile_kind.transpose(-1, -2) if by_keys else blocks.tile_kind
    lists = []
    for value in (2, 1):  # full, partial
        listed = kind == value
        # A stable sort puts the listed blocks first, in order: the first `count` entries are the list.
        order = torch.argsort((~listed).to(torch.int8), dim=-1, stable=True).to(torch.int32).contiguous()
        lists += [listed.sum(-1, dtype=torch.int32).contiguous(), order]  # the kernels step lists by 1
    counts, index = lists[0], lists[1]

    def strides(t: torch.Tensor, dims: int) -> tuple[int, ...]:
        return tuple(0 if n == 1 and d < 2 else st for d, (n, st) in enumerate(zip(t.shape[:dims], t.stride()[:dims],
                                                                                  strict=True)))

    ids = blocks.partial_id
    return BlockLists(*lists, ids, blocks.partial_masks.view(torch.uint8), *strides(counts, 3), *strides(index, 3),
                      *strides(ids, 4), blocks.q_block, blocks.kv_block)


def sparse_tiles(cfg: configs.KernelConfig, spec: AttentionSpec) -> configs.KernelConfig:
    """The config with tiles that divide a block mask's blocks (a kernel tile never straddles two mask blocks)."""
    blocks = spec.block_sparse
    if blocks is None:
        return cfg
    return dataclasses.replace(cfg, block_m=math.gcd(cfg.block_m, blocks.q_block),
                               block_n=math.gcd(cfg.block_n, blocks.kv_block))


def _sizes(q, shape: CallShape, rows: QueryRows | None = None) -> dict:
    """The sizes by kernel argument name: with ``rows``, the queries as the forward kernel walks them."""
    return dict(num_heads=rows.h if rows else shape.h, group_size=rows.g if rows else shape.h // shape.hk,
                seqlen_q=rows.nq if rows else shape.nq, seqlen_k=shape.nk, rows_q=shape.rows_q, rows_k=shape.rows_k,
                head_dim=shape.d, head_dim_v=shape.dv,
                BLOCK_D=configs.padded_head_dim(shape.d), BLOCK_DV=configs.padded_head_dim(shape.dv),
                # The interpreter's tl.dot is wrong on bf16 (and fp16 is slow there): compute in fp32.
                UPCAST=interpreting() and q.dtype != torch.float32)


def forward_kwargs(q, k, v, targets, *, spec: AttentionSpec, shape: CallShape, rows: QueryRows,  # noqa: PLR0913
                   cfg: configs.KernelConfig, merged: tuple | None = None) -> dict:  # (keywords after targets)
    """Every argument of ``attention_forward_kernel`` but the tile sizes and ``split_keys``. ``targets`` = (out,
    lse, probs or None) with split stride 0; or, for a split-KV launch, the split workspaces (splits, batch, rows,
    heads, dv) and (splits, batch, heads, rows), whose batch stride is 0 for a packed q (rows are found through the
    offsets), and ``merged`` = (out, lse, the ``tickets`` counters) that the last split of each query block merges
    them into. FP8 q and k multiplied as they are keep ``spec.descale``: the kernel scales their scores."""
    out, lse, probs = targets
    merged_out, merged_lse, counters = (None, None, None) if merged is None else merged
    merged_strides = dict.fromkeys(("stride_mob", "stride_mon", "stride_moh", "stride_mod", "stride_mlb",
                                    "stride_mlh"), 0)
    if merged is not None:
        out_strides = CallShape.strides("o", out, "sbnhd")
        lse_strides = dict(zip(("stride_ls", "stride_lb", "stride_lh"), lse.stride()[:3], strict=True))
        if shape.q_packed:
            out_strides["stride_ob"] = lse_strides["stride_lb"] = 0
        merged_strides = {**{name.replace("stride_o", "stride_mo"): n for name, n in rows.out.items()},
                          **{name.replace("stride_l", "stride_ml"): n for name, n in rows.lse.items()}}
        if shape.q_packed:
            merged_strides["stride_mob"] = 0
    else:
        out_strides, lse_strides = {"stride_os": 0, **rows.out}, {"stride_ls": 0, **rows.lse}
    return dict(
        q=q, k=k, v=v, out=out, lse=lse, probs=probs, cu_seqlens_q=shape.cu_seqlens_q, **shape.keys,
        merged_out=merged_out, merged_lse=merged_lse, tickets=counters, **merged_strides,
        descale=None if spec.descale is None else spec.descale.score_scales(),
        **rows.sink(spec.sink), blocks=sparse_blocks(spec, by_keys=False),
        **rows.q, **CallShape.strides("k", k), **CallShape.strides("v", v), **out_strides, **lse_strides,
        **_optional_tensors(spec), **_options(spec, shape), **_sizes(q, shape, rows), PLAIN=plain_scores(spec),
        **_descriptors(q, k, v, shape=shape, rows=rows, blocks=(cfg.block_m, cfg.block_n)),
    )


def _descriptors(q, k, v, *, shape: CallShape, rows: QueryRows, blocks: tuple[int, int]) -> dict:
    """TMA descriptors of the forward's q, k and v (paged keys are gathered page by page: none for k, v)."""
    q_rows = (1, q.shape[0]) if shape.q_packed else (shape.b, rows.nq)
    wanted = {"q": (q, tuple(rows.q.values()), (*q_rows, rows.h, shape.d), blocks[0])}
    if shape.keys["block_table"] is None:
        wanted["k"] = (k, tuple(CallShape.strides("k", k).values()), (*_key_rows(k), shape.hk, shape.d), blocks[1])
        wanted["v"] = (v, tuple(CallShape.strides("v", v).values()), (*_key_rows(v), shape.hk, shape.dv), blocks[1])
    return {**tma.kernel_args("k", None), **tma.kernel_args("v", None), **descriptor_args(shape, wanted)}


def _key_rows(t: torch.Tensor) -> tuple[int, int]:
    """(batches, rows per batch) of keys or values: a packed (total, heads, dim) tensor is one batch."""
    return (1, t.shape[0]) if t.dim() == 3 else tuple(t.shape[:2])


def descriptor_args(shape: CallShape, wanted: dict, *, matmul_rows: int = tma.WGMMA_ROWS) -> dict:
    """``{name}_desc``/``{name}_tma`` kernel arguments for each ``wanted`` name -> (tensor, (batch, row, head, dim)
    strides, (batches, rows, heads, dim) sizes, tile rows): descriptors where the target has TMA, the program's
    matmuls have ``matmul_rows`` for wgmma and the layout allows (``tma.py``), None (pointer loads) elsewhere."""
    use = tma.enabled(target_arch(), matmul_rows=matmul_rows)
    args = {}
    for name, (t, strides, sizes, tile_rows) in wanted.items():
        found = tma.view(t, strides, sizes, (tile_rows, configs.padded_head_dim(sizes[3]))) if use else None
        args.update(tma.kernel_args(name, found))
    return args


def backward_descriptors(q, k, v, dout, *, shape: CallShape, blocks: tuple[int, int], matmul_rows: int) -> dict:
    """TMA descriptors of the backward's q, dO (tiles of ``blocks[0]`` rows) and k, v (``blocks[1]`` rows), for a
    kernel whose matmuls have ``matmul_rows`` rows (dK/dV: its keys, dQ: its queries)."""
    q_rows = (1, q.shape[0]) if shape.q_packed else (shape.b, shape.nq)
    return descriptor_args(shape, matmul_rows=matmul_rows, wanted={
        "q": (q, tuple(CallShape.strides("q", q).values()), (*q_rows, shape.h, shape.d), blocks[0]),
        "do": (dout, tuple(CallShape.strides("do", dout).values()), (*q_rows, shape.h, shape.dv), blocks[0]),
        "k": (k, tuple(CallShape.strides("k", k).values()), (*_key_rows(k), shape.hk, shape.d), blocks[1]),
        "v": (v, tuple(CallShape.strides("v", v).values()), (*_key_rows(v), shape.hk, shape.dv), blocks[1]),
    })


def fp8_dout_strides(dout8: torch.Tensor | None) -> dict:
    """The strides of the FP8 backward's e4m3 dO (B, Nq, H, Dv), or packed (total_q, H, Dv) whose rows the kernels
    find through the offsets (batch stride 0, as ``CallShape.strides`` gives dO's), by kernel argument name; None
    without one (compiled out: the 16-bit kernels keep the arguments, and the registers, they had)."""
    if dout8 is None:
        return dict(stride_d8b=None, stride_d8n=None, stride_d8h=None)
    batch = dout8.stride(0) if dout8.dim() == 4 else 0
    return dict(stride_d8b=batch, stride_d8n=dout8.stride(-3), stride_d8h=dout8.stride(-2))


def plain_scores(spec: AttentionSpec) -> bool:
    """No softcap, ALiBi or user mask, and a positive scale: the kernels fold the scale into the exponent."""
    return spec.scale > 0 and spec.softcap <= 0 and spec.alibi_slopes is None and spec.attn_mask is None


def backward_kwargs(q, k, v, stats, *, spec: AttentionSpec, shape: CallShape) -> dict:
    """The arguments the dK/dV and dQ kernels share; ``stats`` = (dout, neg_lse2, delta, fp8_dout), neg_lse2 and
    delta in lse's layout (``attend._delta``); fp8_dout None unless q, k, v are the FP8 training mode's (whose
    ``spec.descale`` the kernels read as one (B, Hk, 3) array): (dO in e4m3, its descale in lse's layout)."""
    dout, neg_lse2, delta, fp8_dout = stats
    scales = spec.descale
    dout8, do_descale = fp8_dout if fp8_dout is not None else (None, None)
    return dict(
        descale=None if scales is None else torch.stack((scales.q, scales.k, scales.v), dim=-1).float().contiguous(),
        do_descale=do_descale, dout8=dout8, **fp8_dout_strides(dout8),
        q=q, k=k, v=v, dout=dout, neg_lse2=neg_lse2, delta=delta, cu_seqlens_q=shape.cu_seqlens_q,
        cu_seqlens_k=shape.cu_seqlens_k, **CallShape.strides("q", q), **CallShape.strides("k", k),
        **CallShape.strides("v", v), **CallShape.strides("do", dout), **shape.lse_strides(neg_lse2),
        **_optional_tensors(spec), **_options(spec, shape), **_sizes(q, shape), PLAIN=plain_scores(spec),
    )
