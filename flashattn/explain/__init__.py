"""``flashattn explain``: FlashAttention stepped through tile by tile, from a real run of ``flashattn.reference``.

``record`` runs the ladder's tiled rungs on a small problem and keeps every step (``trace``); ``write_page``
turns that into one self-contained HTML file (inline script, style and data: opens from disk, no network);
``write_pictures`` draws the same trace as a PNG strip and an animated GIF for places HTML cannot go.

    >>> from flashattn.explain import record, write_page
    >>> path = write_page(record(n=8, d=4, block_rows=4, block_cols=4), Path(tempfile.mkdtemp()) / "explain.html")
    >>> path.stat().st_size < 2_000_000
    True
"""

from __future__ import annotations

import json
import tempfile  # noqa: F401  (the example above)
from pathlib import Path

from .trace import MAX_D, MAX_N, Problem, plain_attention, record

__all__ = ["MAX_D", "MAX_N", "PAGE_LIMIT", "Problem", "plain_attention", "record", "render_page", "write_page",
           "write_pictures"]

PAGE_LIMIT = 2_000_000  # bytes: the page travels as an attachment or a CI artifact


def render_page(trace: dict) -> str:
    """The page for ``trace`` (from ``record``), as text; a ValueError if it would exceed ``PAGE_LIMIT``."""
    template = (Path(__file__).parent / "page.html").read_text(encoding="utf-8")
    data = json.dumps(trace, allow_nan=False, separators=(",", ":")).replace("<", "\\u003c")  # no "</script>"
    html = template.replace("__TRACE__", data)
    if len(html.encode()) > PAGE_LIMIT:
        raise ValueError(f"the page would be {len(html.encode()) / 1e6:.1f} MB, over the {PAGE_LIMIT / 1e6:.0f} MB "
                         "limit: use a smaller --n or --d, or tiles closer to square")
    return html


def write_page(trace: dict, path: Path | str) -> Path:
    """Write the page for ``trace`` (from ``record``) to ``path``; returns the path."""
    html = render_page(trace)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html, encoding="utf-8")
    return path


def write_pictures(trace: dict, png: Path | str | None, gif: Path | str | None) -> list[Path]:
    """The trace as a PNG strip (every FlashAttention-2 step) and an animated GIF (one step a frame); needs
    matplotlib. Returns the paths written."""
    from .picture import draw

    return draw(trace, png=png, gif=gif)
