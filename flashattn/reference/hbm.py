"""Counting HBM traffic by running the algorithms, not by typing in formulas.

The model is the one of the FlashAttention paper: a slow, large memory (HBM) and a fast
on-chip memory (SRAM) that holds ``M`` elements.  Every matrix an algorithm keeps "in HBM" is
an :class:`HBMArray`; the only way to touch it is :meth:`HBMArray.load` (HBM -> SRAM, a copy)
and :meth:`HBMArray.store` (SRAM -> HBM), and each call adds the number of elements moved to
an :class:`HBMCounter`.  Everything else is on-chip arithmetic and is free.

The algorithms in :mod:`~flashattn.reference.attention` and :mod:`~flashattn.reference.flash`
always run this way.  With ``hbm=None`` they get a :class:`NullCounter`, whose tally methods
do nothing: one code path, whether or not anybody is counting.

:func:`measure_traffic`, :func:`traffic_table` and :func:`crossover_sram` drive the algorithms on
random inputs and report what was counted; :func:`asymptotic_scale` gives the paper's
Theta-expressions, used only to normalise those counts (never as the count).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_SRAM",
    "ALGORITHMS",
    "HBMCounter",
    "NullCounter",
    "HBMArray",
    "as_counter",
    "measure_traffic",
    "traffic_table",
    "crossover_sram",
    "asymptotic_scale",
]

#: Default on-chip SRAM size ``M`` in elements (64 KiB of float32; an A100 SM has 192 KiB of
#: shared memory + L1).  With ``d = 64`` it gives the 64 x 64 tiles of the FlashAttention-1 paper.
DEFAULT_SRAM = 16 * 1024

#: Algorithms understood by :func:`measure_traffic`.
ALGORITHMS = ("standard", "flash1", "flash2_fwd", "flash2_bwd")

ALL = slice(None)


@dataclass
class HBMCounter:
    """Running tally of HBM reads and writes, in elements and in bytes.

    ``itemsize`` (bytes per element) overrides the dtype of every array registered with this
    counter, e.g. ``itemsize=2`` to cost float64 reference arithmetic as fp16 storage; ``None``
    uses each array's own ``itemsize``.  ``per_array`` maps an array's name to
    ``[reads, writes]`` in elements.

    >>> hbm = HBMCounter(itemsize=2)
    >>> Q = HBMArray(np.zeros((4, 3)), hbm, "Q")
    >>> _ = Q.load(rows=slice(0, 2))
    >>> hbm.reads, hbm.read_bytes, hbm.reads_of("Q")
    (6, 12, 6)
    """

    itemsize: int | None = None
    reads: int = 0
    writes: int = 0
    read_bytes: int = 0
    write_bytes: int = 0
    per_array: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Elements moved in either direction."""
        return self.reads + self.writes

    @property
    def total_bytes(self) -> int:
        """Bytes moved in either direction."""
        return self.read_bytes + self.write_bytes

    def record_read(self, name: str, elements: int, itemsize: int) -> None:
        """Tally ``elements`` read from the HBM array ``name``."""
        self.reads += elements
        self.read_bytes += elements * itemsize
        self.per_array.setdefault(name, [0, 0])[0] += elements

    def record_write(self, name: str, elements: int, itemsize: int) -> None:
        """Tally ``elements`` written to the HBM array ``name``."""
        self.writes += elements
        self.write_bytes += elements * itemsize
        self.per_array.setdefault(name, [0, 0])[1] += elements

    def reads_of(self, name: str) -> int:
        """Elements read from the array called ``name`` (0 if never touched)."""
        return self.per_array.get(name, [0, 0])[0]

    def writes_of(self, name: str) -> int:
        """Elements written to the array called ``name`` (0 if never touched)."""
        return self.per_array.get(name, [0, 0])[1]

    def as_dict(self) -> dict[str, int]:
        """``{"elements", "bytes", "reads", "writes"}``, the form :func:`measure_traffic` returns."""
        return {"elements": self.total, "bytes": self.total_bytes, "reads": self.reads, "writes": self.writes}


