"""The ``cpu`` path: the C++ kernel (``flashattn/csrc/cpu_flash.cpp`` and its headers, built at first use by
``cpu_build``), FlashAttention-2 forward and backward for CPU tensors.

Why C++: the tiled ``torch`` path issues a dozen torch ops per tile, each its own parallel region that waits for its
slowest thread, so a busy machine slows it several times over. The kernel runs one parallel region per call whose
threads pull tasks (sequence, kv head, query block) longest first, so a thread slowed by another process simply takes
fewer; each task runs its whole key loop with its tiles in cache, the two products of a tile and the online
softmax, softcap, ALiBi, masks and dropout (Triton's Philox, bit for bit) fused in one vectorised pass. The products
of bf16 (and, with AMX-FP16, fp16) tiles run on the CPU's dot-product instructions where ``cpu_tiles`` finds them,
else on fp32 copies of the tiles and the BLAS torch ships. The backward gives each task the dQ of its rows and its
own dK/dV partial: no atomics, deterministic.

What it serves (``serves``): every dense, packed (varlen) and KV-cache call (dense or paged pages of any size; a
cache's key range split among the threads only when they would otherwise idle) in fp16, bf16, fp32 (fp32
accumulation) and fp64, with
causal or window bands at any alignment, softcap, ALiBi, learnable sinks, GQA/MQA without copies, SDPA boolean and
additive masks (with their gradient), block masks, dropout and a gradient flowing into the log-sum-exp. Returned
probabilities (a testing aid) are the ``torch`` path's. Short query blocks (decode) pack the query heads of a kv head
into one tile, so the group shares each K/V tile, and take every kv head and a piece of a long cache per task.
"""

from __future__ import annotations

import functools
from array import array

import torch

from . import cpu_build, cpu_tiles
from .environ import Variable
from .masking import kernel_side, sum_to_shape
from .request import Request
from .spec import FP8_DTYPES, AttentionSpec, Saved, accumulation_dtype, output_dtype

NAME = "cpu"
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Query rows x keys of a task's tile, measured on 2 cores (fp32 and bf16, d = 64 and 128, N = 1k..4k, best of
# 64..256 x 128..512, benchmarks/NOTES.md): the forward gains from tall tiles (the BLAS packs each K/V tile once per
# query block), the backward hardly cares and keeps its four tile-sized buffers smaller.
FORWARD_TILE = (256, 256)
BACKWARD_TILE = (128, 128)


def serves(request: Request) -> str | None:
    """CPU tensors of a float dtype, once the kernel is built (the first call builds it), every feature but
    returned probabilities."""
    if request.device != "cpu":
        return f"it runs on CPU tensors, got {request.device} tensors"
    if request.dtype not in DTYPES and request.dtype not in FP8_DTYPES:
        return f"it takes float16, bfloat16, float32, float64 and FP8, got {request.dtype}"
    if request.uses("return_attn_probs"):
        return "it does not return the probabilities (return_attn_probs with dropout, a testing aid)"
    built, why = cpu_build.status()
    return None if built else f"its C++ kernel is not available ({why})"


