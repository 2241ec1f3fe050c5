"""The fast path of a repeated ``flash_attn_with_kvcache`` call (``flashattn.fastpath``'s, for a decode step).

A decode step has the same signature at every step of a generation, only the lengths move. The key holds what the
checks and the launch depend on, an int cache_seqlens by the key count its launch is sized for
(``spec.cache_launch_keys``; one outside the cache goes the full way, to its error). The lengths and indices are
checked and turned into bounds by the full way's own ``checks.kvcache.cache_bounds``, and new keys appended.
"""

from __future__ import annotations

import torch

from . import backends
from . import kvcache as cache_ops
from .backends.spec import aliases, cache_launch_keys
from .backends.triton import stubbed_device
from .batching import under_transform
from .checks.kvcache import cache_bounds
from .checks.on_device import CacheCheck
from .fastpath import _REALS, _TENSORS, LIMIT, PLANNED_PATHS, _signature


class CacheEntry:
    """Everything decided for one ``flash_attn_with_kvcache`` signature: its path, the path's cache plan (``run(q,
    k_cache, v_cache, bounds)``), the sizes the bounds' checks take, and the path's plan context it holds under."""

    __slots__ = ("advance", "check", "context", "path", "plan", "prepare", "sizes")

    def __init__(self, path, plan, context: tuple, sizes, advance: bool):
        self.path, self.plan, self.context, self.sizes = path, plan, context, sizes
        self.check = CacheCheck("flash_attn_with_kvcache", sizes)  # the device check of a GPU's index values
        self.prepare = cache_ops.Appender()  # rotary and the append of new keys, its launcher kept
        self.advance = advance  # the queries' rotary positions advance (``KVCacheCall.q_positions_advance``)


_CACHE_ENTRIES: dict[tuple, CacheEntry] = {}


def kvcache(given: tuple, cache_seqlens, indices: tuple, rotary: tuple, options: tuple,
            absent: tuple) -> tuple[tuple | None, object]:
    """(the call's key, its result) for ``flash_attn_with_kvcache``: ``given`` = (q, k_cache, v_cache, k, v),
    ``indices`` = (cache_leftpad, cache_batch_idx, block_table), ``rotary`` = (rotary_cos, rotary_sin,
    rotary_interleaved), ``options`` = (softmax_scale, causal, window_size, softcap, num_splits,
    return_softmax_lse) and ``absent`` what the fast path leaves to the full way (ALiBi, sinks, FP8 scales: all
    must be None). As ``flash``: the result is None where the fast path does not run the call, the key None where
    it never will."""
    if (torch.compiler.is_compiling() or any(a is not None for a in absent) or type(rotary[2]) is not bool
            or (rotary[0] is None) != (rotary[1] is None)):
        return None, None
    q, k_cache, v_cache, k, _ = given
    tensors = (*given, *indices, *rotary[:2])
    if type(q) not in _TENSORS or type(k_cache) not in _TENSORS or type(v_cache) not in _TENSORS or any(
            t is not None and type(t) not in _TENSORS for t in tensors[3:]):
        return None, None
    stubbed = stubbed_device()
    if not (q.is_cuda or q.is_cpu or stubbed is not None) or under_transform():
        return None, None
    scale, causal, window, softcap, num_splits, return_lse = options
    if not ((scale is None or type(scale) in _REALS) and type(causal) is bool and type(softcap) in _REALS
            and type(num_splits) is int and type(return_lse) is bool and type(window) is tuple and len(window) == 2
            and type(window[0]) is int and type(window[1]) is int):
        return None, None
    table = indices[2]
    if k_cache.dim() != 4 or (k is not None and k.dim() != 4) or (table is not None and table.dim() != 2):
        return None, None
    new = 0 if k is None else k.shape[1]
    capacity = k_cache.shape[1] * (table.shape[1] if table is not None else 1)
    if type(cache_seqlens) is int:
        if not 0 <= cache_seqlens <= capacity - new:
            return None, None  # the full way says what is wrong
        keys, lengths = cache_launch_keys(cache_seqlens + new, capacity), "int"
    elif cache_seqlens is None or type(cache_seqlens) in _TENSORS:
        keys, lengths = capacity, _signature(cache_seqlens)  # lengths on the device: launches sized for them all
    else:
        return None, None
    try:
        key = (*map(_signature, tensors), aliases(tensors), rotary[2], lengths, keys, options,
               backends.requested_by(), stubbed)
    except RuntimeError:  # no strides or storage: the full way's checks say what it is
        return None, None
    entry = _CACHE_ENTRIES.get(key)
    if entry is None or entry.path.plan_context() != entry.context:
        return key, None
    return key, _decode(entry, given, cache_seqlens, indices, rotary, return_lse)


