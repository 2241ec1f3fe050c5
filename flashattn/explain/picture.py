"""The explain trace as pictures: a PNG strip of FlashAttention-2's steps and an animated GIF, one step a frame.

Each panel is the N x N score matrix that is never stored: the tiles visited so far, coloured by the weights
exp(S_ij - m) they contributed when visited, this step's tile outlined, and the step's HBM traffic against
standard attention's. Drawn from the trace, the same numbers the page shows.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

STRIP_COLUMNS = 6  # panels per row of the PNG


def draw(trace: dict, *, png: Path | str | None, gif: Path | str | None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = trace["fa2"]["steps"]
    written = []
    if png is not None:
        columns = min(STRIP_COLUMNS, len(steps))
        rows = math.ceil(len(steps) / columns)
        fig, axes = plt.subplots(rows, columns, figsize=(2.6 * columns, 2.9 * rows + 0.6), squeeze=False)
        for k, ax in enumerate(axes.flat):
            if k < len(steps):
                _panel(ax, trace, k)
            else:
                ax.axis("off")
        fig.suptitle(_headline(trace), fontsize=10)
        fig.tight_layout()
        written.append(_save(fig, png, plt))
    if gif is not None:
        from matplotlib.animation import FuncAnimation, PillowWriter

        fig, ax = plt.subplots(figsize=(4.2, 4.6))

        def frame(k: int) -> None:
            ax.clear()
            _panel(ax, trace, k)
            fig.suptitle(_headline(trace), fontsize=7)

        movie = FuncAnimation(fig, frame, frames=len(steps), interval=900)
        path = Path(gif)
        path.parent.mkdir(parents=True, exist_ok=True)
        movie.save(path, writer=PillowWriter(fps=1.2))
        plt.close(fig)
        written.append(path)
    return written


def _panel(ax, trace: dict, k: int) -> None:
    from matplotlib.patches import Rectangle

    n = trace["problem"]["n"]
    weights = np.full((n, n), np.nan)
    for step in trace["fa2"]["steps"][: k + 1]:
        (r0, r1), (c0, c1) = step["rows"], step["cols"]
        weights[r0:r1, c0:c1] = np.array(step["P"], dtype=float)
    ax.imshow(weights, cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
    step = trace["fa2"]["steps"][k]
    (r0, r1), (c0, c1) = step["rows"], step["cols"]
    ax.add_patch(Rectangle(
        (c0 - 0.5, r0 - 0.5), c1 - c0, r1 - r0, fill=False, edgecolor="#d62728", linewidth=2))
    ax.set_xticks([])
    ax.set_yticks([])
    std = trace["standard"]["hbm"]
    moved, standard = step["hbm"]["reads"] + step["hbm"]["writes"], std["reads"] + std["writes"]
    m_change = max((abs(a - b) for a, b in zip(step["m_new"], step["m_old"], strict=True)
                    if a is not None and b is not None), default=0.0)
    ax.set_title(f"step {k + 1}: Q[{r0}:{r1}] x K[{c0}:{c1}]\nmax shift of m {m_change:.2f}\n"
                 f"HBM {moved} of standard's {standard}", fontsize=7)


def _headline(trace: dict) -> str:
    p = trace["problem"]
    return (f"FlashAttention-2 on N={p['n']}, d={p['d']}, {p['block_rows']}x{p['block_cols']} tiles"
            f"{', causal' if p['causal'] else ''}: the N x N weights, tile by tile (never stored); "
            f"max |O - softmax(QK^T)V| = {trace['check']['fa2']:.1e}")


def _save(fig, path: Path | str, plt) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
