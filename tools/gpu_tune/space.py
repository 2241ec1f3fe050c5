"""The configs a tuning step tries for one kernel, and the health of each as the device's compiler built it.

The grid is the family's: tile sides, warps and pipeline stages around what its matrix instructions and shared
memory allow (``GRIDS``), the table's own config first, so the baseline is always timed. The device compiles each
candidate; one that spills registers, leaves the family's tensor-core instructions, or needs more shared memory
than the GPU has (Triton refuses to launch it) is dropped before timing: the offline health's rules
(``tools.offline.health``), applied to what the device compiled, and rerun offline on the winners once they are
committed (``configs.shipped()`` includes measured entries).

    >>> found = candidates("decode", 128, "sm90", shipped=KernelConfig(16, 64, 4, 3))
    >>> found[0], len(found) > 10
    (KernelConfig(block_m=16, block_n=64, num_warps=4, num_stages=3), True)
"""

from __future__ import annotations

import itertools

from flashattn.backends.triton.tables import KernelConfig

# kernel -> (BLOCK_M values, BLOCK_N values, warps, stages[, head-dim splits]). Forward and dQ: BLOCK_M queries per
# program by BLOCK_N keys per step; dK/dV: BLOCK_N keys per program by BLOCK_M queries per step, its head dim split
# over 1 or 2 programs (``KernelConfig.split_d``: at 256, 64 and 128 keys fit that way, and spill a little, which
# only a GPU can weigh against the recomputed S^T and dP^T); decode: 16 query rows.
GRIDS = {
    "forward": ((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)),
    "dkdv": ((16, 32, 64), (32, 64, 128), (4, 8), (1, 2, 3), (1, 2)),
    "dq": ((64, 128), (32, 64, 128), (4, 8), (1, 2, 3)),
    "decode": ((16,), (32, 64, 128, 256), (2, 4, 8), (2, 3, 4)),
}
SMOKE_GRID = ((16, 32), (16, 32), (1,), (1,))  # under the interpreter: tiny tiles, two or three candidates
# What the family's matrix instructions look like in its compiled code (PTX for NVIDIA, the ISA for AMD).
TENSOR_CORES = {"sm80": "mma.sync", "sm86": "mma.sync", "sm120": "mma.sync", "sm90": "wgmma", "sm100": "tcgen05",
                "cdna2": "mfma", "cdna3": "mfma", "rdna3": "wmma"}


def _plausible(kernel: str, cfg: KernelConfig, head_dim: int) -> bool:
    """Cheap pruning before anything compiles: tiles whose operands alone would not fit a multiprocessor's
    registers at this head dim, and 8 warps on tiles too small to give each warp a tensor-core tile."""
    if cfg.num_warps == 8 and cfg.block_m * cfg.block_n < 64 * 64:
        return False
    if cfg.split_d > 1 and head_dim < 256:  # below 256 the whole head dim's dK and dV fit one program
        return False
    if head_dim >= 256 and max(cfg.block_m, cfg.block_n) >= 128 and kernel != "decode" and cfg.split_d == 1:
        return False
    # fp32 accumulators of the program's outputs: (BLOCK_M or BLOCK_N) x its columns, twice for dK/dV, over its threads
    rows = cfg.block_n if kernel == "dkdv" else cfg.block_m
    accumulators = rows * head_dim * (2 if kernel == "dkdv" else 1) // (32 * cfg.num_warps * cfg.split_d)
    return accumulators <= 160


def candidates(kernel: str, head_dim: int, family: str, *, shipped: KernelConfig, smoke: bool = False,
               limit: int = 32) -> list[KernelConfig]:
    """The configs to try for ``kernel`` at ``head_dim`` on ``family``: ``shipped`` first, then the grid's
    plausible ones nearest to it in tile area, at most ``limit`` in all."""
    grid = SMOKE_GRID if smoke else GRIDS[kernel]
    found = [KernelConfig(*c) for c in itertools.product(*grid)]
    found = [c for c in found if c != shipped and (smoke or _plausible(kernel, c, head_dim))]
    area = shipped.block_m * shipped.block_n
    found.sort(key=lambda c: (abs((c.block_m * c.block_n).bit_length() - area.bit_length()),
                              c.num_warps != shipped.num_warps, abs(c.num_stages - shipped.num_stages),
                              -c.block_m * c.block_n, c.num_warps, c.num_stages))
    return [shipped, *found][: 2 if smoke else limit]


def compiled_health(kernel_names: tuple[str, ...], before: set[int], family: str) -> dict:
    """What the device compiled since ``before`` (ids of the compiled kernels already present; ``compiled()``)
    for the kernels named: registers, spills, shared memory, and whether the family's tensor-core instructions are
    there. ``{}`` under the interpreter, which compiles nothing."""
    rows = [k for name, k in compiled() if id(k) not in before and name in kernel_names]
    if not rows:
        return {}
    marker = TENSOR_CORES.get(family)
    health = {"registers": max(getattr(k, "n_regs", 0) or 0 for k in rows),
              "spills": max(getattr(k, "n_spills", 0) or 0 for k in rows),
              "shared": max(int(k.metadata.shared) for k in rows)}
    if marker:
        health["tensor_cores"] = all(marker in (k.asm.get("ptx") or k.asm.get("amdgcn") or "") for k in rows)
    problems = []
    if health["spills"]:
        problems.append(f"spills {health['spills']} bytes")
    if marker and not health["tensor_cores"]:
        problems.append(f"no {marker}")
    health["problems"] = problems
    return health


def compiled() -> list[tuple[str, object]]:
    """(name, compiled kernel) of every kernel Triton has compiled in this process for flashattn's Triton kernels
    (none under the interpreter)."""
    from flashattn.backends.triton.kernels import backward, forward

    found = []
    for module in (forward, backward):
        for name in dir(module):
            for caches in getattr(getattr(module, name), "device_caches", {}).values():
                for kernel in caches[0].values():
                    kernel = kernel.result() if hasattr(kernel, "result") else kernel
                    found.append((name, kernel))
    return found
