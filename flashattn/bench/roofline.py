"""``flashattn bench cpu --roofline``: the CPU path against the machine's own limits, measured in the same run.

First the ceilings, with the run's threads: the matrix-product rate of each dtype (``torch.mm`` of 2048 x 2048
matrices; fp16 on a smaller one, as most CPUs have no fast fp16 product) and the read bandwidth (the sum of a
1 GiB float32 tensor), measured again after the cases (each limit the higher reading). Then every case of the
grid, flashattn and torch SDPA, each in its own subprocess; each is reported as a fraction of the product rate its
tiles run at (bf16 calls on the dot-product instructions: the bf16 rate; tiles computed in fp32: the fp32 rate;
``flashattn.backends.cpu_tiles`` says which) and as a speedup over SDPA (SDPA's time / ours). Decode (one token,
batch 1, GQA, bf16) is reported as a fraction of the read bandwidth. Cases predicted from a smaller N of the same
line to take over ``--max-case-seconds`` are skipped.

    flashattn bench cpu --roofline --out benchmarks/results
"""

from __future__ import annotations

import statistics
import time

import torch

from . import report
from .decode import DecodeCase, measure_case
from .measure import OURS, Case, measure

IMPLS = (OURS, "sdpa")
PRODUCT_SIZE = {"float32": 2048, "bfloat16": 2048, "float16": 512}
READ_GIB = 1.0
DECODE = DecodeCase(batch=1, cache_len=32768, heads_q=32, heads_kv=8, headdim=128, dtype="bfloat16", device="cpu",
                    repeats=10)
LINE = ("impl", "dtype", "headdim", "causal", "mode")  # a line of the grid: the cases that differ only in N


