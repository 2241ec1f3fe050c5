"""Kernel profile: what the compiled main loops do, counted offline (no GPU) for the calls that matter most.

    python -m tools.offline.profile [--json out.json] [--arch 90]

For plain bf16 attention (batch 2, 2048 tokens, 4 heads, head dim 64 and 128, causal and not), each kernel the call
launches is compiled through the real launcher for the target (``compile.py``) and its SASS read (``sass.py``):
registers, spills, shared memory, HGMMA instructions and groups and how many groups are waited on at once, TMA
copies, and the main loop's warp-instructions per score element (its length times the warps of a program,
divided by the BLOCK_M x BLOCK_N score elements one trip computes). Triton's own fused-attention tutorial runs its
forward at 0.24 (d=128, 128 x 128, 8 warps, sm_90); those counts are how a kernel change is judged before a GPU
is at hand, and ``tests/test_kernel_profile.py`` fails when one gets worse.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from flashattn.backends.spec import AttentionSpec, Saved
from flashattn.backends.triton import attend as backend
from flashattn.backends.triton import configs

from .compile import KernelCounts, compiled_launches, kernel_counts

MAIN_KERNELS = ("attention_forward_kernel", "attention_backward_dkdv_kernel", "attention_backward_dq_kernel")


@dataclass
class Profile(KernelCounts):
    kernel: str = ""
    arch: int = 0
    head_dim: int = 0
    causal: bool = False


def _plain_call(head_dim: int, causal: bool):
    """(q, k, v, spec) of plain bf16 self-attention: 2 x 2048 tokens, 4 heads."""
    q, k, v = (torch.empty(2, 2048, 4, head_dim, dtype=torch.bfloat16) for _ in range(3))
    return q, k, v, AttentionSpec(scale=head_dim**-0.5, window_right=0 if causal else -1)


def _launches(head_dim: int, causal: bool, arch: int) -> list:
    q, k, v, spec = _plain_call(head_dim, causal)
    out = torch.empty_like(q)
    lse = torch.empty(2, 4, 2048)
    saved = Saved(q, k, v, out, lse)

    def call():
        backend.forward(q, k, v, spec)
        backend.backward(torch.empty_like(out), None, saved, spec)

    with configs.tables_only():  # the tables' configs: their counts judge the code (measured ones their timing)
        return [c for c in compiled_launches(arch, call) if c.name in MAIN_KERNELS]


def profile(head_dim: int, causal: bool, arch: int = 90) -> list[Profile]:
    return [Profile(**asdict(kernel_counts(launch)), kernel=launch.name, arch=arch, head_dim=head_dim, causal=causal)
            for launch in _launches(head_dim, causal, arch)]


def report(head_dims=(64, 128), arch: int = 90, causals=(False, True)) -> list[Profile]:
    return [row for d in head_dims for causal in causals for row in profile(d, causal, arch)]


def format_rows(rows: list[Profile]) -> str:
    lines = [f"{'kernel':32} {'sm':>3} {'d':>4} {'causal':>6} {'tile':>8} {'warps':>5} {'stg':>3} {'regs':>4} "
             f"{'spill':>5} {'smem':>7} {'hgmma':>5} {'groups':>6} {'at once':>7} {'tma':>4} {'loop':>5} "
             f"{'inst/score':>10}"]
    for r in rows:
        lines.append(f"{r.kernel:32} {r.arch:3d} {r.head_dim:4d} {r.causal!s:>6} {r.block_m:>4}x{r.block_n:<3} "
                     f"{r.num_warps:5d} {r.num_stages:3d} {r.registers:4d} {r.spill_bytes:5d} {r.shared_bytes:7d} "
                     f"{r.hgmma:5d} {r.hgmma_groups:6d} {r.hgmma_waited_at_once:7d} {r.tma_loads:4d} "
                     f"{r.main_loop:5d} {r.per_score:10.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Offline counts of the Triton kernels' main loops (no GPU needed).")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--arch", type=int, default=90, choices=(80, 90), help="target architecture (sm_80 or sm_90)")
    p.add_argument("--head-dims", default="64,128", help="comma-separated head dims")
    p.add_argument("--causal", default="both", choices=("both", "true", "false"), help="causal masking")
    a = p.parse_args(argv)
    causals = (False, True) if a.causal == "both" else (a.causal == "true",)
    rows = report(tuple(int(d) for d in a.head_dims.split(",")), a.arch, causals)
    print(format_rows(rows))
    if a.json:
        Path(a.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
