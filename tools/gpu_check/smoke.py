"""gpu-check's kernel smoke: every Triton kernel launched once for each dtype, head dim and causal setting,
outputs poisoned first, each result judged against float64 by the same-precision rule (``tests/oracle.py``: at most
2x the error of plain PyTorch attention in the same precision, 3x for gradients; fp32 near 1e-5 relative).

Kernels: ``fwd+bwd`` (forward, then dK/dV and dQ), ``one-pass`` (the same, dQ summed by atomics in the dK/dV
kernel: ``one_pass_case.py``), ``dropout`` (its mask read from the torch path at the same seed), ``block-mask``
(the three kernels walking a FlexAttention ``BlockMask`` of documents), ``decode`` (one query token against a KV
cache of uneven lengths), ``split-kv`` (split in four and merged), ``fp8-cache`` (an e4m3fn cache with descales,
16-bit queries), ``fp8-matmul`` (q, k, v in e4m3fn on FP8 tensor cores, judged with P rounded alike),
``fp8-train`` (fp8=True: bf16 quantized by the call, forward and backward), ``fp8-backward`` (the same with
``FLASHATTN_FP8_BACKWARD=1``), ``tier`` (``tier_case.py``), ``decode-graph`` (``graph_case.py``).
Shapes are odd on purpose (173 queries, 251 keys, GQA 4:2), so every tile edge is crossed.

Each case ends ``ok``, ``wrong`` (which tensor, its error and the bound), ``fault`` (the launch raised: a CUDA
error names the case that caused it, and the worker restarts with a fresh CUDA context) or ``declined`` (the
Triton path does not serve it on this GPU, with its reason). Workers run in parallel, one subprocess each, so
Triton compiles on every core; each appends its results to ``smoke-<i>.jsonl`` as it goes (merged into
``smoke.json`` at the end).

    python -m tools.gpu_check.smoke --out DIR               # on a GPU
    TRITON_INTERPRET=1 python -m tools.gpu_check.smoke --tiny --out DIR   # on the CPU, toy sizes
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

from .graph_case import check_decode_graph
from .one_pass_case import check_one_pass
from .plan import ROOT, TESTS
from .poison import poisoned
from .tier_case import check_tier

KERNELS = ("fwd+bwd", "one-pass", "tier", "decode", "split-kv", "block-mask", "dropout", "fp8-cache", "fp8-matmul",
           "fp8-train", "fp8-backward", "decode-graph")
GPU_ONLY = {"tier"}  # the Hopper tier's Gluon kernel: compiled kernels on sm_90 alone, never the interpreter
# Cases whose inputs are FP8 (or bf16 quantized to FP8) whatever the dtype, or that test no dtype: under this one.
ONCE = {"fp8-matmul": "bfloat16", "fp8-train": "bfloat16", "fp8-backward": "bfloat16", "decode-graph": "bfloat16"}
DTYPES = ("bfloat16", "float16", "float32")
HEAD_DIMS = (128, 64, 256)
RESTARTS = 3  # per worker, after a fault that may have broken its CUDA context


@dataclass(frozen=True)
class Sizes:
    batch: int
    nq: int
    nk: int
    heads: int
    heads_k: int
    cache_len: int
    block: int  # the block mask's blocks


FULL = Sizes(batch=2, nq=173, nk=251, heads=4, heads_k=2, cache_len=3000, block=128)
TINY = Sizes(batch=1, nq=7, nk=9, heads=2, heads_k=1, cache_len=40, block=16)


@dataclass(frozen=True)
class Case:
    kernel: str
    dtype: str
    head_dim: int
    causal: bool

    @property
    def name(self) -> str:
        return f"{self.kernel} {self.dtype} d={self.head_dim} {'causal' if self.causal else 'full'}"


def cases(tiny: bool) -> list[Case]:
    """Most used first (bf16, d=128), so the first results to come back are the ones that matter most."""
    dtypes, dims = (("float32", "bfloat16"), (16,)) if tiny else (DTYPES, HEAD_DIMS)
    return [Case(kernel, dtype, d, causal) for dtype in dtypes for d in dims for causal in (True, False)
            for kernel in KERNELS if not (kernel == "fp8-cache" and dtype == "float32")  # 16-bit q reads FP8
            and ONCE.get(kernel, dtype) == dtype and not (tiny and kernel in GPU_ONLY)]


def _oracle():
    sys.path.insert(0, str(TESTS))  # the suite's float64 oracle and tolerance rule: one rule, here too
    import oracle

    return oracle


def _inputs(case: Case, sizes: Sizes, device: str):
    import torch

    dtype = getattr(torch, case.dtype)
    shapes = ((sizes.nq, sizes.heads), (sizes.nk, sizes.heads_k), (sizes.nk, sizes.heads_k))
    return [torch.randn(sizes.batch, n, h, case.head_dim, device=device, dtype=dtype, requires_grad=True)
            for n, h in shapes]


def _judge(inputs, out, grads, **reference) -> dict:
    """Assert the rule on out and (when given) the gradients; return each tensor's max error against float64.
    ``reference``: what the oracle needs to compute the same function (``causal``, ``mask``, ``dropped``, ...)."""
    import torch

    oracle = _oracle()
    q, k, v = inputs
    ref, _ = oracle.attention_ref(q, k, v, **reference)
    base, _ = oracle.attention_ref(q, k, v, upcast=False, **reference)
    errors = {"out": oracle.max_err(out, ref)}
    oracle.assert_close("out", out, ref, base)
    if grads is not None:
        g, ours = grads
        want = torch.autograd.grad(ref, (q, k, v), g.double())
        baseline = torch.autograd.grad(base, (q, k, v), g)
        magnitude = max(w.abs().max().item() for w in want)
        for name, x, w, b in zip(("dq", "dk", "dv"), ours, want, baseline, strict=True):
            errors[name] = oracle.max_err(x, w)
            oracle.assert_close(name, x, w, b, factor=3.0, magnitude=magnitude, precision=q.dtype)
    return {name: float(f"{e:.3g}") for name, e in errors.items()}


def _forward_backward(q, k, v, **kwargs):
    import torch

    import flashattn

    with poisoned():
        out = flashattn.flash_attn_func(q, k, v, **kwargs)
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), g)
    return out, (g, grads)


def check_fwd_bwd(case: Case, sizes: Sizes, device: str) -> dict:
    q, k, v = _inputs(case, sizes, device)
    out, grads = _forward_backward(q, k, v, causal=case.causal)
    return _judge((q, k, v), out, grads, causal=case.causal)


def check_dropout(case: Case, sizes: Sizes, device: str) -> dict:
    import torch

    import flashattn

    p = 0.17
    q, k, v = _inputs(case, sizes, device)
    torch.manual_seed(7)  # every path draws the same Philox numbers at the same seed: the torch path shows the mask
    with flashattn.use_backend("torch"):
        _, _, s_dmask = flashattn.flash_attn_func(q.detach(), k.detach(), v.detach(), dropout_p=p,
                                                  causal=case.causal, return_attn_probs=True)
    torch.manual_seed(7)
    out, grads = _forward_backward(q, k, v, dropout_p=p, causal=case.causal)
    return _judge((q, k, v), out, grads, dropped=torch.signbit(s_dmask), dropout_p=p, causal=case.causal)


def check_block_mask(case: Case, sizes: Sizes, device: str) -> dict:
    """Documents (causal within each when the case is causal) as a BlockMask: full, partial and empty tiles."""
    import torch
    from torch.nn.attention import flex_attention as flex

    n = max(sizes.nq, sizes.nk)
    doc = torch.zeros(n, dtype=torch.long, device=device)
    for cut in (n // 5, n // 2, n // 2 + 3):
        doc[cut:] += 1

    def mask_mod(b, h, i, j):
        same = doc[i] == doc[j]
        return same & (i >= j) if case.causal else same

    block_mask = flex.create_block_mask(mask_mod, None, None, sizes.nq, sizes.nk, device=device,
                                        BLOCK_SIZE=sizes.block)
    dense = flex.create_mask(mask_mod, 1, 1, sizes.nq, sizes.nk, device=device)
    q, k, v = _inputs(case, sizes, device)
    out, grads = _forward_backward(q, k, v, block_mask=block_mask)
    return _judge((q, k, v), out, grads, mask=dense)


def _check_decode(case: Case, sizes: Sizes, device: str, splits: int, fp8_cache: bool = False) -> dict:
    """One query token per sequence against caches of uneven lengths; each row judged against its own keys. With
    ``fp8_cache`` the cache holds e4m3fn values and descales (FlashAttention-3's interface)."""
    import torch

    import flashattn
    from flashattn.quantize import to_fp8

    dtype = getattr(torch, case.dtype)
    b, hk, d = sizes.batch, sizes.heads_k, case.head_dim
    q = torch.randn(b, 1, sizes.heads, d, device=device, dtype=dtype)
    k_cache, v_cache = (torch.randn(b, sizes.cache_len, hk, d, device=device, dtype=dtype) for _ in range(2))
    lengths = [sizes.cache_len - 5, sizes.cache_len // 3][:b]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    fp8 = {}
    if fp8_cache:  # an e4m3fn cache with descales: judged against the dequantized values it holds
        scales = [torch.rand(b, hk, device=device) + 0.5 for _ in range(2)]
        stored = [to_fp8(c, s) for c, s in zip((k_cache, v_cache), scales, strict=True)]
        fp8 = {"k_descale": scales[0], "v_descale": scales[1]}
        k_cache, v_cache = (c.to(dtype) * s[:, None, :, None].to(dtype) for c, s in zip(stored, scales, strict=True))
    with poisoned():
        out = flashattn.flash_attn_with_kvcache(q, *(stored if fp8_cache else (k_cache, v_cache)),
                                                cache_seqlens=seqlens, causal=case.causal, num_splits=splits, **fp8)
    oracle = _oracle()
    worst = 0.0
    for row, n in enumerate(lengths):
        args = (q[row:row + 1], k_cache[row:row + 1, :n], v_cache[row:row + 1, :n])
        ref, _ = oracle.attention_ref(*args, causal=case.causal)
        base, _ = oracle.attention_ref(*args, causal=case.causal, upcast=False)
        oracle.assert_close(f"out (sequence {row}, {n} keys)", out[row:row + 1], ref, base)
        worst = max(worst, oracle.max_err(out[row:row + 1], ref))
    return {"out": float(f"{worst:.3g}")}


def check_fp8_matmul(case: Case, sizes: Sizes, device: str) -> dict:
    """FlashAttention-3's FP8 forward: q, k, v quantized to e4m3fn with (batch, nheads_k) descales, multiplied in
    FP8 where the GPU has FP8 tensor cores (P rounded to e4m3), judged against float64 over the dequantized values
    with a float64 computation that rounds P alike as the baseline (the widening paths meet it with room)."""
    import torch

    import flashattn
    from flashattn.quantize import to_fp8

    scales = [torch.rand(sizes.batch, sizes.heads_k, device=device) + 0.5 for _ in range(3)]

    def per_head(s, x):  # (batch, nheads_k) scales for every head of x
        return s.repeat_interleave(x.shape[2] // sizes.heads_k, 1)

    fp8 = [to_fp8(x.detach(), s) for x, s in zip(_inputs(case, sizes, device), scales, strict=True)]
    wide = [x.double() * per_head(s, x).double()[:, None, :, None] for x, s in zip(fp8, scales, strict=True)]
    with poisoned():
        out = flashattn.flash_attn_func(*fp8, causal=case.causal, q_descale=scales[0], k_descale=scales[1],
                                        v_descale=scales[2])
    oracle = _oracle()
    ref, _ = oracle.attention_ref(*wide, causal=case.causal)
    rounded, _ = oracle.attention_ref(*wide, causal=case.causal, round_probs=torch.float8_e4m3fn)
    oracle.assert_close("out", out, ref, rounded)
    return {"out": float(f"{oracle.max_err(out, ref):.3g}")}


def check_fp8_train(case: Case, sizes: Sizes, device: str, fp8_backward: bool = False) -> dict:
    """The FP8 training mode: bf16 q, k, v quantized by the call, attended in FP8 (P rounded on FP8 tensor cores)
    and differentiated at the quantized values. Judged at those values: out as ``fp8-matmul``, the gradients
    against 3x bf16 attention computed the same way (P rounded to e4m3) with autograd. ``fp8_backward``
    (``FLASHATTN_FP8_BACKWARD=1``): S and dP on FP8 tensor cores too, dQ and dK judged at dO in e4m3."""
    import os

    import torch

    from flashattn.quantize import amax_scales, from_fp8, to_fp8

    q, k, v = _inputs(case, sizes, device)
    before = os.environ.get("FLASHATTN_FP8_BACKWARD")
    os.environ["FLASHATTN_FP8_BACKWARD"] = "1" if fp8_backward else "0"
    try:
        out, (g, grads) = _forward_backward(q, k, v, causal=case.causal, fp8=True)
    finally:  # the caller's setting back, as it was
        os.environ.pop("FLASHATTN_FP8_BACKWARD") if before is None else os.environ.update(FLASHATTN_FP8_BACKWARD=before)

    def at_quantized(x, dtype):
        scale = amax_scales(x, heads_k=sizes.heads_k)
        return from_fp8(to_fp8(x.detach(), scale), scale, dtype).requires_grad_()

    wide, low = ([at_quantized(x, dtype) for x in (q, k, v)] for dtype in (torch.float64, torch.bfloat16))
    oracle = _oracle()
    ref, _ = oracle.attention_ref(*wide, causal=case.causal)
    rounded, _ = oracle.attention_ref(*wide, causal=case.causal, round_probs=torch.float8_e4m3fn)
    base, _ = oracle.attention_ref(*low, causal=case.causal, upcast=False, round_probs=torch.float8_e4m3fn)
    oracle.assert_close("out", out, ref, rounded)
    errors = {"out": oracle.max_err(out, ref)}
    g_scores = g.double()
    if fp8_backward:  # dS from dO in e4m3, a scale per (sequence, head)
        g_scale = amax_scales(g, heads_k=g.shape[2])
        g_scores = from_fp8(to_fp8(g, g_scale), g_scale, torch.float64)
    want = [*torch.autograd.grad(ref, wide[:2], g_scores, retain_graph=True),
            *torch.autograd.grad(ref, wide[2:], g.double())]
    baseline = [*torch.autograd.grad(base, low[:2], g_scores.to(g.dtype), retain_graph=True),
                *torch.autograd.grad(base, low[2:], g)]
    for name, x, w, b in zip(("dq", "dk", "dv"), grads, want, baseline, strict=True):
        errors[name] = oracle.max_err(x, w)
        oracle.assert_close(name, x, w, b, factor=3.0)
    return {name: float(f"{e:.3g}") for name, e in errors.items()}


CHECKS = {"fwd+bwd": check_fwd_bwd, "one-pass": lambda c, s, dev: check_one_pass(c, s, dev, check_fwd_bwd),
          "tier": lambda c, s, dev: check_tier(c, s, dev, check_fwd_bwd, check_fp8_matmul),
          "dropout": check_dropout, "block-mask": check_block_mask,
          "decode": lambda c, s, dev: _check_decode(c, s, dev, splits=1),
          "split-kv": lambda c, s, dev: _check_decode(c, s, dev, splits=4),
          "fp8-cache": lambda c, s, dev: _check_decode(c, s, dev, splits=0, fp8_cache=True),
          "fp8-matmul": check_fp8_matmul, "fp8-train": check_fp8_train,
          "fp8-backward": lambda c, s, dev: check_fp8_train(c, s, dev, fp8_backward=True),
          "decode-graph": lambda c, s, dev: check_decode_graph(c, s, dev, _oracle())}


def run_case(case: Case, sizes: Sizes, device: str) -> dict:
    """One case's result: {"case", "status", "seconds", "errors" or "reason"}."""
    import torch

    import flashattn
    from flashattn.errors import ArgumentError

    start = time.perf_counter()
    row = {"case": case.name, **asdict(case)}
    torch.manual_seed(zlib.crc32(case.name.encode()))  # the same inputs in every run
    try:
        with flashattn.use_backend("triton"):
            errors = CHECKS[case.kernel](case, sizes, device)
        if device == "cuda":
            torch.cuda.synchronize()  # an asynchronous fault surfaces here, in its own case
        row.update(status="ok", errors=errors)
    except ArgumentError as e:
        if "path cannot run this call" not in str(e):
            raise
        row.update(status="declined", reason=str(e).split(": ", 2)[-1].split(". Let flashattn")[0])
    except AssertionError as e:
        row.update(status="wrong", reason=str(e))
    except Exception as e:  # a launch fault or a crash inside a kernel: the finding, named by its case
        row.update(status="fault", reason=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}")
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def _log(out: Path, worker: int) -> Path:
    return out / f"smoke-{worker}.jsonl"


def _done(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def worker(out: Path, index: int, count: int, tiny: bool) -> int:
    """Run this worker's share of the cases, appending each result; exit 3 after a fault (its CUDA context may be
    broken) so the parent restarts it on the rest."""
    from . import clock

    clock.install()
    import torch

    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    log = _log(out, index)
    seen = {r["case"] for r in _done(log)}
    for case in cases(tiny)[index::count]:
        if case.name in seen:
            continue
        row = run_case(case, TINY if tiny else FULL, device)
        # One write of the whole line: an interrupt (the parent kills its workers at once) leaves a result whole or
        # absent, never a created but empty log.
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(row) + "\n").encode())
        finally:
            os.close(fd)
        if row["status"] == "fault" and device == "cuda":
            return 3
    return 0


def run(out: Path, jobs: int, tiny: bool) -> list[dict]:
    """Every case, over ``jobs`` worker subprocesses (restarted after a fault); the results in case order."""
    out.mkdir(parents=True, exist_ok=True)
    count = max(1, min(jobs, len(cases(tiny))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    command = [sys.executable, "-m", "tools.gpu_check.smoke", "--out", str(out), "--of", str(count),
               *(["--tiny"] if tiny else [])]
    restarts = dict.fromkeys(range(count), 0)
    running = {i: subprocess.Popen([*command, "--worker", str(i)], env=env) for i in range(count)}
    why = "its worker stopped (see smoke.log)"
    try:
        while running:
            time.sleep(0.2)
            for i, proc in list(running.items()):
                code = proc.poll()
                if code is None:
                    continue
                del running[i]
                left = len(cases(tiny)[i::count]) - len(_done(_log(out, i)))
                if code != 0 and left > 0 and restarts[i] < RESTARTS:
                    restarts[i] += 1
                    running[i] = subprocess.Popen([*command, "--worker", str(i)], env=env)
    except KeyboardInterrupt:  # gpu-check's time limit: report what finished
        why = "interrupted: the step ran out of time"
        for proc in running.values():
            proc.kill()
    by_name = {r["case"]: r for i in range(count) for r in _done(_log(out, i))}
    for i in range(count):  # merged into smoke.json by the caller
        _log(out, i).unlink(missing_ok=True)
    return [by_name.get(c.name, {"case": c.name, **asdict(c), "status": "not run", "reason": why})
            for c in cases(tiny)]


def matrix(rows: list[dict]) -> str:
    """One line per (dtype, head dim, causal), one column per kernel: ok, WRONG, FAULT, declined, or not run."""
    from flashattn.tables import table

    mark = {"ok": "ok", "wrong": "WRONG", "fault": "FAULT", "declined": "declined", "not run": "-"}
    lines: dict[tuple, dict] = {}
    for r in rows:
        key = (r["dtype"], r["head_dim"], "causal" if r["causal"] else "full")
        lines.setdefault(key, {"dtype": key[0], "d": key[1], "mask": key[2]})[r["kernel"]] = mark[r["status"]]
    return table(list(lines.values()), ["dtype", "d", "mask", *KERNELS])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.gpu_check.smoke", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for smoke.json and the workers' logs")
    p.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1), help="worker processes")
    p.add_argument("--tiny", action="store_true", help="toy sizes, fp32/bf16 at head dim 16 (the interpreter)")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--of", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        return worker(args.out, args.worker, args.of, args.tiny)
    start = time.perf_counter()
    rows = run(args.out, args.jobs, args.tiny)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "wrong", "fault", "declined", "not run")}
    (args.out / "smoke.json").write_text(json.dumps({"counts": counts, "cases": rows}, indent=1))
    for r in (r for r in rows if r["status"] != "ok"):
        print(f"{r['status']:>8}  {r['case']}: {r.get('reason', '')}")
    print(matrix(rows))
    print(f"smoke: {len(rows)} cases in {time.perf_counter() - start:.0f} s: "
          + ", ".join(f"{n} {s}" for s, n in counts.items() if n))
    return 0 if counts["wrong"] == counts["fault"] == counts["not run"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
