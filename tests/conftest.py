"""Fixtures shared by the test files (the repository root's conftest.py sets up Triton's interpreter).

``path``: the one way a feature test runs on every execution path: Triton's kernels (on a GPU, else under the
interpreter on CPU tensors), the C++ kernel (``cpu``) and the tiled PyTorch path (``torch``). A test takes the
fixture, puts its inputs on ``path.device`` and calls the public API inside it (the path is forced for the test's
body); ``path.skip_if_slow`` skips a case too large for the interpreter, which runs every Triton program in Python.
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
from contextlib import ExitStack
from dataclasses import dataclass

import pytest
import torch
from triton_versions import TRITON_MISSING

import flashattn
from flashattn.backends import Request, cpu_build, explain

HAS_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))
GPU = torch.cuda.is_available()
TRITON = importlib.util.find_spec("triton") is not None


INTERPRETED = not GPU and os.environ.get("TRITON_INTERPRET") == "1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_compiled(script: str, *, timeout: int = 280) -> str:
    """Run ``script`` (a path) in a process without Triton's interpreter, where kernels compile for a GPU (the
    stubbed launches of ``flashattn.backends.triton.stub``); assert it exits 0 and return what it printed."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (ROOT, os.path.join(ROOT, "tests"), env.get("PYTHONPATH"))))
    done = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout
PATHS = ("triton", "cpu", "torch")
FLOAT64_PATHS = ("cpu", "torch")  # the Triton kernels take no float64: tests of float64 exactness run on these
# Under the interpreter a call costs about 0.1 ms per score element (forward and backward, batch x heads x Nq x Nk):
# larger calls are left to a GPU.
INTERPRETER_SCORES = 16_384


