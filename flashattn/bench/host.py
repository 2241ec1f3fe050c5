"""``flashattn bench host``: what a call costs the host, in microseconds from the Python entry to its kernels'
launches, for each entry point.

A decode step of a 32-layer model makes 32 attention calls per token; at batch 1 their kernels take tens of
microseconds each, so whatever Python spends before a launch is paid in full, once per layer and token. Two modes:

- ``stub`` (the default without a GPU): the Triton kernels are compiled for a GPU architecture (``--arch``, sm_90 by
  default) and their launches recorded instead of run (``flashattn.backends.triton.stub``): every step a GPU call
  takes on the host runs on CPU tensors, and each launch records its time. The figure of an entry point is the
  median time from the call to its last launch (the backward's last for ``train``). This is the host cost alone,
  on the CPU named in the results, without a GPU's driver call (a few microseconds per launch). Beside ``train``,
  its floor (impl ``autograd``): the same step through a no-op ``autograd.Function`` that only allocates the
  outputs and gradients, torch's own share of a training call on that CPU.
- ``gpu``: many calls queued back to back at tiny shapes and the wall time per call, so the host's time is what
  is measured (the kernels finish faster than the calls come); torch SDPA beside ours in the same run.

``--json FILE`` writes the medians under the keys ``fwd`` (``flash_attn_func``), ``train`` (its forward and
backward), ``decode`` (``flash_attn_with_kvcache``, int ``cache_seqlens``), ``decode_tensor_seqlens``, ``varlen``
(``flash_attn_varlen_func``) and ``sdpa`` (``scaled_dot_product_attention``), and the others measured, with the
machine and the mode.

    flashattn bench host                           # stubbed on a CPU: a table, host-stub.json and .png
    flashattn bench host --json host.json --calls 500
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.nn.functional as F

import flashattn
import flashattn.nn

from ..host import cpu_flags
from . import options, report

HELP = "host cost per call: microseconds from the Python entry to each kernel launch (stubbed on a CPU)"
# Microseconds from the call to the last launch, stubbed: a forward, a training step's forward and backward together,
# a decode step; a packed (varlen) call as its dense counterpart.
BUDGETS = {"fwd": 30.0, "train": 80.0, "decode": 30.0, "decode_tensor_seqlens": 30.0, "varlen": 30.0,
           "varlen_train": 80.0}
HEADS, HEADS_KV, HEAD_DIM, SEQLEN, CACHE = 32, 8, 128, 128, 4096


def _randn(*shape, device, dtype=torch.bfloat16, grad=False):
    return torch.randn(*shape, device=device, dtype=dtype, requires_grad=grad)


def _dense(device):
    return [_randn(1, SEQLEN, h, HEAD_DIM, device=device) for h in (HEADS, HEADS_KV, HEADS_KV)]


def _fwd(device):
    q, k, v = _dense(device)
    return lambda: flashattn.flash_attn_func(q, k, v, causal=True)


def _train(device):
    q, k, v = inputs = [t.requires_grad_() for t in _dense(device)]
    grad = torch.randn_like(q)

    def step():  # autograd.grad: no .grad to accumulate (in stub mode a real CPU sum, on a GPU an async launch)
        torch.autograd.grad(flashattn.flash_attn_func(q, k, v, causal=True), inputs, grad)

    return step


def _varlen(device, *, train: bool = False):
    q, k, v = inputs = [t[0].requires_grad_(train) for t in _dense(device)]  # two sequences of 64 tokens, packed
    cu = torch.tensor([0, SEQLEN // 2, SEQLEN], dtype=torch.int32, device=device)
    if not train:
        return lambda: flashattn.flash_attn_varlen_func(q, k, v, cu, cu, SEQLEN // 2, SEQLEN // 2, causal=True)
    grad = torch.randn_like(q)
    return lambda: torch.autograd.grad(
        flashattn.flash_attn_varlen_func(q, k, v, cu, cu, SEQLEN // 2, SEQLEN // 2, causal=True), inputs, grad)


def _varlen_paged(device):
    q = _randn(SEQLEN, HEADS, HEAD_DIM, device=device)  # two chunks of 64 queries against a paged cache
    k_cache, v_cache = (_randn(CACHE // 128, 256, HEADS_KV, HEAD_DIM, device=device) for _ in range(2))
    table = torch.arange(CACHE // 128, dtype=torch.int32, device=device).view(2, -1)
    cu_q = torch.tensor([0, SEQLEN // 2, SEQLEN], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, CACHE, 2 * CACHE], dtype=torch.int32, device=device)
    return lambda: flashattn.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, SEQLEN // 2, CACHE, causal=True,
                                                    block_table=table)


def _cache(device, *, paged: bool = False):
    shape = (CACHE // 256, 256) if paged else (1, CACHE)
    k_cache, v_cache = (_randn(*shape, HEADS_KV, HEAD_DIM, device=device) for _ in range(2))
    q = _randn(1, 1, HEADS, HEAD_DIM, device=device)
    table = torch.arange(CACHE // 256, dtype=torch.int32, device=device)[None] if paged else None
    return q, k_cache, v_cache, table


def _decode(device, *, seqlens: str = "int", paged: bool = False, append: bool = False, rotary: bool = False):
    q, k_cache, v_cache, table = _cache(device, paged=paged)
    lengths = CACHE // 2 if seqlens == "int" else torch.tensor([CACHE // 2], dtype=torch.int32, device=device)
    new = [_randn(1, 1, HEADS_KV, HEAD_DIM, device=device) for _ in range(2)] if append else [None, None]
    tables = {}
    if rotary:  # float32 tables over the cache's positions, rotary_dim = head dim (as flashattn.nn's)
        angles = torch.outer(torch.arange(CACHE, device=device, dtype=torch.float32),
                             torch.rand(HEAD_DIM // 2, device=device))
        tables = {"rotary_cos": angles.cos(), "rotary_sin": angles.sin()}
    return lambda: flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, *new, cache_seqlens=lengths,
                                                     block_table=table, causal=True, **tables)


def _sdpa(device):
    q, k, v = (t.transpose(1, 2) for t in _dense(device))
    return lambda: flashattn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _module(device):
    # float32: on a CPU (stubbed) a bfloat16 linear layer of this size takes milliseconds, not the GPU's microseconds
    layer = flashattn.nn.SelfAttention(512, 4, 2, device=device, dtype=torch.float32).eval()
    cache = layer.new_cache(1, 64, device=device, dtype=torch.float32)
    x = _randn(1, 1, 512, device=device, dtype=torch.float32)

    def step():
        cache.seqlens.zero_()  # the same step each time: a fixed cache position
        with torch.no_grad():
            layer(x, cache)

    return step


# Entry point -> (what it times, how to build the call on a device). The first six are --json's keys.
ENTRIES: dict[str, tuple[str, Callable]] = {
    "fwd": ("flash_attn_func, causal, 1 x 128 x 32:8 x 128", _fwd),
    "train": ("flash_attn_func forward + backward", _train),
    "decode": ("flash_attn_with_kvcache, 1 token, 4k cache, int cache_seqlens", _decode),
    "decode_tensor_seqlens": ("the same with an int32 tensor cache_seqlens",
                              lambda d: _decode(d, seqlens="tensor")),
    "varlen": ("flash_attn_varlen_func, 2 x 64 tokens", _varlen),
    "sdpa": ("scaled_dot_product_attention, causal, GQA", _sdpa),
    "decode_paged": ("flash_attn_with_kvcache, paged (256-token pages), tensor cache_seqlens",
                     lambda d: _decode(d, seqlens="tensor", paged=True)),
    "decode_append": ("flash_attn_with_kvcache appending new k, v", lambda d: _decode(d, seqlens="tensor",
                                                                                      append=True)),
    "decode_rotary": ("flash_attn_with_kvcache appending new k, v with rotary_cos/sin",
                      lambda d: _decode(d, seqlens="tensor", append=True, rotary=True)),
    "varlen_train": ("flash_attn_varlen_func forward + backward", lambda d: _varlen(d, train=True)),
    "varlen_paged": ("flash_attn_varlen_func, 2 x 64 queries against a paged 4k cache each", _varlen_paged),
    # Stubbed, its projections and rotary run on the CPU: more than a GPU's launches of them.
    "nn_decode": ("flashattn.nn.SelfAttention (512 wide, float32), one token with a KVCache", _module),
}


def _sdpa_twin(entry: str, device: str) -> Callable | None:
    """torch SDPA doing what ``entry`` does (GPU mode's baseline), or None where it has no counterpart."""
    if entry in ("fwd", "sdpa", "train"):
        q, k, v = (t.transpose(1, 2).requires_grad_(entry == "train") for t in _dense(device))
        if entry != "train":
            return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        grad = torch.randn_like(q)
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(grad)
    if entry in ("varlen", "varlen_train"):  # the two sequences as a batch of two: what packing spares a padded batch
        train = entry == "varlen_train"
        q, k, v = (t.view(2, SEQLEN // 2, *t.shape[2:]).transpose(1, 2).requires_grad_(train) for t in _dense(device))
        if not train:
            return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        grad = torch.randn_like(q)
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(grad)
    if entry.startswith("decode"):
        q, k_cache, v_cache, _ = _cache(device)
        k, v = (t[:, : CACHE // 2].transpose(1, 2) for t in (k_cache, v_cache))
        return lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k, v, enable_gqa=True)
    return None


def measure_stubbed(entry: str, calls: int, launches) -> dict:
    """Median microseconds from the call to each of its launches, and to its return, over ``calls`` calls (after
    three that compile and warm up)."""
    call = ENTRIES[entry][1]("cpu")
    for _ in range(3):
        call()
    per_launch: list[list[float]] = []
    totals, names = [], []
    for _ in range(calls):
        launches.clear()
        start = time.perf_counter_ns()
        call()
        end = time.perf_counter_ns()
        names = [name for _, name in launches.stamps]
        for i, (stamp, _) in enumerate(launches.stamps):
            if i == len(per_launch):
                per_launch.append([])
            per_launch[i].append((stamp - start) / 1e3)
        totals.append((end - start) / 1e3)
    to_launch = [round(statistics.median(times), 2) for times in per_launch]
    return {"entry": entry, "impl": "flashattn", "us": to_launch[-1] if to_launch else None, "launches": names,
            "us_to_each_launch": to_launch, "us_to_return": round(statistics.median(totals), 2)}


class _NoOp(torch.autograd.Function):
    """What autograd alone costs a training call: the outputs allocated, nothing computed (``train``'s floor)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        ctx.save_for_backward(q, k, v, out)
        return out

    @staticmethod
    def backward(ctx, _dout):
        q, k, v, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def measure_autograd_floor(calls: int) -> dict:
    """``train``'s step through a no-op ``autograd.Function`` in place of flash_attn_func: the median
    microseconds to the backward's return, torch's own share of a training call's host cost on this CPU."""
    q, k, v = inputs = [t.requires_grad_() for t in _dense("cpu")]
    grad = torch.randn_like(q)
    apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, _NoOp)  # as ours: the C apply
    times = []
    for i in range(calls + 3):
        start = time.perf_counter_ns()
        torch.autograd.grad(apply(q, k, v), inputs, grad)
        if i >= 3:
            times.append((time.perf_counter_ns() - start) / 1e3)
    return {"entry": "train", "impl": "autograd", "us": round(statistics.median(times), 2)}


def measure_queued(call: Callable, calls: int) -> dict:
    """``us``: wall microseconds per call of ``calls`` calls queued back to back (GPU), after a warm-up; beside
    it, what says where that time goes: ``us_to_return``, the median time a call takes to return (its host cost
    while the GPU keeps up; ``us`` well above it means the kernels are the bound), and ``plan_replays``, how many
    of our calls (forward and backward counted apart) ran by their launch plan rather than the full Python."""
    from ..backends.triton import attend

    def replays() -> int:
        return attend.FORWARD_PLANS.replays + attend.BACKWARD_PLANS.replays

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    returns, before = [], replays()
    start = time.perf_counter_ns()
    for _ in range(calls):
        begun = time.perf_counter_ns()
        call()
        returns.append(time.perf_counter_ns() - begun)
    torch.cuda.synchronize()
    wall = (time.perf_counter_ns() - start) / 1e3 / calls
    return {"us": round(wall, 2), "us_to_return": round(statistics.median(returns) / 1e3, 2),
            "plan_replays": replays() - before, "calls": calls}


def run(entries: list[str], *, mode: str, calls: int, arch: int = 90) -> list[dict]:
    rows = []
    if mode == "stub":
        from ..backends.triton.stub import stubbed_launches

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the CPU's own work (a module's projections) is not what is timed: no thread pool
        with ExitStack() as stack:
            stack.callback(torch.set_num_threads, threads)
            launches = stack.enter_context(stubbed_launches(arch))
            stack.enter_context(flashattn.use_backend("triton"))
            for entry in entries:
                rows.append(measure_stubbed(entry, calls, launches))
                if entry == "train":
                    rows.append(measure_autograd_floor(calls))
        return rows
    for entry in entries:
        rows.append({"entry": entry, "impl": "flashattn", **measure_queued(ENTRIES[entry][1]("cuda"), calls)})
        twin = _sdpa_twin(entry, "cuda")
        if twin is not None:
            sdpa = measure_queued(twin, calls)
            rows.append({"entry": entry, "impl": "sdpa", "us": sdpa["us"], "us_to_return": sdpa["us_to_return"]})
    return rows


def medians(rows: list[dict]) -> dict[str, float]:
    """Ours per entry point: ``--json``'s keys."""
    return {r["entry"]: r["us"] for r in rows if r["impl"] == "flashattn"}


def budgets_met(rows: list[dict], mode: str) -> dict[str, dict]:
    """Each budgeted entry: stubbed, against ``BUDGETS``; on a GPU, against SDPA in the same run."""
    ours = medians(rows)
    sdpa = {r["entry"]: r["us"] for r in rows if r["impl"] == "sdpa"}
    verdicts = {}
    for entry, budget in BUDGETS.items():
        if entry not in ours:
            continue
        limit = budget if mode == "stub" else sdpa.get(entry)
        verdicts[entry] = {"us": ours[entry], "limit_us": limit, "against": "budget" if mode == "stub" else "sdpa",
                           "met": limit is not None and ours[entry] <= limit}
    return verdicts


def table(rows: list[dict], mode: str) -> str:
    verdicts = budgets_met(rows, mode)
    queued = mode != "stub"
    lines = [f"{'entry point':24} {'impl':9} {'us':>8}  {'limit':>7}  " + ("returns  plans" if queued else "launches")]
    for r in rows:
        verdict = verdicts.get(r["entry"]) if r["impl"] == "flashattn" else None
        limit = "" if verdict is None or verdict["limit_us"] is None else f"{verdict['limit_us']:.0f}"
        mark = "" if verdict is None else ("  met" if verdict["met"] else "  over")
        if queued:  # where a queued call's time goes: its own return, and the calls its launch plan ran
            plans = f"{r['plan_replays']}/{r['calls']}" if "plan_replays" in r else ""
            each = f"{r.get('us_to_return', float('nan')):7.1f}  {plans}"
        else:
            each = ", ".join(f"{n.removesuffix('_kernel')} {t:.0f}" for n, t in
                             zip(r.get("launches", []), r.get("us_to_each_launch", []), strict=True))
        lines.append(f"{r['entry']:24} {r['impl']:9} {r['us']:8.1f}  {limit:>7}{mark:5}  {each}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> bool:
    """Horizontal bars, one per entry point (and SDPA's beside on a GPU), the budgets marked; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [f"{r['entry']} ({r['impl']})" if r["impl"] != "flashattn" else r["entry"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    ax.barh(range(len(rows)), [r["us"] for r in rows],
            color=["tab:blue" if r["impl"] == "flashattn" else "tab:gray" for r in rows])
    for i, r in enumerate(rows):
        if r["impl"] == "flashattn" and r["entry"] in BUDGETS:
            ax.plot([BUDGETS[r["entry"]]] * 2, [i - 0.4, i + 0.4], color="tab:red", lw=2)
    ax.set_yticks(range(len(rows)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("microseconds from the call to its last launch (red: budget)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", default="auto", choices=("auto", "stub", "gpu"),
                   help="stub: launches recorded on a CPU; gpu: queued calls on the GPU; auto: gpu when there is one")
    p.add_argument("--arch", type=options.positive_int, default=90,
                   help="stub mode: the NVIDIA architecture the kernels compile for (10 x major + minor)")
    p.add_argument("--calls", type=options.positive_int, default=300, help="timed calls per entry point")
    p.add_argument("--entries", type=options.choice_list(tuple(ENTRIES)), default=list(ENTRIES),
                   help=f"comma-separated: {', '.join(ENTRIES)}")
    p.add_argument("--json", default=None, help="also write the medians per entry point to this file")
    options.add_output(p, "host-<mode>", progress=False)


def mode_of(args: argparse.Namespace) -> str:
    return args.mode if args.mode != "auto" else ("gpu" if torch.cuda.is_available() else "stub")


def check(args: argparse.Namespace) -> str | None:
    if mode_of(args) == "gpu" and not torch.cuda.is_available():
        return "--mode gpu needs a CUDA device; --mode stub times the host on a CPU"
    return None


def command(args: argparse.Namespace) -> int:
    import json

    mode = mode_of(args)
    where = f"stubbed sm_{args.arch} launches on {report.cpu_model()}" if mode == "stub" else report.device_name(
        "cuda")
    print(f"flashattn bench host ({mode}): {len(args.entries)} entry points, {args.calls} calls each, {where}")
    rows = run(args.entries, mode=mode, calls=args.calls, arch=args.arch)
    print(table(rows, mode))
    device = "cpu" if mode == "stub" else "cuda"
    meta = report.meta(device, args.command_line, {"mode": mode, "arch": args.arch, "calls": args.calls},
                       mode=mode, cpu_flags=cpu_flags(), budgets=budgets_met(rows, mode))
    stem = args.name or f"host-{mode}"
    paths = report.write(rows, meta, Path(args.out), stem)
    if plot(rows, Path(args.out) / f"{stem}.png", f"flashattn host cost per call ({where})"):
        paths.append(Path(args.out) / f"{stem}.png")
    if args.json:
        Path(args.json).write_text(json.dumps({"mode": mode, "machine": {k: meta[k] for k in (
            "device", "cpu", "cpu_flags", "torch", "threads", "load")}, **medians(rows)}, indent=1, default=str))
        paths.append(Path(args.json))
    for path in paths:
        print(f"wrote {path}")
    return 0
