"""Checks of ``flash_attn_with_kvcache``: the cache layout, the new keys, the per-sequence lengths and indices
(on the host for CPU values, on the GPU for a GPU's: ``on_device.py``), and rotary."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..backends.spec import AttentionSpec, KeyCache
from . import fp8, on_device
from ._base import (
    fail,
    unit_stride,
    validate_count,
    validate_flag,
    validate_head_dim,
    validate_heads,
    validate_int,
    validate_tensor,
)
from .deferred import checked_cache
from .flash import FLASH_OPTIONS, flash_options, validate_block_table
from .kinds import validate_plain
from .on_device import values_on_host
from .signature import Signatures
from .values import CacheSizes, check_cache_values


@dataclass(frozen=True)
class KVCacheCall:
    """A validated ``flash_attn_with_kvcache`` call.

    ``spec.cache`` describes the keys to attend after the append: positions [leftpad_b, cache_seqlens_b +
    seqlen_new). ``cache_seqlens`` (int32 (batch,)) is where the new ``k``/``v`` go and the rotary position of
    each sequence's first new token (a cache position, as in flash_attn, even with leftpad). ``rotary`` is (cos,
    sin) or None; ``q_positions_advance``: query t sits at cache_seqlens + t (causal or local), else every query
    sits at cache_seqlens.
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    spec: AttentionSpec
    cache_seqlens: torch.Tensor
    rotary: tuple[torch.Tensor, torch.Tensor] | None
    rotary_interleaved: bool
    q_positions_advance: bool
    sizes: CacheSizes | None = None  # what the index values must fit (``values.check_cache_values``)


class _Structure(NamedTuple):
    """What a ``flash_attn_with_kvcache`` call's signature decides: its options (``spec``, without the cache), the
    sizes its lengths must fit, the number of splits, the rotary layout and whether queries advance."""

    spec: AttentionSpec
    sizes: CacheSizes
    num_splits: int
    rotary_interleaved: bool
    local: bool


_INDEX_NAMES = ("cache_seqlens", "cache_batch_idx", "cache_leftpad", "block_table")
_TENSOR_NAMES = ("q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_batch_idx",
                 "cache_leftpad", "block_table")


def check_kvcache(fn: str, **arguments) -> KVCacheCall:
    """Validate ``flash_attn_with_kvcache``'s arguments, given by name (``arguments``: q, k_cache, v_cache, k, v,
    rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
    window_size, softcap, rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, learnable_sink).

    What the call's signature decides is checked once per signature (``signature.Signatures``); the lengths'
    values every call."""
    a = arguments
    seqlens = a["cache_seqlens"]
    tensors = tuple(a[n] for n in _TENSOR_NAMES if a[n] is not None)
    options = (*(a[n] is None for n in _TENSOR_NAMES), seqlens if seqlens is None else type(seqlens).__name__,
               *(a[n] for n in a if n not in _TENSOR_NAMES and n != "cache_seqlens"))
    signature = _CHECKED.key(fn, (*tensors, seqlens) if isinstance(seqlens, torch.Tensor) else tensors, options)
    structure = _CHECKED.get(signature)
    if structure is None:
        structure = _structure(fn, a)
        if not any(isinstance(x, torch.Tensor) for x in structure.spec.as_args()):  # no tensor option to keep
            _CHECKED.put(signature, structure)
    return _checked_call(fn, a, structure)


_CHECKED = Signatures()  # check_kvcache's passed signatures


