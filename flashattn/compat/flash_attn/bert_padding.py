"""``flash_attn.bert_padding`` on flashattn: padded batches to the packed layout of the varlen functions and back.

``unpad_input`` and ``pad_input`` are ``flashattn.padding``'s; the index helpers are plain differentiable
indexing (flash_attn's custom autograd Functions exist for speed on its GPUs, not for a different result).

Example (after ``flashattn.install_as_flash_attn()``)::

    >>> from flash_attn.bert_padding import pad_input, unpad_input
    >>> x, mask = torch.randn(2, 4, 8), torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    >>> packed, indices, cu_seqlens, max_seqlen, _ = unpad_input(x, mask)
    >>> torch.equal(pad_input(packed, indices, 2, 4)[mask.bool()], x[mask.bool()])
    True
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor

from ... import checks
from ...padding import pad_input, unpad_input

__all__ = ["IndexFirstAxis", "IndexFirstAxisResidual", "IndexPutFirstAxis", "index_first_axis",
           "index_first_axis_residual", "index_put_first_axis", "pad_input", "unpad_input",
           "unpad_input_for_concatenated_sequences"]


def index_first_axis(input: Tensor, indices: Tensor) -> Tensor:  # noqa: A002 (flash_attn's name)
    """``input[indices]`` along the first axis: (first_axis_dim, ...) -> (len(indices), ...)."""
    _check_indices("index_first_axis", indices, input.shape[0])
    return input[indices]


def index_put_first_axis(values: Tensor, indices: Tensor, first_axis_dim: int) -> Tensor:
    """A zero (first_axis_dim, ...) tensor with ``values`` at ``indices``; gradients flow back to ``values``."""
    _check_indices("index_put_first_axis", indices, first_axis_dim)
    out = values.new_zeros(first_axis_dim, *values.shape[1:])
    return out.index_put((indices,), values)


def index_first_axis_residual(input: Tensor, indices: Tensor) -> tuple[Tensor, Tensor]:  # noqa: A002
    """``(input[indices], residual)``, as flash_attn's fused MLP uses it: the residual shares ``input``'s memory, and
    the gradients of both outputs flow back to ``input``."""
    _check_indices("index_first_axis_residual", indices, input.shape[0])
    return _IndexFirstAxisResidual.apply(input, indices)


class _IndexFirstAxisResidual(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, indices):  # noqa: A002
        ctx.save_for_backward(indices)
        return input[indices], input.detach()  # a detached alias: no copy, and no in-place complaint on the view

    @staticmethod
    def backward(ctx, grad_output, grad_residual):
        (indices,) = ctx.saved_tensors
        return grad_residual.clone().index_add_(0, indices, grad_output), None


# flash_attn exposes these helpers as autograd Functions too: ``IndexFirstAxis.apply(...)``.
IndexFirstAxis = SimpleNamespace(apply=index_first_axis)
IndexPutFirstAxis = SimpleNamespace(apply=index_put_first_axis)
IndexFirstAxisResidual = SimpleNamespace(apply=index_first_axis_residual)


def unpad_input_for_concatenated_sequences(hidden_states: Tensor,
                                           attention_mask_in_length: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    """Several short samples concatenated in each row: ``attention_mask_in_length`` (batch, seqlen) holds, per
    row, the samples' lengths followed by zeros ([[2, 3, 0, 0], ...]: a 2-token then a 3-token sample). Returns
    ``(packed, indices, cu_seqlens, max_seqlen)`` with one varlen sequence per sample, so that attention stays
    within each sample."""
    fn = "unpad_input_for_concatenated_sequences"
    lengths = attention_mask_in_length
    checks.check_padding_mask(fn, "attention_mask_in_length", hidden_states=hidden_states, mask=lengths)
    if lengths.is_floating_point():
        raise checks.fail(fn, f"attention_mask_in_length holds sample lengths: an integer tensor, got {lengths.dtype}")
    used = lengths.sum(dim=-1)
    seqlen = lengths.shape[-1]
    if bool((lengths < 0).any()) or bool((used > seqlen).any()):
        raise checks.fail(fn, f"each row's lengths must be >= 0 and sum to at most seqlen = {seqlen}, got row sums "
                              f"{used.tolist()}")
    kept = torch.arange(seqlen, device=lengths.device)[None, :] < used[:, None]
    samples = lengths.flatten()[lengths.flatten() != 0]
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(samples, dim=0, dtype=torch.int32), (1, 0))
    max_seqlen = int(samples.max()) if samples.numel() else 0
    return hidden_states.reshape(-1, *hidden_states.shape[2:])[indices], indices, cu_seqlens, max_seqlen


def _check_indices(fn: str, indices: object, first_axis_dim: int) -> None:
    if not isinstance(indices, Tensor) or indices.dim() != 1 or indices.is_floating_point():
        raise checks.fail(fn, f"indices must be a 1-D integer tensor, got "
                              f"{getattr(indices, 'shape', type(indices).__name__)}")
    if indices.numel() and not torch.compiler.is_compiling():
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= first_axis_dim:
            raise checks.fail(fn, f"indices must lie in [0, {first_axis_dim}), got values from {lo} to {hi}")