def _decode(entry: CacheEntry, given: tuple, cache_seqlens, indices: tuple, rotary: tuple, return_lse: bool):
    """The call of a known signature: its bounds checked as the full way checks them (``cache_bounds``: on the
    host, or on the device), the rotary and the append, the plan."""
    q, k_cache, v_cache, k, v = given
    lengths = None if rotary[0] is not None else _host_lengths(entry, given, cache_seqlens, indices)
    if lengths is not None:  # on the host and in range: no tensors of them
        if k is not None:
            with torch.no_grad():
                cache_ops.append_rows(k_cache, v_cache, k, v, at=lengths, batch_idx=None)
        entry.path.FORWARD_PLANS.replays += 1
        new = 0 if k is None else k.shape[1]
        out, lse = entry.plan.run_lengths(q, k_cache, v_cache, [n + new for n in lengths])
        return (out, lse) if return_lse else out
    bounds = cache_bounds("flash_attn_with_kvcache", cache_seqlens, indices, entry.sizes, q.device,
                          device_check=entry.check)
    if k is not None or rotary[0] is not None:
        q = entry.prepare(given, (bounds.seqlens, bounds.batch_idx, bounds.block_table),
                          None if rotary[0] is None else cache_ops.Rotary(*rotary, entry.advance))
    entry.path.FORWARD_PLANS.replays += 1
    out, lse = entry.plan.run(q, k_cache, v_cache, bounds)
    return (out, lse) if return_lse else out


def _host_lengths(entry: CacheEntry, given: tuple, cache_seqlens, indices: tuple) -> list[int] | None:
    """A cpu entry's lengths as ints where the call has no other index tensor and new keys of the cache's dtypes,
    if each is in range (an int: checked by ``kvcache``; a CPU tensor, int32 of shape (batch,) as its signature
    says: read here); else None: ``cache_bounds`` checks them, and says what is wrong."""
    q, k_cache, v_cache, k, v = given
    if (entry.path.NAME != "cpu" or indices != (None, None, None)
            or (k is not None and (k.dtype != k_cache.dtype or v.dtype != v_cache.dtype))):
        return None
    if type(cache_seqlens) is int:
        return [cache_seqlens] * q.shape[0]
    if cache_seqlens is None:
        return None
    lengths = cache_seqlens.tolist()
    room = entry.sizes.capacity - entry.sizes.new
    return lengths if all(0 <= n <= room for n in lengths) else None


def clear() -> None:
    """Forget every entry."""
    _CACHE_ENTRIES.clear()


def learn_kvcache(key: tuple, call, q) -> None:
    """After the full way ran a ``flash_attn_with_kvcache`` call of ``key`` (checked: ``call``, a
    ``checks.KVCacheCall`` of the caller's own tensors; ``q`` the queries it attended, rotated with rotary), keep
    an entry for its signature once its path holds a plan (``cache_plan``: the triton path's recorded launches,
    the cpu path's kernel call)."""
    spec = call.spec
    name = backends.choose(q, call.k_cache, call.v_cache, spec)
    if spec.descale is not None or name not in PLANNED_PATHS:
        return
    path = backends.get(name)
    context = path.plan_context()
    plan = None if context is None else path.cache_plan(q, call.k_cache, call.v_cache, spec)
    if plan is None:
        return
    if len(_CACHE_ENTRIES) >= LIMIT:
        _CACHE_ENTRIES.clear()
    _CACHE_ENTRIES[key] = CacheEntry(path, plan, context, call.sizes, call.q_positions_advance)
