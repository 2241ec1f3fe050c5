"""Which kernel config a launch gets: the family's table entry (``tables.py``, ``families.py``), forced ones, and the
sizes the launcher derives (padded head dims, split-KV counts).

    >>> lookup("forward", 89, 128, "plain") == TABLES["sm86"]["forward"][(128, "plain")]
    True
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from ..environ import Variable, setting
from .families import FAMILIES, Family, family
from .measured import load as _load_measured
from .tables import KERNELS, ONE_PASS, OVERRIDES, TABLES, WEIGHTS, KernelConfig

__all__ = ["FAMILIES", "KERNELS", "MEASURED", "ONE_PASS", "OVERRIDES", "TABLES", "WEIGHTS", "Family", "KernelConfig",
           "family", "lookup", "shipped", "use", "forced", "tables_only", "split_heuristic", "padded_head_dim",
           "table_key", "one_pass_backward", "one_pass_tiles", "backward_passes"]

DECODE_MAX_ROWS = 16
# Under TRITON_INTERPRET=1 every program runs in Python: small square tiles keep test shapes cheap.
INTERPRETER = KernelConfig(32, 32, 1, 1)
PREPROCESS_BLOCK_M = 64
CONVERT_BLOCK = 1024  # elements a program of the one-pass backward's dQ rounding
MEASURED = _load_measured()  # family -> kernel -> (head dim, weight) -> config timed fastest on a GPU (measured.py)


def table_key(d: int, dv: int) -> int | tuple[int, int]:
    """The padded head dim a call of q/k head dim ``d`` and v head dim ``dv`` is looked up by, or the padded pair
    when they pad differently."""
    pd, pdv = padded_head_dim(d), padded_head_dim(dv)
    return pd if pd == pdv else (pd, pdv)


def lookup(kernel: str, arch: int | str, head_dim: int | tuple[int, int], weight: str, *,
           block_mask: bool = False, measured: bool = True) -> KernelConfig:
    """The config of ``kernel`` for a call of ``table_key`` ``head_dim`` and ``weight`` on ``arch`` (10 x major +
    minor, or a gfx name; ``families.family``): the most
    specific ``OVERRIDES`` entry (the call's head dims with and then without the block mask, then with a block mask
    its larger head dim), else the family's measured entry (``MEASURED``) where ``measured``, else its table entry,
    of the larger head dim. A measured entry was timed on dense q, k and v (``tools.gpu_tune``): calls on packed
    sequences or a KV cache compile to other loops (another pipelining, other registers), so the launcher passes
    ``measured=False`` for them and they keep the table's health-checked entry."""
    fam = family(arch).name
    largest = max(head_dim) if isinstance(head_dim, tuple) else head_dim
    if kernel == "dkdv_one_pass":  # its own entry where dkdv's spills, else dkdv's table entry (timed: two-pass)
        found = ONE_PASS.get(fam, {}).get((largest, weight)) if not block_mask else None
        if found is not None:
            return found
        kernel, measured = "dkdv", False
    for key in ((head_dim, weight, block_mask), (head_dim, weight, False), (largest, weight, block_mask)):
        found = OVERRIDES[fam].get(kernel, {}).get(key)
        if found is not None:
            return found
    measured = measured and not _tables_only.get()
    timed = MEASURED.get(fam, {}).get(kernel, {}).get((largest, weight)) if measured else None
    return timed if timed is not None else TABLES[fam][kernel][(largest, weight)]


def shipped() -> set[KernelConfig]:
    """Every distinct config of every table, override and measured entry."""
    return {cfg for tables in (TABLES, OVERRIDES, MEASURED) for kernels in tables.values()
            for table in kernels.values() for cfg in table.values()}


_forced: ContextVar[tuple[KernelConfig, tuple[str, ...]] | None] = ContextVar("flashattn_triton_config",
                                                                              default=None)


@contextmanager
def use(cfg: KernelConfig, kernels: tuple[str, ...] = KERNELS) -> Iterator[None]:
    """Launch ``kernels`` (``KERNELS`` names; all by default) with ``cfg`` inside the block, instead of the table's
    entry (also under the interpreter): how the health report tries candidates and the tests run each shipped
    tile."""
    token = _forced.set((cfg, kernels))
    try:
        yield
    finally:
        _forced.reset(token)


_tables_only: ContextVar[bool] = ContextVar("flashattn_triton_tables_only", default=False)


@contextmanager
def tables_only() -> Iterator[None]:
    """Inside the block, ``lookup`` passes over the measured entries: how the offline profile counts the tables'
    own configs, whose instruction counts judge the kernels' code (a measured entry is judged by its timing)."""
    token = _tables_only.set(True)
    try:
        yield
    finally:
        _tables_only.reset(token)


def context() -> tuple:
    """What ``use``, ``tables_only`` and ``FLASHATTN_TRITON_BACKWARD`` set, as one hashable value (part of a launch
    plan's key)."""
    return _forced.get(), _tables_only.get(), BACKWARD.get()


