"""scaled_dot_product_attention's masks as PyTorch takes them, on every path: CausalBias (both variants, L == S and
L != S, every dtype, forward and backward, under torch.compile), float32 additive masks with 16-bit q, k, v, and
masks whose strides are not a plain layout's (expanded, zero strides, transposed)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from oracle import assert_close, attention_ref
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import flashattn
from conftest import FLOAT64_PATHS

LENGTHS = [(8, 8), (6, 10), (10, 6), (1, 7), (113, 37)]
VARIANTS = {"upper_left": causal_upper_left, "lower_right": causal_lower_right}


def _bias(variant: str, lq: int, lk: int):
    with warnings.catch_warnings():  # PyTorch warns of NaNs for lower-right with L > S; flashattn outputs 0 there
        warnings.simplefilter("ignore")
        return VARIANTS[variant](lq, lk)


def _sdpa_inputs(b, h, lq, lk, e, *, dtype, device):
    return [torch.randn(b, h, n, e, dtype=dtype, device=device, requires_grad=True) for n in (lq, lk, lk)]


def _check_causal_bias(q, k, v, bias, variant):
    """Ours against float64 attention with the same corner (flash layout oracle), by the precision rule."""
    out = flashattn.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    flash = [t.transpose(1, 2) for t in (q, k, v)]
    bottom_right = variant == "lower_right"
    ref, _ = attention_ref(*flash, causal=True, bottom_right=bottom_right)
    base, _ = attention_ref(*flash, causal=True, bottom_right=bottom_right, upcast=False)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close("out", out.transpose(1, 2), ref, base)
    g = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), g)
    ref_g = torch.autograd.grad(ref, (q, k, v), g.transpose(1, 2).double())
    base_g = torch.autograd.grad(base, (q, k, v), g.transpose(1, 2))
    magnitude = max(r.abs().max().item() for r in ref_g)
    for name, x, r, bl in zip(("dq", "dk", "dv"), ours, ref_g, base_g, strict=True):
        assert_close(name, x, r, bl, factor=3.0, magnitude=magnitude, precision=q.dtype)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("lq,lk", LENGTHS)
def test_causal_bias_is_the_causal_mask_it_names(path, variant, lq, lk):
    path.skip_if_slow(2 * 3 * lq * lk)
    q, k, v = _sdpa_inputs(2, 3, lq, lk, 16, dtype=path.exact_dtype, device=path.device)
    _check_causal_bias(q, k, v, _bias(variant, lq, lk), variant)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_causal_bias_in_every_dtype(path, variant, dtype):
    path.skip_if_declines(dtype)
    q, k, v = _sdpa_inputs(1, 2, 13, 21, 40, dtype=dtype, device=path.device)
    _check_causal_bias(q, k, v, _bias(variant, 13, 21), variant)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_causal_bias_equals_torch_on_its_own_definition(variant):
    # The materialized mask PyTorch documents for each variant, through torch's own SDPA, in float64.
    lq, lk = 7, 12
    q, k, v = _sdpa_inputs(2, 2, lq, lk, 8, dtype=torch.float64, device="cpu")
    bias = _bias(variant, lq, lk)
    ours = flashattn.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=bias._materialize())
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)


def test_lower_right_rows_without_keys_output_zero(path):
    q, k, v = _sdpa_inputs(1, 2, 9, 4, 8, dtype=path.exact_dtype, device=path.device)
    out = flashattn.scaled_dot_product_attention(q, k, v, attn_mask=_bias("lower_right", 9, 4))
    assert torch.equal(out[:, :, :5], torch.zeros_like(out[:, :, :5]))  # query i sees keys j <= i - 5
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_causal_bias_under_torch_compile(variant):
    q, k, v = _sdpa_inputs(1, 2, 6, 10, 8, dtype=torch.float32, device="cpu")
    bias = _bias(variant, 6, 10)
    compiled = torch.compile(flashattn.scaled_dot_product_attention, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, attn_mask=bias),
                               flashattn.scaled_dot_product_attention(q, k, v, attn_mask=bias))


def test_causal_bias_refusals():
    q, k, v = _sdpa_inputs(1, 2, 6, 10, 8, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
        flashattn.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(6, 10), is_causal=True)
    with pytest.raises(ValueError, match=r"CausalBias for \(L, S\) = \(6, 9\) but query and key have \(L, S\) = "
                                         r"\(6, 10\)"):
        flashattn.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(6, 9))
    with pytest.raises(TypeError, match="flash_attn_func: q is a CausalBias, which holds no values"):
        flashattn.flash_attn_func(causal_upper_left(6, 10), k, v)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("grad", [False, True], ids=["constant", "learned"])
def test_float32_additive_mask_with_other_dtypes(path, dtype, grad):
    # PyTorch takes a float32 mask beside q, k, v of any float dtype; the result is in q's dtype, the mask's
    # gradient in float32.
    path.skip_if_declines(dtype, features=("attn_mask",), mask_grad=grad)
    q, k, v = _sdpa_inputs(2, 2, 17, 23, 16, dtype=dtype, device=path.device)
    mask = torch.randn(2, 1, 17, 23, device=path.device, requires_grad=grad)
    out = flashattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    up = [t.detach().double().requires_grad_() for t in (q, k, v)]
    mask64 = mask.detach().double().requires_grad_(grad)
    ref = F.scaled_dot_product_attention(*up, attn_mask=mask64)
    base = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(dtype))
    assert out.dtype == dtype
    assert_close("out", out, ref, base)
    if grad:
        g = torch.randn_like(out)
        (dmask,) = torch.autograd.grad(out, mask, g)
        (ref_dmask,) = torch.autograd.grad(ref, mask64, g.double())
        (base_dmask,) = torch.autograd.grad(base, mask, g) if base.requires_grad else (None,)
        assert dmask.dtype == torch.float32 and dmask.shape == mask.shape
        if base_dmask is not None:  # float32 is the gradient's precision beside float64 q, k, v
            precision = torch.float32 if dtype == torch.float64 else dtype
            assert_close("dmask", dmask, ref_dmask, base_dmask, factor=3.0, precision=precision)


@pytest.mark.parametrize(("q_dtype", "mask_dtype"), [(torch.bfloat16, torch.float16), (torch.float16, torch.float64),
                                                     (torch.float32, torch.float64), (torch.float32, torch.int64)])
def test_other_mask_dtypes_are_refused_as_torch_refuses_them(q_dtype, mask_dtype):
    q = torch.randn(1, 2, 4, 8, dtype=q_dtype)
    mask = torch.zeros(4, 4, dtype=mask_dtype)
    with pytest.raises(RuntimeError, match="Expected attn_mask dtype to be bool or float or to match query dtype"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    with pytest.raises(TypeError, match="scaled_dot_product_attention: Expected attn_mask dtype to be bool or float "
                                        "or to match query dtype"):
        flashattn.scaled_dot_product_attention(q, q, q, attn_mask=mask)


def _strided_masks(lq: int, lk: int, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Masks of the same values with the layouts users build: expanded (stride 0), a transposed view, a slice."""
    base = torch.randn(lq, lk, device=device, dtype=dtype)
    return {
        "expanded": base.expand(2, 3, lq, lk),
        "expanded rows": base[:1].expand(2, 1, lq, lk),
        "transposed": base.t().contiguous().t(),
        "sliced": torch.randn(lq, 2 * lk, device=device, dtype=dtype)[:, ::2],
        "boolean expanded": (base > -0.5).expand(2, 3, lq, lk),
    }


