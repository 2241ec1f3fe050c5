"""Every rung of the ladder computes the same thing.

Inputs are random on every run.  Each test prints its seed (pytest shows it on failure);
set FLASHATTN_TEST_SEED=<seed> to replay one.  Independent oracles are torch float64
(softmax, logsumexp, attention and its autograd), with a bottom-right causal mask built
with ``torch.tril``, not with the code under test.
"""

from __future__ import annotations

import ast
import inspect
import os
import secrets
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from flashattn.reference import (
    causal_mask,
    fa1_block_sizes,
    fa2_block_sizes,
    flash_attention_v1,
    flash_attention_v2_backward,
    flash_attention_v2_forward,
    logsumexp,
    naive_softmax,
    one_pass_attention,
    online_softmax,
    safe_softmax,
    standard_attention,
    standard_block_size,
    three_pass_softmax,
    two_pass_attention,
)

FWD_TOL = 1e-12
BWD_TOL = 1e-10

# (N_q, N_k, d, d_v): N in {1, 2, 7, 64, 113}, d in {1, 8, 40, 59}, N_q != N_k both ways.
SHAPES = [
    (1, 1, 1, 1),
    (2, 2, 8, 8),
    (7, 7, 40, 40),
    (64, 64, 59, 59),
    (113, 113, 8, 8),
    (7, 64, 40, 8),
    (64, 7, 8, 40),
    (113, 64, 59, 1),
    (1, 113, 8, 8),
    (113, 2, 1, 8),
]
# (B_r, B_c) overrides; 1 x 1, sizes that do not divide N, larger than N, and M-derived (None).
BLOCKS = [(1, 1), (3, 5), (16, 7), (200, 200), ("M", 512), ("M", 2000), ("M", 16384)]
# 1 x 1 blocks only on the smaller shapes: one Python step per score keeps them slow.
FLASH_CASES = [
    (shape, blocks) for shape in SHAPES for blocks in BLOCKS if blocks != (1, 1) or shape[0] * shape[1] <= 64**2
]
# The backward is the slowest rung: a smaller block set, 1 x 1 only on the smallest shapes.
BACKWARD_CASES = [
    (shape, blocks)
    for shape, blocks in FLASH_CASES
    if blocks != ("M", 2000) and (blocks != (1, 1) or shape[0] * shape[1] <= 7 * 64)
]


def _ids(value: tuple) -> str:
    if value[0] == "M":
        return f"M={value[1]}"
    return "x".join(map(str, value)) if len(value) == 4 else "{}x{}blocks".format(*value)


@pytest.fixture
def rng() -> np.random.Generator:
    seed = int(os.environ.get("FLASHATTN_TEST_SEED", secrets.randbits(63)))
    print(f"FLASHATTN_TEST_SEED={seed}")
    return np.random.default_rng(seed)


def _qkv(rng: np.random.Generator, shape: tuple[int, int, int, int]) -> tuple[np.ndarray, ...]:
    N_q, N_k, d, d_v = shape
    return rng.standard_normal((N_q, d)), rng.standard_normal((N_k, d)), rng.standard_normal((N_k, d_v))


def _block_kwargs(blocks: tuple) -> dict:
    return {"M": blocks[1]} if blocks[0] == "M" else {"block_sizes": blocks}


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape
    assert not np.isnan(got).any()
    return float(np.abs(got - want).max() / max(1.0, float(np.abs(want).max()))) if got.size else 0.0


