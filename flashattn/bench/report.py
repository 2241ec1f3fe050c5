"""What every benchmark prints and writes: one table formatter, one plot helper, one results writer.

Rows are plain dicts (one per measurement, as ``measure`` returns them). ``table`` prints any rows under any
columns; ``wide`` turns long rows (one per implementation) into one row per point with a column group per
implementation; ``plot`` draws a metric against seqlen or cache length, one line per implementation, one panel
per group; ``write`` saves the rows with a ``meta`` block (device, torch, date, command, threads, CPU model, the
machine's load before timing) as JSON, and the figures beside it.

Example::

    >>> rows = [{"impl": "flashattn", "seqlen": 512, "seconds": 0.0021, "tflops": 3.2},
    ...         {"impl": "sdpa", "seqlen": 512, "seconds": 0.0017, "tflops": 3.95}]
    >>> print(table(wide(rows, ("seqlen",)), ["seqlen", *per_impl(["flashattn", "sdpa"], MS, TFLOPS)]))
              flashattn         sdpa
    seqlen    ms  TFLOP/s    ms  TFLOP/s
    ------  ----  -------  ----  -------
       512  2.10     3.20  1.70     3.95
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, is_dataclass
from datetime import datetime
from pathlib import Path

import torch

from ..host import cpu_model, usable_cores
from ..tables import Col, table
from . import load
from .measure import OURS

__all__ = ["MIB", "MS", "TFLOPS", "US", "Col", "Figure", "device_name", "errors", "meta", "per_impl", "plot", "table",
           "wide", "write"]


# Column templates for ``per_impl``: (header, row field, scale, format).
MS = ("ms", "seconds", 1e3, "sig")
US = ("us", "seconds", 1e6, "sig")
TFLOPS = ("TFLOP/s", "tflops", 1.0, "sig")
MIB = ("MiB", "peak_bytes", 2**-20, ".1f")


def wide(rows: Iterable[Mapping], index: Sequence[str], across: str = "impl") -> list[dict]:
    """One dict per distinct ``index`` tuple (in first-seen order) holding the index fields and, under the key
    ``(row[across], field)``, every field of each row at that point: the shape ``per_impl`` columns read."""
    points: dict[tuple, dict] = {}
    for r in rows:
        if not all(k in r for k in index):
            continue  # an "unavailable" row has no point
        point = points.setdefault(tuple(r[k] for k in index), {k: r[k] for k in index})
        point.update({(r[across], k): v for k, v in r.items()})
    return list(points.values())


def per_impl(impls: Iterable[str], *templates: tuple[str, str, float, str]) -> list[Col]:
    """A column group per implementation, one column per template (``MS``, ``US``, ``TFLOPS``, ``MIB``, ...)."""
    return [Col(header, (impl, key), fmt, scale, group=impl) for impl in impls for header, key, scale, fmt in templates]


def errors(rows: Iterable[Mapping], *keys: str) -> list[str]:
    """ "impl key=value ...: error" for each measured point (a row with all ``keys``) that failed, to print under
    a table: the table shows "-" there. Skips are not failures."""
    return [f"  {r['impl']}" + "".join(f" {k}={r[k]}" for k in keys) + f": {r['error']}"
            for r in rows if r.get("error") and not r["error"].startswith("skipped") and all(k in r for k in keys)]


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    scale: float = 1.0
    log: bool = False  # log scale when every value is > 0 (in-process CPU memory readings can be 0)


METRICS = {
    "ms": Metric("seconds", "time per call (ms)", 1e3, log=True),
    "tflops": Metric("tflops", "TFLOP/s"),
    "mib": Metric("peak_bytes", "peak extra memory (MiB)", 2**-20, log=True),
    "gbps": Metric("gbps", "GB/s"),
    "bw_fraction": Metric("bw_fraction", "fraction of copy bandwidth"),
}
_AXES = {"seqlen": "sequence length N", "cache_len": "cache length"}


@dataclass(frozen=True)
class Figure:
    """What one PNG shows: each metric of ``y`` (keys of ``METRICS``) against ``x`` (log base 2), one line per
    distinct value of ``lines``, a grid of panels with one row per ``rows`` value and one column per ``cols``
    value (times the metrics), and an optional dashed ``goal`` line. Written as ``<stem><suffix>.png``."""

    title: str
    y: tuple[str, ...] = ("tflops",)
    x: str = "seqlen"
    lines: tuple[str, ...] = ("impl",)
    rows: tuple[str, ...] = ()
    cols: tuple[str, ...] = ()
    goal: float | None = None
    suffix: str = ""


def _label(keys: Sequence[str], values: Sequence, varying: set[str]) -> str:
    names = {"headdim": "d={}", "batch": "batch {}", "world": "world {}"}
    parts = []
    for k, v in zip(keys, values, strict=True):
        if k not in varying:
            continue
        parts.append(("causal" if v else "full") if k == "causal" else names.get(k, "{}").format(v))
    return ", ".join(parts)


def _groups(rows: list[dict], keys: Sequence[str]) -> list[tuple]:
    return list(dict.fromkeys(tuple(r.get(k) for k in keys) for r in rows))


def plot(rows: Iterable[Mapping], path: Path, figure: Figure) -> bool:
    """Draw ``figure`` from ``rows`` into ``path``. False when matplotlib is missing or nothing was measured."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    metrics = [METRICS[m] for m in figure.y]
    measured = [r for r in rows if figure.x in r and any(r.get(m.key) is not None for m in metrics)]
    if not measured:
        return False
    grid_rows, grid_cols = _groups(measured, figure.rows), _groups(measured, figure.cols)
    varying = {k for k in (*figure.lines, *figure.rows, *figure.cols) if len({r.get(k) for r in measured}) > 1}
    fig, axes = plt.subplots(len(grid_rows), len(grid_cols) * len(metrics), squeeze=False,
                             figsize=(4.5 * len(grid_cols) * len(metrics), 3.6 * len(grid_rows)))
    for i, row_key in enumerate(grid_rows):
        for j, col_key in enumerate(grid_cols):
            here = [r for r in measured if tuple(r.get(k) for k in figure.rows) == row_key
                    and tuple(r.get(k) for k in figure.cols) == col_key]
            keys = [*figure.rows, *figure.cols]
            title = _label(keys, [*row_key, *col_key], set(keys))  # a panel says what it holds, varying or not
            for m, metric in enumerate(metrics):
                _panel(axes[i][j * len(metrics) + m], here, figure, metric, varying)
                axes[i][j * len(metrics) + m].set_title(title, fontsize=9)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(figure.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _panel(ax, rows: list[dict], figure: Figure, metric: Metric, varying: set[str]) -> None:
    values = []
    for line in _groups(rows, figure.lines):
        pts = sorted((r[figure.x], r[metric.key] * metric.scale) for r in rows
                     if tuple(r.get(k) for k in figure.lines) == line and r.get(metric.key) is not None)
        if not pts:
            continue
        values += [p[1] for p in pts]
        fields = dict(zip(figure.lines, line, strict=True))
        ours = fields.get("impl") == OURS
        style = "o-" if fields.get("mode", "fwd") == "fwd" else "s--"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, linewidth=2.5 if ours else 1.2,
                label=_label(figure.lines, line, varying) or str(line[0]))
    if figure.goal is not None:
        ax.axhline(figure.goal, color="k", linestyle="--", linewidth=1, label=f"goal ({figure.goal})")
    ax.set_xscale("log", base=2)
    if metric.log and values and min(values) > 0:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.set_xlabel(_AXES.get(figure.x, figure.x))
    ax.set_ylabel(metric.label)
    ax.grid(True, which="both", alpha=0.3)


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"


