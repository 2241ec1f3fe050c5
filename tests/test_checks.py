"""Bad input gets a clear TypeError/ValueError naming the argument, from every entry point."""

from __future__ import annotations

import math

import pytest
import torch

import flashattn


def good(nq=8, nk=8, h=4, hk=2, d=16, dtype=torch.float32):
    return torch.randn(2, nq, h, d, dtype=dtype), torch.randn(2, nk, hk, d, dtype=dtype), torch.randn(2, nk, hk, d)


def call_flash(**overrides):
    q, k, v = good()
    args = {"q": q, "k": k, "v": v, **overrides}
    return flashattn.flash_attn_func(**args)


FLASH_CASES = [
    # (overrides, error type, words the message must contain)
    ({"q": torch.randn(2, 8, 16)}, ValueError, ["q", "4 dimensions", "(2, 8, 16)"]),
    ({"q": [[1.0]]}, TypeError, ["q", "torch.Tensor", "list"]),
    ({"q": torch.ones(2, 8, 4, 16, dtype=torch.int32)}, TypeError, ["q", "torch.int32", "float16"]),
    ({"k": torch.randn(2, 8, 2, 16).to(torch.float8_e4m3fn)}, TypeError, ["k", "float8"]),
    ({"q": torch.randn(2, 8, 4, 16, dtype=torch.float64)}, TypeError, ["k", "float32", "q", "float64"]),
    ({"v": torch.randn(2, 9, 2, 16)}, ValueError, ["k", "v", "must agree on (batch, seqlen_k, nheads_k)"]),
    ({"k": torch.randn(2, 8, 3, 16), "v": torch.randn(2, 8, 3, 16)}, ValueError, ["heads", "4", "3"]),
    ({"k": torch.randn(3, 8, 2, 16), "v": torch.randn(3, 8, 2, 16)}, ValueError, ["batch", "2", "3"]),
    ({"k": torch.randn(2, 8, 2, 8), "v": torch.randn(2, 8, 2, 8)}, ValueError, ["head dims", "16", "8"]),
    ({"k": torch.randn(2, 8, 2, 16, device="meta"), "v": torch.randn(2, 8, 2, 16, device="meta")}, ValueError,
     ["k", "meta", "cpu"]),
    ({"window_size": (-2, 0)}, ValueError, ["window_size", ">= -1", "(-2, 0)"]),
    ({"window_size": (1, 2, 3)}, TypeError, ["window_size", "pair"]),
    ({"window_size": (1.5, 2)}, TypeError, ["window_size"]),
    ({"softcap": -1.0}, ValueError, ["softcap", ">= 0", "-1.0"]),
    ({"softcap": math.nan}, ValueError, ["softcap", "finite"]),
    ({"dropout_p": 1.0}, ValueError, ["dropout_p", "[0, 1)", "1.0"]),
    ({"dropout_p": -0.1}, ValueError, ["dropout_p", "-0.1"]),
    ({"dropout_p": "0.1"}, TypeError, ["dropout_p", "real number"]),
    ({"softmax_scale": math.inf}, ValueError, ["softmax_scale", "finite", "inf"]),
    ({"softmax_scale": math.nan}, ValueError, ["softmax_scale", "finite", "nan"]),
    ({"causal": "yes"}, TypeError, ["causal", "bool"]),
    ({"alibi_slopes": torch.rand(3)}, ValueError, ["alibi_slopes", "(nheads,)", "(4,)", "(3,)"]),
    ({"alibi_slopes": torch.ones(4, dtype=torch.int64)}, TypeError, ["alibi_slopes", "floating-point"]),
    ({"alibi_slopes": [0.1] * 4}, TypeError, ["alibi_slopes", "torch.Tensor"]),
    ({"alibi_slopes": torch.rand(4, requires_grad=True)}, ValueError, ["alibi_slopes", "no gradient", "detach"]),
]


def test_numpy_scalars_are_accepted():
    import numpy as np

    q, k, v = good()
    out = flashattn.flash_attn_func(q, k, v, softmax_scale=np.float32(0.25), softcap=np.float64(3.0))
    torch.testing.assert_close(out, flashattn.flash_attn_func(q, k, v, softmax_scale=0.25, softcap=3.0))


