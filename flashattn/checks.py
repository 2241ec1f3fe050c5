"""The one argument checker: every public entry point validates and normalises its arguments here.

Each ``_validate_*`` helper raises a ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind, bad
value) whose message names the function, the argument, the value received and what is allowed.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from .backends.spec import AttentionSpec, KeyCache, Varlen

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DTYPE_NAMES = "float16, bfloat16, float32 or float64"


@dataclass(frozen=True)
class CheckedCall:
    """A validated call in the flash layout, ready for ``flashattn.ops.attention``.

    q (B, Nq, H, D), k (B, Nk, Hk, D), v (B, Nk, Hk, Dv); ``alibi_slopes`` (1 or B, H) float32 (float64 for
    float64 inputs); ``attn_mask`` 4-D (B or 1, H or 1, Nq or 1, Nk or 1), boolean or of the inputs' dtype.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    spec: AttentionSpec
    alibi_slopes: torch.Tensor | None = None
    attn_mask: torch.Tensor | None = None
    varlen: Varlen | None = None
    cache: KeyCache | None = None  # k, v are a paged cache (varlen with block_table): forward only


def _fail(fn: str, message: str, kind: type[Exception] = ValueError) -> Exception:
    return kind(f"{fn}: {message}")


def _validate_tensor(fn: str, name: str, t: object, ndim: int, layout: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise _fail(fn, f"{name} must be a torch.Tensor of shape {layout}, got {type(t).__name__}", TypeError)
    if t.dim() != ndim:
        raise _fail(fn, f"{name} must have {ndim} dimensions {layout}, got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise _fail(fn, f"{name} has dtype {t.dtype}; supported dtypes are {_DTYPE_NAMES}", TypeError)
    return t


def _validate_same(fn: str, named: dict[str, torch.Tensor]) -> None:
    (first, t0), *rest = named.items()
    for name, t in rest:
        if t.dtype != t0.dtype:
            raise _fail(fn, f"{name} has dtype {t.dtype} but {first} has {t0.dtype}; all must match", TypeError)
        if t.device != t0.device:
            raise _fail(fn, f"{name} is on {t.device} but {first} is on {t0.device}; all must be on one device")


def _validate_heads(fn: str, nheads: int, nheads_k: int, q_name: str, k_name: str) -> None:
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise _fail(
            fn,
            f"the number of heads in {q_name} ({nheads}) must be a multiple of the number of heads in "
            f"{k_name} ({nheads_k}) for grouped-query attention",
        )


def _validate_real(fn: str, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(fn, f"{name} must be a real number, got {value!r}", TypeError)
    if not math.isfinite(value):
        raise _fail(fn, f"{name} must be finite, got {value!r}")
    return float(value)


def _validate_dropout(fn: str, dropout_p: object) -> float:
    p = _validate_real(fn, "dropout_p", dropout_p)
    if not 0.0 <= p < 1.0:
        raise _fail(fn, f"dropout_p must be in [0, 1), got {dropout_p!r}")
    return p


def _validate_scale(fn: str, name: str, scale: object, headdim: int) -> float:
    if scale is None:
        return headdim**-0.5 if headdim > 0 else 1.0
    return _validate_real(fn, name, scale)


def _validate_window(fn: str, window_size: object, causal: bool) -> tuple[int, int]:
    ok = isinstance(window_size, Sequence) and len(window_size) == 2
    if not ok or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size):
        raise _fail(fn, f"window_size must be a pair of ints (left, right), got {window_size!r}", TypeError)
    left, right = window_size
    if left < -1 or right < -1:
        raise _fail(fn, f"window_size values must be >= -1 (-1 means unbounded), got {tuple(window_size)}")
    # flash_attn: causal is the window's right edge at the diagonal.
    return (left, 0) if causal else (left, right)


def _validate_softcap(fn: str, softcap: object) -> float:
    c = _validate_real(fn, "softcap", softcap)
    if c < 0:
        raise _fail(fn, f"softcap must be >= 0 (0 disables it), got {softcap!r}")
    return c


def _validate_bool(fn: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise _fail(fn, f"{name} must be a bool, got {value!r}", TypeError)
    return value


def _validate_alibi(fn: str, slopes: object, batch: int, nheads: int, ref: torch.Tensor) -> torch.Tensor | None:
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor):
        raise _fail(fn, f"alibi_slopes must be a torch.Tensor or None, got {type(slopes).__name__}", TypeError)
    if not slopes.is_floating_point():
        raise _fail(fn, f"alibi_slopes must be a floating-point tensor, got dtype {slopes.dtype}", TypeError)
    if slopes.device != ref.device:
        raise _fail(fn, f"alibi_slopes is on {slopes.device} but q is on {ref.device}")
    if slopes.requires_grad and torch.is_grad_enabled():
        raise _fail(fn, "alibi_slopes receives no gradient (as in flash_attn); pass alibi_slopes.detach()")
    if tuple(slopes.shape) not in ((nheads,), (batch, nheads)):
        raise _fail(
            fn,
            f"alibi_slopes must have shape (nheads,) = ({nheads},) or (batch, nheads) = ({batch}, {nheads}), "
            f"got {tuple(slopes.shape)}",
        )
    dtype = torch.float64 if ref.dtype == torch.float64 else torch.float32
    return slopes.reshape(-1, nheads).to(dtype)


def _flash_layout(fn: str, q: object, k: object, v: object, names=("q", "k", "v")) -> tuple[torch.Tensor, ...]:
    layouts = ("(batch, seqlen_q, nheads, headdim)", "(batch, seqlen_k, nheads_k, headdim)")
    q = _validate_tensor(fn, names[0], q, 4, layouts[0])
    k = _validate_tensor(fn, names[1], k, 4, layouts[1])
    v = _validate_tensor(fn, names[2], v, 4, layouts[1])
    _validate_same(fn, dict(zip(names, (q, k, v), strict=True)))
    if k.shape != v.shape:
        raise _fail(fn, f"{names[1]} and {names[2]} must have the same shape, got {tuple(k.shape)} and "
                        f"{tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise _fail(fn, f"batch sizes differ: {names[0]} has {q.shape[0]}, {names[1]} has {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise _fail(fn, f"head dims differ: {names[0]} has {q.shape[3]}, {names[1]} has {k.shape[3]}")
    _validate_heads(fn, q.shape[2], k.shape[2], names[0], names[1])
    return q, k, v


def _flash_options(fn, q, *, batch, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   deterministic, return_attn_probs) -> tuple[AttentionSpec, torch.Tensor | None]:
    """The options shared by the dense and varlen ``flash_attn_*`` functions (bottom-right causal)."""
    causal = _validate_bool(fn, "causal", causal)
    _validate_bool(fn, "deterministic", deterministic)
    _validate_bool(fn, "return_attn_probs", return_attn_probs)
    left, right = _validate_window(fn, window_size, causal)
    spec = AttentionSpec(
        scale=_validate_scale(fn, "softmax_scale", softmax_scale, q.shape[-1]),
        window_left=left,
        window_right=right,
        bottom_right=True,
        softcap=_validate_softcap(fn, softcap),
        dropout_p=_validate_dropout(fn, dropout_p),
        deterministic=deterministic,
    )
    return spec, _validate_alibi(fn, alibi_slopes, batch, q.shape[-2], q)


def check_flash(fn: str, q: object, k: object, v: object, *, names: tuple[str, str, str] = ("q", "k", "v"),
                **options) -> CheckedCall:
    """Validate the arguments of the ``flash_attn_*func`` family (flash layout, bottom-right causal); ``options``
    are the keyword arguments of ``flash_attn_func`` after q, k, v."""
    q, k, v = _flash_layout(fn, q, k, v, names)
    spec, alibi = _flash_options(fn, q, batch=q.shape[0], **options)
    return CheckedCall(q, k, v, spec, alibi_slopes=alibi)


def _validate_cu_seqlens(fn: str, name: str, cu: object, total: int | None, ref: torch.Tensor) -> list[int]:
    if not isinstance(cu, torch.Tensor):
        raise _fail(fn, f"{name} must be an int32 torch.Tensor of shape (batch + 1,), got {type(cu).__name__}",
                    TypeError)
    if cu.dtype != torch.int32:
        raise _fail(fn, f"{name} must have dtype torch.int32, got {cu.dtype}", TypeError)
    if cu.dim() != 1 or cu.numel() < 1:
        raise _fail(fn, f"{name} must be 1-D of length batch + 1 >= 1, got shape {tuple(cu.shape)}")
    if cu.device != ref.device:
        raise _fail(fn, f"{name} is on {cu.device} but the inputs are on {ref.device}")
    values = cu.tolist()  # a host read: the offsets must be right before any kernel trusts them
    if values[0] != 0:
        raise _fail(fn, f"{name} must start at 0, got {values[0]}")
    drops = [i for i in range(1, len(values)) if values[i] < values[i - 1]]
    if drops:
        i = drops[0]
        raise _fail(fn, f"{name} must be non-decreasing, but {name}[{i}] = {values[i]} < {name}[{i - 1}] = "
                        f"{values[i - 1]}")
    if total is not None and values[-1] != total:
        raise _fail(fn, f"{name}[-1] = {values[-1]} must equal the number of packed rows, {total}")
    return values


def _validate_max_seqlen(fn: str, name: str, value: object, lengths: list[int]) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(fn, f"{name} must be an int, got {value!r}", TypeError)
    longest = max(lengths, default=0)
    if value < longest:
        raise _fail(fn, f"{name} = {value} is smaller than the longest sequence, {longest}")
    return value


def check_varlen(fn: str, q: object, k: object, v: object, cu_seqlens_q: object, cu_seqlens_k: object,
                 max_seqlen_q: object, max_seqlen_k: object, *, names: tuple[str, str, str] = ("q", "k", "v"),
                 block_table: object = None, **options) -> CheckedCall:
    """Validate the ``flash_attn_varlen_*func`` family: packed q (total_q, nheads, headdim), k/v (total_k,
    nheads_k, headdim), int32 offsets ``cu_seqlens_*`` (batch + 1) and the maxima. With ``block_table``, k/v are
    a paged cache (num_pages, page_size, nheads_k, headdim) holding each sequence's keys from position 0."""
    paged = block_table is not None
    layouts = ("(total_q, nheads, headdim)", "(num_pages, page_size, nheads_k, headdim), a paged cache since "
               "block_table is given" if paged else "(total_k, nheads_k, headdim)")
    for name, t, layout, ndim in zip(names, (q, k, v), (layouts[0], layouts[1], layouts[1]), (3, 3 + paged, 3 + paged),
                                     strict=True):
        _validate_tensor(fn, name, t, ndim, layout)
    # The dense checks on a batch of one: same heads, head dims, dtypes and devices rules.
    _flash_layout(fn, q[None], k[:1] if paged else k[None], v[:1] if paged else v[None], names)
    cq = _validate_cu_seqlens(fn, "cu_seqlens_q", cu_seqlens_q, q.shape[0], q)
    ck = _validate_cu_seqlens(fn, "cu_seqlens_k", cu_seqlens_k, None if paged else k.shape[0], q)
    if len(cq) != len(ck):
        raise _fail(fn, f"cu_seqlens_q and cu_seqlens_k must describe the same batch, got lengths {len(cq)} and "
                        f"{len(ck)}")
    max_q = _validate_max_seqlen(fn, "max_seqlen_q", max_seqlen_q, [b - a for a, b in pairwise(cq)])
    max_k = _validate_max_seqlen(fn, "max_seqlen_k", max_seqlen_k, [b - a for a, b in pairwise(ck)])
    spec, alibi = _flash_options(fn, q, batch=len(cq) - 1, **options)
    varlen = Varlen(cu_seqlens_q, cu_seqlens_k, max_q, max_k)
    cache = None
    if paged:
        if spec.dropout_p > 0 or options["return_attn_probs"]:
            raise _fail(fn, "a paged K/V (block_table) is for inference: pass dropout_p=0 and "
                            "return_attn_probs=False")
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise _fail(fn, "a paged K/V (block_table) is forward only: no gradients flow through it; run under "
                            "torch.no_grad() or pass detached tensors")
        table = _validate_block_table(fn, block_table, k, len(ck) - 1, [b - a for a, b in pairwise(ck)])
        cache = KeyCache(torch.zeros_like(cu_seqlens_k[1:]), cu_seqlens_k[1:] - cu_seqlens_k[:-1], max_k,
                         block_table=table)
    return CheckedCall(q, k, v, spec, alibi_slopes=alibi, varlen=varlen, cache=cache)


def _validate_block_table(fn: str, table: object, k_cache: torch.Tensor, batch: int,
                          ends: list[int] | None = None) -> torch.Tensor:
    """An int32 (batch, pages per sequence) table whose pages hold positions 0..ends[b] - 1 of sequence b (the
    kind and shape alone when ``ends`` is None). Only the pages in use are checked (serving engines pad the rest
    with any value)."""
    if not isinstance(table, torch.Tensor):
        raise _fail(fn, f"block_table must be an int32 torch.Tensor (batch, max_pages_per_seq) or None, got "
                        f"{type(table).__name__}", TypeError)
    if table.dtype != torch.int32:
        raise _fail(fn, f"block_table must have dtype torch.int32, got {table.dtype}", TypeError)
    if table.dim() != 2 or table.shape[0] != batch:
        raise _fail(fn, f"block_table must have shape (batch, max_pages_per_seq) with batch = {batch}, got "
                        f"{tuple(table.shape)}")
    if table.device != k_cache.device:
        raise _fail(fn, f"block_table is on {table.device} but the cache is on {k_cache.device}")
    if ends is None:
        return table
    pages, page_size = k_cache.shape[0], k_cache.shape[1]
    needed = [-(-end // page_size) for end in ends]
    if max(needed, default=0) > table.shape[1]:
        b = max(range(len(ends)), key=lambda i: needed[i])
        raise _fail(fn, f"sequence {b} reaches position {ends[b] - 1}, which needs {needed[b]} pages of "
                        f"{page_size}, but block_table has {table.shape[1]} per sequence")
    pages_in_use = torch.tensor(needed, device=table.device)[:, None]
    used = table[torch.arange(table.shape[1], device=table.device)[None, :] < pages_in_use]
    if used.numel():
        lo, hi = (int(x) for x in torch.aminmax(used))  # a host read: a bad page id would read stray memory
        if lo < 0 or hi >= pages:
            raise _fail(fn, f"block_table holds page ids in [{lo}, {hi}] for the positions in use, but the cache "
                            f"has pages 0..{pages - 1}")
    return table


@dataclass(frozen=True)
class KVCacheCall:
    """A validated ``flash_attn_with_kvcache`` call.

    ``cache`` describes the keys to attend after the append: positions [leftpad_b, cache_seqlens_b + seqlen_new).
    ``append_at`` (int32 (batch,)) is where the new ``k``/``v`` go (None when there are none). ``rotary`` is
    (cos, sin) or None; ``rotary_start`` (int32 (batch,)) the rotary position of each sequence's first new
    token, cache_seqlens (a cache position, as in flash_attn, even with leftpad); ``q_positions_advance``:
    query t sits at rotary_start + t (causal or local), else every query sits at rotary_start.
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    spec: AttentionSpec
    cache: KeyCache
    alibi_slopes: torch.Tensor | None
    append_at: torch.Tensor | None
    rotary: tuple[torch.Tensor, torch.Tensor] | None
    rotary_interleaved: bool
    rotary_start: torch.Tensor | None
    q_positions_advance: bool


def _validate_index_vector(fn: str, name: str, t: object, batch: int, ref: torch.Tensor) -> torch.Tensor | None:
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise _fail(fn, f"{name} must be an int32 torch.Tensor of shape (batch,) or None, got {type(t).__name__}",
                    TypeError)
    if t.dtype != torch.int32:
        raise _fail(fn, f"{name} must have dtype torch.int32, got {t.dtype}", TypeError)
    if tuple(t.shape) != (batch,):
        raise _fail(fn, f"{name} must have shape (batch,) = ({batch},), got {tuple(t.shape)}")
    if t.device != ref.device:
        raise _fail(fn, f"{name} is on {t.device} but q is on {ref.device}")
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


def check_kvcache(fn: str, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                  cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                  alibi_slopes, num_splits, return_softmax_lse) -> KVCacheCall:
    """Validate ``flash_attn_with_kvcache``'s arguments. Reads the per-sequence lengths and indices on the host
    (one small copy) so that no kernel or in-place append ever trusts a bad one."""
    paged = block_table is not None
    cache_layout = ("(num_pages, page_size, nheads_k, headdim)" if paged else
                    "(batch_cache, seqlen_cache, nheads_k, headdim)")
    q = _validate_tensor(fn, "q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    k_cache = _validate_tensor(fn, "k_cache", k_cache, 4, cache_layout)
    v_cache = _validate_tensor(fn, "v_cache", v_cache, 4, cache_layout)
    _validate_same(fn, {"q": q, "k_cache": k_cache, "v_cache": v_cache})
    if k_cache.shape != v_cache.shape:
        raise _fail(fn, f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
                        f"{tuple(v_cache.shape)}")
    if q.shape[3] != k_cache.shape[3]:
        raise _fail(fn, f"head dims differ: q has {q.shape[3]}, k_cache has {k_cache.shape[3]}")
    _validate_heads(fn, q.shape[2], k_cache.shape[2], "q", "k_cache")
    batch = q.shape[0]
    if (k is None) != (v is None):
        raise _fail(fn, "pass both k and v (the new keys and values to append) or neither")
    if k is not None:
        layout = "(batch, seqlen_new, nheads_k, headdim)"
        k, v = _validate_tensor(fn, "k", k, 4, layout), _validate_tensor(fn, "v", v, 4, layout)
        _validate_same(fn, {"q": q, "k": k, "v": v})
        expected = (batch, k.shape[1], *k_cache.shape[2:])
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise _fail(fn, f"k and v must have shape (batch, seqlen_new, nheads_k, headdim) = {expected}, got "
                            f"{tuple(k.shape)} and {tuple(v.shape)}")
        if cache_seqlens is None:
            raise _fail(fn, "k and v are appended at cache_seqlens: pass cache_seqlens (the cache lengths before "
                            "the append)")
    new = 0 if k is None else k.shape[1]
    if paged:
        if cache_batch_idx is not None:
            raise _fail(fn, "cache_batch_idx cannot be used with block_table (the table already maps sequences to "
                            "pages)")
        capacity = _validate_block_table(fn, block_table, k_cache, batch).shape[1] * k_cache.shape[1]
    else:
        capacity = k_cache.shape[1]
    batch_idx = _validate_index_vector(fn, "cache_batch_idx", cache_batch_idx, batch, q)
    leftpad = _validate_index_vector(fn, "cache_leftpad", cache_leftpad, batch, q)
    if cache_seqlens is None or isinstance(cache_seqlens, torch.Tensor):
        seqlens = _validate_index_vector(fn, "cache_seqlens", cache_seqlens, batch, q)
        lengths, pads, rows = _host_lists(seqlens, leftpad, batch_idx)
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if cache_seqlens < 0:
            raise _fail(fn, f"cache_seqlens must be >= 0, got {cache_seqlens}")
        # Known on the host already: with no leftpad or batch index the call needs no device-to-host copy.
        seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
        lengths, (pads, rows) = [cache_seqlens] * batch, _host_lists(leftpad, batch_idx)
    else:
        raise _fail(fn, f"cache_seqlens must be an int, an int32 tensor (batch,) or None, got {cache_seqlens!r}",
                    TypeError)
    if lengths is None:  # the whole cache
        lengths = [capacity] * batch
        seqlens = torch.full((batch,), capacity, dtype=torch.int32, device=q.device)
    pads = pads or [0] * batch
    for b in range(batch):
        if lengths[b] < 0 or lengths[b] + new > capacity:
            raise _fail(fn, f"cache_seqlens[{b}] = {lengths[b]} plus {new} new keys does not fit the cache's "
                            f"{capacity} positions")
        if not 0 <= pads[b] <= lengths[b]:
            raise _fail(fn, f"cache_leftpad[{b}] = {pads[b]} must be in [0, cache_seqlens[{b}] = {lengths[b]}]")
    if rows is not None:
        if any(not 0 <= r < k_cache.shape[0] for r in rows):
            raise _fail(fn, f"cache_batch_idx values must be in [0, {k_cache.shape[0]}), got {rows}")
        if k is not None and len(set(rows)) != len(rows):
            raise _fail(fn, f"cache_batch_idx has repeated entries {rows}: two sequences would append to one cache "
                            "row")
    elif not paged and k_cache.shape[0] < batch:
        # More rows than sequences is fine (a preallocated cache; sequence b uses row b, as in flash_attn).
        raise _fail(fn, f"k_cache holds {k_cache.shape[0]} sequences but q has batch {batch}; pass a cache with at "
                        "least batch rows, or cache_batch_idx to choose rows")
    ends = [n + new for n in lengths]
    table = _validate_block_table(fn, block_table, k_cache, batch, ends) if paged else None

    num_splits = _validate_count(fn, "num_splits", num_splits)
    _validate_bool(fn, "return_softmax_lse", return_softmax_lse)
    spec, alibi = _flash_options(fn, q, batch=batch, dropout_p=0.0, softmax_scale=softmax_scale, causal=causal,
                                 window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                 deterministic=False, return_attn_probs=False)
    local = spec.window_left >= 0 or spec.window_right >= 0
    # Rotary positions are cache positions, as in flash_attn: from cache_seqlens over the new keys (and the
    # queries when they advance), whatever the left padding.
    reach = max(new, q.shape[1] if local else 1)
    rotary = _validate_rotary(fn, rotary_cos, rotary_sin, q, rotary_interleaved,
                              max((n + reach for n in lengths), default=0))
    cache = KeyCache(
        k_start=torch.zeros_like(seqlens) if leftpad is None else leftpad,
        k_end=seqlens + new if new else seqlens,
        max_seqlen_k=max((e - p for e, p in zip(ends, pads, strict=True)), default=0),
        batch_idx=batch_idx,
        block_table=table,
        num_splits=num_splits,
    )
    return KVCacheCall(
        q, k_cache, v_cache, k, v, spec, cache, alibi,
        append_at=seqlens if k is not None else None,
        rotary=rotary, rotary_interleaved=rotary_interleaved,
        rotary_start=None if rotary is None else seqlens,
        q_positions_advance=local,
    )


def _validate_count(fn: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(fn, f"{name} must be an int, got {value!r}", TypeError)
    if value < 0:
        raise _fail(fn, f"{name} must be >= 0 (0 chooses automatically), got {value}")
    return value


def _validate_rotary(fn, cos, sin, q, interleaved, positions_needed) -> tuple[torch.Tensor, torch.Tensor] | None:
    _validate_bool(fn, "rotary_interleaved", interleaved)
    if cos is None and sin is None:
        return None
    if cos is None or sin is None:
        raise _fail(fn, "pass both rotary_cos and rotary_sin or neither")
    layout = "(seqlen_ro, rotary_dim / 2)"
    cos, sin = _validate_tensor(fn, "rotary_cos", cos, 2, layout), _validate_tensor(fn, "rotary_sin", sin, 2, layout)
    if cos.shape != sin.shape:
        raise _fail(fn, f"rotary_cos and rotary_sin must have the same shape, got {tuple(cos.shape)} and "
                        f"{tuple(sin.shape)}")
    if cos.device != q.device or sin.device != q.device:
        raise _fail(fn, f"rotary_cos/rotary_sin are on {cos.device}/{sin.device} but q is on {q.device}")
    if 2 * cos.shape[1] > q.shape[3]:
        raise _fail(fn, f"rotary_dim = 2 * rotary_cos.shape[1] = {2 * cos.shape[1]} exceeds headdim {q.shape[3]}")
    if cos.shape[0] < positions_needed:
        raise _fail(fn, f"rotary_cos/rotary_sin cover {cos.shape[0]} positions but this call reaches position "
                        f"{positions_needed - 1}")
    return cos, sin


def unpack(fn: str, name: str, packed: object, count: int, varlen: bool = False) -> tuple[torch.Tensor, ...]:
    """Split a packed (batch, seqlen, count, nheads, headdim) tensor, or (total, count, nheads, headdim) when
    ``varlen``, into ``count`` views."""
    layout = f"({'total' if varlen else 'batch, seqlen'}, {count}, nheads, headdim)"
    axis = 1 if varlen else 2
    packed = _validate_tensor(fn, name, packed, axis + 3, layout)
    if packed.shape[axis] != count:
        raise _fail(fn, f"{name} must have shape {layout}, got {tuple(packed.shape)}")
    return packed.unbind(axis)


def _validate_sdpa_mask(fn: str, mask: object, q: torch.Tensor, shape: tuple[int, int, int, int]):
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise _fail(fn, f"attn_mask must be a torch.Tensor or None, got {type(mask).__name__}", TypeError)
    if mask.dtype != torch.bool and mask.dtype != q.dtype:
        raise _fail(fn, f"attn_mask must be boolean or of the query's dtype {q.dtype}, got {mask.dtype}",
                    TypeError)
    if mask.device != q.device:
        raise _fail(fn, f"attn_mask is on {mask.device} but query is on {q.device}")
    if mask.dim() > 4 or any(m not in (1, n) for m, n in zip(mask.shape[::-1], shape[::-1], strict=False)):
        raise _fail(fn, f"attn_mask of shape {tuple(mask.shape)} does not broadcast to (batch, heads, L, S) = "
                        f"{shape}")
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def check_sdpa(
    fn: str,
    query: object,
    key: object,
    value: object,
    *,
    attn_mask: object = None,
    dropout_p: object = 0.0,
    is_causal: object = False,
    scale: object = None,
    enable_gqa: object = False,
) -> CheckedCall:
    """Validate ``scaled_dot_product_attention`` arguments: layout (batch, heads, L, E) and (batch, heads, S, Ev),
    top-left causal alignment. Returns the call in the flash layout (transposed views, no copies)."""
    layout_q, layout_kv = "(batch, heads, L, E)", "(batch, heads_kv, S, E)"
    q = _validate_tensor(fn, "query", query, 4, layout_q)
    k = _validate_tensor(fn, "key", key, 4, layout_kv)
    v = _validate_tensor(fn, "value", value, 4, "(batch, heads_kv, S, Ev)")
    _validate_same(fn, {"query": q, "key": k, "value": v})
    if k.shape[:3] != v.shape[:3]:
        raise _fail(fn, f"key and value must agree in (batch, heads, S), got {tuple(k.shape)} and "
                        f"{tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise _fail(fn, f"query {tuple(q.shape)} and key {tuple(k.shape)} must agree in batch and E")
    enable_gqa = _validate_bool(fn, "enable_gqa", enable_gqa)
    if q.shape[1] != k.shape[1]:
        if not enable_gqa:
            raise _fail(fn, f"query has {q.shape[1]} heads but key has {k.shape[1]}; pass enable_gqa=True "
                            "for grouped-query attention")
        _validate_heads(fn, q.shape[1], k.shape[1], "query", "key")
    is_causal = _validate_bool(fn, "is_causal", is_causal)
    if is_causal and attn_mask is not None:
        raise _fail(fn, "pass either attn_mask or is_causal=True, not both")
    mask = _validate_sdpa_mask(fn, attn_mask, q, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
    spec = AttentionSpec(
        scale=_validate_scale(fn, "scale", scale, q.shape[3]),
        window_left=-1,
        window_right=0 if is_causal else -1,
        bottom_right=False,
        dropout_p=_validate_dropout(fn, dropout_p),
    )
    return CheckedCall(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), spec, attn_mask=mask)
