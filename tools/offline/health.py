"""Kernel health report: compile every shipped kernel configuration offline for every architecture of every GPU
family (NVIDIA sm_75, 80, 86, 89, 90, 100, 120; AMD gfx90a, gfx942, gfx1100; no GPU needed), through the real
launcher, and read registers, spills and shared memory from the binary, and which matrix instructions the matmuls
use.

    python -m tools.offline.health [--json out.json] [--head-dims 64,128] [--archs 86,89,gfx942] [--jobs 8]
                                   [--search] [--block-masks without|with|both]

The kernels are compiled exactly as a call would launch them (``launch.compile_only``: the same keyword arguments,
so the runtime's specialization of aligned pointers, unit strides and divisible sizes), for a representative call
per table entry with every feature its weight may serve switched on: the worst case for registers. Exit status 1
when a configuration spills inside a loop (AMD: spills VGPRs to scratch memory at all), exceeds the target's shared
memory (AMD: LDS), or its fp16/bf16 matmuls miss the family's matrix instructions: any at all (HMMA on Turing to
consumer Blackwell, MFMA on CDNA, WMMA on RDNA 3), and where a warpgroup tile fits, wgmma (HGMMA) on sm_90 and tcgen05
(UTC*MMA) on sm_100.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from flashattn.backends.spec import AttentionSpec, BlockSparse, KeyCache, Saved, Varlen
from flashattn.backends.triton import attend as backend
from flashattn.backends.triton import configs
from flashattn.backends.triton import tables as config_tables
from flashattn.backends.triton.families import Arch, arch_name, vendor
from flashattn.backends.triton.launch import takes_measured

from .compile import SHARED_LIMIT, TARGETS, KernelCounts, compiled_launches, kernel_counts

# dkdv_one_pass: the dK/dV kernel as the one-pass backward compiles it (configs.one_pass_backward)
TABLES = ("forward", "decode", "dkdv", "dq", "dkdv_one_pass")
KERNEL_OF = {"forward": "attention_forward_kernel", "decode": "attention_forward_kernel[decode]",
             "dkdv": "attention_backward_dkdv_kernel", "dq": "attention_backward_dq_kernel",
             "dkdv_one_pass": "attention_backward_dkdv_kernel[one-pass]"}
# wgmma and tcgen05 work on 64-row (and larger) tiles; these configs fit only smaller tiles without spilling, so
# they run on mma.sync (HMMA): decode's 16-row tiles, and head dim 256 in the backward (dK and dV of 64 keys x 256
# dims are 256 fp32 registers a thread in one warpgroup; 8 warps split them but compute S^T twice).
WARPGROUP_EXEMPT = {
    *(("decode", d, w) for d in (16, 32, 64, 128, 256) for w in configs.WEIGHTS),
    *((table, 256, w) for w in configs.WEIGHTS for table in ("dkdv", "dkdv_one_pass")),
    *((table, 128, "heavy") for table in ("dkdv", "dkdv_one_pass")),  # dropout's bits and a mask tile: 16 x 16
    ("dq", 256, "heavy"),
}
# The warpgroup-wide tensor-core instruction of a family, as KernelCounts counts it.
WARPGROUP_MMA = {"sm90": ("hgmma", "HGMMA (wgmma)"), "sm100": ("tcgen05", "UTC*MMA (tcgen05)")}


@dataclass
class Health(KernelCounts):
    kernel: str = ""
    arch: Arch = 0
    head_dim: int = 0
    head_dim_v: int = 0  # v's head dim (the same as head_dim unless the entry is a (d, dv) pair)
    variant: str = ""  # the table's weight: plain, light, heavy, fp32-light, fp32-heavy
    block_mask: bool = False  # the kernel walking a block mask's tile lists (forward, dK/dV, dQ)
    call: str = "laden"  # the call's specialization (CALLS)
    measured: bool = False  # the config is the family's measured entry (configs.MEASURED), timed on the GPU
    problems: list[str] = dataclasses.field(default_factory=list)


# The calls compiled per table. "laden": every feature a call of the entry's weight may use at once, the worst case
# for registers. The others are the specializations users launch, which the compiler pipelines differently (a
# dense forward's contiguous loads stream through more shared memory than a paged one's): "dense" (no band),
# "causal" (a band), "varlen" (packed sequences), "paged" (keys in a paged KV cache).
CALLS = {"forward": ("laden", "dense", "causal", "varlen", "paged"), "decode": ("laden", "dense"),
         "dkdv": ("laden", "dense", "varlen"), "dq": ("laden", "dense", "varlen"),
         "dkdv_one_pass": ("laden", "dense", "varlen")}


def _spec(table: str, weight: str, tensors: dict, block_mask: bool, call: str = "laden") -> AttentionSpec:
    """The call's features. "laden": every feature a call of this weight may use: plain calls the band both sides
    (and, for the forward, keys in a paged KV cache or packed); light ones softcap and ALiBi too (fp32-light serves
    plain calls as well); heavy ones dropout and an additive mask on top. With ``block_mask`` the tiles of a block
    mask (dense calls; its partial tiles take the additive mask's place). The other calls (``CALLS``) keep the
    weight's features and change only the layout and the band."""
    band = {"window_left": 64, "window_right": 0} if call in ("laden", "causal") else {}
    spec = AttentionSpec(scale=0.125, **band)
    if weight != "plain":
        spec = dataclasses.replace(spec, softcap=30.0, alibi_slopes=tensors["alibi"])
    if block_mask:
        spec = dataclasses.replace(spec, block_sparse=tensors["blocks"])
        heavy = {"dropout_p": 0.1, "seed": tensors["seed"]} if weight.endswith("heavy") else {}
        return dataclasses.replace(spec, **heavy)
    if weight.endswith("heavy"):
        return dataclasses.replace(spec, dropout_p=0.1, seed=tensors["seed"], attn_mask=tensors["mask"])
    if call == "laden" and table in ("forward", "decode") or call == "paged":
        return dataclasses.replace(spec, varlen=tensors["varlen"], cache=tensors["cache"])
    if call == "varlen":
        return dataclasses.replace(spec, varlen=tensors["varlen"])
    if call == "dense" and table == "decode":
        return dataclasses.replace(spec, cache=tensors["dense_cache"])
    return spec


HeadDims = int | tuple[int, int]  # a padded table head dim, or a (q/k, v) pair served by its padded maximum's entry


def _dims(head_dim: HeadDims) -> tuple[int, int, int]:
    """(d, dv, the table key) of an entry's head dims."""
    d, dv = head_dim if isinstance(head_dim, tuple) else (head_dim, head_dim)
    return d, dv, configs.table_key(d, dv)


def _causal_blocks(nq: int, nk: int, block: int = 128) -> BlockSparse:
    """A bottom-right causal block mask of FlexAttention's default 128 x 128 blocks: tiles the diagonal crosses
    partial, those below it full."""
    rows, cols = -(-nq // block) * block, -(-nk // block) * block
    allowed = torch.arange(rows)[:, None] + nk - nq >= torch.arange(cols)[None, :]
    tiles = allowed.view(rows // block, block, cols // block, block).transpose(1, 2)
    kind = torch.where(tiles.all((-1, -2)), 2, torch.where(tiles.any((-1, -2)), 1, 0)).to(torch.uint8)
    partial_id = torch.where(kind == 1, torch.cumsum((kind == 1).flatten(), 0).view(kind.shape) - 1, -1)
    return BlockSparse(kind[None, None], partial_id[None, None].to(torch.int32), tiles[kind == 1].contiguous(),
                       block, block)


def _inputs(table: str, weight: str, head_dim: HeadDims, block_mask: bool = False, call: str = "laden"):
    """(q, k, v, spec) of a representative call: 2 sequences of 256 tokens (1 query for decode), 4:2 heads."""
    d, dv, _ = _dims(head_dim)
    dtype = torch.float32 if weight.startswith("fp32") else torch.float16
    b, h, hk, n = 2, 4, 2, 256
    nq = 1 if table == "decode" else n
    cu_q = torch.arange(0, (b + 1) * nq, nq, dtype=torch.int32)
    page = 16
    tensors = {
        "alibi": torch.rand(1, h),
        "seed": torch.zeros(1, dtype=torch.int64),
        "mask": torch.zeros(b, h, nq, n, dtype=dtype),
        "varlen": Varlen(cu_q, cu_q, nq, n),
        # num_splits=0 as flash_attn_with_kvcache's default: a decode call splits its keys (the merge in the launch).
        "cache": KeyCache(torch.zeros(b, dtype=torch.int32), torch.full((b,), n, dtype=torch.int32), n,
                          block_table=torch.arange(b * n // page, dtype=torch.int32).view(b, -1), num_splits=0),
        "dense_cache": KeyCache(torch.zeros(b, dtype=torch.int32), torch.full((b,), n, dtype=torch.int32), n,
                                num_splits=0),
        "blocks": _causal_blocks(nq, n),
    }
    spec = _spec(table, weight, tensors, block_mask, call)
    if spec.varlen is not None and spec.cache is not None:  # packed q; a paged cache of (pages, page size, heads, dim)
        q = torch.empty(b * nq, h, d, dtype=dtype)
        k, v = (torch.empty(b * n // page, page, hk, dim, dtype=dtype) for dim in (d, dv))
    elif spec.varlen is not None:  # packed q, k and v
        q = torch.empty(b * nq, h, d, dtype=dtype)
        k, v = (torch.empty(b * n, hk, dim, dtype=dtype) for dim in (d, dv))
    else:
        q = torch.empty(b, nq, h, d, dtype=dtype)
        k, v = (torch.empty(b, n, hk, dim, dtype=dtype) for dim in (d, dv))
    return q, k, v, spec


def _compile(table: str, weight: str, head_dim: HeadDims, arch: Arch, block_mask: bool, call: str = "laden"
             ) -> object:
    """The compiled kernel that serves (table, head dim, weight) on ``arch`` for ``call``, through the backend's
    own launch path."""
    q, k, v, spec = _inputs(table, weight, head_dim, block_mask, call)

    def call():
        if table in ("forward", "decode"):
            return backend.forward(q, k, v, spec)
        out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1])
        return backend.backward(torch.empty_like(out), None, Saved(q, k, v, out, lse), spec)

    name = KERNEL_OF[table].split("[")[0]
    with configs.backward_passes("one-pass" if table == "dkdv_one_pass" else "two-pass"):
        return next(c for c in compiled_launches(arch, call) if c.name == name)


def _table_of(kernel: str) -> str:
    return next(t for t, name in KERNEL_OF.items() if name == kernel)


def check_one(table: str, head_dim: HeadDims, variant: str, arch: Arch,
              cfg: configs.KernelConfig | None = None, *, block_mask: bool = False, call: str = "laden") -> Health:
    """Compile (table, head dim, variant) for ``arch`` with the config its family ships (or ``cfg``) and judge it.
    ``head_dim`` is a padded head dim, or a (q/k, v) pair of head dims served by its padded maximum's entry;
    ``block_mask``: the kernel as it walks a block mask's tiles; ``call``: which of the table's ``CALLS``."""
    d, dv, key = _dims(head_dim)
    dense = takes_measured(_inputs(table, variant, head_dim, block_mask, call)[3])  # as the launcher decides
    served = configs.lookup(table, arch, key, variant, block_mask=block_mask, measured=dense)
    measured = cfg is None and served != configs.lookup(table, arch, key, variant, block_mask=block_mask,
                                                        measured=False)
    cfg = cfg or served
    try:
        with configs.use(cfg, kernels=(table,)):  # through the real launch path, this kernel with this tile
            counts = kernel_counts(_compile(table, variant, head_dim, arch, block_mask, call))
    except Exception as err:  # a config the compiler rejects (Triton's AMD backend fails on a few): unhealthy
        counts = KernelCounts(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                              0, 0.0)
        failure = (str(err).strip().splitlines() or [""])[-1][:200]
        return Health(**dataclasses.asdict(counts), kernel=KERNEL_OF[table], arch=arch, head_dim=d, head_dim_v=dv,
                      variant=variant, block_mask=block_mask, call=call, measured=measured,
                      problems=[f"does not compile: {type(err).__name__}: {failure}"])
    problems = []
    if vendor(arch) == "hip":
        if counts.loop_spills and counts.spill_bytes:  # CDNA spills VGPRs into AGPRs first, which costs no memory
            problems.append(f"spills {counts.loop_spills} VGPRs, {counts.spill_bytes} bytes of them to scratch")
    # Spilled before the loops and reloaded after them is a few instructions, not a problem; in a measured entry's
    # loops the GPU timed the config, spills and all, faster than the table's (tools.gpu_tune), so they are shown,
    # not failed.
    elif counts.loop_spills and not measured:
        problems.append(f"spills {counts.spill_bytes} bytes, {counts.loop_spills} local loads/stores in loops")
    if counts.shared_bytes > SHARED_LIMIT[arch]:
        problems.append(f"shared memory {counts.shared_bytes} > {SHARED_LIMIT[arch]}")
    problems += _tensor_core_problems(counts, table, key, variant, arch)
    return Health(**dataclasses.asdict(counts), kernel=KERNEL_OF[table], arch=arch, head_dim=d, head_dim_v=dv,
                  variant=variant, block_mask=block_mask, call=call, measured=measured, problems=problems)


def _tensor_core_problems(counts: KernelCounts, table: str, key: HeadDims, variant: str, arch: Arch) -> list[str]:
    """IEEE fp32 matmuls do not run on tensor cores; fp16/bf16 ones must from sm_80 on (below, Triton has no
    tensor-core path), on the family's warpgroup-wide instructions where the tile allows, and on AMD's matrix
    instructions (MFMA on CDNA, WMMA on RDNA 3)."""
    if variant.startswith("fp32"):
        return []
    if vendor(arch) == "hip":
        return [] if counts.mfma or counts.wmma else [f"no MFMA or WMMA instructions on {arch}"]
    if arch < TENSOR_CORES_FROM:
        return []
    if not (counts.hmma or counts.hgmma or counts.tcgen05):
        return [f"no tensor-core instructions on sm_{arch}"]
    wide = WARPGROUP_MMA.get(configs.family(arch).name)
    largest = max(key) if isinstance(key, tuple) else key
    if wide and not getattr(counts, wide[0]) and (table, largest, variant) not in WARPGROUP_EXEMPT:
        return [f"no {wide[1]} instructions on sm_{arch}"]
    return []


# Triton lowers tl.dot to tensor cores from sm_80 on; below, to FMA, whose operands and products sit in registers
# tile by tile: the search tries tiles of at most 64 x 64 there.
TENSOR_CORES_FROM = 80
FMA_TILE_AREA = 64 * 64


def _candidates(cfg: configs.KernelConfig, arch: Arch) -> list[configs.KernelConfig]:
    """Configs to try instead of an unhealthy ``cfg``: its own tile with other warps and stages first, then ever
    smaller tiles; within a tile, deeper pipelines first."""
    sizes = (16, 32, 64, 128)
    matrix_units = vendor(arch) == "hip" or arch >= TENSOR_CORES_FROM
    area = cfg.block_m * cfg.block_n if matrix_units else min(cfg.block_m * cfg.block_n, FMA_TILE_AREA)
    tiles = sorted(((m, n) for m in sizes for n in sizes if m * n <= area),
                   key=lambda t: ((t != (cfg.block_m, cfg.block_n)), -t[0] * t[1], -min(t)))
    warps = (cfg.num_warps, 12 - cfg.num_warps)  # 4 <-> 8
    # AMD's software pipeliner streams with 2 stages (1: none); deeper ones only add LDS.
    stages = (2, 1) if vendor(arch) == "hip" else (3, 2, 1)
    return [configs.KernelConfig(m, n, w, s) for m, n in tiles for s in stages for w in warps
            if configs.KernelConfig(m, n, w, s) != cfg]


def search(table: str, head_dim: HeadDims, variant: str, arch: Arch, block_mask: bool = False
           ) -> configs.KernelConfig | None:
    """The first of ``_candidates`` healthy on ``arch`` in every call of the table, for an entry whose shipped
    config is not."""
    shipped = configs.lookup(table, arch, _dims(head_dim)[2], variant, block_mask=block_mask)
    calls = calls_of(table, variant, block_mask)
    for cfg in _candidates(shipped, arch):
        if not any(check_one(table, head_dim, variant, arch, cfg, block_mask=block_mask, call=call).problems
                   for call in calls):
            return cfg
    return None


def calls_of(table: str, variant: str, block_mask: bool) -> tuple[str, ...]:
    """The calls an entry is compiled in: a block mask's are dense; a heavy weight's additive mask is a dense
    call's, so its layouts collapse to laden (the band) and dense."""
    if block_mask:
        return ("laden",)
    return ("laden", "dense") if variant.endswith("heavy") else CALLS[table]


def _check(entry: tuple) -> Health:
    *args, block_mask, call = entry
    return check_one(*args, block_mask=block_mask, call=call)


def _search(entry: tuple) -> tuple[tuple, configs.KernelConfig | None]:
    return entry, search(*entry)


def _map(fn, entries: list[tuple], jobs: int) -> list:
    """``fn`` over ``entries``, in ``jobs`` processes (compiling is single-threaded; spawned, not forked, so each
    starts with a clean Triton driver)."""
    if jobs <= 1:
        return [fn(e) for e in entries]
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        return pool.map(fn, entries, chunksize=1)


def served(table: str, head_dim: HeadDims, arch: Arch, variant: str = "plain", block_mask: bool = False) -> bool:
    """Whether the triton path launches ``table``'s kernel for these head dims and weight on ``arch``, plain or
    walking a block mask (the family's ``max_head_dim``, ``max_grad_head_dim``, ``max_block_mask_head_dim`` and
    ``fp32``, and ``tables.DECLINED`` on the installed Triton); entries it does not serve only fill a table."""
    fam, largest = configs.family(arch), max(_dims(head_dim)[:2])
    if variant.startswith("fp32") and not fam.fp32 or largest > fam.max_head_dim:
        return False
    if block_mask and largest > fam.max_block_mask_head_dim:
        return False
    declined = config_tables.DECLINED.get(fam.name, set())  # no tile compiles on the installed Triton
    if (table, configs.padded_head_dim(largest), variant) in declined:
        return False
    if table == "dkdv_one_pass" and (block_mask or not configs.one_pass_tiles(arch, largest, variant)):
        return False  # where the one-pass backward never runs (configs.one_pass_backward)
    return table not in ("dkdv", "dq", "dkdv_one_pass") or largest <= fam.max_grad_head_dim


def report(head_dims: tuple[HeadDims, ...] = (16, 32, 64, 128, 256), *, tables=TABLES, variants=configs.WEIGHTS,
           archs: tuple[Arch, ...] = TARGETS, jobs: int = 1, block_masks: tuple[bool, ...] = (False,),
           calls: tuple[str, ...] = ("laden", "dense", "causal", "varlen", "paged")) -> list[Health]:
    """Health rows of every (table, head dim, variant, target, call), once per ``block_masks`` entry (False: the
    plain kernels, in each of the table's ``CALLS`` among ``calls``; True: as they walk a block mask, laden)."""
    entries = [(table, d, variant, arch, sparse, call) for sparse in block_masks for table in tables
               for d in head_dims for variant in variants for arch in archs if served(table, d, arch, variant, sparse)
               for call in calls_of(table, variant, sparse) if call in calls]
    return _map(_check, entries, jobs)


def format_rows(rows: list[Health]) -> str:
    lines = [f"{'kernel':40} {'arch':>7} {'d':>7} {'variant':10} {'tile':>8} {'warps':>5} {'stg':>3} {'regs':>4} "
             f"{'spill':>5} {'in loop':>7} {'smem':>7} {'hgmma':>5} {'mfma':>5} {'wmma':>5} {'at once':>7} {'tma':>3} "
             f"{'inst/score':>10} {'call':>6}  problems"]
    for r in rows:
        dims = str(r.head_dim) if r.head_dim_v in (0, r.head_dim) else f"{r.head_dim}/{r.head_dim_v}"
        kernel = r.kernel + ("[block mask]" if r.block_mask else "")
        lines.append(f"{kernel:40} {arch_name(r.arch):>7} {dims:>7} {r.variant:10} {r.block_m:>4}x{r.block_n:<3} "
                     f"{r.num_warps:5d} {r.num_stages:3d} {r.registers:4d} {r.spill_bytes:5d} {r.loop_spills:7d} "
                     f"{r.shared_bytes:7d} {r.hgmma:5d} {r.mfma:5d} {r.wmma:5d} {r.hgmma_waited_at_once:7d} "
                     f"{r.tma_loads:3d} {r.per_score:10.3f} {r.call:>6}  {'; '.join(r.problems) or 'ok'}"
                     + (" (measured on a GPU)" if r.measured else ""))
    return "\n".join(lines)


def _parse_arch(text: str) -> Arch:
    return text if text.startswith("gfx") else int(text)


def _parse_dims(text: str) -> HeadDims:
    d, _, dv = text.partition(":")
    return (int(d), int(dv)) if dv else int(d)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Compile the shipped Triton kernels for every GPU family offline and "
                                            "report their health.")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--head-dims", default="16,32,64,128,256",
                   help="comma-separated padded head dims, or q/k:v pairs such as 192:128")
    p.add_argument("--tables", default=",".join(TABLES), help="comma-separated tables")
    p.add_argument("--variants", default=",".join(configs.WEIGHTS), help="comma-separated weights")
    p.add_argument("--archs", default=",".join(map(str, TARGETS)),
                   help="comma-separated architectures: 10 x major + minor (NVIDIA) or gfx names (AMD)")
    p.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    p.add_argument("--search", action="store_true", help="for each unhealthy entry, find a healthy config")
    p.add_argument("--block-masks", choices=("without", "with", "both"), default="without",
                   help="the plain kernels, the kernels walking a block mask, or both")
    p.add_argument("--calls", default="laden,dense,causal,varlen,paged",
                   help="comma-separated specializations, each where its table has it: laden (every feature of the "
                        "weight), dense, causal, varlen, paged")
    a = p.parse_args(argv)
    block_masks = {"without": (False,), "with": (True,), "both": (False, True)}[a.block_masks]
    rows = report(tuple(_parse_dims(d) for d in a.head_dims.split(",")), tables=a.tables.split(","),
                  variants=a.variants.split(","), archs=tuple(_parse_arch(x) for x in a.archs.split(",")), jobs=a.jobs,
                  block_masks=block_masks, calls=tuple(a.calls.split(",")))
    if a.search:
        unhealthy = list(dict.fromkeys((_table_of(r.kernel), (r.head_dim, r.head_dim_v), r.variant, r.arch,
                                        r.block_mask) for r in rows if r.problems))
        for (table, d, variant, arch, sparse), found in _map(_search, unhealthy, a.jobs):
            print(f"{table}{' [block mask]' if sparse else ''} {arch_name(arch)} d={d} {variant}: {found}", flush=True)
    print(format_rows(rows))
    if a.json:
        Path(a.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 1 if any(r.problems for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
