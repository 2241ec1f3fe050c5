"""Where a call's device time goes: each kernel's time and launches per call, from ``torch.profiler``.

A decode step at batch 1 runs several short kernels (a length fill or check, the split forward, the merge) whose
sum the events of ``measure.time_calls`` report as one figure; this splits it, kernel by kernel, so that a GPU run
says which one a slow call spends its time in. On a GPU the kernels' device time; on a CPU, where the operators
are the kernels, each operator's own CPU time (the step's Python is not in it).

Example::

    >>> import torch, flashattn
    >>> q, k = torch.randn(1, 1, 2, 16), torch.randn(1, 64, 1, 16)
    >>> times = kernel_times(lambda: flashattn.flash_attn_with_kvcache(q, k, k, cache_seqlens=64), "cpu", calls=2)
    >>> all(t.seconds >= 0 and t.launches > 0 for t in times)
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

SHOWN = 6  # kernels kept per call, the longest first
NAME_CHARS = 48  # a kernel's name as kept (C++ templates run to hundreds of characters)


class KernelTime(NamedTuple):
    """One kernel's (or on a CPU one operator's) share of a call."""

    name: str
    seconds: float  # per call
    launches: float  # per call


def kernel_times(step: Callable[[], object], device: str, calls: int = 20) -> list[KernelTime]:
    """The ``SHOWN`` kernels ``step`` spends the most device time in, per call, over ``calls`` profiled calls after
    one warm-up call."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")

    def synced() -> None:
        if cuda:
            torch.cuda.synchronize()

    step()
    synced()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as run:
        for _ in range(calls):
            step()
        synced()
    times = []
    for event in run.key_averages():
        if cuda and event.device_type != DeviceType.CUDA:
            continue  # the host side of a GPU call: measured by ``bench host``
        own = event.self_device_time_total if cuda else event.self_cpu_time_total
        if own > 0:
            times.append(KernelTime(event.key[:NAME_CHARS], own / 1e6 / calls, event.count / calls))
    return sorted(times, key=lambda t: -t.seconds)[:SHOWN]


def summary(times: list[KernelTime]) -> str:
    """One line: each kernel's microseconds per call (and its launches, where more than one)."""
    parts = [f"{t.name} {t.seconds * 1e6:.1f} us" + (f" x{t.launches:g}" if t.launches != 1 else "") for t in times]
    return ", ".join(parts) or "no kernel recorded"
