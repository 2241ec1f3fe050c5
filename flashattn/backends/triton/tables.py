"""The kernel configs every GPU family ships: tile shapes, warps and pipeline stages, as data.

``TABLES[family][kernel]`` is keyed by (padded head dim, weight): "plain" calls use at most the causal/window band;
"light" ones add softcap or ALiBi; "heavy" ones add dropout (Philox costs registers per score element) or a user
mask tile; the "fp32-" weights serve fp32 inputs (IEEE fp32 matmuls: twice the bytes per tile, no tensor cores, so
small tiles). ``OVERRIDES[family][kernel]`` holds the entries that differ from the table for a (q/k, v) head-dim
pair or a kernel walking a block mask. sm75 (FMA matmuls), sm80 and sm90 are written out; the other families
(``families.py``) are one of them with the entries their health search changed (``_derived``): less shared memory
(sm86, sm120: 99 KiB), other tensor-core instructions (sm100), or AMD's compiler and register files (cdna2,
cdna3 from sm80; rdna3 from sm75).

Every entry compiles, for every architecture of its family, without register spills inside its loops, within
shared memory, and on the family's tensor-core instructions where the tile allows: ``python -m tools.offline.health``
checks that, and tests rerun it. The sm90 plain and light entries have the fewest main-loop instructions per score
element among the healthy; the others are the first healthy config of the health report's search (``--search``).
Tune here, then rerun both.

The kernels' tiles: forward and dQ, BLOCK_M queries per program by BLOCK_N keys per step; dK/dV, BLOCK_N keys per
program (the M dimension of all its matmuls, on the transposed tile S^T) by BLOCK_M queries per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import installed_release


@dataclass(frozen=True, repr=False)
class KernelConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    split_d: int = 1  # dK/dV: programs a key block's head dim is split over (each sums dK, dV of its columns)

    def __repr__(self) -> str:  # split_d only where it is used: the four numbers otherwise, as they are written
        split = f", split_d={self.split_d}" if self.split_d != 1 else ""
        return (f"KernelConfig(block_m={self.block_m}, block_n={self.block_n}, num_warps={self.num_warps}, "
                f"num_stages={self.num_stages}{split})")


WEIGHTS = ("plain", "light", "heavy", "fp32-light", "fp32-heavy")
KERNELS = ("forward", "decode", "dkdv", "dq", "dkdv_one_pass")

def _table(rows: dict[int, tuple[KernelConfig, ...]]) -> dict[tuple[int, str], KernelConfig]:
    """{head_dim: (plain, light, heavy, fp32-light, fp32-heavy)} -> {(head_dim, weight): config}."""
    return {(d, weight): cfg for d, cfgs in rows.items() for weight, cfg in zip(WEIGHTS, cfgs, strict=True)}


Table = dict[str, dict[tuple[int, str], KernelConfig]]
Overrides = dict[str, dict[tuple[int | tuple[int, int], str, bool], KernelConfig]]
C = KernelConfig
# Ampere. Decode (few query rows: a decode step, or its GQA group walked as rows): 16-row tiles, the smallest
# tensor-core tile, and long key tiles with deep pipelines, since the kernel is bound by reading K and V.
_SM80 = {
    "forward": _table({
        16: (C(128, 64, 4, 3), C(128, 64, 4, 3), C(128, 64, 8, 2), C(64, 32, 8, 1), C(64, 32, 8, 1)),
        32: (C(128, 64, 4, 3), C(128, 64, 4, 3), C(128, 64, 8, 1), C(128, 16, 4, 3), C(64, 32, 8, 3)),
        64: (C(128, 64, 8, 3), C(128, 64, 8, 3), C(32, 128, 8, 3), C(32, 32, 8, 1), C(32, 32, 4, 2)),
        128: (C(128, 64, 8, 1), C(128, 64, 8, 1), C(64, 32, 4, 2), C(16, 32, 8, 3), C(16, 16, 4, 3)),
        256: (C(64, 32, 8, 2), C(64, 32, 8, 2), C(64, 32, 8, 2), C(64, 16, 8, 1), C(16, 32, 4, 1)),
    }),
    "decode": _table({
        16: (C(16, 128, 4, 3), C(16, 128, 4, 3), C(16, 64, 2, 3), C(16, 64, 4, 2), C(16, 32, 4, 2)),
        32: (C(16, 128, 4, 3), C(16, 128, 8, 3), C(16, 64, 4, 2), C(16, 64, 4, 3), C(16, 32, 2, 3)),
        64: (C(16, 128, 4, 3), C(16, 128, 4, 3), C(16, 64, 4, 2), C(16, 64, 4, 3), C(16, 32, 4, 3)),
        128: (C(16, 64, 8, 3), C(16, 64, 4, 3), C(16, 64, 4, 2), C(16, 16, 4, 2), C(16, 32, 4, 3)),
        256: (C(16, 32, 4, 3), C(16, 32, 4, 3), C(16, 32, 8, 3), C(16, 32, 4, 1), C(16, 16, 4, 1)),
    }),
    "dkdv": _table({
        16: (C(64, 64, 4, 1), C(32, 128, 8, 2), C(16, 128, 8, 2), C(32, 16, 4, 3), C(32, 32, 8, 2)),
        32: (C(32, 128, 8, 2), C(32, 128, 8, 1), C(64, 16, 8, 3), C(16, 32, 4, 3), C(16, 32, 4, 1)),
        64: (C(64, 32, 8, 3), C(64, 32, 8, 3), C(16, 16, 4, 1), C(16, 64, 4, 1), C(16, 16, 4, 1)),
        128: (C(64, 32, 8, 1), C(64, 32, 8, 1), C(16, 16, 4, 1), C(16, 64, 8, 1), C(32, 16, 4, 1)),
        256: (C(32, 16, 4, 1), C(32, 16, 4, 1), C(16, 16, 8, 1), C(16, 16, 4, 1), C(16, 16, 4, 1)),
    }),
    "dq": _table({
        16: (C(64, 64, 4, 2), C(64, 64, 4, 2), C(64, 64, 8, 2), C(64, 32, 4, 2), C(64, 32, 4, 1)),
        32: (C(64, 64, 4, 2), C(64, 64, 4, 2), C(64, 64, 8, 2), C(128, 16, 8, 3), C(64, 16, 4, 2)),
        64: (C(128, 32, 8, 3), C(128, 32, 8, 3), C(64, 32, 4, 2), C(64, 32, 8, 1), C(128, 16, 8, 3)),
        128: (C(128, 32, 8, 1), C(128, 32, 8, 1), C(128, 16, 8, 3), C(64, 16, 4, 3), C(32, 32, 8, 1)),
        256: (C(32, 32, 8, 1), C(32, 32, 8, 1), C(32, 64, 8, 1), C(16, 16, 4, 3), C(16, 16, 4, 1)),
    }),
}
# Hopper: fp16/bf16 tiles sized for wgmma and TMA, chosen by main-loop instructions per score element among those
# that do not spill. dK/dV runs one pipeline stage: a second holds about 85 more registers (d=64: 168 -> 253) and
# spills at d=128, so there 2-3 programs per multiprocessor hide the loads instead.
_SM90 = {
    "forward": _table({
        16: (C(128, 128, 8, 2), C(128, 128, 8, 2), C(128, 64, 8, 2), C(64, 32, 8, 1), C(64, 32, 8, 3)),
        32: (C(128, 128, 8, 2), C(128, 128, 8, 2), C(128, 64, 8, 2), C(128, 16, 4, 3), C(64, 32, 8, 3)),
        64: (C(128, 128, 8, 2), C(128, 128, 8, 2), C(128, 64, 8, 1), C(32, 32, 8, 1), C(32, 32, 4, 2)),
        128: (C(128, 128, 8, 2), C(128, 64, 8, 2), C(128, 32, 8, 3), C(16, 32, 8, 2), C(16, 16, 4, 1)),
        256: (C(128, 32, 8, 2), C(128, 32, 8, 2), C(64, 32, 8, 3), C(64, 16, 8, 1), C(16, 32, 4, 1)),
    }),
    "decode": _table({
        16: (C(16, 128, 4, 3), C(16, 128, 4, 3), C(16, 64, 2, 3), C(16, 64, 4, 2), C(16, 32, 4, 2)),
        32: (C(16, 128, 4, 3), C(16, 128, 4, 3), C(16, 64, 4, 2), C(16, 64, 4, 3), C(16, 32, 2, 3)),
        64: (C(16, 128, 4, 3), C(16, 128, 4, 3), C(16, 64, 4, 2), C(16, 64, 4, 3), C(16, 32, 4, 3)),
        128: (C(16, 64, 4, 3), C(16, 64, 4, 3), C(16, 64, 4, 2), C(16, 16, 4, 3), C(16, 32, 8, 2)),
        256: (C(16, 32, 4, 3), C(16, 32, 4, 3), C(16, 32, 4, 3), C(16, 32, 4, 1), C(16, 16, 4, 1)),
    }),
    "dkdv": _table({
        16: (C(32, 64, 4, 1), C(32, 64, 4, 1), C(32, 64, 8, 2), C(32, 16, 4, 3), C(32, 32, 8, 2)),
        32: (C(32, 64, 4, 1), C(32, 64, 4, 1), C(16, 128, 8, 1), C(16, 32, 4, 3), C(16, 32, 8, 3)),
        64: (C(32, 64, 4, 1), C(32, 64, 4, 1), C(16, 64, 8, 3), C(16, 64, 4, 1), C(32, 32, 4, 1)),
        128: (C(32, 64, 4, 1), C(16, 64, 4, 1), C(16, 16, 4, 1), C(16, 64, 8, 1), C(32, 16, 4, 1)),
        256: (C(32, 16, 4, 1), C(32, 16, 4, 1), C(16, 16, 8, 1), C(16, 16, 4, 1), C(16, 16, 4, 1)),
    }),
    "dq": _table({
        16: (C(128, 64, 8, 2), C(128, 64, 8, 2), C(64, 64, 4, 2), C(64, 32, 4, 2), C(64, 32, 4, 1)),
        32: (C(128, 64, 8, 2), C(128, 64, 8, 2), C(64, 32, 4, 2), C(128, 16, 8, 3), C(64, 16, 4, 2)),
        64: (C(128, 128, 8, 2), C(128, 128, 8, 2), C(64, 32, 4, 2), C(64, 32, 8, 1), C(128, 16, 8, 3)),
        128: (C(128, 64, 8, 3), C(128, 64, 8, 3), C(64, 32, 8, 3), C(64, 16, 4, 3), C(32, 32, 8, 3)),
        256: (C(64, 32, 4, 2), C(64, 16, 4, 2), C(16, 16, 4, 1), C(16, 16, 4, 3), C(16, 16, 4, 1)),
    }),
}
# Turing: Triton lowers tl.dot to FMA below sm_80, which holds operand tiles and products in registers: small
# tiles within 64 KiB of shared memory, 8 warps where fp16/bf16 operands spill with 4 (their conversions double the
# live values). The backward serves head dims up to 64 there (``families.Family.max_grad_head_dim``): from 128 on,
# dK/dV spills at every tile down to 16 x 16 (fp16), or needs more than 64 KiB (fp32 at 256); its entries for 128
# and 256 only fill the table.
_SM75_ROWS = {  # head dim: (fp16/bf16 weights, fp32 weights)
    "forward": {16: (C(64, 32, 4, 2),) * 2, 32: (C(64, 32, 4, 2),) * 2, 64: (C(32, 32, 4, 2),) * 2,
                128: (C(32, 32, 8, 1), C(32, 32, 4, 1)), 256: (C(16, 32, 8, 1), C(16, 16, 4, 1))},
    "decode": {16: (C(16, 64, 4, 2),) * 2, 32: (C(16, 64, 4, 2),) * 2, 64: (C(16, 32, 4, 2),) * 2,
               128: (C(16, 32, 4, 1),) * 2, 256: (C(16, 16, 4, 1),) * 2},
    "dkdv": {16: (C(16, 32, 8, 1), C(32, 32, 4, 1)), 32: (C(16, 32, 8, 1), C(16, 32, 4, 1)),
             64: (C(16, 16, 8, 1), C(16, 32, 4, 1)), 128: (C(16, 16, 8, 1),) * 2, 256: (C(16, 16, 8, 1),) * 2},
    "dq": {16: (C(32, 32, 8, 2),) * 2, 32: (C(32, 32, 8, 2),) * 2, 64: (C(32, 32, 8, 1),) * 2,
           128: (C(32, 16, 8, 1),) * 2, 256: (C(16, 16, 8, 1),) * 2},
}
_SM75 = {kernel: _table({d: (half,) * 3 + (single,) * 2 for d, (half, single) in rows.items()})
         for kernel, rows in _SM75_ROWS.items()}
TABLES: dict[str, Table] = {"sm75": _SM75, "sm80": _SM80, "sm90": _SM90}
# The one-pass backward's dK/dV kernel (``dkdv_one_pass``: dQ's sums by atomics on top of dK and dV) takes the
# family's dkdv entry but where that spills with the sums' registers: the health report's first healthy config
# (``--tables dkdv_one_pass --search``); None where no tile is healthy, or where every healthy one leaves wgmma for
# mma.sync (sm_90, 16-bit, head dims 128 and 256: 1.75 main-loop instructions a score at best, against 0.85 for
# the two passes' kernels together), so those calls keep two passes. (sm_90 d=64 plain: 64 x 64 on 4 warps would
# run 0.45 instructions a score to dkdv's 32 x 64's 0.58, and puts dQ's product on wgmma, but spills 8 bytes in the
# packed-sequence loop.) Families without an entry here run the two-pass backward.
_TWO_PASSES = dict.fromkeys((d, w) for d in (128, 256) for w in ("plain", "light", "heavy"))
ONE_PASS: dict[str, dict[tuple[int, str], KernelConfig | None]] = {
    "sm80": {(16, "plain"): C(64, 64, 8, 2), (128, "light"): C(32, 32, 8, 3), (128, "heavy"): C(16, 16, 8, 3),
             (128, "fp32-heavy"): C(16, 32, 8, 2), (256, "plain"): C(32, 16, 8, 1), (256, "light"): C(16, 32, 8, 3),
             (256, "heavy"): None, (256, "fp32-heavy"): None},
    "sm90": {(16, "heavy"): C(16, 128, 8, 2), (16, "fp32-heavy"): C(32, 32, 8, 3), (32, "heavy"): C(64, 16, 8, 3),
             (64, "heavy"): C(64, 16, 8, 2), (64, "fp32-heavy"): C(32, 32, 8, 1),
             (128, "fp32-heavy"): C(16, 32, 8, 1), (256, "fp32-heavy"): C(16, 16, 8, 1), **_TWO_PASSES},
}
# Entries that differ from their family's table, per kernel, by (head dims, weight, walks a block mask):
# - a (q/k, v) pair whose padded head dims differ (MLA's 192/128, 96/64) uses the entry of the larger one, except
#   where that config spills with the pair's shapes: the health report's first healthy config for the pair;
# - the kernels walking a block mask carry its list pointers and spans through the loops: where the family's entry
#   then spills (``health --block-masks with``), fp16/bf16 forward/backward entries take the healthy candidate with
#   the fewest main-loop instructions per score element, decode (bound by reading K/V) and fp32 ones the first
#   healthy (``--search``).
OVERRIDES: dict[str, Overrides] = {
    "sm75": {"forward": {(128, "fp32-light", True): C(32, 32, 8, 3), (128, "fp32-heavy", True): C(32, 32, 8, 3)}},
    "sm80": {
        "forward": {(128, "plain", True): C(128, 64, 8, 2)},
        "decode": {(16, "fp32-light", True): C(16, 64, 4, 3), (64, "light", True): C(16, 128, 8, 3),
                   (128, "plain", True): C(16, 64, 4, 3), (256, "fp32-heavy", True): C(16, 16, 4, 3),
                   ((128, 64), "fp32-light", True): C(16, 16, 4, 3), ((256, 128), "heavy", True): C(16, 32, 4, 3),
                   ((256, 128), "fp32-heavy", True): C(16, 16, 8, 3)},
        "dkdv": {(16, "fp32-light", True): C(32, 16, 8, 3), (16, "fp32-heavy", True): C(16, 64, 8, 3),
                 (32, "fp32-light", True): C(16, 32, 8, 3), (32, "fp32-heavy", True): C(16, 32, 8, 3),
                 (64, "fp32-light", True): C(16, 64, 8, 2), (64, "fp32-heavy", True): C(16, 16, 4, 3),
                 (128, "fp32-heavy", True): C(16, 32, 8, 3), (256, "fp32-light", True): C(16, 16, 8, 1),
                 ((128, 64), "fp32-heavy", True): C(32, 16, 4, 3), ((256, 128), "fp32-light", True): C(16, 16, 8, 3)},
    },
    "sm90": {
        "forward": {(128, "plain", True): C(128, 64, 8, 2), (128, "fp32-heavy", True): C(16, 16, 4, 3),
                    ((128, 64), "fp32-heavy", True): C(16, 16, 4, 3)},
        "decode": {(256, "fp32-heavy", True): C(16, 16, 4, 3), ((256, 128), "fp32-heavy", True): C(16, 16, 4, 3)},
        "dkdv": {((128, 64), "plain", False): C(32, 64, 8, 1), ((128, 64), "fp32-heavy", False): C(32, 16, 8, 1),
                 (16, "fp32-light", True): C(32, 16, 4, 1), (16, "fp32-heavy", True): C(32, 32, 4, 3),
                 (32, "fp32-heavy", True): C(16, 32, 4, 3), (128, "plain", True): C(16, 64, 4, 1),
                 (128, "light", True): C(16, 64, 8, 1), ((256, 128), "fp32-heavy", True): C(16, 16, 4, 3)},
        "dq": {((256, 128), "plain", False): C(64, 32, 8, 3), ((256, 128), "light", False): C(64, 16, 8, 3),
               ((128, 64), "heavy", False): C(64, 32, 8, 3), ((128, 64), "fp32-light", False): C(16, 64, 4, 3),
               ((128, 64), "fp32-heavy", False): C(16, 64, 8, 3), (64, "light", True): C(128, 64, 8, 1),
               (128, "heavy", True): C(64, 32, 4, 1), (256, "plain", True): C(64, 16, 4, 2),
               (256, "light", True): C(64, 16, 8, 2)},
    },
}
del C



def _derived(base: str, changes: Overrides) -> tuple[Table, Overrides]:
    """(tables, overrides) of a family that ships ``base``'s configs but for ``changes``, keyed as ``OVERRIDES``:
    a change without a block mask and for a single head dim replaces the table entry, any other joins the
    overrides (on top of ``base``'s)."""
    tables = {kernel: dict(entries) for kernel, entries in TABLES[base].items()}
    overrides = {kernel: dict(entries) for kernel, entries in OVERRIDES[base].items()}
    for kernel, entries in changes.items():
        for (dims, weight, block_mask), cfg in entries.items():
            if block_mask or isinstance(dims, tuple):
                overrides.setdefault(kernel, {})[(dims, weight, block_mask)] = cfg
            else:
                tables[kernel][(dims, weight)] = cfg
    return tables, overrides


C = KernelConfig
# Filled in from `python -m tools.offline.health --search` for each family's architectures.
# sm_86/sm_89 and sm_120: fp32 entries over 99 KiB of shared memory, and a few that spill on sm_86/sm_89 but not
# sm_80; sm_100: heavy (dropout, mask), d = 64, dense d = 128 dK/dV and block-mask entries whose tcgen05 code
# spills where wgmma's did not; the MLA pairs (192/128, 96/64) where their padded entry spills. (Block-mask
# entries searched at head dim 128 and the pairs only so far, here and for AMD.)
_CHANGES: dict[str, tuple[str, Overrides]] = {
    "sm86": ("sm80", {
        "forward": {(32, "fp32-heavy", False): C(64, 32, 8, 2), (128, "fp32-light", True): C(16, 32, 4, 3),
                    ((256, 128), "plain", False): C(64, 32, 8, 3)},
        "dkdv": {(128, "fp32-heavy", False): C(32, 16, 8, 3), ((128, 64), "fp32-heavy", False): C(32, 16, 8, 2),
                 ((128, 64), "fp32-heavy", True): C(32, 16, 4, 2)},
        "dq": {(64, "fp32-heavy", False): C(128, 16, 8, 2), (128, "fp32-light", False): C(64, 16, 4, 2)},
    }),
    "sm100": ("sm90", {
        "forward": {(16, "heavy", False): C(128, 64, 8, 1), (32, "heavy", False): C(128, 64, 8, 1),
                    (64, "heavy", False): C(64, 64, 8, 3), (128, "light", True): C(128, 64, 8, 3),
                    ((256, 128), "fp32-light", True): C(64, 16, 8, 3)},
        "dkdv": {(16, "heavy", False): C(32, 64, 8, 1), (64, "plain", False): C(32, 64, 8, 2),
                 (128, "plain", False): C(32, 64, 8, 1), (128, "light", False): C(16, 64, 8, 1),
                 (64, "heavy", False): C(16, 64, 4, 1), (128, "fp32-light", True): C(16, 64, 8, 3),
                 ((128, 64), "plain", False): C(32, 64, 4, 1), ((128, 64), "plain", True): C(32, 64, 8, 3),
                 ((128, 64), "light", True): C(16, 64, 8, 3)},
        "dq": {(32, "heavy", False): C(64, 32, 4, 3), (64, "plain", False): C(64, 128, 8, 3),
               (128, "heavy", False): C(64, 32, 4, 3), (128, "heavy", True): C(64, 32, 4, 3),
               (128, "fp32-light", True): C(64, 16, 8, 3), ((128, 64), "heavy", False): C(64, 32, 4, 3),
               ((256, 128), "plain", True): C(64, 32, 8, 2), ((128, 64), "plain", True): C(128, 64, 8, 2)},
    }),
    "sm120": ("sm80", {
        "dq": {(64, "fp32-heavy", False): C(128, 16, 8, 2), (128, "fp32-light", False): C(64, 16, 4, 2)},
    }),
    # AMD, searched on gfx90a, gfx942 and gfx1100 with Triton's AMD backend, in every call the health compiles
    # (a dense forward's pipelined loads take more LDS than the paged one's): CDNA's matrix cores take sm_80's
    # tiles, but with dropout or a mask, at d = 256 and in dK/dV its compiler spills VGPRs (or, for a few configs,
    # fails) where 4 wavefronts of 64 in place of 8 fit; RDNA 3 (wave32, no AGPRs) takes sm_75's small tiles, within
    # the head dims and dtypes it serves (``families.py``).
    "cdna2": ("sm80", {
        "forward": {(16, "heavy", False): C(128, 64, 4, 1), (32, "heavy", False): C(128, 64, 4, 1),
                    (64, "light", False): C(128, 64, 4, 2), (128, "fp32-light", False): C(16, 32, 8, 2),
                    (64, "heavy", False): C(64, 64, 4, 2), (256, "heavy", False): C(64, 32, 4, 1),
                    (64, "light", True): C(128, 64, 4, 2), (128, "fp32-light", True): C(16, 32, 8, 2),
                    (128, "light", True): C(128, 64, 4, 1), (128, "plain", True): C(128, 64, 4, 2),
                    (256, "light", True): C(64, 32, 4, 2), (256, "plain", True): C(64, 32, 4, 2)},
        "decode": {(128, "fp32-heavy", False): C(16, 32, 4, 2), (256, "heavy", False): C(16, 32, 8, 2),
                   (64, "fp32-light", False): C(16, 64, 4, 2),
                   (64, "fp32-light", True): C(16, 64, 4, 2), (64, "light", True): C(16, 128, 8, 2),
                   (64, "plain", True): C(16, 128, 4, 2), (128, "light", True): C(16, 64, 4, 2),
                   (128, "plain", True): C(16, 64, 4, 2), (256, "fp32-heavy", True): C(16, 16, 4, 2),
                   (256, "heavy", True): C(16, 32, 4, 2), (256, "light", True): C(16, 32, 4, 2),
                   (256, "plain", True): C(16, 32, 4, 2)},
        "dkdv": {(16, "fp32-heavy", False): C(32, 32, 4, 2), (16, "light", False): C(32, 128, 4, 2),
                 (32, "heavy", False): C(64, 16, 4, 2), (32, "plain", False): C(32, 128, 4, 2),
                 (64, "light", False): C(64, 32, 4, 1), (64, "plain", False): C(64, 32, 4, 1),
                 (128, "light", False): C(64, 32, 4, 1), (128, "plain", False): C(64, 32, 4, 1),
                 ((256, 128), "fp32-light", True): C(16, 16, 8, 1), (128, "fp32-heavy", True): C(16, 32, 4, 2),
                 (256, "fp32-light", True): C(16, 16, 4, 2)},
        "dq": {(16, "heavy", False): C(64, 64, 4, 1), (32, "heavy", False): C(64, 64, 4, 1),
               (128, "fp32-heavy", False): C(32, 32, 4, 2), (128, "light", False): C(128, 32, 4, 2),
               ((96, 64), "light", False): C(128, 32, 4, 2),
               (256, "fp32-light", False): C(16, 16, 4, 2), (256, "heavy", False): C(32, 64, 4, 1),
               (256, "light", False): C(32, 32, 4, 2), (256, "plain", False): C(32, 32, 4, 2),
               (64, "light", True): C(128, 32, 8, 2), (128, "light", True): C(128, 32, 8, 1),
               (256, "heavy", True): C(64, 32, 4, 1)},
    }),
    "cdna3": ("sm80", {
        "forward": {(16, "heavy", False): C(128, 64, 4, 1), (32, "heavy", False): C(128, 64, 4, 2),
                    (64, "fp32-heavy", False): C(32, 32, 4, 1), (64, "heavy", False): C(64, 64, 4, 2),
                    (256, "heavy", False): C(64, 32, 4, 1), (256, "light", False): C(64, 32, 4, 2),
                    (64, "light", True): C(128, 64, 8, 2), (128, "fp32-light", True): C(16, 32, 8, 2),
                    (128, "light", True): C(128, 64, 4, 2), (128, "plain", True): C(128, 64, 4, 2),
                    (256, "plain", True): C(64, 32, 4, 2), (128, "fp32-light", False): C(16, 32, 8, 2)},
        "decode": {(16, "heavy", False): C(16, 64, 2, 1), (32, "heavy", False): C(16, 64, 4, 1),
                   (64, "heavy", False): C(16, 64, 4, 1), (128, "fp32-heavy", False): C(16, 32, 4, 2),
                   (128, "heavy", False): C(16, 64, 4, 1), (256, "heavy", False): C(16, 32, 8, 2),
                   (64, "fp32-light", False): C(16, 64, 4, 2),
                   (64, "fp32-light", True): C(16, 64, 4, 2), (64, "light", True): C(16, 128, 8, 2),
                   (64, "plain", True): C(16, 128, 4, 2), (128, "light", True): C(16, 64, 4, 2),
                   (128, "plain", True): C(16, 64, 4, 2), (256, "fp32-heavy", True): C(16, 16, 4, 2),
                   (256, "light", True): C(16, 32, 4, 2), (256, "plain", True): C(16, 32, 4, 2)},
        "dkdv": {(16, "fp32-heavy", False): C(32, 32, 4, 2), (16, "light", False): C(32, 128, 4, 2),
                 (32, "heavy", False): C(64, 16, 4, 2), (32, "plain", False): C(32, 128, 4, 2),
                 (64, "light", False): C(64, 32, 4, 1), (64, "plain", False): C(64, 32, 4, 1),
                 (128, "light", False): C(64, 32, 4, 1), (128, "plain", False): C(64, 32, 4, 1),
                 ((256, 128), "fp32-light", True): C(16, 16, 8, 1), (128, "fp32-heavy", True): C(16, 32, 4, 2),
                 (256, "fp32-light", True): C(16, 16, 4, 2)},
        "dq": {((128, 64), "light", False): C(128, 32, 8, 2), (16, "heavy", False): C(64, 64, 4, 1),
               ((96, 64), "light", False): C(128, 32, 4, 2),
               (32, "heavy", False): C(64, 64, 4, 1), (128, "fp32-heavy", False): C(32, 32, 4, 2),
               (256, "fp32-light", False): C(16, 16, 4, 2), (256, "heavy", False): C(32, 64, 4, 1),
               (256, "light", False): C(32, 32, 4, 2), (256, "plain", False): C(32, 32, 4, 2),
               ((128, 64), "light", True): C(128, 32, 8, 1)},
    }),
    "rdna3": ("sm75", {
        "forward": {(32, "heavy", False): C(64, 32, 8, 2), (64, "heavy", False): C(64, 16, 4, 2),
                    (128, "heavy", False): C(64, 16, 8, 1)},
        "decode": {(16, "heavy", False): C(32, 32, 4, 2), (32, "heavy", False): C(32, 32, 4, 2),
                   (32, "light", True): C(16, 64, 4, 1), (128, "heavy", False): C(16, 32, 8, 1)},
        "dq": {(16, "heavy", False): C(32, 32, 4, 2), (32, "heavy", False): C(32, 32, 8, 1),
               (64, "heavy", False): C(64, 16, 8, 2), (64, "heavy", True): C(64, 16, 8, 1)},
    }),
}
# Newer Triton releases compile some entries differently: the same tile spills under 3.9 where it did not under
# 3.6. From each release listed on, its entries replace the family's; found by the health search run under that
# release (`make health-newest`: head dims 16 to 256, every kernel, weight and family; not yet the pairs and the
# block-mask entries).
_TRITON_CHANGES: dict[tuple[int, int], dict[str, Overrides]] = {
    (3, 9): {
        "sm80": {"dkdv": {(32, "heavy", False): C(64, 16, 8, 2), (128, "fp32-heavy", False): C(32, 16, 8, 2)}},
        "sm86": {"dq": {(128, "fp32-heavy", False): C(32, 32, 8, 2)}},
        "sm90": {"forward": {(32, "heavy", False): C(64, 64, 8, 3), (64, "heavy", False): C(128, 64, 8, 2),
                             (128, "plain", False): C(128, 128, 8, 3)},
                 "dkdv": {(64, "heavy", False): C(16, 64, 8, 3), (64, "fp32-heavy", False): C(32, 32, 8, 2),
                          (128, "plain", False): C(32, 64, 8, 3), (128, "light", False): C(16, 64, 8, 3)},
                 "dq": {(16, "heavy", False): C(64, 64, 8, 2), (64, "light", False): C(128, 64, 8, 3),
                        (128, "fp32-light", False): C(16, 64, 4, 3),
                        (128, "fp32-heavy", False): C(16, 64, 8, 3)}},
        "sm100": {"forward": {(16, "heavy", False): C(64, 64, 8, 3), (32, "heavy", False): C(64, 64, 8, 3),
                              (64, "plain", False): C(128, 128, 8, 1), (64, "light", False): C(128, 128, 8, 1),
                              (128, "plain", False): C(128, 128, 8, 1)},
                  "dkdv": {(16, "heavy", False): C(32, 64, 8, 3), (64, "fp32-heavy", False): C(32, 32, 8, 3),
                           (128, "plain", False): C(32, 64, 8, 2)},
                  "dq": {(16, "heavy", False): C(64, 64, 8, 3), (64, "plain", False): C(64, 128, 8, 2),
                         (64, "light", False): C(64, 128, 8, 3)}},
        "cdna2": {"forward": {(128, "light", False): C(128, 64, 4, 2), (256, "light", False): C(64, 32, 4, 2)},
                  "dkdv": {(32, "heavy", False): C(64, 16, 4, 1), (128, "light", False): C(32, 64, 4, 2),
                           (128, "fp32-light", False): C(16, 64, 4, 2)},
                  "dq": {(128, "light", False): C(128, 32, 4, 2), (256, "light", False): C(32, 32, 4, 1),
                         (256, "heavy", False): C(64, 32, 4, 1)}},
        "cdna3": {"forward": {(128, "plain", False): C(128, 64, 4, 2), (128, "light", False): C(128, 64, 4, 2)},
                  "dkdv": {(32, "light", False): C(32, 128, 4, 2), (32, "heavy", False): C(64, 16, 4, 1),
                           (128, "light", False): C(32, 64, 4, 1), (128, "fp32-light", False): C(16, 64, 4, 2)},
                  "dq": {(64, "fp32-light", False): C(64, 32, 4, 2), (128, "light", False): C(128, 32, 4, 2),
                         (256, "heavy", False): C(128, 16, 4, 1)}},
        "rdna3": {"forward": {(128, "light", False): C(16, 32, 8, 1), (128, "heavy", False): C(16, 16, 8, 2)},
                  "decode": {(128, "plain", False): C(16, 32, 8, 2), (128, "light", False): C(16, 32, 8, 1),
                             (128, "heavy", False): C(16, 16, 8, 2)},
                  "dq": {(32, "heavy", False): C(64, 16, 8, 2), (64, "plain", False): C(64, 16, 8, 2),
                         (64, "light", False): C(64, 16, 8, 2), (64, "heavy", False): C(16, 16, 8, 1)}},
    },
}
# What no tile compiles on a release, (kernel, padded head dim, weight) per family: the triton path declines such
# calls there (the torch path runs them). Triton 3.9's AMD backend fails ("PassManager::run failed") on CDNA's dQ
# with dropout or a mask at head dim 32, in every tile the search tries.
_TRITON_DECLINES: dict[tuple[int, int], dict[str, set[tuple[str, int, str]]]] = {
    (3, 9): {"cdna2": {("dq", 32, "heavy")}, "cdna3": {("dq", 32, "heavy")}},
}
del C
for _name, (_base, _changes) in _CHANGES.items():
    TABLES[_name], OVERRIDES[_name] = _derived(_base, _changes)


TRITON = installed_release()
# What the offline health checked on each Triton release: the ends of the supported range.
CHECKED_ON = {(3, 6): "every shipped config", (3, 9): "head dims 16-256, every kernel and weight"}
DECLINED: dict[str, set[tuple[str, int, str]]] = {}  # this release's: family -> {(kernel, head dim, weight)}
for _release, _families in sorted(_TRITON_DECLINES.items()):
    if TRITON is not None and _release <= TRITON:
        for _name, _entries in _families.items():
            DECLINED.setdefault(_name, set()).update(_entries)
for _release, _families in sorted(_TRITON_CHANGES.items()):
    if TRITON is not None and _release <= TRITON:
        for _name, _kernels in _families.items():
            for _kernel, _entries in _kernels.items():
                OVERRIDES[_name].setdefault(_kernel, {}).update(_entries)
