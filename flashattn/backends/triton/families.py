"""GPU families: the architectures that share one set of kernel configs, grouped by what the kernels care about.

Two things decide whether a tile shape runs, and runs well, on a GPU: the instructions Triton lowers ``tl.dot`` to
(FMA on Turing, where Triton has no tensor-core path; Ampere-class ``mma.sync``; Hopper's ``wgmma`` fed by TMA;
datacenter Blackwell's ``tcgen05``) and the shared memory one block may use (64, 99, 163 or 227 KiB). Each family
below is one such pair; every architecture maps to one by an explicit rule (``ARCHITECTURES``), and one that is not
listed (a GPU newer than this release) gets the most conservative family, with one log line.

    >>> family(89).name, family(89).shared_bytes // 1024
    ('sm86', 99)
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

_log = logging.getLogger("flashattn")


class Family(NamedTuple):
    name: str
    cards: str
    tensor_cores: str  # what Triton lowers tl.dot to for fp16/bf16
    shared_bytes: int  # opt-in shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin)
    tma: bool  # tiles loaded through tensor descriptors (TMA) when the matmuls are warpgroup-wide
    max_grad_head_dim: int = 256  # the largest head dim the backward kernels serve on it


KIB = 1024
FAMILIES = {f.name: f for f in (
    # Triton lowers tl.dot to tensor cores from sm_80 on: on Turing its matmuls are FMA, in small tiles.
    Family("sm75", "Turing: T4, RTX 20xx, Quadro RTX", "none (Triton's tl.dot is FMA below sm_80)", 64 * KIB,
           tma=False, max_grad_head_dim=64),
    Family("sm80", "Ampere datacenter: A100, A30; Jetson Orin", "mma.sync m16n8k16", 163 * KIB, tma=False),
    Family("sm86", "Ampere and Ada consumer and workstation: RTX 30xx/40xx, A10, A40, L4, L40S", "mma.sync m16n8k16",
           99 * KIB, tma=False),
    Family("sm90", "Hopper: H100, H200, GH200", "wgmma", 227 * KIB, tma=True),
    Family("sm100", "Blackwell datacenter: B200, GB200, B300", "tcgen05", 227 * KIB, tma=True),
    # Consumer Blackwell has TMA, but its matmuls are mma.sync, which descriptor-loaded tiles reach only through
    # registers: pointer loads, as on Ampere.
    Family("sm120", "Blackwell consumer: RTX 50xx, RTX PRO 6000, DGX Spark", "mma.sync m16n8k16", 99 * KIB,
           tma=False),
)}
# 10 x major + minor -> family. sm_87 (Jetson Orin) has the A100's 163 KiB; sm_121 (DGX Spark) is consumer Blackwell.
ARCHITECTURES = {75: "sm75", 80: "sm80", 86: "sm86", 87: "sm80", 89: "sm86", 90: "sm90", 100: "sm100",
                 103: "sm100", 120: "sm120", 121: "sm120"}
# The architectures every shipped config is compiled for and checked offline (``tools.offline.health``): one per
# code generation; sm_87, sm_103 and sm_121 compile as their family's sm_80, sm_100 and sm_120 do.
CHECKED_OFFLINE = (75, 80, 86, 89, 90, 100, 120)
# The family an unlisted architecture gets: the smallest tiles, which fit every GPU's shared memory.
CONSERVATIVE = "sm75"


def family(arch: int) -> Family:
    """The family of sm_``arch`` (``arch`` = 10 x major + minor); an unlisted one gets ``CONSERVATIVE``'s."""
    name = ARCHITECTURES.get(arch)
    return FAMILIES[name] if name is not None else _unlisted(arch)


@functools.cache
def _unlisted(arch: int) -> Family:
    _log.warning("flashattn: sm_%d is not among the architectures the Triton configs were checked for (%s); "
                 "using the %s family's tiles, which fit every GPU's shared memory", arch,
                 ", ".join(f"sm_{a}" for a in ARCHITECTURES), CONSERVATIVE)
    return FAMILIES[CONSERVATIVE]
