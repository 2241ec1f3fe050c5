"""``flashattn bench cpu``: our tiled CPU path against PyTorch's own CPU scaled_dot_product_attention and plain
attention, N = 1k..16k, forward and forward+backward.

    flashattn bench cpu                                            # bench-output/cpu-<date>.json and .png
    flashattn bench cpu --out benchmarks/results --seqlens 1024,4096,16384

fp32, batch 1, non-causal. Each case runs in its own subprocess (a clean peak-memory reading; see
``flashattn.bench.measure``) unless ``--in-process``. Plain attention is left out above ``--plain-limit-gib`` of
N x N tensors. The table's ``ours/sdpa time`` is ours / SDPA, so above 1 we are slower (the opposite sense of
``flashattn bench sweep``'s ``ours/best``).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from tqdm import tqdm

from . import options, report
from .measure import OURS, Case, measure

HELP = "our CPU path vs torch SDPA vs plain attention on CPU, fwd and fwd+bwd, each case in a subprocess"
IMPLS = (OURS, "sdpa", "plain")
MODES = ("fwd", "fwd+bwd")


def cases(seqlens: list[int], heads: int, headdim: int, repeats: int) -> list[Case]:
    """Every (mode, N, implementation) case: fp32 on CPU, batch 1, non-causal."""
    return [Case(impl, n, heads=heads, headdim=headdim, repeats=repeats, mode=mode)
            for mode in MODES for n in seqlens for impl in IMPLS]


def run(todo: list[Case], plain_limit_gib: float, isolate: bool = True, progress: bool = True) -> list[dict]:
    """Measure each case; plain attention beyond ``plain_limit_gib`` is left out (no row)."""
    rows = []
    for case in tqdm(todo, desc="cpu", unit="case", disable=not progress, file=sys.stdout):
        if case.impl == "plain" and case.plain_attention_bytes > plain_limit_gib * 2**30:
            continue
        rows.append(measure(case, isolate=isolate))
    return rows


def _ratio(point: dict) -> float | None:
    ours, sdpa = point.get((OURS, "seconds")), point.get(("sdpa", "seconds"))
    return ours / sdpa if ours and sdpa else None


def table(rows: list[dict]) -> str:
    """One line per (mode, N): ms, TFLOP/s and peak extra MiB per implementation, and ours / SDPA time."""
    points = report.wide(rows, ("mode", "seqlen"))
    columns = ["mode", report.Col("N", "seqlen"), *report.per_impl(IMPLS, report.MS, report.TFLOPS, report.MIB),
               report.Col("ours/sdpa time", _ratio, ".2f")]
    return "\n".join([report.table(points, columns), *report.errors(rows, "mode", "seqlen")])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seqlens", type=options.int_list, default="1024,4096,16384", help="comma-separated")
    p.add_argument("--heads", type=options.positive_int, default=4, help="attention heads")
    p.add_argument("--headdim", type=options.positive_int, default=64, help="head dimension")
    p.add_argument("--repeats", type=options.positive_int, default=3, help="timed runs per case (the median)")
    p.add_argument("--plain-limit-gib", type=options.positive_float, default=12.0,
                   help="leave plain attention out where its N x N tensors would exceed this")
    p.add_argument("--in-process", action="store_true",
                   help="measure in this process (faster; memory readings less exact)")
    options.add_output(p, "cpu-<date>")


def command(args: argparse.Namespace) -> int:
    todo = cases(args.seqlens, args.heads, args.headdim, args.repeats)
    print(f"flashattn bench cpu: {len(todo)} cases, {', '.join(IMPLS)}, fp32, batch 1, {args.heads} heads, "
          f"headdim {args.headdim}")
    rows = run(todo, args.plain_limit_gib, isolate=not args.in_process, progress=not args.quiet)
    print(table(rows))
    meta = report.meta("cpu", args.command_line, {k: getattr(args, k) for k in
                                                 ("seqlens", "heads", "headdim", "repeats", "plain_limit_gib",
                                                  "in_process")})
    title = (f"CPU ({meta['cores']} cores, {meta['threads']} threads), fp32, batch 1, {args.heads} heads, headdim "
             f"{args.headdim}: flashattn vs torch SDPA vs plain")
    figure = report.Figure(title, ("ms", "mib"), lines=("impl", "mode"))
    stem = args.name or f"cpu-{datetime.date.today().isoformat()}"
    for path in report.write(rows, meta, Path(args.out), stem, [figure]):
        print(f"wrote {path}")
    return 0
