"""A compiled kernel's C entry, below the Python of Triton 3.6's launcher, for the launch plans (``plans.py``).

On Triton 3.6 every launch passes two Python layers before the C function that parses its arguments and calls
the driver: ``CudaLauncher.__call__`` (scratch buffers), then, for a kernel that takes host TMA descriptors,
``wrap_handle_tensordesc``'s loop over every argument (seventy-odd in the attention kernels) that expands each
descriptor into the driver's tensor map (``fill_tma_descriptor``), its shape and its strides: about 7 us a launch
on a server CPU before the encodes, three times in a training step. A plan knows once where its descriptors sit
and what all but their base pointers expand to, so it calls the C entry itself with the expansion written out
(``plans._writer``): per descriptor, one encode. Later releases pass the kernel's arguments to C as one tuple
(their Python is already lean) and keep ``compiled.run``; so does any launcher of another shape.

Example::

    found = entry(compiled)    # None: launch by compiled.run
    if found is not None:
        found.launch(gx, gy, gz, stream, compiled.function, found.cooperative, found.pdl, None, None,
                     compiled.packed_metadata, None, enter, leave, *expanded_arguments)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NamedTuple

from . import installed_release


class Entry(NamedTuple):
    """The C entry of one compiled kernel and what a call of it needs besides the kernel's arguments."""

    launch: Callable  # (gx, gy, gz, stream, function, cooperative, pdl, scratch, profile scratch, metadata,
    #                   launch metadata, enter hook, exit hook, *arguments with each descriptor expanded)
    cooperative: bool
    pdl: bool
    descriptors: dict[int, dict | None]  # argument position -> the descriptor's compiled metadata (None: unlowered)


_WRAPPER_CELLS = {"launcher", "tensordesc_indices", "tensordesc_meta"}  # 3.6's wrap_handle_tensordesc closure


def entry(compiled) -> Entry | None:
    """The C entry of ``compiled`` (a Triton ``CompiledKernel`` whose handles are loaded), or None where its
    launcher is not Triton 3.6's, or needs scratch buffers (allocated per launch by the launcher)."""
    if installed_release() != (3, 6):
        return None
    launcher = compiled.run
    if getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1):
        return None
    wrapped = getattr(launcher, "launch", None)
    cooperative, pdl = getattr(launcher, "launch_cooperative_grid", None), getattr(launcher, "launch_pdl", None)
    if wrapped is None or type(cooperative) is not bool or type(pdl) is not bool:
        return None
    code = getattr(wrapped, "__code__", None)
    if code is None:  # no descriptors: the launcher holds the C entry itself
        return Entry(wrapped, cooperative, pdl, {})
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in wrapped.__closure__ or ()), strict=False))
    if set(cells) != _WRAPPER_CELLS or len(cells["tensordesc_indices"]) != len(cells["tensordesc_meta"]):
        return None
    return Entry(cells["launcher"], cooperative, pdl,
                 dict(zip(sorted(cells["tensordesc_indices"]), cells["tensordesc_meta"], strict=True)))


def expansion(fields: dict, meta: dict | None) -> tuple[tuple | None, tuple]:
    """What a descriptor with ``fields`` (shape, strides, block_shape, padding) becomes among the C entry's
    arguments, as 3.6's ``make_tensordesc_arg`` makes it: (the encode's arguments after the base pointer, or None
    where the descriptor is passed as its base tensor; the constants after the map or the base)."""
    shape, strides = list(fields["shape"]), list(fields["strides"])
    if meta is None:  # the kernel reads the descriptor's fields, not a tensor map
        return None, (*shape, *strides, fields["padding"] == "nan", *shape, *strides)
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    if meta["fp4_padded"]:  # the doubled shape is both encoded and passed
        shape[-1] *= 2
    return ((meta["swizzle"], meta["elem_size"], TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]], meta["block_size"],
             shape, strides, 1 if fields["padding"] == "nan" else 0), (*shape, *strides))


class TensorMaps:
    """One descriptor slot's tensor maps by base pointer: everything else it encodes is the plan's, so a pointer
    seen before (the caching allocator hands a training loop's tensors the same addresses) reuses its map instead
    of the driver's encode. Holds at most ``LIMIT`` maps (past it, starts over)."""

    LIMIT = 16

    def __init__(self, fill: Callable, encode: tuple):
        self._fill, self._encode = fill, encode
        self._maps: dict[int, object] = {}

    def __call__(self, pointer: int) -> object:
        found = self._maps.get(pointer)
        if found is None:
            if len(self._maps) >= self.LIMIT:
                self._maps.clear()
            found = self._maps[pointer] = self._fill(pointer, *self._encode)
        return found


def fill_tma_descriptor() -> Callable:
    """The driver's tensor-map encoder, as Triton 3.6's launcher calls it."""
    from triton.runtime import driver

    return driver.active.utils.fill_tma_descriptor


def descriptor_kinds() -> tuple[type, ...]:
    """The host TMA descriptor classes a launch may take: ``tl``'s, and Gluon's (the Hopper tier's) once its module
    is loaded (before, no argument can be one; looked up here so that plans never import Gluon)."""
    gluon = sys.modules.get("triton.experimental.gluon.nvidia.hopper")
    from triton.tools.tensor_descriptor import TensorDescriptor

    return (TensorDescriptor,) if gluon is None else (TensorDescriptor, gluon.TensorDescriptor)