def _torch_attention(Q, K, V, scale: float, causal: bool, dO=None):
    """float64 torch oracle: (O, L) and, given dO, the autograd (dQ, dK, dV)."""
    Qt, Kt, Vt = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (Q, K, V))
    S = scale * Qt @ Kt.T
    N_q, N_k = S.shape
    visible = torch.ones(N_q, N_k, dtype=torch.bool).tril(diagonal=N_k - N_q) if causal else None
    if visible is not None:
        S = S.masked_fill(~visible, float("-inf"))
    L = torch.logsumexp(S, dim=-1)
    if visible is not None:  # a row with no visible key: uniform softmax times 0, so O = 0 and no NaN
        P = torch.softmax(S.masked_fill(~visible.any(-1, keepdim=True), 0.0), dim=-1) * visible
    else:
        P = torch.softmax(S, dim=-1)
    O = P @ Vt
    if dO is None:
        return O.detach().numpy(), L.detach().numpy()
    O.backward(torch.tensor(dO, dtype=torch.float64))
    return tuple(t.grad.numpy() for t in (Qt, Kt, Vt))


# --------------------------------------------------------------------------- softmax rungs


def _rows_with_masks(rng: np.random.Generator, R: int, N: int) -> np.ndarray:
    x = 3.0 * rng.standard_normal((R, N))
    x[rng.random((R, N)) < 0.3] = -np.inf  # partially masked rows
    x[0] = -np.inf  # and one fully masked row
    return x


@pytest.mark.parametrize("N", [1, 2, 7, 64, 113])
@pytest.mark.parametrize("block_size", [1, 3, 16, 200])
def test_softmax_rungs_match_torch(rng, N, block_size):
    x = _rows_with_masks(rng, 5, N)
    want = torch.softmax(torch.tensor(x), dim=-1).nan_to_num(0.0).numpy()
    rungs = {
        "naive": naive_softmax(x),
        "safe": safe_softmax(x),
        "three_pass": three_pass_softmax(x, block_size=block_size),
        "online": online_softmax(x, block_size=block_size),
    }
    for name, got in rungs.items():
        assert _rel_err(got, want) < FWD_TOL, name
        assert np.all(got[0] == 0.0), f"{name}: fully masked row must be exactly 0"
    np.testing.assert_allclose(logsumexp(x), torch.logsumexp(torch.tensor(x), -1).numpy(), rtol=1e-13)


def test_softmax_1d_and_shift_invariance(rng):
    x = rng.standard_normal(37)
    for f in (naive_softmax, safe_softmax, three_pass_softmax, online_softmax):
        assert f(x).shape == (37,)
        assert _rel_err(f(x), safe_softmax(x)) < FWD_TOL
    for f in (safe_softmax, three_pass_softmax, online_softmax):  # shift by 1000 overflows only naive
        assert _rel_err(f(x + 1000.0), safe_softmax(x)) < 1e-11
    assert np.isneginf(logsumexp(np.full(4, -np.inf)))


def test_naive_softmax_overflows_where_safe_does_not():
    x = np.array([1000.0, 1000.0])
    with np.errstate(over="ignore", invalid="ignore"):
        assert np.isnan(naive_softmax(x)).all()
    np.testing.assert_array_equal(safe_softmax(x), [0.5, 0.5])


@settings(max_examples=150, deadline=None)
@given(
    x=arrays(
        np.float64,
        st.tuples(st.integers(1, 4), st.integers(1, 40)),
        elements=st.floats(-1e300, 1e300, allow_nan=False, allow_infinity=False),
    ),
    block_size=st.integers(1, 9),
)
def test_online_softmax_equals_safe_softmax_property(x, block_size):
    """The rescaled running denominator d'_N equals d_N for any finite input."""
    got = online_softmax(x, block_size=block_size)
    want = safe_softmax(x)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
    np.testing.assert_allclose(three_pass_softmax(x, block_size=block_size), want, rtol=1e-12, atol=0)


