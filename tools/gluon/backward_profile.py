"""Offline sm_90 counts of the Hopper tier's one-pass backward (``flashattn/backends/triton/hopper/backward.py``):
registers and their reallocation, spills (and whether any sits in a loop), shared memory, HGMMA, TMA loads, the
atomic reductions of dQ, and instructions per score in the consumers' unmasked loop.

    python -m tools.gluon.backward_profile [--causal] [--head-dim 64] [--window=100:0] [--softcap 30] [--packed]
                                           [--deterministic] [--json out]

``--window left:right`` (-1 for an unbounded side) and ``--softcap``: compiled for a sliding window and a softcap;
``--packed``: for packed sequences (``flash_attn_varlen_func``'s layout, the profile's batch as two sequences);
``--deterministic``: dQ's adds ordered on semaphores (``ordering``: the turns' acquires, fences, release adds).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from flashattn.backends.triton.hopper import tile_dim
from flashattn.backends.triton.hopper.backward import launch_arguments, semaphores_needed

PROFILE_SHAPE = (2, 2048, 4)  # batch, tokens, heads: the tl kernels' profile shape
CONSUMER_WARPS = 8
# S^T, dP^T, dV, dK, dQ: each wgmma its own commit group; at d=128 dQ is two (each warpgroup's dS^T)
GROUPS_PER_TILE = {64: 5, 128: 6, 256: 6}
SPIN_LENGTH = 32  # instructions of the deterministic kernels' wait for a turn (a poll in a loop of 23 on sm_90)
# Scores a tile: 128 keys x 64 queries (backward.py), 64 x 64 at d=256 (backward_wide.py)
SCORES_PER_TILE = {64: 128 * 64, 128: 128 * 64, 256: 64 * 64}


def measure(causal: bool, head_dim: int = 64, *, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
            packed: bool = False, deterministic: bool = False) -> dict:
    from tools.offline.compile import _offline, cubin_report

    (b, n, h), d = PROFILE_SHAPE, head_dim
    shape = (b * n, h, d) if packed else (b, n, h, d)
    q, k, v, dout = (torch.empty(shape, dtype=torch.bfloat16) for _ in range(4))
    stats = tuple(torch.empty((h, b * n) if packed else (b, h, n)) for _ in range(2))
    grads = (torch.empty(shape), torch.empty_like(k), torch.empty_like(v))
    varlen = {}
    if packed:
        offsets = torch.arange(0, b * n + 1, n, dtype=torch.int32)
        varlen = dict(cu_seqlens=(offsets, offsets), max_seqlen_k=n)
    jit, grid, kwargs = launch_arguments(q, k, v, dout, stats, grads, causal=causal, scale=d**-0.5, window=window,
                                         softcap=softcap, **varlen, dq_semaphores=torch.zeros(
                                             semaphores_needed(q, sequences=b if packed else 0), dtype=torch.int32)
                                         if deterministic else None)
    with _offline(90):
        kernel = jit.warmup(grid=grid, **kwargs)
    report = cubin_report(kernel.asm["cubin"])
    sass = report.sass
    loops = []
    every = sass.loops()
    for loop in every:  # the tile loops: with matmuls, nothing nested but a wait (deterministic: for a turn)
        nested = [other for other in every if loop.contains(other)]
        if not sass.count("HGMMA", loop) or any(other.length > SPIN_LENGTH or sass.count("HGMMA", other)
                                                for other in nested):
            continue
        body = sass.instructions[loop.start: loop.end + 1]
        groups = sum(ins.opcode.startswith("HGMMA") and "gsb0" in ins.operands for ins in body)
        if groups:
            loops.append({"length": loop.length, "groups": groups,
                          "local": sum(ins.opcode.startswith(("LDL", "STL")) for ins in body),
                          "red": sum(ins.opcode.startswith("RED") for ins in body)})
    tile = tile_dim(head_dim)
    lean = min((x for x in loops if x["groups"] == GROUPS_PER_TILE[tile]), key=lambda x: x["length"], default=None)
    return {
        "causal": causal, "head_dim": head_dim, "window": list(window), "softcap": softcap, "packed": packed,
        "deterministic": deterministic,
        "registers": report.registers, "spill_bytes": report.spill_bytes,
        "setmaxnreg": sorted({int(ins.operands.split(",")[-1], 16) for ins in sass.instructions
                              if ins.opcode.startswith("USETMAXREG")}),
        "shared_bytes": kernel.metadata.shared, "warps": kernel.metadata.num_warps, "hgmma": sass.count("HGMMA"),
        "tma_loads": sass.count("UTMALDG"), "loops": loops,
        # deterministic: the turns' acquires (a load, then L1 invalidated), the fences before the release adds, the adds
        "ordering": [sass.count("CCTL.IVALL"), sass.count("MEMBAR.ALL.GPU"), sass.count("REDG.E.ADD.STRONG.GPU")],
        "per_score": round(lean["length"] * CONSUMER_WARPS / SCORES_PER_TILE[tile], 3) if lean else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Offline sm_90 counts of the Hopper tier's one-pass backward.")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--head-dim", type=int, default=64, help="a multiple of 8 up to 256")
    parser.add_argument("--window", default="-1:-1", help="left:right, -1 for an unbounded side")
    parser.add_argument("--softcap", type=float, default=0.0)
    parser.add_argument("--packed", action="store_true", help="packed sequences (varlen)")
    parser.add_argument("--deterministic", action="store_true", help="dQ's adds ordered (semaphores)")
    parser.add_argument("--json", help="write the row here")
    args = parser.parse_args(argv)
    row = measure(args.causal, args.head_dim, window=tuple(int(x) for x in args.window.split(":")),
                  softcap=args.softcap, packed=args.packed,
                  deterministic=args.deterministic)
    print(json.dumps(row))
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
