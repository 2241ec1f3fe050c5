"""What a backend is asked to compute: the validated, normalised scalar options of one attention call.

Tensors (q, k, v, ALiBi slopes, an additive or boolean mask) travel beside it; see ``flashattn.backends``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .masking import Band


@dataclass(frozen=True)
class AttentionSpec:
    """Options of one attention call, already checked by ``flashattn.checks``.

    Attributes:
        scale: multiplies q.k before anything else (default headdim ** -0.5 is filled in by the checker).
        window_left, window_right: the visible band ``-left <= j - i - shift <= right``; -1 is unbounded;
            causal is (-1, 0).
        bottom_right: align the band's diagonal to the bottom-right corner (flash_attn) or top-left (SDPA).
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)`` (after scaling, before masks).
        dropout_p: probability of dropping an attention weight; kept weights are scaled by 1 / (1 - p).
        seed: one-element int64 tensor on the inputs' device, the key of the counter-based dropout generator
            (``flashattn.backends.philox``); None without dropout. A tensor, so GPU kernels read it without a sync.
        deterministic: ask for bitwise-reproducible gradients (backends that could use atomics honour it).
    """

    scale: float
    window_left: int = -1
    window_right: int = -1
    bottom_right: bool = True
    softcap: float = 0.0
    dropout_p: float = 0.0
    seed: torch.Tensor | None = None
    deterministic: bool = False

    def band(self, nq: int, nk: int) -> Band:
        return Band.of(nq, nk, self.window_left, self.window_right, self.bottom_right)
