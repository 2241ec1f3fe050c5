"""Rungs 5-7 of the ladder: standard attention (Algorithm 0), 2-pass and 1-pass attention.

Conventions shared by every attention function in :mod:`flashattn.reference`:

* one head: ``Q`` is ``(N_q, d)``, ``K`` is ``(N_k, d)``, ``V`` is ``(N_k, d_v)``, ``O`` is ``(N_q, d_v)``;
* ``S = scale * Q K^T`` with ``scale = d ** -0.5`` unless given;
* ``causal=True`` is bottom-right aligned: query ``i`` sees key ``j`` iff ``j <= i + N_k - N_q``
  (the last query sees every key).  When ``N_q > N_k`` the first ``N_q - N_k`` queries see
  nothing; their output is 0 and their log-sum-exp is ``-inf``;
* inputs are promoted to at least float32 and computed in that dtype.

:func:`standard_attention` is *the* Algorithm 0 of the ladder, written as the paper states it:
three passes that materialise ``S`` and ``P`` in HBM, with every HBM access going through
:class:`~flashattn.reference.hbm.HBMArray`.  There is no second "simple" implementation: with
``hbm=None`` the same tiled code runs and nothing is tallied.

The 2-pass and 1-pass rungs are the online softmax of :mod:`~flashattn.reference.softmax`
applied to a row of scores, so they take its two passes from there; the score blocks, masks
and ``-inf``-safe arithmetic come from :mod:`~flashattn.reference.common`, as for every rung.
"""

from __future__ import annotations

from collections.abc import Callable
from math import isqrt

import numpy as np

from flashattn.reference.common import Scores, finite_shift, lse_from_stats, prepare_inputs, safe_divide, split_range
from flashattn.reference.hbm import ALL, DEFAULT_SRAM, HBMArray, HBMCounter, as_counter
from flashattn.reference.softmax import online_softmax_stats, softmax_from_stats

__all__ = [
    "standard_attention",
    "standard_block_size",
    "two_pass_attention",
    "one_pass_attention",
]


def standard_block_size(d: int, *, M: int) -> int:
    """Largest square tile ``b`` with ``2 b d + b^2 <= M`` (at least 1).

    In Algorithm 0's line 1 a ``b x d`` block of ``Q``, a ``b x d`` block of ``K`` and the
    ``b x b`` block of ``S`` must be on chip together; line 3 is the same with ``P`` and ``V``.
    ``(b + d)^2 <= d^2 + M`` is that inequality, hence the integer square root.

    >>> standard_block_size(M=4 * 64 * 64, d=64)  # a little above d
    79
    """
    return max(1, isqrt(d * d + M) - d)


