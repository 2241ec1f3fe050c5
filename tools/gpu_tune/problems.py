"""What a tuning step times: one call per kernel group, at the sizes users run, built from a ``Problem``.

``forward`` times the Triton path's forward, ``backward`` its backward from a saved forward (the dK/dV and dQ
kernels with their preprocess), ``decode`` one decoding step against a long KV cache (the decode and split-KV
kernels with their merge). Each is called straight on the path's functions rather than through autograd: the
configs a step forces (``configs.use``) live in a context variable, which autograd's device threads would not see.

    >>> p = Problem("forward", "bfloat16", 128, smoke=True)
    >>> p.batch, p.seqlen, p.heads, p.flops(causal=False)
    (1, 32, 2, 1048576)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

GROUPS = {"forward": ("forward",), "backward": ("dkdv", "dq"), "decode": ("decode",)}
TOKENS, HIDDEN = 16384, 2048  # per batch, as the headline sweep: 2 x 8k tokens, 16 heads of 128
DECODE_BATCH, DECODE_CACHE, DECODE_HEADS = 4, 16384, (32, 8)  # GQA 32:8, as Llama-3-8B


@dataclass
class Problem:
    """The call a step times for kernel group ``group`` (``GROUPS``) at ``head_dim`` in ``dtype``; ``smoke``: toy
    sizes for Triton's interpreter."""

    group: str
    dtype: str
    head_dim: int
    smoke: bool = False

    def __post_init__(self):
        if self.group not in GROUPS:
            raise ValueError(f"tools.gpu_tune: group must be one of {', '.join(GROUPS)}, got {self.group!r}")
        if self.smoke:
            self.seqlen, self.batch, self.heads, self.heads_kv = 32, 1, 2, 1
        elif self.group == "decode":
            self.seqlen, self.batch = DECODE_CACHE, DECODE_BATCH
            self.heads, self.heads_kv = DECODE_HEADS
        else:
            self.seqlen = 8192
            self.batch = TOKENS // self.seqlen
            self.heads = self.heads_kv = max(1, HIDDEN // self.head_dim)

    @property
    def device(self) -> str:
        return "cpu" if self.smoke else "cuda"

    def flops(self, *, causal: bool) -> float:
        """4 B H Nq Nk d for the forward (half of it causal), 2.5 times that for the backward."""
        nq = 1 if self.group == "decode" else self.seqlen
        full = 4 * self.batch * self.heads * nq * self.seqlen * self.head_dim
        full *= 0.5 if causal and self.group != "decode" else 1
        return full * (2.5 if self.group == "backward" else 1)

    def inputs(self, seed: int) -> dict:
        """A fresh set of inputs: what ``call`` takes."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        dtype = getattr(torch, self.dtype)

        def randn(*shape):
            return torch.randn(*shape, generator=g, device=self.device, dtype=dtype)

        d, n = self.head_dim, self.seqlen
        if self.group == "decode":
            return {"q": randn(self.batch, 1, self.heads, d), "k": randn(self.batch, n, self.heads_kv, d),
                    "v": randn(self.batch, n, self.heads_kv, d)}
        q, k, v = (randn(self.batch, n, h, d) for h in (self.heads, self.heads_kv, self.heads_kv))
        return {"q": q, "k": k, "v": v, "dout": randn(self.batch, n, self.heads, d)}

    def bytes_per_set(self) -> int:
        """The bytes of one set of ``inputs`` (16-bit elements)."""
        nq = 1 if self.group == "decode" else self.seqlen
        q_like = (1 if self.group == "decode" else 2) * self.batch * nq * self.heads  # q, and dO for the backward
        return 2 * self.head_dim * (q_like + 2 * self.batch * self.seqlen * self.heads_kv)

    def rotation(self, l2_bytes: int) -> int:
        """How many input sets to cycle through so that each call finds its inputs out of the L2 cache."""
        return 1 if self.smoke else min(6, max(2, math.ceil(3 * l2_bytes / self.bytes_per_set())))

    def call(self, inputs: dict, *, causal: bool) -> Callable[[], object]:
        """The timed call on ``inputs``; what a backward needs from its forward is computed here, once."""
        from flashattn import flash_attn_with_kvcache
        from flashattn.backends.spec import AttentionSpec, Saved
        from flashattn.backends.triton import attend

        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        if self.group == "decode":
            return lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=self.seqlen, causal=causal)
        spec = AttentionSpec(scale=self.head_dim ** -0.5, window_right=0 if causal else -1)
        if self.group == "forward":
            return lambda: attend.forward(q, k, v, spec)[0]
        out, lse, _ = attend.forward(q, k, v, spec)
        saved = Saved(q, k, v, out, lse)
        return lambda: attend.backward(inputs["dout"], None, saved, spec)[:3]
