"""The Gluon forward on a Hopper GPU: correctness against float64 first, then its speed beside cuDNN; and the tier's
one-pass backward kernels' correctness (``gpu_backward.py``).

    PYTHONPATH=. python -m tools.gluon.gpu_run --out DIR [--budget 240]     # on an H100 / H200
    PYTHONPATH=. python -m tools.gluon.gpu_run --dry --out DIR              # no GPU: the harness alone

Every kernel variant (``forward.VARIANTS``, persistent ones among them, x head dim 64/128 x causal or not; at head
dim 256 the schedule the tier launches and its persistent twin; at the padded head dims ``PADDED_DIMS`` the
launched one) first runs its correctness cases in its
own subprocess with a timeout, since a barrier protocol that is wrong deadlocks rather than fails: odd lengths (1,
113, 173 x 251, 1025), queries longer than keys (causal rows that see no key: out 0, lse -inf), and on three of
them sliding windows (either alignment) and softcaps (``BANDS``, the launched schedule), outputs poisoned with NaN
before the launch, judged by the tolerance rule of ``tests/oracle.py`` (at most 2x plain bf16 attention's error
against float64). Only the variants that pass are timed, in one more subprocess: 16k tokens a batch (2048 = heads x
d, FlashAttention-3's setting) at N = 1024 and 8192, beside SDPA's cuDNN and flash backends and the ``triton`` path
of flashattn (``flash_attn_func`` as it chooses, and with its portable forward alone: gpu-tune's ``tier`` step picks
the schedules against that), CUDA events, L2 flushed, median of 20. ``gluon.json`` holds everything; the
table is printed last.

``--dry`` replaces the kernel by plain attention on the CPU, so the harness itself can be tested without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# (batch, seqlen_q, seqlen_k, heads, kv_heads): lengths 1, odd, crossing the 128-row tile; one with more queries than
# keys; grouped key/value heads (GQA 6:2, MQA 3:1).
SHAPES = ((1, 1, 1, 2, 2), (2, 113, 113, 3, 3), (2, 173, 251, 3, 3), (1, 1025, 1025, 2, 2), (1, 300, 100, 2, 2),
          (2, 1024, 1024, 2, 2), (2, 173, 251, 6, 2), (1, 300, 100, 3, 1))
# Bands and softcaps, on three of those shapes, for the schedule the tier launches (each band compiles its own
# kernels): (window, top-left aligned, softcap); causal cases take right = 0.
BANDS = (((77, 20), False, 0.0), ((-1, -1), False, 30.0), ((300, 40), True, 20.0), ((150, -1), False, 0.0))
BAND_SHAPES = (SHAPES[2], SHAPES[3], SHAPES[7])
# Packed sequences (flash_attn_varlen_func's layout), the launched schedule again: (query, key) lengths, 4 query heads
# over 2 key heads, with no band and with the first and last of BANDS.
PACKED = ((113, 251), (1, 77), (300, 300), (1025, 600), (200, 90))
PACKED_BANDS = (((-1, -1), False, 0.0), BANDS[0], BANDS[2])
# Head dims between 64, 128 and 256, on those tiles (``forward.tile_dim``): the launched schedule, every case above.
PADDED_DIMS = (40, 96, 192)
# A persistent schedule's grid in the correctness cases: few programs, so that each walks several work tiles.
CHECK_PROGRAMS = 5
SPEED_SEQLENS = (1024, 8192)
TOKENS = 16384
REPEATS = 20


def _variants():
    from flashattn.backends.triton.hopper.forward import VARIANTS
    return VARIANTS


def _launched(d: int):
    from flashattn.backends.triton.hopper import tile_dim
    from flashattn.backends.triton.hopper.forward import LAUNCHED
    return LAUNCHED[tile_dim(d)]


def _launched_at_256():
    from flashattn.backends.triton.hopper.forward import SCHEDULES
    return SCHEDULES[256]


def _case_name(d: int, causal: bool, index: int) -> str:
    return f"d{d}-{'causal' if causal else 'full'}-{_variants()[index]}"


def _kernel(dry: bool, programs: int | None = None):
    """forward(q, k, v, causal, schedule, window=(-1, -1), top_left=False, softcap=0.0) -> (out, lse), out
    poisoned first; --dry: plain attention on the CPU. ``programs``: a persistent schedule's grid (default: the
    SMs)."""
    import torch

    if dry:
        from tests.oracle import attention_ref

        def plain(q, k, v, causal, schedule, window=(-1, -1), top_left=False, softcap=0.0):
            out, lse = attention_ref(q.float(), k.float(), v.float(), causal=causal, window=window, softcap=softcap,
                                     bottom_right=not top_left, upcast=False)
            return out.to(q.dtype), lse.float()
        return plain
    from flashattn.backends.triton.hopper.forward import attention_forward_ws_kernel, launch_arguments

    def launch(q, k, v, causal, schedule, window=(-1, -1), top_left=False, softcap=0.0):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), dtype=torch.float32, device=q.device)
        grid, kwargs = launch_arguments(q, k, v, out, lse, causal=causal, scale=q.shape[-1] ** -0.5,
                                        schedule=schedule, window=window, top_left=top_left,
                                        softcap=softcap, programs=programs)
        attention_forward_ws_kernel[grid](**kwargs)
        return out, lse
    return launch


def _packed_kernel(dry: bool, programs: int | None = None):
    """forward(qs, ks, vs, causal, schedule, window, top_left, softcap) on sequences given as (1, n, heads, d)
    tensors, packed into one (total, heads, d) launch with their offsets: [(out, lse)] per sequence, cut back out
    of the packed out (poisoned first) and lse (heads, total)."""
    import itertools

    import torch

    dense = _kernel(dry, programs)
    if dry:
        return lambda qs, ks, vs, causal, schedule, **band: [dense(q, k, v, causal, schedule, **band)
                                                             for q, k, v in zip(qs, ks, vs, strict=True)]
    from flashattn.backends.triton.hopper.forward import attention_forward_ws_kernel, launch_arguments

    def launch(qs, ks, vs, causal, schedule, window=(-1, -1), top_left=False, softcap=0.0):
        q, k, v = (torch.cat([t[0] for t in ts]) for ts in (qs, ks, vs))
        ends = [list(itertools.accumulate((t.shape[1] for t in ts), initial=0)) for ts in (qs, ks)]
        cu_q, cu_k = (torch.tensor(e, dtype=torch.int32, device=q.device) for e in ends)
        out = torch.full_like(q, float("nan"))
        lse = torch.full((q.shape[1], q.shape[0]), float("nan"), dtype=torch.float32, device=q.device)
        grid, kwargs = launch_arguments(q, k, v, out, lse, causal=causal, scale=q.shape[-1] ** -0.5,
                                        schedule=schedule, window=window, top_left=top_left, softcap=softcap,
                                        cu_seqlens=(cu_q, cu_k), max_seqlen_q=max(t.shape[1] for t in qs),
                                        programs=programs)
        attention_forward_ws_kernel[grid](**kwargs)
        return [(out[a:b][None], lse[:, a:b][None]) for a, b in itertools.pairwise(ends[0])]
    return launch


def _judged(out, lse, q, k, v, *, causal: bool, band: dict) -> dict:
    """One case's verdict by the tolerance rule: out within 2x plain bf16 attention's error against float64, lse
    within 1e-3, rows that see no key out 0 and lse -inf, no NaN. ``band``: window, top_left, softcap."""
    import torch

    from tests.oracle import attention_ref, max_err

    window, top_left, softcap = band["window"], band["top_left"], band["softcap"]
    reference = dict(causal=causal, bottom_right=not top_left, window=window, softcap=softcap)
    ref, ref_lse = attention_ref(q, k, v, **reference)
    base, _ = attention_ref(q, k, v, upcast=False, **reference)
    err, base_err = max_err(out, ref), max_err(base, ref)
    bound = 2 * base_err + torch.finfo(torch.bfloat16).eps * (1 + ref.abs().max().item())
    seen = torch.isfinite(ref_lse)  # causal rows with no key: lse -inf, out 0
    lse_err = max_err(lse[seen], ref_lse[seen]) if seen.any() else 0.0
    unseen_ok = bool((out.transpose(1, 2)[~seen] == 0).all() and (lse[~seen] == -math.inf).all())
    nan = bool(torch.isnan(out).any() or torch.isnan(lse).any())
    ok = err <= bound and lse_err <= 1e-3 and unseen_ok and not nan
    return dict(window=list(window), top_left=top_left, softcap=softcap, ok=ok, err=err, bound=bound,
                lse_err=lse_err, nan=nan, unseen_rows=int((~seen).sum()), unseen_ok=unseen_ok)


def check_case(d: int, causal: bool, index: int, dry: bool) -> dict:
    """One variant's correctness cases, in this process: {'ok', 'cases': [...]}."""
    import torch

    device = "cpu" if dry else "cuda"
    schedule = _variants()[index]
    kernel = _kernel(dry, CHECK_PROGRAMS)
    torch.manual_seed(0)
    cases = []
    plain = [(shape, ((-1, -1), False, 0.0)) for shape in SHAPES]
    launched = schedule == _launched(d)
    bands = [(s, band) for s in BAND_SHAPES for band in BANDS] if launched else []
    for (b, nq, nk, h, hk), (window, top_left, softcap) in plain + bands:
        q, k, v = (torch.randn(b, n, heads, d, dtype=torch.bfloat16, device=device)
                   for n, heads in ((nq, h), (nk, hk), (nk, hk)))
        band = dict(window=window, top_left=top_left, softcap=softcap)
        out, lse = kernel(q, k, v, causal, schedule, **band)
        if device == "cuda":
            torch.cuda.synchronize()
        cases.append(dict(shape=[b, nq, nk, h, hk], **_judged(out, lse, q, k, v, causal=causal, band=band)))
    for window, top_left, softcap in PACKED_BANDS if launched else ():
        qs, ks, vs = ([torch.randn(1, n[i], heads, d, dtype=torch.bfloat16, device=device) for n in PACKED]
                      for i, heads in ((0, 4), (1, 2), (1, 2)))
        band = dict(window=window, top_left=top_left, softcap=softcap)
        results = _packed_kernel(dry, CHECK_PROGRAMS)(qs, ks, vs, causal, schedule, **band)
        for (out, lse), q, k, v in zip(results, qs, ks, vs, strict=True):
            cases.append(dict(shape=[1, q.shape[1], k.shape[1], 4, 2], packed=True,
                              **_judged(out, lse, q, k, v, causal=causal, band=band)))
    return {"ok": all(c["ok"] for c in cases), "cases": cases}