def _structure(fn: str, a: dict) -> _Structure:
    """Every check that depends on the call's signature only: layouts, shapes, dtypes, devices, options."""
    q, k_cache, v_cache = _cache_layout(fn, a["q"], a["k_cache"], a["v_cache"], paged=a["block_table"] is not None)
    k, _ = _new_keys(fn, q, k_cache, v_cache, a["k"], a["v"], cache_seqlens=a["cache_seqlens"])
    known = _index_sizes(fn, q, k_cache, **{n: a[n] for n in _INDEX_NAMES})
    num_splits = validate_count(fn, "num_splits", a["num_splits"])
    validate_flag(fn, "return_softmax_lse", a["return_softmax_lse"])
    # flash_attn_with_kvcache takes flash_attn_func's options but dropout and the probabilities (inference).
    inference = {"dropout_p": 0.0, "deterministic": False, "return_attn_probs": False}
    spec = flash_options(fn, q, batch=q.shape[0], learnable_sink=a["learnable_sink"],
                         **{n: a[n] if n in a else inference[n] for n in FLASH_OPTIONS})
    scales = fp8.descale(fn, inputs={"q": q, "k_cache": k_cache, "v_cache": v_cache},
                         given={n: a.get(n) for n in ("q_descale", "k_descale", "v_descale")}, batch=q.shape[0],
                         nheads_k=k_cache.shape[2])
    local = spec.window_left >= 0 or spec.window_right >= 0
    interleaved = validate_flag(fn, "rotary_interleaved", a["rotary_interleaved"])
    rotary = _rotary(fn, a["rotary_cos"], a["rotary_sin"], q)
    new = 0 if k is None else k.shape[1]
    # Rotary positions are cache positions, as in flash_attn: from cache_seqlens over the new keys (and the
    # queries when they advance), whatever the left padding.
    sizes = CacheSizes(batch=known.batch, capacity=known.capacity, new=new, cache_rows=known.cache_rows,
                       paged=known.paged, num_pages=known.num_pages, page_size=known.page_size,
                       rotary_positions=None if rotary is None else rotary[0].shape[0],
                       rotary_reach=max(new, q.shape[1] if local else 1))
    return _Structure(dataclasses.replace(spec, descale=scales), sizes, num_splits, interleaved, local)


class CacheBounds(NamedTuple):
    """A call's index values, checked: ``seqlens`` (where new keys go), the keys to attend [k_start, k_end) per
    sequence (k_start None: 0), the cache rows or pages, and the most keys any sequence attends."""

    seqlens: torch.Tensor
    k_start: torch.Tensor | None
    k_end: torch.Tensor
    batch_idx: torch.Tensor | None
    block_table: torch.Tensor | None
    max_seqlen_k: int


def cache_bounds(fn: str, cache_seqlens, others: tuple, sizes: CacheSizes, device: torch.device, *,
                 device_check=None) -> CacheBounds:
    """The bounds of a call whose signature passed (``sizes``: its ``CacheSizes``), ``others`` = (cache_leftpad,
    cache_batch_idx, block_table), their values checked (``_checked_values``): the one way both the full checks
    and ``flashattn.fastpath`` turn a call's lengths into what its kernels read. ``device_check``: what checks
    values on a GPU in place of ``on_device.check_cache`` (the fast path's ``on_device.CacheCheck``)."""
    if (type(cache_seqlens) is int and 0 <= cache_seqlens <= sizes.capacity - sizes.new and others == (None,) * 3
            and sizes.rotary_positions is None and not torch.compiler.is_compiling()):
        # One length for every sequence, in range, nothing else to check: a decode step's usual call, at the cost
        # of one tensor (``check_cache_values`` would pass it after a loop over the batch).
        seqlens = torch.full((sizes.batch,), cache_seqlens, dtype=torch.int32, device=device)
        return CacheBounds(seqlens, None, seqlens + sizes.new if sizes.new else seqlens, None, None,
                           cache_seqlens + sizes.new)
    indices = _lengths(fn, cache_seqlens, device, others, sizes)
    (seqlens, leftpad, batch_idx, table), max_seqlen_k = _checked_values(fn, indices, sizes, device_check)
    return CacheBounds(seqlens, leftpad, seqlens + sizes.new if sizes.new else seqlens, batch_idx, table,
                       max_seqlen_k)


def _checked_call(fn: str, a: dict, structure: _Structure) -> KVCacheCall:
    """The call with its lengths' values checked (``cache_bounds``) and its ``KeyCache`` built."""
    q, sizes = a["q"], structure.sizes
    bounds = cache_bounds(fn, a["cache_seqlens"], (a["cache_leftpad"], a["cache_batch_idx"], a["block_table"]),
                          sizes, q.device)
    seqlens = bounds.seqlens
    cache = KeyCache(k_start=bounds.k_start, k_end=bounds.k_end, max_seqlen_k=bounds.max_seqlen_k,
                     batch_idx=bounds.batch_idx, block_table=bounds.block_table, num_splits=structure.num_splits)
    rotary = None if a["rotary_cos"] is None else (a["rotary_cos"], a["rotary_sin"])
    return KVCacheCall(
        q, a["k_cache"], a["v_cache"], a["k"], a["v"], dataclasses.replace(structure.spec, cache=cache),
        cache_seqlens=seqlens,
        rotary=rotary, rotary_interleaved=structure.rotary_interleaved,
        q_positions_advance=structure.local, sizes=sizes,
    )


