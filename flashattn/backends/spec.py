"""What a backend is asked to compute: one attention call's options as one type, ``AttentionSpec``.

Everything besides q, k and v travels in it: the scalar options, the optional tensors (ALiBi slopes, a user mask,
the dropout seed) and the layout of packed (``Varlen``) or cached (``KeyCache``) keys. The custom op's schema is
derived from its fields, and ``as_args``/``from_args`` convert it to and from the op's flat argument list in one
place (as FlexAttention's ``BlockMask.as_tuple()`` does): adding an option means adding a field here, checking it
in ``flashattn.checks`` and implementing it in the backends, and nothing else.

Example::

    >>> spec = AttentionSpec(scale=0.125, window_right=0)
    >>> AttentionSpec.from_args(spec.as_args()).as_args() == spec.as_args()
    True
    >>> AttentionSpec.op_schema().split(", ")[:3]
    ['float scale', 'SymInt window_left', 'SymInt window_right']
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from .masking import Band


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums and statistics are kept in: float64 for float64 inputs, float32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# eq=False throughout: two specs holding equal but distinct tensors have no single truth value of "equal" (a
# dataclass __eq__ would compare the tensors elementwise and fail); identity is what matters for a call.
@dataclass(frozen=True, eq=False)
class Varlen:
    """The packed layout of a variable-length batch: sequence b owns query rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` and key rows ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``.

    ``max_seqlen_*`` bound every length; they also fix the dropout counter layout
    ((b * H + h) * max_seqlen_q + i) * max_seqlen_k + j, shared by every backend.
    """

    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.numel() - 1

    def bounds(self) -> list[tuple[int, int, int, int]]:
        """(q start, q end, k start, k end) per sequence (reads the offsets on the host)."""
        cq, ck = self.cu_seqlens_q.tolist(), self.cu_seqlens_k.tolist()
        return [(cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(self.batch)]


def cache_launch_keys(longest: int, capacity: int) -> int:
    """The key count a KV-cache call's launch is sized for: the longest sequence's keys rounded up to a power of
    two, at most the cache's ``capacity`` (positions per sequence). Kernels bound each sequence by its own length,
    so a larger count only adds split programs that find no keys; rounding keeps one launch (and one launch plan)
    for many steps of a growing cache instead of one per length.

        >>> cache_launch_keys(1000, 4096), cache_launch_keys(3000, 2048)
        (1024, 2048)
    """
    return min(capacity, 1 << max(0, longest - 1).bit_length()) if longest > 0 else 0


def aliases(tensors) -> tuple[int, ...]:
    """For each of ``tensors``, the position of the first that is the same object: what a launch plan's slots
    depend on besides each tensor's own facts. A plan recorded for ``f(x, x, x)`` reads all three from the first
    input; a call with three tensors must not replay it, nor the reverse.

        >>> x, y = object(), object()
        >>> aliases((x, y, x)), aliases((x, y, None, None))
        ((0, 1, 0), (0, 1, 2, 2))
    """
    first: dict[int, int] = {}
    return tuple(first.setdefault(id(t), i) for i, t in enumerate(tensors))


@dataclass(frozen=True, eq=False)
class KeyCache:
    """Where each batch entry's keys and values live in a KV cache (inference; there is no backward).

    Batch entry b attends the ``k_end[b] - k_start[b]`` keys at cache positions ``k_start[b] .. k_end[b] - 1``
    (logical key j is position ``k_start[b] + j``; masks and ALiBi count j from 0; ``k_start`` None: 0). Position
    p is row p of cache entry ``batch_idx[b]`` (default b) of a dense cache (B_cache, N_cache, Hk, D), or, with
    ``block_table`` (B, pages per sequence), row ``p % page_size`` of page ``block_table[b, p // page_size]`` of a
    paged cache (num_pages, page_size, Hk, D).

    ``max_seqlen_k`` bounds every ``k_end[b] - k_start[b]`` (it sizes the split-KV work). ``num_splits``: cut each
    sequence's keys into that many chunks, attend each separately and merge the partial results by their
    log-sum-exp (flash-decoding); 0 lets the backend choose.
    """

    k_start: Tensor | None
    k_end: Tensor
    max_seqlen_k: int
    batch_idx: Tensor | None = None
    block_table: Tensor | None = None
    num_splits: int = 1

    def bounds(self) -> list[tuple[int, int]]:
        """(first position, end position) per batch entry (reads the bounds on the host)."""
        ends = self.k_end.tolist()
        return list(zip(self.k_start.tolist() if self.k_start is not None else [0] * len(ends), ends, strict=True))

    def gather(self, k_cache: Tensor, v_cache: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Each entry's keys and values copied out of the cache and packed one entry after another, as a varlen
        batch: (k (total_k, Hk, D), v (total_k, Hk, Dv), cu_seqlens_k int32 (B + 1,)). One host read (total_k).

        Example::

            >>> cache = torch.arange(8.0).view(2, 4, 1, 1)  # 2 rows of 4 positions
            >>> k, _, cu = KeyCache(torch.tensor([1, 0]), torch.tensor([3, 1]), 2).gather(cache, cache)
            >>> k.flatten().tolist(), cu.tolist()
            ([1.0, 2.0, 4.0], [0, 2, 3])
        """
        start = torch.zeros_like(self.k_end) if self.k_start is None else self.k_start
        lengths = (self.k_end - start).long()
        cu = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0))
        entry = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths,
                                        output_size=int(cu[-1]))
        pos = torch.arange(entry.numel(), device=entry.device) - cu[entry] + start.long()[entry]
        if self.block_table is not None:
            page_size = k_cache.shape[1]
            index = (self.block_table.long()[entry, pos // page_size], pos % page_size)
        else:
            index = (entry if self.batch_idx is None else self.batch_idx.long()[entry], pos)
        return k_cache[index], v_cache[index], cu.to(torch.int32)


@dataclass(frozen=True, eq=False)
class BlockSparse:
    """A block-sparse mask (from FlexAttention's ``BlockMask``, ``flashattn.checks.block_mask``): the (Nq, Nk) score
    matrix cut into ``q_block`` x ``kv_block`` tiles, each empty (skipped), full (run without a mask) or partial
    (run with its element mask). The backends' tiles are exactly these tiles.

    ``tile_kind`` (Bm, Hm, Nq / q_block, Nk / kv_block) uint8, rounded up: 0 empty, 1 partial, 2 full; Bm and Hm are
    the batch or 1 and the query heads or 1 (broadcast). ``partial_id`` (same shape) int32: partial tile t's element
    mask is ``partial_masks[t]`` ((P, q_block, kv_block) bool, True = may attend), -1 elsewhere. Memory: the tile
    map plus the partial tiles, never Nq x Nk.
    """

    tile_kind: Tensor
    partial_id: Tensor
    partial_masks: Tensor
    q_block: int = 128
    kv_block: int = 128


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def output_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the output for queries of ``dtype``: bfloat16 for FP8 queries (FlashAttention-3's rule), else
    the queries' own."""
    return torch.bfloat16 if dtype in FP8_DTYPES else dtype


@dataclass(frozen=True, eq=False)
class Descale:
    """The scales of FP8 inputs (FlashAttention-3's ``q_descale``, ``k_descale``, ``v_descale``): the call attends
    ``x.float() * descale[b, hk]`` for each of q, k, v, whose FP8 values are read and widened tile by tile. Each is
    (B, Hk) float32 (B: the batch, or the sequences of a varlen batch; Hk: the key/value heads, for q too), ones
    where the caller gave none or the input is not FP8."""

    q: Tensor
    k: Tensor
    v: Tensor

    def rows(self, i: int) -> Descale:
        """The scales of batch entry ``i`` alone ((1, Hk) each)."""
        return Descale(self.q[i : i + 1], self.k[i : i + 1], self.v[i : i + 1])

    def folded_queries(self, q: Tensor, cu_seqlens_q: Tensor | None = None) -> Tensor:
        """q (B, Nq, H, D), or packed (total_q, H, D) with its offsets, times its descale and k's, per query head of
        the kv head's group, in q's 16-bit dtype (bfloat16 for FP8 q): what the kernels that widen FP8 keys without
        scaling them multiply by.

            >>> one = torch.ones(1, 1)
            >>> Descale(one, 2 * one, one).folded_queries(torch.ones(1, 1, 2, 4, dtype=torch.float16)).flatten()[0]
            tensor(2., dtype=torch.float16)
        """
        return (q.float() * per_row(self.q * self.k, q, cu_seqlens_q)).to(output_dtype(q.dtype))

    def score_scales(self) -> Tensor:
        """(B, Hk) float32, contiguous: q's descale times k's, what multiplies the scores of FP8 q and k multiplied
        as they are (on FP8 tensor cores).

            >>> one = torch.ones(1, 1)
            >>> Descale(2 * one, 3 * one, one).score_scales()
            tensor([[6.]])
        """
        return (self.q * self.k).float().contiguous()

    def scale_values(self, out: Tensor, dtype: torch.dtype, cu_seqlens_q: Tensor | None = None) -> Tensor:
        """out (B, Nq, H, Dv), or packed (total_q, H, Dv) with its offsets, computed with unscaled FP8 values, times
        v's descale per query head, in ``dtype``."""
        return (out.float() * per_row(self.v, out, cu_seqlens_q)).to(dtype)


def per_row(scales: Tensor, x: Tensor, cu_seqlens: Tensor | None) -> Tensor:
    """(B, Hk) ``scales`` repeated to the query heads of ``x`` (B, N, H, D) and shaped to multiply it; for a packed
    x (total, H, D), each row takes its sequence's (``cu_seqlens``: the B + 1 offsets; rows past the last one, which
    no sequence owns, take the last sequence's)."""
    per_head = scales.float().repeat_interleave(x.shape[-2] // scales.shape[1], 1)
    if x.dim() == 4:
        return per_head[:, None, :, None]
    rows = torch.arange(x.shape[0], device=x.device)
    owner = torch.searchsorted(cu_seqlens[1:].to(rows.dtype), rows, right=True).clamp_max(scales.shape[0] - 1)
    return per_head[owner][:, :, None]


@dataclass(frozen=True, eq=False)
class AttentionSpec:
    """Options of one attention call, already checked by ``flashattn.checks``.

    Attributes:
        scale: multiplies q.k before anything else (default headdim ** -0.5 is filled in by the checker).
        window_left, window_right: the visible band ``-left <= j - i - diagonal <= right``; -1 is unbounded;
            causal is (-1, 0).
        bottom_right: align the band's diagonal to the bottom-right corner (flash_attn) or top-left (SDPA).
        diagonal_offset: moves the diagonal by this many columns on top of the alignment: query i of this call is
            query i + diagonal_offset of a longer sequence whose keys start at this call's key 0 (context
            parallelism attends one chunk of queries to another chunk of keys).
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)`` (after scaling, before masks).
        dropout_p: probability of dropping an attention weight; kept weights are scaled by 1 / (1 - p).
        deterministic: ask for bitwise-reproducible gradients (backends that could use atomics honour it).
        seed: one-element int64 tensor on the inputs' device, the key of the counter-based dropout generator
            (``flashattn.backends.philox``); None without dropout. A tensor, so GPU kernels read it without a sync.
        alibi_slopes: (1 or B, H) in the accumulation dtype; adds ``-slope * |i + diagonal - j|``.
        sink: (H,) in the accumulation dtype, a learnable logit per head that joins every row's softmax
            denominator and takes no value (gpt-oss, FlashAttention-4's ``learnable_sink``): lse becomes
            ``log(exp(sink) + sum_j exp(S_ij))``, and a row that sees no key outputs 0 with lse = sink.
        attn_mask: (B or 1, H or 1, Nq or 1, Nk or 1), boolean (True = may attend) or additive in q's dtype.
        block_sparse: tiles the scores are cut into, each skipped, run unmasked or masked (``BlockSparse``);
            dense q, k, v only.
        varlen: q (and k, v unless ``cache``) are packed sequences: q (total_q, H, D), lse (H, total_q).
        cache: keys and values live in a KV cache (dense or paged): forward only.
        descale: FP8 inputs' scales (``Descale``); None when no input is FP8. Forward only.
        fp8_training: the training mode: 16-bit q, k, v are quantized to e4m3 by the op (``flashattn.quantize``,
            a scale per sequence and kv head), attended as FP8 inputs, and differentiated at the values they
            stand for (straight through the rounding); out and the gradients in the inputs' dtype.
    """

    scale: float
    window_left: int = -1
    window_right: int = -1
    bottom_right: bool = True
    diagonal_offset: int = 0
    softcap: float = 0.0
    dropout_p: float = 0.0
    deterministic: bool = False
    seed: Tensor | None = None
    alibi_slopes: Tensor | None = None
    sink: Tensor | None = None
    attn_mask: Tensor | None = None
    block_sparse: BlockSparse | None = None
    varlen: Varlen | None = None
    cache: KeyCache | None = None
    descale: Descale | None = None
    fp8_training: bool = False

    def band(self, nq: int, nk: int) -> Band:
        return Band.of(nq, nk, left=self.window_left, right=self.window_right, bottom_right=self.bottom_right,
                       diagonal_offset=self.diagonal_offset)

    @property
    def packed(self) -> bool:
        """q is packed (total_q, H, D), and lse (H, total_q): the one test of packed input for every backend."""
        return self.varlen is not None

    def lse_shape(self, q_shape: Sequence[int]) -> tuple[int, ...]:
        """The log-sum-exp's layout, the one rule every path follows: (B, H, Nq) for a dense q (B, Nq, H, D),
        (H, total_q) for a packed one (total_q, H, D), where a query's rows are contiguous for every head.

        Example::

            >>> AttentionSpec(scale=1.0).lse_shape((2, 5, 3, 16))
            (2, 3, 5)
        """
        return (q_shape[1], q_shape[0]) if self.packed else (q_shape[0], q_shape[2], q_shape[1])

    def as_args(self) -> tuple:
        """The flat argument list of the custom op, in ``op_schema`` order."""
        return _AS_ARGS(self)

    @classmethod
    def from_args(cls, args: Sequence) -> AttentionSpec:
        """The inverse of ``as_args``."""
        if len(args) != len(_PLANS[cls]):
            raise ValueError(f"AttentionSpec.from_args: {len(args)} arguments, not the {len(_PLANS[cls])} of the "
                             "schema (more than it has, or fewer)")
        return _FROM_ARGS(args)

    @classmethod
    def op_schema(cls) -> str:
        """The fields as ``torch.library`` schema arguments: ``"float scale, SymInt window_left, ..."``."""
        return ", ".join(f"{leaf.schema_type} {leaf.name}" for leaf in _leaves(cls))

    @classmethod
    def arg_index(cls, name: str) -> int:
        """Position of the (flattened) field ``name`` in ``as_args()``, e.g. to place a gradient."""
        return [leaf.name for leaf in _leaves(cls)].index(name)


class Saved(NamedTuple):
    """What the forward saves for the backward: its inputs and its results."""

    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    lse: Tensor


# --- the flattening behind as_args / from_args / op_schema -------------------------------------------------------
# A field is a scalar (float, int, bool), a tensor (optional or not) or a nested layout dataclass (always optional).
# A nested one is flattened into its own fields, prefixed with its name; absent, it contributes None for tensors
# and 0 for scalars, and it is present exactly when its first required tensor field is not None. The plan is
# computed once at import: ``as_args`` runs under torch.compile, which cannot trace ``typing.get_type_hints``.

_SCALAR_SCHEMA = {float: "float", int: "SymInt", bool: "bool"}


class _Leaf(NamedTuple):
    name: str
    schema_type: str
    path: tuple[str, ...]  # attribute names from the spec down to the value
    kind: type  # Tensor, float, int or bool


def _field_types(cls: type) -> Iterator[tuple[str, type, bool]]:
    """(name, type, optional) of each field of dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        args = typing.get_args(hints[field.name])
        optional = type(None) in args
        kind = next(a for a in args if a is not type(None)) if optional else hints[field.name]
        yield field.name, kind, optional


def _plan(cls: type, path: tuple[str, ...] = ()) -> list[_Leaf]:
    leaves = []
    for name, kind, optional in _field_types(cls):
        if dataclasses.is_dataclass(kind):
            leaves += _plan(kind, (*path, name))
        elif kind is Tensor:
            leaves.append(_Leaf("_".join((*path, name)), "Tensor?" if optional or path else "Tensor", (*path, name),
                                kind))
        elif kind in _SCALAR_SCHEMA and not optional:
            leaves.append(_Leaf("_".join((*path, name)), _SCALAR_SCHEMA[kind], (*path, name), kind))
        else:  # None could not be told from 0 once flattened, and other types have no schema here
            raise TypeError(f"{cls.__name__}.{name}: an op argument must be a Tensor, an optional Tensor, a nested "
                            f"layout or a float, int or bool with a default, got {kind}{' | None' * optional}")
    return leaves


def _leaves(cls: type) -> list[_Leaf]:
    return _PLANS[cls]


# as_args and from_args run on every call (the op's arguments are rebuilt into a spec): each is written out as one
# function of the plan, an expression per leaf, at import (about 1 us a call where walking the plan took 10).


def _flattener(cls: type) -> Callable[[object], tuple]:
    """``obj -> (leaf values...)``: a leaf under an absent nested layout is None (a tensor) or 0 (a scalar)."""
    terms = []
    for leaf in _PLANS[cls]:
        term = "obj." + ".".join(leaf.path)
        default = "None" if leaf.kind is Tensor else repr(leaf.kind(0))
        for depth in range(len(leaf.path) - 1, 0, -1):  # innermost guard first, wrapped by the outer ones
            term = f"({default} if obj.{'.'.join(leaf.path[:depth])} is None else {term})"
        terms.append(term)
    return _compiled("flatten", f"def flatten(obj):\n    return ({', '.join(terms)},)\n", {})


def _unflattener(cls: type) -> Callable[[Sequence], object]:
    """``args -> cls(...)``: a nested layout is present exactly when its first required tensor is not None."""
    lines, names = [], {}
    position = 0

    def build(kind: type) -> str:
        nonlocal position
        parts = []
        for name, nested in _FIELDS[kind]:
            if nested is None:
                parts.append(f"{name}=args[{position}]")
                position += 1
            else:
                first = position + _REQUIRED[nested]
                variable = f"_{name}_{position}"
                names[nested.__name__] = nested
                lines.append(f"    {variable} = None if args[{first}] is None else {build(nested)}")
                parts.append(f"{name}={variable}")
        names[kind.__name__] = kind
        return f"{kind.__name__}({', '.join(parts)})"

    result = build(cls)
    return _compiled("unflatten", "def unflatten(args):\n" + "\n".join(lines) + f"\n    return {result}\n", names)


def _compiled(name: str, source: str, namespace: dict) -> Callable:
    exec(compile(source, f"<flashattn.backends.spec {name}>", "exec"), namespace)
    return namespace[name]


# The leaf, counted from a nested layout's first, that tells whether it is present: its first required tensor.
_REQUIRED = {cls: next(i for i, (_, kind, optional) in enumerate(_field_types(cls)) if kind is Tensor and not optional)
             for cls in (BlockSparse, Varlen, KeyCache, Descale)}
# (field name, its dataclass type or None) per class, computed once: every op call rebuilds a spec.
_FIELDS = {cls: tuple((name, kind if dataclasses.is_dataclass(kind) else None) for name, kind, _ in _field_types(cls))
           for cls in (AttentionSpec, BlockSparse, Varlen, KeyCache, Descale)}
_PLANS = {AttentionSpec: _plan(AttentionSpec)}
_AS_ARGS = _flattener(AttentionSpec)
_FROM_ARGS = _unflattener(AttentionSpec)
