"""Rungs 1-4 of the ladder: from the textbook softmax to the online softmax.

Every function works on a 1-D vector ``x`` of shape ``(N,)`` or row-wise on the last axis
of a 2-D array of shape ``(R, N)``, and returns an array of the same shape.  A row that is
entirely ``-inf`` (a fully masked attention row) has no probability distribution; by the
convention used throughout :mod:`flashattn.reference` its output is all zeros, never NaN.

The two halves of the online softmax, :func:`online_softmax_stats` (the running max and
rescaled denominator) and :func:`softmax_from_stats` (the normalising pass), are functions of
their own because the attention rungs are built on them: 2-pass attention *is* the online
softmax with the normalising pass fused into ``P V``.  The ``-inf``-safe arithmetic they share
with every other rung (:func:`~flashattn.reference.common.finite_shift` and friends) lives in
:mod:`~flashattn.reference.common`.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from flashattn.reference.common import finite_shift, lse_from_stats, safe_divide, split_range

__all__ = [
    "naive_softmax",
    "safe_softmax",
    "three_pass_softmax",
    "online_softmax",
    "logsumexp",
    "online_softmax_stats",
    "softmax_from_stats",
]


def naive_softmax(x: np.ndarray) -> np.ndarray:
    """Textbook softmax, ``a_i = e^{x_i} / sum_j e^{x_j}``.

    Shapes: ``(N,) -> (N,)`` or row-wise ``(R, N) -> (R, N)``.

    It overflows as soon as some ``x_i > ~709`` (float64) and returns NaN there; that failure
    is the reason for :func:`safe_softmax`.  All ``-inf`` rows give 0.

    >>> naive_softmax(np.array([0.0, np.log(3.0)]))
    array([0.25, 0.75])
    """
    x = _as_float(x)
    e = np.exp(x)
    return safe_divide(e, e.sum(axis=-1, keepdims=True))


def safe_softmax(x: np.ndarray) -> np.ndarray:
    """Safe softmax, ``a_i = e^{x_i - m} / sum_j e^{x_j - m}`` with ``m = max_j x_j``.

    Shapes: ``(N,) -> (N,)`` or row-wise ``(R, N) -> (R, N)``.  Subtracting the max makes every
    exponent ``<= 0``, so nothing overflows and the largest term is exactly 1.

    >>> safe_softmax(np.array([1000.0, 1000.0 + np.log(3.0)]))
    array([0.25, 0.75])
    """
    x = _as_float(x)
    shift = finite_shift(x.max(axis=-1, keepdims=True))
    e = np.exp(x - shift)
    return safe_divide(e, e.sum(axis=-1, keepdims=True))


def three_pass_softmax(x: np.ndarray, *, block_size: int = 1) -> np.ndarray:
    """Safe softmax as three explicit passes over the elements (seed "V1" iterative softmax).

    Pass 1: ``m_i = max(m_{i-1}, x_i)``, ``m_0 = -inf``.
    Pass 2: ``d_i = d_{i-1} + e^{x_i - m_N}``, ``d_0 = 0``.
    Pass 3: ``a_i = e^{x_i - m_N} / d_N``.

    The loops step ``block_size`` elements at a time (``1`` is the element-wise form of the
    seeds); rows of a 2-D input are processed together.  Shapes: ``(N,)`` or ``(R, N)``.

    >>> three_pass_softmax(np.array([0.0, np.log(3.0)]))
    array([0.25, 0.75])
    """
    rows, was_1d = _as_rows(x)
    blocks = split_range(rows.shape[1], block_size)
    m = np.full(rows.shape[0], -np.inf)
    for cols in blocks:  # pass 1
        m = np.maximum(m, rows[:, cols].max(axis=1))
    shift = finite_shift(m)
    d = np.zeros(rows.shape[0])
    for cols in blocks:  # pass 2: needs m_N, hence a pass of its own
        d += np.exp(rows[:, cols] - shift[:, None]).sum(axis=1)
    out = np.empty_like(rows)
    for cols in blocks:  # pass 3
        out[:, cols] = softmax_from_stats(rows[:, cols], m, d)
    return out[0] if was_1d else out


def online_softmax(x: np.ndarray, *, block_size: int = 1) -> np.ndarray:
    """Online softmax: two passes, the max and the denominator found together.

    Pass 1: ``m_i = max(m_{i-1}, x_i)`` and ``d'_i = d'_{i-1} e^{m_{i-1} - m_i} + e^{x_i - m_i}``
    (see :func:`online_softmax_stats`); ``d'_N = d_N``, so pass 2 is the old pass 3,
    ``a_i = e^{x_i - m_N} / d'_N``.  Shapes: ``(N,)`` or ``(R, N)``.

    >>> online_softmax(np.array([0.0, np.log(3.0)]))
    array([0.25, 0.75])
    """
    rows, was_1d = _as_rows(x)
    blocks = split_range(rows.shape[1], block_size)
    m, d = online_softmax_stats(rows[:, cols] for cols in blocks)
    out = np.empty_like(rows)
    for cols in blocks:
        out[:, cols] = softmax_from_stats(rows[:, cols], m, d)
    return out[0] if was_1d else out


def logsumexp(x: np.ndarray) -> np.ndarray:
    """Row-wise ``L = log sum_j e^{x_j} = m + log sum_j e^{x_j - m}`` (natural log).

    Shapes: ``(N,) -> ()`` or ``(R, N) -> (R,)``.  An all ``-inf`` row gives ``-inf``.
    ``softmax(x) = e^{x - L}``, which is why FlashAttention-2 keeps only ``L`` for the backward.

    >>> float(logsumexp(np.array([0.0, 0.0])))  # log 2
    0.6931471805599453
    """
    rows, was_1d = _as_rows(x)
    m, d = online_softmax_stats([rows])
    lse = lse_from_stats(m, d)
    return lse[0] if was_1d else lse


def online_softmax_stats(blocks: Iterable[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Pass 1 of the online softmax over a stream of column blocks of shape ``(R, b)``.

    Per block ``x`` (``b`` new elements of each of the ``R`` rows)::

        m_i  = max(m_{i-1}, max_j x[j])
        d'_i = d'_{i-1} e^{m_{i-1} - m_i} + sum_j e^{x[j] - m_i}

    Returns ``(m, d)``, each of shape ``(R,)``: the row max and ``sum_j e^{x_j - m}``.
    Rows that saw only ``-inf`` keep ``m = -inf`` and ``d = 0``.

    >>> m, d = online_softmax_stats([np.array([[0.0]]), np.array([[np.log(3.0)]])])
    >>> float(m[0]), float(d[0])  # e^{-log 3} + 1
    (1.0986122886681098, 1.3333333333333333)
    """
    m = d = None
    for x in blocks:
        if m is None:
            m, d = np.full(x.shape[0], -np.inf), np.zeros(x.shape[0])
        m_new = np.maximum(m, x.max(axis=1))
        shift = finite_shift(m_new)
        # e^{m_{i-1} - m_i} re-bases the old sum onto the new max; it is 0 when m_{i-1} = -inf.
        d = d * np.exp(m - shift) + np.exp(x - shift[:, None]).sum(axis=1)
        m = m_new
    if m is None:
        raise ValueError("online_softmax_stats needs at least one block")
    return m, d


def softmax_from_stats(x: np.ndarray, m: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The normalising pass ``a_j = e^{x_j - m} / d`` for a block ``x`` of shape ``(R, b)``.

    ``m`` and ``d`` have shape ``(R,)``; rows with ``d = 0`` (fully masked) give 0.

    >>> softmax_from_stats(np.array([[0.0, 0.0]]), np.array([0.0]), np.array([2.0]))
    array([[0.5, 0.5]])
    """
    return safe_divide(np.exp(x - finite_shift(m)[:, None]), d[:, None])


def _as_float(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    return x if np.issubdtype(x.dtype, np.floating) else x.astype(np.float64)


def _as_rows(x: np.ndarray) -> tuple[np.ndarray, bool]:
    x = _as_float(x)
    if x.ndim not in (1, 2):
        raise ValueError(f"expected a 1-D or 2-D array, got shape {x.shape}")
    return (x[None, :], True) if x.ndim == 1 else (x, False)
