"""The FP8 training mode, ``flash_attn_func(q, k, v, fp8=True)``: 16-bit q, k, v quantized to float8_e4m3fn by the
call (a scale per (sequence, kv head): amax / 448), attended as FP8 inputs, gradients those of attention at the
quantized values (straight through the rounding; with the Triton path's FP8 backward, dS from dO in e4m3).
Ground truth is float64 on the dequantized values; the bar is
FlashAttention-3's rule for the output (twice the error of the same computation, P rounded where the kernel rounds
it) and three times that rule's error for the gradients (issue 36)."""

from __future__ import annotations

import oracle
import pytest
import torch
from test_fp8 import PATHS

import flashattn
from flashattn import flash_attn_func, flash_attn_varlen_func
from flashattn.quantize import amax_scales

E4M3 = torch.float8_e4m3fn


def _quantized(x: torch.Tensor, heads_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, N, H, D) in e4m3 with its (B, Hk) scales, computed here as the mode documents them."""
    amax = x.detach().float().abs().amax(dim=(1, 3)).view(x.shape[0], heads_k, -1).amax(-1)
    scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    per_head = scale.repeat_interleave(x.shape[2] // heads_k, 1)[:, None, :, None]
    return (x.detach().float() / per_head).clamp(-448, 448).to(E4M3), scale


def _dequantized(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x8.to(dtype) * scale.to(dtype).repeat_interleave(x8.shape[2] // scale.shape[1], 1)[:, None, :, None]


def _rounds_p(path: str) -> bool:
    """Whether the path multiplies e4m3 q, k, v on FP8 tensor cores, rounding P to e4m3 (the Triton path; under
    the interpreter it runs that mode as a Hopper GPU would)."""
    return path == "triton"


def _grads(out: torch.Tensor, inputs: list[torch.Tensor], dout: torch.Tensor, dout_scores: torch.Tensor) -> list:
    """dq, dk (through dS, from ``dout_scores``) and dv (from ``dout``) of ``out``."""
    dq, dk = torch.autograd.grad(out, inputs[:2], dout_scores, retain_graph=True)
    (dv,) = torch.autograd.grad(out, inputs[2], dout, retain_graph=True)
    return [dq, dk, dv]


FP8_BACKWARD_CASES = [(path, False) for path in PATHS] + ([("triton", True)] if "triton" in PATHS else [])
needs_triton = pytest.mark.skipif("triton" not in PATHS, reason="the Triton path runs here under its interpreter only "
                                                                "(TRITON_INTERPRET=1, Triton installed)")


@pytest.mark.parametrize(("path", "fp8_backward"), FP8_BACKWARD_CASES,
                         ids=[f"{p}{'-fp8-backward' if f else ''}" for p, f in FP8_BACKWARD_CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_training_matches_float64_at_the_quantized_values(path, fp8_backward, dtype, causal, monkeypatch):
    """With ``FLASHATTN_FP8_BACKWARD=1`` the Triton path's backward multiplies S and dP in FP8, dO rounded to e4m3
    for dS; otherwise every path's backward is the 16-bit one at the quantized values."""
    monkeypatch.setenv("FLASHATTN_FP8_BACKWARD", "1" if fp8_backward else "0")
    torch.manual_seed(5)
    b, nq, nk, h, hk, d = 2, 37, 113, 4, 2, 64
    q, k, v = (torch.randn(b, n, heads, d, dtype=dtype, requires_grad=True)
               for n, heads in ((nq, h), (nk, hk), (nk, hk)))
    with torch.no_grad():
        k[1] *= 8  # scales differ per batch entry
    dout = torch.randn(b, nq, h, d, dtype=dtype)
    with flashattn.use_backend(path):
        out = flash_attn_func(q, k, v, causal=causal, fp8=True)
    out.backward(dout)
    assert out.dtype == dtype and q.grad.dtype == dtype and not out.isnan().any()

    stored = [_quantized(x, hk) for x in (q, k, v)]
    wide = [_dequantized(x8, s, torch.float64).requires_grad_() for x8, s in stored]
    # PyTorch attention computed the same way: FlashAttention-3's FP8 forward returns bfloat16 (for fp16 inputs too)
    low = [_dequantized(x8, s, torch.bfloat16).requires_grad_() for x8, s in stored]
    rounding = E4M3 if _rounds_p(path) else None
    truth, _ = oracle.attention_ref(*wide, causal=causal)
    rule, _ = oracle.attention_ref(*wide, causal=causal, round_probs=rounding)
    baseline, _ = oracle.attention_ref(*low, causal=causal, upcast=False, round_probs=rounding)
    oracle.assert_close("out", out, truth, rule if rounding is not None else baseline)
    dout_scores = dout
    if fp8_backward:  # dS from dO in e4m3, per (sequence, head), as the FP8 backward computes it
        dout8, dout_scale = _quantized(dout, h)
        dout_scores = _dequantized(dout8, dout_scale, torch.float64)
    truth_grads = _grads(truth, wide, dout.double(), dout_scores.double())
    base_grads = _grads(baseline, low, dout, dout_scores.to(torch.bfloat16))
    for name, ours, t, base in zip(("dq", "dk", "dv"), (q, k, v), truth_grads, base_grads, strict=True):
        oracle.assert_close(name, ours.grad, t, base, factor=3.0)


