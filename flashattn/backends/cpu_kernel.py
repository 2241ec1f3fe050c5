"""The CPU forward kernel (``flashattn/csrc/cpu_flash.cpp``): built with the host C++ compiler at first use, cached,
and used by the CPU backend where it serves the call; elsewhere, or where it cannot be built, the tiled PyTorch path
runs (``cpu.py``).

Why C++: the tiled path issues a dozen torch ops per tile, each its own parallel region that waits for its slowest
thread, so a busy machine slows it several times over. The kernel runs one parallel region per call over (batch,
head, query block), each task with its whole key loop and its tiles in cache; the matmuls of a tile go to the BLAS
torch ships.

The build (``torch.utils.cpp_extension.load``) lives in ``$FLASHATTN_CACHE/cpu`` (default ``~/.cache/flashattn``),
one folder per source, compiler flags and CPU (it is compiled for the host's instruction set); cpp_extension
rebuilds a changed source and locks the folder, so two processes building at once wait for each other.
``FLASHATTN_CPU_KERNEL=0`` turns the kernel off.

What it serves today: the forward of dense (B, N, H, D) calls in fp16, bf16, fp32 and fp64, with causal or window
bands at any alignment, softcap, ALiBi and GQA/MQA. Dropout, user masks, returned probabilities, packed (varlen)
and KV-cache calls, and every backward, run on the tiled path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

import torch

from .spec import AttentionSpec

SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "cpu_flash.cpp"
# -fopenmp: at::parallel_for is OpenMP in a header; without it the region runs on one thread and each matmul inside
# opens its own parallel region, which a busy machine slows several times over.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros")
# Query rows x keys of a task's tile: 128 x 256 measured best of 64-128 x 128-512 on 2 cores (fp32, d = 64, 128).
BLOCK_M, BLOCK_N = 128, 256
_log = logging.getLogger("flashattn")
_enabled: ContextVar[bool] = ContextVar("flashattn_cpu_kernel", default=True)


@contextmanager
def use(enabled: bool) -> Iterator[None]:
    """Run the CPU backend with (True) or without (False: the tiled path only) the kernel inside the block; how
    the tests cover both paths."""
    token = _enabled.set(enabled)
    try:
        yield
    finally:
        _enabled.reset(token)


def cache_dir() -> Path:
    return Path(os.environ.get("FLASHATTN_CACHE") or Path.home() / ".cache" / "flashattn") / "cpu"


def _cpu_signature() -> str:
    """The host's instruction-set flags (a build with -march=native must not run on another CPU)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def build_name() -> str:
    key = "\n".join([SOURCE.read_text(), " ".join(FLAGS), _cpu_signature(), torch.__version__])
    return "flashattn_cpu_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _put_ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH; the pip package's copy sits beside the interpreter, which a venv's
    python run without activating does not have on PATH."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def _load():
    """(module, None) or (None, why not); logged once."""
    if os.environ.get("FLASHATTN_CPU_KERNEL", "1").strip() == "0":
        return None, "FLASHATTN_CPU_KERNEL=0"
    try:
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()
        folder = cache_dir() / build_name()
        folder.mkdir(parents=True, exist_ok=True)
        module = load(name=build_name(), sources=[str(SOURCE)], extra_cflags=list(FLAGS), extra_ldflags=["-fopenmp"],
                      build_directory=str(folder),
                      verbose=False)
        return module, None
    except Exception as exc:  # no compiler, a failed build, a broken cache: the tiled path runs instead
        why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        _log.warning("flashattn: the CPU kernel could not be built (%s); using the tiled PyTorch path", why)
        return None, why


def status() -> tuple[bool, str]:
    """(whether the kernel is built and loaded, a line saying so or why not); builds it if needed."""
    module, why = _load()
    return (True, f"built in {cache_dir() / build_name()}") if module is not None else (False, why)


def unserved(q, k, v, spec: AttentionSpec, *, return_probs: bool) -> str | None:
    """Why the kernel does not serve this forward (None: it does)."""
    if not _enabled.get():
        return "turned off (cpu_kernel.use(False))"
    if q.device.type != "cpu":
        return "not a CPU tensor"
    if spec.dropout_p > 0 or spec.attn_mask is not None or return_probs:
        return "dropout, a user mask or returned probabilities"
    if spec.packed or spec.cache is not None:
        return "packed or cached keys"
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return "a head dim with a stride"
    return None


def forward(q, k, v, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(out, lse) from the kernel, or None when it is not available (the caller runs the tiled path).

    Example::

        >>> q = k = v = torch.randn(1, 5, 2, 8)
        >>> result = forward(q, k, v, AttentionSpec(scale=8 ** -0.5))
        >>> result is None or result[0].shape == (1, 5, 2, 8)
        True
    """
    module, _ = _load()
    if module is None:
        return None
    band = spec.band(q.shape[1], k.shape[1])
    alibi = spec.alibi_slopes
    if alibi is not None:
        alibi = alibi.reshape(-1, q.shape[2])
    out, lse = module.forward(q, k, v, alibi, float(spec.scale), float(spec.softcap), band.left, band.right,
                              band.diagonal, BLOCK_M, BLOCK_N)
    return out, lse