def meta(device: str, command: Sequence[str] | str | None = None, sweep: object = None, **extra) -> dict:
    """What a reader needs to trust a result file: where, with what, when, how it was started, how busy the
    machine was, and the sweep.

    ``command`` is the argument list (default ``sys.argv``); ``sweep`` a dataclass or dict; ``extra`` is added.
    ``load`` is the reading taken before timing (``load.recorded()``: load average, other processes' CPU, usable
    cores; None when the benchmark was not started through the command line) and ``load_warning`` its warning.
    """
    if command is None:
        command = sys.argv
    reading = load.recorded()
    return {"device": device_name(device), "torch": torch.__version__,
            "date": datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": command if isinstance(command, str) else shlex.join(command),
            "threads": torch.get_num_threads(), "cpu": cpu_model(), "cores": os.cpu_count(),
            "usable_cores": usable_cores(),
            "load": None if reading is None else {k: v for k, v in reading.items() if k != "warning"},
            "load_warning": None if reading is None else reading.get("warning"),
            "sweep": asdict(sweep) if is_dataclass(sweep) else sweep, **extra}


def write(rows: list[dict], meta: dict, out_dir: Path, stem: str, figures: Sequence[Figure] = (),
          **sections) -> list[Path]:
    """Write ``<stem>.json`` (``{"meta": ..., "rows": ..., **sections}``) and one PNG per figure that could be
    drawn (``<stem><suffix>.png``) under ``out_dir``; returns the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.json"]
    paths[0].write_text(json.dumps({"meta": meta, "rows": rows, **sections}, indent=1, default=str))
    for figure in figures:
        path = out_dir / f"{stem}{figure.suffix}.png"
        if plot(rows, path, figure):
            paths.append(path)
    return paths