def product_rate(dtype: str, repeats: int = 5) -> float:
    """GFLOP/s of the best of ``repeats`` n x n products in ``dtype``."""
    n = PRODUCT_SIZE[dtype]
    a, b = (torch.randn(n, n).to(getattr(torch, dtype)) for _ in range(2))
    a @ b
    best = min(_seconds(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def read_bandwidth(gib: float | None = None, repeats: int = 5) -> float:
    """GB/s of the best of ``repeats`` sums of a ``gib`` GiB float32 tensor: bytes read, nothing written."""
    x = torch.ones(int((READ_GIB if gib is None else gib) * 2**30) // 4)
    x.sum()
    best = min(_seconds(x.sum) for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def ceilings() -> dict:
    """The machine's limits in this process: product rates (GFLOP/s) per dtype and read bandwidth (GB/s)."""
    return {"product_gflops": {dtype: product_rate(dtype) for dtype in PRODUCT_SIZE},
            "read_gbps": read_bandwidth()}


def higher_ceilings(first: dict, last: dict) -> dict:
    """The ceilings measured before and after the cases, each limit the higher of the two: a shared machine's
    speed drifts over a run, and a share of the rate read against a ceiling measured in a slow minute would
    overstate what the kernels reach. Both readings are kept (``measured``)."""
    return {"product_gflops": {d: max(first["product_gflops"][d], last["product_gflops"][d])
                               for d in first["product_gflops"]},
            "read_gbps": max(first["read_gbps"], last["read_gbps"]),
            "measured": [first, last]}


def drift(limits: dict) -> float:
    """How far the lower of the two readings of a limit fell under the higher, at most over the limits (0 with a
    single reading)."""
    readings = limits.get("measured", [])
    if len(readings) < 2:
        return 0.0
    pairs = [[r["product_gflops"][d] for r in readings] for d in limits["product_gflops"]]
    pairs.append([r["read_gbps"] for r in readings])
    return max(1 - min(values) / max(values) for values in pairs)


def tiles_dtype(dtype: str) -> str:
    """The dtype the cpu path's tile products run in for ``dtype`` inputs here (its ceiling's dtype)."""
    from ..backends import cpu_tiles

    tiles = cpu_tiles.choose(getattr(torch, dtype))
    return dtype if tiles in cpu_tiles.ENGINES else ("float64" if dtype == "float64" else "float32")


def run(todo: list[Case], limits: dict, *, max_case_seconds: float, progress) -> list[dict]:
    """Each case in its subprocess (skipping what a smaller N of its line predicts to be too slow), then the
    decode case (``limits``' read bandwidth sizes it); ``annotate`` puts them against the ceilings."""
    rows, last = [], {}
    for case in progress(todo):
        line = tuple(getattr(case, k) for k in LINE[1:]) + (case.impl,)
        if line in last:
            seqlen, seconds = last[line]
            predicted = seconds * (case.seqlen / seqlen) ** 2 * case.repeats
            if predicted > max_case_seconds:
                rows.append({**case.__dict__, "seconds": None, "tflops": None,
                             "error": f"skipped: predicted {predicted:.0f} s > --max-case-seconds"})
                continue
        row = measure(case)
        if row.get("seconds"):
            last[line] = (case.seqlen, row["seconds"])
        rows.append(row)
    decode = measure_case(DECODE, list(IMPLS), copy_gbps=limits["read_gbps"], headroom_gib=1.0)
    for row in decode:  # its fraction comes from annotate, against the run's read bandwidth
        row.pop("bw_fraction", None)
    return rows + [{**row, "mode": "decode"} for row in decode]


def annotate(rows: list[dict], limits: dict) -> list[dict]:
    """Each grid row's ``ceiling`` (the dtype our tiles run in for its inputs: one ceiling for both
    implementations, so their fractions compare) and ``of_rate``; ours gets ``speedup`` = SDPA's time / ours.
    Decode rows get ``of_read_bandwidth``."""
    rates = limits["product_gflops"]
    from ..backends import cpu_tiles

    for row in rows:
        if row.get("mode") == "decode":
            row["of_read_bandwidth"] = row["gbps"] / limits["read_gbps"] if row.get("gbps") else None
    rows_grid = [r for r in rows if r.get("mode") != "decode"]
    for row in rows_grid:
        row["ceiling"] = tiles_dtype(row["dtype"])
        if row["impl"] == OURS:  # which instructions multiplied our tiles (SDPA's are its own)
            row["engine"] = cpu_tiles.engine_label(getattr(torch, row["dtype"]))
        rate = rates.get(row["ceiling"])
        row["of_rate"] = row["tflops"] * 1e3 / rate if row.get("tflops") and rate else None
    keyed = {tuple(r[k] for k in ("impl", "dtype", "headdim", "causal", "mode", "seqlen")): r for r in rows_grid}
    for row in rows_grid:
        sdpa = keyed.get(("sdpa", *(row[k] for k in ("dtype", "headdim", "causal", "mode", "seqlen"))))
        if row["impl"] == OURS and row.get("seconds") and sdpa and sdpa.get("seconds"):
            row["speedup"] = sdpa["seconds"] / row["seconds"]
    return rows


def table(rows: list[dict], limits: dict) -> str:
    """The ceilings, one line per grid point (each implementation's GFLOP/s and fraction of its ceiling, our
    speedup over SDPA), the worst speedup, and the decode line."""
    rates = limits["product_gflops"]
    head = [f"ceilings: product rate {', '.join(f'{d} {g:.0f}' for d, g in rates.items())} GFLOP/s; "
            f"read bandwidth {limits['read_gbps']:.1f} GB/s"]
    if limits.get("measured"):
        head[0] += f" (the higher of two readings, before and after the cases: {drift(limits):.0%} apart at most)"
    grid = [r for r in rows if r.get("mode") != "decode"]
    points = report.wide(grid, ("dtype", "headdim", "causal", "mode", "seqlen"))
    columns = ["dtype", report.Col("d", "headdim"), "causal", "mode", report.Col("N", "seqlen"),
               *(c for impl in IMPLS for c in (
                   report.Col("GFLOP/s", (impl, "tflops"), ".0f", 1e3, group=impl),
                   report.Col("of rate", (impl, "of_rate"), ".0%", group=impl))),
               report.Col("x SDPA", (OURS, "speedup"), ".2f")]
    engines = sorted({(r["dtype"], r["engine"]) for r in grid if r.get("engine")})
    if engines:
        head.append("flashattn's tiles: " + "; ".join(f"{dtype} on {engine}" for dtype, engine in engines))
    lines = [*head, report.table(points, columns)]
    speedups = sorted((r["speedup"], r) for r in grid if r.get("speedup"))
    if speedups:
        worst, where = speedups[0]
        median = statistics.median(s for s, _ in speedups)
        lines.append(f"speedup over SDPA in {len(speedups)} cells: median {median:.2f}, worst {worst:.2f} "
                     f"({where['dtype']}, d={where['headdim']}, "
                     f"{'causal' if where['causal'] else 'full'}, {where['mode']}, N={where['seqlen']})")
    for row in rows:
        if row.get("mode") == "decode" and row.get("seconds"):
            lines.append(f"decode {row['impl']}: batch {row['batch']}, cache {row['cache_len']}, heads "
                         f"{row['heads_q']}:{row['heads_kv']}, d={row['headdim']}, {row['dtype']}: "
                         f"{row['seconds'] * 1e3:.2f} ms, {row['gbps']:.1f} GB/s = "
                         f"{row['of_read_bandwidth']:.0%} of the read bandwidth")
    return "\n".join([*lines, *report.errors(grid, "dtype", "headdim", "causal", "mode", "seqlen")])
