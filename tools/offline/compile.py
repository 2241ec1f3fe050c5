"""Compiling the Triton kernels for a GPU that is not there: what a call would launch, for any NVIDIA or AMD
architecture.

``compiled_launches(arch, call)`` runs ``call`` (which calls the triton path's ``forward``/``backward``,
``flashattn.backends.triton.attend``, on CPU tensors) with an offline CUDA or HIP driver standing in for the GPU and
``launch.compile_only`` recording, so every kernel is compiled exactly as that call would launch it: the same
arguments by name, hence the runtime's specialization (16-byte aligned pointers, unit strides, sizes divisible by
16). ``cubin_report`` reads an NVIDIA binary's resource usage and SASS with the ``cuobjdump`` Triton ships; on AMD,
``kernel_counts`` reads the AMDGPU assembly Triton keeps (registers, scratch, MFMA/WMMA). The health report and
the kernel profile are built on these."""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import triton
from triton.backends.amd.driver import HIPDriver
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import CudaDriver
from triton.runtime import driver

from flashattn.backends.triton import hopper
from flashattn.backends.triton.families import ARCHITECTURES, CHECKED_OFFLINE, Arch, family, vendor
from flashattn.backends.triton.launch import Compiled, compile_only

from .sass import MMA_SYNC, WGMMA, Sass

# The architectures the health report compiles for, and the opt-in shared memory per block of each.
TARGETS = CHECKED_OFFLINE
SHARED_LIMIT = {arch: family(arch).shared_bytes for arch in ARCHITECTURES}


class _DeviceUtils:
    """What Triton asks of a device before a kernel's first launch: only its shared memory per block."""

    def __init__(self, max_shared: int):
        self.max_shared = max_shared

    def get_device_properties(self, device) -> dict:
        return {"max_shared_mem": self.max_shared}


class _OfflineDriver(CudaDriver):
    """A CUDA driver that answers Triton's questions for a chosen architecture without a GPU; kernels are only
    compiled (warmed up), never launched. Its device number is the architecture, so compilations for different
    targets do not share Triton's per-device caches. ``max_shared``: the device's shared memory per block, which
    ``launch.compile_only`` holds each kernel to as a launch would (unlimited by default: the health report judges
    it against the family's limit instead)."""

    def __init__(self, arch: int, max_shared: int = 2**31):  # no super().__init__(): it would load libcuda
        self.arch = arch
        self.utils = _DeviceUtils(max_shared)

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.arch, 32)

    def get_current_device(self) -> int:
        return self.arch

    def get_current_stream(self, device=None) -> int:
        return 0


class _OfflineHipDriver(HIPDriver):
    """The same for an AMD architecture (a gfx name): wavefronts of the family's width."""

    def __init__(self, arch: str, max_shared: int = 2**31):  # no super().__init__(): it would load the HIP runtime
        self.arch = arch
        self.utils = _DeviceUtils(max_shared)

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("hip", self.arch, family(self.arch).warp_size)

    def get_current_device(self) -> int:  # one per architecture, as on NVIDIA: Triton caches kernels per device
        return 1000 + sorted(a for a in ARCHITECTURES if isinstance(a, str)).index(self.arch)

    def get_current_stream(self, device=None) -> int:
        return 0


@contextmanager
def _offline(arch: Arch, max_shared: int = 2**31):
    previous = driver._active  # None until a driver was first needed; reset_active() would need a GPU
    offline = _OfflineHipDriver(arch, max_shared) if vendor(arch) == "hip" else _OfflineDriver(arch, max_shared)
    driver.set_active(offline)
    try:
        yield
    finally:
        driver._active = previous


def compiled_launches(arch: Arch, call: Callable[[], object], *, max_shared: int = 2**31) -> list[Compiled]:
    """The launches ``call`` makes, each compiled for ``arch`` (10 x major + minor, or a gfx name) instead of run,
    on a device with ``max_shared`` bytes of shared memory per block."""
    # The portable kernels, whose tables these tools judge, also for calls the Hopper tier would take (the tier's
    # own kernel: tools/gluon/profile.py).
    with _offline(arch, max_shared), compile_only() as launches, hopper.using("portable"):
        call()
    return launches



