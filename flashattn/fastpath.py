"""The fast path of a repeated ``flash_attn_func``, ``flash_attn_varlen_func`` or SDPA call: a signature seen
before goes straight to its launches (``fastdecode.py`` does the same for ``flash_attn_with_kvcache``).

What a call's checks conclude, which path runs it and what that path launches depend only on its signature: the
tensors' shapes, strides, dtypes, devices and 16-byte alignment, the option values, whether autograd records it,
and the context (the forced path, the stubbed GPU, the path's plan context: ``plans.context``, the CPU tile switch).
The first calls of a signature take the full way (checks, choice, the triton path's Python, which records a launch
plan: ``backends/triton/plans.py``; the cpu path's plan is its kernel call's options: ``backends/cpu.py``); once the
path holds a plan for it, the signature maps to an ``Entry`` holding
everything decided (the checked spec, the forward's plan), and a later call computes its key, allocates its outputs
and launches: no checks, choice, spec or op arguments (on a decode-sized call they cost more than the kernel). A
training step runs through ``_Planned``, an autograd function of q, k and v alone whose backward replays the
backward's plan, kept in the entry per gradient signature. A varlen call's offsets are values, not part of its
signature: each call's are checked as the full way checks them (on the device for a GPU's) and put in their
places among the plans' inputs (``VarlenEntry``).

Calls it does not serve take the full way every time, with every check and error: torch.compile (which traces
the full way once), ``torch.func`` transforms and their tensors, tensor subclasses, the optional tensors (ALiBi,
sinks, block masks, FP8 scales and mode), dropout (a fresh seed per call), options of other types than plain
bools, ints and floats (some of which the checks refuse where an equal value passes), tensors without strides, CPU
calls the torch path runs (where the C++ kernel is not built), and whatever the paths do not plan (the cpu path
plans dense calls with rows it reads in place; its backward takes the op's way).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from . import backends, ops
from .backends.spec import AttentionSpec, Saved, aliases
from .backends.triton import stubbed_device
from .batching import under_transform
from .checks.on_device import VarlenCheck, values_on_host
from .checks.values import VarlenSizes

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

    def run(self, q: Tensor, k: Tensor, v: Tensor, offsets: tuple | None = None) -> tuple[Tensor, Tensor]:
        """(out, lse) by the forward's plan; ``offsets``: a varlen call's (cu_seqlens_q, cu_seqlens_k)."""
        self.path.FORWARD_PLANS.replays += 1
        out, lse = self.forward.run((q, k, v) if offsets is None else self.forward.inputs((q, k, v), offsets),
                                    q.device)
        return out, lse

    def gradients(self, dout: Tensor | None, dlse: Tensor | None, saved: Saved,
                  offsets: tuple | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """(dq, dk, dv) by the backward's plan for this gradient signature, else by the op's backward (which
        records the plan, kept here for the next step); ``offsets`` as ``run``'s."""
        if dout is None:  # only lse's gradient flows (gradients are not materialized: _Planned)
            dout = torch.zeros_like(saved.out)
        context = self.path.plan_context()
        try:
            # out and lse are the forward plan's own allocations: their layout and alignment never vary.
            signature = (dout.shape, dout.stride(), dout.dtype, dout.device, dout.data_ptr() & 15,
                         None if dlse is None else (dlse.shape, dlse.stride(), dlse.dtype, dlse.device,
                                                    dlse.data_ptr() & 15), aliases((dout, dlse, *saved)), context)
        except RuntimeError:  # no storage: gradients batched by torch.func or gradcheck's older vmap
            signature = None
        plan = None if signature is None else self.backward.get(signature)
        if plan is not None and not under_transform():
            self.path.BACKWARD_PLANS.replays += 1
            head = (dout, dlse, *saved)
            dq, dk, dv = plan.run(head if offsets is None else self.forward.inputs(head, offsets), saved.q.device)
            return dq, dk, dv
        spec = self.spec if offsets is None else dataclasses.replace(self.spec, varlen=dataclasses.replace(
            self.spec.varlen, cu_seqlens_q=offsets[0], cu_seqlens_k=offsets[1]))
        if signature is None or under_transform():  # the op's backward, whose batching rule takes them
            return ops._eager_backward(dout, dlse, *saved, *spec.as_args(), self.path.NAME, False)[:3]
        dq, dk, dv, _ = ops._gradients(dout, dlse, saved, spec, backend=self.path.NAME, mask_grad=False)
        plan = self.path.backward_plan(dout, dlse, saved, spec) if context is not None else None
        if plan is not None:
            self.backward[signature] = plan
        return dq, dk, dv


