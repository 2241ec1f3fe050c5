"""Kernel health report: compile every shipped kernel configuration offline for sm_80 and sm_90 (no GPU needed)
and read registers, spills and shared memory from the cubin, and whether Hopper's tensor-core instructions
(HGMMA, from wgmma) are used.

    python -m flashattn.backends.triton.health [--json out.json] [--head-dims 64,128]

Exit status 1 when a configuration spills, exceeds the target's shared memory, or (sm_90) has no HGMMA.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import configs, kernels

# Opt-in shared memory per block: A100 (sm_80) 163 KiB, H100 (sm_90) 227 KiB.
SHARED_LIMIT = {80: 166912, 90: 232448}
TARGETS = (80, 90)

POINTERS = {
    "Q": "in", "K": "in", "V": "in", "Out": "in", "DOut": "in", "DQ": "in", "DK": "in", "DV_": "in",
    "Probs": "in", "Mask": "in", "Lse": "fp32", "Delta": "fp32", "DLse": "fp32", "Alibi": "fp32", "Seed": "i64",
    "CuQ": "i32", "CuK": "i32", "KStart": "i32", "KEnd": "i32", "KBatch": "i32", "BlockTable": "i32",
}
FLOATS = {"scale", "softcap", "dropout_p"}
# Every feature a config of that weight may have to serve, all switched on: the worst case for registers.
VARIANT_FLAGS = {
    "light": dict(HAS_LEFT=True, HAS_RIGHT=True, HAS_SOFTCAP=True, HAS_ALIBI=True, MASK_KIND=kernels.MASK_NONE,
                  HAS_DROPOUT=False),
    "heavy": dict(HAS_LEFT=True, HAS_RIGHT=True, HAS_SOFTCAP=True, HAS_ALIBI=True, MASK_KIND=kernels.MASK_ADD,
                  HAS_DROPOUT=True),
}
# How the forward kernel finds keys, worst case per weight: light calls may read a paged cache for a packed q
# (paged varlen, flash_attn_with_kvcache); heavy ones (dropout, a mask) only dense or varlen keys.
FORWARD_KEYS = {
    "light": dict(Q_PACKED=True, K_RANGE=True, K_BATCH=True, PAGED=True),
    "heavy": dict(Q_PACKED=True, K_RANGE=True, K_BATCH=False, PAGED=False),
}
DECODE = "attention_forward_kernel[decode]"  # the forward with the few-rows table (configs.DECODE)
# wgmma works on 64-row warpgroup tiles; these head-dim-256 backward configs fit only 32-row tiles without
# spilling, so they run on mma.sync (HMMA).
HGMMA_EXEMPT = {
    *((DECODE, d, w) for d in (16, 32, 64, 128, 256) for w in configs.WEIGHTS),  # 16-row tiles: mma.sync
    ("attention_backward_dkdv_kernel", 256, "heavy"),
    ("attention_backward_dq_kernel", 256, "light"),
    ("attention_backward_dq_kernel", 256, "heavy"),
}


@dataclass
class Health:
    kernel: str
    arch: int
    head_dim: int
    variant: str  # the table's weight: light, heavy, fp32-light, fp32-heavy
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    registers: int
    spill_bytes: int
    shared_bytes: int
    hgmma: bool
    problems: list[str]


def _signature(fn, dtype: str, constexprs: dict) -> tuple[dict, dict, dict]:
    """Types of every argument as the runtime would specialise them: unit strides (``*_d``) become the
    constant 1, other integers are i32 with 16-divisibility hints like Triton gives aligned shapes."""
    sig, consts, attrs = {}, dict(constexprs), {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in POINTERS:
            kind = POINTERS[name]
            sig[name] = "*" + (dtype if kind == "in" else kind)
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOATS:
            sig[name] = "fp32"
        elif name.startswith("stride_") and name[-1] == "d":
            sig[name] = "constexpr"
            consts[name] = 1
        else:
            sig[name] = "i32"
            if name.startswith("stride_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


def _cuobjdump() -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def _inspect_cubin(cubin: bytes) -> tuple[int, int, bool]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([_cuobjdump(), "--dump-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    spills = int(re.search(r"STACK:(\d+)", usage).group(1)) + int(re.search(r"LOCAL:(\d+)", usage).group(1))
    return regs, spills, "HGMMA" in sass


def _shipped(head_dims):
    """(kernel, name, head_dim, weight, config) for every entry of the config tables with a head dim in
    ``head_dims``."""
    tables = ((kernels.attention_forward_kernel, "attention_forward_kernel", configs.FORWARD),
              (kernels.attention_forward_kernel, DECODE, configs.DECODE),
              (kernels.attention_backward_dkdv_kernel, "attention_backward_dkdv_kernel", configs.BACKWARD_DKDV),
              (kernels.attention_backward_dq_kernel, "attention_backward_dq_kernel", configs.BACKWARD_DQ))
    for fn, name, table in tables:
        for (d, weight), cfg in sorted(table.items()):
            if d in head_dims:
                yield fn, name, d, weight, cfg


def check_one(fn, head_dim: int, cfg: configs.KernelConfig, arch: int, variant: str, name: str | None = None
              ) -> Health:
    name = name or fn.__name__
    fp32 = variant.startswith("fp32-")
    dtype = "fp32" if fp32 else "fp16"
    weight = variant.removeprefix("fp32-")
    constexprs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=head_dim, BLOCK_DV=head_dim,
                      UPCAST=False, FP32_DOT=fp32, **VARIANT_FLAGS[weight])
    if "WRITE_PROBS" in fn.arg_names:  # the forward
        constexprs.update(WRITE_PROBS=False, **FORWARD_KEYS[weight])
    else:
        constexprs["IS_VARLEN"] = True
    sig, consts, attrs = _signature(fn, dtype, constexprs)
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    regs, spills, hgmma = _inspect_cubin(compiled.asm["cubin"])
    shared = compiled.metadata.shared
    problems = []
    if spills:
        problems.append(f"spills {spills} bytes")
    if shared > SHARED_LIMIT[arch]:
        problems.append(f"shared memory {shared} > {SHARED_LIMIT[arch]}")
    # IEEE fp32 matmuls do not run on tensor cores; fp16/bf16 ones must, where the tile allows.
    if arch == 90 and not fp32 and not hgmma and (name, head_dim, variant) not in HGMMA_EXEMPT:
        problems.append("no HGMMA (wgmma) instructions on sm_90")
    return Health(name, arch, head_dim, variant, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages,
                  regs, spills, shared, hgmma, problems)


def report(head_dims=(16, 32, 64, 128, 256)) -> list[Health]:
    return [check_one(fn, d, cfg, arch, variant, name) for fn, name, d, variant, cfg in _shipped(head_dims)
            for arch in TARGETS]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Compile the shipped Triton kernels for sm_80/sm_90 and report health.")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--head-dims", default="16,32,64,128,256", help="comma-separated padded head dims")
    a = p.parse_args(argv)
    rows = report(tuple(int(d) for d in a.head_dims.split(",")))
    print(f"{'kernel':34} {'sm':>3} {'d':>4} {'variant':10} {'tile':>8} {'warps':>5} {'stg':>3} {'regs':>4} "
          f"{'spill':>5} {'smem':>7} {'hgmma':>5}  problems")
    for r in rows:
        print(f"{r.kernel:34} {r.arch:3d} {r.head_dim:4d} {r.variant:10} {r.block_m:>4}x{r.block_n:<3} "
              f"{r.num_warps:5d} {r.num_stages:3d} {r.registers:4d} {r.spill_bytes:5d} {r.shared_bytes:7d} "
              f"{'yes' if r.hgmma else 'no':>5}  {'; '.join(r.problems) or 'ok'}")
    if a.json:
        Path(a.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 1 if any(r.problems for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
