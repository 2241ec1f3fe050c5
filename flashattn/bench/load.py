"""Is the machine busy? A reading taken before timing, so a benchmark can say when its numbers may be unreliable.

Two figures, both in cores' worth of work: the 1-minute load average (``os.getloadavg``; runnable tasks,
smoothed, system-wide) and the CPU time other processes used on this process's CPUs during a short sample
(``/proc/stat``, Linux; steal time from the hypervisor counts as other). A benchmark warns, one line on stderr,
when the load average exceeds half the usable cores or other processes use a quarter of them: either way the
timed code shares its cores with work it does not control.

``flashattn demo`` and every ``flashattn bench`` subcommand take the reading through ``measured()`` before they
time anything; ``report.meta`` records it in the JSON (``load``, ``load_warning``). Example::

    >>> reading = {"load_1m": 3.0, "other_cpu": 0.1, "usable_cores": 2}
    >>> warning(reading)
    'the machine is busy (1-minute load average 3.00 on 2 usable cores): timings may be unreliable'
    >>> warning({"load_1m": 0.2, "other_cpu": None, "usable_cores": 2}) is None
    True
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from ..host import load_average, usable_cores

LOAD_FRACTION = 0.5  # of the usable cores: the 1-minute load average above this warns
OTHER_FRACTION = 0.25  # of the usable cores: other processes' CPU use in the sample above this warns
SAMPLE_SECONDS = 0.25
# How a parent hands its reading to the processes it starts (context-parallel's torchrun ranks), whose own
# reading would count their sibling ranks starting up as "other processes".
ENV_VAR = "FLASHATTN_BENCH_LOAD"

_reading: ContextVar[dict | None] = ContextVar("flashattn_bench_load", default=None)


def _busy_ticks(cpus: set[int]) -> int | None:
    """Clock ticks the CPUs in ``cpus`` have spent busy since boot (every state but idle and iowait)."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            # user nice system idle iowait irq softirq steal (guest time is already inside user)
            ticks = [int(x) for x in fields[:8]]
            total += sum(ticks) - ticks[3] - ticks[4]
    return total


def _own_seconds() -> float:
    times = os.times()
    return times.user + times.system


def other_processes_cpu(seconds: float = SAMPLE_SECONDS) -> float | None:
    """Cores' worth of CPU that other processes used on this process's CPUs over ``seconds`` (None off Linux)."""
    try:
        cpus = os.sched_getaffinity(0)
        tick = os.sysconf("SC_CLK_TCK")
    except (AttributeError, OSError, ValueError):
        return None
    start, own, clock = _busy_ticks(cpus), _own_seconds(), time.monotonic()
    if start is None:
        return None
    time.sleep(seconds)
    end = _busy_ticks(cpus)
    elapsed = time.monotonic() - clock
    if end is None or elapsed <= 0:
        return None
    busy = (end - start) / tick - (_own_seconds() - own)
    return round(max(0.0, busy / elapsed), 2)


def reading(sample_seconds: float = SAMPLE_SECONDS) -> dict:
    """``{"load_1m", "other_cpu", "usable_cores"}`` now; a figure the OS cannot give is None."""
    return {"load_1m": load_average(), "other_cpu": other_processes_cpu(sample_seconds),
            "usable_cores": usable_cores()}


def warning(figures: dict) -> str | None:
    """The warning for a reading, or None when the machine looks quiet enough to time on."""
    cores = figures["usable_cores"]
    reasons = []
    if figures["load_1m"] is not None and figures["load_1m"] > LOAD_FRACTION * cores:
        reasons.append(f"1-minute load average {figures['load_1m']:.2f} on {cores} usable cores")
    if figures["other_cpu"] is not None and figures["other_cpu"] > OTHER_FRACTION * cores:
        reasons.append(f"other processes are using {figures['other_cpu']:.2f} of {cores} usable cores")
    if not reasons:
        return None
    return f"the machine is busy ({'; '.join(reasons)}): timings may be unreliable"


def check() -> dict:
    """Take a reading and, if the machine is busy, say so in one line on stderr; returns the reading with its
    ``warning`` (None when quiet)."""
    figures = reading()
    figures["warning"] = warning(figures)
    if figures["warning"]:
        print(f"flashattn: warning: {figures['warning']}", file=sys.stderr, flush=True)
    return figures


@contextmanager
def measured() -> Iterator[dict]:
    """Check the load now (before any timing) and keep the reading for ``recorded()`` inside the block."""
    token = _reading.set(check())
    try:
        yield _reading.get()
    finally:
        _reading.reset(token)


def recorded() -> dict | None:
    """The reading taken before this command's timing: ``measured()``'s, else the one a parent process handed
    down in ``FLASHATTN_BENCH_LOAD``; None when none was taken (a benchmark function called directly)."""
    figures = _reading.get()
    if figures is None and os.environ.get(ENV_VAR):
        try:
            figures = json.loads(os.environ[ENV_VAR])
        except ValueError:
            figures = None
    return figures


def child_environment() -> dict[str, str]:
    """The environment for a process this command starts, with the reading handed down."""
    figures = recorded()
    return {**os.environ, **({ENV_VAR: json.dumps(figures)} if figures is not None else {})}