class NullCounter(HBMCounter):
    """A counter that counts nothing: what the algorithms use when ``hbm is None``."""

    def record_read(self, name: str, elements: int, itemsize: int) -> None:
        pass

    def record_write(self, name: str, elements: int, itemsize: int) -> None:
        pass


def as_counter(hbm: HBMCounter | None) -> HBMCounter:
    """``hbm`` itself, or a fresh :class:`NullCounter` when it is ``None``."""
    return NullCounter() if hbm is None else hbm


class HBMArray:
    """A 1-D or 2-D NumPy array that lives "in HBM": every access is tallied.

    ``load(rows, cols)`` returns a *copy* (the block now sits in SRAM; writing to it does not
    change HBM) and counts its elements as reads.  ``store(rows, cols, value)`` writes
    ``value`` (broadcast to the block) and counts the block's elements as writes.  For 1-D
    arrays ``cols`` must be the full slice.  :attr:`data` hands the underlying buffer to the
    caller without counting: it is how an algorithm "returns O", a pointer, not a copy.

    >>> hbm = HBMCounter()
    >>> O = HBMArray(np.zeros((2, 2)), hbm, "O")
    >>> O.store(slice(0, 1), ALL, 1.0)
    >>> O.data, hbm.writes, hbm.write_bytes
    (array([[1., 1.],
           [0., 0.]]), 2, 16)
    """

    def __init__(self, data: np.ndarray, counter: HBMCounter, name: str, itemsize: int | None = None):
        if data.ndim not in (1, 2):
            raise ValueError(f"HBMArray {name!r} must be 1-D or 2-D, got shape {data.shape}")
        self._data = data
        self.counter = counter
        self.name = name
        self.itemsize = itemsize or counter.itemsize or data.itemsize

    @property
    def shape(self) -> tuple[int, ...]:
        return self._data.shape

    @property
    def data(self) -> np.ndarray:
        return self._data

    def load(self, rows: slice = ALL, cols: slice = ALL) -> np.ndarray:
        """Copy ``self[rows, cols]`` to SRAM, counting its elements as reads."""
        block = self._data[self._index(rows, cols)].copy()
        self.counter.record_read(self.name, block.size, self.itemsize)
        return block

    def store(self, rows: slice, cols: slice, value: np.ndarray | float) -> None:
        """Write ``value`` to ``self[rows, cols]``, counting the block's elements as writes."""
        index = self._index(rows, cols)
        self._data[index] = value
        self.counter.record_write(self.name, self._data[index].size, self.itemsize)

    def _index(self, rows: slice, cols: slice) -> tuple[slice, ...]:
        if self._data.ndim == 2:
            return (rows, cols)
        if cols != ALL:
            raise IndexError(f"HBMArray {self.name!r} is 1-D: cols must be the full slice")
        return (rows,)


def measure_traffic(
    algorithm: str, N: int, d: int, M: int, itemsize: int = 2, causal: bool = False, seed: int = 0
) -> dict[str, int]:
    """Run ``algorithm`` once on random ``(N, d)`` inputs with SRAM size ``M`` and count HBM traffic.

    ``algorithm`` is one of :data:`ALGORITHMS`: ``"standard"`` (Algorithm 0, tiled),
    ``"flash1"`` (Algorithm 1), ``"flash2_fwd"`` and ``"flash2_bwd"`` (the backward alone: its
    inputs ``O``, ``L`` come from an uncounted forward).  Returns
    ``{"elements", "bytes", "reads", "writes"}``; bytes use ``itemsize`` per element.

    >>> t = measure_traffic("flash2_fwd", N=64, d=16, M=1024)
    >>> t["bytes"] == 2 * t["elements"]
    True
    """
    counter = HBMCounter(itemsize=itemsize)
    _runner(algorithm)(*_random_inputs(N, d, seed), M=M, causal=causal, hbm=counter)
    return counter.as_dict()


