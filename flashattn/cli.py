"""The ``flashattn`` command line: ``flashattn demo``, ``flashattn bench [--decode]`` (or ``python -m flashattn``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from . import __version__, reference
from .bench.measure import Case, measure
from .bench.plot import plot_time_memory


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(f"{{:>{w}}}" for w in widths)
    out = [line.format(*header), line.format(*("-" * w for w in widths))]
    out += [line.format(*map(str, r)) for r in rows]
    return "\n".join(out)


def _ladder_errors(n: int = 97, d: int = 40, seed: int = 0) -> list[list[str]]:
    """Each rung of the ladder against standard attention (Algorithm 0), in float64."""
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal((n, d)) for _ in range(4))
    x = rng.standard_normal((n, n))
    rows = []
    soft = reference.safe_softmax(x)
    for name in ("naive_softmax", "three_pass_softmax", "online_softmax"):
        rows.append([name, "safe_softmax", f"{np.abs(getattr(reference, name)(x) - soft).max():.1e}"])
    for causal in (False, True):
        want, lse = reference.standard_attention(q, k, v, causal=causal, return_lse=True)
        rungs = {
            "two_pass_attention": reference.two_pass_attention(q, k, v, causal=causal),
            "one_pass_attention": reference.one_pass_attention(q, k, v, causal=causal),
            "flash_attention_v1": reference.flash_attention_v1(q, k, v, M=4 * d * 16, causal=causal),
            "flash_attention_v2_forward": reference.flash_attention_v2_forward(q, k, v, M=4 * d * 16,
                                                                               causal=causal)[0],
        }
        tag = " (causal)" if causal else ""
        for name, got in rungs.items():
            rows.append([name + tag, "standard_attention", f"{np.abs(got - want).max():.1e}"])
        grads = reference.flash_attention_v2_backward(q, k, v, want, do, lse, M=4 * d * 16, causal=causal)
        want_grads = _autograd_grads(q, k, v, do, causal)
        err = max(np.abs(g - w).max() for g, w in zip(grads, want_grads, strict=True))
        rows.append(["flash_attention_v2_backward" + tag, "torch autograd (float64)", f"{err:.1e}"])
    return rows


def _autograd_grads(q, k, v, do, causal):
    t = [torch.from_numpy(a).requires_grad_() for a in (q, k, v)]
    s = t[0] @ t[1].T * q.shape[1] ** -0.5
    if causal:
        n = s.shape[0]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(s, -1) @ t[2]
    return [g.numpy() for g in torch.autograd.grad(out, t, torch.from_numpy(do))]


def _traffic_rows(n: int, d: int, sram_sizes: list[int]) -> tuple[list[list[str]], int | None]:
    rows = []
    for m in sram_sizes:
        counts = {a: reference.measure_traffic(a, n, d, M=m)["bytes"] for a in
                  ("standard", "flash1", "flash2_fwd", "flash2_bwd")}
        winner = "flash" if counts["flash2_fwd"] < counts["standard"] else "standard"
        rows.append([n, d, m, *(f"{counts[a] / 2**20:.1f}" for a in counts), winner])
    return rows, reference.crossover_sram(n, d, sram_sizes)


def demo(args: argparse.Namespace) -> int:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"flashattn {__version__} demo on {device} (torch {torch.__version__})\n")

    print("1. The ladder: every rung computes the same attention (float64, max abs error)")
    print(_table(_ladder_errors(), ["algorithm", "compared with", "max error"]), "\n")

    n, d = args.traffic_n, args.traffic_d
    sram = [d * d // 2, d * d, 2 * d * d, 4 * d * d, 16 * d * d, 64 * d * d]
    rows, cross = _traffic_rows(n, d, sram)
    print(f"2. HBM traffic counted block by block (MiB at 2 bytes/element), N={n}, d={d}, SRAM M in elements")
    print(_table(rows, ["N", "d", "M", "standard", "flash1", "flash2_fwd", "flash2_bwd", "fwd winner"]))
    print(f"   crossover: flash forward moves less data than standard attention from M = {cross} elements "
          f"(theory: M ~ d^2 = {d * d})\n")

    seqlens = [int(s) for s in args.seqlens.split(",")]
    impls = ["flashattn", "sdpa", "plain"]
    # bf16 on a GPU (what its kernels are for), fp32 on CPU (where half-precision matmuls are emulated and slow).
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    cases = [Case(impl, s, heads=args.heads, headdim=args.headdim, device=device, causal=args.causal, dtype=dtype,
                  repeats=args.repeats) for s in seqlens for impl in impls]
    results = []
    for case in tqdm(cases, desc="3. timing", unit="case", file=sys.stdout):
        skip = case.impl == "plain" and case.plain_attention_bytes > args.plain_limit_gib * 2**30
        results.append({**vars(case), "seconds": None, "peak_bytes": None, "error": "skipped: N x N too big"}
                       if skip else measure(case))
    print(f"\n3. Forward time and peak extra memory, batch 1, {args.heads} heads, headdim {args.headdim}, "
          f"{dtype}, causal={args.causal}")
    table = []
    for s in seqlens:
        by = {r["impl"]: r for r in results if r["seqlen"] == s}
        row = [s]
        for impl in impls:
            r = by[impl]
            if r["seconds"] is None:
                row += ["-", "-"]
            else:
                row += [f"{r['seconds'] * 1e3:.1f}", f"{r['peak_bytes'] / 2**20:.1f}"]
        table.append(row)
    header = ["N"] + [f"{impl} {what}" for impl in impls for what in ("ms", "MiB")]
    print(_table(table, header))
    (out_dir / "demo.json").write_text(json.dumps({"device": device, "results": results}, indent=1))
    title = f"attention forward on {device}: flashattn vs plain attention vs torch SDPA"
    plotted = plot_time_memory(results, out_dir / "demo.png", title)
    print(f"\nwrote {out_dir / 'demo.json'}" + (f" and {out_dir / 'demo.png'}" if plotted else
                                                 " (install matplotlib for the plot)"))
    return 0


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


# Options of each `flashattn bench` sweep (dest names), and their defaults: one given to the other sweep is an error.
_SWEEP_ONLY = {"seqlens": None, "headdims": None, "causal": "both", "modes": None, "baselines": None, "tokens": None,
               "hidden": None, "in_process": False}
_DECODE_ONLY = {"batches": None, "cache_lens": None, "heads_q": None, "heads_kv": None, "headdim": None,
                "num_splits": None, "cache_seqlens": None}


def _misplaced(args: argparse.Namespace, options: dict, where: str) -> None:
    given = [f"--{k.replace('_', '-')}" for k, default in options.items() if getattr(args, k) != default]
    if given:
        raise SystemExit(f"flashattn bench: {', '.join(given)} {where}")


def bench_decode(args: argparse.Namespace) -> int:
    from .bench import decode, harness

    _misplaced(args, _SWEEP_ONLY, "not used with --decode")
    device = args.device or harness.default_device()
    sweep = decode.DecodeSweep.for_device(device)
    for name in ("batches", "cache_lens"):
        if getattr(args, name):
            setattr(sweep, name, _ints(getattr(args, name)))
    for name in ("heads_q", "heads_kv", "headdim", "num_splits", "cache_seqlens", "dtype", "repeats"):
        if getattr(args, name) is not None:
            setattr(sweep, name, getattr(args, name))
    if sweep.heads_q % sweep.heads_kv:
        raise SystemExit(f"flashattn bench: --heads-q {sweep.heads_q} is not a multiple of --heads-kv "
                         f"{sweep.heads_kv}")
    print(f"flashattn bench --decode on {device}: {len(sweep.cases())} cases, heads {sweep.heads_q}:"
          f"{sweep.heads_kv}, headdim {sweep.headdim}, {sweep.dtype}; ours vs {', '.join(sweep.impls[1:])}")
    rows, copy = decode.run(sweep, progress=not args.quiet)
    for r in rows:
        if "batch" not in r:
            print(f"  {r['impl']}: {r['error']}")
    print(decode.table(rows, copy))
    target = decode.goal(rows)
    if target:
        got = "not measured" if target["bw_fraction"] is None else f"{target['bw_fraction']:.1%}"
        print(f"goal: >= {target['target_bw_fraction']:.0%} of copy bandwidth at batch {target['target_batch']}, "
              f"cache {target['target_cache_len']}: {got} ({'met' if target['met'] else 'not met'})")
    stem = args.name or f"decode-{device.split(':')[0]}"
    for path in decode.write(rows, copy, sweep, Path(args.out), stem):
        print(f"wrote {path}")
    return 0


def bench(args: argparse.Namespace) -> int:
    from .bench import harness

    if args.decode:
        return bench_decode(args)
    _misplaced(args, _DECODE_ONLY, "only go with --decode")
    device = args.device or harness.default_device()
    sweep = harness.Sweep.for_device(device)
    for name in ("seqlens", "headdims"):
        if getattr(args, name):
            setattr(sweep, name, _ints(getattr(args, name)))
    if args.causal != "both":
        sweep.causals = [args.causal == "true"]
    for name in ("modes", "baselines"):
        value = getattr(args, name)
        if value:
            items = [x for x in value.split(",") if x]
            if name == "modes":
                sweep.modes = items
            else:
                sweep.impls = [harness.OURS, *items]
    for name in ("dtype", "tokens", "hidden", "repeats"):
        if getattr(args, name) is not None:
            setattr(sweep, name, getattr(args, name))
    sweep.isolate = not args.in_process
    bad = [m for m in sweep.modes if m not in ("fwd", "bwd", "fwd+bwd")]
    if bad:
        raise SystemExit(f"flashattn bench: --modes takes fwd, bwd, fwd+bwd; got {', '.join(bad)}")
    print(f"flashattn bench on {device}: {len(sweep.cases())} cases, implementations {', '.join(sweep.impls)}")
    rows = harness.run(sweep, progress=not args.quiet)
    for r in rows:
        if "seqlen" not in r:
            print(f"  {r['impl']}: {r['error']}")
    print(harness.table(rows))
    stem = args.name or f"bench-{device.split(':')[0]}"
    for path in harness.write(rows, sweep, Path(args.out), stem):
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashattn", description="Exact, IO-aware attention.")
    parser.add_argument("--version", action="version", version=f"flashattn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="the ladder, the HBM-traffic table, and time/memory against plain attention")
    p.add_argument("--out", default="demo-output", help="folder for demo.json and demo.png")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--seqlens", default="512,1024,2048,4096,8192")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--plain-limit-gib", type=float, default=8.0,
                   help="skip plain attention where its N x N tensors would exceed this")
    p.add_argument("--traffic-n", type=int, default=1024)
    p.add_argument("--traffic-d", type=int, default=64)
    p.set_defaults(func=demo)

    p = sub.add_parser("bench", help="sweep our attention against every baseline on this machine (TFLOP/s, memory)")
    p.add_argument("--out", default="bench-output", help="folder for the JSON and the plots")
    p.add_argument("--name", default=None, help="file stem (default bench-<device>)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--seqlens", default=None, help="comma-separated, e.g. 512,1024,2048")
    p.add_argument("--headdims", default=None, help="comma-separated, e.g. 64,128")
    p.add_argument("--causal", default="both", choices=("both", "true", "false"))
    p.add_argument("--modes", default=None, help="comma-separated from fwd, bwd, fwd+bwd")
    p.add_argument("--baselines", default=None,
                   help="comma-separated from sdpa, sdpa-math, sdpa-flash, sdpa-efficient, sdpa-cudnn, flex, plain")
    p.add_argument("--dtype", default=None, help="float16, bfloat16 or float32 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per batch; batch = tokens // seqlen")
    p.add_argument("--hidden", type=int, default=None, help="hidden size; heads = hidden // headdim")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per case (the median is reported)")
    p.add_argument("--in-process", action="store_true",
                   help="on CPU, measure in this process (faster; memory readings less exact)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    d = p.add_argument_group("decode", "--decode: one new token per sequence attending a KV cache "
                             "(flash_attn_with_kvcache vs torch SDPA), as a fraction of the copy bandwidth")
    d.add_argument("--decode", action="store_true", help="run the decode sweep instead of the attention sweep")
    d.add_argument("--batches", default=None, help="comma-separated (default 1,4,16,64 on GPU)")
    d.add_argument("--cache-lens", default=None, help="comma-separated (default 1024,...,131072 on GPU)")
    d.add_argument("--heads-q", type=int, default=None, help="query heads (default 32 on GPU)")
    d.add_argument("--heads-kv", type=int, default=None, help="key/value heads (default 4 on GPU)")
    d.add_argument("--headdim", type=int, default=None, help="default 128 on GPU")
    d.add_argument("--num-splits", type=int, default=None, help="flash_attn_with_kvcache's num_splits (default 0)")
    d.add_argument("--cache-seqlens", default=None, choices=("int", "tensor"),
                   help="pass cache_seqlens as a Python int (default) or an int32 tensor")
    p.set_defaults(func=bench)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
