"""Tile shapes, warps and pipeline stages of the shipped kernels, as data, per GPU generation.

``TABLES[family][kernel]`` is keyed by (padded head dim, weight): "plain" calls use at most the causal/window band;
"light" ones add softcap or ALiBi; "heavy" ones add dropout (Philox costs registers per score element) or a user
mask tile; the "fp32-" weights serve fp32 inputs (IEEE fp32 matmuls: twice the bytes per tile, no tensor cores, so
small tiles). The families are "sm80" (Ampere, and anything before Hopper) and "sm90" (Hopper: wgmma wants 64-row
warpgroup tiles, TMA feeds them, and 227 KiB of shared memory allows deeper pipelines). Every entry compiles without
register spills inside its loops, within shared memory, and (sm90, fp16/bf16) on wgmma (HGMMA) where a warpgroup
tile fits: ``python -m tools.offline.health`` checks that for every entry, and a test reruns it. The
sm90 plain and light entries have the fewest main-loop instructions per score element among those; the others are
the first healthy config of the health report's search. Tune here, then rerun both.

The kernels' tiles: forward and dQ, BLOCK_M queries per program by BLOCK_N keys per step; dK/dV, BLOCK_N keys per
program (the M dimension of all its matmuls, on the transposed tile S^T) by BLOCK_M queries per step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


WEIGHTS = ("plain", "light", "heavy", "fp32-light", "fp32-heavy")
KERNELS = ("forward", "decode", "dkdv", "dq")
FAMILIES = ("sm80", "sm90")


def family(arch: int) -> str:
    """The tables an architecture uses (``arch`` = 10 x major + minor)."""
    return "sm90" if arch >= 90 else "sm80"


def _table(rows: dict[int, tuple[KernelConfig, ...]]) -> dict[tuple[int, str], KernelConfig]:
    """{head_dim: (plain, light, heavy, fp32-light, fp32-heavy)} -> {(head_dim, weight): config}."""
    return {(d, weight): cfg for d, cfgs in rows.items() for weight, cfg in zip(WEIGHTS, cfgs, strict=True)}


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
        64: (C(32, 64, 4, 1), C(32, 64, 4, 1), C(16, 64, 4, 2), C(16, 64, 4, 1), C(32, 32, 4, 1)),
        128: (C(32, 64, 4, 1), C(16, 64, 4, 1), C(16, 16, 4, 1), C(16, 64, 8, 1), C(32, 16, 4, 1)),
        256: (C(32, 16, 4, 1), C(32, 16, 4, 1), C(16, 16, 8, 1), C(16, 16, 4, 1), C(16, 16, 4, 1)),
    }),
    "dq": _table({
        16: (C(128, 64, 8, 2), C(128, 64, 8, 2), C(64, 64, 4, 2), C(64, 32, 4, 2), C(64, 32, 4, 1)),
        32: (C(128, 64, 8, 2), C(128, 64, 8, 2), C(64, 32, 4, 2), C(128, 16, 8, 3), C(64, 16, 4, 2)),
        64: (C(128, 128, 8, 2), C(128, 128, 8, 2), C(64, 32, 4, 2), C(64, 32, 8, 1), C(128, 16, 8, 3)),
        128: (C(128, 64, 8, 3), C(128, 64, 8, 3), C(64, 32, 4, 2), C(64, 16, 4, 3), C(32, 32, 8, 1)),
        256: (C(64, 32, 4, 2), C(64, 16, 4, 2), C(16, 16, 4, 1), C(16, 16, 4, 3), C(16, 16, 4, 1)),
    }),
}
TABLES = {"sm80": _SM80, "sm90": _SM90}
# Entries that differ from their family's table, per kernel, by (head dims, weight, walks a block mask):
# - a (q/k, v) pair whose padded head dims differ (MLA's 192/128, 96/64) uses the entry of the larger one, except
#   where that config spills with the pair's shapes: the health report's first healthy config for the pair;
# - the kernels walking a block mask carry its list pointers and spans through the loops: where the family's entry
#   then spills (``health --block-masks with``), fp16/bf16 forward/backward entries take the healthy candidate with
#   the fewest main-loop instructions per score element, decode (bound by reading K/V) and fp32 ones the first
#   healthy (``--search``).
OVERRIDES: dict[str, dict[str, dict[tuple[int | tuple[int, int], str, bool], KernelConfig]]] = {
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
DECODE_MAX_ROWS = 16
del C
# Under TRITON_INTERPRET=1 every program runs in Python: small square tiles keep test shapes cheap.
INTERPRETER = KernelConfig(32, 32, 1, 1)
PREPROCESS_BLOCK_M = 64
MERGE_BLOCK_M = 16


def table_key(d: int, dv: int) -> int | tuple[int, int]:
    """The padded head dim a call of q/k head dim ``d`` and v head dim ``dv`` is looked up by, or the padded pair
    when they pad differently."""
    pd, pdv = padded_head_dim(d), padded_head_dim(dv)
    return pd if pd == pdv else (pd, pdv)


def lookup(kernel: str, arch: int, head_dim: int | tuple[int, int], weight: str, *,
           block_mask: bool = False) -> KernelConfig:
    """The config of ``kernel`` for a call of ``table_key`` ``head_dim`` and ``weight`` on sm_``arch``: the most
    specific ``OVERRIDES`` entry (the call's head dims with and then without the block mask, then with a block mask
    its larger head dim), else the family's table entry of the larger head dim."""
    fam = family(arch)
    largest = max(head_dim) if isinstance(head_dim, tuple) else head_dim
    for key in ((head_dim, weight, block_mask), (head_dim, weight, False), (largest, weight, block_mask)):
        found = OVERRIDES[fam].get(kernel, {}).get(key)
        if found is not None:
            return found
    return TABLES[fam][kernel][(largest, weight)]