class CubinReport(NamedTuple):
    registers: int
    spill_bytes: int
    sass: Sass


def cubin_report(cubin: bytes) -> CubinReport:
    tool = str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([tool, "--dump-sass", f.name], capture_output=True, text=True, check=True).stdout
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    spills = int(re.search(r"STACK:(\d+)", usage).group(1)) + int(re.search(r"LOCAL:(\d+)", usage).group(1))
    return CubinReport(registers, spills, Sass.parse(sass))


@dataclass
class KernelCounts:
    """What one compiled launch is made of, read from its cubin (``sass.py`` defines the terms)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    registers: int
    spill_bytes: int  # stack frame and local memory: register spills, or a subroutine call's saved registers
    loop_spills: int  # local-memory loads and stores inside loops (``Sass.spills_in_loops``)
    shared_bytes: int
    hgmma: int  # wgmma instructions (HGMMA, QGMMA for FP8 operands)
    hmma: int  # mma.sync instructions, HMMA or QMMA (FP8) (Turing to Blackwell; on sm_90/100 a matmul that missed)
    tcgen05: int  # sm_100's tensor-core instructions (UTC*MMA, from tcgen05.mma)
    hgmma_groups: int
    hgmma_waited_at_once: int  # groups retired within a few instructions of their issue: no overlap
    tma_loads: int  # UTMALDG: tensor-descriptor copies
    main_loop: int  # instructions in the main loop (the leanest innermost loop with tensor-core instructions)
    per_score: float  # main_loop x warps / (BLOCK_M x BLOCK_N): warp-instructions per score element
    mfma: int = 0  # AMD CDNA's matrix instructions (v_mfma_*)
    wmma: int = 0  # AMD RDNA 3's (v_wmma_*)


def amd_counts(launch: Compiled) -> KernelCounts:
    """The counts of an AMD kernel, from the assembly Triton keeps: registers (architectural VGPRs plus CDNA's
    accumulation AGPRs), ``spill_bytes`` the scratch segment a kernel that spills VGPRs to memory gets,
    ``loop_spills`` the spilled VGPRs wherever they went (on CDNA first into AGPRs, which costs no memory), LDS,
    and the matrix instructions."""
    kernel = launch.kernel
    asm = kernel.asm["amdgcn"]

    def field(name: str) -> int:
        found = re.search(rf"\.{name}:\s*(\d+)", asm)
        return int(found.group(1)) if found else 0

    def comment(name: str) -> int:
        found = re.search(rf";\s*{name}:\s*(\d+)", asm)
        return int(found.group(1)) if found else 0

    scratch = field("private_segment_fixed_size") or comment("ScratchSize")
    return KernelCounts(
        launch.kwargs["BLOCK_M"], launch.kwargs["BLOCK_N"], kernel.metadata.num_warps, kernel.metadata.num_stages,
        comment("TotalNumVgprs") or comment("NumVgprs") + comment("NumAgprs"), scratch, field("vgpr_spill_count"),
        kernel.metadata.shared, 0, 0, 0, 0, 0, 0, 0, 0.0, mfma=len(re.findall(r"\bv_mfma_", asm)),
        wmma=len(re.findall(r"\bv_wmma_", asm)))


def kernel_counts(launch: Compiled) -> KernelCounts:
    kernel = launch.kernel
    if "amdgcn" in kernel.asm:
        return amd_counts(launch)
    report = cubin_report(kernel.asm["cubin"])
    sass = report.sass
    loop = sass.main_loop()
    block_m, block_n = launch.kwargs["BLOCK_M"], launch.kwargs["BLOCK_N"]
    warps = kernel.metadata.num_warps
    length = loop.length if loop else 0
    return KernelCounts(
        block_m, block_n, warps, kernel.metadata.num_stages, report.registers, report.spill_bytes,
        sass.spills_in_loops(), kernel.metadata.shared, sass.count(WGMMA), sass.count(MMA_SYNC),
        sass.count_tcgen05(), sass.hgmma_groups(),
        sass.hgmma_waited_at_once(), sass.count("UTMALDG"), length, round(length * warps / (block_m * block_n), 3),
    )