# --------------------------------------------------------------------------- attention rungs


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_standard_attention_matches_torch(rng, shape, causal):
    Q, K, V = _qkv(rng, shape)
    scale = shape[2] ** -0.5
    O_want, L_want = _torch_attention(Q, K, V, scale, causal)
    for M in (100, 16384):  # M = 100 < N_k = 113 streams each S row twice in Algorithm 0's line 2
        O, L = standard_attention(Q, K, V, causal=causal, return_lse=True, M=M)
        assert _rel_err(O, O_want) < FWD_TOL
        assert np.array_equal(np.isneginf(L), np.isneginf(L_want))
        finite = np.isfinite(L_want)
        assert _rel_err(L[finite], L_want[finite]) < FWD_TOL
    assert standard_attention(Q, K, V, causal=causal).shape == O_want.shape


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_two_and_one_pass_attention_equal_standard(rng, shape, causal):
    Q, K, V = _qkv(rng, shape)
    want = standard_attention(Q, K, V, causal=causal)
    assert _rel_err(two_pass_attention(Q, K, V, causal=causal), want) < FWD_TOL
    assert _rel_err(one_pass_attention(Q, K, V, causal=causal), want) < FWD_TOL


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("shape", "blocks"), FLASH_CASES, ids=_ids)
def test_flash_forward_equals_standard(rng, shape, causal, blocks):
    Q, K, V = _qkv(rng, shape)
    O_want, L_want = standard_attention(Q, K, V, causal=causal, return_lse=True)
    kw = _block_kwargs(blocks)
    assert _rel_err(flash_attention_v1(Q, K, V, causal=causal, **kw), O_want) < FWD_TOL
    O, L = flash_attention_v2_forward(Q, K, V, causal=causal, **kw)
    assert _rel_err(O, O_want) < FWD_TOL
    assert np.array_equal(np.isneginf(L), np.isneginf(L_want))
    finite = np.isfinite(L_want)
    assert _rel_err(L[finite], L_want[finite]) < FWD_TOL


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("shape", "blocks"), BACKWARD_CASES, ids=_ids)
def test_flash_backward_matches_torch_autograd(rng, shape, causal, blocks):
    Q, K, V = _qkv(rng, shape)
    kw = _block_kwargs(blocks)
    O, L = flash_attention_v2_forward(Q, K, V, causal=causal, **kw)
    dO = rng.standard_normal(O.shape)
    grads = flash_attention_v2_backward(Q, K, V, O, dO, L, causal=causal, **kw)
    for name, got, want in zip(
        ("dQ", "dK", "dV"), grads, _torch_attention(Q, K, V, shape[2] ** -0.5, causal, dO), strict=True
    ):
        assert _rel_err(got, want) < BWD_TOL, name


def test_fully_masked_rows_are_exactly_zero(rng):
    """Causal with N_q > N_k: the first N_q - N_k queries see no key at all."""
    N_q, N_k, d = 20, 6, 8
    Q, K, V = _qkv(rng, (N_q, N_k, d, 5))
    blind = slice(0, N_q - N_k)
    outputs = {
        "standard": standard_attention(Q, K, V, causal=True),
        "two_pass": two_pass_attention(Q, K, V, causal=True),
        "one_pass": one_pass_attention(Q, K, V, causal=True),
        "fa1": flash_attention_v1(Q, K, V, causal=True, block_sizes=(3, 4)),
    }
    O, L = flash_attention_v2_forward(Q, K, V, causal=True, block_sizes=(3, 4))
    outputs["fa2"] = O
    for name, out in outputs.items():
        assert not np.isnan(out).any(), name
        assert np.all(out[blind] == 0.0), name
        assert np.all(out[N_q - N_k :].any(axis=1)), name
    assert np.all(np.isneginf(L[blind])) and np.isfinite(L[N_q - N_k :]).all()
    dQ, dK, dV = flash_attention_v2_backward(Q, K, V, O, rng.standard_normal(O.shape), L, causal=True)
    assert not any(np.isnan(g).any() for g in (dQ, dK, dV))
    assert np.all(dQ[blind] == 0.0)


