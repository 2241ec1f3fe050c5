"""``flashattn bench cpu``: our CPU path against PyTorch's own CPU scaled_dot_product_attention and plain
attention, N = 1k..16k, forward and forward+backward.

    flashattn bench cpu                                            # bench-output/cpu-<date>.json and .png
    flashattn bench cpu --out benchmarks/results --seqlens 1024,4096,16384
    flashattn bench cpu --dtypes float32,bfloat16 --causal both --load   # under one competing busy process
    flashattn bench cpu --roofline --out benchmarks/results          # against the machine's own limits

Batch 1; fp32 and non-causal unless ``--dtypes``/``--causal`` say otherwise. ``--load`` starts one busy process
for the whole run (it stops itself after ``--load-seconds`` at the latest, and is stopped when the run ends), so
ours and SDPA are measured under the same load. Each case runs in its own subprocess (a clean peak-memory reading; see
``flashattn.bench.measure``) unless ``--in-process``. Plain attention is left out above ``--plain-limit-gib`` of
N x N tensors. The table's ``ours/sdpa time`` is ours / SDPA, so above 1 we are slower (the opposite sense of
``flashattn bench sweep``'s ``ours/best``).

``--roofline`` (``flashattn.bench.roofline``) measures the machine's product rates and read bandwidth first and
reports every case against them and as a speedup over SDPA, on its own grid unless the options above say
otherwise: bf16, fp16 and fp32, d 64 and 128, N 1k to 16k, causal or not, forward and forward+backward, then
decode; the result file is ``cpu-roofline-<date>`` with the CPU's model and flags.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

from ..host import cpu_flags, cpu_model
from . import options, report, roofline
from .measure import FEATURES, OURS, Case, measure

HELP = "our CPU path vs torch SDPA vs plain attention on CPU, fwd and fwd+bwd, each case in a subprocess"
IMPLS = (OURS, "sdpa", "plain")
MODES = ("fwd", "fwd+bwd")
FEATURE_IMPLS = tuple(f"{OURS}+{feature}" for feature in FEATURES)


CAUSAL = {"no": (False,), "yes": (True,), "both": (False, True)}
# A process that keeps one core busy until its deadline (argv[1], seconds from now).
_BUSY = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


def cases(seqlens: list[int], heads: int, headdims: list[int], repeats: int, *,
          dtypes: tuple[str, ...] = ("float32",), causals: tuple[bool, ...] = (False,),
          features: bool = False) -> list[Case]:
    """Every (dtype, head dim, causal, mode, N, implementation) case on CPU, batch 1; with ``features``, ours
    with each feature of ``measure.FEATURES`` too (forward)."""
    impls = {mode: IMPLS + (FEATURE_IMPLS if features and mode == "fwd" else ()) for mode in MODES}
    return [Case(impl, n, heads=heads, headdim=d, repeats=repeats, mode=mode, dtype=dtype, causal=causal)
            for dtype in dtypes for d in headdims for causal in causals for mode in MODES for n in seqlens
            for impl in impls[mode]]


@contextmanager
def competing_load(seconds: float) -> Iterator[subprocess.Popen]:
    """One busy process for the duration of the block, stopped at its end (and by itself after ``seconds``)."""
    busy = subprocess.Popen([sys.executable, "-c", _BUSY, str(seconds)])
    try:
        yield busy
    finally:
        busy.kill()
        busy.wait()


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


KEYS = ("dtype", "headdim", "causal", "mode", "seqlen")


def table(rows: list[dict]) -> str:
    """One line per (dtype, head dim, causal, mode, N): ms, TFLOP/s and peak extra MiB per implementation, and
    ours / SDPA time; then the median and the worst of that ratio over the grid."""
    points = report.wide(rows, KEYS)
    columns = ["dtype", report.Col("d", "headdim"), "causal", "mode", report.Col("N", "seqlen"),
               *report.per_impl(IMPLS, report.MS, report.TFLOPS, report.MIB),
               report.Col("ours/sdpa time", _ratio, ".2f")]
    lines = [report.table(points, columns), summary(rows)]
    if any(row["impl"] in FEATURE_IMPLS for row in rows):
        feature_columns = ["dtype", report.Col("d", "headdim"), "causal", report.Col("N", "seqlen"),
                           *(report.Col(f"{impl.split('+')[1]}/plain", _feature_ratio(impl), ".2f")
                             for impl in FEATURE_IMPLS)]
        lines += ["", "ours with a feature / ours plain, forward time:",
                  report.table([p for p in points if p["mode"] == "fwd"], feature_columns)]
    return "\n".join([*lines, *report.errors(rows, *KEYS)])


def _feature_ratio(impl: str):
    def ratio(point: dict) -> float | None:
        with_it, plain = point.get((impl, "seconds")), point.get((OURS, "seconds"))
        return with_it / plain if with_it and plain else None

    return ratio


def summary(rows: list[dict]) -> str:
    """'ours/sdpa time over N cells: median m, worst w (where)'."""
    ratios = sorted((r, tuple(p[k] for k in KEYS)) for p in report.wide(rows, KEYS) if (r := _ratio(p)))
    if not ratios:
        return "ours/sdpa time: no cell has both"
    median = statistics.median(r for r, _ in ratios)
    worst, where = ratios[-1]
    return (f"ours/sdpa time over {len(ratios)} cells: median {median:.2f}, worst {worst:.2f} "
            f"({', '.join(map(str, where))})")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seqlens", type=options.int_list, help="comma-separated (default 1024,4096,16384)")
    p.add_argument("--heads", type=options.positive_int, default=4, help="attention heads")
    p.add_argument("--headdims", type=options.int_list,
                   help="comma-separated head dimensions (default 64; with --roofline 64,128)")
    p.add_argument("--repeats", type=options.positive_int, default=3, help="timed runs per case (the median)")
    p.add_argument("--dtypes", type=options.choice_list(("float32", "bfloat16", "float16", "float64")),
                   help="comma-separated input dtypes (default float32; with --roofline bfloat16,float16,float32)")
    p.add_argument("--causal", choices=tuple(CAUSAL),
                   help="causal masking: no, yes or both (default no; with --roofline both)")
    p.add_argument("--features", action="store_true",
                   help=f"also time ours with each of {', '.join(FEATURES)} (forward), against ours plain")
    p.add_argument("--load", action="store_true", help="run everything under one competing busy process")
    p.add_argument("--load-seconds", type=options.positive_float, default=3600.0,
                   help="the busy process stops itself after this long at the latest")
    p.add_argument("--plain-limit-gib", type=options.positive_float, default=12.0,
                   help="leave plain attention out where its N x N tensors would exceed this")
    p.add_argument("--in-process", action="store_true",
                   help="measure in this process (faster; memory readings less exact)")
    p.add_argument("--roofline", action="store_true",
                   help="measure the machine's product rates and read bandwidth, report against them, add decode "
                        "(default grid: bfloat16,float16,float32, d 64,128, N 1k-16k, causal both)")
    p.add_argument("--max-case-seconds", type=options.positive_float, default=300.0,
                   help="with --roofline: skip a case that a smaller N of its line predicts to take longer")
    options.add_output(p, "cpu-<date>")


# The grid's defaults, plain and with --roofline; what the command line gives replaces them.
GRID = {"seqlens": [1024, 4096, 16384], "headdims": [64], "dtypes": ["float32"], "causal": "no"}
ROOFLINE_GRID = {"seqlens": [1024, 4096, 16384], "headdims": [64, 128], "dtypes": ["bfloat16", "float16", "float32"],
                 "causal": "both"}


def grid_of(args: argparse.Namespace) -> dict:
    defaults = ROOFLINE_GRID if args.roofline else GRID
    return {k: default if getattr(args, k) is None else getattr(args, k) for k, default in defaults.items()}


def roofline_command(args: argparse.Namespace) -> int:
    grid = grid_of(args)
    todo = [c for c in cases(grid["seqlens"], args.heads, grid["headdims"], args.repeats, dtypes=tuple(grid["dtypes"]),
                             causals=CAUSAL[grid["causal"]]) if c.impl in roofline.IMPLS]
    print(f"flashattn bench cpu --roofline: {cpu_model()}, {torch.get_num_threads()} threads; the ceilings, then "
          f"{len(todo)} cases and decode")
    first = roofline.ceilings()
    progress = functools.partial(tqdm, desc="roofline", unit="case", disable=args.quiet, file=sys.stdout)
    rows = roofline.run(todo, first, max_case_seconds=args.max_case_seconds, progress=progress)
    limits = roofline.higher_ceilings(first, roofline.ceilings())
    rows = roofline.annotate(rows, limits)
    text = roofline.table(rows, limits)
    print(text)
    meta = report.meta("cpu", args.command_line, grid, cpu_flags=cpu_flags(), ceilings=limits,
                       tiles={dtype: roofline.tiles_dtype(dtype) for dtype in grid["dtypes"]})
    title = (f"{cpu_model()} ({meta['threads']} threads): flashattn vs torch SDPA, TFLOP/s (ceilings: "
             + ", ".join(f"{d} {g:.0f}" for d, g in limits["product_gflops"].items()) + " GFLOP/s)")
    figure = report.Figure(title, ("tflops",), lines=("impl", "mode"), rows=("dtype",), cols=("headdim", "causal"))
    stem = args.name or f"cpu-roofline-{datetime.date.today().isoformat()}"
    for path in report.write(rows, meta, Path(args.out), stem, [figure]):
        print(f"wrote {path}")
    (Path(args.out) / f"{stem}.txt").write_text(text + "\n")
    print(f"wrote {Path(args.out) / f'{stem}.txt'}")
    return 0


def command(args: argparse.Namespace) -> int:
    if args.roofline:
        return roofline_command(args)
    for key, value in grid_of(args).items():
        setattr(args, key, value)
    todo = cases(args.seqlens, args.heads, args.headdims, args.repeats, dtypes=tuple(args.dtypes),
                 causals=CAUSAL[args.causal], features=args.features)
    dtypes = ",".join(args.dtypes)
    print(f"flashattn bench cpu: {len(todo)} cases, {', '.join(IMPLS)}, {dtypes}, batch 1, {args.heads} heads, "
          f"headdim {','.join(map(str, args.headdims))}{', under one competing busy process' if args.load else ''}")
    if args.load:
        with competing_load(args.load_seconds):
            rows = run(todo, args.plain_limit_gib, isolate=not args.in_process, progress=not args.quiet)
    else:
        rows = run(todo, args.plain_limit_gib, isolate=not args.in_process, progress=not args.quiet)
    print(table(rows))
    meta = report.meta("cpu", args.command_line, {k: getattr(args, k) for k in
                                                 ("seqlens", "heads", "headdims", "repeats", "plain_limit_gib",
                                                  "features", "in_process", "dtypes", "causal", "load")})
    loaded = ", one competing busy process" if args.load else ""
    title = (f"CPU ({meta['cores']} cores, {meta['threads']} threads{loaded}), {dtypes}, batch 1, {args.heads} "
             f"heads: flashattn vs torch SDPA vs plain")
    figure = report.Figure(title, ("ms", "mib"), lines=("impl", "mode"), rows=("dtype", "headdim", "causal"))
    stem = args.name or f"cpu-{datetime.date.today().isoformat()}"
    for path in report.write(rows, meta, Path(args.out), stem, [figure]):
        print(f"wrote {path}")
    return 0