def traffic_table(
    Ns: Iterable[int],
    ds: Iterable[int],
    Ms: Iterable[int],
    algorithms: Sequence[str] = ALGORITHMS,
    itemsize: int = 2,
    causal: bool = False,
) -> list[dict[str, Any]]:
    """One row per ``(N, d, M, algorithm)``: the counted traffic plus the Theta-scale it is compared to.

    Row keys: ``algorithm, N, d, M, elements, bytes, reads, writes, scale, ratio`` where
    ``scale = asymptotic_scale(...)`` and ``ratio = elements / scale``.

    >>> [row["algorithm"] for row in traffic_table([32], [8], [256], ("standard", "flash1"))]
    ['standard', 'flash1']
    """
    rows = []
    for N in Ns:
        for d in ds:
            for M in Ms:
                for algorithm in algorithms:
                    counts = measure_traffic(algorithm, N, d, M, itemsize=itemsize, causal=causal)
                    scale = asymptotic_scale(algorithm, N, d, M)
                    row = {"algorithm": algorithm, "N": N, "d": d, "M": M, **counts}
                    rows.append({**row, "scale": scale, "ratio": counts["elements"] / scale})
    return rows


def crossover_sram(
    N: int,
    d: int,
    Ms: Iterable[int],
    algorithms: Sequence[str] = ("flash1", "flash2_fwd"),
    itemsize: int = 2,
    causal: bool = False,
) -> int | None:
    """Smallest ``M`` in ``Ms`` at which every flash forward in ``algorithms`` moves fewer elements than
    standard attention does with the same ``M``; ``None`` if there is none.

    Theory puts it near ``M ~ d^2``: flash costs ``Theta(N^2 d^2 / M)``, standard ``Theta(N^2)``.

    >>> crossover_sram(64, 8, [16, 64, 256, 1024]) in (64, 256)
    True
    """
    for M in sorted(Ms):
        standard = measure_traffic("standard", N, d, M, itemsize, causal)["elements"]
        flash = [measure_traffic(a, N, d, M, itemsize, causal)["elements"] for a in algorithms]
        if all(f < standard for f in flash):
            return M
    return None


def asymptotic_scale(algorithm: str, N: int, d: int, M: int) -> float:
    """The paper's Theta-expression for ``algorithm``, up to its constant.

    ``N d + N^2`` for standard attention; ``N^2 d^2 / M + N d`` for the FlashAttention passes
    (the ``N d`` term is the unavoidable read of the inputs, which dominates once
    ``M >= N d``).  Used to normalise counts, never as a count.

    Standard attention's bound assumes ``M >~ d^2``: below that its matmul tiles
    (:func:`~flashattn.reference.attention.standard_block_size`, ``b ~ M / 2d < d``) re-read
    ``K`` and ``V`` ``N / b`` times, and the count grows like ``N^2 d^2 / M`` as well.

    >>> asymptotic_scale("flash1", N=1024, d=64, M=65536)
    131072.0
    """
    _runner(algorithm)  # validates the name
    if algorithm == "standard":
        return float(N * d + N * N)
    return N * N * d * d / M + N * d


def _random_inputs(N: int, d: int, seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((N, d)) for _ in range(4))  # Q, K, V, dO


def _runner(algorithm: str) -> Callable[..., Any]:
    # Imported here: attention.py and flash.py import this module for HBMArray.
    from flashattn.reference.attention import standard_attention
    from flashattn.reference.flash import (
        flash_attention_v1,
        flash_attention_v2_backward,
        flash_attention_v2_forward,
    )

    def flash2_bwd(Q, K, V, dO, *, M, causal, hbm):
        O, L = flash_attention_v2_forward(Q, K, V, M=M, causal=causal)
        return flash_attention_v2_backward(Q, K, V, O, dO, L, M=M, causal=causal, hbm=hbm)

    runners = {
        "standard": lambda Q, K, V, dO, **kw: standard_attention(Q, K, V, **kw),
        "flash1": lambda Q, K, V, dO, **kw: flash_attention_v1(Q, K, V, **kw),
        "flash2_fwd": lambda Q, K, V, dO, **kw: flash_attention_v2_forward(Q, K, V, **kw),
        "flash2_bwd": flash2_bwd,
    }
    if algorithm not in runners:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    return runners[algorithm]
