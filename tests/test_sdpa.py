"""flashattn.scaled_dot_product_attention as a drop-in for PyTorch's: same results as torch's own SDPA in float64,
the same-precision rule in fp16/bf16, masks (boolean, additive, broadcast, with gradient), top-left causal, GQA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import assert_close

import flashattn


def qkv(b, h, hk, lq, lk, e, ev=None, dtype=torch.float64):
    q = torch.randn(b, h, lq, e, dtype=dtype, requires_grad=True)
    k = torch.randn(b, hk, lk, e, dtype=dtype, requires_grad=True)
    v = torch.randn(b, hk, lk, ev or e, dtype=dtype, requires_grad=True)
    return q, k, v


def compare_with_torch(args, kwargs, atol=1e-10):
    ours = flashattn.scaled_dot_product_attention(*args, **kwargs)
    theirs = F.scaled_dot_product_attention(*args, **kwargs)
    torch.testing.assert_close(ours, theirs, rtol=atol, atol=atol)
    g = torch.randn_like(ours)
    inputs = [t for t in (*args, kwargs.get("attn_mask")) if t is not None and t.requires_grad]
    for x, r in zip(torch.autograd.grad(ours, inputs, g), torch.autograd.grad(theirs, inputs, g), strict=True):
        torch.testing.assert_close(x, r, rtol=atol, atol=atol)


@pytest.mark.parametrize("lq,lk", [(1, 1), (113, 113), (40, 97), (97, 40)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_torch_sdpa_float64(lq, lk, is_causal):
    compare_with_torch(qkv(2, 3, 3, lq, lk, 59), {"is_causal": is_causal, "scale": 0.21})


def test_value_head_dim_may_differ_and_gqa():
    compare_with_torch(qkv(2, 8, 2, 33, 45, 40, ev=24), {"enable_gqa": True})


@pytest.mark.parametrize(
    "mask_shape", [(2, 3, 31, 47), (31, 47), (1, 47), (3, 1, 47), (2, 1, 31, 1)], ids=lambda s: "x".join(map(str, s))
)
def test_additive_mask_broadcasts_and_gets_its_gradient(mask_shape):
    q, k, v = qkv(2, 3, 3, 31, 47, 16)
    mask = torch.randn(mask_shape, dtype=torch.float64, requires_grad=True)
    compare_with_torch((q, k, v), {"attn_mask": mask})


def test_boolean_mask():
    q, k, v = qkv(2, 3, 3, 31, 47, 16)
    mask = torch.rand(2, 1, 31, 47) > 0.3
    mask[..., 0] = True  # every row keeps a key, so torch's math path is defined everywhere
    compare_with_torch((q, k, v), {"attn_mask": mask})


def test_fully_masked_rows_output_zero_not_nan():
    q, k, v = qkv(1, 2, 2, 6, 9, 8)
    mask = torch.ones(6, 9, dtype=torch.bool)
    mask[2] = False
    out = flashattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_causal_is_top_left_aligned():
    # PyTorch's is_causal: query i sees keys j <= i, even when L != S (flash_attn aligns bottom-right instead).
    q, k, v = qkv(1, 1, 1, 3, 5, 8)
    out = flashattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    first_row = v[:, :, 0]
    torch.testing.assert_close(out[:, :, 0], first_row)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_low_precision_follows_the_rule(dtype):
    q, k, v = qkv(2, 4, 2, 129, 65, 96, dtype=dtype)
    mask = torch.randn(1, 4, 129, 65, dtype=dtype)
    ours = flashattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    up = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*up, attn_mask=mask.double(), enable_gqa=True)
    base = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert ours.shape == ref.shape and ours.dtype == dtype
    assert_close("out", ours, ref, base)
    g = torch.randn_like(ours)
    grads = torch.autograd.grad(ours, (q, k, v), g)
    ref_g = torch.autograd.grad(ref, up, g.double())
    base_g = torch.autograd.grad(base, (q, k, v), g)
    for name, x, r, bl in zip(("dq", "dk", "dv"), grads, ref_g, base_g, strict=True):
        assert_close(name, x, r, bl, factor=3.0)


def test_dropout_is_reproducible_and_changes_output():
    q, k, v = qkv(1, 2, 2, 50, 50, 16, dtype=torch.float32)
    torch.manual_seed(7)
    a = flashattn.scaled_dot_product_attention(q, k, v, dropout_p=0.2)
    torch.manual_seed(7)
    b = flashattn.scaled_dot_product_attention(q, k, v, dropout_p=0.2)
    plain = flashattn.scaled_dot_product_attention(q, k, v)
    assert torch.equal(a, b) and not torch.allclose(a, plain)


def test_masks_and_gradients_across_many_tiles(monkeypatch):
    from flashattn.backends import cpu

    monkeypatch.setattr(cpu, "MAX_BLOCK_K", 16)
    monkeypatch.setattr(cpu, "MIN_BLOCK_Q", 1)
    monkeypatch.setattr(cpu, "TILE_ELEMENTS", 13 * 16 * 6)
    q, k, v = qkv(2, 3, 3, 70, 50, 16)
    mask = torch.randn(3, 70, 50, dtype=torch.float64, requires_grad=True)
    compare_with_torch((q, k, v), {"attn_mask": mask})
    compare_with_torch(qkv(2, 3, 3, 70, 50, 16), {"is_causal": True})