def _lengths(fn: str, cache_seqlens, device: torch.device, others: tuple, sizes: CacheSizes) -> _Indices:
    """The index tensors with cache_seqlens as a tensor (an int one's value checked here, on the host)."""
    leftpad, batch_idx, table = map(unit_stride, others)
    if cache_seqlens is None or isinstance(cache_seqlens, torch.Tensor):
        return _Indices((unit_stride(cache_seqlens), leftpad, batch_idx, table), None, sizes, device)
    length = validate_int(fn, "cache_seqlens", cache_seqlens)
    if length < 0:
        raise fail(fn, f"cache_seqlens must be >= 0, got {length}")
    # Known on the host already: with no leftpad or batch index the call needs no device-to-host copy.
    seqlens = torch.full((sizes.batch,), length, dtype=torch.int32, device=device)
    return _Indices((seqlens, leftpad, batch_idx, table), [length] * sizes.batch, sizes, device)


class _Indices(NamedTuple):
    """The index tensors of a call (cache_seqlens (None: the whole cache), cache_leftpad, cache_batch_idx,
    block_table), cache_seqlens as host values when given as an int, and the sizes their values must fit."""

    tensors: tuple
    known_lengths: list[int] | None
    sizes: CacheSizes
    device: torch.device


def _checked_values(fn: str, indices: _Indices, sizes: CacheSizes, device_check=None) -> tuple[tuple, int]:
    """(seqlens, leftpad, batch_idx, block_table) with seqlens filled in, and max_seqlen_k, once the values are
    checked: on the host where they are there (CPU tensors, an int cache_seqlens); a GPU's by a kernel in stream
    order (``on_device.py``: no device-to-host copy), with the cache's capacity bounding max_seqlen_k (the value
    flash_attn itself sizes its split-KV work with); under torch.compile by an op when the graph runs."""
    seqlens, leftpad, batch_idx, table = checked = indices.tensors
    if torch.compiler.is_compiling():
        checked = checked_cache(fn, indices.tensors, sizes)
        max_seqlen_k = sizes.capacity
    elif values_on_host(None if indices.known_lengths is not None else seqlens, leftpad, batch_idx, table):
        max_seqlen_k = check_cache_values(fn, indices.tensors, sizes, known_lengths=indices.known_lengths)
    else:
        if device_check is None:
            on_device.check_cache(fn, indices.tensors, sizes)
        else:
            device_check(indices.tensors)
        known = indices.known_lengths
        max_seqlen_k = sizes.capacity if known is None else max(known, default=0) + sizes.new
    if checked[0] is None:  # the whole cache
        checked = (torch.full((sizes.batch,), sizes.capacity, dtype=torch.int32, device=indices.device),
                   *checked[1:])
    return checked, max_seqlen_k


def _cache_layout(fn: str, q, k_cache, v_cache, *, paged: bool) -> tuple[torch.Tensor, ...]:
    cache_layout = ("(num_pages, page_size, nheads_k, headdim)" if paged else
                    "(batch_cache, seqlen_cache, nheads_k, headdim)")
    q = validate_tensor(fn, "q", q, 4, "(batch, seqlen_q, nheads, headdim)", fp8=True)
    k_cache = validate_tensor(fn, "k_cache", k_cache, 4, cache_layout, fp8=True)
    v_cache = validate_tensor(fn, "v_cache", v_cache, 4, cache_layout, fp8=True)
    fp8.validate_cache_dtypes(fn, q, k_cache, v_cache)
    if k_cache.shape[:3] != v_cache.shape[:3]:  # v's head dim may differ (as in flash_attn_func)
        raise fail(fn, f"k_cache and v_cache must agree on all but the head dim, got {tuple(k_cache.shape)} and "
                       f"{tuple(v_cache.shape)}")
    if q.shape[3] != k_cache.shape[3]:
        raise fail(fn, f"head dims differ: q has {q.shape[3]}, k_cache has {k_cache.shape[3]}")
    validate_head_dim(fn, "q", q.shape[3])
    validate_head_dim(fn, "v_cache", v_cache.shape[3])
    validate_heads(fn, nheads=q.shape[2], nheads_k=k_cache.shape[2], names=("q", "k_cache"))
    return q, k_cache, v_cache