class _Planned(torch.autograd.Function):
    """A training call of an ``Entry`` that returns lse: q, k, v in (and a varlen call's offsets, which take no
    gradient), (out, lse) out, the backward by the entry's plans. Gradients are not materialized: an unused lse
    passes None, not a tensor of zeros, to the backward. Forward and context in one function: the older form, one
    Python call less than ``setup_context``'s."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, entry: Entry, offsets: tuple | None) -> tuple[Tensor, Tensor]:
        out, lse = entry.run(q, k, v, offsets)
        # The offsets saved as tensors too: changed in place before the backward, they are an error, as the op's.
        ctx.save_for_backward(q, k, v, out, lse, *(offsets or ()))
        ctx.entry = entry
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *offsets = ctx.saved_tensors
        return (*ctx.entry.gradients(dout, dlse, Saved(q, k, v, out, lse), tuple(offsets) or None), None, None)


class _PlannedOut(torch.autograd.Function):
    """``_Planned`` for a call that returns out alone (the usual training call): one output for autograd to
    wrap and differentiate, and lse, which no one else sees, kept on the context."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, entry: Entry, offsets: tuple | None) -> Tensor:
        out, ctx.lse = entry.run(q, k, v, offsets)
        ctx.save_for_backward(q, k, v, out, *(offsets or ()))
        ctx.entry = entry
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, *offsets = ctx.saved_tensors
        return (*ctx.entry.gradients(dout, None, Saved(q, k, v, out, ctx.lse), tuple(offsets) or None), None, None)


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
    if not _plain_options(options):
        return None, None
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    try:
        key = (q.shape, q.stride(), q.dtype, q.device, q.data_ptr() & 15, k.shape, k.stride(), k.dtype, k.device,
               k.data_ptr() & 15, v.shape, v.stride(), v.dtype, v.device, v.data_ptr() & 15, k is q, v is q, v is k,
               options, grad, torch.are_deterministic_algorithms_enabled(), backends.requested_by(),
               stubbed)  # (is: the plans' slots, ``spec.aliases``; the switch: the checkers' ``deterministic``)
    except RuntimeError:  # no strides (sparse, nested, MKL-DNN) or no storage (torch.func's wrappers, even
        return None, None  # escaped from their transform): the full way, whose checks say what it is
    entry = _ENTRIES.get(key)
    if entry is None or entry.path.plan_context() != entry.context:  # a context of other launches
        return key, None
    if not options[-1]:  # return_attn_probs=False
        return key, (_apply_planned_out(q, k, v, entry, None) if grad else entry.run(q, k, v)[0])
    out, lse = _apply_planned(q, k, v, entry, None) if grad else entry.run(q, k, v)
    return key, (out, lse, None)


def _plain_options(options: tuple) -> bool:
    """Whether ``flash_attn_func``'s options (``flash``) are of the plain types the fast path keys by value, without
    dropout."""
    dropout_p, scale, causal, window, softcap, deterministic, probs = options
    return (type(dropout_p) in _REALS and dropout_p == 0 and type(softcap) in _REALS  # see _REALS
            and (scale is None or type(scale) in _REALS) and type(causal) is bool and type(deterministic) is bool
            and type(probs) is bool and type(window) is tuple and len(window) == 2 and type(window[0]) is int
            and type(window[1]) is int)


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
        signature = ("sdpa", *map(_signature, (query, key, value)), key is query, value is query, value is key,
                     options, grad, torch.are_deterministic_algorithms_enabled(), backends.requested_by(), stubbed)
    except RuntimeError:
        return None, None
    entry = _ENTRIES.get(signature)
    if entry is None or entry.path.plan_context() != entry.context:
        return signature, None
    # The checks make the views with view(shape) first (``checks.sdpa``), which gives a size-1 dim the stride a
    # reshape does: a stride never multiplied by an index but 0, and the plan's strides are its record's. Skipped.
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    out = _apply_planned_out(q, k, v, entry, None) if grad else entry.run(q, k, v)[0]
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


# --- flash_attn_varlen_func ---------------------------------------------------------------------------------------
# A packed batch: the same signature for every batch of a serving loop or a training run that packs to one total,
# only the offsets' values move. They are checked each call as the full way checks them: by the device check
# (``on_device.VarlenCheck``, no copy to the host) for a GPU's, on the host for a CPU's.

VARLEN = "flash_attn_varlen_func"


