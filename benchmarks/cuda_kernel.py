"""The CUDA C++ kernel on a GPU in one run: compile (NVRTC, timed), accuracy against float64 beside torch SDPA in
the same precision, and forward timings beside our Triton kernel and SDPA's flash backend.

    PYTHONPATH=. python3 benchmarks/cuda_kernel.py --out $OUT     # on a GPU
    python benchmarks/cuda_kernel.py --smoke --out /tmp/x          # no GPU: the NVRTC compile and the files only

Accuracy: max |out - float64 reference| over (dtype, head dim, causal) at B=2, H=8, N=1025, and the same for
torch SDPA (the tolerance rule: ours <= 2x SDPA's). Timing: TFLOP/s = 4 * B * H * N * N * D (half when causal)
from medians of CUDA-event timings with L2 flushed (flashattn.bench.measure), 16k tokens per batch, hidden 2048.
Writes cuda-kernel-<device>-<date>.json and .png under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch

import flashattn
from flashattn.backends.cuda import runtime
from flashattn.bench.measure import Case, run_here


def compile_seconds(device_arch: str) -> float:
    start = time.perf_counter()
    runtime.compile_source((runtime.SOURCE_DIR / "flash_fwd.cu").read_text(), "flash_fwd.cu", device_arch)
    return time.perf_counter() - start


def accuracy() -> list[dict]:
    rows = []
    for dtype in (torch.float16, torch.bfloat16):
        for d in (64, 128):
            for causal in (False, True):
                q, k, v = (torch.randn(2, 1025, 8, d, dtype=dtype, device="cuda") for _ in range(3))
                with flashattn.use_backend("cuda"):
                    ours = flashattn.flash_attn_func(q, k, v, causal=causal)
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                ref = torch.nn.functional.scaled_dot_product_attention(qt.double(), kt.double(), vt.double(),
                                                                       is_causal=causal).transpose(1, 2)
                sdpa = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
                err, base = ((x.double() - ref).abs().max().item() for x in (ours, sdpa))
                rows.append({"dtype": str(dtype).removeprefix("torch."), "headdim": d, "causal": causal,
                             "max_err": err, "sdpa_max_err": base, "passes": err <= 2 * base})
    return rows


def timings(repeats: int) -> list[dict]:
    rows = []
    for d in (64, 128):
        for causal in (False, True):
            for n in (1024, 4096, 16384):
                b, h = max(1, 16384 // n), 2048 // d
                for impl in ("flashattn-cuda", "flashattn", "sdpa-flash"):
                    row = run_here(Case(impl, n, b, h, d, "bfloat16", "cuda", causal, repeats, "fwd"))
                    rows.append({**row, "impl": "flashattn-triton" if impl == "flashattn" else impl})
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["headdim"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.5), squeeze=False)
    for ax, (d, causal) in zip(axes[0], keys, strict=True):
        for impl in ("flashattn-cuda", "flashattn-triton", "sdpa-flash"):
            pts = sorted((r["seqlen"], r["tflops"]) for r in rows
                         if r["impl"] == impl and r["headdim"] == d and r["causal"] == causal and r.get("tflops"))
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=impl)
        ax.set(xscale="log", xlabel="sequence length", ylabel="TFLOP/s (forward)",
               title=f"d={d}{' causal' if causal else ''}")
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--smoke", action="store_true", help="no GPU: compile with NVRTC for sm_90, write the files")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    if args.smoke:
        result = {"device": "none (smoke)", "compile_seconds_sm90": compile_seconds("sm_90")}
        name = "smoke"
    else:
        major, minor = torch.cuda.get_device_capability()
        device = torch.cuda.get_device_name()
        result = {"device": device, "date": date, "compile_seconds": compile_seconds(f"sm_{major}{minor}"),
                  "accuracy": accuracy(), "timings": timings(args.repeats)}
        name = device.replace(" ", "-").lower()
        plot(result["timings"], args.out / f"cuda-kernel-{name}-{date}.png", f"{device}, bf16, forward")
        for row in result["accuracy"]:
            print(f"{row['dtype']:9} d={row['headdim']:3} causal={row['causal']!s:5}  max err {row['max_err']:.2e}"
                  f"  (sdpa {row['sdpa_max_err']:.2e})  {'ok' if row['passes'] else 'FAIL'}")
        for row in result["timings"]:
            print(f"{row['impl']:17} d={row['headdim']:3} causal={row['causal']!s:5} N={row['seqlen']:6}  "
                  f"{row.get('tflops') or float('nan'):7.1f} TFLOP/s  {row.get('error') or ''}")
    path = args.out / f"cuda-kernel-{name}-{date}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
