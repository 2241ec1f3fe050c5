"""The CPU backend's C++ forward kernel and its fallback, the tiled PyTorch path: both paths on every feature the
kernel serves, against the float64 oracle with the same-precision rule, gradients included (the backward recomputes
from the kernel's lse); the build's fallback when it cannot be compiled."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from oracle import attention_ref, check_against_oracle, feature_kwargs, make_inputs

import flashattn
from flashattn.backends import cpu_kernel
from flashattn.backends.spec import AttentionSpec

HAS_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))
FEATURES = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": (9, 4)},
    "softcap": {"softcap": 3.0, "causal": True},
    "alibi": {"alibi": True, "window_size": (20, 0)},
}
SHAPES = [  # (b, nq, nk, h, hk, d): odd lengths, q/k lengths that differ, GQA, odd head dims
    (2, 113, 77, 4, 2, 40),
    (1, 1, 1025, 4, 1, 59),
    (1, 300, 300, 2, 2, 96),
]


@pytest.fixture(params=[True, False], ids=["kernel", "tiled"])
def path(request):
    if request.param and not HAS_COMPILER:
        pytest.skip("no C++ compiler: only the tiled path runs here")
    with cpu_kernel.use(request.param):
        yield request.param


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_both_paths_against_float64(path, feature, shape, dtype):
    b, nq, nk, h, hk, d = shape
    torch.manual_seed(0)
    q, k, v = make_inputs(b, nq, nk, h, hk, d, dtype)
    kwargs = feature_kwargs(FEATURES[feature], b, h)
    with flashattn.use_backend("cpu"):
        out = flashattn.flash_attn_func(q, k, v, **kwargs)
        check_against_oracle(q, k, v, kwargs, out, grads=nq < 1000)


def test_the_kernel_serves_dense_calls_here():
    """On a machine with a compiler (CI's has gcc) the kernel builds, and a dense call runs on it."""
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler")
    built, detail = cpu_kernel.status()
    assert built, detail
    q, k, v = make_inputs(1, 7, 9, 2, 1, 16, torch.float32, requires_grad=False)
    spec = AttentionSpec(scale=0.25, window_right=0)
    assert cpu_kernel.unserved(q, k, v, spec, return_probs=False) is None
    out, lse = cpu_kernel.forward(q, k, v, spec)
    ref, ref_lse = attention_ref(q, k, v, scale=0.25, causal=True)
    assert (out.double() - ref).abs().max() < 1e-5 and (lse.double() - ref_lse).abs().max() < 1e-5


def test_rows_that_see_no_key_give_zero_and_minus_inf(path):
    """Bottom-right causal with more queries than keys: the first rows see nothing (out 0, lse -inf, no NaN)."""
    from flashattn.backends import cpu

    q, k, v = make_inputs(1, 10, 4, 2, 2, 8, torch.float32, requires_grad=False)
    out, lse, _ = cpu.forward(q, k, v, AttentionSpec(scale=8**-0.5, window_right=0))
    assert not torch.isnan(out).any()
    assert (out[:, :6] == 0).all() and torch.isneginf(lse[:, :, :6]).all() and torch.isfinite(lse[:, :, 6:]).all()


@pytest.mark.parametrize("reason", ["FLASHATTN_CPU_KERNEL=0", "a failed build"])
def test_the_tiled_path_runs_when_the_kernel_cannot_be_built(reason, monkeypatch, caplog):
    cpu_kernel._load.cache_clear()
    if reason == "a failed build":
        from torch.utils import cpp_extension

        def broken(**_):
            raise RuntimeError("Error building extension 'flashattn_cpu': c++: command not found")

        monkeypatch.setattr(cpp_extension, "load", broken)
    else:
        monkeypatch.setenv("FLASHATTN_CPU_KERNEL", "0")
    try:
        with caplog.at_level(logging.WARNING, logger="flashattn"):
            built, detail = cpu_kernel.status()
            q, k, v = make_inputs(1, 33, 33, 2, 2, 16, torch.float32)
            with flashattn.use_backend("cpu"):
                out = flashattn.flash_attn_func(q, k, v, causal=True)
            check_against_oracle(q, k, v, {"causal": True}, out)
        assert not built and ("FLASHATTN_CPU_KERNEL" in detail if reason != "a failed build" else "c++" in detail)
        warned = [r for r in caplog.records if "tiled PyTorch path" in r.getMessage()]
        assert len(warned) == (1 if reason == "a failed build" else 0)
    finally:
        cpu_kernel._load.cache_clear()


def test_calls_the_kernel_does_not_serve_say_why():
    q = k = v = torch.zeros(1, 4, 2, 8)
    assert "dropout" in cpu_kernel.unserved(q, k, v, AttentionSpec(scale=1.0, dropout_p=0.1), return_probs=False)
    assert "probabilities" in cpu_kernel.unserved(q, k, v, AttentionSpec(scale=1.0), return_probs=True)
    with cpu_kernel.use(False):
        assert "turned off" in cpu_kernel.unserved(q, k, v, AttentionSpec(scale=1.0), return_probs=False)


def test_the_kernel_keeps_the_callers_grad_and_inference_modes():
    """The region's threads take the caller's modes: under inference_mode (the demo's timing) and with inputs
    that require grad outside the op (the distributed blocks) the kernel runs."""
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler")
    q, k, v = make_inputs(1, 130, 300, 2, 1, 16, torch.float32)
    spec = AttentionSpec(scale=0.25)
    out, _ = cpu_kernel.forward(q, k, v, spec)
    with torch.inference_mode():
        q2, k2, v2 = (t.detach().clone() for t in (q, k, v))
        out2, _ = cpu_kernel.forward(q2, k2, v2, spec)
    assert torch.equal(out, out2) and not out.requires_grad
