"""A device's two ceilings, measured in the run that reports against them (``flashattn bench sweep --ceilings``):
the dense matrix-product rate of the sweep's dtype and the memory bandwidth. On CUDA: ``torch.matmul`` of 8192^3
(median of CUDA-event timings, random inputs: zeros run faster) and ``dst.copy_(src)`` of 1 GiB (bytes read plus
written); on CPU, the roofline benchmark's product rate and read bandwidth, on smaller problems.

    >>> limits = measure("cpu", "float32", quick=True)
    >>> sorted(limits)
    ['bandwidth_gbps', 'bandwidth_kind', 'matmul_dtype', 'matmul_tflops']
"""

from __future__ import annotations

import statistics

import torch

from .decode import copy_bandwidth
from .measure import time_calls
from .roofline import read_bandwidth


def _cuda_matmul_tflops(device: str, dtype: torch.dtype, n: int = 8192, repeats: int = 10) -> float:
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    times = time_calls(lambda: a @ b, repeats, device, flush_l2=False)
    return 2 * n**3 / statistics.median(times) / 1e12


def _cpu_matmul_tflops(dtype: torch.dtype, n: int) -> float:
    a, b = (torch.randn(n, n).to(dtype) for _ in range(2))
    a @ b
    best = min(statistics.median(time_calls(lambda: a @ b, 1, "cpu")) for _ in range(3))
    return 2 * n**3 / best / 1e12


def measure(device: str, dtype: str = "bfloat16", quick: bool = False) -> dict:
    """{"matmul_tflops", "matmul_dtype", "bandwidth_gbps", "bandwidth_kind"} of ``device``; ``quick``: small
    problems (seconds on any machine, for smoke runs)."""
    torch_dtype = getattr(torch, dtype)
    if device.startswith("cuda"):
        tflops = _cuda_matmul_tflops(device, torch_dtype, n=2048 if quick else 8192)
        gbps = copy_bandwidth(device, 2**26 if quick else 2**30, 10)["gbps"]
        kind = "copy (read + write)"
    else:
        tflops = _cpu_matmul_tflops(torch_dtype, 256 if quick else 2048)
        gbps = read_bandwidth(1 / 64 if quick else None)
        kind = "read"
    return {"matmul_tflops": float(f"{tflops:.3g}"), "matmul_dtype": dtype, "bandwidth_gbps": float(f"{gbps:.3g}"),
            "bandwidth_kind": kind}
