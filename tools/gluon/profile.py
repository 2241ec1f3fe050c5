"""Offline sm_90 counts of the Gluon FlashAttention-3-style forward (``forward.py``): registers and their
reallocation, spills, shared memory, HGMMA groups and how long each stays in flight, TMA loads, and instructions per
score in the consumers' main loop, the same way ``tools.offline.profile`` counts the tl kernels.

    python -m tools.gluon.profile [--all | --launched] [--fp8] [--window=256:0] [--softcap 30] [--packed]
                                  [--cases 128:0,64:1] [--json out]

``--fp8``: the FP8 forward (e4m3 q, k, v; wgmma on FP8 operands, ``QGMMA`` in the SASS). ``--launched``: the
schedule the tier launches (``forward.LAUNCHED``) instead of ``SCHEDULES``'s. ``--window left:right`` (-1 for an
unbounded side) and ``--softcap``: the kernel compiled for a sliding window and a softcap; ``--packed``: for packed
sequences (``flash_attn_varlen_func``'s layout, the same tokens as two sequences).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from flashattn.backends.triton.hopper import tile_dim
from flashattn.backends.triton.hopper.forward import (
    BLOCK_M,
    BLOCK_N,
    LAUNCHED,
    SCHEDULES,
    VARIANTS,
    Schedule,
    attention_forward_ws_kernel,
    launch_arguments,
)
from tools.offline.sass import WGMMA

# The shape the tl kernels are profiled at (tools.offline.profile): batch 2, 2048 tokens, 4 heads.
PROFILE_SHAPE = (2, 2048, 4)
CONSUMER_WARPS = 8  # two consumer warpgroups
_WAIT = re.compile(r"gsb0\s*,\s*0x([0-9a-f]+)")
_PV = re.compile(r"R\d+, R\d+, gdesc")  # A from registers: P V; Q K^T reads both operands from shared memory


def compile_sm90(head_dim: int, causal: bool, schedule: Schedule | None = None, dtype: torch.dtype = torch.bfloat16,
                 *, window: tuple[int, int] = (-1, -1), softcap: float = 0.0, packed: bool = False):
    """The kernel compiled for sm_90 as ``forward`` would launch it at PROFILE_SHAPE (CPU tensors, nothing runs)."""
    from tools.offline.compile import _offline

    batch, seqlen, heads = PROFILE_SHAPE
    q, k, v = (torch.empty(batch, seqlen, heads, head_dim, dtype=dtype) for _ in range(3))
    out = torch.empty_like(q, dtype=torch.float32 if dtype == torch.float8_e4m3fn else dtype)
    lse = torch.empty(batch, heads, seqlen)
    schedule = schedule or SCHEDULES[tile_dim(head_dim)]
    descale = None
    if dtype == torch.float8_e4m3fn:  # v as the FP8 forward hands it over: keys contiguous (attend.interleaved_values)
        v = v.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        descale = torch.ones(batch, k.shape[2])
    layout = {}
    if packed:  # every batch's rows as one packed batch, cut into two sequences
        q, k, v, out = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v, out))
        cuts = torch.tensor([0, seqlen // 2, batch * seqlen], dtype=torch.int32)
        layout = dict(cu_seqlens=(cuts, cuts), max_seqlen_q=batch * seqlen - seqlen // 2)
        lse = torch.empty(heads, batch * seqlen)
    grid, kwargs = launch_arguments(q, k, v, out, lse, causal=causal, scale=head_dim**-0.5, schedule=schedule,
                                    descale=descale, window=window, softcap=softcap, **layout)
    with _offline(90):
        return attention_forward_ws_kernel.warmup(grid=grid, **kwargs)


@dataclass
class Measured:
    head_dim: int
    causal: bool
    schedule: Schedule
    registers: int  # the cubin's per-thread count at launch; setmaxnreg moves it per warpgroup
    setmaxnreg: tuple  # distinct USETMAXREG targets
    spill_bytes: int
    shared_bytes: int
    warps: int  # all partitions, padded to whole warpgroups (the launch's block is warps x 32 threads)
    hgmma: int
    hgmma_groups: int
    overlap: list  # per HGMMA group, sass.hgmma_overlap(): instructions until a wait for 0 retires it
    retired: list  # per group, ("qk" | "pv", instructions until the wait that retires it, waits for 1 counted)
    tma_loads: int
    loop: int  # instructions per key tile in the consumer's unmasked loop
    per_score: float  # loop x 8 consumer warps / (128 x 128)
    fp8: bool = False  # e4m3 q, k, v
    reciprocals: int = 0  # MUFU.RCP instructions (a softcap's, one a score)
    band_loops: int = 0  # innermost loops holding a QK^T and a PV group: the masked and unmasked key loops
    loop_spills: int = 0  # local-memory loads and stores inside the key loops (spill_bytes counts all of them)

    def overlapped(self, kind: str, at_least: int = 32) -> int:
        """Groups of ``kind`` with at least ``at_least`` instructions issued between them and their retirement."""
        return sum(k == kind and gap >= at_least for k, gap in self.retired)


def retired(sass) -> list[tuple[str, int]]:
    """For each HGMMA group, its kind (``qk``: both operands in shared memory, ``pv``: A from registers) and the
    instructions between it and the ``WARPGROUP.DEPBAR.LE gsb0, N`` that retires it (groups retire oldest first:
    a wait for N leaves the N youngest in flight). ``Sass.hgmma_overlap`` counts waits for 0 only."""
    out, pending = [], []
    for i, ins in enumerate(sass.instructions):
        if ins.opcode.startswith(WGMMA) and "gsb0" in ins.operands:
            pending.append((i, "pv" if _PV.search(ins.operands) else "qk"))
        elif ins.opcode == "WARPGROUP.DEPBAR.LE":
            match = _WAIT.search(ins.operands)
            keep = int(match.group(1), 16) if match else 0
            cut = max(len(pending) - keep, 0)
            out += [(kind, i - at - 1) for at, kind in pending[:cut]]
            pending = pending[cut:]
    return out


def _groups(sass, loop) -> int:
    return sum(ins.opcode.startswith(WGMMA) and "gsb0" in ins.operands
               for ins in sass.instructions[loop.start: loop.end + 1])


def consumer_loop(sass):
    """The consumer's unmasked key loop and the tiles one trip covers: the leanest innermost loop per tile among
    those holding HGMMA groups (a QK^T and a PV group per tile; the masked loop is the longer one, the producer's
    loop has none)."""
    best = None
    for loop in sass.innermost_loops():
        groups = _groups(sass, loop)
        if groups >= 2 and (best is None or loop.length * 2 / groups < best[0].length * 2 / best[1]):
            best = (loop, groups)
    return None if best is None else (best[0], best[1] // 2)


def measure(head_dim: int, causal: bool, schedule: Schedule | None = None, fp8: bool = False, *,
            window: tuple[int, int] = (-1, -1), softcap: float = 0.0, packed: bool = False) -> Measured:
    from tools.offline.compile import cubin_report

    schedule = schedule or SCHEDULES[tile_dim(head_dim)]
    kernel = compile_sm90(head_dim, causal, schedule, torch.float8_e4m3fn if fp8 else torch.bfloat16,
                          window=window, softcap=softcap, packed=packed)
    report = cubin_report(kernel.asm["cubin"])
    sass = report.sass
    found = consumer_loop(sass)
    per_tile = found[0].length / found[1] if found else 0
    setmaxnreg = tuple(sorted({int(ins.operands.split(",")[-1], 16) for ins in sass.instructions
                               if ins.opcode.startswith("USETMAXREG")}))
    return Measured(
        head_dim, causal, schedule, report.registers, setmaxnreg, report.spill_bytes, kernel.metadata.shared,
        kernel.metadata.num_warps, sass.count(WGMMA), sass.hgmma_groups(), sass.hgmma_overlap(), retired(sass),
        sass.count("UTMALDG"), round(per_tile),
        round(per_tile * CONSUMER_WARPS / (BLOCK_M * BLOCK_N[tile_dim(head_dim)]), 3), fp8,
        sass.count("MUFU.RCP"),
        sum(_groups(sass, loop) >= 2 for loop in sass.innermost_loops()),
        sum(sass.count(("LDL", "STL"), loop) for loop in sass.innermost_loops() if _groups(sass, loop) >= 2),
    )


def format_row(r: Measured) -> str:
    gaps = {kind: [gap for k, gap in r.retired if k == kind] for kind in ("qk", "pv")}
    return (f"{r.head_dim:4d} {r.causal!s:>6} {r.schedule.overlap:>3} {int(r.schedule.pingpong):2d} "
            f"{r.schedule.unroll:2d} {int(r.schedule.persistent):2d} {r.registers:4d} "
            f"{'/'.join(map(str, r.setmaxnreg)):>14} {r.spill_bytes:5d} "
            f"{r.shared_bytes:6d} {r.warps:5d} {r.hgmma:5d} {r.hgmma_groups:6d} {r.tma_loads:3d} {r.loop:5d} "
            f"{r.per_score:10.3f}  qk {gaps['qk']} pv {gaps['pv']}")


HEADER = (f"{'d':>4} {'causal':>6} {'ovl':>3} {'pp':>2} {'un':>2} {'ps':>2} {'regs':>4} {'setmaxnreg':>14} "
          f"{'spill':>5} {'smem':>6} {'warps':>5} {'hgmma':>5} {'groups':>6} {'tma':>3} {'/tile':>5} "
          f"{'inst/score':>10}  instructions until each group retires")


def main(argv: list[str] | None = None) -> int:
    """``python -m flashattn.backends.triton.experimental.gluon_profile [--all] [--cases 128:0,64:1] [--json out]``:
    the shipped schedule per case (head dim : causal), or with ``--all`` every schedule in VARIANTS."""
    parser = argparse.ArgumentParser(description="Offline sm_90 counts of the Gluon FA3-style forward (no GPU).")
    parser.add_argument("--cases", default="64:0,64:1,128:0,128:1", help="head_dim:causal, comma-separated")
    parser.add_argument("--all", action="store_true", help="every schedule in VARIANTS, not only the shipped one")
    parser.add_argument("--launched", action="store_true", help="the schedule the tier launches (LAUNCHED)")
    parser.add_argument("--fp8", action="store_true", help="the FP8 forward (e4m3 q, k, v)")
    parser.add_argument("--window", default="-1:-1", help="left:right, -1 for an unbounded side")
    parser.add_argument("--softcap", type=float, default=0.0)
    parser.add_argument("--packed", action="store_true", help="packed sequences (flash_attn_varlen_func's layout)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    rows = []
    print(HEADER)
    for case in args.cases.split(","):
        head_dim, causal = (int(x) for x in case.split(":"))
        chosen = (LAUNCHED if args.launched else SCHEDULES)[tile_dim(head_dim)]
        for schedule in VARIANTS if args.all else (chosen,):
            row = measure(head_dim, bool(causal), schedule, fp8=args.fp8,
                          window=tuple(int(x) for x in args.window.split(":")), softcap=args.softcap,
                          packed=args.packed)
            rows.append(asdict(row))
            print(format_row(row))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
