"""Facts about the machine this process runs on, for ``flashattn info`` and the benchmarks' result files: the CPU
model, the cores this process may use, and the load average.

Example::

    >>> usable_cores() >= 1 and isinstance(cpu_model(), str)
    True
"""

from __future__ import annotations

import os
import platform

__all__ = ["cpu_flags", "cpu_model", "load_average", "usable_cores"]


def cpu_model() -> str:
    """The CPU's ``model name`` from /proc/cpuinfo; elsewhere what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The instruction-set flags that decide the CPU kernel's speed, as /proc/cpuinfo names them.
FLAGS_OF_NOTE = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile",
                 "amx_bf16", "amx_fp16", "asimd", "sve", "bf16")


def cpu_flags() -> list[str]:
    """Which of ``FLAGS_OF_NOTE`` this CPU has (Linux; elsewhere an empty list)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    present = set(line.split(":", 1)[1].split())
                    return [flag for flag in FLAGS_OF_NOTE if flag in present]
    except OSError:
        pass
    return []


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask), else every CPU."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def load_average() -> float | None:
    """The 1-minute load average, or None where the OS has none (Windows)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