def standard_attention(
    Q: np.ndarray,
    K: np.ndarray,
    V: np.ndarray,
    *,
    scale: float | None = None,
    causal: bool = False,
    return_lse: bool = False,
    M: int = DEFAULT_SRAM,
    hbm: HBMCounter | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Algorithm 0, standard attention: ``S = scale Q K^T``, ``P = softmax(S)``, ``O = P V``.

    1. Load ``Q, K`` by blocks from HBM, compute ``S = Q K^T``, write ``S`` to HBM.
    2. Read ``S`` from HBM, compute ``P = softmax(S)``, write ``P`` to HBM.
    3. Load ``P`` and ``V`` by blocks from HBM, compute ``O = P V``, write ``O`` to HBM.

    Tiles are :func:`standard_block_size` ``(d, M=M)``.  In step 2 a row of ``S`` is read once
    when it fits in ``M``; a longer row needs the two passes of the online softmax, so it is
    read twice.  HBM traffic is ``Theta(N d + N^2)`` (for ``M >= d^2``; see :mod:`.traffic`).

    Shapes: ``Q (N_q, d)``, ``K (N_k, d)``, ``V (N_k, d_v)`` -> ``O (N_q, d_v)``, and with
    ``return_lse`` also ``L (N_q,)``, ``L_i = log sum_j e^{S_ij}`` (``-inf`` for a fully masked row).

    >>> Q = K = np.eye(2); V = np.array([[1.0], [3.0]])
    >>> standard_attention(Q, K, V, scale=np.log(3.0))  # softmax rows (3/4, 1/4), (1/4, 3/4)
    array([[1.5],
           [2.5]])
    """
    Q, K, V, scores = prepare_inputs(Q, K, V, scale=scale, causal=causal)
    counter = as_counter(hbm)
    N_q, N_k, d_v = Q.shape[0], K.shape[0], V.shape[1]
    S = HBMArray(np.empty((N_q, N_k), Q.dtype), counter, "S")
    P = HBMArray(np.empty((N_q, N_k), Q.dtype), counter, "P")
    O = HBMArray(np.empty((N_q, d_v), Q.dtype), counter, "O")
    L = HBMArray(np.empty(N_q, Q.dtype), counter, "L") if return_lse else None

    _scores_to_hbm(HBMArray(Q, counter, "Q"), HBMArray(K, counter, "K"), S, scores, M=M)
    _softmax_in_hbm(S, P, L, M=M)
    _matmul_to_hbm(P, HBMArray(V, counter, "V"), O, M=M)
    return (O.data, L.data) if L is not None else O.data


def _scores_to_hbm(Q: HBMArray, K: HBMArray, S: HBMArray, scores: Scores, *, M: int) -> None:
    """Algorithm 0, line 1: S = scale Q K^T, one b x b tile at a time; each Q tile is loaded once."""
    (N_q, d), N_k = Q.shape, K.shape[0]
    b = standard_block_size(d, M=M)
    for rows in split_range(N_q, b):
        Q_i = Q.load(rows)
        for cols in split_range(N_k, b):
            S.store(rows, cols, scores.block(Q_i, K.load(cols), rows, cols))


def _softmax_in_hbm(S: HBMArray, P: HBMArray, L: HBMArray | None, *, M: int) -> None:
    """Algorithm 0, line 2: P = softmax(S) row block by row block (and L = logsumexp(S))."""
    N_q, N_k = S.shape
    chunks = split_range(N_k, min(N_k, M))
    for rows in split_range(N_q, max(1, M // N_k)):
        read = _row_reader(S, rows, chunks)
        m, l = online_softmax_stats(read(cols) for cols in chunks)
        for cols in chunks:
            P.store(rows, cols, softmax_from_stats(read(cols), m, l))
        if L is not None:
            L.store(rows, ALL, lse_from_stats(m, l))


def _row_reader(S: HBMArray, rows: slice, chunks: list[slice]) -> Callable[[slice], np.ndarray]:
    """How line 2 reads ``S[rows]``: once if whole rows fit on chip, else once per softmax pass."""
    if len(chunks) > 1:
        return lambda cols: S.load(rows, cols)
    resident = S.load(rows)
    return lambda cols: resident


def _matmul_to_hbm(P: HBMArray, V: HBMArray, O: HBMArray, *, M: int) -> None:
    """Algorithm 0, line 3: O = P V with a b x d_v accumulator on chip; each O tile is written once."""
    (N_q, N_k), d_v = P.shape, V.shape[1]
    b = standard_block_size(d_v, M=M)
    for rows in split_range(N_q, b):
        acc = np.zeros((rows.stop - rows.start, d_v), O.data.dtype)
        for cols in split_range(N_k, b):
            acc += P.load(rows, cols) @ V.load(cols)
        O.store(rows, ALL, acc)


def _key_scores(Q: np.ndarray, K: np.ndarray, j: int, scores: Scores) -> np.ndarray:
    """``x_j = scale Q[k, :] K^T[:, j]`` for every query row ``k`` at once: shape ``(N_q,)``."""
    return scores.block(Q, K[j : j + 1], ALL, slice(j, j + 1))[:, 0]


def two_pass_attention(
    Q: np.ndarray, K: np.ndarray, V: np.ndarray, *, scale: float | None = None, causal: bool = False
) -> np.ndarray:
    """2-pass attention: the online softmax's statistics, then softmax and ``P V`` fused.

    For each query row (all rows at once, vectorised), looping over keys ``i = 1..N_k``::

        pass 1:  x_i  = Q[k,:] K^T[:,i]
                 m_i  = max(m_{i-1}, x_i)
                 d'_i = d'_{i-1} e^{m_{i-1} - m_i} + e^{x_i - m_i}
        pass 2:  a_i  = e^{x_i - m_N} / d'_N
                 o_i  = o_{i-1} + a_i V[i,:]
        O[k,:] = o_N

    ``x_i`` is recomputed in pass 2 rather than kept, so no ``N_k``-vector per row is stored.
    Shapes: ``Q (N_q, d)``, ``K (N_k, d)``, ``V (N_k, d_v)`` -> ``(N_q, d_v)``.

    >>> Q = K = np.eye(2); V = np.array([[1.0], [3.0]])
    >>> two_pass_attention(Q, K, V, scale=np.log(3.0))
    array([[1.5],
           [2.5]])
    """
    Q, K, V, scores = prepare_inputs(Q, K, V, scale=scale, causal=causal)
    N_k = K.shape[0]
    m, d = online_softmax_stats(_key_scores(Q, K, i, scores)[:, None] for i in range(N_k))
    o = np.zeros((Q.shape[0], V.shape[1]), Q.dtype)
    for i in range(N_k):
        a = softmax_from_stats(_key_scores(Q, K, i, scores)[:, None], m, d)
        o += a * V[i]
    return o


def one_pass_attention(
    Q: np.ndarray, K: np.ndarray, V: np.ndarray, *, scale: float | None = None, causal: bool = False
) -> np.ndarray:
    """1-pass attention: the output is rescaled as the max and denominator move.

    For each query row (all rows at once, vectorised), looping over keys ``i = 1..N_k``::

        x_i  = Q[k,:] K^T[:,i]
        m_i  = max(m_{i-1}, x_i)
        d'_i = d'_{i-1} e^{m_{i-1} - m_i} + e^{x_i - m_i}
        o'_i = o'_{i-1} d'_{i-1} e^{m_{i-1} - m_i} / d'_i + e^{x_i - m_i} / d'_i V[i,:]
        O[k,:] = o'_N

    ``o'_i`` is the exact attention output over the first ``i`` keys, so one pass suffices;
    this is FlashAttention with blocks of one key.  Shapes as :func:`two_pass_attention`.

    >>> Q = K = np.eye(2); V = np.array([[1.0], [3.0]])
    >>> one_pass_attention(Q, K, V, scale=np.log(3.0))
    array([[1.5],
           [2.5]])
    """
    Q, K, V, scores = prepare_inputs(Q, K, V, scale=scale, causal=causal)
    N_q = Q.shape[0]
    m, d = np.full(N_q, -np.inf), np.zeros(N_q)
    o = np.zeros((N_q, V.shape[1]), Q.dtype)
    for i in range(K.shape[0]):
        x = _key_scores(Q, K, i, scores)
        m_new = np.maximum(m, x)
        shift = finite_shift(m_new)
        kept = d * np.exp(m - shift)  # d'_{i-1} e^{m_{i-1} - m_i}: old mass on the new base
        new = np.exp(x - shift)  # e^{x_i - m_i}
        d_new = kept + new
        # d'_i = 0 only while every key so far was masked; o' stays 0 then.
        o = safe_divide(kept, d_new)[:, None] * o + safe_divide(new, d_new)[:, None] * V[i]
        m, d = m_new, d_new
    return o
