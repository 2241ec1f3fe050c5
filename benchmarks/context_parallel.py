"""Context-parallel attention across GPUs (NCCL): time and communication volume of every layout.

    torchrun --nproc-per-node 8 benchmarks/context_parallel.py --seqlen 131072 --out results/
    PYTHONPATH=. torchrun --nproc-per-node 1 benchmarks/context_parallel.py --seqlen 16384   # proves the NCCL path

Each rank holds seqlen / world tokens; the script times forward and forward+backward of each layout with CUDA
events (the slowest rank's median of --repeats, ranks started together) and prints the bytes each rank sends
per step, computed from the shapes:

    ring / zigzag   forward (w - 1) x 2 local K/V blocks; backward (w - 1) x (K, V, dK, dV) + the last (dK, dV),
                    gradients in float32
    all-gather      forward (w - 1)/w x 2 full K/V; backward the same again plus (w - 1)/w x 2 full dK/dV
    Ulysses         forward (w - 1)/w x (q, k, v, out) local tensors; backward the same
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

import flashattn.distributed as fd

LAYOUTS = {"ring": (fd.ring_flash_attn_func, "contiguous"), "zigzag": (fd.zigzag_ring_flash_attn_func, "zigzag"),
           "allgather": (fd.allgather_flash_attn_func, "contiguous"),
           "ulysses": (fd.ulysses_flash_attn_func, "contiguous")}


def sent_bytes(name: str, world: int, batch: int, local: int, heads: int, heads_kv: int, d: int, size: int) -> dict:
    """Bytes one rank sends in a forward and in a backward."""
    block = batch * local * heads_kv * d * size
    q_block = batch * local * heads * d * size
    share = (world - 1) / world
    if name in ("ring", "zigzag"):
        grad = block * 4 // size  # dK, dV accumulate in float32 while they travel
        return {"fwd": (world - 1) * 2 * block, "bwd": (world - 1) * 2 * (block + grad) + 2 * grad if world > 1 else 0}
    if name == "allgather":
        full = block * world
        return {"fwd": share * 2 * full, "bwd": share * 4 * full}
    return {"fwd": share * (2 * q_block + 2 * block), "bwd": share * (2 * q_block + 2 * block)}


def _time(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls after two warm-ups, started together on every rank (a barrier before
    each), and the slowest rank's median: a step ends when the last rank is done."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    slowest = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=32768)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--heads-kv", type=int, default=8)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # before NCCL starts, so it binds this GPU
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16
    rows = []
    for name, (fn, layout) in LAYOUTS.items():
        if name == "ulysses" and (a.heads % world or a.heads_kv % world):
            continue
        torch.manual_seed(0)
        full = [torch.randn(a.batch, a.seqlen, h, a.headdim, device="cuda", dtype=dtype)
                for h in (a.heads, a.heads_kv, a.heads_kv)]
        q, k, v = (fd.shard(t, layout).requires_grad_() for t in full)
        fwd = _time(lambda: fn(q, k, v, causal=True), a.repeats)  # noqa: B023
        ones = torch.ones_like(q)  # d(out.sum())/d(out); autograd.grad, so no .grad accumulation is timed
        step = _time(lambda: torch.autograd.grad(fn(q, k, v, causal=True), (q, k, v), ones), a.repeats)  # noqa: B023
        flops = 4 * a.batch * a.heads * a.seqlen**2 * a.headdim / 2 / world
        row = {"layout": name, "world": world, "seqlen": a.seqlen, "fwd_s": fwd, "fwd_bwd_s": step,
               "fwd_tflops_per_gpu": flops / fwd / 1e12,
               "sent_bytes": sent_bytes(name, world, a.batch, a.seqlen // world, a.heads, a.heads_kv, a.headdim, 2)}
        rows.append(row)
        if rank == 0:
            sent = {key: val / 2**20 for key, val in row["sent_bytes"].items()}
            print(f"{name:10} world {world} fwd {fwd * 1e3:8.2f} ms  fwd+bwd {step * 1e3:8.2f} ms  "
                  f"{row['fwd_tflops_per_gpu']:6.1f} TFLOP/s/GPU  sends fwd {sent['fwd']:9.1f} MiB "
                  f"bwd {sent['bwd']:9.1f} MiB")
    if rank == 0 and a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / f"context-parallel-w{world}.json").write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
