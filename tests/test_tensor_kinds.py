"""Tensors that are not plain dense data, as q, k, v or masks: each is converted as PyTorch converts it or refused
with an error naming the function, the argument and the type, never read as plain data (flashattn.checks.kinds)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.masked import masked_tensor
from torch.testing._internal.two_tensor import TwoTensor

import flashattn
from conftest import FLOAT64_PATHS
from flashattn import flash_attn_func, scaled_dot_product_attention


def _jagged(lengths, heads, dim, *, dtype=torch.float64, device="cpu"):
    """A (batch, heads, j, dim) jagged tensor, ragged in the sequence: how PyTorch's SDPA takes nested tensors."""
    rows = [torch.randn(n, heads, dim, dtype=dtype, device=device) for n in lengths]
    return torch.nested.nested_tensor(rows, layout=torch.jagged, requires_grad=True).transpose(1, 2)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(("lengths_q", "lengths_k", "heads"),
                         [((3, 5), (3, 5), (2, 2)), ((1, 7, 2), (6, 1, 3), (4, 2))])
def test_jagged_nested_tensors_attend_each_sequence(path, lengths_q, lengths_k, heads, is_causal):
    q = _jagged(lengths_q, heads[0], 16, dtype=path.exact_dtype, device=path.device)
    k, v = (_jagged(lengths_k, heads[1], 16, dtype=path.exact_dtype, device=path.device) for _ in range(2))
    gqa = heads[0] != heads[1]
    out = scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=gqa)
    assert out.is_nested and out.shape[:2] == q.shape[:2]
    assert (out + q).shape == q.shape  # the same ragged dimension as the query's
    dense = [(a.detach().double()[None], b.detach().double()[None], c.detach().double()[None])
             for a, b, c in zip(q.unbind(), k.unbind(), v.unbind(), strict=True)]
    tol = {"rtol": 1e-10, "atol": 1e-10} if path.exact_dtype == torch.float64 else {"rtol": 2e-5, "atol": 2e-5}
    for got, (a, b, c) in zip(out.unbind(), dense, strict=True):
        want = F.scaled_dot_product_attention(a, b, c, is_causal=is_causal, enable_gqa=gqa)[0]
        torch.testing.assert_close(got.double(), want, **tol)
    (grad,) = torch.autograd.grad(out.transpose(1, 2).values().square().sum(), q)
    leaves = [a.requires_grad_() for a, _, _ in dense]
    sum(F.scaled_dot_product_attention(a, b, c, is_causal=is_causal, enable_gqa=gqa).square().sum()
        for a, (_, b, c) in zip(leaves, dense, strict=True)).backward()
    assert grad.is_nested
    for got, a in zip(grad.unbind(), leaves, strict=True):
        torch.testing.assert_close(got.double(), a.grad[0], **tol)


def test_nested_refusals():
    q = _jagged((3, 5), 2, 8)
    dense = torch.randn(2, 2, 5, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"Expected query, key, and value to be nested tensors, but got "
                                        r"query.is_nested: True, key.is_nested: False"):
        scaled_dot_product_attention(q, dense, dense)
    with pytest.raises(ValueError, match="attn_mask is not taken with nested query, key and value"):
        scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(5, 5, dtype=torch.bool))
    strided = torch.nested.nested_tensor([torch.randn(2, n, 8) for n in (3, 5)])
    with pytest.raises(TypeError, match="query is a nested tensor of layout torch.strided"):
        scaled_dot_product_attention(strided, strided, strided)
    rows = q.transpose(1, 2)
    with pytest.raises(TypeError, match="flash_attn_func: q is a nested tensor, whose sequences are ragged; pass "
                                        "them packed: flash_attn_varlen_func"):
        flash_attn_func(rows, rows, rows)


REFUSED = {  # what each kind becomes in the message
    "sparse": (lambda t: t.to_sparse(), "a torch.sparse_coo tensor"),
    "mkldnn": (lambda t: t.float().to_mkldnn(), "a torch._mkldnn tensor"),
    "MaskedTensor": (lambda t: _quiet(masked_tensor, t, torch.ones_like(t, dtype=torch.bool)),
                     "a torch.masked.maskedtensor.core.MaskedTensor, a tensor subclass whose values are not "
                     "plain data"),
    "wrapper subclass": (lambda t: TwoTensor(t, t.clone()), "a torch.testing._internal.two_tensor.TwoTensor, a tensor "
                                                            "subclass whose values are not plain data"),
}


def _quiet(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MaskedTensor warns that it is a prototype
        return fn(*args)


@pytest.mark.parametrize("kind", list(REFUSED))
@pytest.mark.parametrize("argument", ["query", "attn_mask"])
def test_tensors_that_are_not_plain_data_are_refused(kind, argument):
    make, described = REFUSED[kind]
    q = torch.randn(1, 2, 4, 8)
    mask = torch.zeros(4, 4)
    args = {"query": make(q), "attn_mask": None} if argument == "query" else {"query": q, "attn_mask": make(mask)}
    with pytest.raises(TypeError, match=f"scaled_dot_product_attention: {argument} is {described}"):
        scaled_dot_product_attention(args["query"], q, q, attn_mask=args["attn_mask"])


@pytest.mark.parametrize("kind", ["sparse", "wrapper subclass"])
def test_flash_attn_refuses_them_too(kind):
    make, described = REFUSED[kind]
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(TypeError, match=f"flash_attn_func: k is {described}"):
        flash_attn_func(q, make(q), q)
    with pytest.raises(TypeError, match=f"flash_attn_func: alibi_slopes is {described}"):
        flash_attn_func(q, q, q, alibi_slopes=make(torch.rand(2)))


class _PlainSubclass(torch.Tensor):
    """A subclass that keeps its data the ordinary way (as_subclass): read as the tensor it is."""


@pytest.mark.parametrize("path", FLOAT64_PATHS, indirect=True)
def test_subclasses_that_hold_plain_data_are_read_as_data(path):
    q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64) for n in (4, 6, 6))
    want = F.scaled_dot_product_attention(q, k, v)
    got = scaled_dot_product_attention(q.as_subclass(_PlainSubclass), torch.nn.Parameter(k), v)
    torch.testing.assert_close(got.as_subclass(torch.Tensor), want, rtol=1e-10, atol=1e-10)


def test_fake_tensors_trace_through_the_checks():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode, flashattn.use_backend("torch"):
        q = mode.from_tensor(torch.randn(1, 2, 4, 8))
        assert scaled_dot_product_attention(q, q, q, is_causal=True).shape == (1, 2, 4, 8)
