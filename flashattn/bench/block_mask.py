"""``flashattn bench block-mask``: documents packed in one sequence, three ways: a FlexAttention ``BlockMask``
(``flash_attn_func(..., block_mask=)``), the varlen path on the same documents (``flash_attn_varlen_func``, the
fastest a block mask can hope for), and a dense N x N boolean mask (``scaled_dot_product_attention(attn_mask=)``),
which visits every tile. Causal within each document.

Each case draws ``docs`` document lengths summing to ``seqlen`` (seeded), builds the block mask once outside the
timed calls (its build time is reported as ``mask_seconds``) and times forward or forward + backward, median of
``repeats`` calls, with the peak memory of one call (CPU: the resident set's high-water mark; CUDA: the allocator's
peak). The issue's targets: block mask <= 1.2x varlen and <= 1/8 of the dense mask at 16 documents in 16k tokens,
and memory O(N) (the dense mask alone is N^2 bytes).

    flashattn bench block-mask --out benchmarks/results                 # 16 docs, N = 4k, 8k, 16k
    flashattn bench block-mask --seqlens 16384 --modes fwd --impls block-mask,varlen
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

import flashattn

from . import options, report
from .measure import peak_bytes, time_calls

HELP = "a document mask three ways: BlockMask vs varlen vs a dense N x N mask, time and memory"
IMPLS = ("block-mask", "varlen", "dense-mask")
MODES = ("fwd", "fwd+bwd")


@dataclass
class DocumentCase:
    seqlen: int
    docs: int
    impl: str
    mode: str
    heads: int = 8
    headdim: int = 64
    dtype: str = "float32"
    device: str = "cpu"
    repeats: int = 3
    seed: int = 0

    def lengths(self) -> list[int]:
        """``docs`` lengths >= 1 summing to ``seqlen``, drawn around seqlen / docs."""
        gen = torch.Generator().manual_seed(self.seed)
        cuts = torch.randperm(self.seqlen - 1, generator=gen)[: self.docs - 1].add(1).sort().values.tolist()
        bounds = [0, *cuts, self.seqlen]
        return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]


def _call(case: DocumentCase, q, k, v) -> tuple[Callable[[], torch.Tensor], float]:
    """(one attention call, seconds spent building its mask)."""
    lengths = torch.tensor(case.lengths(), device=q.device)
    doc = torch.repeat_interleave(torch.arange(case.docs, device=q.device), lengths)
    if case.impl == "varlen":
        cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        longest = int(lengths.max())
        return (lambda: flashattn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, longest, longest,
                                                         causal=True)[None]), 0.0
    if case.impl == "block-mask":
        from torch.nn.attention.flex_attention import create_block_mask

        def document(b, h, qi, ki):
            return (doc[qi] == doc[ki]) & (qi >= ki)

        t0 = time.perf_counter()
        mask = create_block_mask(document, None, None, case.seqlen, case.seqlen, device=q.device)
        built = time.perf_counter() - t0
        return (lambda: flashattn.flash_attn_func(q, k, v, block_mask=mask)), built
    t0 = time.perf_counter()
    dense = (doc[:, None] == doc[None, :]).tril_()
    built = time.perf_counter() - t0
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    return (lambda: flashattn.scaled_dot_product_attention(qt, kt, vt, attn_mask=dense).transpose(1, 2)), built


def run_case(case: DocumentCase) -> dict:
    dtype = getattr(torch, case.dtype)
    grad = case.mode == "fwd+bwd"
    shape = (1, case.seqlen, case.heads, case.headdim)
    q, k, v = (torch.randn(shape, dtype=dtype, device=case.device, requires_grad=grad) for _ in range(3))
    call, mask_seconds = _call(case, q, k, v)  # the mask (torch's create_block_mask is its own cost) is input
    if grad:
        g = torch.randn(shape, dtype=dtype, device=case.device)

        def step():
            torch.autograd.grad(call(), (q, k, v), g)
    else:
        def step():
            with torch.inference_mode():
                call()
    peak = peak_bytes(step, case.device)  # also the warm-up
    seconds = statistics.median(time_calls(step, case.repeats, case.device))
    return {**asdict(case), "seconds": seconds, "mask_seconds": mask_seconds, "peak_bytes": peak}


@dataclass
class DocumentSweep:
    seqlens: list[int] = field(default_factory=lambda: [4096, 8192, 16384])
    docs: int = 16
    impls: list[str] = field(default_factory=lambda: list(IMPLS))
    modes: list[str] = field(default_factory=lambda: list(MODES))
    heads: int = 8
    headdim: int = 64
    dtype: str = "float32"
    device: str = "cpu"
    repeats: int = 3

    def cases(self) -> list[DocumentCase]:
        return [DocumentCase(n, self.docs, impl, mode, self.heads, self.headdim, self.dtype, self.device,
                             self.repeats) for n in self.seqlens for mode in self.modes for impl in self.impls]


def ratios(rows: list[dict]) -> list[dict]:
    """Per (seqlen, mode): each implementation's seconds and peak memory, and block-mask / varlen, block-mask /
    dense-mask time ratios (None where a side is missing)."""
    points = report.wide(rows, ("seqlen", "mode"))
    for p in points:
        block, varlen, dense = (p.get((i, "seconds")) for i in IMPLS)
        p["vs_varlen"] = block / varlen if block and varlen else None
        p["vs_dense"] = block / dense if block and dense else None
    return points


COLUMNS = ["seqlen", "mode",
           *report.per_impl(IMPLS, report.MS, report.MIB),
           report.Col("block/varlen", "vs_varlen", ".2f"), report.Col("block/dense", "vs_dense", ".3f")]


def add_arguments(p: argparse.ArgumentParser) -> None:
    defaults = DocumentSweep()
    p.add_argument("--seqlens", type=options.int_list, default=defaults.seqlens, help="tokens in the packed sequence")
    p.add_argument("--docs", type=options.positive_int, default=defaults.docs, help="documents packed in it")
    p.add_argument("--impls", type=options.choice_list(IMPLS), default=list(IMPLS), help="which ways to run it")
    p.add_argument("--modes", type=options.choice_list(MODES), default=list(MODES), help="fwd and/or fwd+bwd")
    p.add_argument("--heads", type=options.positive_int, default=defaults.heads, help="query and key/value heads")
    p.add_argument("--headdim", type=options.positive_int, default=defaults.headdim, help="head dim of q, k and v")
    p.add_argument("--repeats", type=options.positive_int, default=defaults.repeats, help="timed calls (median)")
    options.add_dtype(p, default="float32")
    options.add_device(p)
    options.add_output(p, "block-mask-<device>-<date>")


def command(args: argparse.Namespace) -> int:
    device = args.device or options.default_device()
    sweep = DocumentSweep(args.seqlens, args.docs, args.impls, args.modes, args.heads, args.headdim,
                          args.dtype or "float32", device, args.repeats)
    rows = []
    for case in tqdm(sweep.cases(), disable=args.quiet, desc="block-mask"):
        try:
            rows.append(run_case(case))
        except Exception as e:  # a failing case is a row of the report, not a crash
            rows.append({**asdict(case), "error": f"{type(e).__name__}: {str(e)[:200]}"})
    meta = report.meta(device, args.command_line, sweep)
    points = ratios([r for r in rows if "error" not in r])
    print(report.table(points, COLUMNS))
    print("\n".join(report.errors(rows, "seqlen", "mode", "impl")))
    stem = args.name or f"block-mask-{meta['device'].replace(' ', '-').lower()}-{datetime.date.today().isoformat()}"
    summary = [{k if isinstance(k, str) else ".".join(k): v for k, v in p.items()
                if isinstance(k, str) or k[1] in ("seconds", "peak_bytes")} for p in points]
    for path in report.write(rows, meta, Path(args.out), stem, summary=summary):
        print(f"wrote {path}")
    return 0
