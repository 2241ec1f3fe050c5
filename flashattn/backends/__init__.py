"""Backends behind the one attention op, each a module satisfying ``Backend``; ``choose`` picks one by name.

Automatic choice: CUDA tensors (fp16/bf16/fp32, head dims up to 256) -> ``triton``, anything else -> ``cpu``
(tiled PyTorch, which runs on every device). Force one with the environment variable
``FLASHATTN_BACKEND=cpu|triton|cuda|auto`` or, taking precedence, the context manager
``flashattn.use_backend("cpu")``. ``cuda`` (a fused CUDA C++ forward kernel, inference only, fp16/bf16, head dim 64
or 128, causal or not) is never chosen automatically.
Forcing ``triton`` on CPU tensors needs ``TRITON_INTERPRET=1`` (set before triton is imported): that is how CI
checks the kernels without a GPU.

The choice is made when a call starts (under ``torch.compile``: when the graph is traced) and travels with the
call into the op, so a backward always runs on the backend of its forward.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from .spec import AttentionSpec, Saved

__all__ = ["BACKENDS", "Backend", "choose", "get", "select", "use_backend"]

BACKENDS = ("auto", "cpu", "triton", "cuda")
TRITON_MAX_HEAD_DIM = 256
_forced: ContextVar[str | None] = ContextVar("flashattn_backend", default=None)


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


@torch.compiler.assume_constant_result
def requested() -> str:
    """The backend asked for by ``use_backend`` or ``FLASHATTN_BACKEND`` ("auto" when neither is set).

    Under ``torch.compile`` it is read when the graph is traced: a graph keeps the backend it was traced with.
    """
    forced = _forced.get()
    if forced is not None:
        return forced
    return _validate(os.environ.get("FLASHATTN_BACKEND", "auto"), "FLASHATTN_BACKEND")


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@torch.compiler.assume_constant_result
def _automatic(device_type: str, dtype: torch.dtype, head_dim: int) -> str:
    triton_ok = (device_type == "cuda" and dtype != torch.float64 and head_dim <= TRITON_MAX_HEAD_DIM
                 and _triton_installed())
    return "triton" if triton_ok else "cpu"


def choose(device_type: str, dtype: torch.dtype, head_dim: int) -> str:
    """The name of the backend for a call on ``device_type`` tensors of ``dtype`` whose largest head dim (of q/k
    and of v) is ``head_dim``: the forced one, else the automatic choice."""
    name = requested()
    return _automatic(device_type, dtype, head_dim) if name == "auto" else name


def select(q: Tensor, v: Tensor) -> Backend:
    """The backend module a call with query ``q`` and value ``v`` runs on: ``get(choose(...))``."""
    return get(choose(q.device.type, q.dtype, max(q.shape[-1], v.shape[-1])))


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