@pytest.mark.parametrize("path", PATHS)
def test_fp8_training_is_the_fp8_forward_of_the_quantized_inputs(path):
    """The mode's output is FlashAttention-3's FP8 call on the inputs quantized with amax / 448 scales."""
    torch.manual_seed(6)
    q, k, v = (torch.randn(2, 40, heads, 32, dtype=torch.bfloat16) * 3 for heads in (6, 2, 2))
    (q8, qs), (k8, ks), (v8, vs) = (_quantized(x, 2) for x in (q, k, v))
    with flashattn.use_backend(path):
        ours = flash_attn_func(q, k, v, causal=True, fp8=True)
        explicit = flash_attn_func(q8, k8, v8, causal=True, q_descale=qs, k_descale=ks, v_descale=vs)
    assert torch.equal(ours, explicit)
    assert torch.equal(amax_scales(k, heads_k=2), ks)


@pytest.mark.parametrize("fp8_backward", [False, pytest.param(True, marks=needs_triton)],
                         ids=["default-path", "triton-fp8-backward"])
def test_fp8_training_on_packed_sequences_quantizes_each_sequence_alone(fp8_backward, monkeypatch):
    """Each sequence of a packed batch has its own scales (dO's too, in the FP8 backward): the packed call's output
    and gradients are each sequence's alone."""
    if fp8_backward:
        monkeypatch.setenv("FLASHATTN_FP8_BACKWARD", "1")
    torch.manual_seed(7)
    lengths = [37, 0, 76]
    cu = torch.tensor([0, 37, 37, 113], dtype=torch.int32)
    q, k, v = (torch.randn(113, heads, 64, dtype=torch.bfloat16) for heads in (4, 2, 2))
    with torch.no_grad():
        for x in (q, k, v):
            x[37:] *= 50  # the last sequence is far larger: one scale for the batch would flush the first's
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    with flashattn.use_backend("triton" if fp8_backward else "auto"):
        out = flash_attn_varlen_func(q, k, v, cu, cu, 76, 76, causal=True, fp8=True)
        out.float().square().sum().backward()
        start = 0
        alone_calls = []
        for n in lengths:
            part = [x.detach()[start : start + n][None].requires_grad_() for x in (q, k, v)]
            if n:
                alone = flash_attn_func(*part, causal=True, fp8=True)
                alone.float().square().sum().backward()
                alone_calls.append((start, n, part, alone))
            start += n
    for start, n, part, alone in alone_calls:
        rows = slice(start, start + n)
        torch.testing.assert_close(out[rows], alone[0], atol=2e-2 * (1 + alone.abs().max().item()), rtol=0)
        for x, p in zip((q, k, v), part, strict=True):
            torch.testing.assert_close(x.grad[rows], p.grad[0], atol=3e-2 * (1 + p.grad.abs().max().item()), rtol=0)
    scales = amax_scales(k.detach(), heads_k=2, cu_seqlens=cu)
    assert scales[1].tolist() == [1.0, 1.0]  # an empty sequence
    want = k.detach()[:37].float().abs().amax(dim=(0, 2)) / 448
    assert torch.equal(scales[0], want)


def test_an_all_zero_head_gives_zeros_not_nan():
    q = torch.randn(1, 8, 2, 16, dtype=torch.bfloat16, requires_grad=True)
    k = torch.zeros(1, 8, 1, 16, dtype=torch.bfloat16, requires_grad=True)
    v = torch.zeros(1, 8, 1, 16, dtype=torch.bfloat16, requires_grad=True)
    out = flash_attn_func(q, k, v, fp8=True)
    out.float().sum().backward()
    assert out.eq(0).all() and all(t.grad.isfinite().all() for t in (q, k, v))


