"""A value head dim that differs from the query/key head dim (FlashAttention-3 takes it; MLA prefill uses 192 for
q/k and 128 for v) through every entry point: dense, varlen and KV cache, on every path, against the float64
oracle."""

from __future__ import annotations

import pytest
import torch
from oracle import attention_ref, check_against_oracle

import flashattn


def _inputs(b, nq, nk, h, hk, d, dv, dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    q = torch.randn(b, nq, h, d, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(b, nk, hk, d, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(b, nk, hk, dv, dtype=dtype, device=device, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("d,dv", [(192, 128), (96, 64), (40, 72)])
@pytest.mark.parametrize("kwargs", [{}, {"causal": True, "softcap": 5.0}, {"window_size": (7, 3), "dropout_p": 0.0}],
                         ids=["plain", "causal softcap", "window"])
def test_dense_calls(path, d, dv, kwargs):
    if path.interpreted and "window_size" in kwargs:
        pytest.skip("under the interpreter the plain and causal calls (each key loop's three walks) suffice")
    q, k, v = _inputs(2, 37, 45, 4, 2, d, dv, device=path.device)
    out = flashattn.flash_attn_func(q, k, v, **kwargs)
    assert out.shape == (2, 37, 4, dv)
    check_against_oracle(q, k, v, kwargs, out)


def test_varlen_and_kv_cache_take_it(path):
    q, k, v = _inputs(1, 30, 30, 4, 2, 96, 64, device=path.device)
    cu = torch.tensor([0, 12, 30], dtype=torch.int32, device=path.device)
    out = flashattn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 18, 18, causal=True)
    assert out.shape == (30, 4, 64)
    for sq, eq in ((0, 12), (12, 30)):
        ref, _ = attention_ref(q[:, sq:eq], k[:, sq:eq], v[:, sq:eq], causal=True)
        assert (out[sq:eq].double() - ref[0]).abs().max() < 1e-5
    out.sum().backward()
    assert v.grad.shape == v.shape and k.grad.shape == k.shape

    k_cache, v_cache, k_new, v_new, q1, seqlens = path.put(
        torch.zeros(2, 16, 2, 96), torch.zeros(2, 16, 2, 64), torch.randn(2, 5, 2, 96), torch.randn(2, 5, 2, 64),
        torch.randn(2, 1, 4, 96), torch.tensor([3, 7], dtype=torch.int32))
    out = flashattn.flash_attn_with_kvcache(q1, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens)
    assert out.shape == (2, 1, 4, 64)
    for i, n in enumerate((8, 12)):  # the appended rows are attended
        ref, _ = attention_ref(q1[i : i + 1], k_cache[i : i + 1, :n], v_cache[i : i + 1, :n])
        assert (out[i : i + 1].double() - ref).abs().max() < 1e-5


def test_bad_value_shapes_say_what_is_allowed():
    q, k, v = _inputs(1, 8, 8, 2, 2, 32, 16)
    with pytest.raises(ValueError, match=r"must agree on \(batch, seqlen_k, nheads_k\)"):
        flashattn.flash_attn_func(q, k, v[:, :7])
    with pytest.raises(ValueError, match="v has head dim 0"):
        flashattn.flash_attn_func(q, k, v[..., :0])
    with pytest.raises(ValueError, match=r"headdim_v\) = \(1, 2, 2, 16\)"):
        flashattn.flash_attn_with_kvcache(q[:, :1].detach(), k.detach(), v.detach(), torch.zeros(1, 2, 2, 32),
                                          torch.zeros(1, 2, 2, 32), cache_seqlens=torch.tensor([3], dtype=torch.int32))
