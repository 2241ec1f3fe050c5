"""The one autograd op behind every entry point, registered with ``torch.library``.

``flashattn::attention`` computes (out, lse, probs) and ``flashattn::attention_backward`` its gradients. Their
schemas are derived from ``AttentionSpec`` (``AttentionSpec.op_schema``), so every option reaches the backends
through one type: ``attention(q, k, v, spec)`` flattens it, the op's implementation, its fake and its autograd
rebuild it. Being custom ops with fake (meta) implementations, they are opaque leaves to
``torch.compile(fullgraph=True)``: traced without graph breaks, dispatched to a backend at run time.

The FP8 training mode (``AttentionSpec.fp8_training``) is the op's own: it quantizes q, k, v before the path
(which sees FP8 inputs and their descale) and differentiates at the quantized values after: on the FP8 inputs
where the path's backward takes them (``fp8_backward``: FP8 matmuls), else on the 16-bit values they stand for.

The path is chosen before the op (``flashattn.backends.choose``, the one place that decides what can run a call)
and passed to it by name, so the backward of a call always runs on the path that ran its forward, wherever and on
whatever thread autograd runs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from . import backends, batching, quantize
from .backends.spec import AttentionSpec, Saved, accumulation_dtype, output_dtype

_SPEC = AttentionSpec.op_schema()
_MASK_GRAD_INDEX = 3 + AttentionSpec.arg_index("attn_mask")  # of attn_mask among the forward op's inputs
_SINK_GRAD_INDEX = 3 + AttentionSpec.arg_index("sink")


def _split(rest: tuple) -> tuple[AttentionSpec, str, bool]:
    """(spec, backend name, flag) from the op arguments that follow the leading tensors."""
    *spec_args, backend, flag = rest
    return AttentionSpec.from_args(spec_args), backend, flag


def _attention(q: Tensor, k: Tensor, v: Tensor, *rest) -> tuple[Tensor, Tensor, Tensor]:
    spec, backend, return_probs = _split(rest)
    return _forward(q, k, v, spec, backend, return_probs)


def _forward(q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, backend: str,
             return_probs: bool) -> tuple[Tensor, Tensor, Tensor]:
    if spec.fp8_training:  # quantized here, attended as FP8 inputs (FP8 matmuls where the path has them)
        q8, k8, v8, descale = quantize.quantized_inputs(q, k, v, spec)
        fp8 = dataclasses.replace(spec, fp8_training=False, descale=descale)
        out, lse, probs = backends.get(backend).forward(q8, k8, v8, fp8, return_probs=return_probs)
        return out.to(q.dtype), lse, probs
    return backends.get(backend).forward(q, k, v, spec, return_probs=return_probs)


def _attention_fake(q: Tensor, k: Tensor, v: Tensor, *rest) -> tuple[Tensor, Tensor, Tensor]:
    spec, _, return_probs = _split(rest)
    if spec.packed:  # q (total_q, H, D); probs padded to the maxima
        h, batch = q.shape[1], spec.varlen.batch
        nq, nk = spec.varlen.max_seqlen_q, spec.varlen.max_seqlen_k
    else:
        batch, nq, h = q.shape[:3]
        nk = k.shape[1]
    out = q.new_empty(*q.shape[:-1], v.shape[-1], dtype=output_dtype(q.dtype))
    lse = q.new_empty(spec.lse_shape(q.shape), dtype=accumulation_dtype(q.dtype))
    probs = q.new_empty(batch, h, nq, nk) if return_probs else q.new_empty(0)
    return out, lse, probs


def _attention_backward(dout: Tensor, dlse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                        lse: Tensor, *rest) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    spec, backend, mask_grad = _split(rest)
    return _gradients(dout, dlse, Saved(q, k, v, out, lse), spec, backend=backend, mask_grad=mask_grad)


def _gradients(dout: Tensor, dlse: Tensor | None, saved: Saved, spec: AttentionSpec, *, backend: str,
               mask_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The backward's implementation on the spec itself (``_attention_backward`` is it on the op's arguments)."""
    q, k, v = saved.q, saved.k, saved.v
    path = backends.get(backend)
    if spec.fp8_training:  # the gradients at the values the forward attended (straight through the rounding)
        q8, k8, v8, descale = quantize.quantized_inputs(q, k, v, spec)
        fp8 = dataclasses.replace(spec, fp8_training=False, descale=descale)
        if path.fp8_backward(q8, k8, v8, fp8):  # FP8 matmuls in the backward too
            q, k, v, spec = q8, k8, v8, fp8
        else:
            q, k, v = quantize.read_back(q8, k8, v8, descale, spec, q.dtype)
            spec = dataclasses.replace(spec, fp8_training=False)
    dq, dk, dv, dmask = path.backward(dout, dlse, saved._replace(q=q, k=k, v=v), spec, mask_grad=mask_grad)
    return dq, dk, dv, (dmask if dmask is not None else q.new_empty(0))


def _attention_backward_fake(dout, dlse, q, k, v, out, lse, *rest) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    spec, _, mask_grad = _split(rest)
    dmask = torch.empty_like(spec.attn_mask) if mask_grad else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dmask