class VarlenEntry(Entry):
    """An ``Entry`` whose calls bring their offsets (and a paged K/V's block table): its forward is the path's
    ``varlen_plan``, and ``check`` checks each call's (cu_seqlens_q, cu_seqlens_k, block_table) on the device
    against its sizes (only GPU calls, or stubbed ones, have entries: the cpu path plans no packed call)."""

    __slots__ = ("check",)

    def __init__(self, spec: AttentionSpec, path, forward, context: tuple, sizes: VarlenSizes):
        super().__init__(spec, path, forward, context)
        self.check = VarlenCheck(VARLEN, sizes)


def varlen(given: tuple, maxima: tuple, options: tuple, absent: tuple) -> tuple[tuple | None, object]:
    """``flash`` for ``flash_attn_varlen_func``: ``given`` = (q, k, v, cu_seqlens_q, cu_seqlens_k, block_table or
    None), ``maxima`` = (max_seqlen_q, max_seqlen_k), ``options`` as ``flash``'s, and ``absent`` what the fast path
    leaves to the full way (ALiBi, sinks, FP8 scales and mode: all None or False). A paged K/V (a block table) is
    served without gradients: its key counts are worked out per call as the full way does."""
    table = given[5]
    if torch.compiler.is_compiling() or any(type(t) not in _TENSORS for t in given[:5]) or (
            table is not None and type(table) not in _TENSORS):
        return None, None
    for given_option in absent:
        if given_option is not None and given_option is not False:
            return None, None
    q, k, v, cu_q, cu_k, _ = given
    stubbed = stubbed_device()
    if (not (q.is_cuda or q.is_cpu or stubbed is not None) or under_transform() or not _plain_options(options)
            or type(maxima[0]) is not int or type(maxima[1]) is not int):
        return None, None
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if grad and table is not None:
        return None, None
    try:
        key = ("varlen", *map(_signature, given), aliases(given), maxima, options, grad,
               torch.are_deterministic_algorithms_enabled(), backends.requested_by(), stubbed)
    except RuntimeError:  # no strides or storage: the full way's checks say what it is
        return None, None
    entry = _ENTRIES.get(key)
    if entry is None or entry.path.plan_context() != entry.context:
        return key, None
    entry.check((cu_q, cu_k, table))
    # As the full way's KeyCache: a paged sequence's keys are its cu_seqlens_k difference.
    offsets = (cu_q, cu_k) if table is None else (cu_q, cu_k, cu_k[1:] - cu_k[:-1], table)
    if not options[-1]:  # return_attn_probs=False
        return key, (_apply_planned_out(q, k, v, entry, offsets) if grad else entry.run(q, k, v, offsets)[0])
    out, lse = _apply_planned(q, k, v, entry, offsets) if grad else entry.run(q, k, v, offsets)
    return key, (out, lse, None)


def learn_varlen(key: tuple | None, call, given: tuple) -> None:
    """``learn`` for a ``flash_attn_varlen_func`` call of ``key`` (checked: ``call``) if it holds the caller's own
    tensors, ``given`` = (q, k, v, cu_seqlens_q, cu_seqlens_k, block_table or None)."""
    spec = call.spec
    table = None if spec.cache is None else spec.cache.block_table
    if key is None or any(a is not b for a, b in zip(
            (call.q, call.k, call.v, spec.varlen.cu_seqlens_q, spec.varlen.cu_seqlens_k, table), given, strict=True)):
        return
    name = backends.choose(call.q, call.k, call.v, spec)
    if name not in PLANNED_PATHS or values_on_host(*given[3:]):  # (host values: the full way checks them there)
        return
    path = backends.get(name)
    context = path.plan_context()
    plan = None if context is None else path.varlen_plan(call.q, call.k, call.v, spec)
    if plan is None:
        return
    layout = spec.varlen
    paged = table is not None
    sizes = VarlenSizes(call.q.shape[0], None if paged else call.k.shape[0], layout.max_seqlen_q,  # as the full
                        layout.max_seqlen_k, num_pages=call.k.shape[0],  # way's (``checks.check_varlen``)
                        page_size=call.k.shape[1] if paged else 1)
    if len(_ENTRIES) >= LIMIT:
        _ENTRIES.clear()
    _ENTRIES[key] = VarlenEntry(spec, path, plan, context, sizes)


def clear() -> None:
    """Forget every entry, ``fastdecode``'s too (the next calls take the full way)."""
    from . import fastdecode

    _ENTRIES.clear()
    fastdecode.clear()


def _signature(t: Tensor | None) -> tuple | None:
    return t if t is None else (type(t), t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15)
