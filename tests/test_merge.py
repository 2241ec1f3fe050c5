"""merge_attention_states: attention over a union of key sets from the parts, in the stable form."""

from __future__ import annotations

import math

import pytest
import torch

from flashattn import flash_attn_func, merge_attention_states


def partial(q, k, v):
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("split", [1, 17, 39])
def test_merging_two_key_splits_gives_full_attention(dtype, split):
    q = torch.randn(2, 23, 4, 32, dtype=dtype)
    k, v = torch.randn(2, 40, 2, 32, dtype=dtype), torch.randn(2, 40, 2, 32, dtype=dtype)
    out, lse = merge_attention_states(*partial(q, k[:, :split], v[:, :split]), *partial(q, k[:, split:], v[:, split:]))
    want_out, want_lse = partial(q, k, v)
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2}[dtype]
    assert out.dtype == dtype and lse.dtype == want_lse.dtype
    torch.testing.assert_close(out, want_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, want_lse, rtol=tol, atol=tol)


def test_empty_sides_and_huge_values():
    out_a, out_b = torch.randn(1, 3, 2, 4), torch.randn(1, 3, 2, 4)
    lse_a = torch.tensor([[[-math.inf, 1e4, -math.inf], [0.0, -1e4, 5.0]]])
    lse_b = torch.tensor([[[-math.inf, 1e4, 2.0], [-math.inf, -1e4, 5.0]]])
    out, lse = merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert torch.isneginf(lse[0, 0, 0]) and torch.equal(out[0, 0, 0], torch.zeros(4))  # empty on both sides
    torch.testing.assert_close(lse[0, 0, 1], torch.tensor(1e4 + math.log(2)))  # no overflow at e^{1e4}
    torch.testing.assert_close(out[0, 1, 0], (out_a[0, 1, 0] + out_b[0, 1, 0]) / 2)
    torch.testing.assert_close(out[0, 2, 0], out_b[0, 2, 0])  # side a empty: side b as it is
    torch.testing.assert_close(out[0, 0, 1], out_a[0, 0, 1])
    assert torch.isfinite(out).all()


def test_varlen_layout_and_gradients():
    out_a, out_b = (torch.randn(7, 3, 5, dtype=torch.float64, requires_grad=True) for _ in range(2))
    lse_a, lse_b = (torch.randn(3, 7, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(merge_attention_states, (out_a, lse_a, out_b, lse_b))


def test_shape_errors_name_the_arguments():
    with pytest.raises(ValueError, match="lse of shape"):
        merge_attention_states(torch.randn(1, 3, 2, 4), torch.randn(1, 3, 2), torch.randn(1, 3, 2, 4),
                               torch.randn(1, 3, 2))
    with pytest.raises(TypeError, match="lse_b must be floating point"):
        merge_attention_states(torch.randn(3, 2, 4), torch.randn(2, 3), torch.randn(3, 2, 4),
                               torch.ones(2, 3, dtype=torch.int64))
