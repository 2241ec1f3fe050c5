"""Time and peak memory of one attention implementation on one problem size.

CPU: torch has no peak-memory counter for CPU tensors, so each case runs in a fresh subprocess that warms up on a
tiny problem (loading code, starting threads), resets the kernel's peak-RSS mark (``/proc/self/clear_refs``), and
reports how far the peak rose over what it held just before the call. CUDA: CUDA events and
``torch.cuda.max_memory_allocated`` in this process.

Run one case by hand::

    python -m flashattn.bench.measure flashattn 4096 --heads 4 --headdim 64
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ..interface import flash_attn_func


def plain_attention(q, k, v, causal):
    """Algorithm 0 in PyTorch: S and P are full (B, H, N, N) tensors."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return (torch.softmax(s, dim=-1) @ v).transpose(1, 2)


def torch_sdpa(q, k, v, causal):
    """PyTorch's own scaled_dot_product_attention (on CPU, its fused flash kernel)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2)


def ours(q, k, v, causal):
    return flash_attn_func(q, k, v, causal=causal)


IMPLEMENTATIONS: dict[str, Callable] = {"flashattn": ours, "plain": plain_attention, "torch_sdpa": torch_sdpa}


@dataclass
class Case:
    impl: str
    seqlen: int
    batch: int = 1
    heads: int = 4
    headdim: int = 64
    dtype: str = "float32"
    device: str = "cpu"
    causal: bool = False
    repeats: int = 3
    mode: str = "fwd"  # "fwd" (inference) or "fwd+bwd" (training step of the attention alone)


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux >= 4.0: reset VmHWM, the peak resident set size, to the current size
        return True
    except OSError:
        return False


def _step(fn, q, k, v, causal: bool, mode: str) -> None:
    if mode == "fwd":
        with torch.inference_mode():
            fn(q, k, v, causal)
        return
    out = fn(q, k, v, causal)
    out.backward(torch.ones_like(out))
    for t in (q, k, v):
        t.grad = None


def run_here(case: Case) -> dict:
    """Measure in this process: median seconds of ``repeats`` calls after one warm-up, and peak extra bytes."""
    if case.mode not in ("fwd", "fwd+bwd"):
        raise ValueError(f"mode must be 'fwd' or 'fwd+bwd', got {case.mode!r}")
    fn = IMPLEMENTATIONS[case.impl]
    dtype = getattr(torch, case.dtype)
    shape = (case.batch, case.seqlen, case.heads, case.headdim)
    grad = case.mode == "fwd+bwd"
    q, k, v = (torch.randn(shape, dtype=dtype, device=case.device, requires_grad=grad) for _ in range(3))
    cuda = case.device.startswith("cuda")
    tiny = [t.detach()[:, : min(case.seqlen, 16)].requires_grad_(grad) for t in (q, k, v)]
    _step(fn, *tiny, case.causal, case.mode)  # load code and start thread pools outside the measured call
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        exact = _reset_peak_rss()
        before = _proc_status("VmRSS")
    _step(fn, q, k, v, case.causal, case.mode)  # the measured call; it also warms up the timing loop
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        high = _proc_status("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        peak = high - before
    times = []
    for _ in range(case.repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _step(fn, q, k, v, case.causal, case.mode)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            _step(fn, q, k, v, case.causal, case.mode)
            times.append(time.perf_counter() - t0)
    return {**asdict(case), "seconds": statistics.median(times), "peak_bytes": max(0, peak)}


def measure(case: Case, timeout: float = 600) -> dict:
    """Measure ``case``, isolated in a subprocess on CPU (a clean peak-RSS reading), in-process on CUDA."""
    if case.device.startswith("cuda"):
        return run_here(case)
    args = [sys.executable, "-m", "flashattn.bench.measure", case.impl, str(case.seqlen), "--json"]
    for key in ("batch", "heads", "headdim", "dtype", "device", "repeats", "mode"):
        args += [f"--{key}", str(getattr(case, key))]
    if case.causal:
        args.append("--causal")
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        error = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        return {**asdict(case), "seconds": None, "peak_bytes": None, "error": error}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Time and peak memory of one attention call.")
    p.add_argument("impl", choices=sorted(IMPLEMENTATIONS))
    p.add_argument("seqlen", type=int)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--mode", default="fwd", choices=("fwd", "fwd+bwd"))
    p.add_argument("--json", action="store_true", help="print one JSON line")
    a = p.parse_args(argv)
    case = Case(a.impl, a.seqlen, a.batch, a.heads, a.headdim, a.dtype, a.device, a.causal, a.repeats, a.mode)
    result = run_here(case)
    print(json.dumps(result) if a.json else result)


if __name__ == "__main__":
    main()
