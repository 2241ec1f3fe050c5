"""The op under ``torch.func.vmap``: batching rules for ``flashattn::attention`` and its backward.

Inside ``vmap`` the kernels would see batched tensors they cannot read, so the op (its eager autograd function and
both registered ops) declares how to run a batch of calls: the mapped dimension folds into the batch dimension of
the flash layout, ``(V, B, N, H, D) -> (V * B, N, H, D)``, one call for the whole map, when every batched input is
one that folds that way (q, k, v, out, the gradients, ``attn_mask`` and ``alibi_slopes``, whose batch dimension is
1 or B); otherwise (packed sequences, a KV cache, FP8 scales, dropout, a mapped sink or block mask, a gradient
asked of the mask) the calls run one after another, each on its slice. Nested ``vmap`` and gradients through
either rule work because each calls the op again, one level down.

Dropout never folds: under ``vmap(randomness="same")`` every slice must draw the same pattern, which the slices of a
folded batch would not (the pattern depends on the batch index). With ``randomness="different"`` the dropout seed,
drawn by the caller from torch's generator, is itself batched, one per slice; ``"error"`` (vmap's default) refuses
the draw, as PyTorch's own dropout does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .backends.spec import AttentionSpec

# Positions in the forward op's arguments (q, k, v, *spec, backend, return_probs) and the backward's
# (dout, dlse, q, k, v, out, lse, *spec, backend, mask_grad).
_FORWARD_SPEC = 3
_BACKWARD_SPEC = 7
_N_SPEC = len(AttentionSpec(scale=1.0).as_args())
# Spec fields whose mapped dimension folds into the batch: both are (1 or B, ...).
_FOLDABLE = {AttentionSpec.arg_index("attn_mask"), AttentionSpec.arg_index("alibi_slopes")}


def under_transform() -> bool:
    """Whether a ``torch.func`` transform (vmap, grad, jacrev, ...) is active on this thread."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def is_transformed(*tensors: Tensor | None) -> bool:
    """Whether any of ``tensors`` is a ``torch.func`` wrapper (batched or grad-tracking)."""
    return any(t is not None and torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors)


# The batched tensors of the older, internal vmap (``torch._vmap_internals``), which ``torch.autograd.gradcheck``
# still uses for its batched gradients: it loops over the slices of a functional op (the registered backward op),
# never of one that writes into its arguments (the CPU kernel's).
_LEGACY_BATCHED = torch._C._parse_dispatch_key("Batched")


def is_legacy_batched(*tensors: Tensor | None) -> bool:
    """Whether any of ``tensors`` is batched by ``torch._vmap_internals``' vmap."""
    return any(t is not None and torch._C._dispatch_keys(t).has(_LEGACY_BATCHED) for t in tensors)


def forward_rule(run: Callable) -> Callable:
    """The batching rule of the forward: ``run(q, k, v, *spec, backend, return_probs)`` on the folded batch or on
    each slice. Returns (out, lse, probs) with the mapped dimension first."""

    def rule(info, in_dims: Sequence[int | None], *args):
        spec_args = args[_FORWARD_SPEC:_FORWARD_SPEC + _N_SPEC]
        spec_dims = in_dims[_FORWARD_SPEC:_FORWARD_SPEC + _N_SPEC]
        if not _folds(AttentionSpec.from_args(spec_args), spec_dims, mask_grad=False):
            return _one_by_one(run, info.batch_size, args, in_dims)
        size, batch = info.batch_size, _batch_of(args[:3], in_dims[:3])
        q, k, v = (_fold(t, d, size) for t, d in zip(args[:3], in_dims[:3], strict=True))
        spec = _fold_spec(spec_args, spec_dims, size, batch)
        out, lse, probs = run(q, k, v, *spec, *args[_FORWARD_SPEC + _N_SPEC:])
        return_probs = args[-1]
        unfold = (out.unflatten(0, (size, batch)), lse.unflatten(0, (size, batch)))
        if return_probs:
            return (*unfold, probs.unflatten(0, (size, batch))), (0, 0, 0)
        return (*unfold, probs), (0, 0, None)

    return rule


