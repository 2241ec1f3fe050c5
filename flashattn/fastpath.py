"""The fast path of a repeated ``flash_attn_func`` call: a signature seen before goes straight to its launches.

What a call's checks conclude, which path runs it and what that path launches depend only on its signature: the
tensors' shapes, strides, dtypes, devices and 16-byte alignment, the option values, whether autograd records it,
and the context (the forced path, the stubbed GPU, the path's plan context: ``plans.context``, the CPU tile switch).
The first calls of a signature take the full way (checks, choice, the triton path's Python, which records a launch
plan: ``backends/triton/plans.py``; the cpu path's plan is its kernel call's options: ``backends/cpu.py``); once the
path holds a plan for it, the signature maps to an ``Entry`` holding
everything decided (the checked spec, the forward's plan), and a later call computes its key, allocates its outputs
and launches: no checks, choice, spec or op arguments (on a decode-sized call they cost more than the kernel). A
training step runs through ``_Planned``, an autograd function of q, k and v alone whose backward replays the
backward's plan, kept in the entry per gradient signature.

Calls it does not serve take the full way every time, with every check and error: torch.compile (which traces
the full way once), ``torch.func`` transforms and their tensors, tensor subclasses, the optional tensors (ALiBi,
sinks, block masks, FP8 scales and mode), dropout (a fresh seed per call), options of other types than plain
bools, ints and floats (some of which the checks refuse where an equal value passes), tensors without strides, CPU
calls the torch path runs (where the C++ kernel is not built), and whatever the paths do not plan (the cpu path
plans dense calls with rows it reads in place; its backward takes the op's way).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import backends, ops
from . import kvcache as cache_ops
from .backends.spec import AttentionSpec, Saved, cache_launch_keys
from .backends.triton import stubbed_device
from .batching import under_transform
from .checks.kvcache import cache_bounds
from .checks.on_device import CacheCheck

_TENSORS = (Tensor, torch.nn.Parameter)
# Options keyed by value must be of these types: a bool equals an int in a key, and the checks refuse a bool where
# they take a number.
_REALS = (float, int)
LIMIT = 4096  # signatures kept; past it the entries start over (a model has a handful)
# The paths with kept plans (forward_plan, backward_plan, cache_plan, plan_context, FORWARD_PLANS, BACKWARD_PLANS).
PLANNED_PATHS = ("triton", "cpu")


class Entry:
    """Everything decided for one signature: its checked spec, the triton path (``attend``), its forward's plan
    and the path's plan context it holds under, and the backward's plans by gradient signature."""

    __slots__ = ("backward", "context", "forward", "path", "spec")

    def __init__(self, spec: AttentionSpec, path, forward, context: tuple):
        self.spec, self.path, self.forward, self.context = spec, path, forward, context
        self.backward: dict[tuple, object] = {}

    def run(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.path.FORWARD_PLANS.replays += 1
        out, lse = self.forward.run((q, k, v), q.device)
        return out, lse

    def gradients(self, dout: Tensor | None, dlse: Tensor | None, saved: Saved) -> tuple[Tensor, Tensor, Tensor]:
        """(dq, dk, dv) by the backward's plan for this gradient signature, else by the op's backward (which
        records the plan, kept here for the next step)."""
        if dout is None:  # only lse's gradient flows (gradients are not materialized: _Planned)
            dout = torch.zeros_like(saved.out)
        context = self.path.plan_context()
        try:
            # out and lse are the forward plan's own allocations: their layout and alignment never vary.
            signature = (dout.shape, dout.stride(), dout.dtype, dout.device, dout.data_ptr() & 15,
                         None if dlse is None else (dlse.shape, dlse.stride(), dlse.dtype, dlse.device,
                                                    dlse.data_ptr() & 15), context)
        except RuntimeError:  # no storage: gradients batched by torch.func or gradcheck's older vmap
            signature = None
        if signature is None or under_transform():  # the op's backward, whose batching rule takes them
            return ops._eager_backward(dout, dlse, *saved, *self.spec.as_args(), self.path.NAME, False)[:3]
        plan = self.backward.get(signature)
        if plan is not None:
            self.path.BACKWARD_PLANS.replays += 1
            dq, dk, dv = plan.run((dout, dlse, *saved), saved.q.device)
            return dq, dk, dv
        dq, dk, dv, _ = ops._gradients(dout, dlse, saved, self.spec, backend=self.path.NAME, mask_grad=False)
        plan = self.path.backward_plan(dout, dlse, saved, self.spec) if context is not None else None
        if plan is not None:
            self.backward[signature] = plan
        return dq, dk, dv


class _Planned(torch.autograd.Function):
    """A training call of an ``Entry`` that returns lse: q, k, v in, (out, lse) out, the backward by the entry's
    plans. Gradients are not materialized: an unused lse passes None, not a tensor of zeros, to the backward.
    Forward and context in one function: the older form, one Python call less than ``setup_context``'s."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, entry: Entry) -> tuple[Tensor, Tensor]:
        out, lse = entry.run(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.entry = entry
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        return (*ctx.entry.gradients(dout, dlse, Saved(q, k, v, out, lse)), None)


class _PlannedOut(torch.autograd.Function):
    """``_Planned`` for a call that returns out alone (the usual training call): one output for autograd to
    wrap and differentiate, and lse, which no one else sees, kept on the context."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, entry: Entry) -> Tensor:
        out, ctx.lse = entry.run(q, k, v)
        ctx.save_for_backward(q, k, v, out)
        ctx.entry = entry
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out = ctx.saved_tensors
        return (*ctx.entry.gradients(dout, None, Saved(q, k, v, out, ctx.lse)), None)


# As ops._apply_eager: the C apply, without Function.apply's binding of the arguments by inspect.signature.
_apply_planned = torch._C._FunctionBase.__dict__["apply"].__get__(None, _Planned)
_apply_planned_out = torch._C._FunctionBase.__dict__["apply"].__get__(None, _PlannedOut)


_ENTRIES: dict[tuple, Entry] = {}


def flash(q: object, k: object, v: object, options: tuple, absent: tuple) -> tuple[tuple | None, object]:
    """(the call's key, its result) for ``flash_attn_func``'s q, k, v, its options (dropout_p, softmax_scale,
    causal, window_size, softcap, deterministic, return_attn_probs) and its optional arguments (``absent``: all
    must be None or False); the result is None where the fast path does not run the call, and the key None where
    it never will (``learn`` needs it). Nothing is served under torch.compile, which traces the full way."""
    if torch.compiler.is_compiling():
        return None, None
    if type(q) not in _TENSORS or type(k) not in _TENSORS or type(v) not in _TENSORS:
        return None, None
    for given in absent:
        if given is not None and given is not False:
            return None, None
    stubbed = stubbed_device()
    if not (q.is_cuda or q.is_cpu or stubbed is not None) or under_transform():
        return None, None
    dropout_p, scale, causal, window, softcap, deterministic, probs = options
    if not (type(dropout_p) in _REALS and dropout_p == 0 and type(softcap) in _REALS  # see _REALS
            and (scale is None or type(scale) in _REALS) and type(causal) is bool and type(deterministic) is bool
            and type(probs) is bool and type(window) is tuple and len(window) == 2 and type(window[0]) is int
            and type(window[1]) is int):
        return None, None
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    try:
        key = (q.shape, q.stride(), q.dtype, q.device, q.data_ptr() & 15, k.shape, k.stride(), k.dtype, k.device,
               k.data_ptr() & 15, v.shape, v.stride(), v.dtype, v.device, v.data_ptr() & 15, options, grad,
               backends.requested_by(), stubbed)
    except RuntimeError:  # no strides (sparse, nested, MKL-DNN) or no storage (torch.func's wrappers, even
        return None, None  # escaped from their transform): the full way, whose checks say what it is
    entry = _ENTRIES.get(key)
    if entry is None or entry.path.plan_context() != entry.context:  # a context of other launches
        return key, None
    if not options[-1]:  # return_attn_probs=False
        return key, (_apply_planned_out(q, k, v, entry) if grad else entry.run(q, k, v)[0])
    out, lse = _apply_planned(q, k, v, entry) if grad else entry.run(q, k, v)
    return key, (out, lse, None)


def sdpa(query: object, key: object, value: object, attn_mask: object, options: tuple) -> tuple[tuple | None, object]:
    """``flash`` for ``scaled_dot_product_attention`` with 4-D query, key and value (B, H, L, E) and no mask:
    ``options`` = (dropout_p, is_causal, scale, enable_gqa). The call runs as its flash-layout views
    (``q = query.transpose(1, 2)``), as the full way runs it, and its output is transposed back."""
    if torch.compiler.is_compiling() or attn_mask is not None or any(
            type(t) not in _TENSORS or t.dim() != 4 for t in (query, key, value)):
        return None, None
    dropout_p, causal, scale, gqa = options
    if not (type(dropout_p) in _REALS and dropout_p == 0 and type(causal) is bool and type(gqa) is bool
            and (scale is None or type(scale) in _REALS)):
        return None, None
    stubbed = stubbed_device()
    if not (query.is_cuda or query.is_cpu or stubbed is not None) or under_transform():
        return None, None
    grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    try:
        signature = ("sdpa", *map(_signature, (query, key, value)), options, grad, backends.requested_by(), stubbed)
    except RuntimeError:
        return None, None
    entry = _ENTRIES.get(signature)
    if entry is None or entry.path.plan_context() != entry.context:
        return signature, None
    # The checks make the views with view(shape) first (``checks.sdpa``), which gives a size-1 dim the stride a
    # reshape does: a stride never multiplied by an index but 0, and the plan's strides are its record's. Skipped.
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    out = _apply_planned_out(q, k, v, entry) if grad else entry.run(q, k, v)[0]
    return signature, out.transpose(1, 2)


def learn_sdpa(signature: tuple | None, call, query: Tensor, key: Tensor, value: Tensor) -> None:
    """``learn`` for an SDPA call whose checked flash-layout tensors are its inputs' transposed views (none for a
    call ``sdpa`` gave no signature)."""
    if signature is None:
        return
    for flash, given in zip((call.q, call.k, call.v), (query, key, value), strict=True):
        view = given.view(given.shape).transpose(1, 2)  # what ``sdpa`` will pass
        if flash.data_ptr() != view.data_ptr() or flash.shape != view.shape or flash.stride() != view.stride():
            return
    learn(signature, call.q, call.k, call.v, call.spec)


def learn(key: tuple, q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec) -> None:
    """After the full way ran a call of ``key`` (checked: its own q, k, v and spec), keep an entry for its
    signature once its path holds a plan: the triton path once it recorded one (the first call records it, the
    second finds it), the cpu path at once (``backends/cpu.py``: the kernel call's options)."""
    name = backends.choose(q, k, v, spec)
    if name not in PLANNED_PATHS:
        return
    path = backends.get(name)
    context = path.plan_context()
    plan = None if context is None else path.forward_plan(q, k, v, spec)
    if plan is None:
        return
    if len(_ENTRIES) >= LIMIT:
        _ENTRIES.clear()
    _ENTRIES[key] = Entry(spec, path, plan, context)


def clear() -> None:
    """Forget every entry (the next calls take the full way)."""
    _ENTRIES.clear()
    _CACHE_ENTRIES.clear()


# --- flash_attn_with_kvcache ---------------------------------------------------------------------------------------
# A decode step: the same signature at every step of a generation, only the lengths move. The key holds what the
# checks and the launch depend on, an int cache_seqlens by the key count its launch is sized for
# (``spec.cache_launch_keys``; one outside the cache goes the full way, to its error). The lengths and indices are
# checked and turned into bounds by the full way's own ``checks.kvcache.cache_bounds``, and new keys appended.


class CacheEntry:
    """Everything decided for one ``flash_attn_with_kvcache`` signature: its path, the path's cache plan (``run(q,
    k_cache, v_cache, bounds)``), the sizes the bounds' checks take, and the path's plan context it holds under."""

    __slots__ = ("check", "context", "path", "plan", "sizes")

    def __init__(self, path, plan, context: tuple, sizes):
        self.path, self.plan, self.context, self.sizes = path, plan, context, sizes
        self.check = CacheCheck("flash_attn_with_kvcache", sizes)  # the device check of a GPU's index values


_CACHE_ENTRIES: dict[tuple, CacheEntry] = {}


def _signature(t: Tensor | None) -> tuple | None:
    return t if t is None else (type(t), t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15)


def kvcache(given: tuple, cache_seqlens, indices: tuple, options: tuple, absent: tuple) -> tuple[tuple | None, object]:
    """(the call's key, its result) for ``flash_attn_with_kvcache``: ``given`` = (q, k_cache, v_cache, k, v),
    ``indices`` = (cache_leftpad, cache_batch_idx, block_table), ``options`` = (softmax_scale, causal,
    window_size, softcap, num_splits, return_softmax_lse) and ``absent`` what the fast path leaves to the full way
    (rotary, ALiBi, sinks, FP8 scales: all must be None). As ``flash``: the result is None where the fast path does
    not run the call, the key None where it never will."""
    if torch.compiler.is_compiling() or any(a is not None for a in absent):
        return None, None
    q, k_cache, v_cache, k, _ = given
    tensors = (*given, *indices)
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
        key = (*map(_signature, tensors), lengths, keys, options, backends.requested_by(), stubbed)
    except RuntimeError:  # no strides or storage: the full way's checks say what it is
        return None, None
    entry = _CACHE_ENTRIES.get(key)
    if entry is None or entry.path.plan_context() != entry.context:
        return key, None
    return key, _decode(entry, given, cache_seqlens, indices, return_lse)


def _decode(entry: CacheEntry, given: tuple, cache_seqlens, indices: tuple, return_lse: bool):
    """The call of a known signature: its bounds checked as the full way checks them (``cache_bounds``: on the
    host, or on the device), the append, the plan."""
    q, k_cache, v_cache, k, v = given
    lengths = _host_lengths(entry, given, cache_seqlens, indices)
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
    if k is not None:
        with torch.no_grad():
            cache_ops.append(k_cache, v_cache, k, v, at=bounds.seqlens, batch_idx=bounds.batch_idx,
                             block_table=bounds.block_table)
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


def learn_kvcache(key: tuple, call) -> None:
    """After the full way ran a ``flash_attn_with_kvcache`` call of ``key`` (checked: ``call``, a
    ``checks.KVCacheCall`` of the caller's own tensors), keep an entry for its signature once its path holds a
    plan (``cache_plan``: the triton path's recorded launches, the cpu path's kernel call)."""
    spec = call.spec
    name = backends.choose(call.q, call.k_cache, call.v_cache, spec)
    if call.rotary is not None or spec.descale is not None or name not in PLANNED_PATHS:
        return
    path = backends.get(name)
    context = path.plan_context()
    plan = None if context is None else path.cache_plan(call.q, call.k_cache, call.v_cache, spec)
    if plan is None:
        return
    if len(_CACHE_ENTRIES) >= LIMIT:
        _CACHE_ENTRIES.clear()
    _CACHE_ENTRIES[key] = CacheEntry(path, plan, context, call.sizes)