@pytest.mark.parametrize("overrides,error,words", FLASH_CASES, ids=lambda x: None)
def test_flash_attn_func_rejects(overrides, error, words):
    with pytest.raises(error) as info:
        call_flash(**overrides)
    message = str(info.value)
    assert message.startswith("flash_attn_func:")
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"


def test_packed_entry_points_name_their_arguments():
    with pytest.raises(ValueError, match=r"flash_attn_qkvpacked_func: qkv must have shape \(batch, seqlen, 3"):
        flashattn.flash_attn_qkvpacked_func(torch.randn(2, 8, 2, 4, 16))
    with pytest.raises(ValueError, match="flash_attn_kvpacked_func: kv must have 5 dimensions"):
        flashattn.flash_attn_kvpacked_func(torch.randn(2, 8, 4, 16), torch.randn(2, 8, 4, 16))
    with pytest.raises(ValueError, match="flash_attn_kvpacked_func: .*dropout_p"):
        flashattn.flash_attn_kvpacked_func(torch.randn(2, 8, 4, 16), torch.randn(2, 8, 2, 4, 16), dropout_p=2.0)


SDPA_CASES = [
    ({"attn_mask": torch.zeros(8, 9)}, ValueError, ["attn_mask", "(8, 9)", "broadcast"]),
    ({"attn_mask": torch.zeros(8, 8, dtype=torch.int64)}, TypeError, ["attn_mask", "boolean", "torch.int64"]),
    ({"attn_mask": torch.ones(8, 8, dtype=torch.bool), "is_causal": True}, ValueError, ["attn_mask", "is_causal"]),
    ({"key": torch.randn(2, 2, 8, 16), "value": torch.randn(2, 2, 8, 16)}, ValueError, ["enable_gqa", "4", "2"]),
    ({"key": torch.randn(2, 3, 8, 16), "value": torch.randn(2, 3, 8, 16), "enable_gqa": True}, ValueError,
     ["multiple", "4", "3"]),
    ({"value": torch.randn(2, 4, 9, 16)}, ValueError, ["key", "value"]),
    ({"scale": math.nan}, ValueError, ["scale", "finite"]),
    ({"query": torch.randn(16)}, ValueError, ["query", "at least 2 dimensions"]),  # PyTorch takes (..., L, E)
    ({"dropout_p": 1.5}, ValueError, ["dropout_p", "1.5"]),
]


@pytest.mark.parametrize("overrides,error,words", SDPA_CASES, ids=lambda x: None)
def test_sdpa_rejects(overrides, error, words):
    args = {"query": torch.randn(2, 4, 8, 16), "key": torch.randn(2, 4, 8, 16), "value": torch.randn(2, 4, 8, 16)}
    args.update(overrides)
    with pytest.raises(error) as info:
        flashattn.scaled_dot_product_attention(**args)
    message = str(info.value)
    assert message.startswith("scaled_dot_product_attention:")
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"


def test_torch_deterministic_mode_asks_for_deterministic_kernels():
    """PyTorch's convention: ``torch.use_deterministic_algorithms(True)`` makes every call ask for its deterministic
    kernels (``deterministic=True`` for the flash_attn functions; SDPA has no flag of its own), and the checker's
    cache of passed signatures keeps the two modes apart."""
    from flashattn.checks.flash import check_flash
    from flashattn.checks.sdpa import check_sdpa

    q = torch.randn(1, 8, 2, 16)
    options = dict(dropout_p=0.0, softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0,
                   alibi_slopes=None, deterministic=False, return_attn_probs=False)
    sdpa = lambda: check_sdpa("scaled_dot_product_attention", q.transpose(1, 2), q.transpose(1, 2),  # noqa: E731
                              q.transpose(1, 2), is_causal=True)[0].spec
    assert not check_flash("flash_attn_func", q, q, q, **options).spec.deterministic and not sdpa().deterministic
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert check_flash("flash_attn_func", q, q, q, **options).spec.deterministic and sdpa().deterministic
    finally:
        torch.use_deterministic_algorithms(was)
    assert not check_flash("flash_attn_func", q, q, q, **options).spec.deterministic
