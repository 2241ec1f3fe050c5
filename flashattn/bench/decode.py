"""``flashattn bench decode``: one new token attending a KV cache, as a fraction of the device's copy bandwidth.

Decode attention does almost no arithmetic per byte (each cached key and value is read once for a handful of
query heads), so its ceiling is memory bandwidth. Each case times ``flashattn.flash_attn_with_kvcache`` on a cache
of ``cache_len`` positions and counts the bytes it must move: every K and V row it attends, plus q and the output.
Achieved GB/s is that count over the time; the fraction divides it by the device's copy bandwidth measured in the
same run (``dst.copy_(src)`` of 1 GiB, read + write bytes), a ceiling that a memory-bound kernel can reach, unlike
the datasheet figure. The baseline, also timed in the same run on the same cache, is torch SDPA (default backend
choice, ``enable_gqa=True``) on q (B, Hq, 1, D) and transposed views k, v (B, Hk, L, D) of the cache.

GPU timing: CUDA events, L2 flushed before each call, the launch queued ahead behind a spin kernel so that the
events time the device work, not Python overhead (``measure.time_calls``); ``host_seconds`` is the synchronised
wall time per call, overhead included. The issue's goal: >= 80% of copy bandwidth at batch 1, 64k cache.

    flashattn bench decode --out $OUT                      # GPU: decode-cuda.json, decode-cuda.png, a table
    flashattn bench decode --batches 1 --cache-lens 65536 --cache-seqlens tensor

In Python: ``rows, copy = run(DecodeSweep.for_device("cpu"))``, then ``table(rows, copy)``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import flashattn

from . import anatomy, options, report
from .measure import L2_FLUSH_BYTES, OURS, time_calls

HELP = "one new token per sequence attending a KV cache: flash_attn_with_kvcache vs SDPA, GB/s"
BASELINE = "sdpa"  # torch.nn.functional.scaled_dot_product_attention, default backend choice, enable_gqa=True
GOAL = {"batch": 1, "cache_len": 65536, "bw_fraction": 0.8}


@dataclass
class DecodeCase:
    """One decode step: ``batch`` sequences, each with ``seqlen_q`` new query tokens over ``cache_len`` cached
    positions (the cache is allocated with exactly that many rows and all of them are attended)."""

    batch: int
    cache_len: int
    heads_q: int = 32
    heads_kv: int = 4
    headdim: int = 128
    dtype: str = "bfloat16"
    device: str = "cuda"
    seqlen_q: int = 1
    num_splits: int = 0  # 0: the implementation chooses how many pieces to split each cache into
    cache_seqlens: str = "int"  # how cache_seqlens is passed: a Python "int" or an int32 (batch,) "tensor"
    repeats: int = 30
    cache_dtype: str = ""  # ours reads the cache in this dtype (an FP8 one); "" = dtype. The baseline reads dtype.

    @property
    def element_size(self) -> int:
        return torch.finfo(getattr(torch, self.dtype)).bits // 8

    @property
    def cache_bytes(self) -> int:
        """The K and V rows attended: each is read once, whatever the number of query heads sharing it (counted
        in the cache's dtype: an FP8 cache's bytes)."""
        size = torch.finfo(getattr(torch, self.cache_dtype or self.dtype)).bits // 8
        return 2 * self.batch * self.cache_len * self.heads_kv * self.headdim * size

    @property
    def q_bytes(self) -> int:
        """q, and equally the output."""
        return self.batch * self.seqlen_q * self.heads_q * self.headdim * self.element_size

    @property
    def bytes_moved(self) -> int:
        """The least any implementation must move: the cache rows read, q read and the output written."""
        return self.cache_bytes + 2 * self.q_bytes

    @property
    def memory_bytes(self) -> int:
        """What the case allocates: the cache, q, and an output per implementation (ours and the baseline)."""
        return self.cache_bytes + 3 * self.q_bytes

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int | torch.Tensor]:
        dtype = getattr(torch, self.dtype)
        q = torch.randn(self.batch, self.seqlen_q, self.heads_q, self.headdim, dtype=dtype, device=self.device)
        shape = (self.batch, self.cache_len, self.heads_kv, self.headdim)
        k, v = (torch.randn(shape, dtype=dtype, device=self.device) for _ in range(2))
        if self.cache_dtype and self.cache_dtype != self.dtype:  # stored in FP8 with descale 1
            k, v = (t.to(getattr(torch, self.cache_dtype)) for t in (k, v))
        seqlens: int | torch.Tensor = self.cache_len
        if self.cache_seqlens == "tensor":
            seqlens = torch.full((self.batch,), self.cache_len, dtype=torch.int32, device=self.device)
        return q, k, v, seqlens


def _ours(case: DecodeCase, q, k, v, seqlens) -> Callable[[], torch.Tensor]:
    fn = flashattn.flash_attn_with_kvcache  # looked up per case: an AttributeError says it is not there (yet)
    return lambda: fn(q, k, v, cache_seqlens=seqlens, num_splits=case.num_splits)


def _sdpa(case: DecodeCase, q, k, v, seqlens) -> Callable[[], torch.Tensor]:
    # Views, not copies: (B, L, Hk, D) transposed is the layout SDPA's flash and efficient kernels read natively.
    # SDPA reads no FP8: against an FP8 cache it reads the same values widened once to q's dtype, before timing.
    k, v = (t.to(q.dtype) for t in (k, v))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    return lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2)


def sdpa_backend(q, k, v) -> str | None:
    """Which SDPA kernel the baseline's call dispatches to (FLASH_ATTENTION, MATH, ...), to read its numbers by;
    None if this torch cannot say (the query is a private function)."""
    try:
        from torch.nn.attention import SDPBackend

        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        return SDPBackend(torch._fused_sdp_choice(qt, kt, vt, enable_gqa=True)).name
    except Exception:  # informative only: never let it cost a measurement
        return None


def _ours_16bit(case: DecodeCase, q, k, v, seqlens) -> Callable[[], torch.Tensor]:
    # Ours on the same values in q's dtype (widened before timing), timed in the same run: what the FP8 cache gains.
    return _ours(case, q, *(t.to(q.dtype) for t in (k, v)), seqlens)


OURS_16BIT = "flashattn-16bit-cache"
IMPLEMENTATIONS: dict[str, Callable] = {OURS: _ours, OURS_16BIT: _ours_16bit, BASELINE: _sdpa}


@dataclass
class DecodeSweep:
    """What to measure. GPU defaults are the issue's: batch 1..64, cache 1k..128k, GQA 32:4 (8:1), headdim 128,
    bf16. ``for_device("cpu")`` gives a tiny fp32 sweep that only checks the machinery."""

    batches: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    cache_lens: list[int] = field(default_factory=lambda: [1024, 4096, 16384, 65536, 131072])
    heads_q: int = 32
    heads_kv: int = 4
    headdim: int = 128
    dtype: str = "bfloat16"
    device: str = "cuda"
    num_splits: int = 0
    cache_seqlens: str = "int"
    repeats: int = 30
    cache_dtype: str = ""
    copy_gib: float = 1.0  # per buffer; far larger than L2, so the copy runs at HBM speed
    copy_repeats: int = 10
    headroom_gib: float = 2.0  # left free for workspaces, split-KV partials, the allocator and the L2 flush
    impls: list[str] = field(default_factory=lambda: [OURS, BASELINE])
    profile: bool = False  # each row also gets its call's kernels and their device time (``anatomy``)

    @classmethod
    def for_device(cls, device: str) -> DecodeSweep:
        if device.startswith("cuda"):
            return cls(device=device)
        return cls(batches=[1, 2], cache_lens=[256, 1024], heads_q=8, heads_kv=1, headdim=64, dtype="float32",
                   device=device, repeats=3, copy_gib=1 / 16, copy_repeats=3, headroom_gib=0.25)

    def timed(self) -> list[str]:
        """The implementations timed: with an FP8 cache, also ours on that cache widened to 16 bits, side by side."""
        if self.cache_dtype and self.cache_dtype != self.dtype and OURS in self.impls and OURS_16BIT not in self.impls:
            return [OURS, OURS_16BIT, *(impl for impl in self.impls if impl != OURS)]
        return self.impls

    def cases(self) -> list[DecodeCase]:
        return [DecodeCase(b, n, self.heads_q, self.heads_kv, self.headdim, self.dtype, self.device,
                           num_splits=self.num_splits, cache_seqlens=self.cache_seqlens, repeats=self.repeats,
                           cache_dtype=self.cache_dtype)
                for b in self.batches for n in self.cache_lens]


def copy_bandwidth(device: str, buffer_bytes: int, repeats: int) -> dict:
    """The device's achievable memory bandwidth: median time of ``dst.copy_(src)`` of ``buffer_bytes``, counting
    the bytes read and the bytes written."""
    src = torch.zeros(buffer_bytes, dtype=torch.uint8, device=device)  # zeros, not empty: touch every CPU page
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of dst outside the measurement
    times = time_calls(lambda: dst.copy_(src), repeats, device, flush_l2=False)
    seconds = statistics.median(times)
    moved = 2 * buffer_bytes
    return {"buffer_bytes": buffer_bytes, "bytes_moved": moved, "seconds": seconds, "gbps": moved / seconds / 1e9}


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def available(sweep: DecodeSweep) -> dict[str, str | None]:
    """Each implementation -> None if it runs here on a tiny cache of the sweep's shape, else the reason."""
    tiny = DecodeCase(1, 16, sweep.heads_q, sweep.heads_kv, sweep.headdim, sweep.dtype, sweep.device,
                      num_splits=sweep.num_splits, cache_seqlens=sweep.cache_seqlens)
    inputs = tiny.inputs()
    reasons: dict[str, str | None] = {}
    for impl in sweep.timed():
        if impl not in IMPLEMENTATIONS:
            reasons[impl] = f"unknown implementation; choose from {', '.join(IMPLEMENTATIONS)}"
            continue
        try:
            with torch.inference_mode():
                IMPLEMENTATIONS[impl](tiny, *inputs)()
            reasons[impl] = None
        except Exception as e:  # a missing or failing implementation is a row of the report, not a crash
            reasons[impl] = _error(e)
    return reasons


