"""``flashattn bench context-parallel``: context-parallel attention across ranks, the time and the communication
volume of every layout.

    flashattn bench context-parallel --nproc-per-node 8 --seqlen 131072   # one node: starts torchrun itself
    flashattn bench context-parallel --device cpu --nproc-per-node 2 --seqlen 1024   # gloo on CPU: the machinery
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m flashattn.bench.context_parallel --seqlen 262144                # several nodes: torchrun as usual

The subcommand needs one process per device, so outside torchrun it starts ``python -m torch.distributed.run
--standalone --nproc-per-node N -m flashattn.bench.context_parallel ...`` with this interpreter (so the same
environment, whether or not ``torchrun`` is on PATH) and returns its exit status; inside torchrun (``LOCAL_RANK``
set) it runs this rank's part. NCCL on GPUs, gloo on CPU.

Each rank holds seqlen / world tokens; each layout's forward and forward+backward are timed (the slowest rank's
median of --repeats, every call started behind a barrier so the ranks begin together; CUDA events on a GPU,
``perf_counter`` on CPU; no L2 flush), and the bytes each rank sends per step are computed from the shapes:

    ring / zigzag   forward (w - 1) x 2 local K/V blocks; backward (w - 1) x (K, V, dK, dV) + the last (dK, dV),
                    gradients in float32
    all-gather      forward (w - 1)/w x 2 full K/V; backward the same again plus (w - 1)/w x 2 full dK/dV
    Ulysses         forward (w - 1)/w x (q, k, v, out) local tensors; backward the same
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import flashattn.distributed as fd

from . import load, options, report

HELP = "ring, zigzag, all-gather and Ulysses context parallelism under torchrun: time and bytes sent per rank"
LAYOUTS = {"ring": (fd.ring_flash_attn_func, "contiguous"), "zigzag": (fd.zigzag_ring_flash_attn_func, "zigzag"),
           "allgather": (fd.allgather_flash_attn_func, "contiguous"),
           "ulysses": (fd.ulysses_flash_attn_func, "contiguous")}
# What a rank needs to know: forwarded to each rank by the torchrun command line.
RANK_OPTIONS = ("device", "seqlen", "batch", "heads", "heads_kv", "headdim", "dtype", "repeats", "out", "name")


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


def _once(fn, cuda: bool) -> float:
    if not cuda:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def _time(fn, repeats: int, device: str) -> float:
    """Median seconds of ``repeats`` calls after two warm-ups, started together on every rank (a barrier before
    each), and the slowest rank's median: a step ends when the last rank is done."""
    fn()
    fn()
    cuda = device.startswith("cuda")
    times = []
    for _ in range(repeats):
        dist.barrier()
        times.append(_once(fn, cuda))
    slowest = torch.tensor([statistics.median(times)], device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def measure_layout(name: str, a: argparse.Namespace, device: str, world: int) -> dict:
    """Time one layout (causal) on this rank's shard of a (batch, seqlen, heads, headdim) problem."""
    fn, layout = LAYOUTS[name]
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(0)
    full = [torch.randn(a.batch, a.seqlen, h, a.headdim, device=device, dtype=dtype)
            for h in (a.heads, a.heads_kv, a.heads_kv)]
    q, k, v = (fd.shard(t, layout).requires_grad_() for t in full)
    fwd = _time(lambda: fn(q, k, v, causal=True), a.repeats, device)
    ones = torch.ones_like(q)  # d(out.sum())/d(out); autograd.grad, so no .grad accumulation is timed
    step = _time(lambda: torch.autograd.grad(fn(q, k, v, causal=True), (q, k, v), ones), a.repeats, device)
    flops = 4 * a.batch * a.heads * a.seqlen**2 * a.headdim / 2 / world
    size = torch.finfo(dtype).bits // 8
    return {"layout": name, "world": world, "seqlen": a.seqlen, "batch": a.batch, "heads": a.heads,
            "heads_kv": a.heads_kv, "headdim": a.headdim, "dtype": a.dtype, "fwd_s": fwd, "fwd_bwd_s": step,
            "fwd_tflops_per_gpu": flops / fwd / 1e12,
            "sent_bytes": sent_bytes(name, world, a.batch, a.seqlen // world, a.heads, a.heads_kv, a.headdim, size)}


COLUMNS = ["layout", "world", report.Col("fwd ms", "fwd_s", scale=1e3),
           report.Col("fwd+bwd ms", "fwd_bwd_s", scale=1e3),
           report.Col("fwd TFLOP/s per rank", "fwd_tflops_per_gpu"),
           report.Col("sends fwd MiB", lambda r: r["sent_bytes"]["fwd"] / 2**20),
           report.Col("sends bwd MiB", lambda r: r["sent_bytes"]["bwd"] / 2**20)]


def _resolved(a: argparse.Namespace) -> tuple[str, str]:
    device = a.device or options.default_device()
    return device, a.dtype or ("bfloat16" if device.startswith("cuda") else "float32")


def run_ranks(a: argparse.Namespace) -> int:
    """This rank's part of the benchmark (inside torchrun); rank 0 prints the table and writes the results."""
    a.device, a.dtype = _resolved(a)
    device = a.device
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)  # before NCCL starts, so it binds this GPU
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        rows = [measure_layout(name, a, device, world) for name in LAYOUTS
                if name != "ulysses" or not (a.heads % world or a.heads_kv % world)]
        if rank == 0:
            print(report.table(rows, COLUMNS))
            sweep = {k: getattr(a, k) for k in RANK_OPTIONS if k not in ("out", "name")}
            meta = report.meta(device, a.command_line, sweep, world=world, backend=dist.get_backend())
            for path in report.write(rows, meta, Path(a.out), a.name or f"context-parallel-w{world}"):
                print(f"wrote {path}")
    finally:
        if dist.get_backend() == "nccl":
            dist.destroy_process_group()
        # gloo: no teardown. ProcessGroupGloo's destructor joins a gloo thread that may wait for the GIL it holds
        # (seen on torch 2.7); the rank's process ends at once instead (``main``), destructors unrun.
    return 0


def torchrun_command(a: argparse.Namespace) -> list[str]:
    """The command that runs this benchmark on ``--nproc-per-node`` local processes."""
    device, _ = _resolved(a)
    nproc = a.nproc_per_node or (max(1, torch.cuda.device_count()) if device.startswith("cuda") else 1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "flashattn.bench.context_parallel"]
    for key in RANK_OPTIONS:
        if getattr(a, key) is not None:
            cmd += [f"--{key.replace('_', '-')}", str(getattr(a, key))]
    return cmd


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc-per-node", type=options.positive_int, default=None,
                   help="ranks to start on this machine (default: every visible GPU; 1 on CPU); ignored inside "
                        "torchrun, which decides")
    options.add_device(p)
    p.add_argument("--seqlen", type=options.positive_int, default=32768, help="whole sequence, split over the ranks")
    p.add_argument("--batch", type=options.positive_int, default=1, help="batch size")
    p.add_argument("--heads", type=options.positive_int, default=32, help="query heads")
    p.add_argument("--heads-kv", type=options.positive_int, default=8, help="key/value heads")
    p.add_argument("--headdim", type=options.positive_int, default=128, help="head dimension")
    options.add_dtype(p)
    p.add_argument("--repeats", type=options.positive_int, default=10, help="timed runs per layout (the median)")
    options.add_output(p, "context-parallel-w<world>", progress=False)


def check(a: argparse.Namespace) -> str | None:
    if a.heads % a.heads_kv:
        return f"--heads {a.heads} is not a multiple of --heads-kv {a.heads_kv}"
    return None


def command(a: argparse.Namespace) -> int:
    if "LOCAL_RANK" in os.environ:  # started by torchrun (or another launcher that sets up torch.distributed)
        return run_ranks(a)
    cmd = torchrun_command(a)
    print("running", " ".join(cmd[:8]), "...", flush=True)
    return subprocess.run(cmd, env=load.child_environment()).returncode  # the ranks record this process's reading


def main(argv: list[str] | None = None) -> int:
    """``python -m flashattn.bench.context_parallel``: what torchrun runs on each rank."""
    p = argparse.ArgumentParser(prog="python -m flashattn.bench.context_parallel", description=options.plain(__doc__),
                                formatter_class=options.HelpFormatter)
    add_arguments(p)
    a = p.parse_args(argv)
    problem = check(a)
    if problem:
        p.error(problem)
    a.command_line = ["python", "-m", "flashattn.bench.context_parallel", *(sys.argv[1:] if argv is None else argv)]
    if "LOCAL_RANK" in os.environ:  # a rank: its parent took the reading (siblings starting up would skew its own)
        code = command(a)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # without interpreter teardown: see run_ranks
    with load.measured():
        return command(a)


if __name__ == "__main__":
    raise SystemExit(main())
