"""Rungs 8-10 of the ladder: FlashAttention-1, FlashAttention-2 forward and backward.

All three tile ``Q`` into row blocks of ``B_r`` rows and ``K, V`` into blocks of ``B_c`` rows,
and touch HBM only through :class:`~flashattn.reference.hbm.HBMArray`, so an
:class:`~flashattn.reference.hbm.HBMCounter` passed as ``hbm`` sees exactly what they move.
``block_sizes=(B_r, B_c)`` overrides the sizes derived from the SRAM size ``M`` (in elements).
Shapes and masking follow :mod:`~flashattn.reference.attention`; the score blocks and the
``-inf``-safe statistics come from :mod:`~flashattn.reference.common`.  Everything but the data
(``Q, K, V``, and ``O, dO, L`` for the backward) is passed by keyword.

Under ``causal=True`` a ``(Q_i, K_j)`` block pair in which no query sees any key is skipped:
nothing is loaded for it and nothing is computed.
"""

from __future__ import annotations

from collections.abc import Callable
from math import ceil

import numpy as np

from flashattn.reference.common import finite_shift, lse_from_stats, prepare_inputs, safe_divide, split_range
from flashattn.reference.hbm import ALL, DEFAULT_SRAM, HBMArray, HBMCounter, as_counter

#: ``trace(event, **values)``: called by the tiled rungs at every block step with the on-chip values of that step
#: (``flashattn.explain`` records them to draw the algorithm); None, the default, costs one test per step.
Trace = Callable[..., None]

__all__ = [
    "fa1_block_sizes",
    "fa2_block_sizes",
    "flash_attention_v1",
    "flash_attention_v2_forward",
    "flash_attention_v2_backward",
]


def fa1_block_sizes(d: int, *, M: int) -> tuple[int, int]:
    """Algorithm 1, line 1: ``B_c = ceil(M / 4d)``, ``B_r = min(ceil(M / 4d), d)``.

    ``K_j, V_j`` (``2 B_c d``), ``Q_i, O_i`` (``2 B_r d``) and ``S_ij`` (``B_r B_c <= M / 4``)
    then fit in ``O(M)``.  ``K, V`` form the outer loop: the large ``B_c`` is the block kept
    resident, and the outer loop has ``T_c = N / B_c = 4 N d / M`` steps, each re-reading
    ``Q, O, l, m`` (``Theta(N d)``): ``Theta(N^2 d^2 / M)`` in all.

    >>> fa1_block_sizes(M=16384, d=64)
    (64, 64)
    >>> fa1_block_sizes(M=16384, d=16)
    (16, 256)
    """
    B = _quarter_block(d, M=M)
    return min(B, d), B


def fa2_block_sizes(d: int, *, M: int) -> tuple[int, int]:
    """FlashAttention-2 block sizes: ``B_r = ceil(M / 4d)``, ``B_c = min(ceil(M / 4d), d)``.

    FA-2 swaps the loops, ``Q`` outer and ``K, V`` inner, so the roles swap too.  The
    outer-loop block is the one kept resident (here ``Q_i`` and its accumulator); every
    outer step streams the whole of the inner operands (``K, V``: ``2 N d``) once.  Traffic
    is ``T_outer * 2 N d`` with ``T_outer = N / B_outer``, so the outer block is the one to
    make large: ``B_r = M / 4d`` gives ``T_r = 4 N d / M`` and ``Theta(N^2 d^2 / M)``.
    Giving the ``M / 4d`` to the streamed ``B_c`` instead would leave ``B_r <= d``, i.e.
    ``Theta(N^2 d / min(d, M/4d))`` traffic, no better than FA-1's inner loop.

    >>> fa2_block_sizes(M=16384, d=16)
    (256, 16)
    """
    B = _quarter_block(d, M=M)
    return B, min(B, d)


