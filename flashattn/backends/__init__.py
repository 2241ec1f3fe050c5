"""Backends behind the one attention op, each a module satisfying ``Backend``; ``choose`` picks one by name.

Automatic choice: CUDA tensors (fp16/bf16/fp32, head dims up to 256, block masks of blocks that are multiples of
16) -> ``triton``, anything else -> ``cpu`` (the C++ kernel on CPU tensors, tiled PyTorch on every device).
Force one with the environment variable ``FLASHATTN_BACKEND=cpu|triton|cuda|auto`` or, taking precedence, the
context manager ``flashattn.use_backend("cpu")``. ``cuda`` (a fused CUDA C++ forward kernel, inference only,
fp16/bf16, head dim 64 or 128, causal or not) is never chosen automatically.
Forcing ``triton`` on CPU tensors needs ``TRITON_INTERPRET=1`` (set before triton is imported): that is how CI
checks the kernels without a GPU.

The choice is made when a call starts (under ``torch.compile``: when the graph is traced, so a graph keeps the
backend it was traced with) and travels with the call into the op, so a backward always runs on the backend of
its forward. Each distinct choice is logged once, with its reason, at debug level on ``logging.getLogger(
"flashattn")``; ``flashattn info`` shows the choice for typical inputs.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from .spec import AttentionSpec, Saved

__all__ = ["BACKENDS", "Backend", "choose", "explain", "get", "use_backend"]

BACKENDS = ("auto", "cpu", "triton", "cuda")
TRITON_MAX_HEAD_DIM = 256
TRITON_BLOCK_MULTIPLE = 16  # a block mask's blocks must be multiples of this for the Triton tiles to divide them
_forced: ContextVar[str | None] = ContextVar("flashattn_backend", default=None)
_log = logging.getLogger("flashattn")


@runtime_checkable
class Backend(Protocol):
    """What every backend module provides (``flashattn.backends.cpu`` is the reference implementation).

    Layouts: q (B, Nq, H, D), k (B, Nk, Hk, D), v (B, Nk, Hk, Dv) with H % Hk == 0; when ``spec.packed``, q is
    (total_q, H, D) and k, v (total_k, Hk, D) (or a KV cache when ``spec.cache`` is set: dense (B_cache, N_cache,
    Hk, D) or paged (num_pages, page_size, Hk, D)). lse is (B, H, Nq), or (H, total_q) when packed, in
    ``accumulation_dtype(q.dtype)``.
    """

    NAME: str

    def unsupported(self, q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, *,
                    return_probs: bool = False) -> str | None:
        """Why this backend cannot run the call (None when it can)."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, *,
                return_probs: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """(out, lse, probs): probs (B, H, Nq, Nk) with dropped entries negated if ``return_probs``, else empty."""

    def backward(self, dout: Tensor, dlse: Tensor | None, saved: Saved, spec: AttentionSpec, *,
                 mask_grad: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """(dq, dk, dv, dmask): gradients of q, k, v, and of the additive ``spec.attn_mask`` if ``mask_grad``."""


def _validate(name: object, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source} must be one of {', '.join(BACKENDS)}; got {name!r}")
    return name


def requested() -> str:
    """The backend asked for by ``use_backend`` or ``FLASHATTN_BACKEND`` ("auto" when neither is set)."""
    forced = _forced.get()
    if forced is not None:
        return forced
    return _validate(os.environ.get("FLASHATTN_BACKEND", "auto"), "FLASHATTN_BACKEND")


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@torch.compiler.assume_constant_result
def explain(device_type: str, dtype: torch.dtype, head_dim: int, odd_blocks: bool = False) -> tuple[str, str]:
    """(backend name, why) for a call on ``device_type`` tensors of ``dtype`` whose largest head dim (of q/k and
    of v) is ``head_dim`` (``odd_blocks``: with a block mask whose blocks are not multiples of 16, which the Triton
    tiles cannot divide): the forced backend, else the automatic choice.
    Each distinct answer is logged once at debug level on the ``flashattn`` logger.

    Example::

        >>> explain("cpu", torch.float32, 64)  # doctest: +ELLIPSIS
        ('cpu', 'auto: ...')
    """
    answer = _decide(device_type, dtype, head_dim, odd_blocks)
    if answer not in _logged:
        _logged.add(answer)
        _log.debug("backend %s: %s", *answer)
    return answer


_logged: set[tuple[str, str]] = set()


def _decide(device_type: str, dtype: torch.dtype, head_dim: int, odd_blocks: bool) -> tuple[str, str]:
    name = requested()
    if name != "auto":
        source = "use_backend()" if _forced.get() is not None else "FLASHATTN_BACKEND"
        return name, f"forced by {source}"
    if device_type != "cuda":
        return "cpu", f"auto: {device_type} tensors run on the tiled PyTorch path"
    if dtype == torch.float64:
        return "cpu", "auto: float64 has no Triton kernel; the tiled PyTorch path runs it"
    if odd_blocks:
        return "cpu", "auto: a block mask whose blocks are not multiples of 16 runs on the tiled PyTorch path"
    if head_dim > TRITON_MAX_HEAD_DIM:
        return "cpu", f"auto: head dim {head_dim} exceeds the Triton kernels' {TRITON_MAX_HEAD_DIM}"
    if not _triton_installed():
        return "cpu", "auto: triton is not installed (pip install 'flashattn[triton]')"
    return "triton", "auto: CUDA tensors run on the Triton kernels"


def choose(q: Tensor, v: Tensor, spec: AttentionSpec | None = None) -> str:
    """The name of the backend a call with query ``q``, value ``v`` and options ``spec`` runs on (``explain``)."""
    blocks = None if spec is None else spec.block_sparse
    odd_blocks = blocks is not None and bool(blocks.q_block % TRITON_BLOCK_MULTIPLE
                                             or blocks.kv_block % TRITON_BLOCK_MULTIPLE)
    return explain(q.device.type, q.dtype, max(q.shape[-1], v.shape[-1]), odd_blocks)[0]


def get(name: str) -> Backend:
    """The backend module called ``name`` (imported on first use: CPU-only installs need no triton)."""
    if name not in BACKENDS[1:]:
        raise ValueError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS[1:])}")
    return importlib.import_module(f"{__name__}.{name}")


@contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force a backend inside a ``with`` block: ``"cpu"``, ``"triton"``, ``"cuda"`` or ``"auto"``.

    Example::

        >>> q = k = v = torch.randn(1, 8, 2, 16)
        >>> with use_backend("cpu"):
        ...     out = flashattn.flash_attn_func(q, k, v)  # doctest: +SKIP
    """
    token = _forced.set(_validate(name, "use_backend(name)"))
    try:
        yield
    finally:
        _forced.reset(token)