def test_causal_mask_is_bottom_right_aligned():
    np.testing.assert_array_equal(causal_mask(3, 3), np.tril(np.ones((3, 3), bool)))
    np.testing.assert_array_equal(causal_mask(2, 4), [[1, 1, 1, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(causal_mask(3, 1), [[0], [0], [1]])


def test_scale_argument_and_float32(rng):
    Q, K, V = _qkv(rng, (9, 11, 8, 4))
    want = standard_attention(Q, K, V, scale=0.7)
    assert _rel_err(flash_attention_v2_forward(Q, K, V, scale=0.7)[0], want) < FWD_TOL
    assert _rel_err(flash_attention_v1(Q, K, V, scale=0.7), want) < FWD_TOL
    O32 = flash_attention_v2_forward(*(a.astype(np.float32) for a in (Q, K, V)), block_sizes=(4, 3))[0]
    assert O32.dtype == np.float32
    assert _rel_err(O32, standard_attention(Q, K, V)) < 1e-5


# --------------------------------------------------------------------------- block sizes


@pytest.mark.parametrize("d", [1, 8, 40, 64, 128])
@pytest.mark.parametrize("M", [1, 100, 4096, 16384, 100_000])
def test_block_size_rules(M, d):
    B_r, B_c = fa1_block_sizes(d, M=M)
    assert B_c == -(-M // (4 * d)) and B_r == min(B_c, d)
    assert fa2_block_sizes(d, M=M) == (B_c, B_r)  # the outer-loop block gets the ceil(M / 4d)
    b = standard_block_size(d, M=M)
    assert b >= 1
    assert b == 1 or 2 * b * d + b * b <= M < 2 * (b + 1) * d + (b + 1) ** 2


def test_invalid_arguments():
    Q = np.ones((3, 4))
    with pytest.raises(ValueError):
        standard_attention(Q, np.ones((3, 5)), np.ones((3, 2)))
    with pytest.raises(ValueError):
        flash_attention_v2_forward(Q, Q, Q, block_sizes=(0, 2))
    with pytest.raises(ValueError):
        fa1_block_sizes(4, M=0)
    with pytest.raises(ValueError):
        online_softmax(np.ones((2, 2, 2)))


def test_options_are_keyword_only():
    """Only the data (Q, K, V, and O, dO, L) is positional: no call can pass M where scale was meant."""
    import flashattn.reference as ref

    options = {"M", "hbm", "scale", "causal", "return_lse", "block_sizes", "block_size", "itemsize", "algorithms"}
    checked = 0
    for name in ref.__all__:
        obj = getattr(ref, name)
        if not inspect.isfunction(obj):
            continue
        for param in inspect.signature(obj).parameters.values():
            if param.name in options:
                assert param.kind is inspect.Parameter.KEYWORD_ONLY, f"{name}({param.name})"
                checked += 1
    assert checked >= 25
    Q = np.ones((4, 2))
    with pytest.raises(TypeError):
        flash_attention_v1(Q, Q, Q, 1024)
    with pytest.raises(TypeError):
        standard_attention(Q, Q, Q, 0.5)


# Who may import whom inside flashattn/reference: hbm knows no algorithm, every rung gets its
# plumbing from common, and only the attention rungs reach back to the online softmax they extend.
LAYERS = {
    "hbm": set(),
    "common": {"hbm"},
    "softmax": {"common"},
    "attention": {"common", "hbm", "softmax"},
    "flash": {"common", "hbm"},
    "traffic": {"attention", "flash", "hbm"},
}


def test_module_layout_has_no_import_circle():
    package = Path(inspect.getfile(causal_mask)).parent
    assert {p.stem for p in package.glob("*.py")} - {"__init__"} == set(LAYERS)
    for name, allowed in LAYERS.items():
        tree = ast.parse((package / f"{name}.py").read_text())
        imported = {
            node.module.rsplit(".", 1)[-1]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flashattn.reference.")
        }
        assert imported == allowed, name
        nested = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) and n not in tree.body]
        assert not nested, f"{name}.py imports inside a function"