def _sequences(q, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(seqs (S, 7) int64: q batch, q start, nq, k batch, k start, nk, diagonal per sequence; the page table or
    None), for varlen and KV-cache calls (the kernel derives a dense batch's itself). One host read of the
    offsets, as the tiled path's ``bounds()``."""
    if spec.packed:
        queries = [(0, sq, eq - sq) for sq, eq, _, _ in spec.varlen.bounds()]
    else:
        queries = [(b, 0, q.shape[1]) for b in range(q.shape[0])]
    cache = spec.cache
    if cache is not None:
        entries = range(len(queries)) if cache.batch_idx is None else cache.batch_idx.tolist()
        keys = [(kb, start, end - start) for kb, (start, end) in zip(entries, cache.bounds(), strict=True)]
    else:  # packed: a dense batch never comes here
        keys = [(0, sk, ek - sk) for _, _, sk, ek in spec.varlen.bounds()]
    rows = [(*qs, *ks, spec.band(qs[2], ks[2]).diagonal) for qs, ks in zip(queries, keys, strict=True)]
    seqs = torch.tensor(rows, dtype=torch.long).view(-1, 7)
    return seqs, None if cache is None else cache.block_table


def _options(q, k, spec: AttentionSpec, *, tile: tuple[int, int], tiles: str) -> dict:
    """The kernel's keyword options (the operators' schema in ``cpu_flash.cpp``) for this call."""
    if spec.packed or spec.cache is not None:
        seqs, table = _sequences(q, spec)
        diagonal = 0
    else:
        seqs, table, diagonal = None, None, spec.band(q.shape[1], k.shape[1]).diagonal
    # Every row of q and k as an upper bound of any sequence's length (dense, packed or paged alike).
    rows = (t.numel() // max(t.shape[-1] * t.shape[-2], 1) for t in (q, k))
    reach = dict(zip(("nq", "nk"), rows, strict=True), diagonal_offset=spec.diagonal_offset)
    left, right = (kernel_side(side, **reach) for side in (spec.window_left, spec.window_right))
    options = {"seqs": seqs, "block_table": table, "diagonal": diagonal, "scale": float(spec.scale),
               "softcap": float(spec.softcap), "left": int(left), "right": int(right), "block_m": tile[0],
               "block_n": tile[1], "alibi": spec.alibi_slopes, "sink": spec.sink, "dropout_p": float(spec.dropout_p),
               "seed": 0, "counter_rows": 0, "counter_cols": 0, "mask": None, "tile_kind": None, "partial_id": None,
               "partial_masks": None, "tiles": tiles}
    if spec.dropout_p > 0:
        rows, cols = ((spec.varlen.max_seqlen_q, spec.varlen.max_seqlen_k) if spec.packed
                      else (q.shape[1], k.shape[1]))
        options.update(seed=int(spec.seed.item()), counter_rows=int(rows), counter_cols=int(cols))
    blocks = spec.block_sparse
    if blocks is not None:  # the tiles are the block mask's
        options.update(tile_kind=blocks.tile_kind, partial_id=blocks.partial_id, partial_masks=blocks.partial_masks,
                       block_m=blocks.q_block, block_n=blocks.kv_block)
    mask = spec.attn_mask
    if mask is not None:  # (B|1, H|1, Nq|1, Nk|1) -> a (B, H, Nq, Nk) view; additive masks in the accumulation type
        if mask.dtype != torch.bool:
            mask = mask.to(accumulation_dtype(q.dtype))
        options["mask"] = mask.expand(q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    return options


def _as_batch(t: torch.Tensor, spec: AttentionSpec, *, keys: bool) -> torch.Tensor:
    """Packed (total, H, D) tensors as a batch of one (1, total, H, D); KV caches are already 4-D."""
    return t[None] if spec.packed and not (keys and spec.cache is not None) else t


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """The kernel reads rows through strides with a unit last one (views of longer sequences are fine): a head
    dim with a stride (SDPA accepts any strides) is copied."""
    return t if t.stride(-1) == 1 else t.contiguous()


def forward(q, k, v, spec: AttentionSpec, *, return_probs: bool = False):
    """(out, lse, an empty tensor), as every path returns them: out (B, Nq, H, Dv) in q's dtype and lse
    (``spec.lse_shape``) in the accumulation dtype, from dense, packed (varlen) or cached keys. ``serves`` refuses
    ``return_probs``.

    Example (where the kernel is built: ``serves`` says so; tests/test_cpu_kernel.py runs it)::

        >>> q = k = v = torch.randn(1, 5, 2, 8)
        >>> out, lse, _ = forward(q, k, v, AttentionSpec(scale=8 ** -0.5))  # doctest: +SKIP
        >>> out.shape, lse.shape  # doctest: +SKIP
        (torch.Size([1, 5, 2, 8]), torch.Size([1, 2, 5]))
    """
    q, k, v = (_unit_stride(t) for t in (q, k, v))
    lse = torch.empty(spec.lse_shape(q.shape), dtype=accumulation_dtype(q.dtype))
    fp8 = {}
    if spec.descale is not None:  # q's and k's descales scale the scores, v's each output row, in the kernel
        fp8 = {"v_descale": spec.descale.v, "qk_descale": spec.descale.score_scales()}
        if q.dtype in FP8_DTYPES:
            q = _widened(q, output_dtype(q.dtype))
        if _widened_once(q, k, spec):
            k, v = _widened(k, q.dtype), _widened(v, q.dtype)
        else:  # as bytes, widened tile by tile (kv_format: 1 e4m3fn, 2 e5m2)
            fp8["kv_format"] = 1 if k.dtype == torch.float8_e4m3fn else 2
            k, v = k.view(torch.uint8), v.view(torch.uint8)
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    q4, k4, v4 = _as_batch(q, spec, keys=False), _as_batch(k, spec, keys=True), _as_batch(v, spec, keys=True)
    cpu_build.module().forward(q4, k4, v4, _as_batch(out, spec, keys=False), lse[None] if spec.packed else lse,
                               **_options(q4, k4, spec, tile=FORWARD_TILE, tiles=_forward_tiles(q, k, spec)), **fp8)
    return out, lse, q.new_empty(0)


def _forward_tiles(q, k, spec: AttentionSpec) -> str:
    """The kernel's ``tiles`` for a forward: by its query rows per kv head (``cpu_tiles.choose_forward``)."""
    rows = spec.varlen.max_seqlen_q if spec.packed else q.shape[-3]
    return cpu_tiles.choose_forward(q.dtype, rows * (q.shape[-2] // k.shape[-2]))


def _widened(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 ``x`` in ``dtype``, exactly, by the C++ kernel's vectorised code (PyTorch's FP8 conversion on the CPU
    cost FP8 prefill a third of its time)."""
    out = torch.empty(x.shape, dtype=dtype)
    cpu_build.module().widen(x.contiguous().view(torch.uint8), out, 1 if x.dtype == torch.float8_e4m3fn else 2)
    return out


def _widened_once(q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec) -> bool:
    """Whether FP8 keys and values that are not a cache are read by more than one query block of a kv head: the
    kernel would widen each tile once per block (FP8 prefill at 4k tokens ran at 0.75x bf16's speed), so they are
    widened whole, once, exactly, instead. A cache, and a decode-like call, are widened tile by tile."""
    if spec.cache is not None:
        return False
    rows = spec.varlen.max_seqlen_q if spec.varlen is not None else q.shape[-3]
    return rows * (q.shape[-2] // k.shape[-2]) > FORWARD_TILE[0]


def fp8_backward(q, k, v, spec: AttentionSpec) -> bool:
    """Whether the backward takes the FP8 training mode's e4m3 q, k, v with ``spec.descale`` (FP8 matmuls): no,
    the op hands this path the 16-bit values they stand for (``quantize.read_back``)."""
    return False


def backward(dout, dlse, saved: Saved, spec: AttentionSpec, *, mask_grad: bool = False):
    """(dq, dk, dv, dmask), as every path returns them (no KV cache: the op differentiates a cached call as the
    varlen call of its gathered keys); dmask, with ``mask_grad``, is dS summed to the mask's own shape."""
    q, k, v, out, lse = (_unit_stride(t) for t in saved)
    if spec.cache is not None:
        raise NotImplementedError("the cpu path has no backward through keys in a KV cache")
    acc = accumulation_dtype(q.dtype)
    dout = _unit_stride(dout)
    lse = lse.to(acc)
    dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    batch = functools.partial(_as_batch, spec=spec, keys=False)
    dmask = torch.zeros(q.shape[0], q.shape[2], q.shape[1], k.shape[1], dtype=acc) if mask_grad else None
    if dlse is not None:
        dlse = dlse[None] if spec.packed else dlse
    cpu_build.module().backward(batch(q), batch(k), batch(v), batch(out), batch(dout),
                                lse[None] if spec.packed else lse, dlse, batch(dq), batch(dk), batch(dv), dmask,
                                **_options(batch(q), batch(k), spec, tile=BACKWARD_TILE,
                                           tiles=cpu_tiles.choose(q.dtype)))
    mask = spec.attn_mask
    return dq, dk, dv, None if dmask is None else sum_to_shape(dmask, mask.shape).to(mask.dtype)


# --- kept plans (flashattn.fastpath) --------------------------------------------------------------------------------
# A repeated call's signature fixes everything ``forward`` decides for a dense call (the options, the tiles, the
# outputs' shapes): ``flashattn.fastpath`` keeps the decision as a plan and later calls of the signature skip the
# checks, the choice of path and the options (60 us of a 16-token call's 97 us on a 2-core Xeon, where the kernel
# takes 32 and SDPA's whole call 20).


# The forward operator's options in its schema's order (cpu_flash.cpp, FLASHATTN_OPTIONS): a plan passes them by
# position, which binds in a fifth less time than by name.
OPTION_NAMES = ("seqs", "block_table", "diagonal", "scale", "softcap", "left", "right", "block_m", "block_n", "alibi",
                "sink", "dropout_p", "seed", "counter_rows", "counter_cols", "mask", "tile_kind", "partial_id",
                "partial_masks", "tiles")


def _positional(options: dict) -> tuple:
    return tuple(options[name] for name in OPTION_NAMES)


class _Replays:
    """How many calls ran by a kept plan (``flashattn.fastpath`` counts them; tests read them)."""

    __slots__ = ("replays",)

    def __init__(self):
        self.replays = 0


FORWARD_PLANS, BACKWARD_PLANS = _Replays(), _Replays()


class ForwardPlan:
    """The kernel call ``forward`` makes for one dense signature: ``run`` allocates out and lse and calls it."""

    __slots__ = ("dtype", "lse_dtype", "lse_shape", "op", "options", "out_shape")

    def __init__(self, q, k, v, spec: AttentionSpec):
        self.op = cpu_build.module().forward
        self.options = _positional(_options(q, k, spec, tile=FORWARD_TILE, tiles=_forward_tiles(q, k, spec)))
        self.out_shape, self.dtype = (*q.shape[:-1], v.shape[-1]), q.dtype
        self.lse_shape, self.lse_dtype = spec.lse_shape(q.shape), accumulation_dtype(q.dtype)

    def run(self, inputs, device) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = inputs
        out = torch.empty(*self.out_shape, dtype=self.dtype)  # sizes as arguments: a tuple is parsed slower
        lse = torch.empty(*self.lse_shape, dtype=self.lse_dtype)
        self.op(q, k, v, out, lse, *self.options)
        return out, lse


def _replayable(spec: AttentionSpec, q, k, v) -> bool:
    """Whether ``forward``'s kernel call for these tensors is fixed by their signature: no option is a tensor or a
    fresh seed (dropout, masks, ALiBi, sinks, FP8 scales), no FP8 tensor (widened or reinterpreted first), and rows
    the kernel reads in place (a unit last stride; ``forward`` copies the others)."""
    return not (spec.dropout_p > 0 or spec.descale is not None or spec.attn_mask is not None
                or spec.block_sparse is not None or spec.alibi_slopes is not None or spec.sink is not None
                or q.numel() == 0 or any(t.dtype in FP8_DTYPES or t.stride(-1) != 1 for t in (q, k, v)))


def forward_plan(q, k, v, spec: AttentionSpec) -> ForwardPlan | None:
    """The plan of a dense call (no packed or cached keys) that is ``_replayable``; None for the others, which take
    ``forward`` every time."""
    if spec.packed or spec.cache is not None or k.numel() == 0 or not _replayable(spec, q, k, v):
        return None
    return ForwardPlan(q, k, v, spec)


class CachePlan:
    """The kernel call ``forward`` makes for one ``flash_attn_with_kvcache`` signature: per call, only the
    sequences' rows (``_sequences``' layout: batch entry, its cache row, first key, keys, diagonal) from the
    call's checked bounds (``checks.kvcache.CacheBounds``), and its block table."""

    __slots__ = ("bottom_right", "dtype", "lse_dtype", "lse_shape", "op", "options", "out_shape", "rows",
                 "shift")

    def __init__(self, q, k_cache, v_cache, spec: AttentionSpec):
        self.op = cpu_build.module().forward
        # The options after seqs, block_table and diagonal (which each call brings).
        self.options = _positional(_options(q, k_cache, spec, tile=FORWARD_TILE,
                                            tiles=_forward_tiles(q, k_cache, spec)))[3:]
        self.out_shape, self.dtype = (*q.shape[:-1], v_cache.shape[-1]), q.dtype
        self.lse_shape, self.lse_dtype = spec.lse_shape(q.shape), accumulation_dtype(q.dtype)
        self.rows = q.shape[1]
        # Band.of's diagonal of an (rows x keys) matrix: keys * bottom_right + shift
        self.bottom_right, self.shift = int(spec.bottom_right), spec.diagonal_offset - self.rows * spec.bottom_right

    def run(self, q, k_cache, v_cache, bounds) -> tuple[torch.Tensor, torch.Tensor]:
        ends = bounds.k_end.tolist()
        starts = None if bounds.k_start is None else bounds.k_start.tolist()
        entries = None if bounds.batch_idx is None else bounds.batch_idx.tolist()
        return self.run_lengths(q, k_cache, v_cache, ends, starts=starts, entries=entries,
                                block_table=bounds.block_table)

    def run_lengths(self, q, k_cache, v_cache, ends: list[int], *, starts: list[int] | None = None,
                    entries: list[int] | None = None, block_table=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``run`` with the bounds as host values, checked: sequence b attends positions ``starts[b]`` (0) to
        ``ends[b]`` of cache row ``entries[b]`` (b)."""
        nq, right, shift = self.rows, self.bottom_right, self.shift
        out = torch.empty(*self.out_shape, dtype=self.dtype)
        lse = torch.empty(*self.lse_shape, dtype=self.lse_dtype)
        end = ends[0]
        if starts is None and entries is None and block_table is None and end > 0 and ends.count(end) == len(ends):
            # One length (an int cache_seqlens): a dense call on the cache's first rows and positions, as views.
            batch = len(ends)
            self.op(q, k_cache[:batch, :end], v_cache[:batch, :end], out, lse, None, None, end * right + shift,
                    *self.options)
            return out, lse
        rows = array("q")  # (S, 7) int64, flat: a tensor of them by frombuffer costs half of torch.tensor's
        if starts is None and entries is None:
            for b, n in enumerate(ends):
                rows.extend((b, 0, nq, b, 0, n, n * right + shift))
        else:
            starts = [0] * len(ends) if starts is None else starts
            entries = range(len(ends)) if entries is None else entries
            for b, (e, s, n) in enumerate(zip(entries, starts, ends, strict=True)):
                rows.extend((b, 0, nq, e, s, n - s, (n - s) * right + shift))
        seqs = torch.frombuffer(rows, dtype=torch.long).view(-1, 7)
        self.op(q, k_cache, v_cache, out, lse, seqs, block_table, 0, *self.options)
        return out, lse


def cache_plan(q, k_cache, v_cache, spec: AttentionSpec) -> CachePlan | None:
    """``forward_plan`` for a ``flash_attn_with_kvcache`` call (``spec.cache`` set) that is ``_replayable``, else
    None."""
    if spec.cache is None or not _replayable(spec, q, k_cache, v_cache):
        return None
    return CachePlan(q, k_cache, v_cache, spec)


def varlen_plan(q, k, v, spec: AttentionSpec) -> None:
    """None: a packed call takes ``forward`` every time (its sequences' rows are read from the offsets)."""
    return None


def backward_plan(dout, dlse, saved: Saved, spec: AttentionSpec) -> None:
    """None: a training step's backward takes ``backward`` (a backward's work dwarfs its call's cost)."""
    return None


def plan_context() -> tuple | None:
    """What decides a kept plan besides the call's signature: the tile switch (``FLASHATTN_CPU_TILES``); the
    build is the process's. None where the kernel is not built (the torch path serves CPU calls)."""
    return (_TILES.get(),) if cpu_build.status()[0] else None


_TILES = Variable(cpu_tiles.ENV)
