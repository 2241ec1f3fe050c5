"""What a call asks of an execution path: ``Request``, read off its inputs once, is all that a path's
``serves`` may look at, so every path declares what it serves in the same terms.

Example::

    >>> q = k = v = torch.randn(1, 8, 2, 16)
    >>> request = Request.of(q, k, v, AttentionSpec(scale=0.25, window_right=0, softcap=30.0))
    >>> request.device, request.head_dim, request.features  # causal is no feature: every path serves it
    ('cpu', 16, ('softcap',))
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .spec import AttentionSpec

# The options a path may or may not implement, by the names its refusals use ("window": a sliding window, beyond
# the causal mask that every path serves).
FEATURES = ("varlen", "kv cache", "alibi", "sink", "attn_mask", "block mask", "dropout", "softcap", "window",
            "return_attn_probs", "fp8")


class Request(NamedTuple):
    """One call as the paths see it (a tuple of plain values, so ``torch.compile`` treats the choice as a
    constant of the graph).

    Attributes:
        device: the inputs' device type: "cpu", "cuda", ...
        dtype: q's dtype.
        head_dim, head_dim_v: of q and k, and of v.
        features: the names (``FEATURES``) of the optional features the call uses.
        mask_blocks: a block mask's (query, key) block sizes; None without one.
        mask_grad: the gradient of an additive ``attn_mask`` will be asked for.
        grad: a gradient of q, k or v will be asked for (a backward follows).
    """

    device: str
    dtype: torch.dtype
    head_dim: int
    head_dim_v: int
    features: tuple[str, ...] = ()
    mask_blocks: tuple[int, int] | None = None
    mask_grad: bool = False
    grad: bool = False

    @classmethod
    def of(cls, q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, *, return_probs: bool = False) -> Request:
        """The request of a checked call (flash layout, ``spec`` from ``flashattn.checks``)."""
        used = (spec.varlen is not None, spec.cache is not None, spec.alibi_slopes is not None, spec.sink is not None,
                spec.attn_mask is not None, spec.block_sparse is not None, spec.dropout_p > 0, spec.softcap > 0,
                spec.window_left >= 0 or spec.window_right > 0, return_probs,
                spec.descale is not None or spec.fp8_training)  # in FEATURES' order
        blocks = spec.block_sparse
        grad_enabled = torch.is_grad_enabled()
        mask = spec.attn_mask
        return cls(
            device=q.device.type, dtype=q.dtype, head_dim=int(q.shape[-1]), head_dim_v=int(v.shape[-1]),
            features=tuple(name for name, on in zip(FEATURES, used, strict=True) if on),
            mask_blocks=None if blocks is None else (blocks.q_block, blocks.kv_block),
            mask_grad=grad_enabled and mask is not None and mask.dtype != torch.bool and mask.requires_grad,
            grad=grad_enabled and any(t.requires_grad for t in (q, k, v)),
        )

    def uses(self, feature: str) -> bool:
        """Whether the call uses ``feature`` (one of ``FEATURES``)."""
        if feature not in FEATURES:
            raise ValueError(f"Request.uses: unknown feature {feature!r}; one of {', '.join(FEATURES)}")
        return feature in self.features

    def describe(self) -> str:
        """The call in a few words, for messages: "cuda bfloat16 tensors of head dim 128"."""
        dims = (f"{self.head_dim}" if self.head_dim == self.head_dim_v
                else f"{self.head_dim} (q, k) and {self.head_dim_v} (v)")
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.device} {dtype} tensors of head dim {dims}"
