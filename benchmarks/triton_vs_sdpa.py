"""First GPU timing: our Triton kernels against torch SDPA's flash backend, forward and backward, in one run.

    PYTHONPATH=. python3 benchmarks/triton_vs_sdpa.py --out $OUT          # on a GPU: batch 4, heads 16, N 4096, d 128
    python benchmarks/triton_vs_sdpa.py --smoke                            # CPU, tiny, interpreter: checks the script

TFLOP/s = 4 * B * H * N * N * D per forward (half when causal), 2.5x that for the backward. Times are medians of
CUDA-event timings after warm-up. Writes triton-vs-sdpa-<device>-<date>.json and .png under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

import flashattn


def sdpa_flash(q, k, v, causal):
    """PyTorch SDPA restricted to its flash backend (FlashAttention-2) where available."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)


def ours(q, k, v, causal):
    with flashattn.use_backend("triton"):
        return flashattn.flash_attn_func(q, k, v, causal=causal)


def timed(fn, warmup: int, reps: int) -> float:
    """Median seconds of ``fn()``; CUDA events on a GPU, wall clock otherwise."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            import time

            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_fwd_and_bwd(impl, q, k, v, causal, warmup, reps) -> tuple[float, float]:
    """(forward seconds, backward seconds), the backward as (forward + backward) - forward."""
    g = torch.randn_like(impl(q, k, v, causal))

    def fwd_bwd():
        torch.autograd.grad(impl(q, k, v, causal), (q, k, v), g)

    fwd = timed(lambda: impl(q, k, v, causal), warmup, reps)
    return fwd, max(timed(fwd_bwd, warmup, reps) - fwd, 1e-9)


def run(b, h, n, d, dtype, device, warmup, reps) -> list[dict]:
    rows = []
    for causal in (False, True):
        q, k, v = (torch.randn(b, n, h, d, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
        flops_fwd = 4 * b * h * n * n * d / (2 if causal else 1)
        for name, impl in (("flashattn-triton", ours), ("sdpa-flash", sdpa_flash)):
            fwd, bwd = time_fwd_and_bwd(impl, q, k, v, causal, warmup, reps)
            rows.append({"impl": name, "causal": causal, "batch": b, "heads": h, "seqlen": n, "headdim": d,
                         "dtype": str(dtype).removeprefix("torch."), "fwd_ms": fwd * 1e3, "bwd_ms": bwd * 1e3,
                         "fwd_tflops": flops_fwd / fwd / 1e12, "bwd_tflops": 2.5 * flops_fwd / bwd / 1e12})
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
    for i, impl in enumerate(("flashattn-triton", "sdpa-flash")):
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
        device, shape, warmup, reps = "cpu", (1, 2, 64, 16), 0, 1
        dtype = torch.float32
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --smoke)")
    else:
        device, shape, warmup, reps, dtype = "cuda", (4, 16, 4096, 128), 5, 20, torch.bfloat16
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu-interpreter"
    rows = run(*shape, dtype, device, warmup, reps)
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
