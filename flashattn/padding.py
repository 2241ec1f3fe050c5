"""Padding <-> packed conversion for the varlen functions; a drop-in for ``flash_attn.bert_padding``.

A padded batch (batch, seqlen, ...) with a (batch, seqlen) mask of real tokens becomes one packed tensor
(total, ...) plus the int32 offsets ``cu_seqlens`` that ``flash_attn_varlen_func`` takes, and back.

Example::

    >>> hidden = torch.randn(2, 4, 8)
    >>> mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    >>> packed, indices, cu_seqlens, max_seqlen, used = unpad_input(hidden, mask)
    >>> packed.shape, cu_seqlens.tolist(), max_seqlen
    (torch.Size([5, 8]), [0, 3, 5], 3)
    >>> torch.equal(pad_input(packed, indices, 2, 4)[mask.bool()], hidden[mask.bool()])
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import checks

__all__ = ["pad_input", "unpad_input"]


def unpad_input(
    hidden_states: Tensor, attention_mask: Tensor, unused_mask: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, int, Tensor]:
    """Keep the tokens where ``attention_mask`` is nonzero, packed batch by batch.

    Args:
        hidden_states: (batch, seqlen, ...).
        attention_mask: (batch, seqlen), nonzero (or True) for tokens that are used.
        unused_mask: optional (batch, seqlen) mask of tokens that are kept in the packed tensor but not counted as
            used (``flash_attn``'s "allocated but unused" tokens); they follow the used ones of their sequence.

    Returns:
        ``(packed, indices, cu_seqlens, max_seqlen, seqused)``: packed (total, ...); indices (total,) int64 flat
        positions in (batch * seqlen); cu_seqlens (batch + 1,) int32 offsets of each sequence in ``packed``;
        max_seqlen a Python int; seqused (batch,) int32 number of used tokens per sequence.
    """
    checks.check_padding_mask("unpad_input", "attention_mask", hidden_states=hidden_states, mask=attention_mask)
    if unused_mask is not None:
        checks.check_padding_mask("unpad_input", "unused_mask", hidden_states=hidden_states, mask=unused_mask)
    indices, cu_seqlens, max_seqlen, seqused = plan_unpad(attention_mask, unused_mask)
    packed = hidden_states.reshape(-1, *hidden_states.shape[2:])[indices]
    return packed, indices, cu_seqlens, max_seqlen, seqused


def plan_unpad(attention_mask: Tensor, unused_mask: Tensor | None = None) -> tuple[Tensor, Tensor, int, Tensor]:
    """What ``unpad_input`` returns besides the packed tensor, from the (batch, seqlen) masks alone:
    ``(indices, cu_seqlens, max_seqlen, seqused)``. Computing it reads the device (max_seqlen, the indices), so
    callers that unpad several tensors with one mask compute it once."""
    kept = attention_mask.bool() if unused_mask is None else attention_mask.bool() | unused_mask.bool()
    seqused = attention_mask.bool().sum(dim=-1, dtype=torch.int32)
    seqlens = kept.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, max_seqlen, seqused


def pad_input(hidden_states: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """Scatter packed tokens back to a zero-padded (batch, seqlen, ...) tensor; the inverse of ``unpad_input``.

    Differentiable: the gradient of a padded position is dropped, the others flow back to ``hidden_states``.
    """
    checks.check_pad("pad_input", hidden_states=hidden_states, indices=indices)
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out = out.index_put((indices,), hidden_states)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
