"""Our tiled CPU path against PyTorch's own CPU scaled_dot_product_attention (and plain attention), N = 1k..16k.

    python benchmarks/cpu_vs_sdpa.py [--out benchmarks/results] [--seqlens 1024,4096,16384]

Each case runs in its own subprocess (clean peak-memory reading; see flashattn.bench.measure). Writes
cpu-<date>.json and cpu-<date>.png and prints time ratios (ours / torch SDPA) and peak extra memory.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from pathlib import Path

import torch
from tqdm import tqdm

from flashattn.bench.measure import Case, measure
from flashattn.bench.plot import plot_time_memory

IMPLS = ("flashattn", "sdpa", "plain")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--seqlens", default="1024,4096,16384")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--plain-limit-gib", type=float, default=12.0)
    a = p.parse_args()
    cases = [
        Case(impl, n, heads=a.heads, headdim=a.headdim, repeats=a.repeats, mode=mode)
        for mode in ("fwd", "fwd+bwd") for n in map(int, a.seqlens.split(",")) for impl in IMPLS
    ]
    results = []
    for case in tqdm(cases, unit="case"):
        if case.impl == "plain" and case.plain_attention_bytes > a.plain_limit_gib * 2**30:
            continue
        results.append(measure(case))
    date = datetime.date.today().isoformat()
    meta = {"device": "cpu", "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "date": date}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"cpu-{date}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    plot_time_memory(results, out / f"cpu-{date}.png", f"CPU ({meta['cores']} cores), fp32, batch 1, "
                     f"{a.heads} heads, headdim {a.headdim}: flashattn vs torch SDPA vs plain")
    print(f"{'mode':8} {'N':>6} {'ours ms':>9} {'sdpa ms':>9} {'ratio':>6} {'ours MiB':>9} {'sdpa MiB':>9} "
          f"{'plain MiB':>9}")
    for mode in ("fwd", "fwd+bwd"):
        for n in map(int, a.seqlens.split(",")):
            by = {r["impl"]: r for r in results if r["seqlen"] == n and r["mode"] == mode}
            ours, sdpa, plain = by["flashattn"], by["sdpa"], by.get("plain")
            if not (ours.get("seconds") and sdpa.get("seconds")):  # a failed case: its error is in the JSON
                print(f"{mode:8} {n:6d} error: {ours.get('error') or sdpa.get('error')}")
                continue
            plain_mib = f"{plain['peak_bytes'] / 2**20:9.1f}" if plain and plain.get("peak_bytes") else f"{'-':>9}"
            print(f"{mode:8} {n:6d} {ours['seconds'] * 1e3:9.1f} {sdpa['seconds'] * 1e3:9.1f} "
                  f"{ours['seconds'] / sdpa['seconds']:6.2f} {ours['peak_bytes'] / 2**20:9.1f} "
                  f"{sdpa['peak_bytes'] / 2**20:9.1f} {plain_mib}")


if __name__ == "__main__":
    main()
