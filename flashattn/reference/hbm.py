"""The HBM model: arrays in slow memory whose every block load and store is counted.

The model is the one of the FlashAttention paper: a slow, large memory (HBM) and a fast
on-chip memory (SRAM) that holds ``M`` elements.  Every matrix an algorithm keeps "in HBM" is
an :class:`HBMArray`; the only way to touch it is :meth:`HBMArray.load` (HBM -> SRAM, a copy)
and :meth:`HBMArray.store` (SRAM -> HBM), and each call adds the number of elements moved to
an :class:`HBMCounter`.  Everything else is on-chip arithmetic and is free.

The algorithms in :mod:`~flashattn.reference.attention` and :mod:`~flashattn.reference.flash`
always run this way.  With ``hbm=None`` they get a :class:`NullCounter`, whose tally methods
do nothing: one code path, whether or not anybody is counting.

This module is only the counting machinery and knows no algorithm; running the algorithms and
reporting what they moved is :mod:`~flashattn.reference.traffic`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "DEFAULT_SRAM",
    "ALL",
    "HBMCounter",
    "NullCounter",
    "HBMArray",
    "as_counter",
]

#: Default on-chip SRAM size ``M`` in elements (64 KiB of float32; an A100 SM has 192 KiB of
#: shared memory + L1).  With ``d = 64`` it gives the 64 x 64 tiles of the FlashAttention-1 paper.
DEFAULT_SRAM = 16 * 1024

#: The whole of an axis, as a block: ``A.load(rows, ALL)`` loads whole rows.
ALL = slice(None)


@dataclass(kw_only=True)
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

    def note_access(self, name: str, kind: str, index: tuple[slice, ...]) -> None:
        """Called with every load (``kind`` "read") and store ("write") and the block's ``index``; a hook for
        recorders (``flashattn.explain``), which see where each block comes from. The tally does not need it."""

    def reads_of(self, name: str) -> int:
        """Elements read from the array called ``name`` (0 if never touched)."""
        return self.per_array.get(name, [0, 0])[0]

    def writes_of(self, name: str) -> int:
        """Elements written to the array called ``name`` (0 if never touched)."""
        return self.per_array.get(name, [0, 0])[1]

    def as_dict(self) -> dict[str, int]:
        """``{"elements", "bytes", "reads", "writes"}``, the form
        :func:`~flashattn.reference.traffic.measure_traffic` returns."""
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

    def __init__(self, data: np.ndarray, counter: HBMCounter, name: str, *, itemsize: int | None = None):
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
        index = self._index(rows, cols)
        block = self._data[index].copy()
        self.counter.record_read(self.name, block.size, self.itemsize)
        self.counter.note_access(self.name, "read", index)
        return block

    def store(self, rows: slice, cols: slice, value: np.ndarray | float) -> None:
        """Write ``value`` to ``self[rows, cols]``, counting the block's elements as writes."""
        index = self._index(rows, cols)
        self._data[index] = value
        self.counter.record_write(self.name, self._data[index].size, self.itemsize)
        self.counter.note_access(self.name, "write", index)

    def _index(self, rows: slice, cols: slice) -> tuple[slice, ...]:
        if self._data.ndim == 2:
            return (rows, cols)
        if cols != ALL:
            raise IndexError(f"HBMArray {self.name!r} is 1-D: cols must be the full slice")
        return (rows,)
