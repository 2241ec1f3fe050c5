"""CPU prefill with FP8 q, k, v (FlashAttention-3's interface, widened tile by tile) against bf16 q, k, v, on the
same host, in one run: the two calls alternate, median of ``--repeats`` each. Run from the checkout's root:

    PYTHONPATH=. python benchmarks/results/fp8-prefill-cpu-2026-11-26/measure.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import flashattn
from flashattn import flash_attn_func


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seqlens", default="1024,4096")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for n in (int(x) for x in args.seqlens.split(",")):
        for causal in (False, True):
            torch.manual_seed(0)
            b, h, d = 1, 8, 128
            wide = [torch.randn(b, n, h, d) for _ in range(3)]
            scales = [torch.full((b, h), 0.02) for _ in range(3)]
            fp8 = [(x / 0.02).to(torch.float8_e4m3fn) for x in wide]
            bf16 = [x.bfloat16() for x in wide]
            descales = dict(zip(("q_descale", "k_descale", "v_descale"), scales, strict=True))
            calls = {"bf16": (bf16, {}), "fp8": (fp8, descales)}
            times = {name: [] for name in calls}
            with flashattn.use_backend("cpu"):
                for inputs, kwargs in calls.values():  # warm-up (and the first call's build)
                    flash_attn_func(*inputs, causal=causal, **kwargs)
                for _ in range(args.repeats):
                    for name, (inputs, kwargs) in calls.items():
                        start = time.perf_counter()
                        flash_attn_func(*inputs, causal=causal, **kwargs)
                        times[name].append(time.perf_counter() - start)
            med = {name: statistics.median(t) for name, t in times.items()}
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            row = {"seqlen": n, "causal": causal, "bf16_ms": round(med["bf16"] * 1e3, 2),
                   "fp8_ms": round(med["fp8"] * 1e3, 2), "fp8_over_bf16_speed": round(med["bf16"] / med["fp8"], 3),
                   "bf16_tflops": round(flops / med["bf16"] / 1e12, 3)}
            rows.append(row)
            print(row, flush=True)
    meta = {"cpu": cpu_model(), "threads": args.threads, "torch": torch.__version__, "repeats": args.repeats,
            "date": time.strftime("%Y-%m-%d"), "shape": "batch 1, 8 heads, d=128, q/k/v same length"}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
