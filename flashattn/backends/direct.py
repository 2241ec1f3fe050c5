"""Launching a small Triton kernel without Triton's per-call argument binding.

``kernel[grid](*args)`` specializes every argument (integers equal to 1 or divisible by 16, pointer alignment) to
find the compiled kernel: tens of microseconds of host time, more than a small kernel takes on a GPU. A kernel
declared with ``do_not_specialize`` for all its integer and pointer arguments compiles to one binary per pattern of
absent (None) tensors, tensor dtypes, integer widths (32 or 64 bits) and constants, so ``launch`` compiles it once
through Triton and calls that binary's launcher directly after. Used by the device checks of index values
(``flashattn.checks.on_device``) and the KV-cache append (``flashattn.kvcache``); works under the offline stub
driver (``backends.triton.stub``), and under Triton's interpreter (where every call runs through Triton).

Example::

    launch(check_cache_kernel, (1, 1, 1), args, device=q.device, constants=3)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .triton import _stubbed, interpreting


def hooked(enter, leave) -> bool:
    """Whether Triton's launch hooks see launches (and so need each launch's metadata): its hooks are chains
    (triton.knobs.HookChain), and an empty one sees none. Also read by the launch plans (``triton/plans.py``)."""
    return ((enter is not None and bool(getattr(enter, "calls", True)))
            or (leave is not None and bool(getattr(leave, "calls", True))))


_COMPILED: dict[tuple, tuple] = {}  # (kernel, argument kinds, constants, device, stubbed GPU) -> its launcher


def _kind(arg: object) -> object:
    if type(arg) is int:
        return -0x80000000 <= arg <= 0x7FFFFFFF
    return None if arg is None else arg.dtype


def _key(kernel, args: tuple, device: torch.device, constants: int) -> tuple:
    # What the binary depends on besides the constants: each tensor's dtype (its pointer type), which arguments are
    # None, and each integer's width (Triton passes one past 32 bits as a 64-bit argument).
    return (id(kernel), *map(_kind, args[:-constants]), *args[-constants:], device, _stubbed.get())


def launch(kernel, grid: tuple[int, int, int], args: tuple, *, device: torch.device, constants: int) -> None:
    """``kernel[grid](*args)``; the last ``constants`` arguments are its ``tl.constexpr`` ones (hashable), the
    others tensors, None or integers it does not specialize on."""
    if device.index is not None and device.type == "cuda" and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            return launch(kernel, grid, args, device=device, constants=constants)
    key = _key(kernel, args, device, constants)
    launcher = _COMPILED.get(key)
    if launcher is None:
        compiled = kernel[grid](*args)
        if not interpreting():
            from triton import knobs
            from triton.runtime import driver

            _COMPILED[key] = compiled, driver, knobs, _entry(compiled)
        return
    compiled, driver, knobs, found = launcher
    stream = driver.active.get_current_stream(driver.active.get_current_device())
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    meta = compiled.launch_metadata(grid, stream, *args) if hooked(enter, leave) else None
    if found is None:
        compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, meta, enter, leave, *args)
    else:
        found.launch(*grid, stream, compiled.function, found.cooperative, found.pdl, None, None,
                     compiled.packed_metadata, meta, enter, leave, *args)


def _entry(compiled):
    """The kernel's C entry (``triton/entry.py``: these kernels take no descriptors), called past the Python of
    Triton's launcher; None where there is none to call."""
    from .triton.entry import entry

    found = entry(compiled)
    return None if found is None or found.descriptors else found


def prepared(kernel, grid: tuple[int, int, int], args: tuple, *, device: torch.device, constants: int,
             count: int) -> Callable[[tuple], None] | None:
    """``launch`` of ``kernel`` with ``args`` fixed but for its first ``count``, which each call brings (tensors of
    the same kinds: dtypes, None where None), once ``launch`` compiled it for these arguments (else None): the
    compiled kernel's launcher called at once, for calls of one signature (``flashattn.fastpath``), on the device
    current when they run (the signature's context)."""
    launcher = _COMPILED.get(_key(kernel, args, device, constants))
    if launcher is None:
        return None
    compiled, driver, knobs, found = launcher
    rest = args[count:]
    function, metadata, runtime, active = compiled.function, compiled.packed_metadata, knobs.runtime, driver.active
    if found is None:
        run, head = compiled.run, (function, metadata)
    else:  # the C entry's arguments between the stream and the launch metadata
        run, head = found.launch, (function, found.cooperative, found.pdl, None, None, metadata)

    def launch_with(given: tuple) -> None:
        stream = active.get_current_stream(active.get_current_device())
        enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
        meta = compiled.launch_metadata(grid, stream, *given, *rest) if hooked(enter, leave) else None
        run(*grid, stream, *head, meta, enter, leave, *given, *rest)

    return launch_with