def _tflops(b, h, n, d, causal, seconds):
    return 4 * b * h * n * n * d / (2 if causal else 1) / seconds / 1e12


def _implementations(kernel, q, k, v, *, causal: bool, indices: list[int]) -> dict:
    """name -> a call of it on (q, k, v): the Gluon variants, SDPA's cuDNN and flash backends, flashattn (as it
    chooses, and its portable forward alone)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashattn

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        return run

    impls = {f"gluon {_variants()[i]}": (lambda i=i: kernel(q, k, v, causal, _variants()[i])) for i in indices}
    impls["sdpa-cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    impls["sdpa-flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
    impls["flashattn"] = lambda: flashattn.flash_attn_func(q, k, v, causal=causal)

    def portable():  # the portable forward alone: what gpu-tune's ``tier`` step compares the schedules with
        from flashattn.backends.triton import hopper

        with hopper.using("portable"):
            return flashattn.flash_attn_func(q, k, v, causal=causal)
    impls["flashattn-portable"] = portable
    return impls


def speed(passing: list[tuple[int, bool, int]], dry: bool, log: Path) -> None:
    """Median seconds and TFLOP/s of each passing variant beside SDPA's backends and flashattn's triton path, a
    JSON line each appended to ``log`` as it is measured (a run stopped part way keeps its rows)."""
    import torch

    from flashattn.bench.measure import _time_cpu, _time_cuda

    device = "cpu" if dry else "cuda"
    kernel = _kernel(dry)
    for d, causal in sorted({(d, c) for d, c, _ in passing}, reverse=True):
        for n in (128,) if dry else SPEED_SEQLENS:
            b, h = max(1, TOKENS // n), 2048 // d
            q, k, v = (torch.randn(b, n, h, d, dtype=torch.bfloat16, device=device) for _ in range(3))
            indices = [i for dd, cc, i in passing if (dd, cc) == (d, causal)]
            impls = _implementations(kernel, q, k, v, causal=causal, indices=indices)
            for name, step in impls.items():
                row = dict(impl=name, d=d, causal=causal, seqlen=n, batch=b, heads=h)
                try:
                    times = _time_cpu(step, 2) if dry else _time_cuda(step, REPEATS)
                    row["seconds"] = sorted(times)[len(times) // 2]
                    row["tflops"] = _tflops(b, h, n, d, causal, row["seconds"])
                except Exception as e:  # a backend this GPU lacks is a row, not a crash
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                with log.open("a") as f:
                    f.write(json.dumps(row) + "\n")


def _child(args: list[str], timeout: float) -> tuple[dict | None, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    try:
        done = subprocess.run([sys.executable, "-m", "tools.gluon.gpu_run", *args], capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s (a deadlock?)"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = done.stderr.strip().splitlines()
        return None, f"exit {done.returncode}: {tail[-1][:300] if tail else ''}"
    return json.loads(lines[-1]), ""


def _table(rows: list[dict]) -> str:
    lines = [f"{'d':>4} {'mask':>6} {'N':>5} {'impl':>24} {'TFLOP/s':>8} {'vs cudnn':>8}"]
    cudnn = {(r["d"], r["causal"], r["seqlen"]): r.get("tflops") for r in rows if r["impl"] == "sdpa-cudnn"}
    for r in rows:
        ref = cudnn.get((r["d"], r["causal"], r["seqlen"]))
        t = r.get("tflops")
        ratio = f"{t / ref:8.2f}" if t and ref else f"{'-':>8}"
        shown = f"{t:8.1f}" if t else f"{r.get('error', '-')[:40]}"
        lines.append(f"{r['d']:>4} {'causal' if r['causal'] else 'full':>6} {r['seqlen']:>5} {r['impl']:>24} "
                     f"{shown} {ratio}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gluon-gpu"))
    p.add_argument("--budget", type=float, default=240.0, help="seconds for the whole run (default %(default)s)")
    p.add_argument("--jobs", type=int, default=8, help="correctness subprocesses at once")
    p.add_argument("--dry", action="store_true", help="plain attention on the CPU in place of the kernel")
    p.add_argument("--case", help=argparse.SUPPRESS)  # d:causal:variant, run in a child
    p.add_argument("--backward", help=argparse.SUPPRESS)  # d:causal, the backward's cases, run in a child
    p.add_argument("--speed", help=argparse.SUPPRESS)  # JSON list of passing cases, run in a child
    p.add_argument("--log", type=Path, help=argparse.SUPPRESS)  # where the child appends its rows
    a = p.parse_args(argv)
    if a.case:
        d, causal, index = (int(x) for x in a.case.split(":"))
        print(json.dumps(check_case(d, bool(causal), index, a.dry)))
        return 0
    if a.backward:
        from .gpu_backward import check_backward

        d, causal = (int(x) for x in a.backward.split(":"))
        print(json.dumps(check_backward(d, bool(causal), a.dry)))
        return 0
    if a.speed:
        speed([tuple(c) for c in json.loads(a.speed)], a.dry, a.log)
        print("{}")
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    report = {"correctness": {}, "speed": [], "speed_error": "not run", "seconds": 0.0}
    elsewhere = None if a.dry else _not_hopper()
    if elsewhere:
        report["skipped"] = elsewhere
        (a.out / "gluon.json").write_text(json.dumps(report, indent=1))
        print(f"[gluon] skipped: {elsewhere}")
        return 0
    try:
        _checked_then_timed(a, report)
    except KeyboardInterrupt:  # gpu-check's budget ran out: keep what was measured
        report["speed_error"] = report["speed_error"] or "stopped (budget)"
    finally:
        _write(a.out, report, a.out / "gluon-speed.jsonl")
    passed = sum(r.get("ok", False) for r in report["correctness"].values())
    print(f"[gluon] correctness: {passed} of {len(report['correctness'])} variants passed; "
          f"speed: {report['speed_error'] or 'ok'}")
    print(_table(report["speed"]))
    return 0 if report["correctness"] and passed == len(report["correctness"]) else 1


def _not_hopper() -> str | None:
    """Why this machine cannot run the kernel (wgmma and setmaxnreg are sm_90's alone), or None."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device (--dry runs the harness on the CPU)"
    major, minor = torch.cuda.get_device_capability()
    return None if (major, minor) == (9, 0) else f"{torch.cuda.get_device_name()} is sm_{major}{minor}, not sm_90"


def _write(out: Path, report: dict, log: Path) -> None:
    report["speed"] = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    (out / "gluon.json").write_text(json.dumps(report, indent=1))


def _checked_then_timed(a: argparse.Namespace, report: dict) -> None:
    """Correctness of every variant (``report["correctness"]``, written to gluon.json at once), then the speed of
    those that passed (appended to gluon-speed.jsonl row by row)."""
    start = time.monotonic()
    dry = ["--dry"] if a.dry else []
    todo = [(d, causal, i) for d in (128, 64) for causal in (False, True) for i in range(len(_variants()))]
    at_256 = (_launched_at_256(), dataclasses.replace(_launched_at_256(), persistent=True))  # launched, persistent
    todo += [(256, causal, _variants().index(s)) for s in at_256 for causal in (False, True)]
    todo += [(d, causal, _variants().index(_launched(d))) for d in PADDED_DIMS for causal in (False, True)]
    if a.dry:  # a variant, and the one launched (which checks the bands too)
        todo = [todo[0], next(c for c in todo if _variants()[c[2]] == _launched(c[0]))]
    check_timeout = max(30.0, 0.4 * a.budget)

    from .gpu_backward import HEAD_DIMS

    # The backward kernels' cases after the forward's: (name, the child's arguments).
    backward = [(f"backward-d{d}-{'causal' if c else 'full'}", ["--backward", f"{d}:{int(c)}"])
                for d in HEAD_DIMS + PADDED_DIMS for c in (False, True)]
    jobs = [(_case_name(*case), ["--case", ":".join(str(int(x)) for x in case)]) for case in todo]
    jobs += backward[:1] if a.dry else backward

    def run(job):
        name, args = job
        result, why = _child([*dry, *args], check_timeout)
        return name, result, why
    results, log = report["correctness"], a.out / "gluon-speed.jsonl"
    log.unlink(missing_ok=True)
    with ThreadPoolExecutor(a.jobs) as pool:
        for name, result, why in pool.map(run, jobs):
            results[name] = result or {"ok": False, "error": why}
            bad = [c for c in (result or {}).get("cases", []) if not c["ok"]]
            print(f"[gluon] {name}: {'ok' if result and result['ok'] else 'FAILED'} {why} "
                  f"{json.dumps(bad)[:240] if bad else ''}", flush=True)
    passing = [c for c in todo if results[_case_name(*c)].get("ok")]
    report["seconds"] = time.monotonic() - start
    _write(a.out, report, log)
    left = a.budget - (time.monotonic() - start) - 5
    report["speed_error"] = "no variant passed" if not passing else "no time left" if left <= 20 else ""
    if not report["speed_error"]:
        report["speed_error"] = _child([*dry, "--speed", json.dumps(passing), "--log", str(log)], left)[1]
    report["seconds"] = time.monotonic() - start

if __name__ == "__main__":
    sys.exit(main())
