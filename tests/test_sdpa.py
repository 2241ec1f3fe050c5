"""flashattn.scaled_dot_product_attention as a drop-in for PyTorch's, on every path: same results as torch's own SDPA
in float64 (float32 against it on triton), the same-precision rule in fp16/bf16, masks (boolean, additive,
broadcast, with gradient), top-left causal, GQA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import assert_close

import flashattn
from conftest import FLOAT64_PATHS


def qkv(b, h, hk, lq, lk, e, ev=None, dtype=torch.float64, device="cpu"):
    q = torch.randn(b, h, lq, e, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(b, hk, lk, e, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(b, hk, lk, ev or e, dtype=dtype, device=device, requires_grad=True)
    return q, k, v


def compare_with_torch(args, kwargs):
    """Ours against torch's SDPA on the same inputs, computed in float64: to 1e-10 from float64 inputs, to 1e-5
    (relative to the size of the result) from float32 ones (triton's most precise)."""
    ours = flashattn.scaled_dot_product_attention(*args, **kwargs)
    exact = [t.detach().double().requires_grad_(t.requires_grad) if torch.is_tensor(t) and t.is_floating_point()
             else t for t in (*args, kwargs.get("attn_mask"))]
    theirs = F.scaled_dot_product_attention(*exact[:3], **{**kwargs, "attn_mask": exact[3]})
    atol = 1e-10 if ours.dtype == torch.float64 else 1e-5
    torch.testing.assert_close(ours.double(), theirs, rtol=atol, atol=atol)
    g = torch.randn_like(ours)
    pairs = [(t, x) for t, x in zip((*args, kwargs.get("attn_mask")), exact, strict=True)
             if t is not None and t.requires_grad]
    ours_g = torch.autograd.grad(ours, [t for t, _ in pairs], g)
    theirs_g = torch.autograd.grad(theirs, [x for _, x in pairs], g.double())
    for x, r in zip(ours_g, theirs_g, strict=True):
        torch.testing.assert_close(x.double(), r, rtol=atol, atol=atol * max(1.0, r.abs().max().item()))


@pytest.mark.parametrize("lq,lk", [(1, 1), (113, 113), (40, 97), (97, 40)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_torch_sdpa(path, lq, lk, is_causal):
    path.skip_if_slow(2 * 3 * lq * lk)
    compare_with_torch(qkv(2, 3, 3, lq, lk, 59, dtype=path.exact_dtype, device=path.device),
                       {"is_causal": is_causal, "scale": 0.21})


def test_value_head_dim_may_differ_and_gqa(path):
    compare_with_torch(qkv(2, 8, 2, 33, 45, 40, ev=24, dtype=path.exact_dtype, device=path.device),
                       {"enable_gqa": True})


@pytest.mark.parametrize("grad", [False, True], ids=["constant", "learned"])
@pytest.mark.parametrize(
    "mask_shape", [(2, 3, 31, 47), (31, 47), (1, 47), (3, 1, 47), (2, 1, 31, 1)], ids=lambda s: "x".join(map(str, s))
)
def test_additive_mask_broadcasts_and_gets_its_gradient(path, mask_shape, grad):
    path.skip_if_declines(path.exact_dtype, features=("attn_mask",), mask_grad=grad)
    q, k, v = qkv(2, 3, 3, 31, 47, 16, dtype=path.exact_dtype, device=path.device)
    mask = torch.randn(mask_shape, dtype=path.exact_dtype, device=path.device, requires_grad=grad)
    compare_with_torch((q, k, v), {"attn_mask": mask})


def test_boolean_mask(path):
    q, k, v = qkv(2, 3, 3, 31, 47, 16, dtype=path.exact_dtype, device=path.device)
    mask = torch.rand(2, 1, 31, 47, device=path.device) > 0.3
    mask[..., 0] = True  # every row keeps a key, so torch's math path is defined everywhere
    compare_with_torch((q, k, v), {"attn_mask": mask})


def test_fully_masked_rows_output_zero_not_nan(path):
    q, k, v = qkv(1, 2, 2, 6, 9, 8, dtype=path.exact_dtype, device=path.device)
    mask = torch.ones(6, 9, dtype=torch.bool, device=path.device)
    mask[2] = False
    out = flashattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_causal_is_top_left_aligned(path):
    # PyTorch's is_causal: query i sees keys j <= i, even when L != S (flash_attn aligns bottom-right instead).
    q, k, v = qkv(1, 1, 1, 3, 5, 8, dtype=path.exact_dtype, device=path.device)
    out = flashattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    first_row = v[:, :, 0]
    torch.testing.assert_close(out[:, :, 0], first_row)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_low_precision_follows_the_rule(path, dtype):
    shape = (2, 4, 2, 129, 65, 96) if not path.interpreted else (1, 4, 2, 33, 29, 96)
    q, k, v = qkv(*shape, dtype=dtype, device=path.device)
    mask = torch.randn(1, 4, *shape[3:5], dtype=dtype, device=path.device)
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


def test_dropout_is_reproducible_and_changes_output(path):
    q, k, v = qkv(1, 2, 2, 50, 50, 16, dtype=torch.float32, device=path.device)
    torch.manual_seed(7)
    a = flashattn.scaled_dot_product_attention(q, k, v, dropout_p=0.2)
    torch.manual_seed(7)
    b = flashattn.scaled_dot_product_attention(q, k, v, dropout_p=0.2)
    plain = flashattn.scaled_dot_product_attention(q, k, v)
    assert torch.equal(a, b) and not torch.allclose(a, plain)


@pytest.mark.parametrize("path", FLOAT64_PATHS, indirect=True)
def test_masks_and_gradients_across_many_tiles(path, tiny_tiles):
    tiny_tiles(2 * 3)
    q, k, v = qkv(2, 3, 3, 70, 50, 16)
    mask = torch.randn(3, 70, 50, dtype=torch.float64, requires_grad=True)
    compare_with_torch((q, k, v), {"attn_mask": mask})
    compare_with_torch(qkv(2, 3, 3, 70, 50, 16), {"is_causal": True})
