"""Checks of ``flash_attn_with_kvcache``: the cache layout, the new keys, the per-sequence lengths and indices
(read on the host, one small copy, so no kernel or in-place append ever trusts a bad one), and rotary."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..backends.spec import AttentionSpec, KeyCache
from ._base import fail, validate_bool, validate_count, validate_heads, validate_same, validate_tensor
from .flash import flash_options, validate_block_table


@dataclass(frozen=True)
class KVCacheCall:
    """A validated ``flash_attn_with_kvcache`` call.

    ``spec.cache`` describes the keys to attend after the append: positions [leftpad_b, cache_seqlens_b +
    seqlen_new). ``append_at`` (int32 (batch,)) is where the new ``k``/``v`` go (None when there are none).
    ``rotary`` is (cos, sin) or None; ``rotary_start`` (int32 (batch,)) the rotary position of each sequence's
    first new token, cache_seqlens (a cache position, as in flash_attn, even with leftpad);
    ``q_positions_advance``: query t sits at rotary_start + t (causal or local), else every query sits at
    rotary_start.
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    spec: AttentionSpec
    append_at: torch.Tensor | None
    rotary: tuple[torch.Tensor, torch.Tensor] | None
    rotary_interleaved: bool
    rotary_start: torch.Tensor | None
    q_positions_advance: bool


@dataclass(frozen=True)
class _Lengths:
    """Where each sequence's keys are, on the device (``seqlens``, ``leftpad``, ``batch_idx``, ``block_table``)
    and on the host (``lengths``, ``pads``, ``ends``)."""

    seqlens: torch.Tensor
    leftpad: torch.Tensor | None
    batch_idx: torch.Tensor | None
    block_table: torch.Tensor | None
    lengths: list[int]
    pads: list[int]
    ends: list[int]


def check_kvcache(fn: str, **arguments) -> KVCacheCall:
    """Validate ``flash_attn_with_kvcache``'s arguments, given by name (``arguments``: q, k_cache, v_cache, k, v,
    rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
    window_size, softcap, rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse)."""
    a = arguments
    q, k_cache, v_cache = _cache_layout(fn, a["q"], a["k_cache"], a["v_cache"], paged=a["block_table"] is not None)
    k, v = _new_keys(fn, q, k_cache, a["k"], a["v"], cache_seqlens=a["cache_seqlens"])
    new = 0 if k is None else k.shape[1]
    where = _lengths(fn, q, k_cache, new=new, **{n: a[n] for n in ("cache_seqlens", "cache_batch_idx",
                                                                     "cache_leftpad", "block_table")})
    num_splits = validate_count(fn, "num_splits", a["num_splits"])
    validate_bool(fn, "return_softmax_lse", a["return_softmax_lse"])
    spec = flash_options(fn, q, batch=q.shape[0], dropout_p=0.0, deterministic=False, return_attn_probs=False,
                         **{n: a[n] for n in ("softmax_scale", "causal", "window_size", "softcap", "alibi_slopes")})
    local = spec.window_left >= 0 or spec.window_right >= 0
    # Rotary positions are cache positions, as in flash_attn: from cache_seqlens over the new keys (and the
    # queries when they advance), whatever the left padding.
    reach = max(new, q.shape[1] if local else 1)
    rotary = _rotary(fn, a["rotary_cos"], a["rotary_sin"], q, interleaved=a["rotary_interleaved"],
                     positions_needed=max((n + reach for n in where.lengths), default=0))
    seqlens = where.seqlens
    cache = KeyCache(
        k_start=torch.zeros_like(seqlens) if where.leftpad is None else where.leftpad,
        k_end=seqlens + new if new else seqlens,
        max_seqlen_k=max((e - p for e, p in zip(where.ends, where.pads, strict=True)), default=0),
        batch_idx=where.batch_idx,
        block_table=where.block_table,
        num_splits=num_splits,
    )
    return KVCacheCall(
        q, k_cache, v_cache, k, v, dataclasses.replace(spec, cache=cache),
        append_at=seqlens if k is not None else None,
        rotary=rotary, rotary_interleaved=a["rotary_interleaved"],
        rotary_start=None if rotary is None else seqlens,
        q_positions_advance=local,
    )


