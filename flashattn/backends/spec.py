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
        offset: moves the diagonal by this many columns on top of the alignment: query i of this call is query
            i + offset of a longer sequence whose keys start at this call's key 0 (context parallelism attends
            one chunk of queries to another chunk of keys).
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
    offset: int = 0
    softcap: float = 0.0
    dropout_p: float = 0.0
    seed: torch.Tensor | None = None
    deterministic: bool = False

    def band(self, nq: int, nk: int) -> Band:
        return Band.of(nq, nk, self.window_left, self.window_right, self.bottom_right, self.offset)


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


@dataclass(frozen=True)
class KeyCache:
    """Where each batch entry's keys and values live in a KV cache (inference; there is no backward).

    Batch entry b attends the ``k_end[b] - k_start[b]`` keys at cache positions ``k_start[b] .. k_end[b] - 1``
    (logical key j is position ``k_start[b] + j``; masks and ALiBi count j from 0). Position p is row p of cache
    entry ``batch_idx[b]`` (default b) of a dense cache (B_cache, N_cache, Hk, D), or, with ``block_table``
    (B, pages per sequence), row ``p % page_size`` of page ``block_table[b, p // page_size]`` of a paged cache
    (num_pages, page_size, Hk, D).

    ``max_seqlen_k`` bounds every ``k_end[b] - k_start[b]`` (it sizes the split-KV work). ``num_splits``: cut each
    sequence's keys into that many chunks, attend each separately and merge the partial results by their
    log-sum-exp (flash-decoding); 0 lets the backend choose.
    """

    k_start: torch.Tensor
    k_end: torch.Tensor
    max_seqlen_k: int
    batch_idx: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    num_splits: int = 1

    def bounds(self) -> list[tuple[int, int]]:
        """(first position, end position) per batch entry (reads the bounds on the host)."""
        return list(zip(self.k_start.tolist(), self.k_end.tolist(), strict=True))
