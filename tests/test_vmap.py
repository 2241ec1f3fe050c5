"""torch.func over the drop-ins, on every path: vmap of the forward and backward (any in_dims, nested, a mapped
mask), grad, jacrev, and gradcheck's batched gradients; the rule that folds the mapped dimension into the batch
and the one that runs slice by slice give the same answers as a loop of plain calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flashattn
from conftest import FLOAT64_PATHS
from flashattn import flash_attn_func, flash_attn_varlen_func, scaled_dot_product_attention


def _tol(path) -> dict:
    return {"rtol": 1e-10, "atol": 1e-10} if path.exact_dtype == torch.float64 else {"rtol": 2e-5, "atol": 2e-5}


def _randn(*shape, path, grad=False):
    return torch.randn(*shape, dtype=path.exact_dtype, device=path.device, requires_grad=grad)


@pytest.mark.parametrize("in_dims", [(0, 0, 0), (0, None, None), (None, 1, 1), (2, 0, None)], ids=str)
def test_vmap_sdpa_matches_a_loop(path, in_dims):
    size, shape = 3, {"q": (2, 2, 5, 8), "k": (2, 2, 7, 8), "v": (2, 2, 7, 8)}

    def mapped(name, dim):
        one = shape[name]
        return _randn(*one, path=path) if dim is None else _randn(*one[:dim], size, *one[dim:], path=path)

    q, k, v = (mapped(n, d) for n, d in zip(("q", "k", "v"), in_dims, strict=True))
    out = torch.func.vmap(lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True),
                          in_dims=in_dims)(q, k, v)
    pick = [(lambda t, i, d=d: t if d is None else t.select(d, i)) for d in in_dims]
    loop = torch.stack([scaled_dot_product_attention(*(p(t, i) for p, t in zip(pick, (q, k, v), strict=True)),
                                                     is_causal=True) for i in range(size)])
    torch.testing.assert_close(out, loop, **_tol(path))


def test_nested_vmap_and_mapped_masks(path):
    q, k, v = (_randn(2, 3, 1, 2, n, 8, path=path) for n in (5, 6, 6))
    exact = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)))
    nested = torch.func.vmap(torch.func.vmap(scaled_dot_product_attention))(q, k, v)
    torch.testing.assert_close(nested.double(), exact, **_tol(path))
    masks = _randn(3, 5, 6, path=path)
    out = torch.func.vmap(lambda q, m: scaled_dot_product_attention(q, k[0, 0], v[0, 0], attn_mask=m))(q[0], masks)
    ref = F.scaled_dot_product_attention(q[0].double(), k[0, 0].double(), v[0, 0].double(),
                                         attn_mask=masks[:, None, None].double())
    torch.testing.assert_close(out.double(), ref, **_tol(path))


def test_vmap_flash_attn_func_forward_and_backward(path):
    q, k, v = (_randn(3, 2, n, 4, 16, path=path, grad=True) for n in (9, 12, 12))
    out = torch.func.vmap(lambda q, k, v: flash_attn_func(q, k, v, causal=True, window_size=(3, 1)))(q, k, v)
    loop = torch.stack([flash_attn_func(q[i], k[i], v[i], causal=True, window_size=(3, 1)) for i in range(3)])
    torch.testing.assert_close(out, loop, **_tol(path))
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    loop_grads = torch.autograd.grad(loop, (q, k, v), g)
    for x, r in zip(grads, loop_grads, strict=True):
        torch.testing.assert_close(x, r, **_tol(path))


def test_vmap_over_packed_sequences_runs_slice_by_slice(path):
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=path.device)
    q, k, v = (_randn(2, 8, 2, 16, path=path) for _ in range(3))
    call = lambda q, k, v: flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True)  # noqa: E731
    loop = torch.stack([call(*t) for t in zip(q, k, v, strict=True)])
    torch.testing.assert_close(torch.func.vmap(call)(q, k, v), loop, **_tol(path))


def test_grad_and_jacrev(path):
    q, k, v = (_randn(1, 2, n, 8, path=path) for n in (4, 6, 6))
    grad = torch.func.grad(lambda q: scaled_dot_product_attention(q, k, v, is_causal=True).square().sum())(q)
    leaf = q.double().requires_grad_()
    F.scaled_dot_product_attention(leaf, k.double(), v.double(), is_causal=True).square().sum().backward()
    torch.testing.assert_close(grad.double(), leaf.grad, **_tol(path))
    jac = torch.func.jacrev(lambda q: scaled_dot_product_attention(q, k[0, 0], v[0, 0]))(q[0, 0, :2])
    ref = torch.func.jacrev(lambda q: F.scaled_dot_product_attention(q, k[0, 0].double(), v[0, 0].double()))(
        q[0, 0, :2].double())
    assert jac.shape == (2, 8, 2, 8)
    torch.testing.assert_close(jac.double(), ref, **_tol(path))


@pytest.mark.parametrize("path", FLOAT64_PATHS, indirect=True)
@pytest.mark.parametrize("case", ["sdpa causal", "sdpa mask", "flash window"])
def test_gradcheck_with_batched_gradients(path, case):
    q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64, requires_grad=True) for n in (3, 5, 5))
    if case == "sdpa causal":
        fn, args = (lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True)), (q, k, v)
    elif case == "sdpa mask":
        mask = torch.randn(1, 2, 3, 5, dtype=torch.float64, requires_grad=True)
        fn, args = (lambda q, k, v, m: scaled_dot_product_attention(q, k, v, attn_mask=m)), (q, k, v, mask)
    else:
        fn = lambda q, k, v: flash_attn_func(q, k, v, causal=True, window_size=(1, 0))  # noqa: E731
        args = tuple(t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(fn, args, check_batched_grad=True)


def test_dropout_follows_vmap_randomness(path):
    q, k, v = (_randn(1, 2, 16, 8, path=path).expand(3, 1, 2, 16, 8) for _ in range(3))
    call = lambda q, k, v: scaled_dot_product_attention(q, k, v, dropout_p=0.5)  # noqa: E731
    with pytest.raises(RuntimeError, match="randomness"):
        torch.func.vmap(call)(q, k, v)
    same = torch.func.vmap(call, randomness="same")(q, k, v)
    different = torch.func.vmap(call, randomness="different")(q, k, v)
    assert torch.equal(same[0], same[1]) and torch.equal(same[1], same[2])
    assert not torch.equal(different[0], different[1])


def test_backward_is_not_differentiable_under_torch_func():
    q, k, v = (torch.randn(1, 2, 4, 8, dtype=torch.float64) for _ in range(3))
    with flashattn.use_backend("torch"), pytest.raises(RuntimeError, match="not differentiable"):
        torch.func.grad(lambda q: torch.func.grad(
            lambda q: scaled_dot_product_attention(q, k, v).sum())(q).sum())(q)


def test_vmap_under_torch_compile():
    # Traced, the op is the registered custom op: its own batching rule (the fold) runs in the graph.
    q, k, v = (torch.randn(3, 2, 2, n, 8) for n in (5, 7, 7))
    masks = torch.randn(3, 5, 7)
    mapped = torch.func.vmap(lambda q, k, v, m: scaled_dot_product_attention(q, k, v, attn_mask=m))
    compiled = torch.compile(mapped, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, masks),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=masks[:, None, None]))
