"""First GPU timing: our Triton kernels against torch SDPA's flash backend, forward and backward, in one run.

    PYTHONPATH=. python3 benchmarks/triton_vs_sdpa.py --out $OUT          # on a GPU: batch 4, heads 16, N 4096, d 128
    python benchmarks/triton_vs_sdpa.py --smoke                            # CPU, tiny, interpreter: checks the script

TFLOP/s = 4 * B * H * N * N * D per forward (half when causal), 2.5x that for the backward; times are medians of
CUDA-event timings after warm-up with L2 flushed (flashattn.bench.measure). Writes
triton-vs-sdpa-<device>-<date>.json and .png under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

import flashattn
from flashattn.bench.measure import Case, run_here


def run(b, h, n, d, dtype: str, device: str, repeats: int) -> list[dict]:
    """Forward and backward of ours (the Triton backend) and SDPA's flash backend, causal and not, timed by
    ``flashattn.bench.measure`` (CUDA events, L2 flushed before each run, median)."""
    baseline = "sdpa-flash" if device == "cuda" else "sdpa"
    rows = []
    for causal in (False, True):
        for impl in ("flashattn", baseline):
            cases = {mode: Case(impl, n, b, h, d, dtype, device, causal, repeats, mode) for mode in ("fwd", "bwd")}
            with flashattn.use_backend("triton"):
                fwd, bwd = run_here(cases["fwd"]), run_here(cases["bwd"])
            rows.append({"impl": "flashattn-triton" if impl == "flashattn" else impl, "causal": causal,
                         "batch": b, "heads": h, "seqlen": n, "headdim": d, "dtype": dtype,
                         "fwd_ms": fwd["seconds"] * 1e3, "bwd_ms": bwd["seconds"] * 1e3,
                         "fwd_tflops": fwd["tflops"], "bwd_tflops": bwd["tflops"]})
    return rows


def plot(rows, path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{'causal' if c else 'full'} {m}" for c in (False, True) for m in ("fwd", "bwd")]
    width = 0.38
    for i, impl in enumerate(dict.fromkeys(r["impl"] for r in rows)):
        vals = [next(r for r in rows if r["impl"] == impl and r["causal"] == c)[f"{m}_tflops"]
                for c in (False, True) for m in ("fwd", "bwd")]
        ax.bar([x + i * width for x in range(len(labels))], vals, width, label=impl)
    ax.set_xticks([x + width / 2 for x in range(len(labels))], labels)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU under the Triton interpreter")
    a = p.parse_args()
    if a.smoke:
        device, shape, reps, dtype = "cpu", (1, 2, 64, 16), 1, "float32"
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --smoke)")
    else:
        device, shape, reps, dtype = "cuda", (4, 16, 4096, 128), 30, "bfloat16"
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu-interpreter"
    rows = run(*shape, dtype, device, reps)
    date = datetime.date.today().isoformat()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"triton-vs-sdpa-{name.replace(' ', '_')}-{date}"
    (out / f"{stem}.json").write_text(json.dumps({"device": name, "torch": torch.__version__, "rows": rows}, indent=1))
    plot(rows, out / f"{stem}.png", f"{name}: B,H,N,D = {shape}, {dtype}")
    for r in rows:
        print(f"{r['impl']:17} causal={r['causal']!s:5} fwd {r['fwd_ms']:8.2f} ms {r['fwd_tflops']:7.1f} TFLOP/s   "
              f"bwd {r['bwd_ms']:8.2f} ms {r['bwd_tflops']:7.1f} TFLOP/s")


if __name__ == "__main__":
    main()
