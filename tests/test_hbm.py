"""HBM traffic is counted, and the counts follow the paper's Theta-bounds.

Standard attention: Theta(N d + N^2).  FlashAttention-1, FA-2 forward and FA-2 backward:
Theta(N^2 d^2 / M) (plus the N d it takes to read the inputs once).  The bands below were
picked from measured ratios over the sweep (min/max in the comments) with some margin.
"""

from __future__ import annotations

import os
import secrets
from functools import cache
from math import ceil

import numpy as np
import pytest

from flashattn.reference import (
    ALGORITHMS,
    HBMArray,
    HBMCounter,
    NullCounter,
    asymptotic_scale,
    crossover_sram,
    fa1_block_sizes,
    fa2_block_sizes,
    flash_attention_v1,
    flash_attention_v2_backward,
    flash_attention_v2_forward,
    measure_traffic,
    standard_attention,
    standard_block_size,
    traffic_table,
)
from flashattn.reference.hbm import ALL

# N in {256, 512, 1024}, d in {16, 32, 64}, M = 4 d^2, 8 d^2, ... up to N d.
SWEEP = [
    (N, d, 4 * d * d * 2**k)
    for N in (256, 512, 1024)
    for d in (16, 32, 64)
    for k in range(8)
    if 4 * d * d * 2**k <= N * d
]
# elements / asymptotic_scale over SWEEP, measured:  standard 4.28..5.63, flash1 7.64..12.42,
# flash2_fwd 5.01..7.65, flash2_bwd 11.57..15.94.
BANDS = {
    "standard": (3.5, 6.5),
    "flash1": (6.5, 14.5),
    "flash2_fwd": (4.25, 9.0),
    "flash2_bwd": (10.0, 18.5),
}
# The other Theta: if the counts followed it instead, the ratio would stay in a band too.
WRONG_SCALE = {"standard": "flash1", "flash1": "standard", "flash2_fwd": "standard", "flash2_bwd": "standard"}
FLASH = ("flash1", "flash2_fwd", "flash2_bwd")


@cache
def traffic(algorithm: str, N: int, d: int, M: int, causal: bool = False) -> int:
    return measure_traffic(algorithm, N, d, M=M, causal=causal)["elements"]


@pytest.fixture
def rng() -> np.random.Generator:
    seed = int(os.environ.get("FLASHATTN_TEST_SEED", secrets.randbits(63)))
    print(f"FLASHATTN_TEST_SEED={seed}")
    return np.random.default_rng(seed)


def _qkv(rng: np.random.Generator, N_q: int, N_k: int, d: int, d_v: int) -> tuple[np.ndarray, ...]:
    return rng.standard_normal((N_q, d)), rng.standard_normal((N_k, d)), rng.standard_normal((N_k, d_v))


# --------------------------------------------------------------------------- the counter itself


def test_load_copies_and_counts_store_counts():
    hbm = HBMCounter()
    A = HBMArray(np.arange(12.0).reshape(3, 4), hbm, "A")
    block = A.load(slice(1, 3), slice(0, 2))
    block[:] = -1.0  # a copy in SRAM: HBM is untouched
    assert A.data[1, 0] == 4.0
    assert (hbm.reads, hbm.writes, hbm.read_bytes) == (4, 0, 32)
    A.store(slice(0, 1), ALL, 7.0)  # a broadcast value still writes the whole block
    assert (hbm.writes, hbm.write_bytes, hbm.total, hbm.total_bytes) == (4, 32, 8, 64)
    assert (hbm.reads_of("A"), hbm.writes_of("A"), hbm.reads_of("B")) == (4, 4, 0)
    assert hbm.as_dict() == {"elements": 8, "bytes": 64, "reads": 4, "writes": 4}


def test_itemsize_override_and_1d_arrays():
    hbm = HBMCounter(itemsize=2)
    v = HBMArray(np.zeros(10, dtype=np.float32), hbm, "v")
    w = HBMArray(np.zeros(10), hbm, "w", itemsize=1)
    v.load(slice(0, 5))
    w.store(slice(0, 10), ALL, 1.0)
    assert (hbm.read_bytes, hbm.write_bytes) == (10, 10)
    assert HBMArray(np.zeros(3, dtype=np.float32), HBMCounter(), "x").itemsize == 4
    with pytest.raises(IndexError):
        v.load(slice(0, 2), slice(0, 1))


