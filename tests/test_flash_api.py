"""flash_attn_* drop-ins on every execution path (the ``path`` fixture): forward and gradients against the float64
oracle, by the tolerance rule of oracle.py, over odd shapes and every feature; dropout reproducibility and
statistics; tiles of every size; outputs that must be written in full."""

from __future__ import annotations

import math

import pytest
import torch
from oracle import assert_close, attention_ref, check_against_oracle, feature_kwargs, make_inputs

import flashattn
from conftest import with_dropout_mask
from flashattn import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from flashattn.backends import philox

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim): odd lengths and head dims, q/k lengths that differ,
# Nq > Nk (causal then masks whole rows), a single key, and MQA/GQA. The last three are small enough for Triton's
# interpreter (the others run on a GPU).
SHAPES = [
    (1, 1, 1, 1, 1, 40),
    (2, 113, 113, 4, 2, 59),
    (1, 113, 257, 2, 1, 96),
    (1, 257, 113, 3, 3, 40),
    (2, 64, 1, 2, 2, 16),
    (1, 1025, 1025, 1, 1, 64),
    (2, 37, 45, 4, 2, 40),
    (1, 50, 19, 3, 3, 59),
    (1, 33, 70, 2, 1, 96),
]
FEATURES = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": (17, 5)},
    "window_left_causal": {"window_size": (40, -1), "causal": True},
    "softcap": {"softcap": 1.5},
    "alibi": {"alibi": True},
    "all": {"causal": True, "window_size": (64, 0), "softcap": 2.0, "alibi": True},
    "dropout": {"dropout_p": 0.2, "causal": True, "alibi": True},
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def on_path(path, features: dict, b: int, h: int) -> dict:
    kwargs = feature_kwargs(features, b, h)
    if "alibi_slopes" in kwargs:
        kwargs["alibi_slopes"] = kwargs["alibi_slopes"].to(path.device)
    return kwargs


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_and_gradients(path, shape, feature, dtype):
    b, nq, nk, h, hk, d = shape
    if nq * nk > 10**6 and (dtype != torch.float32 or feature not in ("plain", "causal", "all")):
        pytest.skip("the 1025 x 1025 shape runs a representative subset to keep the suite fast")
    path.skip_if_slow(b * h * nq * nk)
    if path.interpreted and (feature in ("softcap", "alibi") or
                             dtype == torch.bfloat16 and feature not in ("plain", "all", "dropout")):
        pytest.skip("under the interpreter (bf16 computed upcast) a subset keeps the suite fast: softcap and ALiBi "
                    "run in \"all\"")
    q, k, v = path.put(*make_inputs(*shape, dtype))
    kwargs = on_path(path, FEATURES[feature], b, h)
    p = kwargs.pop("dropout_p", 0.0)
    if p > 0:
        out, dropped = with_dropout_mask(q, k, v, p, kwargs)
        check_against_oracle(q, k, v, kwargs, out, dropped=dropped, dropout_p=p)
    else:
        check_against_oracle(q, k, v, kwargs, flash_attn_func(q, k, v, **kwargs))


def test_fully_masked_rows_are_zero_with_minus_inf_lse(path):
    # Nq > Nk with bottom-right causal: the first Nq - Nk queries see no key at all.
    q, k, v = path.put(*make_inputs(1, 9, 4, 2, 2, 8, torch.float32))
    out, lse, probs = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert probs is None  # no dropout: no S_dmask, as in flash_attn
    assert torch.equal(out[:, :5], torch.zeros_like(out[:, :5]))
    assert torch.isneginf(lse[:, :, :5]).all() and torch.isfinite(lse[:, :, 5:]).all()
    _, _, probs = flash_attn_func(q, k, v, causal=True, dropout_p=0.3, return_attn_probs=True)
    assert torch.equal(probs[:, :, :5], torch.zeros_like(probs[:, :, :5]))
    (out.sum() + lse.clamp_min(-1e4).sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, :5], torch.zeros_like(q.grad[:, :5]))
    _, ref_lse = attention_ref(q, k, v, causal=True)
    assert_close("lse", lse[:, :, 5:], ref_lse[:, :, 5:], ref_lse[:, :, 5:])


