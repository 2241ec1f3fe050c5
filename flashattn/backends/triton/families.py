"""GPU families: the architectures that share one set of kernel configs, grouped by what the kernels care about.

Two things decide whether a tile shape runs, and runs well, on a GPU: the instructions Triton lowers ``tl.dot`` to
(FMA on Turing, where Triton has no tensor-core path; Ampere-class ``mma.sync``; Hopper's ``wgmma`` fed by TMA;
datacenter Blackwell's ``tcgen05``; AMD's MFMA on CDNA, WMMA on RDNA 3) and the shared memory one block may use (64,
99, 163 or 227 KiB; AMD's LDS: 64 KiB per workgroup). Each family below is one such pair; every architecture maps to
one by an explicit rule (``ARCHITECTURES``: NVIDIA's by 10 x major + minor, AMD's by their gfx name), and one that is
not listed (a GPU newer than this release) gets its vendor's most conservative family, with one log line.

    >>> family(89).name, family(89).shared_bytes // 1024
    ('sm86', 99)
    >>> family("gfx942").name, family("gfx942").warp_size
    ('cdna3', 64)
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

_log = logging.getLogger("flashattn")


Arch = int | str  # NVIDIA: 10 x major + minor (90); AMD: the gfx name ("gfx942")


class Family(NamedTuple):
    name: str
    cards: str
    tensor_cores: str  # what Triton lowers tl.dot to for fp16/bf16
    shared_bytes: int  # opt-in shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin; AMD: LDS)
    tma: bool  # tiles loaded through tensor descriptors (TMA) when the matmuls are warpgroup-wide
    max_grad_head_dim: int = 256  # the largest head dim the backward kernels serve on it
    warp_size: int = 32  # threads per warp (AMD: per wavefront)
    max_head_dim: int = 256  # the largest head dim any kernel serves on it
    fp32: bool = True  # whether it serves fp32 inputs (IEEE fp32 matmuls, off the matrix units)
    max_block_mask_head_dim: int = 256  # the largest head dim its kernels serve walking a block mask


KIB = 1024
FAMILIES = {f.name: f for f in (
    # Triton lowers tl.dot to tensor cores from sm_80 on: on Turing its matmuls are FMA, in small tiles. Walking a
    # block mask past head dim 128 they spill in every tile for fp32 with dropout or a mask (a 192/128 pair: about
    # 2 KB in the loop), so such calls take the torch path.
    Family("sm75", "Turing: T4, RTX 20xx, Quadro RTX", "none (Triton's tl.dot is FMA below sm_80)", 64 * KIB,
           tma=False, max_grad_head_dim=64, max_block_mask_head_dim=128),
    Family("sm80", "Ampere datacenter: A100, A30; Jetson Orin", "mma.sync m16n8k16", 163 * KIB, tma=False),
    Family("sm86", "Ampere and Ada consumer and workstation: RTX 30xx/40xx, A10, A40, L4, L40S", "mma.sync m16n8k16",
           99 * KIB, tma=False),
    Family("sm90", "Hopper: H100, H200, GH200", "wgmma", 227 * KIB, tma=True),
    Family("sm100", "Blackwell datacenter: B200, GB200, B300", "tcgen05", 227 * KIB, tma=True),
    # Consumer Blackwell has TMA, but its matmuls are mma.sync, which descriptor-loaded tiles reach only through
    # registers: pointer loads, as on Ampere.
    Family("sm120", "Blackwell consumer: RTX 50xx, RTX PRO 6000, DGX Spark", "mma.sync m16n8k16", 99 * KIB,
           tma=False),
    # AMD (ROCm): 64 KiB of LDS per workgroup on all three; CDNA's wavefronts are 64 threads and its matrix cores
    # accumulate in AGPRs beside the VGPRs, RDNA 3's are 32 threads with WMMA and no AGPRs.
    Family("cdna2", "AMD Instinct MI200: MI210, MI250, MI250X", "MFMA", 64 * KIB, tma=False, warp_size=64),
    Family("cdna3", "AMD Instinct MI300: MI300X, MI300A, MI325X", "MFMA", 64 * KIB, tma=False, warp_size=64),
    # RDNA 3's compiler spills the kernels' registers at head dim 256 even in 16 x 16 tiles, in the backward from
    # 128, and in every fp32 kernel (IEEE fp32 matmuls on its vector units): those calls take the torch path.
    Family("rdna3", "AMD Radeon RX 7900, Radeon PRO W7900/W7800", "WMMA (wave32)", 64 * KIB, tma=False,
           max_grad_head_dim=64, max_head_dim=128, fp32=False),
)}
# Architecture -> family. sm_87 (Jetson Orin) has the A100's 163 KiB; sm_121 (DGX Spark) is consumer Blackwell;
# gfx1101 and gfx1102 are RDNA 3's smaller dies.
ARCHITECTURES: dict[Arch, str] = {
    75: "sm75", 80: "sm80", 86: "sm86", 87: "sm80", 89: "sm86", 90: "sm90", 100: "sm100", 103: "sm100", 120: "sm120",
    121: "sm120", "gfx90a": "cdna2", "gfx942": "cdna3", "gfx1100": "rdna3", "gfx1101": "rdna3", "gfx1102": "rdna3"}
# The architectures every shipped config is compiled for and checked offline (``tools.offline.health``): one per
# code generation; sm_87, sm_103, sm_121, gfx1101 and gfx1102 compile as their family's checked one does.
CHECKED_OFFLINE: tuple[Arch, ...] = (75, 80, 86, 89, 90, 100, 120, "gfx90a", "gfx942", "gfx1100")
# The family an unlisted architecture gets: its vendor's smallest tiles, which fit every GPU's shared memory.
CONSERVATIVE = {"cuda": "sm75", "hip": "rdna3"}


def vendor(arch: Arch) -> str:
    """Triton's backend of ``arch``: "cuda" (NVIDIA) or "hip" (AMD)."""
    return "hip" if isinstance(arch, str) else "cuda"


def arch_name(arch: Arch) -> str:
    """How messages name an architecture: sm_90, gfx942."""
    return arch if isinstance(arch, str) else f"sm_{arch}"


def family(arch: Arch) -> Family:
    """The family of ``arch`` (10 x major + minor, or a gfx name); an unlisted one gets its vendor's
    ``CONSERVATIVE`` family."""
    name = ARCHITECTURES.get(arch)
    return FAMILIES[name] if name is not None else _unlisted(arch)


@functools.cache
def _unlisted(arch: Arch) -> Family:
    conservative = CONSERVATIVE[vendor(arch)]
    known = ", ".join(arch_name(a) for a in ARCHITECTURES if vendor(a) == vendor(arch))
    _log.warning("flashattn: %s is not among the architectures the Triton configs were checked for (%s); using the "
                 "%s family's tiles, which fit every such GPU's shared memory", arch_name(arch), known, conservative)
    return FAMILIES[conservative]
