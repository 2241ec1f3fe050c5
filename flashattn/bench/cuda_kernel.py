"""``flashattn bench cuda-kernel``: the CUDA C++ kernel on a GPU in one run: compile (NVRTC, timed), accuracy
against float64 beside torch SDPA in the same precision, and forward timings beside our Triton kernel and SDPA's
flash backend.

    flashattn bench cuda-kernel --out $OUT          # on a GPU
    flashattn bench cuda-kernel --smoke --out /tmp/x  # no GPU: the NVRTC compile for sm_90 and the files only

Accuracy: max |out - float64 reference| over (dtype, head dim, causal) at B=2, H=8, N=1025, and the same for
torch SDPA (the tolerance rule: ours <= 2x SDPA's). Timing: TFLOP/s = 4 * B * H * N * N * D (half when causal)
from medians of CUDA-event timings with L2 flushed (``flashattn.bench.measure``), 16k tokens per batch, hidden
2048. Writes cuda-kernel-<device>-<date>.json (``rows``: the timings; ``accuracy``; ``meta.compile``) and .png.
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path

import torch

import flashattn

from . import options, report
from .measure import OURS, OURS_CUDA, Case, measure

HELP = "compile the CUDA C++ kernel, check it against float64 beside SDPA, time its forward (--smoke: no GPU)"
TRITON = "flashattn-triton"  # what OURS runs on a GPU, named so beside the CUDA kernel
SMOKE_ARCH = "sm_90"


def compile_seconds(device_arch: str) -> float:
    """Seconds to compile every variant of the kernel for ``device_arch`` (what eight first calls cost)."""
    from ..backends.cuda import runtime  # imported here: the CLI loads this module to list the subcommand

    start = time.perf_counter()
    runtime.compile_all(device_arch)
    return time.perf_counter() - start


def accuracy() -> list[dict]:
    rows = []
    for dtype in (torch.float16, torch.bfloat16):
        for d in (64, 128):
            for causal in (False, True):
                q, k, v = (torch.randn(2, 1025, 8, d, dtype=dtype, device="cuda") for _ in range(3))
                with flashattn.use_backend("cuda"):
                    ours = flashattn.flash_attn_func(q, k, v, causal=causal)
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                ref = torch.nn.functional.scaled_dot_product_attention(qt.double(), kt.double(), vt.double(),
                                                                       is_causal=causal).transpose(1, 2)
                sdpa = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
                err, base = ((x.double() - ref).abs().max().item() for x in (ours, sdpa))
                rows.append({"dtype": str(dtype).removeprefix("torch."), "headdim": d, "causal": causal,
                             "max_err": err, "sdpa_max_err": base, "passes": err <= 2 * base})
    return rows


def timings(repeats: int) -> list[dict]:
    """Forward of the CUDA kernel, our Triton kernel and SDPA-flash; a case that fails is a row with ``error``."""
    rows = []
    for d in (64, 128):
        for causal in (False, True):
            for n in (1024, 4096, 16384):
                b, h = max(1, 16384 // n), 2048 // d
                for impl in (OURS_CUDA, OURS, "sdpa-flash"):
                    row = measure(Case(impl, n, b, h, d, "bfloat16", "cuda", causal, repeats, "fwd"))
                    rows.append({**row, "impl": TRITON if impl == OURS else impl})
    return rows


ACCURACY_COLUMNS = ["dtype", "headdim", "causal", report.Col("max err", "max_err", ".2e"),
                    report.Col("sdpa max err", "sdpa_max_err", ".2e"),
                    report.Col("ok", lambda r: "ok" if r["passes"] else "FAIL")]


def timing_table(rows: list[dict]) -> str:
    points = report.wide(rows, ("headdim", "causal", "seqlen"))
    columns = ["headdim", "causal", "seqlen", *report.per_impl((OURS_CUDA, TRITON, "sdpa-flash"), report.MS,
                                                              report.TFLOPS)]
    return "\n".join([report.table(points, columns), *report.errors(rows, "headdim", "causal", "seqlen")])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=options.positive_int, default=30, help="timed runs per case (the median)")
    p.add_argument("--smoke", action="store_true",
                   help=f"no GPU: compile with NVRTC for {SMOKE_ARCH} and write the files, nothing else")
    options.add_output(p, "cuda-kernel-<device>-<date>, or cuda-kernel-smoke-<date> with --smoke", progress=False)


def check(args: argparse.Namespace) -> str | None:
    if not args.smoke and not torch.cuda.is_available():
        return "needs a CUDA device (or --smoke)"
    return None


def command(args: argparse.Namespace) -> int:
    date = datetime.date.today().isoformat()
    if args.smoke:
        meta = report.meta("cpu", args.command_line, {"smoke": True},
                           compile={"arch": SMOKE_ARCH, "seconds": compile_seconds(SMOKE_ARCH)})
        meta["device"] = "none (smoke)"
        rows, checks, name = [], [], "smoke"
    else:
        major, minor = torch.cuda.get_device_capability()
        arch = f"sm_{major}{minor}"
        meta = report.meta("cuda", args.command_line, {"repeats": args.repeats},
                           compile={"arch": arch, "seconds": compile_seconds(arch)})
        checks, rows = accuracy(), timings(args.repeats)
        name = meta["device"].replace(" ", "-").lower()
        print(report.table(checks, ACCURACY_COLUMNS), "\n")
        print(timing_table(rows))
    print(f"compile for {meta['compile']['arch']}: {meta['compile']['seconds']:.1f} s")
    figure = report.Figure(f"{meta['device']}, bf16, forward", ("tflops",), cols=("headdim", "causal"))
    stem = args.name or f"cuda-kernel-{name}-{date}"
    for path in report.write(rows, meta, Path(args.out), stem, [figure], accuracy=checks):
        print(f"wrote {path}")
    return 0
