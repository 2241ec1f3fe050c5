"""Plots of benchmark results: time and peak memory against sequence length, one line per implementation."""

from __future__ import annotations

from pathlib import Path


def plot_time_memory(results: list[dict], path: Path, title: str) -> bool:
    """Write a two-panel PNG (time, peak extra memory vs N, log-log) of ``results`` rows from
    ``flashattn.bench.measure``; one line per (impl, mode). Returns False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = sorted({(r["impl"], r.get("mode", "fwd")) for r in results})
    for impl, mode in series:
        pts = [r for r in results if (r["impl"], r.get("mode", "fwd")) == (impl, mode) and r["seconds"] is not None]
        label = impl if len({m for _, m in series}) == 1 else f"{impl} {mode}"
        n = [r["seqlen"] for r in pts]
        style = "o-" if mode == "fwd" else "s--"
        ax_t.plot(n, [r["seconds"] * 1e3 for r in pts], style, label=label)
        ax_m.plot(n, [max(r["peak_bytes"], 1) / 2**20 for r in pts], style, label=label)
    for ax, label in ((ax_t, "time per call (ms)"), (ax_m, "peak extra memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
