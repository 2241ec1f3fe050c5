"""``flashattn bench sweep``: our attention against every baseline that runs on this machine, over a sweep.

A sweep crosses sequence lengths, head dims, causal or not, and modes (fwd, bwd, fwd+bwd) at a fixed number of
tokens per batch (batch = tokens // seqlen) and hidden size (heads = hidden // headdim), so every point does the
same work per token. Each row reports seconds, TFLOP/s (4 B H N^2 D per forward, half when causal, 2.5x for the
backward) and peak extra memory; ours also gets its speed ratio against the best baseline of the same point.

    flashattn bench sweep                                  # the full sweep on this machine
    flashattn bench sweep --seqlens 4096 --headdims 128 --modes fwd,bwd --baselines sdpa-flash
    flashattn bench sweep --device cpu --in-process --quiet --out /tmp/bench --name smoke

In Python: ``rows = run(Sweep.for_device("cpu"))``, then ``table(rows)``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from . import ceilings, options, report
from .measure import (
    COMPILED,
    FORWARD_ONLY,
    IMPLEMENTATIONS,
    MODES,
    OURS,
    OURS_CUDA,
    OURS_VARIANTS,
    Case,
    measure,
    run_here,
)

HELP = "sweep our attention against every baseline on this machine (TFLOP/s, time, memory)"
CUDA_BASELINES = ("sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "sdpa-math", "flex", "plain")
CPU_BASELINES = ("sdpa", "sdpa-math", "plain")


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
        """Every point and implementation; compiled implementations (FlexAttention) after all the others, so a
        sweep stopped early has every point of the rest."""
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
        return sorted(out, key=lambda c: c.impl in COMPILED)


def available(impls: list[str], device: str, dtype: str) -> dict[str, str | None]:
    """Each implementation -> None if it runs here (forward and backward on a tiny problem), else the reason.
    Compiled ones are not probed (a probe would cost a compile of its own): their cases report their errors."""
    reasons: dict[str, str | None] = {}
    for impl in impls:
        if impl not in IMPLEMENTATIONS:
            reasons[impl] = f"unknown implementation; choose from {', '.join(IMPLEMENTATIONS)}"
            continue
        if impl in COMPILED and device.startswith("cuda"):
            reasons[impl] = None
            continue
        try:
            run_here(Case(impl, 32, batch=1, heads=2, headdim=64, dtype=dtype, device=device, repeats=1,
                          mode="fwd" if impl in FORWARD_ONLY else "fwd+bwd"))
            reasons[impl] = None
        except Exception as e:  # the point of probing: a backend missing here is reported, not fatal
            reasons[impl] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return reasons


def run(sweep: Sweep, progress: bool = True, on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Measure every case of the sweep (skipping implementations that cannot run here) and add the ratios;
    ``on_row(rows)`` after each case (the command writes the JSON so far: a sweep stopped early keeps it)."""
    reasons = available(sweep.impls, sweep.device, sweep.dtype)
    rows = [{"impl": impl, "error": f"unavailable: {why}"} for impl, why in reasons.items() if why]
    todo = [c for c in sweep.cases() if reasons[c.impl] is None]
    for case in tqdm(todo, desc="bench", unit="case", disable=not progress, file=sys.stdout):
        if case.impl == "plain" and case.plain_attention_bytes > sweep.plain_limit_gib * 2**30:
            rows.append({**asdict(case), "seconds": None, "tflops": None, "peak_bytes": None,
                         "error": "skipped: its N x N tensors exceed plain_limit_gib"})
        else:
            rows.append(measure(case, isolate=sweep.isolate))
        if on_row is not None:
            add_ratios(rows)
            on_row(rows)
    add_ratios(rows)
    return rows


def _point(row: dict) -> tuple:
    return row["seqlen"], row["headdim"], row["causal"], row["mode"]


def add_ratios(rows: list[dict]) -> None:
    """On each of our rows: ``best_baseline``, its TFLOP/s, and ``speedup`` = ours / best (> 1: we are faster); on a
    GPU also ``device_speedup``, the same from the GPU's time alone (calls queued ahead: no host time), which
    separates a kernel's speed from what the host adds to short calls."""
    measured = [r for r in rows if r.get("tflops")]
    for ours in (r for r in measured if r["impl"] == OURS):
        rivals = [r for r in measured if r["impl"] not in OURS_VARIANTS and _point(r) == _point(ours)]
        if rivals:
            best = max(rivals, key=lambda r: r["tflops"])
            ours.update(best_baseline=best["impl"], best_baseline_tflops=best["tflops"],
                        speedup=ours["tflops"] / best["tflops"])
        timed = [r for r in rivals if r.get("device_tflops")]
        if timed and ours.get("device_tflops"):
            best = max(timed, key=lambda r: r["device_tflops"])
            ours.update(device_speedup=ours["device_tflops"] / best["device_tflops"])




