"""The plumbing every rung shares: inputs, blocks, the score block and the ``-inf``-safe statistics.

None of this is a step of the derivation; it is what the steps have in common, written down once:

* :func:`prepare_inputs` checks ``Q, K, V``, promotes them to one float dtype and returns the
  :class:`Scores` of the problem: how to compute a block ``S_ij = scale Q_i K_j^T`` under the
  causal mask, and whether a block pair is visible at all;
* :func:`split_range` cuts ``[0, N)`` into the blocks every loop of the ladder steps through;
* :func:`causal_mask` is the bottom-right aligned mask, for the whole matrix or one block;
* :func:`finite_shift`, :func:`safe_divide` and :func:`lse_from_stats` are the three places
  where a fully masked row (every score ``-inf``) could turn into NaN; each turns it into 0
  (or ``L = -inf``) instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flashattn.reference.hbm import ALL

__all__ = [
    "Scores",
    "prepare_inputs",
    "split_range",
    "causal_mask",
    "finite_shift",
    "safe_divide",
    "lse_from_stats",
]


@dataclass(frozen=True)
class Scores:
    """Blocks of ``S = scale Q K^T`` for a problem with ``N_q`` queries and ``N_k`` keys.

    ``block(Q_i, K_j, rows, cols)`` is ``S_ij = scale Q_i K_j^T`` with ``-inf`` where the causal
    mask hides a key, for ``Q_i = Q[rows]`` (``(B_r, d)``) and ``K_j = K[cols]`` (``(B_c, d)``):
    shape ``(B_r, B_c)``.  ``visible(rows, cols)`` says whether any query in ``rows`` sees any
    key in ``cols``; a tiled rung skips a block pair that is not visible.

    >>> scores = Scores(scale=1.0, causal=True, N_q=2, N_k=2)
    >>> scores.block(np.ones((2, 1)), np.ones((2, 1)), slice(0, 2), slice(0, 2))
    array([[  1., -inf],
           [  1.,   1.]])
    >>> scores.visible(slice(0, 1), slice(1, 2))  # query 0 sees only key 0
    False
    """

    scale: float
    causal: bool
    N_q: int
    N_k: int

    def block(self, Q_i: np.ndarray, K_j: np.ndarray, rows: slice, cols: slice) -> np.ndarray:
        """``S_ij = scale Q_i K_j^T`` for the block ``(rows, cols)``, ``-inf`` where causally masked."""
        S_ij = self.scale * (Q_i @ K_j.T)
        if self.causal:
            S_ij[~causal_mask(self.N_q, self.N_k, rows=rows, cols=cols)] = -np.inf
        return S_ij

    def visible(self, rows: slice, cols: slice) -> bool:
        """Whether any query in ``rows`` sees any key in ``cols`` (always, without the causal mask).

        The last row of the block sees the most keys, up to ``rows.stop - 1 + N_k - N_q``.
        """
        return not self.causal or cols.start <= rows.stop - 1 + self.N_k - self.N_q


def prepare_inputs(
    Q: np.ndarray, K: np.ndarray, V: np.ndarray, *, scale: float | None, causal: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, Scores]:
    """Check shapes, promote to a common float dtype (at least float32), and describe the scores.

    ``Q (N_q, d)``, ``K (N_k, d)``, ``V (N_k, d_v)``; ``scale=None`` means ``d ** -0.5``.
    Returns ``Q, K, V`` in the common dtype and their :class:`Scores`.

    >>> Q, K, V, scores = prepare_inputs(np.ones((3, 4)), np.ones((5, 4)), np.ones((5, 2)), scale=None, causal=False)
    >>> Q.dtype, scores
    (dtype('float64'), Scores(scale=0.5, causal=False, N_q=3, N_k=5))
    """
    Q, K, V = (np.asarray(a) for a in (Q, K, V))
    if Q.ndim != 2 or K.ndim != 2 or V.ndim != 2:
        raise ValueError(f"expected 2-D Q, K, V; got shapes {Q.shape}, {K.shape}, {V.shape}")
    if Q.shape[1] != K.shape[1] or K.shape[0] != V.shape[0]:
        raise ValueError(f"incompatible shapes Q {Q.shape}, K {K.shape}, V {V.shape}")
    dtype = np.result_type(Q.dtype, K.dtype, V.dtype, np.float32)
    scale = Q.shape[1] ** -0.5 if scale is None else float(scale)
    scores = Scores(scale=scale, causal=bool(causal), N_q=Q.shape[0], N_k=K.shape[0])
    return Q.astype(dtype, copy=False), K.astype(dtype, copy=False), V.astype(dtype, copy=False), scores


def split_range(n: int, block_size: int) -> list[slice]:
    """``[0, n)`` cut into consecutive slices of ``block_size`` (the last one may be shorter).

    >>> split_range(5, 2)
    [slice(0, 2, None), slice(2, 4, None), slice(4, 5, None)]
    """
    if block_size < 1:
        raise ValueError(f"block size must be >= 1, got {block_size}")
    return [slice(start, min(start + block_size, n)) for start in range(0, n, block_size)]


def causal_mask(N_q: int, N_k: int, *, rows: slice = ALL, cols: slice = ALL) -> np.ndarray:
    """Boolean ``visible[i, j] = j <= i + N_k - N_q`` (bottom-right aligned), restricted to a block.

    Shape ``(len(rows), len(cols))``.  The last query sees every key; when ``N_q > N_k`` the
    first ``N_q - N_k`` queries see none.

    >>> causal_mask(2, 3).astype(int)
    array([[1, 1, 0],
           [1, 1, 1]])
    """
    i = np.arange(N_q)[rows][:, None]
    j = np.arange(N_k)[cols][None, :]
    return j <= i + (N_k - N_q)


def finite_shift(m: np.ndarray) -> np.ndarray:
    """Row maxima with ``-inf`` replaced by 0, for use as the shift in ``e^{x - m}``.

    A max of ``-inf`` means every entry of the row is ``-inf``; shifting by 0 then gives
    ``e^{-inf} = 0`` instead of ``e^{-inf - (-inf)} = NaN``.

    >>> finite_shift(np.array([2.0, -np.inf]))
    array([2., 0.])
    """
    return np.where(np.isneginf(m), 0.0, m)


def safe_divide(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """``num / den`` with 0 wherever ``den == 0`` (then ``num`` is 0 too: an empty sum).

    >>> safe_divide(np.array([1.0, 0.0]), np.array([4.0, 0.0]))
    array([0.25, 0.  ])
    """
    num, den = np.broadcast_arrays(num, den)
    return np.divide(num, den, out=np.zeros(num.shape, dtype=np.result_type(num, den)), where=den != 0)


def lse_from_stats(m: np.ndarray, d: np.ndarray) -> np.ndarray:
    """``L = m + log d`` from a row max ``m`` and ``d = sum_j e^{x_j - m}``; ``-inf`` where ``d = 0``.

    ``d = 0`` is a row with nothing to attend to.  Shapes: ``(R,), (R,) -> (R,)``.

    >>> lse_from_stats(np.array([1.0, -np.inf]), np.array([1.0, 0.0]))
    array([  1., -inf])
    """
    log_d = np.log(d, out=np.full(d.shape, -np.inf), where=d > 0)
    return finite_shift(m) + log_d
