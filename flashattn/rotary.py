"""Rotary position embeddings (RoPE): rotate pairs of dims of q and k by angles that grow with the position.

Used by the training path (``flashattn.nn.SelfAttention``) and by inference on a KV cache
(``flash_attn_with_kvcache``); plain torch ops on any device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .backends.spec import accumulation_dtype


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, *, interleaved: bool) -> Tensor:
    """Rotate the first ``rotary_dim = 2 * cos.shape[1]`` dims of x (B, N, H, D) by the angles of ``positions``
    (B, N), or (1, N) for every sequence alike; computed in float32 (float64 stays float64), returned in x's dtype.

    Interleaved (GPT-J) rotates the pairs (x[2i], x[2i + 1]); otherwise (GPT-NeoX) the pairs (x[i], x[i + r/2]).
    Each pair (a, b) becomes (a cos - b sin, a sin + b cos) with the angle of pair i at that position.

    Example::

        >>> x = torch.tensor([[[[1.0, 0.0, 5.0]]]])  # one token, one head, rotary_dim 2 of headdim 3
        >>> cos, sin = torch.tensor([[1.0], [0.0]]), torch.tensor([[0.0], [1.0]])  # 0 deg at pos 0, 90 at pos 1
        >>> apply_rotary(x, cos, sin, torch.tensor([[1]]), interleaved=True)
        tensor([[[[0., 1., 5.]]]])
    """
    acc = accumulation_dtype(x.dtype)
    half = cos.shape[1]
    c = cos.to(acc)[positions][:, :, None, :]  # (B, N, 1, rotary_dim / 2): the same angle for every head
    s = sin.to(acc)[positions][:, :, None, :]
    rot = x[..., : 2 * half].to(acc)
    a, b = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., :half], rot[..., half:])
    ra, rb = a * c - b * s, a * s + b * c
    rot = torch.stack((ra, rb), dim=-1).flatten(-2) if interleaved else torch.cat((ra, rb), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., 2 * half :]), dim=-1)


def positions(start: Tensor, count: int, advance: bool = True) -> Tensor:
    """(B, count) positions start_b + t, or start_b for every t when not ``advance``."""
    steps = torch.arange(count, device=start.device) if advance else torch.zeros(count, device=start.device)
    return start.long()[:, None] + steps.long()[None, :]
