"""``flashattn bench``: our attention against every baseline that runs on this machine, over a sweep.

A sweep crosses sequence lengths, head dims, causal or not, and modes (fwd, bwd, fwd+bwd) at a fixed number of
tokens per batch (batch = tokens // seqlen) and hidden size (heads = hidden // headdim), so every point does the
same work per token. Each row reports seconds, TFLOP/s (4 B H N^2 D per forward, half when causal, 2.5x for the
backward) and peak extra memory; ours also gets its speed ratio against the best baseline of the same point.

Example::

    >>> sweep = Sweep(seqlens=[64], headdims=[16], causals=[False], modes=["fwd"], tokens=64, hidden=32)
    >>> rows = run(sweep, progress=False)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from .measure import FORWARD_ONLY, IMPLEMENTATIONS, Case, measure, run_here

OURS = "flashattn"
OURS_CUDA = "flashattn-cuda"  # our CUDA C++ kernel: timed beside the others, not a baseline for the ratio
CUDA_BASELINES = ("sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "sdpa-math", "flex", "plain")
CPU_BASELINES = ("sdpa", "sdpa-math", "plain")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class Sweep:
    """What to measure. Defaults follow the device: the issue's GPU setting (16k tokens, hidden 2048, bf16) on
    CUDA, a small fp32 sweep on CPU."""

    seqlens: list[int] = field(default_factory=lambda: [512, 1024, 2048, 4096, 8192, 16384])
    headdims: list[int] = field(default_factory=lambda: [64, 128])
    causals: list[bool] = field(default_factory=lambda: [False, True])
    modes: list[str] = field(default_factory=lambda: ["fwd", "bwd", "fwd+bwd"])
    dtype: str = "bfloat16"
    device: str = "cuda"
    tokens: int = 16384
    hidden: int = 2048
    impls: list[str] = field(default_factory=lambda: [OURS, OURS_CUDA, *CUDA_BASELINES])
    repeats: int = 30
    isolate: bool = True
    plain_limit_gib: float = 16.0

    @classmethod
    def for_device(cls, device: str) -> Sweep:
        if device.startswith("cuda"):
            return cls(device=device)
        return cls(seqlens=[256, 512, 1024, 2048], dtype="float32", device=device, tokens=2048, hidden=256,
                   impls=[OURS, *CPU_BASELINES], repeats=3)

    def cases(self) -> list[Case]:
        out = []
        for mode in self.modes:
            for d in self.headdims:
                for causal in self.causals:
                    for n in self.seqlens:
                        for impl in self.impls:
                            if mode != "fwd" and impl in FORWARD_ONLY:
                                continue
                            out.append(Case(impl, n, batch=max(1, self.tokens // n), heads=max(1, self.hidden // d),
                                            headdim=d, dtype=self.dtype, device=self.device, causal=causal,
                                            repeats=self.repeats, mode=mode))
        return out


def available(impls: list[str], device: str, dtype: str) -> dict[str, str | None]:
    """Each implementation -> None if it runs here (forward and backward on a tiny problem), else the reason."""
    reasons: dict[str, str | None] = {}
    for impl in impls:
        if impl not in IMPLEMENTATIONS:
            reasons[impl] = f"unknown implementation; choose from {', '.join(IMPLEMENTATIONS)}"
            continue
        try:
            run_here(Case(impl, 32, batch=1, heads=2, headdim=64, dtype=dtype, device=device, repeats=1,
                          mode="fwd" if impl in FORWARD_ONLY else "fwd+bwd"))
            reasons[impl] = None
        except Exception as e:  # the point of probing: a backend missing here is reported, not fatal
            reasons[impl] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return reasons


def run(sweep: Sweep, progress: bool = True) -> list[dict]:
    """Measure every case of the sweep (skipping implementations that cannot run here) and add the ratios."""
    reasons = available(sweep.impls, sweep.device, sweep.dtype)
    rows = [{"impl": impl, "error": f"unavailable: {why}"} for impl, why in reasons.items() if why]
    todo = [c for c in sweep.cases() if reasons[c.impl] is None]
    for case in tqdm(todo, desc="bench", unit="case", disable=not progress, file=sys.stdout):
        if case.impl == "plain" and case.plain_attention_bytes > sweep.plain_limit_gib * 2**30:
            rows.append({**asdict(case), "seconds": None, "tflops": None, "peak_bytes": None,
                         "error": "skipped: its N x N tensors exceed plain_limit_gib"})
            continue
        rows.append(measure(case, isolate=sweep.isolate))
    add_ratios(rows)
    return rows


def _point(row: dict) -> tuple:
    return row["seqlen"], row["headdim"], row["causal"], row["mode"]


def add_ratios(rows: list[dict]) -> None:
    """On each of our rows: ``best_baseline``, its TFLOP/s, and ``speedup`` = ours / best (> 1: we are faster)."""
    measured = [r for r in rows if r.get("tflops")]
    for ours in (r for r in measured if r["impl"] == OURS):
        rivals = [r for r in measured if r["impl"] not in (OURS, OURS_CUDA) and _point(r) == _point(ours)]
        if rivals:
            best = max(rivals, key=lambda r: r["tflops"])
            ours.update(best_baseline=best["impl"], best_baseline_tflops=best["tflops"],
                        speedup=ours["tflops"] / best["tflops"])


def table(rows: list[dict]) -> str:
    """One block per (mode, headdim, causal): TFLOP/s per implementation and seqlen, and our speedup."""
    measured = [r for r in rows if "seqlen" in r]
    impls = list(dict.fromkeys(r["impl"] for r in measured))
    lines = []
    for mode, d, causal in dict.fromkeys((r["mode"], r["headdim"], r["causal"]) for r in measured):
        lines.append(f"\n{mode}, headdim {d}, {'causal' if causal else 'non-causal'} (TFLOP/s)")
        header = f"{'seqlen':>7} " + " ".join(f"{i:>14}" for i in impls) + f" {'ours/best':>9}"
        lines.append(header)
        for n in sorted({r["seqlen"] for r in measured}):
            cells, speedup = [], ""
            for impl in impls:
                r = next((r for r in measured if r["impl"] == impl and _point(r) == (n, d, causal, mode)), None)
                cells.append(f"{r['tflops']:14.3g}" if r and r.get("tflops") else f"{'-':>14}")
                if r and impl == OURS and r.get("speedup"):
                    speedup = f"{r['speedup']:9.2f}"
            lines.append(f"{n:7d} " + " ".join(cells) + f" {speedup:>9}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str, value: str = "tflops") -> bool:
    """A grid of panels (mode x (headdim, causal)), one line per implementation: ``value`` vs seqlen."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    measured = [r for r in rows if r.get(value) is not None and "seqlen" in r]
    if not measured:
        return False
    modes = list(dict.fromkeys(r["mode"] for r in measured))
    columns = list(dict.fromkeys((r["headdim"], r["causal"]) for r in measured))
    fig, axes = plt.subplots(len(modes), len(columns), figsize=(4 * len(columns), 3.2 * len(modes)), squeeze=False)
    for i, mode in enumerate(modes):
        for j, (d, causal) in enumerate(columns):
            ax = axes[i][j]
            for impl in dict.fromkeys(r["impl"] for r in measured):
                pts = sorted((r["seqlen"], r[value]) for r in measured
                             if r["impl"] == impl and (r["mode"], r["headdim"], r["causal"]) == (mode, d, causal))
                if pts:
                    scale = 2**-20 if value == "peak_bytes" else 1
                    ax.plot([p[0] for p in pts], [p[1] * scale for p in pts], "o-", label=impl,
                            linewidth=2.5 if impl == OURS else 1.2)
            ax.set_xscale("log", base=2)
            if value == "peak_bytes" and all(r[value] > 0 for r in measured):
                ax.set_yscale("log")  # in-process CPU readings can be 0 (freed memory reused): stay linear then
            ax.set_title(f"{mode}, d={d}, {'causal' if causal else 'full'}", fontsize=9)
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOP/s" if value == "tflops" else "peak extra MiB")
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(rows: list[dict], sweep: Sweep, out_dir: Path, stem: str) -> list[Path]:
    """JSON with the sweep and the device, and the two plots; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name(sweep.device) if sweep.device.startswith("cuda") else "cpu"
    meta = {"device": device_name, "torch": torch.__version__, "sweep": asdict(sweep)}
    paths = [out_dir / f"{stem}.json"]
    paths[0].write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    title = f"{device_name}, {sweep.dtype}, {sweep.tokens} tokens/batch, hidden {sweep.hidden}"
    for value, suffix in (("tflops", "tflops"), ("peak_bytes", "memory")):
        path = out_dir / f"{stem}-{suffix}.png"
        if plot(rows, path, title, value):
            paths.append(path)
    return paths
