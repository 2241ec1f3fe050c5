"""flash_attn_* drop-ins on the CPU path: forward and gradients against the float64 oracle, by the tolerance rule
of oracle.py, over odd shapes and every feature; dropout reproducibility and statistics."""

from __future__ import annotations

import math

import pytest
import torch
from oracle import assert_close, attention_ref, check_against_oracle, feature_kwargs, make_inputs

from flashattn import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim): odd lengths and head dims, q/k lengths that differ,
# Nq > Nk (causal then masks whole rows), a single key, and MQA/GQA.
SHAPES = [
    (1, 1, 1, 1, 1, 40),
    (2, 113, 113, 4, 2, 59),
    (1, 113, 257, 2, 1, 96),
    (1, 257, 113, 3, 3, 40),
    (2, 64, 1, 2, 2, 16),
    (1, 1025, 1025, 1, 1, 64),
]
FEATURES = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": (17, 5)},
    "window_left_causal": {"window_size": (40, -1), "causal": True},
    "softcap": {"softcap": 1.5},
    "alibi": {"alibi": True},
    "all": {"causal": True, "window_size": (64, 0), "softcap": 2.0, "alibi": True},
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_and_gradients(shape, feature, dtype):
    b, nq, nk, h, hk, d = shape
    if nq * nk > 10**6 and (dtype != torch.float32 or feature not in ("plain", "causal", "all")):
        pytest.skip("the 1025 x 1025 shape runs a representative subset to keep the suite fast")
    q, k, v = make_inputs(*shape, dtype)
    kwargs = feature_kwargs(FEATURES[feature], b, h)
    out = flash_attn_func(q, k, v, **kwargs)
    check_against_oracle(q, k, v, kwargs, out)


def test_fully_masked_rows_are_zero_with_minus_inf_lse():
    # Nq > Nk with bottom-right causal: the first Nq - Nk queries see no key at all.
    q, k, v = make_inputs(1, 9, 4, 2, 2, 8, torch.float32)
    out, lse, probs = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert probs is None  # no dropout: no S_dmask, as in flash_attn
    assert torch.equal(out[:, :5], torch.zeros_like(out[:, :5]))
    assert torch.isneginf(lse[:, :, :5]).all() and torch.isfinite(lse[:, :, 5:]).all()
    _, _, probs = flash_attn_func(q, k, v, causal=True, dropout_p=0.3, return_attn_probs=True)
    assert torch.equal(probs[:, :, :5], torch.zeros_like(probs[:, :, :5]))
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, :5], torch.zeros_like(q.grad[:, :5]))


def test_empty_key_sequence_gives_zero_output():
    q, k, v = make_inputs(2, 3, 0, 2, 1, 8, torch.float32)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_softmax_lse_and_probabilities(dtype):
    b, nq, nk, h, d = 2, 37, 70, 3, 24
    q, k, v = make_inputs(b, nq, nk, h, h, d, dtype, requires_grad=False)
    out, lse, probs = flash_attn_func(q, k, v, causal=True, softcap=3.0, dropout_p=0.25, return_attn_probs=True)
    _, ref_lse = attention_ref(q, k, v, causal=True, softcap=3.0)
    assert lse.shape == (b, h, nq)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_close("lse", lse.to(dtype), ref_lse, ref_lse)  # dropout does not touch the log-sum-exp
    assert probs.shape == (b, h, nq, nk)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    # |S_dmask| is the softmax itself (dropped entries are negated, not rescaled): rows sum to one.
    torch.testing.assert_close(probs.double().abs().sum(-1), torch.ones(b, h, nq, dtype=torch.float64), rtol=0,
                               atol=tol)