# The three arrays and every option by keyword (the SRAM size, scale, mask, tiles, counter and trace hook).
def flash_attention_v1(Q: np.ndarray, K: np.ndarray, V: np.ndarray, *, M: int = DEFAULT_SRAM,  # noqa: PLR0913
                       scale: float | None = None, causal: bool = False, block_sizes: tuple[int, int] | None = None,
                       hbm: HBMCounter | None = None, trace: Trace | None = None) -> np.ndarray:
    """Algorithm 1 (FlashAttention), line by line; ``K, V`` outer loop ``j``, ``Q`` inner loop ``i``.

    ``O, l, m`` live in HBM (initialised there, line 2) and are loaded and written back on
    every inner step.  Per block, on chip::

        S_ij   = scale Q_i K_j^T                                                     (line 9)
        m~_ij  = rowmax(S_ij),  P~_ij = exp(S_ij - m~_ij),  l~_ij = rowsum(P~_ij)      (line 10)
        m_new  = max(m_i, m~_ij),  l_new = e^{m_i - m_new} l_i + e^{m~_ij - m_new} l~_ij  (line 11)
        O_i   <- diag(l_new)^-1 (diag(l_i) e^{m_i - m_new} O_i + e^{m~_ij - m_new} P~_ij V_j)  (line 12)
        l_i   <- l_new,  m_i <- m_new                                                 (line 13)

    Line 12 renormalises ``O_i`` on every step: ``O_i`` is always the exact attention output
    over the keys seen so far.  Block sizes default to :func:`fa1_block_sizes` ``(d, M=M)``.
    ``trace("tile", rows=, cols=, S=, P=, m_old=, m_new=, l_old=, l_new=, rescale=, O=)`` sees every step.
    Shapes: ``Q (N_q, d)``, ``K (N_k, d)``, ``V (N_k, d_v)`` -> ``O (N_q, d_v)``.

    >>> Q = K = np.eye(2); V = np.array([[1.0], [3.0]])
    >>> flash_attention_v1(Q, K, V, scale=np.log(3.0), block_sizes=(1, 1))
    array([[1.5],
           [2.5]])
    """
    Q, K, V, scores = prepare_inputs(Q, K, V, scale=scale, causal=causal)
    (N_q, d), N_k = Q.shape, K.shape[0]
    B_r, B_c = _resolve_block_sizes(block_sizes, fa1_block_sizes, d, M=M)
    counter = as_counter(hbm)
    Qh, Kh, Vh, Oh = _in_hbm(Q, K, V, counter)
    lh = HBMArray(np.empty(N_q), counter, "l")
    mh = HBMArray(np.empty(N_q), counter, "m")
    Oh.store(ALL, ALL, 0.0)  # line 2
    lh.store(ALL, ALL, 0.0)
    mh.store(ALL, ALL, -np.inf)

    for cols in split_range(N_k, B_c):  # line 5
        K_j, V_j = Kh.load(cols), Vh.load(cols)  # line 6
        for rows in split_range(N_q, B_r):  # line 7
            if not scores.visible(rows, cols):  # causal: no query in Q_i sees a key in K_j
                continue
            Q_i, O_i, l_i, m_i = Qh.load(rows), Oh.load(rows), lh.load(rows), mh.load(rows)  # line 8
            S_ij = scores.block(Q_i, K_j, rows, cols)  # line 9
            m_tilde = S_ij.max(axis=1)  # line 10
            P_tilde = np.exp(S_ij - finite_shift(m_tilde)[:, None])
            l_tilde = P_tilde.sum(axis=1)
            m_new = np.maximum(m_i, m_tilde)  # line 11
            shift = finite_shift(m_new)
            old_weight = np.exp(m_i - shift)  # e^{m_i - m_new}; 0 while row i saw only -inf
            new_weight = np.exp(m_tilde - shift)  # e^{m~_ij - m_new}
            l_new = old_weight * l_i + new_weight * l_tilde
            unnormalised = (l_i * old_weight)[:, None] * O_i + new_weight[:, None] * (P_tilde @ V_j)
            Oh.store(rows, ALL, safe_divide(unnormalised, l_new[:, None]))  # line 12
            lh.store(rows, ALL, l_new)  # line 13
            mh.store(rows, ALL, m_new)
            if trace is not None:
                trace("tile", rows=rows, cols=cols, S=S_ij, P=P_tilde, m_old=m_i, m_new=m_new, l_old=l_i,
                      l_new=l_new, rescale=old_weight, O=Oh.data[rows])
    return Oh.data  # line 16