def table(rows: list[dict]) -> str:
    """One block per (mode, headdim, causal): ms and TFLOP/s per implementation and seqlen, and our speedup."""
    measured = [r for r in rows if "seqlen" in r]
    impls = list(dict.fromkeys(r["impl"] for r in measured))
    columns = ["seqlen", *report.per_impl(impls, report.MS, report.TFLOPS),
               report.Col("ours/best", (OURS, "speedup"), ".2f")]
    if any(r.get("device_speedup") for r in measured):  # a GPU: the same ratio without host time
        columns.append(report.Col("kernels", (OURS, "device_speedup"), ".2f"))
    blocks = []
    for mode, d, causal in dict.fromkeys((r["mode"], r["headdim"], r["causal"]) for r in measured):
        here = [r for r in measured if (r["mode"], r["headdim"], r["causal"]) == (mode, d, causal)]
        points = sorted(report.wide(here, ("seqlen",)), key=lambda p: p["seqlen"])
        blocks.append(f"\n{mode}, headdim {d}, {'causal' if causal else 'non-causal'}\n"
                      + report.table(points, columns))
    return "\n".join(blocks)


def figures(sweep: Sweep, device_name: str) -> list[report.Figure]:
    """TFLOP/s and peak memory against seqlen: one row of panels per mode, one column per (headdim, causal)."""
    title = f"{device_name}, {sweep.dtype}, {sweep.tokens} tokens/batch, hidden {sweep.hidden}"
    grid = {"rows": ("mode",), "cols": ("headdim", "causal")}
    return [report.Figure(title, ("tflops",), suffix="-tflops", **grid),
            report.Figure(title, ("mib",), suffix="-memory", **grid)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    options.add_device(p)
    options.add_per_device(p, "--seqlens", "comma-separated", Sweep, options.int_list)
    p.add_argument("--headdims", type=options.int_list, default=None, help="comma-separated (default: 64,128)")
    p.add_argument("--causal", default="both", choices=("both", "true", "false"), help="causal masking")
    p.add_argument("--modes", type=options.choice_list(MODES), default=None,
                   help="comma-separated from fwd, bwd, fwd+bwd (default: all three)")
    p.add_argument("--baselines", type=options.name_list, default=None,
                   help=f"comma-separated from {', '.join(b for b in IMPLEMENTATIONS if b != OURS)} "
                        f"(default: {', '.join(CUDA_BASELINES)} on a GPU; {', '.join(CPU_BASELINES)} on CPU)")
    options.add_dtype(p)
    options.add_per_device(p, "--tokens", "tokens per batch; batch = tokens // seqlen", Sweep)
    options.add_per_device(p, "--hidden", "hidden size; heads = hidden // headdim", Sweep)
    options.add_per_device(p, "--repeats", "timed runs per case, the median is reported", Sweep)
    p.add_argument("--in-process", action="store_true",
                   help="on CPU, measure in this process (faster; memory readings less exact)")
    p.add_argument("--ceilings", action="store_true",
                   help="first measure the device's matmul rate and bandwidth (meta.ceilings), to judge against")
    options.add_output(p, "bench-<device>")


def from_args(args: argparse.Namespace) -> Sweep:
    """The device's default sweep with the options given on the command line."""
    sweep = Sweep.for_device(args.device or options.default_device())
    for name in ("seqlens", "headdims", "modes", "dtype", "tokens", "hidden", "repeats"):
        if getattr(args, name) is not None:
            setattr(sweep, name, getattr(args, name))
    if args.causal != "both":
        sweep.causals = [args.causal == "true"]
    if args.baselines is not None:
        sweep.impls = [OURS, *args.baselines]
    sweep.isolate = not args.in_process
    return sweep


def command(args: argparse.Namespace) -> int:
    sweep = from_args(args)
    print(f"flashattn bench sweep on {sweep.device}: {len(sweep.cases())} cases, implementations "
          f"{', '.join(sweep.impls)}")
    meta = report.meta(sweep.device, args.command_line, sweep)
    if args.ceilings:
        meta["ceilings"] = ceilings.measure(sweep.device, sweep.dtype, quick=not sweep.device.startswith("cuda"))
        print("ceilings: " + ", ".join(f"{k} {v}" for k, v in meta["ceilings"].items()))
    stem = args.name or f"bench-{sweep.device.split(':')[0]}"
    rows = run(sweep, progress=not args.quiet, on_row=lambda so_far: report.write(so_far, meta, Path(args.out), stem))
    for r in rows:
        if "seqlen" not in r:
            print(f"  {r['impl']}: {r['error']}")
    print(table(rows))
    for line in report.errors(rows, "mode", "headdim", "causal", "seqlen"):
        print(line)
    for path in report.write(rows, meta, Path(args.out), stem, figures(sweep, meta["device"])):
        print(f"wrote {path}")
    return 0