def test_window_sides_past_every_key_are_unbounded(path):
    """A window side as large as an int can be (2^31 - 1, sys.maxsize) sees every key on that side, as -1 does:
    the kernels' 32-bit row + diagonal + side must not wrap to a negative bound (the Triton kernels' did)."""
    import sys

    q, k, v = path.put(*make_inputs(1, 300, 200, 2, 2, 16, torch.float32))
    full, causal = flash_attn_func(q, k, v), flash_attn_func(q, k, v, causal=True)
    for window, want in (((-1, 2**31 - 1), full), ((2**31 - 1, 2**31 - 1), full), ((sys.maxsize, 0), causal),
                         ((2**31 - 1, -1), full)):
        torch.testing.assert_close(flash_attn_func(q, k, v, window_size=window), want, msg=str(window))


def test_empty_key_sequence_gives_zero_output(path):
    q, k, v = path.put(*make_inputs(2, 3, 0, 2, 1, 8, torch.float32))
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_softmax_lse_and_probabilities(path, dtype):
    b, nq, nk, h, d = 2, 37, 70, 3, 24
    path.skip_if_declines(dtype, d)
    q, k, v = path.put(*make_inputs(b, nq, nk, h, h, d, dtype, requires_grad=False))
    out, lse, probs = flash_attn_func(q, k, v, causal=True, softcap=3.0, dropout_p=0.25, return_attn_probs=True)
    _, ref_lse = attention_ref(q, k, v, causal=True, softcap=3.0)
    assert lse.shape == (b, h, nq)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_close("lse", lse.to(dtype), ref_lse, ref_lse)  # dropout does not touch the log-sum-exp
    assert probs.shape == (b, h, nq, nk)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    # |S_dmask| is the softmax itself (dropped entries are negated, not rescaled): rows sum to one.
    torch.testing.assert_close(probs.double().abs().sum(-1), torch.ones(b, h, nq, dtype=torch.float64,
                               device=path.device), rtol=0, atol=tol)


def test_softmax_scale_and_packed_variants_agree(path):
    b, n, h, d = 2, 50, 4, 32
    qkv = path.put(torch.randn(b, n, 3, h, d, requires_grad=True))[0]
    out_packed = flash_attn_qkvpacked_func(qkv, causal=True, softmax_scale=0.3)
    q, k, v = qkv.unbind(2)
    out = flash_attn_func(q, k, v, causal=True, softmax_scale=0.3)
    torch.testing.assert_close(out_packed, out, rtol=0, atol=0)
    ref, _ = attention_ref(q, k, v, causal=True, scale=0.3)
    assert_close("out", out_packed, ref, ref)
    out_packed.square().sum().backward()
    assert qkv.grad.shape == qkv.shape and torch.isfinite(qkv.grad).all()

    kv = path.put(torch.randn(b, 70, 2, 2, d))[0]
    out_kv = flash_attn_kvpacked_func(q, kv, window_size=(10, 10))
    torch.testing.assert_close(out_kv, flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], window_size=(10, 10)))


def test_output_is_contiguous_and_accepts_strided_inputs(path):
    base = path.put(torch.randn(2, 8, 40, 64))[0]  # (B, H, N, D) memory, seen as (B, N, H, D): non-contiguous
    q = k = v = base.transpose(1, 2)
    out = flash_attn_func(q, k, v, causal=True)
    assert out.is_contiguous()
    ref, _ = attention_ref(q, k, v, causal=True)
    assert_close("out", out, ref, ref)