BACKWARD = Variable("FLASHATTN_TRITON_BACKWARD")
BACKWARDS = ("auto", "one-pass", "two-pass")


def one_pass_backward(arch: int | str, *, deterministic: bool, special: bool,
                      entry: tuple[int | tuple[int, int], str] | None = None) -> bool:
    """Whether a backward on ``arch`` (0: the interpreter) adds dQ up with atomics in its dK/dV kernel (one pass: 5
    matmuls a tile) instead of a dQ kernel of its own (two passes: 7, bitwise reproducible; ``kernels/backward.py``).
    ``FLASHATTN_TRITON_BACKWARD`` chooses: ``two-pass``; ``one-pass``, where ``one_pass_tiles`` has tiles for the
    table ``entry`` (head dims, weight; None: any), never for ``deterministic`` calls nor ``special`` ones (FP8
    q/k/v, a block mask); or ``auto`` (the default): two passes, until a GPU's timing of both decides where one pays.

        >>> one_pass_backward(90, deterministic=False, special=False)  # FLASHATTN_TRITON_BACKWARD unset
        False
    """
    value = BACKWARD.get("auto")
    if value not in BACKWARDS:
        raise ValueError(f"FLASHATTN_TRITON_BACKWARD={value!r} is not one of {', '.join(BACKWARDS)}")
    if value != "one-pass" or deterministic or special:
        return False
    return arch == 0 or one_pass_tiles(arch, *(entry or (None, None)))


def one_pass_tiles(arch: int | str, head_dim: int | tuple[int, int] | None, weight: str | None) -> bool:
    """Whether the one-pass dK/dV kernel has checked tiles on ``arch`` for (head dims, weight): its family has
    ``ONE_PASS`` entries (the others are unchecked) and none of them declines the entry (None); a None head dim
    asks for the family alone.

        >>> one_pass_tiles(90, 64, "plain"), one_pass_tiles(90, 128, "plain"), one_pass_tiles(86, 64, "plain")
        (True, False, False)
    """
    table = ONE_PASS.get(family(arch).name)
    if table is None or head_dim is None:
        return table is not None
    key = (padded_head_dim(max(head_dim) if isinstance(head_dim, tuple) else head_dim), weight)
    return key not in table or table[key] is not None


def backward_passes(chosen: str):
    """``FLASHATTN_TRITON_BACKWARD=chosen`` inside the ``with`` block (``environ.setting``): for tools that compile
    or time one backward."""
    if chosen not in BACKWARDS:
        raise ValueError(f"backward_passes: chosen={chosen!r} is not one of {', '.join(BACKWARDS)}")
    return setting(BACKWARD.name, chosen)


def forced(kernel: str) -> KernelConfig | None:
    """The config ``use`` forces on ``kernel``, if any."""
    found = _forced.get()
    return found[0] if found is not None and kernel in found[1] else None


PROGRAMS_PER_MULTIPROCESSOR = 2  # what ``split_heuristic`` fills: FlashAttention-2's rule for its 128-thread programs


def split_heuristic(programs: int, multiprocessors: int, key_blocks: int, max_splits: int = 128,
                    programs_each: int = PROGRAMS_PER_MULTIPROCESSOR) -> int:
    """How many key splits (flash-decoding) a forward launch of ``programs`` programs should use.

    Splitting helps only when the launch cannot fill the GPU's ``multiprocessors`` x ``programs_each`` program
    slots: a decode program (16 rows, 4 warps, its K/V pipeline under 100 KiB) leaves room for a second on its
    multiprocessor, whose loads then overlap the first's, so one program per multiprocessor leaves half the loads
    a decode step could have in flight. Then pick the fewest splits whose waves of programs fill the slots within
    85% of the best achievable, skipping counts that leave the keys per split unchanged (the same work, more
    merging). The rule of flash_attn's ``num_splits_heuristic`` (which also counts two programs a multiprocessor).

    Example::

        >>> split_heuristic(programs=4, multiprocessors=132, key_blocks=1024)  # batch 1, 4 kv heads, 64k keys
        57
        >>> split_heuristic(programs=4, multiprocessors=132, key_blocks=1024, programs_each=1)
        28
        >>> split_heuristic(programs=512, multiprocessors=132, key_blocks=512)
        1
    """
    slots = multiprocessors * programs_each
    if programs >= 0.8 * slots:
        return 1
    max_splits = max(1, min(max_splits, slots, key_blocks))

    def efficiency(splits: int) -> float:
        waves = programs * splits / slots
        return waves / math.ceil(waves)

    def useful(splits: int) -> bool:
        return splits == 1 or math.ceil(key_blocks / splits) != math.ceil(key_blocks / (splits - 1))

    best = max(efficiency(s) for s in range(1, max_splits + 1) if useful(s))
    return next(s for s in range(1, max_splits + 1) if useful(s) and efficiency(s) >= 0.85 * best)


def padded_head_dim(d: int) -> int:
    return max(16, 1 << (max(d, 1) - 1).bit_length())
