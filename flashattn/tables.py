"""Aligned text tables, the one formatter of ``flashattn info``, the demo and every benchmark.

Example::

    >>> print(table([{"path": "cpu", "ms": 2.104}, {"path": "torch", "ms": 13.5}], [Col("path", left=True), "ms"]))
    path     ms
    -----  ----
    cpu    2.10
    torch  13.5
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Col", "table"]


@dataclass(frozen=True)
class Col:
    """One column: ``key`` looks the cell up in a dict row (a callable computes it), ``scale`` multiplies a number,
    ``fmt`` is a format spec ("sig": 3 significant digits, fixed-point above 0.01). Cells that are missing or None
    print "-". ``group`` is a heading over consecutive columns that share it (an implementation's name)."""

    header: str
    key: Hashable | Callable[[Mapping], object] = None
    fmt: str = "sig"
    scale: float = 1.0
    group: str = ""
    left: bool = False  # text columns (notes, errors) read better left-aligned

    def cell(self, row: Mapping | Sequence, index: int) -> str:
        if isinstance(row, Mapping):
            key = self.header if self.key is None else self.key
            value = key(row) if callable(key) else row.get(key)
        else:
            value = row[index]
        return _format(value, self.fmt, self.scale)


def _sig(x: float) -> str:
    """3 significant digits; fixed-point (1234, 12.3, 0.0123) except for the very small (2.17e-05)."""
    if x == 0 or not math.isfinite(x) or abs(x) < 0.01:
        return f"{x:.3g}"
    return f"{x:.{max(0, 2 - math.floor(math.log10(abs(x))))}f}"


def _format(value: object, fmt: str, scale: float) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if scale != 1:
        value = value * scale
    if fmt == "sig":
        return str(value) if isinstance(value, int) else _sig(value)
    return format(value, fmt)


def table(rows: Iterable[Mapping | Sequence], columns: Sequence[Col | str]) -> str:
    """Aligned text: a group heading line (when any column has a group), the headers, a rule, one line per row.

    ``rows`` are dicts (each column looks up its key, by default its header) or sequences (by position).
    """
    cols = [c if isinstance(c, Col) else Col(c) for c in columns]
    cells = [[c.cell(r, i) for i, c in enumerate(cols)] for r in rows]
    widths = [max(len(c.header), *(len(line[i]) for line in cells)) for i, c in enumerate(cols)]
    spans = _spans(cols)
    for group, start, stop in spans:  # widen a group's last column if its heading is longer than the columns
        short = len(group) - (sum(widths[start:stop]) + 2 * (stop - start - 1))
        widths[stop - 1] += max(0, short)

    def line(texts: Sequence[str]) -> str:
        return "  ".join(t.ljust(w) if c.left else t.rjust(w) for t, w, c in zip(texts, widths, cols, strict=True))

    out = []
    if any(group for group, _, _ in spans):
        out.append("  ".join(group.center(sum(widths[a:b]) + 2 * (b - a - 1)) for group, a, b in spans).rstrip())
    out += [line([c.header for c in cols]), line(["-" * w for w in widths]), *map(line, cells)]
    return "\n".join(s.rstrip() for s in out)


def _spans(cols: Sequence[Col]) -> list[tuple[str, int, int]]:
    spans: list[tuple[str, int, int]] = []
    for i, c in enumerate(cols):
        if spans and spans[-1][0] == c.group and c.group:
            spans[-1] = (c.group, spans[-1][1], i + 1)
        else:
            spans.append((c.group, i, i + 1))
    return spans
