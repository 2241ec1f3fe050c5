"""The build of the ``cpu`` path's C++ kernel (``flashattn/csrc/cpu_flash.cpp`` and its headers): compiled with
the host C++ compiler at first use and cached.

The build (``torch.utils.cpp_extension.load``) lives in ``$FLASHATTN_CACHE/cpu`` (default ``~/.cache/flashattn``),
one folder per sources, compiler flags, CPU (it is compiled for the host's instruction set) and torch version;
two processes building at once wait for each other (an ``flock`` of our own, which dies with its process: under it
a lock file of cpp_extension's, left by a process killed while building, is stale and removed, where cpp_extension
itself would wait for it forever). The library registers typed
operators (``TORCH_LIBRARY``) in a namespace named after the build: ``module()`` is ``torch.ops.<that name>``.
A failed or broken build is logged once, and the ``cpu`` path then declines CPU calls (the ``torch`` path serves
them) instead of raising. ``FLASHATTN_CPU_KERNEL=0`` turns the kernel off. ``FLASHATTN_CPU_ISA=avx2`` builds it
for AVX2 and FMA only (``-march=x86-64-v3``) and hides the 16-bit dot-product engines (``cpu_tiles``), so an
AVX-512 machine runs what an AVX2-only one does: the test suite proves both on one host that way.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import shutil
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parents[1] / "csrc"
# The translation units, compiled side by side (ninja runs one per core): the registration, the forward's and the
# backward's instantiations (each about half of the build's time).
UNITS = (CSRC / "cpu_flash.cpp", CSRC / "cpu_flash_forward.cpp", CSRC / "cpu_flash_backward.cpp")
# Every file the build reads: a change to any of them is a new build folder.
SOURCES = (*UNITS, *(CSRC / name for name in (
    "cpu_ops.h", "cpu_vec.h", "cpu_dropout.h", "cpu_common.h", "cpu_gemm16.h", "cpu_tiles.h", "cpu_wide_tiles.h",
    "cpu_forward_tasks.h", "cpu_forward.h", "cpu_backward.h", "cpu_fp8.h", "cpu_fpenv.h",
    "cpu_score_rows.h", "cpu_amx.h")))
# -fopenmp: at::parallel_for is OpenMP in a header; without it the region runs on one thread and each matmul inside
# opens its own parallel region, which a busy machine slows several times over.
# -fvisibility=hidden: the library's own functions are called directly (and may be inlined), not through the PLT
# as symbols another library could replace; the ops register themselves when it loads, so it exports nothing.
FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
         "-fvisibility=hidden", "-fvisibility-inlines-hidden")
ISA_ENV = "FLASHATTN_CPU_ISA"
ISAS = {"native": "-march=native", "avx2": "-march=x86-64-v3"}  # x86-64-v3: AVX2, FMA, F16C, BMI
# at::vec::Vectorized picks its lane width from CPU_CAPABILITY, which torch defines for its own kernels only: the
# widest the host runs (-march=native compiles for it), else the portable one.
CAPABILITIES = (("AVX512", ("avx512f", "avx512bw", "avx512vl", "avx512dq")), ("AVX2", ("avx2", "fma")))
_log = logging.getLogger("flashattn")


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


def isa() -> str:
    """``FLASHATTN_CPU_ISA``: ``native`` (the default: every instruction this CPU has) or ``avx2`` (x86 only)."""
    chosen = os.environ.get(ISA_ENV, "").strip().lower() or "native"
    if chosen not in ISAS:
        raise ValueError(f"flashattn: {ISA_ENV}={chosen!r} is not one of {', '.join(ISAS)}")
    if chosen == "avx2" and (platform.machine() not in ("x86_64", "AMD64")
                             or not set(_cpu_signature().split()).issuperset(("avx2", "fma"))):
        raise ValueError(f"flashattn: {ISA_ENV}=avx2 needs an x86-64 CPU with AVX2 and FMA; this one "
                         f"({platform.machine()}) has not")
    return chosen


def compile_flags() -> list[str]:
    """The compiler flags of the build: ``FLAGS``, the target (``FLASHATTN_CPU_ISA``), ``CPU_CAPABILITY``."""
    return [*FLAGS, ISAS[isa()], *capability_flags()]


def capability_flags() -> list[str]:
    """The ``CPU_CAPABILITY`` defines for this host (x86: AVX512 or AVX2 where all their flags are present; AVX2
    under ``FLASHATTN_CPU_ISA=avx2``)."""
    flags = set(_cpu_signature().split())
    if isa() == "avx2":
        return ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    for name, needs in CAPABILITIES:
        if platform.machine() in ("x86_64", "AMD64") and flags.issuperset(needs):
            return [f"-DCPU_CAPABILITY={name}", f"-DCPU_CAPABILITY_{name}"]
    return ["-DCPU_CAPABILITY=DEFAULT"]


def build_name() -> str:
    key = "\n".join([*(path.read_text() for path in SOURCES), " ".join(compile_flags()), _cpu_signature(),
                     torch.__version__])
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
    """(module, the line ``status()`` gives) or (None, why not); logged once. A build folder that fails to load (a
    truncated or foreign library left by a killed build) is removed and built once more before giving up."""
    if os.environ.get("FLASHATTN_CPU_KERNEL", "1").strip() == "0":
        return None, "FLASHATTN_CPU_KERNEL=0"
    try:
        folder = cache_dir() / build_name()
    except ValueError as exc:  # a FLASHATTN_CPU_ISA this machine cannot honour
        _log.warning("%s; CPU calls run on the torch path", exc)
        return None, str(exc).removeprefix("flashattn: ")
    try:
        return _build(folder), f"built in {folder}"
    except Exception as exc:  # no compiler, a failed build, a broken cache: the torch path runs instead
        error = exc
    if any(folder.glob("*.so")):
        _log.info("flashattn: the CPU kernel's build in %s did not load (%s); rebuilding it", folder, _why(error))
        shutil.rmtree(folder, ignore_errors=True)
        try:
            return _build(folder), f"built in {folder}"
        except Exception as exc:
            error = exc
    _log.warning("flashattn: the CPU kernel could not be built (%s); CPU calls run on the torch path", _why(error))
    return None, _why(error)


def _why(exc: Exception) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}"


class _NoCudaNotice(logging.Filter):
    """Drops torch's "No CUDA runtime is found, using CUDA_HOME=..." (a CUDA build of torch on a machine without a
    GPU says it when cpp_extension loads): it is about CUDA, and this build is C++ for the CPU."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "No CUDA runtime is found" not in record.getMessage()


