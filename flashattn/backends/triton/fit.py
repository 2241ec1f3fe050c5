"""Configs that fit the GPU at hand: the launch-time guard on shared memory.

Triton checks a compiled kernel's shared memory against the device's per-block limit only when it first launches
it, and raises ``OutOfResources`` before anything runs. The tables are checked offline for every architecture of
every family (``tools.offline.health``), but a GPU outside them, a Triton whose pipelining needs more, or a card
with less than its family may still refuse a config: ``launch_fitting`` then steps down to a smaller one, logs it
once, and remembers it, instead of failing the call.

    >>> smaller(KernelConfig(128, 64, 8, 3))
    KernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)
    >>> smaller(KernelConfig(128, 64, 8, 1))
    KernelConfig(block_m=64, block_n=64, num_warps=8, num_stages=1)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Hashable

from triton.runtime.errors import OutOfResources

from ...errors import ArgumentError
from . import configs
from .configs import KernelConfig

_log = logging.getLogger("flashattn")
SMALLEST_TILE = 16  # the smallest tensor-core tile side
# (what, the table's config) -> the config that fitted: later calls start there.
_fitted: dict[tuple[Hashable, KernelConfig], KernelConfig] = {}


def smaller(cfg: KernelConfig) -> KernelConfig | None:
    """The next config to try when ``cfg`` needs more shared memory than the device has: one pipeline stage fewer
    (each stage buffers a K and a V tile), then half the longer tile side (the keys' on a tie), down to 16 x 16
    with one stage; None below that."""
    if cfg.num_stages > 1:
        return dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    if max(cfg.block_m, cfg.block_n) <= SMALLEST_TILE:
        return None
    if cfg.block_n >= cfg.block_m:
        return dataclasses.replace(cfg, block_n=cfg.block_n // 2)
    return dataclasses.replace(cfg, block_m=cfg.block_m // 2)


def _call(what: Hashable) -> str:
    """``what`` as a log line names it: (kernel, dtype, head dim, v head dim, device) from the launcher."""
    if not (isinstance(what, tuple) and len(what) == 5):
        return str(what)
    kernel, dtype, d, dv, device = what
    dims = str(d) if d == dv else f"{d}/{dv}"
    return f"{kernel} kernel, {str(dtype).removeprefix('torch.')}, head dim {dims}, {device}"


def _describe(cfg: KernelConfig) -> str:
    return f"{cfg.block_m}x{cfg.block_n} tile ({cfg.num_warps} warps, {cfg.num_stages} stages)"


def launch_fitting(cfg: KernelConfig, run: Callable[[KernelConfig], None], *, kernel: str, what: Hashable) -> None:
    """``run(cfg)``, which launches ``kernel`` (a ``configs.KERNELS`` name) with ``cfg``; where the device lacks
    the shared memory it needs, ``run`` again with ever ``smaller`` configs. ``what`` = (kernel, dtype, head dim,
    v head dim, device), what the shared memory depends on: the config that fitted is remembered under it (built
    per launch, so a tuple, formatted only when logged). A config forced by ``configs.use``
    is launched as it is."""
    if configs.forced(kernel) is not None:
        run(cfg)
        return
    table_cfg = cfg
    cfg = _fitted.get((what, table_cfg), table_cfg)
    while True:
        try:
            run(cfg)
        except OutOfResources as err:
            if err.name != "shared memory":
                raise
            step = smaller(cfg)
            if step is None:
                raise ArgumentError(f"flashattn: {_call(what)}: even a {_describe(cfg)} needs {err.required} bytes of "
                                 f"shared memory, this GPU allows {err.limit} per block") from err
            _log.warning("flashattn: %s: the %s needs %d bytes of shared memory, this GPU allows %d per block; "
                         "trying a %s", _call(what), _describe(cfg), err.required, err.limit, _describe(step))
            cfg = step
            continue
        _fitted[(what, table_cfg)] = cfg
        return
