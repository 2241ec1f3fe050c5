"""Test oracle: plain attention that materialises S, in float64 (ground truth) or in the inputs' own precision
(the baseline a kernel is judged against), plus the tolerance rule: a kernel's error against float64 is at most
2x (3x for gradients) that of plain attention in the same precision."""

from __future__ import annotations

import math

import torch


def attention_ref(
    q, k, v, *, scale=None, causal=False, window=(-1, -1), softcap=0.0, alibi=None, mask=None,
    bottom_right=True, dropped=None, dropout_p=0.0, upcast=True, sink=None, round_probs=None,
):
    """Attention in the flash layout q (B, Nq, H, D), k/v (B, Nk, Hk, D) by the textbook formula.

    ``upcast`` computes in float64; otherwise in the inputs' dtype (the same-precision PyTorch baseline).
    ``dropped`` (B, H, Nq, Nk) bool marks weights removed by dropout. ``sink`` (H,): one more score per row, in
    the denominator only (learnable attention sinks). ``round_probs`` (a dtype): P V as an FP8 forward computes it
    (FlashAttention-3): exp(S - rowmax) rounded to that dtype, divided by the sum of the unrounded values. Returns
    (out, lse) with out in float64 or the input dtype, rows that see no key giving out 0 and lse -inf.
    """
    dtype = torch.float64 if upcast else q.dtype
    b, nq, h, d = q.shape
    nk, hk = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    qt = q.transpose(1, 2).to(dtype)
    kt = k.transpose(1, 2).to(dtype).repeat_interleave(h // hk, dim=1)
    vt = v.transpose(1, 2).to(dtype).repeat_interleave(h // hk, dim=1)
    s = (qt @ kt.transpose(-1, -2)) * scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    i = torch.arange(nq, device=q.device)[:, None]
    j = torch.arange(nk, device=q.device)[None, :]
    offset = j - i - (nk - nq if bottom_right else 0)
    left, right = window[0], 0 if causal else window[1]
    visible = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    if right >= 0:
        visible &= offset <= right
    if left >= 0:
        visible &= offset >= -left
    if alibi is not None:
        slopes = alibi.reshape(-1, h, 1, 1).to(device=q.device, dtype=dtype)
        s = s - slopes * offset.abs().to(dtype)
    s = s.masked_fill(~visible, -math.inf)
    if mask is not None:
        mask = mask.to(q.device)
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.to(dtype)
    if sink is not None:
        s = torch.cat([s, sink.to(device=q.device, dtype=dtype).view(1, h, 1, 1).expand(*s.shape[:-1], 1)], -1)
    lse = torch.logsumexp(s.to(torch.float64) if not upcast else s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    if round_probs is not None:
        top = s.amax(-1, keepdim=True)
        e = torch.exp(s - top.masked_fill(top == -math.inf, 0.0))
        p = (e.to(round_probs).to(dtype) / e.sum(-1, keepdim=True)).nan_to_num(0.0)
    if sink is not None:
        p = p[..., :-1]
    if dropped is not None:
        p = p.masked_fill(dropped.to(p.device), 0.0) / (1 - dropout_p)
    out = (p @ vt).transpose(1, 2)
    return out, lse


def max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    if x.numel() == 0:
        return 0.0
    return (x.double() - ref.double()).abs().max().item()


def assert_close(name, ours, ref64, baseline, factor=2.0, magnitude=None, precision=None):
    """The rule: |ours - ref64| <= factor * |baseline - ref64| for low precision; fp32/fp64 near 1e-5 relative.

    ``magnitude`` is the size of the quantities in the problem (default max |ref64|), for the tolerance floor.
    ``precision``: the dtype the computation ran in, when it differs from the result's (a float32 sink's
    gradient computed from bf16 attention is judged as bf16).
    """
    precision = precision or ours.dtype
    err = max_err(ours, ref64)
    if magnitude is None:
        magnitude = ref64.abs().max().item() if ref64.numel() else 0.0
    scale = 1.0 + magnitude
    if precision in (torch.float32, torch.float64):
        bound = 1e-5 * scale if precision == torch.float32 else 1e-10 * scale
    else:
        # Plus one rounding of the result (an ulp at its scale): it matters only where the baseline is exact by luck
        # (dq with a single key is 0 in theory, and the kernel's delta = rowsum(dO * O) carries O's rounding, as in
        # FlashAttention; dv with a single key is dO, but the kernel's P = exp(S - lse) is 1 only to fp32's
        # precision, so its rounding to fp16 may land one unit away).
        bound = factor * max_err(baseline, ref64) + torch.finfo(precision).eps * scale
    assert err <= bound, f"{name}: max error {err:.3g} > allowed {bound:.3g}"
    assert not torch.isnan(ours).any(), f"{name}: NaN in output"


def make_inputs(b, nq, nk, h, hk, d, dtype, requires_grad=True):
    q = torch.randn(b, nq, h, d, dtype=dtype)
    k = torch.randn(b, nk, hk, d, dtype=dtype)
    v = torch.randn(b, nk, hk, d, dtype=dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def feature_kwargs(features, b, h):
    kwargs = {key: val for key, val in features.items() if key != "alibi"}
    if features.get("alibi"):
        kwargs["alibi_slopes"] = torch.rand(b, h) * 0.3
    return kwargs


def oracle_kwargs(kwargs):
    return {
        "causal": kwargs.get("causal", False),
        "window": kwargs.get("window_size", (-1, -1)),
        "softcap": kwargs.get("softcap", 0.0),
        "alibi": kwargs.get("alibi_slopes"),
        "scale": kwargs.get("softmax_scale"),
        "sink": kwargs.get("learnable_sink"),
    }


def check_against_oracle(q, k, v, kwargs, out, grads=True, dropped=None, dropout_p=0.0):
    ref, _ = attention_ref(q, k, v, dropped=dropped, dropout_p=dropout_p, **oracle_kwargs(kwargs))
    base, _ = attention_ref(q, k, v, dropped=dropped, dropout_p=dropout_p, upcast=False, **oracle_kwargs(kwargs))
    assert out.dtype == q.dtype and out.shape == ref.shape
    assert_close("out", out, ref, base)
    if not grads:
        return
    g = torch.randn_like(out)
    sink = kwargs.get("learnable_sink")
    inputs, names = (q, k, v), ("dq", "dk", "dv")
    if sink is not None and sink.requires_grad:
        inputs, names = (*inputs, sink), (*names, "dsink")
    ours = torch.autograd.grad(out, inputs, g)
    ref_g = torch.autograd.grad(ref, inputs, g.double())
    base_g = torch.autograd.grad(base, inputs, g)
    magnitude = max(r.abs().max().item() if r.numel() else 0.0 for r in ref_g)
    for name, x, r, bl, t in zip(names, ours, ref_g, base_g, inputs, strict=True):
        assert x.dtype == t.dtype and x.shape == r.shape
        assert_close(name, x, r, bl, factor=3.0, magnitude=magnitude, precision=q.dtype)