def backward_rule(run: Callable) -> Callable:
    """The batching rule of the backward: ``run(dout, dlse, q, k, v, out, lse, *spec, backend, mask_grad)``.
    Returns (dq, dk, dv, dmask) with the mapped dimension first (dmask's absent without ``mask_grad``)."""

    def rule(info, in_dims: Sequence[int | None], *args):
        spec_args = args[_BACKWARD_SPEC:_BACKWARD_SPEC + _N_SPEC]
        spec_dims = in_dims[_BACKWARD_SPEC:_BACKWARD_SPEC + _N_SPEC]
        mask_grad = args[-1]
        if not _folds(AttentionSpec.from_args(spec_args), spec_dims, mask_grad=mask_grad):
            return _one_by_one(run, info.batch_size, args, in_dims)
        size = info.batch_size
        batch = _batch_of(args[2:5], in_dims[2:5])
        dense = [None if t is None else _fold(t, d, size)
                 for t, d in zip(args[:_BACKWARD_SPEC], in_dims[:_BACKWARD_SPEC], strict=True)]
        spec = _fold_spec(spec_args, spec_dims, size, batch)
        dq, dk, dv, dmask = run(*dense, *spec, *args[_BACKWARD_SPEC + _N_SPEC:])
        return tuple(g.unflatten(0, (size, batch)) for g in (dq, dk, dv)) + (dmask,), (0, 0, 0, None)

    return rule


def _folds(spec: AttentionSpec, spec_dims: Sequence[int | None], *, mask_grad: bool) -> bool:
    """Whether one call on the folded batch computes every slice's call exactly."""
    if spec.packed or spec.cache is not None or spec.descale is not None or spec.fp8_training:
        return False
    if spec.dropout_p > 0 or mask_grad:  # the pattern, and the mask's gradient, are per slice
        return False
    if spec.block_sparse is not None and spec.block_sparse.tile_kind.shape[0] != 1:
        return False
    return all(d is None or i in _FOLDABLE for i, d in enumerate(spec_dims))


def _batch_of(tensors: Sequence[Tensor], dims: Sequence[int | None]) -> int:
    """B of the flash layout (B, N, H, D), read from the first of q, k, v (their B agree: the checker saw to it)."""
    t, d = tensors[0], dims[0]
    return t.shape[0] if d is None or d > 0 else t.shape[1]


def _leading(t: Tensor, dim: int | None, size: int) -> Tensor:
    """``t`` with the mapped dimension first, expanded to ``size`` where ``t`` is not mapped."""
    return t.expand(size, *t.shape) if dim is None else t.movedim(dim, 0)


def _fold(t: Tensor, dim: int | None, size: int) -> Tensor:
    """(V, B, ...) -> (V * B, ...): a view where the layout allows, else a copy."""
    return _leading(t, dim, size).flatten(0, 1)


def _fold_spec(spec_args: Sequence, spec_dims: Sequence[int | None], size: int, batch: int) -> list:
    """The spec's arguments for the folded batch: a mask or slopes of batch 1 stay as they are when not mapped, the
    others are expanded to (V, B, ...) and folded."""
    folded = list(spec_args)
    for i in _FOLDABLE:
        t, d = spec_args[i], spec_dims[i]
        if t is None or (d is None and t.shape[0] == 1):
            continue
        t = _leading(t, d, size)
        folded[i] = t.expand(size, batch, *t.shape[2:]).flatten(0, 1)
    return folded


def _one_by_one(run: Callable, size: int, args: Sequence, dims: Sequence[int | None]):
    """Every slice's call in turn, the results stacked: what any call can do."""
    results = [run(*(a if d is None else a.select(d, i) for a, d in zip(args, dims, strict=True)))
               for i in range(size)]
    return tuple(torch.stack(parts) for parts in zip(*results, strict=True)), (0,) * len(results[0])
