"""Seconds spent compiling, per process, for gpu-check's accounting: Triton's kernels (its compilation listener:
cache hits and misses with their times) and the launcher stubs Triton builds with the host C compiler.

Each process that runs kernels installs the clock once (``install()``; the step wrapper ``tools.gpu_check.step``
the smoke's workers and the pytest plugin ``tools.gpu_check.pytest_plugin`` do); every
compilation appends one JSON line to the file named by ``GPU_CHECK_COMPILE_LOG`` at once, so a process stopped
mid-step has still counted what it compiled. ``total(path)`` sums a step's lines.
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path

ENV = "GPU_CHECK_COMPILE_LOG"
FIELDS = ("kernels", "kernel_seconds", "cache_hits", "launchers", "launcher_seconds")


def _record(**counts) -> None:
    path = os.environ.get(ENV)
    if path:
        with open(path, "a") as f:  # one short line per event: appends from parallel processes stay whole
            f.write(json.dumps(counts) + "\n")


def _listener(*, src, metadata, metadata_group, times, cache_hit) -> None:
    if cache_hit:
        _record(cache_hits=1)
    else:
        _record(kernels=1, kernel_seconds=times.total / 1e6)  # microseconds


def _timed_builder(build):
    @functools.wraps(build)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return build(*args, **kwargs)
        finally:
            _record(launchers=1, launcher_seconds=time.perf_counter() - start)

    return timed


@functools.cache
def install() -> bool:
    """Start counting in this process (once); False where this Triton has no compilation listener."""
    try:
        import triton.backends.nvidia.driver as nvidia_driver
        from triton import knobs
    except ImportError:
        return False
    if not hasattr(knobs, "compilation") or not hasattr(knobs.compilation, "listener"):
        return False
    knobs.compilation.listener = _listener
    if hasattr(nvidia_driver, "compile_module_from_src"):  # launcher stubs: C, built per kernel signature
        nvidia_driver.compile_module_from_src = _timed_builder(nvidia_driver.compile_module_from_src)
    return True


def total(path: Path) -> dict:
    """The sums over every line in ``path`` (zeros when nothing was compiled or the file is absent)."""
    sums = dict.fromkeys(FIELDS, 0)
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:  # a line cut off by a killed process
                continue
            for key in sums:
                sums[key] += row.get(key, 0)
    sums["kernel_seconds"] = round(sums["kernel_seconds"], 1)
    sums["launcher_seconds"] = round(sums["launcher_seconds"], 1)
    return sums
