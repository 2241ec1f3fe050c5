"""Learnable attention sinks (gpt-oss; FlashAttention-4's ``learnable_sink``): a logit per head in every row's
softmax denominator, taking no value. Dense, varlen and KV-cache calls and ``SelfAttention``, on every path, forward
and gradients (the sink's included) against float64."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_close, attention_ref, check_against_oracle

import flashattn
import flashattn.nn
from conftest import with_dropout_mask


def _inputs(path, b, nq, nk, h, hk, d, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, heads, d, generator=gen, dtype=dtype).requires_grad_()
               for n, heads in ((nq, h), (nk, hk), (nk, hk)))
    sink = (2 * torch.randn(h, generator=gen)).requires_grad_()
    return path.put(q, k, v, sink)


FEATURES = {"plain": {}, "causal": {"causal": True}, "window softcap": {"window_size": (9, 2), "softcap": 4.0},
            "alibi": {"alibi_slopes": torch.rand(4) * 0.3}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_dense_against_float64(path, feature, dtype):
    if path.interpreted and dtype == torch.bfloat16 and feature != "plain":
        pytest.skip("bf16 under the interpreter is computed upcast; a subset keeps the suite fast")
    q, k, v, sink = _inputs(path, 2, 37, 53, 4, 2, 40, dtype)
    kwargs = {**{key: path.put(x)[0] if torch.is_tensor(x) else x for key, x in FEATURES[feature].items()},
              "learnable_sink": sink}
    out = flashattn.flash_attn_func(q, k, v, **kwargs)
    check_against_oracle(q, k, v, kwargs, out)


def test_lse_includes_the_sink_and_its_gradient_flows(path):
    q, k, v, sink = _inputs(path, 1, 20, 33, 4, 4, 16)
    out, lse, _ = flashattn.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, return_attn_probs=True)
    ref, ref_lse = attention_ref(q, k, v, causal=True, sink=sink)
    assert_close("lse", lse, ref_lse, ref_lse)
    g = torch.randn_like(out)
    ours = torch.autograd.grad((out * g).sum() + lse.square().sum(), (q, k, v, sink))
    want = torch.autograd.grad((ref * g.double()).sum() + ref_lse.square().sum(), (q, k, v, sink))
    for name, x, r in zip(("dq", "dk", "dv", "dsink"), ours, want, strict=True):
        assert_close(name, x, r, r)


def test_dropout_keeps_the_sinks_gradient(path):
    q, k, v, sink = _inputs(path, 2, 31, 40, 4, 2, 32)
    out, dropped = with_dropout_mask(q, k, v, 0.2, {"learnable_sink": sink})
    check_against_oracle(q, k, v, {"learnable_sink": sink}, out, dropped=dropped, dropout_p=0.2)


def test_a_row_that_sees_no_key_outputs_zero_with_the_sink_as_lse(path):
    q, k, v, sink = _inputs(path, 1, 9, 4, 2, 2, 16)
    # Bottom-right causal with 9 queries and 4 keys: the first 5 queries see nothing.
    out, lse, _ = flashattn.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, return_attn_probs=True)
    assert torch.equal(out[:, :5], torch.zeros_like(out[:, :5]))
    torch.testing.assert_close(lse[0, :, :5], sink.detach()[:, None].expand(2, 5))
    (out.sum() + lse.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v, sink))
    # d lse_i / d sink = P_sink,i, which is 1 in the 5 rows whose lse is the sink itself.
    dsink, = torch.autograd.grad(flashattn.flash_attn_func(q, k, v, causal=True, learnable_sink=sink,
                                                           return_attn_probs=True)[1].sum(), sink)
    assert ((dsink >= 5) & (dsink < 9)).all()
    # No key at all: out 0, lse the sink.
    out, lse, _ = flashattn.flash_attn_func(q, k[:, :0], v[:, :0], learnable_sink=sink, return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(out))
    torch.testing.assert_close(lse, sink.detach()[None, :, None].expand_as(lse))


def test_varlen_against_each_sequence(path):
    torch.manual_seed(1)
    lengths = [(5, 9), (17, 17), (0, 3), (12, 4)]
    cu_q = torch.tensor([0, *torch.tensor([a for a, _ in lengths]).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor([b for _, b in lengths]).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), 4, 24, requires_grad=True)
    k, v = (torch.randn(int(cu_k[-1]), 2, 24, requires_grad=True) for _ in range(2))
    sink = torch.randn(4, requires_grad=True)
    q, k, v, sink, cu_q, cu_k = path.put(q, k, v, sink, cu_q, cu_k)
    out = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 17, causal=True, learnable_sink=sink)
    g = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v, sink), g)
    refs = []
    for i in range(len(lengths)):
        sq, eq, sk, ek = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        ref, _ = attention_ref(q[None, sq:eq], k[None, sk:ek], v[None, sk:ek], causal=True, sink=sink)
        refs.append(ref[0])
        assert eq == sq or (out[sq:eq].double() - ref[0]).abs().max() < 1e-5
    want = torch.autograd.grad(torch.cat(refs), (q, k, v, sink), g.double())
    for name, x, r in zip(("dq", "dk", "dv", "dsink"), ours, want, strict=True):
        assert_close(name, x, r, r)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_kv_cache_decode(path, num_splits):
    """A decode step of 8 query heads over 2 kv heads (the kernels pack a group's heads into one tile), whole cache
    or split-KV (the sink joins once, after the splits merge)."""
    torch.manual_seed(2)
    q, sink, k_cache, v_cache, lengths = path.put(
        torch.randn(3, 1, 8, 32), torch.randn(8), torch.randn(3, 64, 2, 32), torch.randn(3, 64, 2, 32),
        torch.tensor([0, 64, 23], dtype=torch.int32))
    out, lse = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, learnable_sink=sink,
                                                 num_splits=num_splits, return_softmax_lse=True)
    for b, n in enumerate(lengths.tolist()):
        ref, ref_lse = attention_ref(q[b : b + 1], k_cache[b : b + 1, :n], v_cache[b : b + 1, :n], sink=sink)
        assert (out[b : b + 1].double() - ref).abs().max() < 1e-5
        assert (lse[b : b + 1].double() - ref_lse).abs().max() < 1e-5


def test_self_attention_learns_its_sinks():
    torch.manual_seed(3)
    layer = flashattn.nn.SelfAttention(64, 4, 2, learnable_sink=True).double()
    with torch.no_grad():
        layer.sink.normal_(0.0, 2.0)
    x = torch.randn(2, 12, 64, dtype=torch.float64)
    layer(x).square().sum().backward()
    assert layer.sink.grad is not None and layer.sink.grad.abs().sum() > 0
    # Generation through the KV cache attends with the same sinks.
    cache = layer.new_cache(2, 16)
    with torch.no_grad():
        stepped = torch.cat([layer(x[:, :7], cache), *(layer(x[:, i : i + 1], cache) for i in range(7, 12))], 1)
        torch.testing.assert_close(stepped, layer(x), rtol=0, atol=1e-10)


@pytest.mark.parametrize("sink,error,match", [
    ("nope", TypeError, "learnable_sink must be a torch.Tensor"),
    (torch.zeros(4, dtype=torch.int64), TypeError, "floating-point"),
    (torch.zeros(3), ValueError, r"shape \(nheads,\) = \(4,\), got \(3,\)"),
    (torch.zeros(1, 4), ValueError, r"got \(1, 4\)"),
])
def test_bad_sinks_are_named(sink, error, match):
    q = torch.randn(1, 5, 4, 16)
    with pytest.raises(error, match=match):
        flashattn.flash_attn_func(q, q, q, learnable_sink=sink)
    with pytest.raises(error, match=match):
        flashattn.flash_attn_with_kvcache(q, q, q, learnable_sink=sink)


def test_the_cuda_path_declines_them():
    from flashattn.backends import Request, cuda

    assert "sink" in cuda.serves(Request("cuda", torch.float16, 64, 64, features=("sink",)))


def test_compiles_without_graph_breaks(path):
    """The sink is one more tensor of the op's schema and its gradient plain torch ops: fullgraph traces both."""
    q, k, v, sink = _inputs(path, 1, 24, 24, 4, 2, 16)
    step = torch.compile(lambda *t: flashattn.flash_attn_func(*t[:3], causal=True, learnable_sink=t[3]),
                         fullgraph=True)
    compiled = torch.autograd.grad(step(q, k, v, sink).square().sum(), (q, k, v, sink))
    eager = torch.autograd.grad(flashattn.flash_attn_func(q, k, v, causal=True, learnable_sink=sink).square().sum(),
                                (q, k, v, sink))
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b)