def shipped() -> set[KernelConfig]:
    """Every distinct config of every table."""
    return {cfg for tables in (TABLES, OVERRIDES) for kernels in tables.values() for table in kernels.values()
            for cfg in table.values()}


_forced: ContextVar[KernelConfig | None] = ContextVar("flashattn_triton_config", default=None)


@contextmanager
def use(cfg: KernelConfig) -> Iterator[None]:
    """Launch every kernel with ``cfg`` inside the block, instead of the table's entry (also under the
    interpreter): how the health report tries candidates and the tests run each shipped tile."""
    token = _forced.set(cfg)
    try:
        yield
    finally:
        _forced.reset(token)


def forced() -> KernelConfig | None:
    return _forced.get()


def split_heuristic(programs: int, multiprocessors: int, key_blocks: int, max_splits: int = 128) -> int:
    """How many key splits (flash-decoding) a forward launch of ``programs`` programs should use.

    Splitting helps only when the launch cannot fill the GPU: then pick the fewest splits whose waves of programs
    fill the multiprocessors within 85% of the best achievable, skipping counts that leave the keys per split
    unchanged (the same work, more merging). The rule of flash_attn's ``num_splits_heuristic``.

    Example::

        >>> split_heuristic(programs=4, multiprocessors=132, key_blocks=512)  # batch 1, 4 kv heads
        29
        >>> split_heuristic(programs=512, multiprocessors=132, key_blocks=512)
        1
    """
    if programs >= 0.8 * multiprocessors:
        return 1
    max_splits = max(1, min(max_splits, multiprocessors, key_blocks))

    def efficiency(splits: int) -> float:
        waves = programs * splits / multiprocessors
        return waves / math.ceil(waves)

    def useful(splits: int) -> bool:
        return splits == 1 or math.ceil(key_blocks / splits) != math.ceil(key_blocks / (splits - 1))

    best = max(efficiency(s) for s in range(1, max_splits + 1) if useful(s))
    return next(s for s in range(1, max_splits + 1) if useful(s) and efficiency(s) >= 0.85 * best)


def padded_head_dim(d: int) -> int:
    return max(16, 1 << (max(d, 1) - 1).bit_length())
