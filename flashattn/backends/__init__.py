"""Backends behind the one attention op. Each module offers ``forward``, ``backward`` and ``forward_cache`` (keys
in a KV cache, inference) with the signatures of ``flashattn.backends.cpu``; ``select`` picks one for the inputs.

Automatic choice: CUDA tensors (fp16/bf16/fp32, head dims up to 256) -> ``triton``, anything else -> ``cpu``
(tiled PyTorch, which runs on every device). Force one with the environment variable
``FLASHATTN_BACKEND=cpu|triton|cuda|auto`` or, taking precedence, the context manager
``flashattn.use_backend("cpu")``. ``cuda`` (a fused CUDA C++ forward kernel, inference only, fp16/bf16, head dim 64
or 128, causal or not) is never chosen automatically.
Forcing ``triton`` on CPU tensors needs ``TRITON_INTERPRET=1`` (set before triton is imported): that is how CI
checks the kernels without a GPU.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from types import ModuleType

import torch

from . import cpu

__all__ = ["BACKENDS", "select", "use_backend"]

BACKENDS = ("auto", "cpu", "triton", "cuda")
_forced: ContextVar[str | None] = ContextVar("flashattn_backend", default=None)


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


TRITON_MAX_HEAD_DIM = 256


def select(q: torch.Tensor, v: torch.Tensor) -> ModuleType:
    """The backend module for a call with query ``q`` and value ``v``."""
    name = requested()
    if name == "auto":
        triton_ok = (
            q.device.type == "cuda"
            and q.dtype != torch.float64
            and max(q.shape[-1], v.shape[-1]) <= TRITON_MAX_HEAD_DIM
            and importlib.util.find_spec("triton") is not None
        )
        name = "triton" if triton_ok else "cpu"
    if name == "triton":
        from . import triton as triton_backend  # imported on first use: CPU-only installs need no triton

        return triton_backend
    if name == "cuda":  # only on request: it covers a subset and has not been measured faster than triton
        from . import cuda as cuda_backend

        return cuda_backend
    return cpu


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
