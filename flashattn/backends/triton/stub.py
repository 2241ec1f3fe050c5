"""A GPU that is not there, for timing the host side of a call: the Triton kernels compiled for a real architecture
and launched into a recorder instead of a device.

Inside ``stubbed_launches(arch)`` the triton path serves CPU tensors as it would serve CUDA ones on a GPU of that
architecture (its family's tiles, its multiprocessor count, its TMA descriptors), runs every step of a call (the
checks, the path's choice, Triton's argument binding and cache lookup, its launcher's metadata and, on Triton 3.6,
its launcher's Python, which expands each TMA descriptor), and where the driver would encode a descriptor or
launch a kernel it records them instead, the launch with the time and the kernel's name: the microseconds from
a call to each of its launches are what the host costs a GPU call, measured on a CPU. The first call of each
kernel compiles it (as on a GPU); nothing runs, so outputs hold whatever their buffers held.

Example::

    with stubbed_launches(90) as launches:
        flash_attn_func(q, k, v)          # CPU tensors; launches.stamps: [(ns, kernel name), ...]
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class StubDevice:
    """The GPU a stubbed call stands for: its architecture (10 x major + minor) and multiprocessor count."""

    arch: int = 90
    multiprocessors: int = 132  # an H100 SXM's


@dataclass
class Launches:
    """What ``stubbed_launches`` recorded: (perf_counter_ns at the launch, kernel name) per launch, in order."""

    device: StubDevice
    stamps: list[tuple[int, str]] = field(default_factory=list)
    arguments: list[tuple] | None = None  # each launch's grid and arguments, when asked for (keep_arguments)
    heads: list[tuple] | None = None  # with arguments: each launch's stream, function, cooperative, PDL, scratch
    #                                     buffers, metadata, launch metadata and hooks (Triton 3.6's layout)
    through_launcher: int = 0  # launches that went through the launcher's Python, not to its C entry directly

    def clear(self) -> None:
        self.stamps.clear()
        if self.arguments is not None:
            self.arguments.clear()
            self.heads.clear()
        self.through_launcher = 0




class StubTensorMap(NamedTuple):
    """What a TMA descriptor's encode was given (the driver's tensor map it stands for): equal maps, equal calls."""

    pointer: int
    swizzle: int
    element_size: int
    element_type: int
    block: list
    shape: list
    strides: list
    padding: int


def _launcher_class(launches: Launches) -> type:
    """The launcher class of the stub driver: Triton 3.6's ``CudaLauncher`` with its C entry replaced by a
    recorder, so that the Python a launch runs through on a GPU (the expansion of each TMA descriptor, whose
    encode the stub's ``fill_tma_descriptor`` records) runs here too, and ``entry.entry`` finds the recorder where
    it finds the C entry. Other releases' launchers are replaced whole: the recorder takes their arguments."""
    from . import installed_release

    faithful = installed_release() == (3, 6)

    def record(name: str, *args) -> None:
        launches.stamps.append((time.perf_counter_ns(), name))
        if launches.arguments is not None:  # (grid x, y, z), then the kernel's arguments
            launches.arguments.append((name, args[:3], args[13:]))
            launches.heads.append(args[3:13])

    class Launcher:
        def __init__(self, src, metadata):
            self.name = metadata.name
            self.launch_cooperative_grid = metadata.launch_cooperative_grid
            self.launch_pdl = metadata.launch_pdl
            self.global_scratch_size = metadata.global_scratch_size
            self.profile_scratch_size = metadata.profile_scratch_size
            self.launch = functools.partial(record, self.name)  # no Python code: what entry() takes for C
            if faithful:
                from triton.backends.nvidia.driver import wrap_handle_tensordesc

                self.launch = wrap_handle_tensordesc(self.launch, dict(src.signature),
                                                     getattr(metadata, "tensordesc_meta", None))

        def __call__(self, gridX, gridY, gridZ, stream, function, *args) -> None:  # noqa: N803 (Triton's names)
            launches.through_launcher += 1
            if not faithful:  # args: metadata, launch metadata, hooks, then the kernel's
                record(self.name, gridX, gridY, gridZ, *[None] * 10, *args[4:])
                return
            # Scratch buffers are not allocated: nothing runs (and a plan launches such kernels through here).
            self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                        None, None, *args)

    return Launcher


def _driver(device: StubDevice, launches: Launches):
    """A Triton CUDA driver for ``device`` whose launcher records instead of launching (built at call time: the
    module imports no triton)."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver

    class Utils:
        def get_device_properties(self, _device) -> dict:
            return {"max_shared_mem": 232448, "multiprocessor_count": device.multiprocessors,
                    "max_num_regs": 65536, "warpSize": 32}

        def load_binary(self, name, kernel, shared, _device) -> tuple:
            return 0, 0, 0, 0, 1024  # module, function, registers, spills, threads: nothing is loaded

        def fill_tma_descriptor(self, pointer, *fields) -> StubTensorMap:  # Triton 3.6's encode, recorded
            return StubTensorMap(pointer, *fields)

    class Driver(CudaDriver):
        launcher_cls = _launcher_class(launches)

        def __init__(self):  # no super().__init__(): it would load libcuda
            self.utils = Utils()

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", device.arch, 32)

        def get_current_device(self) -> int:
            return device.arch  # Triton's caches are per device: one per stubbed architecture

        def get_current_stream(self, _device=None) -> int:
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    return Driver()


@contextmanager
def stubbed_launches(arch: int = 90, multiprocessors: int = 132, *, keep_arguments: bool = False
                     ) -> Iterator[Launches]:
    """Inside the block, the triton path takes CPU tensors as a GPU of ``arch`` would take CUDA ones and records
    each launch in the ``Launches`` it yields instead of running it (with its grid and arguments when
    ``keep_arguments``). Needs triton, and not its interpreter."""
    from triton.runtime import driver

    from . import _stubbed, interpreting

    if interpreting():
        raise RuntimeError("stubbed_launches: TRITON_INTERPRET=1 runs the kernels in the interpreter; unset it to "
                           "compile them for a GPU and stub their launches")
    launches = Launches(StubDevice(arch, multiprocessors), arguments=[] if keep_arguments else None,
                        heads=[] if keep_arguments else None)
    previous = driver._active  # None until a driver was first needed; reset_active() would need a GPU
    driver.set_active(_driver(launches.device, launches))
    token = _stubbed.set(launches.device)
    try:
        yield launches
    finally:
        _stubbed.reset(token)
        driver._active = previous