@pytest.mark.parametrize(("dtype", "kwargs", "words"), [
    (E4M3, {}, "fp8=True quantizes float16 or bfloat16 q, k and v itself"),
    (torch.float32, {}, "fp8=True quantizes float16 or bfloat16 q, k and v, got torch.float32"),
    (torch.bfloat16, {"dropout_p": 0.1}, "dropout_p must be 0 with fp8=True"),
    (torch.bfloat16, {"return_attn_probs": True}, "return_attn_probs is not available with fp8=True"),
    (torch.bfloat16, {"fp8": "yes"}, "fp8 must be a bool"),
])
def test_what_the_training_mode_refuses_by_name(dtype, kwargs, words):
    x = torch.randn(1, 4, 2, 16).to(dtype)
    with pytest.raises((TypeError, ValueError), match=words) as caught:
        flash_attn_func(x, x, x, **{"fp8": True, **kwargs})
    assert "flash_attn_func" in str(caught.value)


def test_a_paged_cache_refuses_the_training_mode():
    q = torch.randn(5, 2, 16, dtype=torch.bfloat16)
    pages = torch.randn(2, 4, 2, 16, dtype=torch.bfloat16)
    cu_q, cu_k = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="a paged K/V .* fp8=False"):
        flash_attn_varlen_func(q, pages, pages, cu_q, cu_k, 5, 8, block_table=torch.tensor([[0, 1]]).int(), fp8=True)


def test_the_training_mode_compiles_into_one_graph():
    q, k, v = (torch.randn(1, 24, heads, 32, dtype=torch.bfloat16, requires_grad=True) for heads in (4, 2, 2))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(q, k, v):
        return flash_attn_func(q, k, v, causal=True, fp8=True).float().square().sum()

    step(q, k, v).backward()
    eager = [t.detach().requires_grad_() for t in (q, k, v)]
    flash_attn_func(*eager, causal=True, fp8=True).float().square().sum().backward()
    for compiled, plain in zip((q, k, v), eager, strict=True):
        torch.testing.assert_close(compiled.grad, plain.grad, atol=0, rtol=0)


def test_self_attention_trains_in_the_fp8_mode():
    from flashattn.nn import SelfAttention

    torch.manual_seed(8)
    layers = {fp8: SelfAttention(64, 4, 2, fp8=fp8, dtype=torch.bfloat16) for fp8 in (False, True)}
    layers[True].load_state_dict(layers[False].state_dict())
    x = torch.randn(2, 24, 64, dtype=torch.bfloat16)
    outs = {}
    for fp8, layer in layers.items():
        outs[fp8] = layer(x)
        outs[fp8].float().square().sum().backward()
    gap = (outs[True].float() - outs[False].float()).abs().max()
    assert 0 < gap < 0.1 * outs[False].float().abs().max(), gap  # e4m3's rounding, not garbage
    grads = [layer.qkv.weight.grad.float() for layer in layers.values()]
    assert (grads[1] - grads[0]).abs().max() < 0.15 * grads[0].abs().max()
    with pytest.raises(ValueError, match="SelfAttention: dropout must be 0 with fp8=True"):
        SelfAttention(64, 4, fp8=True, dropout=0.1)


@needs_triton
def test_the_fp8_backward_rounds_do_for_ds_only(monkeypatch):
    """Triton's FP8 backward (under the interpreter): dQ and dK are those of dO in e4m3 (a scale per (sequence,
    head)), nearer them than the gradients of the exact dO; dV is the exact dO's."""
    monkeypatch.setenv("FLASHATTN_FP8_BACKWARD", "1")
    torch.manual_seed(8)
    b, n, h, hk, d = 1, 64, 4, 2, 32
    q, k, v = (torch.randn(b, n, heads, d, dtype=torch.bfloat16, requires_grad=True) for heads in (h, hk, hk))
    dout = torch.randn(b, n, h, d, dtype=torch.bfloat16)
    with flashattn.use_backend("triton"):
        flash_attn_func(q, k, v, causal=True, fp8=True).backward(dout)
    wide = [_dequantized(*_quantized(x, hk), torch.float64).requires_grad_() for x in (q, k, v)]
    truth, _ = oracle.attention_ref(*wide, causal=True)
    dout8 = _dequantized(*_quantized(dout, h), torch.float64)
    rounded = _grads(truth, wide, dout.double(), dout8)
    exact = _grads(truth, wide, dout.double(), dout.double())
    for name, ours, at_rounded, at_exact in zip(("dq", "dk"), (q, k), rounded[:2], exact[:2], strict=True):
        near, far = ((ours.grad.double() - want).abs().max().item() for want in (at_rounded, at_exact))
        assert near < far / 2, (name, near, far)
    assert (v.grad.double() - exact[2]).abs().max().item() < 2e-2 * (1 + exact[2].abs().max().item())