def test_expanded_output_gradients(path):
    # out.sum() and lse.sum() hand the backward stride-0 (expanded) gradients: a path must read them as such.
    q, k, v = path.put(*make_inputs(1, 30, 30, 2, 2, 16, torch.float32))
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    grads = torch.autograd.grad(out.sum() + lse.sum(), (q, k, v))
    ref, ref_lse = attention_ref(q, k, v, causal=True)
    ref_grads = torch.autograd.grad(ref.sum() + ref_lse.sum(), (q, k, v))
    for x, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(x.double(), r.double(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("feature", ["plain", "causal", "all"])
def test_dropout_matches_oracle_with_the_same_mask(path, feature, dtype):
    b, nq, nk, h, hk, d = 2, 77, 91, 4, 2, 40
    path.skip_if_slow(b * h * nq * nk, why=" (the dropout feature of test_forward_and_gradients covers it)")
    q, k, v = path.put(*make_inputs(b, nq, nk, h, hk, d, dtype))
    kwargs = on_path(path, FEATURES[feature], b, h)
    out, dropped = with_dropout_mask(q, k, v, 0.17, kwargs)
    check_against_oracle(q, k, v, kwargs, out, dropped=dropped, dropout_p=0.17)


def test_dropout_is_the_same_on_every_path(path):
    """Every path draws Philox4x32-10 at the same counters: the same weights dropped, the same outputs and
    gradients as the torch path's."""
    q, k, v = make_inputs(2, 29, 41, 4, 2, 32, torch.float32)
    results = {}
    for name in (path.name, "torch"):
        leaves = path.put(q, k, v)
        torch.manual_seed(11)
        with flashattn.use_backend(name):
            out, _, s_dmask = flash_attn_func(*leaves, dropout_p=0.25, causal=True, return_attn_probs=True)
            torch.manual_seed(11)
            again = flash_attn_func(*leaves, dropout_p=0.25, causal=True)
        results[name] = (s_dmask, out, again, *torch.autograd.grad(again, leaves, torch.ones_like(again)))
    visible = results["torch"][0] != 0  # hidden entries carry no dropout decision
    assert torch.equal(torch.signbit(results[path.name][0])[visible], torch.signbit(results["torch"][0])[visible])
    for a, b in zip(results[path.name][1:], results["torch"][1:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _philox4x32_10(seed: int, counter: int) -> list[int]:
    """Philox4x32-10 (Random123's constants) on counter (low, high, 0, 0), written on Python ints."""
    mask = 0xFFFFFFFF
    c = [counter & mask, counter >> 32, 0, 0]
    k0, k1 = seed & mask, seed >> 32
    for _ in range(10):
        pb, pa = 0xCD9E8D57 * c[2], 0xD2511F53 * c[0]
        c = [(pb >> 32) ^ c[1] ^ k0, pb & mask, (pa >> 32) ^ c[3] ^ k1, pa & mask]
        k0, k1 = (k0 + 0x9E3779B9) & mask, (k1 + 0xBB67AE85) & mask
    return c


def test_dropout_draws_eight_columns_of_a_row_from_a_philox_call():
    """The generator every path shares (flashattn.backends.philox): element (row r, column j) of rows of n columns
    draws 16-bit half j & 1 of word (j >> 1) & 3 of Philox4x32-10 on counter r * ceil(n / 8) + (j >> 3), and is
    kept when draw / 2^16 >= p."""
    seed, cols = 0x2A2B2C2D3E3F, 13
    elements = [(0, 0), (0, 1), (0, 2), (0, 7), (0, 8), (0, 12), (1, 0), (1, 9), (2**33 + 5, 3), (12345678, 11)]
    want = [(_philox4x32_10(seed, r * 2 + (j >> 3))[(j >> 1) & 3] >> (16 * (j & 1))) & 0xFFFF for r, j in elements]
    rows, columns = (torch.tensor(t) for t in zip(*elements, strict=True))
    assert philox.dropout_draws(seed, rows, columns, cols).tolist() == want
    p = 0.3
    keep = philox.dropout_keep(seed, rows, columns, cols, p).tolist()
    assert keep == [draw / 65536 >= p for draw in want]


def test_dropout_reproducible_under_manual_seed_and_rate_is_p(path):
    q, k, v = path.put(*make_inputs(2, 64, 64, 2, 2, 16, torch.float32, requires_grad=False))
    p = 0.3
    torch.manual_seed(123)
    out1, _, s1 = flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    torch.manual_seed(123)
    out2, _, s2 = flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    out3, _, s3 = flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    assert torch.equal(out1, out2) and torch.equal(s1, s2)
    assert not torch.equal(out1, out3)
    rate = torch.signbit(s1).double().mean().item()
    assert abs(rate - p) < 5 * math.sqrt(p * (1 - p) / s1.numel())


def test_dropout_backward_replays_the_forward_mask(path):
    # With a fixed seed, the gradient equals the oracle's gradient for the mask S_dmask reports; a backward that
    # drew a fresh mask would not.
    path.skip_if_declines(torch.float64)
    q, k, v = path.put(*make_inputs(1, 64, 64, 2, 2, 16, torch.float64))
    out, dropped = with_dropout_mask(q, k, v, 0.5, {})
    ref, _ = attention_ref(q, k, v, dropped=dropped, dropout_p=0.5)
    g = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), g)
    theirs = torch.autograd.grad(ref, (q, k, v), g)
    for x, r in zip(ours, theirs, strict=True):
        torch.testing.assert_close(x, r, rtol=1e-10, atol=1e-10)


def test_lse_is_differentiable(path):
    # d lse_i / d S_ij = P_ij: ring/context-parallel attention merges partial results through lse.
    dtype = torch.float32 if path.name == "triton" else torch.float64
    q, k, v = path.put(*make_inputs(1, 20, 30, 2, 1, 8, dtype))
    _, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    _, ref_lse = attention_ref(q, k, v, causal=True)
    g = torch.randn_like(lse)
    ours = torch.autograd.grad(lse, (q, k), g)
    theirs = torch.autograd.grad(ref_lse, (q, k), g.double())
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for x, r in zip(ours, theirs, strict=True):
        torch.testing.assert_close(x.double(), r.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("feature", ["plain", "causal", "window", "window_left_causal", "all"])
@pytest.mark.parametrize("shape", [(2, 77, 91, 4, 2, 24), (1, 100, 37, 2, 1, 16), (1, 37, 100, 3, 1, 8)],
                         ids=lambda s: "x".join(map(str, s)))
def test_many_tiles(path, shape, feature, tiny_tiles):
    b, nq, nk, h, hk, d = shape
    path.skip_if_slow(b * h * nq * nk)
    tiny_tiles(b * h)
    q, k, v = path.put(*make_inputs(*shape, torch.float32))
    kwargs = on_path(path, FEATURES[feature], b, h)
    check_against_oracle(q, k, v, kwargs, flash_attn_func(q, k, v, **kwargs))


def test_dropout_mask_does_not_depend_on_tiling(path, tiny_tiles):
    q, k, v = path.put(*make_inputs(1, 45, 60, 4, 2, 16, torch.float32, requires_grad=False))
    torch.manual_seed(5)
    big = flash_attn_func(q, k, v, dropout_p=0.4, causal=True, return_attn_probs=True)
    tiny_tiles(1 * 4)
    torch.manual_seed(5)
    small = flash_attn_func(q, k, v, dropout_p=0.4, causal=True, return_attn_probs=True)
    visible = big[2] != 0  # masked-out entries carry no dropout decision (skipped tiles never draw one)
    assert visible.sum() > 1000
    assert torch.equal(torch.signbit(big[2])[visible], torch.signbit(small[2])[visible])
    torch.testing.assert_close(small[0], big[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("feature", ["plain", "causal", "all"])
def test_every_output_element_is_written(path, feature, tiny_tiles, poisoned):
    """Outputs, gradients and workspaces are allocated NaN-poisoned: any element a path forgets to write shows
    up."""
    shape = (2, 50, 33, 4, 2, 16)  # Nq > Nk: causal leaves whole rows with no key
    tiny_tiles(2 * 4)
    q, k, v = path.put(*make_inputs(*shape, torch.float32))
    kwargs = on_path(path, FEATURES[feature], 2, 4)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    assert not out.isnan().any() and not lse.isnan().any()
    (out.sum() + lse.clamp_min(-1e4).sum()).backward()
    assert not any(t.grad.isnan().any() for t in (q, k, v))
    check_against_oracle(*(t.detach().requires_grad_() for t in (q, k, v)), kwargs, out.detach(), grads=False)


@pytest.mark.parametrize("b,nq,nk", [(0, 5, 7), (2, 0, 7)])
def test_empty_batch_or_queries(path, b, nq, nk):
    q, k, v = path.put(*make_inputs(b, nq, nk, 2, 2, 8, torch.float32))
    out, lse, probs = flash_attn_func(q, k, v, causal=True, dropout_p=0.1, return_attn_probs=True)
    assert out.shape == (b, nq, 2, 8) and lse.shape == (b, 2, nq) and probs.shape == (b, 2, nq, nk)
    out.sum().backward()
    assert k.grad.shape == k.shape and not k.grad.any()