def _cache_layout(fn: str, q, k_cache, v_cache, *, paged: bool) -> tuple[torch.Tensor, ...]:
    cache_layout = ("(num_pages, page_size, nheads_k, headdim)" if paged else
                    "(batch_cache, seqlen_cache, nheads_k, headdim)")
    q = validate_tensor(fn, "q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    k_cache = validate_tensor(fn, "k_cache", k_cache, 4, cache_layout)
    v_cache = validate_tensor(fn, "v_cache", v_cache, 4, cache_layout)
    validate_same(fn, {"q": q, "k_cache": k_cache, "v_cache": v_cache})
    if k_cache.shape != v_cache.shape:
        raise fail(fn, f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
                       f"{tuple(v_cache.shape)}")
    if q.shape[3] != k_cache.shape[3]:
        raise fail(fn, f"head dims differ: q has {q.shape[3]}, k_cache has {k_cache.shape[3]}")
    validate_heads(fn, q.shape[2], k_cache.shape[2], ("q", "k_cache"))
    return q, k_cache, v_cache


def _new_keys(fn: str, q, k_cache, k, v, *, cache_seqlens) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if (k is None) != (v is None):
        raise fail(fn, "pass both k and v (the new keys and values to append) or neither")
    if k is None:
        return None, None
    layout = "(batch, seqlen_new, nheads_k, headdim)"
    k, v = validate_tensor(fn, "k", k, 4, layout), validate_tensor(fn, "v", v, 4, layout)
    validate_same(fn, {"q": q, "k": k, "v": v})
    expected = (q.shape[0], k.shape[1], *k_cache.shape[2:])
    if tuple(k.shape) != expected or tuple(v.shape) != expected:
        raise fail(fn, f"k and v must have shape (batch, seqlen_new, nheads_k, headdim) = {expected}, got "
                       f"{tuple(k.shape)} and {tuple(v.shape)}")
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
    if t.dtype != torch.int32:
        raise fail(fn, f"{name} must have dtype torch.int32, got {t.dtype}", TypeError)
    if tuple(t.shape) != (batch,):
        raise fail(fn, f"{name} must have shape (batch,) = ({batch},), got {tuple(t.shape)}")
    if t.device != ref.device:
        raise fail(fn, f"{name} is on {t.device} but q is on {ref.device}")
    return t


def _host_lists(*tensors: torch.Tensor | None) -> list[list[int] | None]:
    """The values of small index tensors on the host, in one device-to-host copy."""
    present = [t for t in tensors if t is not None]
    flat = torch.cat([t.reshape(-1).long() for t in present]).tolist() if present else []
    out, i = [], 0
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        out.append(flat[i : i + t.numel()])
        i += t.numel()
    return out


def _lengths(fn: str, q, k_cache, *, new: int, cache_seqlens, cache_batch_idx, cache_leftpad, block_table
             ) -> _Lengths:
    batch, paged = q.shape[0], block_table is not None
    if paged and cache_batch_idx is not None:
        raise fail(fn, "cache_batch_idx cannot be used with block_table (the table already maps sequences to "
                       "pages)")
    capacity = k_cache.shape[1]
    if paged:
        capacity *= validate_block_table(fn, block_table, k_cache, batch).shape[1]
    batch_idx = _validate_index_vector(fn, "cache_batch_idx", cache_batch_idx, batch, q)
    leftpad = _validate_index_vector(fn, "cache_leftpad", cache_leftpad, batch, q)
    seqlens, lengths, pads, rows = _read_lengths(fn, q, cache_seqlens, leftpad=leftpad, batch_idx=batch_idx)
    if lengths is None:  # the whole cache
        lengths = [capacity] * batch
        seqlens = torch.full((batch,), capacity, dtype=torch.int32, device=q.device)
    pads = pads or [0] * batch
    for b in range(batch):
        if lengths[b] < 0 or lengths[b] + new > capacity:
            raise fail(fn, f"cache_seqlens[{b}] = {lengths[b]} plus {new} new keys does not fit the cache's "
                           f"{capacity} positions")
        if not 0 <= pads[b] <= lengths[b]:
            raise fail(fn, f"cache_leftpad[{b}] = {pads[b]} must be in [0, cache_seqlens[{b}] = {lengths[b]}]")
    _validate_rows(fn, rows, k_cache, batch=batch, appending=new > 0, paged=paged)
    ends = [n + new for n in lengths]
    table = validate_block_table(fn, block_table, k_cache, batch, ends) if paged else None
    return _Lengths(seqlens, leftpad, batch_idx, table, lengths, pads, ends)


def _read_lengths(fn: str, q, cache_seqlens, *, leftpad, batch_idx):
    """(seqlens tensor, lengths, pads, rows): the host lists None where the tensor is absent."""
    batch = q.shape[0]
    if cache_seqlens is None or isinstance(cache_seqlens, torch.Tensor):
        seqlens = _validate_index_vector(fn, "cache_seqlens", cache_seqlens, batch, q)
        return seqlens, *_host_lists(seqlens, leftpad, batch_idx)
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if cache_seqlens < 0:
            raise fail(fn, f"cache_seqlens must be >= 0, got {cache_seqlens}")
        # Known on the host already: with no leftpad or batch index the call needs no device-to-host copy.
        seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
        return seqlens, [cache_seqlens] * batch, *_host_lists(leftpad, batch_idx)
    raise fail(fn, f"cache_seqlens must be an int, an int32 tensor (batch,) or None, got {cache_seqlens!r}",
               TypeError)


def _validate_rows(fn: str, rows: list[int] | None, k_cache, *, batch: int, appending: bool, paged: bool) -> None:
    if rows is not None:
        if any(not 0 <= r < k_cache.shape[0] for r in rows):
            raise fail(fn, f"cache_batch_idx values must be in [0, {k_cache.shape[0]}), got {rows}")
        if appending and len(set(rows)) != len(rows):
            raise fail(fn, f"cache_batch_idx has repeated entries {rows}: two sequences would append to one cache "
                           "row")
    elif not paged and k_cache.shape[0] < batch:
        # More rows than sequences is fine (a preallocated cache; sequence b uses row b, as in flash_attn).
        raise fail(fn, f"k_cache holds {k_cache.shape[0]} sequences but q has batch {batch}; pass a cache with at "
                       "least batch rows, or cache_batch_idx to choose rows")


def _rotary(fn: str, cos, sin, q, *, interleaved, positions_needed: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    validate_bool(fn, "rotary_interleaved", interleaved)
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
    if cos.shape[0] < positions_needed:
        raise fail(fn, f"rotary_cos/rotary_sin cover {cos.shape[0]} positions but this call reaches position "
                       f"{positions_needed - 1}")
    return cos, sin