_attention_op = torch.library.custom_op(
    "flashattn::attention", _attention, mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, {_SPEC}, str backend, bool return_probs) -> (Tensor, Tensor, Tensor)",
)
_attention_op.register_fake(_attention_fake)
_attention_op.register_vmap(batching.forward_rule(_attention_op))
_backward_op = torch.library.custom_op(
    "flashattn::attention_backward", _attention_backward, mutates_args=(),
    schema=f"(Tensor dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {_SPEC}, "
           "str backend, bool mask_grad) -> (Tensor, Tensor, Tensor, Tensor)",
)
_backward_op.register_fake(_attention_backward_fake)
_backward_op.register_vmap(batching.backward_rule(_backward_op))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, *rest = inputs
    out, lse, probs = output
    ctx.rest = rest[:-1]  # the spec's arguments and the backend name, minus return_probs
    ctx.n_inputs = len(inputs)
    mask = inputs[_MASK_GRAD_INDEX]
    ctx.mask_grad = mask is not None and mask.requires_grad
    # Tensors go through save_for_backward (version checks, no reference cycles); the spec's scalars through ctx.
    ctx.tensor_slots = [i for i, a in enumerate(ctx.rest) if isinstance(a, Tensor)]
    ctx.save_for_backward(q, k, v, out, lse, *(ctx.rest[i] for i in ctx.tensor_slots))
    ctx.rest = [None if i in ctx.tensor_slots else a for i, a in enumerate(ctx.rest)]
    ctx.mark_non_differentiable(probs)


def _backward_with(run: Callable) -> Callable:
    """The autograd backward of the op, running the gradients through ``run`` (the registered backward op, or its
    implementation directly in eager mode)."""

    def backward(ctx, dout, dlse, _dprobs):
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        if dout is None:  # only lse's gradient flows (not materialized: _EagerAttention)
            dout = torch.zeros_like(out)
        rest = list(ctx.rest)
        for slot, t in zip(ctx.tensor_slots, tensors, strict=True):
            rest[slot] = t
        spec, backend, _ = _split((*rest, False))
        if spec.cache is not None:
            grads = _cache_backward(ctx, dout, dlse, Saved(q, k, v, out, lse), spec, backend)
        else:
            if run is _eager_backward and not _transformed_gradients(dout, dlse):  # the spec is at hand
                dq, dk, dv, dmask = _gradients(dout, dlse, Saved(q, k, v, out, lse), spec, backend=backend,
                                               mask_grad=ctx.mask_grad)
            else:
                dq, dk, dv, dmask = run(dout, dlse, q, k, v, out, lse, *rest, ctx.mask_grad)
            grads = [None] * ctx.n_inputs
            grads[:3] = dq, dk, dv
            if ctx.mask_grad:
                grads[_MASK_GRAD_INDEX] = dmask
        if ctx.needs_input_grad[_SINK_GRAD_INDEX]:
            grads[_SINK_GRAD_INDEX] = sink_grad(dout, dlse, out, lse, spec.sink)
        return tuple(grads)

    return backward


def _cache_backward(ctx, dout, dlse, saved: Saved, spec: AttentionSpec, backend: str) -> tuple:
    """dq of a call whose keys live in a KV cache (paged varlen): the keys are gathered into a packed batch and
    differentiated as an ordinary varlen call. The cache itself receives no gradient."""
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        raise RuntimeError("flashattn: a paged K/V (block_table) receives no gradient: it is a cache, read in "
                           "place. Detach k and v (the gradient of q is computed), or pass them unpaged.")
    k, v, cu_seqlens_k = spec.cache.gather(saved.k, saved.v)
    varlen = dataclasses.replace(spec.varlen, cu_seqlens_k=cu_seqlens_k)
    packed = dataclasses.replace(spec, cache=None, varlen=varlen)
    dq, _, _ = attention_backward(dout, dlse, saved._replace(k=k, v=v), packed, backend=backend)
    return [dq, *([None] * (ctx.n_inputs - 1))]


def sink_grad(dout: Tensor, dlse: Tensor | None, out: Tensor, lse: Tensor, sink: Tensor) -> Tensor:
    """The gradient of the learnable sink logits (H,), from the results alone: with P_sink = exp(sink - lse) the
    sink's weight in each row, d out_i / d sink = -P_sink O_i and d lse_i / d sink = P_sink, so
    d sink_h = -sum over h's rows of P_sink (rowsum(dO * O) - dlse). Dropout does not change it (it scales the
    weights P_ij, not their sum). out (B, Nq, H, Dv) or packed (total, H, Dv); lse (B, H, Nq) or (H, total)."""
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(-1, -2)  # lse's layout
    if dlse is not None:
        delta = delta - dlse.to(acc)
    weight = torch.exp(sink.to(acc)[:, None] - lse)
    weight = torch.where(lse == float("-inf"), torch.zeros_like(weight), weight)  # sink = -inf: never taken
    return -(weight * delta).sum(-1).reshape(-1, sink.shape[0]).sum(0).to(sink.dtype)


_attention_op.register_autograd(_backward_with(_backward_op), setup_context=_setup_context)