def test_null_counter_counts_nothing_and_results_are_identical(rng):
    Q, K, V = _qkv(rng, 33, 21, 8, 5)
    hbm = HBMCounter()
    O, L = flash_attention_v2_forward(Q, K, V, M=512, causal=True, hbm=hbm)
    O0, L0 = flash_attention_v2_forward(Q, K, V, M=512, causal=True)
    assert hbm.total > 0
    np.testing.assert_array_equal(O, O0)  # same code path, counted or not
    np.testing.assert_array_equal(L, L0)
    null = NullCounter()
    flash_attention_v1(Q, K, V, M=512, hbm=null)
    assert null.total == 0 and null.per_array == {}


# --------------------------------------------------------------------------- exact counts


def test_fa2_forward_reads_q_once_and_writes_o_and_l_once(rng):
    N_q, N_k, d, d_v, M = 100, 70, 16, 8, 1024
    Q, K, V = _qkv(rng, N_q, N_k, d, d_v)
    B_r, _ = fa2_block_sizes(d, M=M)
    T_r = ceil(N_q / B_r)
    counters = {}
    for causal in (False, True):
        hbm = counters[causal] = HBMCounter()
        flash_attention_v2_forward(Q, K, V, M=M, causal=causal, hbm=hbm)
        assert hbm.reads_of("Q") == N_q * d
        assert (hbm.writes_of("O"), hbm.writes_of("L")) == (N_q * d_v, N_q)
        assert hbm.writes == N_q * d_v + N_q
    full = counters[False]  # every Q block streams all of K and V
    assert (full.reads_of("K"), full.reads_of("V")) == (T_r * N_k * d, T_r * N_k * d_v)
    assert full.reads == N_q * d + T_r * N_k * (d + d_v)
    assert counters[True].reads_of("K") < full.reads_of("K")


def test_fa1_reads_kv_once_and_rewrites_o_l_m_every_step(rng):
    N_q, N_k, d, d_v, M = 50, 90, 8, 8, 512
    Q, K, V = _qkv(rng, N_q, N_k, d, d_v)
    _, B_c = fa1_block_sizes(d, M=M)
    T_c = ceil(N_k / B_c)
    hbm = HBMCounter()
    flash_attention_v1(Q, K, V, M=M, hbm=hbm)
    assert (hbm.reads_of("K"), hbm.reads_of("V")) == (N_k * d, N_k * d_v)
    assert hbm.reads_of("Q") == T_c * N_q * d
    assert hbm.reads_of("O") == T_c * N_q * d_v
    assert hbm.writes_of("O") == (1 + T_c) * N_q * d_v  # line 2 initialises O in HBM
    assert hbm.writes_of("l") == hbm.writes_of("m") == (1 + T_c) * N_q


@pytest.mark.parametrize("M", [40, 4096], ids=["rows-longer-than-M", "rows-fit"])
def test_standard_attention_materialises_s_and_p(rng, M):
    N_q, N_k, d, d_v = 60, 50, 8, 4
    Q, K, V = _qkv(rng, N_q, N_k, d, d_v)
    hbm = HBMCounter()
    standard_attention(Q, K, V, M=M, hbm=hbm)
    S_reads = N_q * N_k * (1 if N_k <= M else 2)  # a row longer than M: online softmax's 2 passes
    assert (hbm.writes_of("S"), hbm.reads_of("S")) == (N_q * N_k, S_reads)
    assert (hbm.writes_of("P"), hbm.reads_of("P")) == (N_q * N_k, N_q * N_k)
    assert (hbm.reads_of("Q"), hbm.writes_of("O")) == (N_q * d, N_q * d_v)
    assert hbm.reads_of("K") == ceil(N_q / standard_block_size(d, M=M)) * N_k * d
    assert hbm.writes == 2 * N_q * N_k + N_q * d_v


