"""What flash_attn and PyTorch accept is accepted: int-likes and truthy flags, SDPA of any rank, paged K/V with a
query that wants gradients; what cannot work is a clear error; torch.compile(fullgraph=True) traces the varlen and
KV-cache functions and a decode loop; the backend choice is logged."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import flashattn
from flashattn.nn import SelfAttention


def _qkv(b=2, nq=12, nk=12, h=4, hk=2, d=16, dtype=torch.float64):
    return torch.randn(b, nq, h, d, dtype=dtype), torch.randn(b, nk, hk, d, dtype=dtype), \
        torch.randn(b, nk, hk, d, dtype=dtype)


@pytest.mark.parametrize("window", [torch.tensor([3, 1]), (np.int64(3), np.int32(1)), [torch.tensor(3), 1]],
                         ids=["tensor", "numpy", "mixed"])
def test_window_size_takes_int_likes(window):
    q, k, v = _qkv()
    torch.testing.assert_close(flashattn.flash_attn_func(q, k, v, window_size=window),
                               flashattn.flash_attn_func(q, k, v, window_size=(3, 1)))


@pytest.mark.parametrize("flag", [1, np.bool_(True), torch.tensor(True), torch.tensor(1)], ids=str)
def test_flags_take_anything_with_a_numeric_truth_value(flag):
    q, k, v = _qkv()
    torch.testing.assert_close(flashattn.flash_attn_func(q, k, v, causal=flag),
                               flashattn.flash_attn_func(q, k, v, causal=True))
    out, lse, _ = flashattn.flash_attn_func(q, k, v, return_attn_probs=flag)
    assert lse.shape == (2, 4, 12)


def test_varlen_maxima_and_scale_take_tensors():
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    q, k, v = (torch.randn(10, 2, 8, dtype=torch.float64) for _ in range(3))
    longest = (cu[1:] - cu[:-1]).max()  # a 0-d tensor, as flash_attn's users compute it
    got = flashattn.flash_attn_varlen_func(q, k, v, cu, cu, longest, np.int64(7), softmax_scale=torch.tensor(0.3))
    torch.testing.assert_close(got, flashattn.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, softmax_scale=0.3))


def test_kvcache_counts_take_int_likes():
    q, k_cache, v_cache = torch.randn(2, 1, 4, 8), torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 8)
    want = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5, num_splits=2)
    got = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=np.int32(5), num_splits=np.int64(2),
                                            rotary_interleaved=1)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("overrides,error,words", [
    ({"window_size": (1.5, 2)}, TypeError, ["window_size", "pair"]),
    ({"window_size": torch.tensor([1.0, 2.0])}, TypeError, ["window_size"]),
    ({"window_size": (-2, 0)}, ValueError, ["window_size", ">= -1"]),
    ({"causal": "yes"}, TypeError, ["causal", "bool"]),
    ({"causal": None}, TypeError, ["causal", "bool"]),
    ({"deterministic": [1]}, TypeError, ["deterministic"]),
], ids=lambda x: None)
def test_what_is_really_wrong_is_still_refused(overrides, error, words):
    q, k, v = _qkv()
    with pytest.raises(error) as info:
        flashattn.flash_attn_func(q, k, v, **overrides)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_sizes_refuse_floats():
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    q = torch.randn(10, 2, 8)
    with pytest.raises(TypeError, match="max_seqlen_q must be an integer"):
        flashattn.flash_attn_varlen_func(q, q, q, cu, cu, 7.0, 7)


@pytest.mark.parametrize("q_shape,k_shape,gqa", [
    ((5, 8), (7, 8), False),
    ((3, 5, 8), (3, 7, 8), False),
    ((6, 5, 8), (2, 7, 8), True),
    ((2, 3, 4, 5, 8), (2, 3, 4, 7, 8), False),
    ((2, 3, 6, 5, 8), (2, 3, 2, 7, 8), True),
    ((2, 3, 5, 8), (1, 3, 7, 8), False),  # the batch broadcasts, as PyTorch allows
], ids=str)
def test_sdpa_takes_any_rank_like_pytorch(q_shape, k_shape, gqa):
    q = torch.randn(q_shape, dtype=torch.float64, requires_grad=True)
    k = torch.randn(k_shape, dtype=torch.float64, requires_grad=True)
    v = torch.randn(k_shape, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(5, 7, dtype=torch.float64)
    got = flashattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v)),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_sdpa_refuses_shapes_that_do_not_broadcast():
    q, k = torch.randn(2, 3, 5, 8), torch.randn(4, 3, 7, 8)
    with pytest.raises(ValueError, match="broadcast"):
        flashattn.scaled_dot_product_attention(q, k, k)
    with pytest.raises(ValueError, match="enable_gqa"):
        k = torch.randn(2, 2, 7, 8)
        flashattn.scaled_dot_product_attention(torch.randn(2, 4, 5, 8), k, k)


def test_head_dim_zero_is_a_clear_error():
    empty = torch.randn(1, 4, 2, 0)
    with pytest.raises(ValueError, match="flash_attn_func: q has head dim 0"):
        flashattn.flash_attn_func(empty, empty, empty)
    with pytest.raises(ValueError, match="scaled_dot_product_attention: query has head dim 0"):
        flashattn.scaled_dot_product_attention(empty, empty, empty)
    with pytest.raises(ValueError, match="value has head dim 0"):
        q = torch.randn(1, 2, 4, 8)
        flashattn.scaled_dot_product_attention(q, q, torch.randn(1, 2, 4, 0))
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="flash_attn_varlen_func: q has head dim 0"):
        flashattn.flash_attn_varlen_func(empty[0], empty[0], empty[0], cu, cu, 4, 4)
    with pytest.raises(ValueError, match="flash_attn_with_kvcache: q has head dim 0"):
        flashattn.flash_attn_with_kvcache(empty, empty, empty)


def test_a_forced_backend_that_cannot_run_the_call_is_a_value_error():
    q = torch.randn(1, 8, 2, 64, dtype=torch.float16)
    with flashattn.use_backend("cuda"), pytest.raises(ValueError) as info:
        flashattn.flash_attn_func(q, q, q)
    message = str(info.value)
    assert "cuda path" in message and "cpu" in message and "CUDA tensors" in message
    with flashattn.use_backend("triton"), pytest.raises(ValueError, match="triton path .* float64"):
        flashattn.flash_attn_func(*_qkv())


def test_the_backend_choice_is_logged_once_per_reason(caplog):
    from flashattn import backends

    backends._logged.clear()
    q, k, v = _qkv(dtype=torch.float32)
    with caplog.at_level(logging.DEBUG, logger="flashattn"):
        flashattn.flash_attn_func(q, k, v)
        flashattn.flash_attn_func(q, k, v)
        with flashattn.use_backend("torch"):
            flashattn.flash_attn_func(q, k, v)
    lines = [r.getMessage() for r in caplog.records if r.name == "flashattn"]
    from flashattn.backends import cpu_build

    assert len(lines) == 2 and lines[1] == "path torch: forced by use_backend()", lines
    if cpu_build.status()[0]:
        assert lines[0] == "path cpu: auto: cpu (the C++ kernel) serves it"
    else:  # FLASHATTN_CPU_KERNEL=0, or no compiler: the reason is named once
        assert lines[0].startswith("path torch: auto: cpu declines: ") and "torch (tiled PyTorch) serves it" in lines[0]


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


def test_compile_fullgraph_varlen_and_its_checks():
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    q, k, v = (torch.randn(10, 4, 16) for _ in range(3))
    f = _compiled(lambda q, k, v, cu: flashattn.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True))
    torch.testing.assert_close(f(q, k, v, cu), flashattn.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True))
    # The value checks run when the graph executes: the same clear errors as in eager mode.
    with pytest.raises(ValueError, match="flash_attn_varlen_func: cu_seqlens_q must be non-decreasing"):
        f(q, k, v, torch.tensor([0, 8, 10 - 4], dtype=torch.int32))


def test_compile_fullgraph_paged_varlen():
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    q = torch.randn(7, 2, 16)
    pages = torch.randn(6, 2, 2, 16)
    table = torch.tensor([[4, 0, 1], [5, 2, 3]], dtype=torch.int32)
    f = _compiled(lambda q, p, t: flashattn.flash_attn_varlen_func(q, p, p, cu, cu, 4, 4, block_table=t))
    torch.testing.assert_close(f(q, pages, table), flashattn.flash_attn_varlen_func(q, pages, pages, cu, cu, 4, 4,
                                                                                    block_table=table))
    with pytest.raises(ValueError, match="block_table holds page ids"):
        f(q, pages, table + 10)


def test_compile_fullgraph_kvcache_appends_and_checks():
    k_cache, v_cache = torch.zeros(2, 16, 2, 8), torch.zeros(2, 16, 2, 8)
    q, k, v = torch.randn(2, 1, 4, 8), torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8)
    f = _compiled(lambda q, kc, vc, k, v, n: flashattn.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=n,
                                                                               causal=True))
    lengths = torch.tensor([5, 2], dtype=torch.int32)
    out = f(q, k_cache, v_cache, k, v, lengths)
    assert torch.equal(k_cache[0, 5], k[0, 0]) and torch.equal(v_cache[1, 2], v[1, 0])
    want = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths + 1, causal=True)
    torch.testing.assert_close(out, want)
    with pytest.raises(ValueError, match="cache_seqlens\\[1\\] = 16 plus 1 new keys does not fit"):
        f(q, k_cache, v_cache, k, v, torch.tensor([5, 16], dtype=torch.int32))


def test_compile_fullgraph_decode_loop_compiles_once():
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    attn = SelfAttention(dim=64, num_heads=8, num_kv_heads=2).eval()
    cache = attn.new_cache(batch_size=2, max_seqlen=32)
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(attn, fullgraph=True, backend="aot_eager")
    prompt, tokens = torch.randn(2, 10, 64), torch.randn(2, 6, 64)
    with torch.no_grad():
        outs = [step(prompt, cache=cache)] + [step(tokens[:, i : i + 1], cache=cache) for i in range(6)]
        full = attn(torch.cat([prompt, tokens], 1))
    assert cache.seqlens.tolist() == [16, 16]
    assert counters["stats"]["unique_graphs"] == 2  # one for the prefill, one for every decode step
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=2e-5, atol=2e-5)
