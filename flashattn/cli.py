"""The ``flashattn`` command line (also ``python -m flashattn``)::

    flashattn demo                        # the ladder, the HBM-traffic table, time and memory vs plain attention
    flashattn bench sweep                 # our attention against every baseline here (TFLOP/s, time, memory)
    flashattn bench decode                # decode against a KV cache, as a fraction of copy bandwidth
    flashattn bench cpu                   # the CPU path against torch's CPU SDPA and plain attention
    flashattn bench context-parallel      # context-parallel layouts across ranks (starts torchrun)
    flashattn bench cuda-kernel           # the CUDA C++ kernel: compile, accuracy, forward timing
    flashattn bench block-mask            # a FlexAttention BlockMask against varlen and a dense mask
    flashattn bench host                  # host cost per call, from the Python entry to each kernel launch
    flashattn info [--json]               # versions, devices, compilers, the path each call takes and why
    flashattn explain [--pictures]        # an HTML page stepping through FlashAttention-1 and -2, tile by tile

``flashattn bench <subcommand> --help`` lists each one's options with their defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from . import __version__, info, reference
from .bench import block_mask, context_parallel, cpu, cuda_kernel, decode, host, load, options, report, sweep
from .bench.measure import OURS, Case, measure

BENCH_COMMANDS = {"sweep": sweep, "decode": decode, "cpu": cpu, "context-parallel": context_parallel,
                  "cuda-kernel": cuda_kernel, "block-mask": block_mask, "host": host}


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
    device = args.device or options.default_device()
    print(f"flashattn {__version__} demo on {device} (torch {torch.__version__})\n")

    print("1. The ladder: every rung computes the same attention (float64, max abs error)")
    print(report.table(_ladder_errors(), ["algorithm", "compared with", "max error"]), "\n")

    n, d = args.traffic_n, args.traffic_d
    sram = [d * d // 2, d * d, 2 * d * d, 4 * d * d, 16 * d * d, 64 * d * d]
    rows, cross = _traffic_rows(n, d, sram)
    print(f"2. HBM traffic counted block by block (MiB at 2 bytes/element), N={n}, d={d}, SRAM M in elements")
    print(report.table(rows, ["N", "d", "M", "standard", "flash1", "flash2_fwd", "flash2_bwd", "fwd winner"]))
    print(f"   crossover: flash forward moves less data than standard attention from M = {cross} elements "
          f"(theory: M ~ d^2 = {d * d})\n")

    results, dtype = _demo_timings(args, device)
    print(f"\n3. Forward time and peak extra memory, batch 1, {args.heads} heads, headdim {args.headdim}, "
          f"{dtype}, causal={args.causal}")
    columns = [report.Col("N", "seqlen"), *report.per_impl(DEMO_IMPLS, report.MS, report.TFLOPS, report.MIB)]
    print(report.table(report.wide(results, ("seqlen",)), columns))
    title = f"attention forward on {device}: flashattn vs plain attention vs torch SDPA"
    figure = report.Figure(title, ("ms", "mib"))
    meta = report.meta(device, args.command_line, {k: getattr(args, k) for k in DEMO_SWEEP})
    paths = report.write(results, meta, out_dir, "demo", [figure])
    print(f"\nwrote {' and '.join(map(str, paths))}" + ("" if len(paths) > 1 else " (install matplotlib for the plot)"))
    print(f"4. The algorithm, tile by tile: {', '.join(map(str, _write_explain(out_dir / 'explain.html', True)))} "
          "(open the page in a browser)")
    return 0


def _write_explain(page: Path, pictures: bool, **problem) -> list[Path]:
    from . import explain  # matplotlib only when pictures are drawn

    trace = explain.record(**problem)
    paths = [explain.write_page(trace, page)]
    if pictures:
        try:
            paths += explain.write_pictures(trace, page.with_suffix(".png"), page.with_suffix(".gif"))
        except ImportError:
            print("   (install matplotlib for the PNG and GIF)")
    return paths


def _explain_page(out: str) -> Path:
    """The page ``--out`` names: ``out`` itself when it ends in .html, else ``out/explain.html`` (a folder, as
    ``demo --out`` takes)."""
    path = Path(out)
    return path if path.suffix.lower() in (".html", ".htm") and not path.is_dir() else path / "explain.html"


def explain_command(args: argparse.Namespace) -> int:
    problem = {name: getattr(args, name) for name in ("n", "d", "block_rows", "block_cols", "causal", "seed")}
    paths = _write_explain(_explain_page(args.out), args.pictures, **problem)
    print(f"wrote {', '.join(map(str, paths))}: open {paths[0]} in a browser (no network needed)")
    return 0


def _check_explain(args: argparse.Namespace) -> str | None:
    from . import explain

    found = explain.Problem(args.n, args.d, args.block_rows, args.block_cols, args.causal, args.seed).problems()
    if found:
        return "; ".join(found)
    page = _explain_page(args.out)
    in_the_way = next((p for p in page.parents if p.exists() and not p.is_dir()), None)
    if in_the_way is not None:
        return f"--out {args.out}: {in_the_way} is a file, not a folder"
    try:  # the folder it goes in, made if missing; no permission is a usage error
        page.parent.mkdir(parents=True, exist_ok=True)
        if page.is_dir() or not os.access(page.parent, os.W_OK) or (page.exists() and not os.access(page, os.W_OK)):
            raise PermissionError(f"{page} cannot be written")
    except OSError as err:
        return f"--out {args.out}: {err.strerror or err}"
    try:  # the size depends on the tiles' shapes: measured, a second or less
        explain.render_page(explain.record(n=args.n, d=args.d, block_rows=args.block_rows,
                                           block_cols=args.block_cols, causal=args.causal, seed=args.seed))
    except ValueError as err:
        return str(err)
    return None


def _add_explain(sub) -> None:
    from .explain.trace import MAX_D, MAX_N

    p = sub.add_parser("explain", help="an HTML page that steps through FlashAttention-1 and -2 tile by tile",
                       description="Write one self-contained HTML page (no network, opens from disk) that steps "
                                   "through FlashAttention-1 and -2 on a small problem, tile by tile, with every "
                                   "number recorded while flashattn.reference runs; --pictures adds a PNG strip "
                                   "and an animated GIF beside it.", formatter_class=options.HelpFormatter)
    p.add_argument("--out", default="explain.html",
                   help="the page to write (a .html file), or a folder for explain.html and its pictures")
    p.add_argument("--n", type=int, default=12, help=f"queries and keys, 1 to {MAX_N}")
    p.add_argument("--d", type=int, default=4, help=f"head dim, 1 to {MAX_D}")
    p.add_argument("--block-rows", type=int, default=4, help="queries per tile, dividing n")
    p.add_argument("--block-cols", type=int, default=4, help="keys per tile, dividing n")
    p.add_argument("--causal", action="store_true", help="causal masking")
    p.add_argument("--seed", type=int, default=0, help="seed of the random Q, K, V, dO")
    p.add_argument("--pictures", action="store_true", help="also write a PNG strip and an animated GIF beside the page")
    p.set_defaults(func=explain_command, check=_check_explain, parser=p, timed=False)


DEMO_IMPLS = (OURS, "sdpa", "plain")
DEMO_SWEEP = ("seqlens", "heads", "headdim", "causal", "repeats", "plain_limit_gib")


def _demo_timings(args: argparse.Namespace, device: str) -> tuple[list[dict], str]:
    # bf16 on a GPU (what its kernels are for), fp32 on CPU (where half-precision matmuls are emulated and slow).
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    cases = [Case(impl, s, heads=args.heads, headdim=args.headdim, device=device, causal=args.causal, dtype=dtype,
                  repeats=args.repeats) for s in args.seqlens for impl in DEMO_IMPLS]
    results = []
    for case in tqdm(cases, desc="3. timing", unit="case", file=sys.stdout):
        skip = case.impl == "plain" and case.plain_attention_bytes > args.plain_limit_gib * 2**30
        results.append({**vars(case), "seconds": None, "peak_bytes": None, "error": "skipped: N x N too big"}
                       if skip else measure(case))
    return results, dtype


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="the ladder, the HBM-traffic table, and time/memory against plain attention",
                       formatter_class=options.HelpFormatter)
    p.add_argument("--out", default="demo-output", help="folder for demo.json and demo.png")
    options.add_device(p)
    p.add_argument("--seqlens", type=options.int_list, default="512,1024,2048,4096,8192",
                   help="comma-separated sequence lengths to time")
    p.add_argument("--heads", type=options.positive_int, default=4, help="attention heads")
    p.add_argument("--headdim", type=options.positive_int, default=64, help="head dimension")
    p.add_argument("--causal", action="store_true", help="causal masking")
    p.add_argument("--repeats", type=options.positive_int, default=3, help="timed runs per case (the median)")
    p.add_argument("--plain-limit-gib", type=options.positive_float, default=8.0,
                   help="skip plain attention where its N x N tensors would exceed this")
    p.add_argument("--traffic-n", type=options.positive_int, default=1024, help="N of the HBM-traffic table")
    p.add_argument("--traffic-d", type=options.positive_int, default=64, help="head dim of the HBM-traffic table")
    p.set_defaults(func=demo)


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help=f"benchmarks: {', '.join(BENCH_COMMANDS)}",
                           description="Benchmarks. Each subcommand writes <out>/<name>.json (rows, and a meta "
                                       "block: device, torch, date, command, threads, CPU model) and its plots.")
    commands = bench.add_subparsers(dest="benchmark", required=True, metavar="{" + ",".join(BENCH_COMMANDS) + "}",
                                    help="which benchmark")
    for name, module in BENCH_COMMANDS.items():
        p = commands.add_parser(name, help=module.HELP, description=options.plain(module.__doc__),
                                formatter_class=options.HelpFormatter)
        module.add_arguments(p)
        p.set_defaults(func=module.command, check=getattr(module, "check", None), parser=p)


def show_info(args: argparse.Namespace) -> int:
    facts = info.collect()
    sys.stdout.write(json.dumps(facts, indent=1) + "\n" if args.json else info.format_text(facts))
    return 0


def _add_info(sub) -> None:
    p = sub.add_parser("info", help="what is installed and usable here, and which backend runs a call and why",
                       description=options.plain(info.__doc__.split("\n\n")[0]))
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=show_info, timed=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashattn", description="Exact, IO-aware attention.")
    parser.add_argument("--version", action="version", version=f"flashattn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, help="what to run")
    _add_demo(sub)
    _add_bench(sub)
    _add_info(sub)
    _add_explain(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    problem = args.check(args) if getattr(args, "check", None) else None
    if problem:
        args.parser.error(problem)  # a usage error (exit 2), like a bad value
    args.command_line = ["flashattn", *argv]
    if not getattr(args, "timed", True):
        return args.func(args)
    with load.measured():  # before any timing: warns on a busy machine, and the results record the reading
        return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