def flash_attention_v2_forward(Q: np.ndarray, K: np.ndarray, V: np.ndarray, *, M: int = DEFAULT_SRAM,  # noqa: PLR0913
                               scale: float | None = None, causal: bool = False,
                               block_sizes: tuple[int, int] | None = None,
                               hbm: HBMCounter | None = None, trace: Trace | None = None
                               ) -> tuple[np.ndarray, np.ndarray]:
    """FlashAttention-2 forward: ``Q`` outer loop ``i``, ``K, V`` inner loop ``j``, deferred normalisation.

    ``Q_i`` is loaded once; the accumulator ``O~_i`` and the row statistics stay on chip::

        S_ij   = scale Q_i K_j^T
        m_ij   = max(m_i(j-1), rowmax(S_ij))
        P~_ij  = exp(S_ij - m_ij)
        l_ij   = e^{m_i(j-1) - m_ij} l_i(j-1) + rowsum(P~_ij)
        O~_ij  = diag(e^{m_i(j-1) - m_ij}) O~_i(j-1) + P~_ij V_j          (no division)
      after the last j:
        O_i = diag(l_i)^-1 O~_i,   L_i = m_i + log(l_i)                    (one division)

    ``O`` and ``L`` are each written once; fully masked rows give ``O = 0``, ``L = -inf``.
    Block sizes default to :func:`fa2_block_sizes` ``(d, M=M)``. ``trace("tile", rows=, cols=, S=, P=, m_old=,
    m_new=, l_old=, l_new=, rescale=, O=)`` sees every step (``O``: the unnormalised accumulator), and
    ``trace("row", rows=, O=, L=)`` every finished row block.
    Shapes: ``Q (N_q, d)``, ``K (N_k, d)``, ``V (N_k, d_v)`` -> ``O (N_q, d_v)``, ``L (N_q,)``.

    >>> Q = K = np.eye(2); V = np.array([[1.0], [3.0]])
    >>> O, L = flash_attention_v2_forward(Q, K, V, scale=np.log(3.0), block_sizes=(1, 1))
    >>> O, L  # L_0 = log(3 + 1)
    (array([[1.5],
           [2.5]]), array([1.38629436, 1.38629436]))
    """
    Q, K, V, scores = prepare_inputs(Q, K, V, scale=scale, causal=causal)
    (N_q, d), (N_k, d_v) = Q.shape, V.shape
    B_r, B_c = _resolve_block_sizes(block_sizes, fa2_block_sizes, d, M=M)
    counter = as_counter(hbm)
    Qh, Kh, Vh, Oh = _in_hbm(Q, K, V, counter)
    Lh = HBMArray(np.empty(N_q, Q.dtype), counter, "L")

    for rows in split_range(N_q, B_r):
        Q_i = Qh.load(rows)
        acc = np.zeros((Q_i.shape[0], d_v), Q.dtype)
        m, l = np.full(Q_i.shape[0], -np.inf), np.zeros(Q_i.shape[0])
        for cols in split_range(N_k, B_c):
            if not scores.visible(rows, cols):  # causal: no query in Q_i sees a key in K_j
                continue
            S_ij = scores.block(Q_i, Kh.load(cols), rows, cols)
            m_new = np.maximum(m, S_ij.max(axis=1))
            shift = finite_shift(m_new)
            P_tilde = np.exp(S_ij - shift[:, None])
            rescale = np.exp(m - shift)  # e^{m_i(j-1) - m_ij}: old terms onto the new max
            l_new = rescale * l + P_tilde.sum(axis=1)
            acc = rescale[:, None] * acc + P_tilde @ Vh.load(cols)
            if trace is not None:
                trace("tile", rows=rows, cols=cols, S=S_ij, P=P_tilde, m_old=m, m_new=m_new, l_old=l, l_new=l_new,
                      rescale=rescale, O=acc)
            m, l = m_new, l_new
        Oh.store(rows, ALL, safe_divide(acc, l[:, None]))
        Lh.store(rows, ALL, lse_from_stats(m, l))
        if trace is not None:
            trace("row", rows=rows, O=Oh.data[rows], L=Lh.data[rows])
    return Oh.data, Lh.data