def test_softmax_scale_and_packed_variants_agree():
    b, n, h, d = 2, 50, 4, 32
    qkv = torch.randn(b, n, 3, h, d, requires_grad=True)
    out_packed = flash_attn_qkvpacked_func(qkv, causal=True, softmax_scale=0.3)
    q, k, v = qkv.unbind(2)
    out = flash_attn_func(q, k, v, causal=True, softmax_scale=0.3)
    torch.testing.assert_close(out_packed, out, rtol=0, atol=0)
    ref, _ = attention_ref(q, k, v, causal=True, scale=0.3)
    assert_close("out", out_packed, ref, ref)
    out_packed.square().sum().backward()
    assert qkv.grad.shape == qkv.shape and torch.isfinite(qkv.grad).all()

    kv = torch.randn(b, 70, 2, 2, d)
    out_kv = flash_attn_kvpacked_func(q, kv, window_size=(10, 10))
    torch.testing.assert_close(out_kv, flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], window_size=(10, 10)))


def test_output_is_contiguous_and_accepts_strided_inputs():
    base = torch.randn(2, 8, 40, 64)  # (B, H, N, D) memory, seen as (B, N, H, D): non-contiguous q, k, v
    q = k = v = base.transpose(1, 2)
    out = flash_attn_func(q, k, v)
    assert out.is_contiguous()
    ref, _ = attention_ref(q, k, v)
    assert_close("out", out, ref, ref)


def dropped_from(s_dmask):
    # S_dmask carries the probability, negated (sign bit set, -0.0 included) where dropout removed it.
    return torch.signbit(s_dmask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("feature", ["plain", "causal", "all"])
def test_dropout_matches_oracle_with_the_same_mask(feature, dtype):
    b, nq, nk, h, hk, d = 2, 77, 91, 4, 2, 40
    p = 0.17
    q, k, v = make_inputs(b, nq, nk, h, hk, d, dtype)
    kwargs = feature_kwargs(FEATURES[feature], b, h)
    out, _, s_dmask = flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True, **kwargs)
    dropped = dropped_from(s_dmask)
    check_against_oracle(q, k, v, kwargs, out, dropped=dropped, dropout_p=p)


def test_dropout_reproducible_under_manual_seed_and_rate_is_p():
    q, k, v = make_inputs(4, 128, 128, 2, 2, 16, torch.float32, requires_grad=False)
    p = 0.3
    torch.manual_seed(123)
    out1, _, s1 = flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    torch.manual_seed(123)
    out2, _, s2 = flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    out3, _, s3 = flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    assert torch.equal(out1, out2) and torch.equal(s1, s2)
    assert not torch.equal(out1, out3)
    rate = dropped_from(s1).double().mean().item()
    assert abs(rate - p) < 5 * math.sqrt(p * (1 - p) / s1.numel())


def test_dropout_backward_replays_the_forward_mask():
    # With a fixed seed, the gradient from flash_attn equals the oracle's gradient for the mask S_dmask reports;
    # a backward that drew a fresh mask would not.
    q, k, v = make_inputs(1, 64, 64, 2, 2, 16, torch.float64)
    out, _, s_dmask = flash_attn_func(q, k, v, dropout_p=0.5, return_attn_probs=True)
    ref, _ = attention_ref(q, k, v, dropped=dropped_from(s_dmask), dropout_p=0.5)
    g = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), g)
    theirs = torch.autograd.grad(ref, (q, k, v), g)
    for x, r in zip(ours, theirs, strict=True):
        torch.testing.assert_close(x, r, rtol=1e-10, atol=1e-10)


def test_lse_is_differentiable():
    # d lse_i / d S_ij = P_ij: ring/context-parallel attention merges partial results through lse.
    q, k, v = make_inputs(1, 20, 30, 2, 1, 8, torch.float64)
    _, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    _, ref_lse = attention_ref(q, k, v, causal=True)
    g = torch.randn_like(lse)
    ours = torch.autograd.grad(lse, (q, k), g)
    theirs = torch.autograd.grad(ref_lse, (q, k), g)
    for x, r in zip(ours, theirs, strict=True):
        torch.testing.assert_close(x, r, rtol=1e-10, atol=1e-10)


