"""Counting HBM traffic by running the algorithms, not by typing in formulas.

:func:`measure_traffic` runs one algorithm of the ladder on random inputs with an
:class:`~flashattn.reference.hbm.HBMCounter` attached and reports what it moved;
:func:`traffic_table` and :func:`crossover_sram` sweep it over sizes.  :func:`asymptotic_scale`
gives the paper's Theta-expressions, used only to normalise those counts (never as the count).

This module sits on top of the ladder: it imports the algorithms, and nothing in the ladder
imports it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import product
from typing import Any

import numpy as np

from flashattn.reference.attention import standard_attention
from flashattn.reference.flash import flash_attention_v1, flash_attention_v2_backward, flash_attention_v2_forward
from flashattn.reference.hbm import HBMCounter

__all__ = [
    "ALGORITHMS",
    "measure_traffic",
    "traffic_table",
    "crossover_sram",
    "asymptotic_scale",
]


# Every runner takes the same random Q, K, V, dO; the forwards ignore dO.
def _standard(Q, K, V, dO, *, M: int, causal: bool, hbm: HBMCounter) -> None:
    standard_attention(Q, K, V, M=M, causal=causal, hbm=hbm)


def _flash1(Q, K, V, dO, *, M: int, causal: bool, hbm: HBMCounter) -> None:
    flash_attention_v1(Q, K, V, M=M, causal=causal, hbm=hbm)


def _flash2_fwd(Q, K, V, dO, *, M: int, causal: bool, hbm: HBMCounter) -> None:
    flash_attention_v2_forward(Q, K, V, M=M, causal=causal, hbm=hbm)


def _flash2_bwd(Q, K, V, dO, *, M: int, causal: bool, hbm: HBMCounter) -> None:
    # The forward is not counted: "flash2_bwd" is the traffic of the backward pass alone.
    O, L = flash_attention_v2_forward(Q, K, V, M=M, causal=causal)
    flash_attention_v2_backward(Q, K, V, O, dO, L, M=M, causal=causal, hbm=hbm)


_RUNNERS: dict[str, Callable[..., None]] = {
    "standard": _standard,
    "flash1": _flash1,
    "flash2_fwd": _flash2_fwd,
    "flash2_bwd": _flash2_bwd,
}

#: Algorithms understood by :func:`measure_traffic`.
ALGORITHMS = tuple(_RUNNERS)


def measure_traffic(
    algorithm: str, N: int, d: int, *, M: int, itemsize: int = 2, causal: bool = False, seed: int = 0
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
    run = _runner(algorithm)
    counter = HBMCounter(itemsize=itemsize)
    run(*_random_inputs(N, d, seed), M=M, causal=causal, hbm=counter)
    return counter.as_dict()


def traffic_table(
    Ns: Iterable[int],
    ds: Iterable[int],
    Ms: Iterable[int],
    *,
    algorithms: Sequence[str] = ALGORITHMS,
    itemsize: int = 2,
    causal: bool = False,
) -> list[dict[str, Any]]:
    """One row per ``(N, d, M, algorithm)``: the counted traffic plus the Theta-scale it is compared to.

    Row keys: ``algorithm, N, d, M, elements, bytes, reads, writes, scale, ratio`` where
    ``scale = asymptotic_scale(...)`` and ``ratio = elements / scale``.

    >>> [row["algorithm"] for row in traffic_table([32], [8], [256], algorithms=("standard", "flash1"))]
    ['standard', 'flash1']
    """
    rows = []
    for N, d, M, algorithm in product(Ns, ds, Ms, algorithms):
        counts = measure_traffic(algorithm, N, d, M=M, itemsize=itemsize, causal=causal)
        scale = asymptotic_scale(algorithm, N, d, M=M)
        row = {"algorithm": algorithm, "N": N, "d": d, "M": M, **counts}
        rows.append({**row, "scale": scale, "ratio": counts["elements"] / scale})
    return rows


def crossover_sram(
    N: int,
    d: int,
    Ms: Iterable[int],
    *,
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
    options = {"itemsize": itemsize, "causal": causal}
    for M in sorted(Ms):
        standard = measure_traffic("standard", N, d, M=M, **options)["elements"]
        flash = [measure_traffic(a, N, d, M=M, **options)["elements"] for a in algorithms]
        if all(f < standard for f in flash):
            return M
    return None


def asymptotic_scale(algorithm: str, N: int, d: int, *, M: int) -> float:
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


def _runner(algorithm: str) -> Callable[..., None]:
    if algorithm not in _RUNNERS:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    return _RUNNERS[algorithm]
