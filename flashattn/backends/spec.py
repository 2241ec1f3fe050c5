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


@dataclass(frozen=True)
class Varlen:
    """The packed layout of a variable-length batch: sequence b owns query rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` and key rows ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``.

    ``max_seqlen_*`` bound every length; they also fix the dropout counter layout
    ((b * H + h) * max_seqlen_q + i) * max_seqlen_k + j, shared by every backend.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.numel() - 1

    def bounds(self) -> list[tuple[int, int, int, int]]:
        """(q start, q end, k start, k end) per sequence (reads the offsets on the host)."""
        cq, ck = self.cu_seqlens_q.tolist(), self.cu_seqlens_k.tolist()
        return [(cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(self.batch)]