@dataclass(frozen=True)
class ExecutionPath:
    """The path a test runs on: its name (``flashattn.backends.PATHS``) and the device its inputs belong on."""

    name: str
    device: str

    @property
    def exact_dtype(self) -> torch.dtype:
        """The most precise dtype the path takes: float64, or float32 on triton."""
        return torch.float32 if self.name == "triton" else torch.float64

    @property
    def interpreted(self) -> bool:
        """Triton's kernels running in the interpreter (no GPU): slow, and bf16 matmuls computed upcast."""
        return self.name == "triton" and self.device == "cpu"

    def put(self, *tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
        """``tensors`` on this path's device, each a leaf that requires grad where the original did."""
        return [None if t is None else t.detach().to(self.device).requires_grad_(t.requires_grad) for t in tensors]

    def skip_if_declines(self, dtype: torch.dtype, head_dim: int = 16, **request) -> None:
        """Skip when this path, forced, refuses such a call (float64 on triton, say), giving the path's reason;
        ``request``: other ``Request`` fields (``head_dim_v``, ``features``, ``mask_grad``, ...)."""
        request.setdefault("head_dim_v", head_dim)
        try:
            explain(Request(self.device, dtype, head_dim, **request))
        except ValueError as refused:
            pytest.skip(str(refused).split(": ", 1)[-1].split(". Let flashattn")[0])

    def skip_if_slow(self, scores: int, *, why: str = "") -> None:
        """Skip under the interpreter when a call has more than ``INTERPRETER_SCORES`` score elements."""
        if self.interpreted and scores > INTERPRETER_SCORES:
            pytest.skip(f"{scores} score elements are too many for Triton's interpreter{why} (a GPU runs them)")


def with_dropout_mask(q, k, v, p: float, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(out on the path under test, the weights it dropped): the mask comes from the torch path's S_dmask at the same
    seed; every path draws the same Philox numbers at the same counters (test_dropout_is_the_same_on_every_path)."""
    torch.manual_seed(7)
    with flashattn.use_backend("torch"):
        _, _, s_dmask = flashattn.flash_attn_func(q.detach(), k.detach(), v.detach(), dropout_p=p,
                                                  return_attn_probs=True, **kwargs)
    torch.manual_seed(7)
    return flashattn.flash_attn_func(q, k, v, dropout_p=p, **kwargs), torch.signbit(s_dmask)


def nvrtc_available() -> bool:
    """Whether the cuda path's compiler, NVRTC, loads here (a CUDA build of torch, or the test extra, ships it)."""
    from flashattn.backends.cuda import runtime

    try:
        runtime.nvrtc()
        return True
    except runtime.CompileError:
        return False


def _unavailable(name: str) -> str | None:
    if name == "triton" and TRITON_MISSING:
        return TRITON_MISSING
    if name == "triton" and not (GPU or INTERPRETED):
        return "no GPU and TRITON_INTERPRET is not set"
    if name == "cpu" and not HAS_COMPILER:
        return "no C++ compiler: the C++ kernel cannot be built"
    return None


def _selected_paths() -> tuple[str, ...]:
    """``FLASHATTN_TEST_PATHS`` (comma-separated), else every path: the GPU check runs the triton path's tests
    alone within its time budget (``tools.gpu_check``), the CPU paths being CI's."""
    chosen = tuple(p for p in os.environ.get("FLASHATTN_TEST_PATHS", "").split(",") if p) or PATHS
    unknown = [p for p in chosen if p not in PATHS]
    if unknown:
        raise pytest.UsageError(f"FLASHATTN_TEST_PATHS names {', '.join(unknown)}; the paths are {', '.join(PATHS)}")
    return chosen


def pytest_collection_modifyitems(config, items):
    """Deselect the tests of the paths ``FLASHATTN_TEST_PATHS`` leaves out."""
    chosen = _selected_paths()
    if chosen == PATHS:
        return
    def kept(item) -> bool:
        callspec = getattr(item, "callspec", None)
        return callspec is None or callspec.params.get("path", chosen[0]) in chosen

    dropped = [item for item in items if not kept(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if kept(item)]


@pytest.fixture(params=PATHS)
def path(request):
    """Runs the test once per execution path, forced for the test's body (``ExecutionPath``). A file or test may
    name fewer paths: ``@pytest.mark.parametrize("path", FLOAT64_PATHS, indirect=True)``."""
    name = request.param
    reason = _unavailable(name)
    if reason is not None:
        pytest.skip(reason)
    if name == "cpu":
        built, why = cpu_build.status()
        assert built, f"a C++ compiler is here, but the C++ kernel did not build: {why}"
    with flashattn.use_backend(name):
        yield ExecutionPath(name, "cuda" if name == "triton" and GPU else "cpu")


@pytest.fixture
def poisoned(monkeypatch):
    """While the test runs, every float tensor ``torch.empty``, ``empty_like`` and ``Tensor.new_empty`` hand out is
    full of NaN (their contract allows any content): an output element a path forgets to write shows up."""

    def poison(make):
        def made(*args, **kwargs):
            t = make(*args, **kwargs)
            return t.fill_(math.nan) if t.is_floating_point() else t

        return made

    for owner, name in ((torch, "empty"), (torch, "empty_like"), (torch.Tensor, "new_empty")):
        monkeypatch.setattr(owner, name, poison(getattr(owner, name)))


@pytest.fixture
def tiny_tiles(path, monkeypatch):
    """Force small tiles so every test shape spans many query and key blocks (mask edges, skipped blocks, partial
    last blocks), on the path under test; returns a function that applies them for a given batch x heads."""
    from flashattn.backends import cpu, tiled
    from flashattn.backends.triton import configs

    with ExitStack() as stack:

        def apply(batch_heads):
            if path.name == "torch":  # 13 query rows x 16 keys
                monkeypatch.setattr(tiled, "MAX_BLOCK_K", 16)
                monkeypatch.setattr(tiled, "MIN_BLOCK_Q", 1)
                monkeypatch.setattr(tiled, "TILE_ELEMENTS", 13 * 16 * batch_heads)
            elif path.name == "cpu":
                monkeypatch.setattr(cpu, "FORWARD_TILE", (13, 16))
                monkeypatch.setattr(cpu, "BACKWARD_TILE", (13, 16))
            else:  # the smallest tensor-core tile
                stack.enter_context(configs.use(configs.KernelConfig(16, 16, 4, 1)))

        yield apply
