"""Record FlashAttention as ``flashattn.reference`` runs it: every block step's on-chip values and every HBM
block access, for FlashAttention-1, FlashAttention-2's forward and its backward, beside standard attention's
traffic and the plain formula.

The numbers come from the reference functions themselves (their ``trace`` hook and an ``HBMCounter`` that notes
where each block comes from), not from a second implementation.

    >>> trace = record(n=8, d=4, block_rows=4, block_cols=4)
    >>> first = trace["fa2"]["steps"][0]
    >>> len(trace["fa2"]["steps"]), {"S", "P", "m_new", "l_new", "rescale", "O", "accesses"} <= set(first)
    (4, True)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import reference
from ..reference.hbm import HBMCounter

MAX_N = 64  # a page that stays small (every step's tiles are in it) and a grid that still reads
MAX_D = 16
MAX_STEPS = 256  # tile steps of one pass: each carries its tiles, and a slider of more is no longer a story


@dataclass(frozen=True)
class Problem:
    """The small attention problem the page steps through: Q, K, V (n, d) from ``seed``, tiles of
    ``block_rows`` queries by ``block_cols`` keys."""

    n: int = 12
    d: int = 4
    block_rows: int = 4
    block_cols: int = 4
    causal: bool = False
    seed: int = 0

    def problems(self) -> list[str]:
        """What is wrong with these options, for a usage error (empty when they are fine)."""
        found = []
        if not 1 <= self.n <= MAX_N:
            found.append(f"--n must be in [1, {MAX_N}] (the page holds every step's tiles), got {self.n}")
        if not 1 <= self.d <= MAX_D:
            found.append(f"--d must be in [1, {MAX_D}], got {self.d}")
        for name, size in (("--block-rows", self.block_rows), ("--block-cols", self.block_cols)):
            if not 1 <= size <= max(self.n, 1):
                found.append(f"{name} must be in [1, n={self.n}], got {size}")
            elif self.n % size:
                found.append(f"{name} must divide n={self.n} (whole tiles), got {size}")
        if not found and (self.n // self.block_rows) * (self.n // self.block_cols) > MAX_STEPS:
            found.append(f"n={self.n} in tiles of {self.block_rows} x {self.block_cols} makes "
                         f"{(self.n // self.block_rows) * (self.n // self.block_cols)} steps; at most {MAX_STEPS} "
                         "fit a page: use larger tiles")
        if self.seed < 0:
            found.append(f"--seed must be >= 0, got {self.seed}")
        return found


class _Recorder(HBMCounter):
    """An HBM counter that also keeps each step: the block accesses since the last step and the step's values."""

    def __init__(self):
        super().__init__()
        self.steps: list[dict] = []
        self._pending: list[dict] = []

    def note_access(self, name: str, kind: str, index: tuple[slice, ...]) -> None:
        rows = index[0]
        self._pending.append({"array": name, "kind": kind, "rows": _span(rows, None)})

    def __call__(self, event: str, *, rows: slice | None = None, cols: slice | None = None, **values) -> None:
        if event in ("row", "col"):  # a finished row block (FA-2) or key block (the backward): its writes belong
            last = self.steps[-1]   # to the step that finished it
            if values:
                last[f"{event}_done"] = {k: _plain(v) for k, v in values.items()}
            last["accesses"] += self._pending
        else:
            self.steps.append({"rows": _span(rows), "cols": _span(cols), "accesses": self._pending,
                               **{k: _plain(v) for k, v in values.items()}})
        self._pending = []
        self.steps[-1]["hbm"] = {"reads": self.reads, "writes": self.writes}

    def finish(self) -> dict:
        """The steps, with accesses after the last one (FA-1's final K/V loop end, the backward's dK/dV) folded
        into it, and the totals."""
        if self.steps and self._pending:
            self.steps[-1]["accesses"] += self._pending
            self.steps[-1]["hbm"] = {"reads": self.reads, "writes": self.writes}
        return {"steps": self.steps, "hbm": {"reads": self.reads, "writes": self.writes}}


def record(*, n: int = 12, d: int = 4, block_rows: int = 4, block_cols: int = 4, causal: bool = False,
           seed: int = 0) -> dict:
    """Run the reference ladder's tiled rungs on one small problem and return what a page needs (JSON-able).

    Keys: ``problem``; ``inputs`` (Q, K, V, dO); ``fa1``, ``fa2``, ``backward`` (``steps``, ``hbm`` totals,
    results); ``standard`` (standard attention's O and traffic); ``check`` (each result's max error against
    the plain formula softmax(scale Q K^T) V, computed here in NumPy).
    """
    problem = Problem(n, d, block_rows, block_cols, causal, seed)
    if problem.problems():
        raise ValueError("; ".join(problem.problems()))
    rng = np.random.default_rng(seed)
    Q, K, V, dO = (np.round(rng.standard_normal((n, d)), 2) for _ in range(4))  # short numbers on the page
    scale = 1 / np.sqrt(d)
    blocks = (block_rows, block_cols)

    fa1 = _Recorder()
    O1 = reference.flash_attention_v1(Q, K, V, scale=scale, causal=causal, block_sizes=blocks, hbm=fa1, trace=fa1)
    fa2 = _Recorder()
    O2, L = reference.flash_attention_v2_forward(Q, K, V, scale=scale, causal=causal, block_sizes=blocks, hbm=fa2,
                                                 trace=fa2)
    bwd = _Recorder()
    dQ, dK, dV = reference.flash_attention_v2_backward(Q, K, V, O2, dO, L, scale=scale, causal=causal,
                                                       block_sizes=blocks, hbm=bwd, trace=bwd)
    standard = HBMCounter()
    O0 = reference.standard_attention(Q, K, V, scale=scale, causal=causal, M=block_rows * block_cols * 4,
                                      hbm=standard)
    plain = plain_attention(Q, K, V, scale=scale, causal=causal)
    return {
        "problem": {**problem.__dict__, "scale": scale},
        "inputs": {"Q": _plain(Q), "K": _plain(K), "V": _plain(V), "dO": _plain(dO)},
        "fa1": {**fa1.finish(), "O": _plain(O1)},
        "fa2": {**fa2.finish(), "O": _plain(O2), "L": _plain(L)},
        "backward": {**bwd.finish(), "dQ": _plain(dQ), "dK": _plain(dK), "dV": _plain(dV)},
        "standard": {"O": _plain(O0), "hbm": {"reads": standard.reads, "writes": standard.writes}},
        "plain": _plain(plain),
        "check": {name: float(np.abs(out - plain).max()) for name, out in (("fa1", O1), ("fa2", O2), ("standard", O0))},
    }


def plain_attention(Q: np.ndarray, K: np.ndarray, V: np.ndarray, *, scale: float, causal: bool) -> np.ndarray:
    """softmax(scale Q K^T) V in one line of NumPy (rows that see no key: 0), the page's final check."""
    S = scale * Q @ K.T
    if causal:  # bottom-right aligned, as the ladder's causal mask; here N_q = N_k
        S = np.where(np.tri(*S.shape, dtype=bool), S, -np.inf)
    P = np.exp(S - S.max(axis=1, keepdims=True))
    return (P / P.sum(axis=1, keepdims=True)) @ V


def _span(s: slice | None, default=None) -> list[int] | None:
    return default if s is None or s == slice(None) else [s.start, s.stop]


def _plain(x) -> object:
    """JSON numbers: arrays to nested lists (copies), rounded to 6 decimals (the page shows 3); -inf (a row that
    has seen no key yet) to None."""
    a = np.asarray(x, dtype=float)
    return np.where(np.isfinite(a), a.round(6), None).tolist()