@contextlib.contextmanager
def _building(folder: Path):
    """The build folder to this process alone: an exclusive ``flock`` (released by the kernel when the process
    ends, however it ends), waited for; a no-op where there is no ``fcntl``."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(folder / "flashattn-build.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(folder: Path):
    _put_ninja_on_path()
    torch_log, quiet = logging.getLogger("torch.utils.cpp_extension"), _NoCudaNotice()
    torch_log.addFilter(quiet)
    try:
        from torch.utils.cpp_extension import load

        if not any(folder.glob("*.so")):  # said once: the first call on a machine waits for this
            _log.warning("flashattn: building the C++ CPU kernel for this machine (once per CPU and torch version, "
                         "about 20 s on two cores; cached in %s)", folder)
        folder.mkdir(parents=True, exist_ok=True)
        with _building(folder):
            baton = folder / "lock"  # cpp_extension's: nobody else is building, so a process that died left it
            if baton.exists():
                _log.info("flashattn: removing %s, left by a build that did not finish", baton)
                baton.unlink(missing_ok=True)
            load(name=folder.name, sources=[str(unit) for unit in UNITS], extra_cflags=compile_flags(),
                 extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False, is_python_module=False)
    finally:
        torch_log.removeFilter(quiet)
    ops = getattr(torch.ops, folder.name)
    for name in ("forward", "backward", "engines"):  # a library that loaded but registered nothing fails here
        getattr(ops, name)
    return ops


def status() -> tuple[bool, str]:
    """(whether the kernel is built and loaded, a line saying so or why not); builds it if needed."""
    module, line = _load()
    return module is not None, line


def module():
    """The loaded kernel's operators, ``torch.ops.<build name>`` (``forward``, ``backward``, ``engines``; built if
    needed); only called once ``status()`` said it is built."""
    loaded, why = _load()
    if loaded is None:
        raise RuntimeError(f"flashattn: the CPU kernel is not available ({why})")
    return loaded