@pytest.mark.parametrize("kind", ["expanded", "expanded rows", "transposed", "sliced", "boolean expanded"])
def test_masks_with_any_strides(path, kind):
    lq, lk = 11, 19
    mask = _strided_masks(lq, lk, path.device, path.exact_dtype)[kind]
    if mask.dtype == torch.bool:
        mask = mask.clone()
        mask[..., 0] = True
    q, k, v = _sdpa_inputs(2, 3, lq, lk, 16, dtype=path.exact_dtype, device=path.device)
    ours = flashattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    theirs = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)),
                                            attn_mask=mask.contiguous() if mask.dtype == torch.bool
                                            else mask.double().contiguous())
    atol = 1e-10 if path.exact_dtype == torch.float64 else 1e-5
    torch.testing.assert_close(ours.double(), theirs, rtol=atol, atol=atol)


@pytest.mark.parametrize("path", FLOAT64_PATHS, indirect=True)
def test_expanded_mask_gets_the_summed_gradient(path):
    base = torch.randn(11, 19, dtype=torch.float64, requires_grad=True)
    q, k, v = _sdpa_inputs(2, 3, 11, 19, 16, dtype=torch.float64, device="cpu")
    out = flashattn.scaled_dot_product_attention(q, k, v, attn_mask=base.expand(2, 3, 11, 19))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=base.expand(2, 3, 11, 19))
    g = torch.randn_like(out)
    (ours,) = torch.autograd.grad(out, base, g)
    (theirs,) = torch.autograd.grad(ref, base, g)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", ["dtypes", "devices", "mask and is_causal"])
def test_errors_carry_pytorchs_words(case):
    q = torch.randn(1, 2, 4, 8)
    args, kwargs, words = {
        "dtypes": ((q, q.double(), q), {}, "Expected query, key, and value to have the same dtype"),
        "devices": ((q, q, q.to("meta")), {}, "Expected query, key, and value to have the same device type"),
        "mask and is_causal": ((q, q, q), {"attn_mask": torch.ones(4, 4, dtype=torch.bool), "is_causal": True},
                               "Explicit attn_mask should not be set when is_causal=True"),
    }[case]
    with pytest.raises(RuntimeError, match=f"scaled_dot_product_attention: {words}"):
        flashattn.scaled_dot_product_attention(*args, **kwargs)
    if case != "mask and is_causal":  # torch's CPU kernel applies both there; its math backend raises these words
        with pytest.raises(RuntimeError, match=words):
            F.scaled_dot_product_attention(*args, **kwargs)