@pytest.fixture
def tiny_tiles(monkeypatch):
    """Force 13-row x 16-column tiles so every test shape spans many query and key blocks (mask edges, skipped
    blocks, partial last blocks); returns a function that applies them for a given batch x heads."""
    from flashattn.backends import cpu

    def apply(batch_heads):
        monkeypatch.setattr(cpu, "MAX_BLOCK_K", 16)
        monkeypatch.setattr(cpu, "MIN_BLOCK_Q", 1)
        monkeypatch.setattr(cpu, "TILE_ELEMENTS", 13 * 16 * batch_heads)

    return apply


@pytest.mark.parametrize("feature", ["plain", "causal", "window", "window_left_causal", "all"])
@pytest.mark.parametrize("shape", [(2, 77, 91, 4, 2, 24), (1, 100, 37, 2, 1, 16), (1, 37, 100, 3, 1, 8)],
                         ids=lambda s: "x".join(map(str, s)))
def test_many_tiles(shape, feature, tiny_tiles):
    b, nq, nk, h, hk, d = shape
    tiny_tiles(b * h)
    q, k, v = make_inputs(*shape, torch.float32)
    kwargs = feature_kwargs(FEATURES[feature], b, h)
    check_against_oracle(q, k, v, kwargs, flash_attn_func(q, k, v, **kwargs))


def test_dropout_mask_does_not_depend_on_tiling(tiny_tiles):
    q, k, v = make_inputs(2, 45, 60, 4, 2, 16, torch.float32, requires_grad=False)
    torch.manual_seed(5)
    big = flash_attn_func(q, k, v, dropout_p=0.4, causal=True, return_attn_probs=True)
    tiny_tiles(2 * 4)
    torch.manual_seed(5)
    small = flash_attn_func(q, k, v, dropout_p=0.4, causal=True, return_attn_probs=True)
    visible = big[2] != 0  # masked-out entries carry no dropout decision (skipped tiles never draw one)
    assert visible.sum() > 1000
    assert torch.equal(torch.signbit(big[2])[visible], torch.signbit(small[2])[visible])
    torch.testing.assert_close(small[0], big[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("feature", ["plain", "causal", "all"])
def test_every_output_element_is_written(feature, tiny_tiles, monkeypatch):
    """Outputs and gradients are allocated NaN-poisoned: any element the backend forgets to write shows up."""
    from flashattn.backends import cpu

    monkeypatch.setattr(cpu, "_uninitialized", lambda *shape, dtype, device: torch.full(
        shape, math.nan, dtype=dtype, device=device))
    shape = (2, 50, 33, 4, 2, 16)  # Nq > Nk: causal leaves whole rows with no key
    tiny_tiles(2 * 4)
    q, k, v = make_inputs(*shape, torch.float32)
    kwargs = feature_kwargs(FEATURES[feature], 2, 4)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    assert not out.isnan().any() and not lse.isnan().any()
    (out.sum() + lse.clamp_min(-1e4).sum()).backward()
    assert not any(t.grad.isnan().any() for t in (q, k, v))
    check_against_oracle(q.detach().requires_grad_(), k.detach().requires_grad_(), v.detach().requires_grad_(),
                         kwargs, out.detach(), grads=False)


@pytest.mark.parametrize("b,nq,nk", [(0, 5, 7), (2, 0, 7)])
def test_empty_batch_or_queries(b, nq, nk):
    q, k, v = make_inputs(b, nq, nk, 2, 2, 8, torch.float32)
    out, lse, probs = flash_attn_func(q, k, v, causal=True, dropout_p=0.1, return_attn_probs=True)
    assert out.shape == (b, nq, 2, 8) and lse.shape == (b, 2, nq) and probs.shape == (b, 2, nq, nk)
    out.sum().backward()
    assert k.grad.shape == k.shape and not k.grad.any()