# Eleven parameters: the six arrays of the FA-2 paper's Algorithm 2 (Q, K, V, O, dO, L) and the
# forward's five keyword options; bundling the options would make the two calls read differently.
def flash_attention_v2_backward(  # noqa: PLR0913
    Q: np.ndarray, K: np.ndarray, V: np.ndarray, O: np.ndarray, dO: np.ndarray, L: np.ndarray, *,
    M: int = DEFAULT_SRAM, scale: float | None = None, causal: bool = False,
    block_sizes: tuple[int, int] | None = None, hbm: HBMCounter | None = None, trace: Trace | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashAttention-2 backward (FA-2 paper, Algorithm 2): gradients by recomputing ``P`` from ``L``.

    Preprocessing: ``D = rowsum(dO o O)`` (``D_i = dO_i . O_i = sum_j P_ij dP_ij``), written to
    HBM.  Then ``K, V`` outer loop ``j`` (``dK_j, dV_j`` accumulate on chip), ``Q`` inner loop ``i``::

        S_ij  = scale Q_i K_j^T
        P_ij  = exp(S_ij - L_i)                       (the softmax, recomputed, no N x N storage)
        dV_j += P_ij^T dO_i
        dP_ij = dO_i V_j^T
        dS_ij = P_ij o (dP_ij - D_i)                  (softmax Jacobian)
        dQ_i += scale dS_ij K_j                       (read-modify-write in HBM)
        dK_j += scale dS_ij^T Q_i

    The loop order is FA-1's (``K, V`` outer), so block sizes default to
    :func:`fa1_block_sizes` ``(d, M=M)``: the resident ``K_j, V_j, dK_j, dV_j`` block is the large one.
    Rows with ``L = -inf`` (fully masked) get zero gradient. ``trace("tile", rows=, cols=, S=, P=, dP=, dS=,
    dQ=, dK=, dV=)`` sees every step (dQ_i after the step; dK_j, dV_j accumulated so far), ``trace("col", cols=)``
    every finished key block.
    Shapes: ``Q (N_q, d)``, ``K (N_k, d)``, ``V (N_k, d_v)``, ``O, dO (N_q, d_v)``, ``L (N_q,)``
    -> ``dQ (N_q, d)``, ``dK (N_k, d)``, ``dV (N_k, d_v)``.

    >>> Q = K = np.eye(2); V = np.array([[1.0], [3.0]])
    >>> O, L = flash_attention_v2_forward(Q, K, V)
    >>> dQ, dK, dV = flash_attention_v2_backward(Q, K, V, O, np.ones_like(O), L)
    >>> dV.ravel()  # column sums of P, which are 1 by symmetry
    array([1., 1.])
    """
    Q, K, V, scores = prepare_inputs(Q, K, V, scale=scale, causal=causal)
    (N_q, d), (N_k, d_v) = Q.shape, V.shape
    B_r, B_c = _resolve_block_sizes(block_sizes, fa1_block_sizes, d, M=M)
    counter = as_counter(hbm)
    inputs = {"Q": Q, "K": K, "V": V, "O": O, "dO": dO, "L": L}
    Qh, Kh, Vh, Oh, dOh, Lh = (HBMArray(np.asarray(a), counter, name) for name, a in inputs.items())
    Dh = HBMArray(np.empty(N_q), counter, "D")
    dQh = HBMArray(np.empty((N_q, d), Q.dtype), counter, "dQ")
    dKh = HBMArray(np.empty((N_k, d), Q.dtype), counter, "dK")
    dVh = HBMArray(np.empty((N_k, d_v), Q.dtype), counter, "dV")

    for rows in split_range(N_q, B_r):
        Dh.store(rows, ALL, (dOh.load(rows) * Oh.load(rows)).sum(axis=1))
    dQh.store(ALL, ALL, 0.0)

    for cols in split_range(N_k, B_c):
        K_j, V_j = Kh.load(cols), Vh.load(cols)
        dK_j, dV_j = np.zeros_like(K_j), np.zeros_like(V_j)
        for rows in split_range(N_q, B_r):
            if not scores.visible(rows, cols):  # causal: no query in Q_i sees a key in K_j
                continue
            Q_i, dO_i, dQ_i, L_i, D_i = (a.load(rows) for a in (Qh, dOh, dQh, Lh, Dh))
            S_ij = scores.block(Q_i, K_j, rows, cols)
            P_ij = np.exp(S_ij - finite_shift(L_i)[:, None])  # L_i = -inf: S_ij is all -inf, P_ij = 0
            dV_j += P_ij.T @ dO_i
            dP_ij = dO_i @ V_j.T
            dS_ij = P_ij * (dP_ij - D_i[:, None])
            dQh.store(rows, ALL, dQ_i + scores.scale * (dS_ij @ K_j))
            dK_j += scores.scale * (dS_ij.T @ Q_i)
            if trace is not None:
                trace("tile", rows=rows, cols=cols, S=S_ij, P=P_ij, dP=dP_ij, dS=dS_ij, dQ=dQh.data[rows], dK=dK_j,
                      dV=dV_j)
        dKh.store(cols, ALL, dK_j)
        dVh.store(cols, ALL, dV_j)
        if trace is not None:
            trace("col", cols=cols)
    return dQh.data, dKh.data, dVh.data


def _in_hbm(Q: np.ndarray, K: np.ndarray, V: np.ndarray, counter: HBMCounter) -> tuple[HBMArray, ...]:
    """``Q, K, V`` and an uninitialised output ``O`` (``N_q x d_v``) as HBM arrays whose every block load and store
    ``counter`` tallies: where each forward rung starts."""
    Qh, Kh, Vh = (HBMArray(a, counter, name) for a, name in ((Q, "Q"), (K, "K"), (V, "V")))
    return Qh, Kh, Vh, HBMArray(np.empty((Q.shape[0], V.shape[1]), Q.dtype), counter, "O")


def _quarter_block(d: int, *, M: int) -> int:
    """``ceil(M / 4d)``: the rows of a ``d``-wide block that use a quarter of the SRAM."""
    if M < 1 or d < 1:
        raise ValueError(f"SRAM size M and head dim d must be >= 1, got M={M}, d={d}")
    return ceil(M / (4 * d))


def _resolve_block_sizes(
    block_sizes: tuple[int, int] | None, rule: Callable[..., tuple[int, int]], d: int, *, M: int
) -> tuple[int, int]:
    B_r, B_c = rule(d, M=M) if block_sizes is None else block_sizes
    if B_r < 1 or B_c < 1:
        raise ValueError(f"block sizes must be >= 1, got B_r={B_r}, B_c={B_c}")
    return int(B_r), int(B_c)