def _new_keys(fn: str, q, k_cache, v_cache, k, v, *,
              cache_seqlens) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if (k is None) != (v is None):
        raise fail(fn, "pass both k and v (the new keys and values to append) or neither")
    if k is None:
        return None, None
    layout = "(batch, seqlen_new, nheads_k, headdim)"
    k = validate_tensor(fn, "k", k, 4, layout, fp8=True)
    v = validate_tensor(fn, "v", v, 4, layout, fp8=True)
    fp8.validate_new_keys_dtype(fn, k_cache, k, v)
    expected = (q.shape[0], k.shape[1], *k_cache.shape[2:])
    expected_v = (*expected[:3], v_cache.shape[3])
    if tuple(k.shape) != expected or tuple(v.shape) != expected_v:
        raise fail(fn, f"k and v must have shapes (batch, seqlen_new, nheads_k, headdim) = {expected} and "
                       f"(batch, seqlen_new, nheads_k, headdim_v) = {expected_v}, got {tuple(k.shape)} and "
                       f"{tuple(v.shape)}")
    if cache_seqlens is None:
        raise fail(fn, "k and v are appended at cache_seqlens: pass cache_seqlens (the cache lengths before the "
                       "append)")
    return k, v


def _validate_index_vector(fn: str, name: str, t: object, batch: int, ref: torch.Tensor) -> torch.Tensor | None:
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise fail(fn, f"{name} must be an int32 torch.Tensor of shape (batch,) or None, got {type(t).__name__}",
                   TypeError)
    validate_plain(fn, name, t)
    if t.dtype != torch.int32:
        raise fail(fn, f"{name} must have dtype torch.int32, got {t.dtype}", TypeError)
    if tuple(t.shape) != (batch,):
        raise fail(fn, f"{name} must have shape (batch,) = ({batch},), got {tuple(t.shape)}")
    if t.device != ref.device:
        raise fail(fn, f"{name} is on {t.device} but q is on {ref.device}")
    return t


def _index_sizes(fn: str, q, k_cache, *, cache_seqlens, cache_batch_idx, cache_leftpad, block_table) -> CacheSizes:
    """The kinds and shapes of the index arguments and the sizes their values must fit (the values themselves are
    checked per call: ``values.check_cache_values``)."""
    batch, paged = q.shape[0], block_table is not None
    if paged and cache_batch_idx is not None:
        raise fail(fn, "cache_batch_idx cannot be used with block_table (the table already maps sequences to "
                       "pages)")
    capacity = k_cache.shape[1]
    if paged:
        capacity *= validate_block_table(fn, block_table, k_cache, batch).shape[1]
    elif cache_batch_idx is None and k_cache.shape[0] < batch:
        # More rows than sequences is fine (a preallocated cache; sequence b uses row b, as in flash_attn).
        raise fail(fn, f"k_cache holds {k_cache.shape[0]} sequences but q has batch {batch}; pass a cache with at "
                       "least batch rows, or cache_batch_idx to choose rows")
    _validate_index_vector(fn, "cache_batch_idx", cache_batch_idx, batch, q)
    _validate_index_vector(fn, "cache_leftpad", cache_leftpad, batch, q)
    if cache_seqlens is None or isinstance(cache_seqlens, torch.Tensor):
        _validate_index_vector(fn, "cache_seqlens", cache_seqlens, batch, q)
    else:
        try:
            validate_int(fn, "cache_seqlens", cache_seqlens)
        except TypeError:
            raise fail(fn, f"cache_seqlens must be an int, an int32 tensor (batch,) or None, got {cache_seqlens!r}",
                       TypeError) from None
    return CacheSizes(batch, capacity, new=0, cache_rows=k_cache.shape[0], paged=paged, num_pages=k_cache.shape[0],
                      page_size=k_cache.shape[1])


def _rotary(fn: str, cos, sin, q) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(cos, sin) tables (seqlen_ro, rotary_dim / 2), or None (the positions they must cover are checked with the
    lengths)."""
    if cos is None and sin is None:
        return None
    if cos is None or sin is None:
        raise fail(fn, "pass both rotary_cos and rotary_sin or neither")
    layout = "(seqlen_ro, rotary_dim / 2)"
    cos, sin = validate_tensor(fn, "rotary_cos", cos, 2, layout), validate_tensor(fn, "rotary_sin", sin, 2, layout)
    if cos.shape != sin.shape:
        raise fail(fn, f"rotary_cos and rotary_sin must have the same shape, got {tuple(cos.shape)} and "
                       f"{tuple(sin.shape)}")
    if cos.device != q.device or sin.device != q.device:
        raise fail(fn, f"rotary_cos/rotary_sin are on {cos.device}/{sin.device} but q is on {q.device}")
    if 2 * cos.shape[1] > q.shape[3]:
        raise fail(fn, f"rotary_dim = 2 * rotary_cos.shape[1] = {2 * cos.shape[1]} exceeds headdim {q.shape[3]}")
    return cos, sin