def test_fa2_backward_counts(rng):
    N_q, N_k, d, d_v, M = 40, 56, 8, 8, 256
    Q, K, V = _qkv(rng, N_q, N_k, d, d_v)
    O, L = flash_attention_v2_forward(Q, K, V, M=M)
    hbm = HBMCounter()
    flash_attention_v2_backward(Q, K, V, O, rng.standard_normal(O.shape), L, M=M, hbm=hbm)
    _, B_c = fa1_block_sizes(d, M=M)
    T_c = ceil(N_k / B_c)
    assert (hbm.reads_of("O"), hbm.writes_of("D")) == (N_q * d_v, N_q)  # D = rowsum(dO o O), once
    assert hbm.reads_of("dO") == (1 + T_c) * N_q * d_v
    assert hbm.writes_of("dQ") == (1 + T_c) * N_q * d  # zero-initialised, then one RMW per K block
    assert (hbm.writes_of("dK"), hbm.writes_of("dV")) == (N_k * d, N_k * d_v)
    assert (hbm.reads_of("K"), hbm.reads_of("V")) == (N_k * d, N_k * d_v)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_causal_skips_masked_blocks(algorithm):
    full, causal = traffic(algorithm, 512, 32, 4096), traffic(algorithm, 512, 32, 4096, causal=True)
    if algorithm == "standard":  # the mask is applied to S, which is still written in full
        assert causal == full
    else:  # about half of the blocks are skipped (measured ~0.56-0.58)
        assert causal < 0.65 * full


# --------------------------------------------------------------------------- Theta-bounds


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_traffic_stays_in_theta_band(algorithm):
    lo, hi = BANDS[algorithm]
    ratios = {(N, d, M): traffic(algorithm, N, d, M) / asymptotic_scale(algorithm, N, d, M=M) for N, d, M in SWEEP}
    outside = {p: round(r, 3) for p, r in ratios.items() if not lo <= r <= hi}
    assert not outside, f"{algorithm}: (N, d, M) -> ratio outside [{lo}, {hi}]: {outside}"
    # Normalised by the wrong Theta the ratio spreads wider than any band of this width.
    wrong = [traffic(algorithm, N, d, M) / asymptotic_scale(WRONG_SCALE[algorithm], N, d, M=M) for N, d, M in SWEEP]
    assert max(wrong) / min(wrong) > 3 * hi / lo


@pytest.mark.parametrize("algorithm", FLASH)
def test_flash_traffic_quadruples_with_n_and_halves_with_m(algorithm):
    base = traffic(algorithm, 512, 32, 4096)
    assert 3.5 < traffic(algorithm, 1024, 32, 4096) / base <= 4.0  # measured 3.80-3.89
    assert 0.5 < traffic(algorithm, 512, 32, 8192) / base < 0.6  # measured 0.53-0.55


def test_standard_traffic_quadruples_with_n_and_ignores_m():
    base = traffic("standard", 512, 32, 4096)
    assert 3.5 < traffic("standard", 1024, 32, 4096) / base <= 4.0  # measured 3.91
    assert 0.8 < traffic("standard", 512, 32, 8192) / base <= 1.0  # measured 0.87: S, P dominate


def test_flash_forward_beats_standard_when_m_is_well_above_d_squared():
    points = [(N, d, M) for N, d, M in SWEEP if 8 * d * d <= M]
    assert len(points) >= 6
    for p in points:
        standard = traffic("standard", *p)
        assert traffic("flash1", *p) < standard, p
        assert traffic("flash2_fwd", *p) < standard, p


def test_crossover_is_near_d_squared():
    N, d = 256, 16
    Ms = [256, 512, 1024, 2048]
    M = crossover_sram(N, d, Ms)
    assert M is not None and d * d // 2 <= M <= 8 * d * d
    smaller = [m for m in Ms if m < M]
    for m in smaller:  # below the crossover at least one flash forward still moves more
        assert max(traffic("flash1", N, d, m), traffic("flash2_fwd", N, d, m)) >= traffic("standard", N, d, m)
    assert crossover_sram(64, 16, [32, 64]) is None  # SRAM below d^2: no win


def test_measure_traffic_and_table_shapes():
    t = measure_traffic("flash2_fwd", 64, 8, M=512, itemsize=2)
    assert set(t) == {"elements", "bytes", "reads", "writes"}
    assert t["bytes"] == 2 * t["elements"] and t["elements"] == t["reads"] + t["writes"]
    rows = traffic_table([64], [8], [256, 512], algorithms=("standard", "flash2_bwd"))
    assert [(r["algorithm"], r["M"]) for r in rows] == [
        ("standard", 256),
        ("flash2_bwd", 256),
        ("standard", 512),
        ("flash2_bwd", 512),
    ]
    assert all(r["ratio"] == r["elements"] / r["scale"] for r in rows)
    with pytest.raises(ValueError):
        measure_traffic("flash3", 64, 8, M=512)