class _Gradients(torch.autograd.Function):
    """The backward's implementation as an autograd function of its own, for ``torch.func`` transforms of the
    gradients (``vmap`` over ``autograd.grad``: gradcheck's batched gradients, ``jacrev``; ``torch.func.grad``):
    it carries the backward's batching rule, which the registered op's autograd wrapper cannot take into ``grad``.
    The gradients themselves are not differentiable (no double backward)."""

    forward = staticmethod(_attention_backward)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("flashattn: the attention backward is not differentiable (no double backward, no "
                           "gradients of gradients); differentiate the attention once")


_Gradients.vmap = staticmethod(batching.backward_rule(_Gradients.apply))


def _transformed_gradients(dout: Tensor, dlse: Tensor | None) -> bool:
    """Whether the gradients are batched (gradcheck's older vmap, or torch.func's) or a transform is active."""
    return batching.is_legacy_batched(dout, dlse) or batching.is_transformed(dout, dlse) or batching.under_transform()


def _eager_backward(dout, dlse, *rest):
    """The backward's implementation, through ``_Gradients`` where a ``torch.func`` transform is active, through
    the registered op (functional: the older vmap loops over it) under gradcheck's batched gradients."""
    if batching.is_legacy_batched(dout, dlse):
        return _backward_op(dout, dlse, *rest)
    if batching.is_transformed(dout, dlse) or batching.under_transform():
        return _Gradients.apply(dout, dlse, *rest)
    return _attention_backward(dout, dlse, *rest)


class _EagerAttention(torch.autograd.Function):
    """The op's autograd without the op's dispatch, for eager training steps and ``torch.func`` transforms: the
    same forward, context and backward functions, and the op's batching rule (``flashattn.batching``).
    torch.library's autograd wrapper re-reads the whole schema on every call (about 0.3 ms with AttentionSpec's
    arguments), more than a short sequence's attention costs, and does not compose with ``torch.func.grad``."""

    forward = staticmethod(_attention)
    backward = staticmethod(_backward_with(_eager_backward))

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _setup_context(ctx, inputs, output)
        # An unused lse (or out) reaches the backward as None, not as zeros allocated for it: what the fast path
        # (flashattn.fastpath) passes too, so that the two launch the same backward.
        ctx.set_materialize_grads(False)


_EagerAttention.vmap = staticmethod(batching.forward_rule(_EagerAttention.apply))
# Function.apply binds the arguments to forward's signature by inspect.signature on every call (forward has no
# defaults to fill in: 20-40 us wasted); outside torch.func's transforms the C apply underneath does the rest.
_apply_eager = torch._C._FunctionBase.__dict__["apply"].__get__(None, _EagerAttention)


def attention(q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, *, return_probs: bool = False,
              backend: str | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Run the op on checked inputs in the flash layout: q (B, Nq, H, D), k (B, Nk, Hk, D), v (B, Nk, Hk, Dv),
    or packed (total, H, D) when ``spec.varlen`` is set, or keys in a KV cache when ``spec.cache`` is set.

    Returns (out (B, Nq, H, Dv), lse (B, H, Nq), probs (B, H, Nq, Nk) or an empty tensor); varlen: out
    (total_q, H, Dv), lse (H, total_q), probs (B, H, max_seqlen_q, max_seqlen_k). ``backend`` (a name from
    ``flashattn.backends.PATHS``) overrides the choice, e.g. to run several blocks of one layer on one backend.
    """
    backend = backend or backends.choose(q, k, v, spec, return_probs=return_probs)
    if torch.compiler.is_compiling():  # the registered op: a leaf of the graph, with its fake and autograd
        return _attention_op(q, k, v, *spec.as_args(), backend, return_probs)
    # Eager: the same code without the op's dispatch (Python, 0.1-0.4 ms a call, more than a decode step's
    # attention): the backend directly for inference, the op's autograd functions for training and under
    # torch.func's transforms (whose batching rule they carry).
    if batching.under_transform() or batching.is_transformed(q, k, v, spec.attn_mask):  # (or escaped from one)
        return _EagerAttention.apply(q, k, v, *spec.as_args(), backend, return_probs)
    if _records_grad(q, k, v, spec):
        return _apply_eager(q, k, v, *spec.as_args(), backend, return_probs)
    return _forward(q, k, v, spec, backend, return_probs)


def _records_grad(q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, Tensor) and t.requires_grad for t in (q, k, v, spec.attn_mask, spec.alibi_slopes, spec.sink))


def attention_backward(dout: Tensor, dlse: Tensor | None, saved: Saved, spec: AttentionSpec, *,
                       backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one call given its saved inputs and results (``Saved``) and the gradients of its out and
    lse. Used for blocks of a longer sequence: with the whole attention's ``out`` and ``lse`` (the final
    statistics), P = exp(S - lse) of the block is exact, so the block's gradients are its exact share."""
    run = _backward_op if torch.compiler.is_compiling() else _attention_backward  # eager: no dispatch, as above
    dq, dk, dv, _ = run(dout, dlse, *saved, *spec.as_args(), backend, False)
    return dq, dk, dv
