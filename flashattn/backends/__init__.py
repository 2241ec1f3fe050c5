"""The execution paths behind the one attention op, and the one rule that picks the path of a call.

Paths, each declaring what it serves (``serves(request)``: None, or why not, in the terms of ``Request``) and
running it (``forward``/``backward``, the ``Backend`` contract):

- ``triton``: fused Triton kernels for CUDA tensors (``backends/triton``);
- ``cpu``: the C++ kernel for CPU tensors, built at first use (``backends/cpu.py``);
- ``torch``: tiled FlashAttention-2 in PyTorch ops, every feature on every device (``backends/tiled.py``);
- ``cuda``: a fused CUDA C++ forward (fp16/bf16, head dim 64 or 128), only when asked for by name.

The automatic choice walks ``ORDER`` for the inputs' device and takes the first path that serves the call: CUDA
tensors run on triton, else torch (float64, head dims over 256, a mask's gradient); CPU tensors on the C++ kernel,
else torch (no compiler, returned probabilities); any other device on torch. Force a path with the environment
variable ``FLASHATTN_BACKEND`` or, taking precedence, ``flashattn.use_backend(name)``; a forced path that cannot
serve a call is an error naming why, except ``cpu``, which keeps the meaning it always had: the C++ kernel, and the
torch path for what the kernel does not serve (so settings made before the torch path had its own name still run).
Under ``TRITON_INTERPRET=1`` a forced ``triton`` runs CPU tensors in Triton's interpreter: how CI checks the kernels.

The choice is made when a call starts (under ``torch.compile``: when the graph is traced, so a graph keeps the path
it was traced with) and travels with the call into the op, so a backward always runs on the path of its forward.
Each distinct choice is logged once, with its reason, at debug level on ``logging.getLogger("flashattn")``;
``explain`` gives the reason, and ``flashattn info`` shows it for typical calls.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from types import ModuleType
from typing import NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor

from ..errors import ArgumentError
from . import cpu, cuda, tiled, triton
from .environ import Variable
from .request import Request
from .spec import AttentionSpec, Saved

__all__ = ["BACKENDS", "ORDER", "PATHS", "Backend", "Request", "choose", "explain", "get", "use_backend"]


class Path(NamedTuple):
    """An execution path: its name, what it is, what it serves, and the module of its ``forward`` and ``backward``
    (imported on first use: the triton path's imports triton)."""

    name: str
    title: str
    serves: Callable[[Request], str | None]
    module: str


PATHS = {path.name: path for path in (
    Path("triton", "the Triton kernels", triton.serves, f"{__name__}.triton.attend"),
    Path("cpu", "the C++ kernel", cpu.serves, f"{__name__}.cpu"),
    Path("torch", "tiled PyTorch", tiled.serves, f"{__name__}.tiled"),
    Path("cuda", "the CUDA C++ forward", cuda.serves, f"{__name__}.cuda"),
)}
BACKENDS = ("auto", *PATHS)  # what use_backend and FLASHATTN_BACKEND accept
# The automatic choice: the paths tried for each device type, in order; other devices run on torch.
ORDER = {"cuda": ("triton", "torch"), "cpu": ("cpu", "torch")}
OTHER_DEVICES = ("torch",)
# A forced name tries these paths in order: "cpu" keeps its older meaning (the kernel, else the tiled torch path).
FORCED = {"cpu": ("cpu", "torch")}
_forced: ContextVar[str | None] = ContextVar("flashattn_backend", default=None)
_BACKEND_ENV = Variable("FLASHATTN_BACKEND")
_log = logging.getLogger("flashattn")


@runtime_checkable
class Backend(Protocol):
    """What every path's module provides (``flashattn.backends.tiled`` is the reference implementation); what it
    serves is declared apart, in ``PATHS``.

    Layouts: q (B, Nq, H, D), k (B, Nk, Hk, D), v (B, Nk, Hk, Dv) with H % Hk == 0; when ``spec.packed``, q is
    (total_q, H, D) and k, v (total_k, Hk, D) (or a KV cache when ``spec.cache`` is set: dense (B_cache, N_cache,
    Hk, D) or paged (num_pages, page_size, Hk, D)). lse has the layout ``spec.lse_shape(q.shape)``, in
    ``accumulation_dtype(q.dtype)``.
    """

    NAME: str

    def forward(self, q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, *,
                return_probs: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """(out, lse, probs): probs (B, H, Nq, Nk) with dropped entries negated if ``return_probs``, else empty."""

    def backward(self, dout: Tensor, dlse: Tensor | None, saved: Saved, spec: AttentionSpec, *,
                 mask_grad: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """(dq, dk, dv, dmask): gradients of q, k, v, and of the additive ``spec.attn_mask`` if ``mask_grad``."""

    def fp8_backward(self, q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec) -> bool:
        """Whether ``backward`` takes the FP8 training mode's e4m3 q, k, v with their ``spec.descale`` (and returns
        gradients in dout's dtype); else the op hands it the 16-bit values they stand for."""


def _validate(name: object, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source} must be one of {', '.join(BACKENDS)}; got {name!r}")
    return name


def requested() -> str:
    """The name asked for by ``use_backend`` or ``FLASHATTN_BACKEND`` ("auto" when neither is set)."""
    forced = _forced.get()
    if forced is not None:
        return forced
    return _validate(_BACKEND_ENV.get("auto"), "FLASHATTN_BACKEND")


def requested_by() -> tuple[str | None, str | None]:
    """What forces a path, as it stands: ``use_backend``'s name and ``FLASHATTN_BACKEND``'s (part of the key of
    an answer kept for a call)."""
    return _forced.get(), _BACKEND_ENV.get()


def explain(request: Request) -> tuple[str, str]:
    """(path name, why) for a call (``Request``): the forced path, else the automatic choice, with the reasons
    of the paths passed over. A forced path that cannot serve the call raises ``ValueError`` saying why.
    Each distinct answer is logged once at debug level on the ``flashattn`` logger.

    Example::

        >>> explain(Request("cuda", torch.float64, 64, 64))  # doctest: +ELLIPSIS
        ('torch', 'auto: triton declines: ...; torch (tiled PyTorch) serves it')
    """
    answer = _decide(request)
    if answer not in _logged:
        _logged.add(answer)
        _log.debug("path %s: %s", *answer)
    return answer


_logged: set[tuple[str, str]] = set()


def _decide(request: Request) -> tuple[str, str]:
    name = requested()
    if name == "auto":
        return _first_serving(ORDER.get(request.device, OTHER_DEVICES), request, "auto")
    source = "use_backend()" if _forced.get() is not None else "FLASHATTN_BACKEND"
    if name in FORCED:
        return _first_serving(FORCED[name], request, f"{name!r} forced by {source}")
    reason = PATHS[name].serves(request)
    if reason is not None:
        raise ArgumentError(f"flashattn: the {name} path cannot run this call on {request.describe()} (forced by "
                         f"{source}): {reason}. Let flashattn choose (use_backend('auto'), or unset "
                         "FLASHATTN_BACKEND), or force a path that can.")
    return name, f"forced by {source}"


def _first_serving(names: tuple[str, ...], request: Request, how: str) -> tuple[str, str]:
    declined = []
    for name in names:
        reason = PATHS[name].serves(request)
        if reason is None:
            passed_over = "".join(f"{n} declines: {why}; " for n, why in declined)
            return name, f"{how}: {passed_over}{name} ({PATHS[name].title}) serves it"
        declined.append((name, reason))
    raise AssertionError(f"no path serves {request}: the torch path serves every call")  # pragma: no cover


def choose(q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, *, return_probs: bool = False) -> str:
    """The name of the path a call of checked inputs and options runs on (``explain``)."""
    request = Request.of(q, k, v, spec, return_probs=return_probs)
    if torch.compiler.is_compiling():
        return _choice(*request)
    stubbed = triton.stubbed_device()
    if request.device != "cuda" and stubbed is None:
        return _choice(*request)
    # GPU calls in eager mode: the answer of each request under each choice in force, remembered (deciding costs
    # a few us a call, a short call's kernel time). The CPU paths' answers may change (a kernel build can fail).
    situation = (request, *requested_by(), stubbed,
                 torch.cuda.current_device() if stubbed is None else None)
    name = _CHOSEN.get(situation)
    if name is None:
        name = _CHOSEN[situation] = explain(request)[0]
    return name


_CHOSEN: dict[tuple, str] = {}


def _constant_when_traced(fn: Callable) -> Callable:
    """``torch.compiler.assume_constant_result`` without importing ``torch._dynamo`` where nothing has yet (its
    import doubled ``import flashattn``'s time: 4.5 s of 8.6 on a slow 2-core machine, in every process): the mark
    dynamo's decorator sets, the same from torch 2.7 to 2.14 (torch marks its own ``justknobs_check`` so)."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


@_constant_when_traced
def _choice(*fields) -> str:
    """``explain``'s path for the request of these fields: a constant of a traced graph, evaluated once when
    ``torch.compile`` traces the call (a NamedTuple does not survive as such an argument; its fields do)."""
    return explain(Request(*fields))[0]


def get(name: str) -> ModuleType:
    """The module with the ``forward`` and ``backward`` of the path ``name`` (imported on first use: CPU-only
    installs need no triton)."""
    if name not in PATHS:
        raise ValueError(f"unknown path {name!r}; choose from {', '.join(PATHS)}")
    return importlib.import_module(PATHS[name].module)


@contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force a path inside a ``with`` block (it takes precedence over ``FLASHATTN_BACKEND``): ``"triton"`` (the
    Triton kernels), ``"cpu"`` (the C++ kernel, and the torch path for what it does not serve), ``"torch"`` (tiled
    PyTorch, any device), ``"cuda"`` (the CUDA C++ forward) or ``"auto"``. A forced path that cannot serve a call
    raises ``ValueError`` saying why, before anything runs.

    Example::

        >>> from flashattn import flash_attn_func
        >>> q = k = v = torch.randn(1, 8, 2, 16)
        >>> with use_backend("torch"):
        ...     out = flash_attn_func(q, k, v, causal=True)
        >>> out.shape
        torch.Size([1, 8, 2, 16])
    """
    token = _forced.set(_validate(name, "use_backend(name)"))
    try:
        yield
    finally:
        _forced.reset(token)