def _free_bytes(device: str) -> int:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # hand cached blocks back so the driver's count is what a new case can get
        return torch.cuda.mem_get_info(torch.device(device))[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise KeyError("MemAvailable")


def _row(case: DecodeCase, impl: str, **values) -> dict:
    return {**asdict(case), "impl": impl, "bytes_moved": case.bytes_moved, **values}


def _timed(case: DecodeCase, impl: str, step: Callable[[], torch.Tensor], copy_gbps: float) -> dict:
    cuda = case.device.startswith("cuda")
    seconds = statistics.median(time_calls(step, case.repeats, case.device, queue_ahead=True))

    def synced():
        step()
        if cuda:
            torch.cuda.synchronize()

    host = statistics.median(time_calls(synced, case.repeats, "cpu"))
    gbps = case.bytes_moved / seconds / 1e9
    return _row(case, impl, seconds=seconds, host_seconds=host, gbps=gbps, bw_fraction=gbps / copy_gbps)


def measure_case(case: DecodeCase, impls: list[str], copy_gbps: float, headroom_gib: float,
                 profile: bool = False) -> list[dict]:
    """One row per implementation: seconds, GB/s, fraction of ``copy_gbps``; ours also gets ``speedup`` over the
    baseline and the largest difference from its output; with ``profile``, ``kernels``: the call's longest kernels
    (name, seconds and launches per call). A case that does not fit in memory gives rows with
    ``error`` = "skipped: needs X GiB" without allocating anything."""
    need = case.memory_bytes + headroom_gib * 2**30 + (L2_FLUSH_BYTES if case.device.startswith("cuda") else 0)
    free = _free_bytes(case.device)
    if need > free:
        why = f"skipped: needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
        return [_row(case, impl, seconds=None, gbps=None, bw_fraction=None, error=why) for impl in impls]
    try:
        inputs = case.inputs()
    except RuntimeError as e:  # out of memory after all: the estimate was short (fragmentation, another process)
        return [_row(case, impl, seconds=None, gbps=None, bw_fraction=None, error=f"skipped: {_error(e)}")
                for impl in impls]
    rows, outs = {}, {}
    for impl in impls:
        try:
            step = IMPLEMENTATIONS[impl](case, *inputs)
            with torch.inference_mode():
                outs[impl] = step()  # warm-up (compilation, autotuning), and the output for the cross-check
                rows[impl] = _timed(replace(case, cache_dtype="") if impl == OURS_16BIT else case, impl, step,
                                    copy_gbps)
                if profile:
                    rows[impl]["kernels"] = [t._asdict() for t in anatomy.kernel_times(step, case.device)]
        except Exception as e:  # e.g. a baseline that runs out of memory at this size: a row, not a crash
            rows[impl] = _row(case, impl, seconds=None, gbps=None, bw_fraction=None, error=_error(e))
    ours, base = rows.get(OURS), rows.get(BASELINE)
    if base:
        base["sdpa_backend"] = sdpa_backend(*inputs[:3])
    if ours and base and ours.get("seconds") and base.get("seconds"):
        diff = (outs[OURS].float() - outs[BASELINE].float()).abs().max().item()
        ours.update(baseline=BASELINE, speedup=base["seconds"] / ours["seconds"], max_abs_diff=diff)
    wide = rows.get(OURS_16BIT)
    if ours and wide and ours.get("seconds") and wide.get("seconds"):
        ours["speedup_over_16bit_cache"] = wide["seconds"] / ours["seconds"]
    return list(rows.values())


def run(sweep: DecodeSweep, progress: bool = True) -> tuple[list[dict], dict]:
    """The copy bandwidth, then every case of the sweep; returns the rows and the copy measurement."""
    copy = copy_bandwidth(sweep.device, int(sweep.copy_gib * 2**30), sweep.copy_repeats)
    reasons = available(sweep)
    rows = [{"impl": impl, "error": f"unavailable: {why}"} for impl, why in reasons.items() if why]
    impls = [impl for impl, why in reasons.items() if why is None]
    for case in tqdm(sweep.cases(), desc="decode", unit="case", disable=not progress, file=sys.stdout):
        rows += measure_case(case, impls, copy["gbps"], sweep.headroom_gib, sweep.profile)
    return rows, copy


def goal(rows: list[dict]) -> dict | None:
    """The issue's target point (batch 1, 64k cache) if the sweep measured it: our fraction and whether it is met."""
    row = next((r for r in rows if r["impl"] == OURS and r.get("batch") == GOAL["batch"]
                and r.get("cache_len") == GOAL["cache_len"]), None)
    if row is None:
        return None
    got = row.get("bw_fraction")
    return {**{f"target_{k}": v for k, v in GOAL.items()}, "bw_fraction": got,
            "met": got is not None and got >= GOAL["bw_fraction"]}


def table(rows: list[dict], copy: dict) -> str:
    """One line per (batch, cache_len): each implementation's time, GB/s and fraction of copy bandwidth, our speedup
    and largest difference from the baseline; a point that did not fit reads "skipped: ..." in the last column."""
    measured = [r for r in rows if "batch" in r]
    impls = list(dict.fromkeys(r["impl"] for r in measured))
    points = report.wide(measured, ("batch", "cache_len"))
    for point in points:
        notes = [str(point.get((impl, "error"))) for impl in impls]
        point["note"] = next((n for n in notes if n.startswith("skipped")), None)
    columns = [report.Col("batch"), report.Col("cache", "cache_len"),
               *report.per_impl(impls, report.US, ("GB/s", "gbps", 1.0, ".0f"), ("of copy", "bw_fraction", 1.0, ".1%")),
               report.Col("speedup", (OURS, "speedup"), ".2f"), report.Col("max|diff|", (OURS, "max_abs_diff"), ".1e"),
               *([report.Col("vs 16-bit", (OURS, "speedup_over_16bit_cache"), ".2f")] if OURS_16BIT in impls else []),
               report.Col("note", left=True)]
    lines = [f"\ndecode attention (copy bandwidth {copy['gbps']:.0f} GB/s; 'of copy' = achieved / copy)",
             report.table(points, columns)]
    backends = sorted({r["sdpa_backend"] for r in rows if r.get("sdpa_backend")})
    if backends:
        lines.append(f"  {BASELINE} ran on SDPA's {', '.join(backends)} backend")
    lines += sorted(set(report.errors(measured, "batch", "cache_len")))
    profiled = [r for r in measured if "kernels" in r]
    if profiled:
        lines.append("\nwhere a call's device time goes (per call, the longest kernels first):")
        lines += [f"  batch {r['batch']}, cache {r['cache_len']}, {r['impl']}: "
                  f"{anatomy.summary([anatomy.KernelTime(**t) for t in r['kernels']])}" for r in profiled]
    return "\n".join(lines)


def figure(sweep: DecodeSweep, copy: dict, device_name: str) -> report.Figure:
    """Fraction of copy bandwidth against cache length: one panel per implementation, a line per batch size, the
    goal dashed."""
    title = (f"decode on {device_name}, {sweep.dtype}, heads {sweep.heads_q}:{sweep.heads_kv}, headdim "
             f"{sweep.headdim}; copy {copy['gbps']:.0f} GB/s")
    return report.Figure(title, ("bw_fraction",), x="cache_len", lines=("batch",), cols=("impl",),
                         goal=GOAL["bw_fraction"])


def write(rows: list[dict], copy: dict, sweep: DecodeSweep, out_dir: Path, stem: str,
          command: list[str] | None = None) -> list[Path]:
    """JSON (``meta``: the sweep, the device, its copy bandwidth, the goal check; ``rows``) and the plot; returns
    the paths."""
    meta = report.meta(sweep.device, command, sweep, copy_bandwidth=copy, goal=goal(rows))
    return report.write(rows, meta, out_dir, stem, [figure(sweep, copy, meta["device"])])


def add_arguments(p: argparse.ArgumentParser) -> None:
    options.add_device(p)
    options.add_per_device(p, "--batches", "comma-separated", DecodeSweep, options.int_list)
    options.add_per_device(p, "--cache-lens", "comma-separated", DecodeSweep, options.int_list)
    options.add_per_device(p, "--heads-q", "query heads", DecodeSweep)
    options.add_per_device(p, "--heads-kv", "key/value heads, dividing --heads-q", DecodeSweep)
    options.add_per_device(p, "--headdim", "head dimension", DecodeSweep)
    p.add_argument("--num-splits", type=options.nonnegative_int, default=0,
                   help="flash_attn_with_kvcache's num_splits; 0 lets it choose")
    p.add_argument("--cache-seqlens", default="int", choices=("int", "tensor"),
                   help="pass cache_seqlens as a Python int or an int32 (batch,) tensor")
    options.add_dtype(p)
    p.add_argument("--cache-dtype", default=None, choices=("float8_e4m3fn", "float8_e5m2"),
                   help="store the KV cache in FP8 (descale 1); the baseline, and ours a second time, read it widened "
                        "to --dtype in the same run")
    options.add_per_device(p, "--repeats", "timed runs per case, the median is reported", DecodeSweep)
    p.add_argument("--profile", action="store_true",
                   help="also list each call's kernels and their device time per call (torch.profiler)")
    options.add_output(p, "decode-<device>")


def from_args(args: argparse.Namespace) -> DecodeSweep:
    """The device's default decode sweep with the options given on the command line."""
    sweep = DecodeSweep.for_device(args.device or options.default_device())
    for name in ("batches", "cache_lens", "heads_q", "heads_kv", "headdim", "num_splits", "cache_seqlens", "dtype",
                 "repeats", "cache_dtype", "profile"):
        if getattr(args, name) is not None:
            setattr(sweep, name, getattr(args, name))
    return sweep


def check(args: argparse.Namespace) -> str | None:
    sweep = from_args(args)
    if sweep.heads_q % sweep.heads_kv:
        return f"--heads-q {sweep.heads_q} is not a multiple of --heads-kv {sweep.heads_kv}"
    if sweep.cache_dtype and sweep.dtype not in ("float16", "bfloat16"):
        return f"--cache-dtype {sweep.cache_dtype} is read by 16-bit queries: pass --dtype bfloat16 or float16"
    return None


def command(args: argparse.Namespace) -> int:
    sweep = from_args(args)
    print(f"flashattn bench decode on {sweep.device}: {len(sweep.cases())} cases, heads {sweep.heads_q}:"
          f"{sweep.heads_kv}, headdim {sweep.headdim}, {sweep.dtype}; ours vs {', '.join(sweep.timed()[1:])}")
    rows, copy = run(sweep, progress=not args.quiet)
    for r in rows:
        if "batch" not in r:
            print(f"  {r['impl']}: {r['error']}")
    print(table(rows, copy))
    target = goal(rows)
    if target:
        got = "not measured" if target["bw_fraction"] is None else f"{target['bw_fraction']:.1%}"
        print(f"goal: >= {target['target_bw_fraction']:.0%} of copy bandwidth at batch {target['target_batch']}, "
              f"cache {target['target_cache_len']}: {got} ({'met' if target['met'] else 'not met'})")
    stem = args.name or f"decode-{sweep.device.split(':')[0]}"
    for path in write(rows, copy, sweep, Path(args.out), stem, args.command_line):
        print(f"wrote {path}")
    return 0
