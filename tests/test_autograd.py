"""Gradients by torch.autograd.gradcheck in float64 (every feature, lse included) on the paths that take float64,
and torch.compile tracing the one op without graph breaks on every path."""

from __future__ import annotations

import pytest
import torch

import flashattn
from conftest import FLOAT64_PATHS

CASES = {
    "plain": {},
    "causal_gqa": {"causal": True},
    "window_softcap": {"window_size": (3, 2), "softcap": 1.2},
    "alibi": {"alibi": True, "causal": True},
    "dropout": {"dropout_p": 0.3, "window_size": (4, -1)},
}


@pytest.mark.parametrize("path", FLOAT64_PATHS, indirect=True)
@pytest.mark.parametrize("case", CASES)
def test_gradcheck_flash(path, case):
    kwargs = dict(CASES[case])
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.rand(2, 4, dtype=torch.float64)
    q = torch.randn(2, 7, 4, 5, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 9, 2, 5, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 9, 2, 5, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v):
        torch.manual_seed(0)  # dropout: the same mask on every evaluation gradcheck makes
        out, lse, _ = flashattn.flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
        return out, lse

    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("path", FLOAT64_PATHS, indirect=True)
def test_gradcheck_sdpa_with_learned_mask(path):
    q = torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 5, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(2, 1, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, m: flashattn.scaled_dot_product_attention(q, k, v, attn_mask=m), (q, k, v, mask)
    )


def test_torch_compile_fullgraph_matches_eager(path):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(32, 96)

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(x).view(b, n, 3, 4, 8).unbind(2)
            out = flashattn.flash_attn_func(q, k, v, causal=True, softcap=5.0)
            sdpa = flashattn.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            return out.reshape(b, n, 32) + sdpa.transpose(1, 2).reshape(b, n, 32)

    torch._dynamo.reset()
    model = Block().to(path.device)
    x = torch.randn(2, 19, 32, device=path.device)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    eager_out = model(x)
    compiled_out = compiled(x)
    torch.testing.assert_close(compiled_out, eager_out)
    eager_grads = torch.autograd.grad(eager_out.sum(), list(model.parameters()))
    compiled_grads = torch.autograd.grad(compiled_out.sum(), list(model.parameters()))
    for a, b in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(a, b)


def test_custom_op_passes_torch_library_opcheck(path):
    q, k, v = path.put(*(torch.randn(1, n, h, 8, requires_grad=True) for n, h in ((5, 2), (6, 1), (6, 1))))
    from flashattn.backends.spec import AttentionSpec

    spec = AttentionSpec(scale=0.3, window_left=-1, window_right=0, bottom_right=True, diagonal_offset=2)
    args = (q, k, v, *spec.as_args(), path.name, False)
    torch.library.opcheck(torch.ops.flashattn.attention.default, args)
