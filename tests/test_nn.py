"""flashattn.nn: MultiheadAttention against torch.nn.MultiheadAttention with the same weights (float64, so any
difference is a bug, not rounding), also inside torch's transformer modules (where our attention must be what
runs), and SelfAttention against a plain rotary + GQA + causal formula, with the KV cache equal to recomputing the
whole sequence. Float64 throughout: on the paths that take it (cpu, torch), each test once per path."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import flashattn.nn
from conftest import FLOAT64_PATHS
from flashattn.nn import MultiheadAttention, SelfAttention

pytestmark = [pytest.mark.usefixtures("path"), pytest.mark.parametrize("path", FLOAT64_PATHS, indirect=True)]
F64 = torch.float64


def _pair(**kwargs):
    ours = MultiheadAttention(dtype=F64, **kwargs)
    theirs = torch.nn.MultiheadAttention(dtype=F64, **kwargs)
    theirs.load_state_dict(ours.state_dict())  # the parameter names and shapes are torch's
    return ours, theirs


def _inputs(kwargs, n=3, length=6, s=9):
    e = kwargs["embed_dim"]
    kdim, vdim = kwargs.get("kdim") or e, kwargs.get("vdim") or e

    def make(size, width):
        shape = (n, size, width) if kwargs.get("batch_first") else (size, n, width)
        return torch.randn(shape, dtype=F64, requires_grad=True)

    return make(length, e), make(s, kdim), make(s, vdim)


MODULES = [
    {"embed_dim": 16, "num_heads": 4},
    {"embed_dim": 16, "num_heads": 2, "batch_first": True},
    {"embed_dim": 16, "num_heads": 4, "bias": False, "batch_first": True},
    {"embed_dim": 16, "num_heads": 4, "add_bias_kv": True, "add_zero_attn": True},
    {"embed_dim": 12, "num_heads": 3, "kdim": 7, "vdim": 5, "batch_first": True},
]


def _masks(kind, n=3, h=4, length=6, s=9):
    torch.manual_seed(3)
    if kind == "none":
        return {}
    if kind == "key_padding":
        kpm = torch.zeros(n, s, dtype=torch.bool)
        kpm[0, -3:] = True
        kpm[2, :2] = True
        return {"key_padding_mask": kpm}
    if kind == "bool_2d":
        return {"attn_mask": torch.rand(length, s) < 0.3}
    if kind == "float_3d":
        return {"attn_mask": torch.randn(n * h, length, s, dtype=F64)}
    if kind == "both":
        kpm = torch.rand(n, s) < 0.2
        return {"attn_mask": torch.rand(length, s) < 0.3, "key_padding_mask": kpm}
    if kind == "both_float":
        kpm = torch.zeros(n, s, dtype=F64).masked_fill(torch.rand(n, s) < 0.2, -math.inf)
        return {"attn_mask": torch.randn(length, s, dtype=F64), "key_padding_mask": kpm}
    raise AssertionError(kind)


def _grads(outputs, tensors):
    return torch.autograd.grad(outputs, tensors, [torch.ones_like(o) for o in outputs], allow_unused=True)


@pytest.mark.parametrize("module_kwargs", MODULES, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
@pytest.mark.parametrize("need_weights,average", [(False, True), (True, True), (True, False)])
def test_mha_matches_torch(module_kwargs, need_weights, average):
    ours, theirs = _pair(**module_kwargs)
    q, k, v = _inputs(module_kwargs)
    kw = {"need_weights": need_weights, "average_attn_weights": average}
    out, w = ours(q, k, v, **kw)
    ref, ref_w = theirs(q, k, v, **kw)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    assert (w is None) == (ref_w is None)
    if w is not None:
        torch.testing.assert_close(w, ref_w, rtol=0, atol=1e-12)
    params = [q, k, v, *ours.parameters()]
    mine = _grads([out], params)
    want = _grads([ref], [q, k, v, *theirs.parameters()])
    for a, b in zip(mine, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("mask", ["key_padding", "bool_2d", "float_3d", "both", "both_float"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_mha_masks_match_torch(mask, need_weights):
    kwargs = {"embed_dim": 16, "num_heads": 4}
    ours, theirs = _pair(**kwargs)
    q, k, v = _inputs(kwargs)
    masks = _masks(mask)
    out, w = ours(q, k, v, need_weights=need_weights, **masks)
    ref, ref_w = theirs(q, k, v, need_weights=need_weights, **masks)
    rows = ~torch.isnan(ref).any(-1)  # torch gives NaN where a query may attend nothing; we give 0 (next test)
    torch.testing.assert_close(out[rows], ref[rows], rtol=0, atol=1e-12)
    if need_weights:
        torch.testing.assert_close(w.transpose(0, 1)[rows], ref_w.transpose(0, 1)[rows], rtol=0, atol=1e-12)
    for a, b in zip(_grads([out[rows]], [q, k, v]), _grads([ref[rows]], [q, k, v]), strict=True):
        if not torch.isnan(b).any():
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_mha_causal_and_unbatched():
    kwargs = {"embed_dim": 16, "num_heads": 4, "batch_first": True}
    ours, theirs = _pair(**kwargs)
    x = torch.randn(2, 7, 16, dtype=F64)
    causal = torch.ones(7, 7, dtype=torch.bool).triu(1)
    ref, _ = theirs(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)
    out, _ = ours(x, x, x, is_causal=True, need_weights=False)  # no attn_mask needed
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    out1, w1 = ours(x[0], x[0], x[0])
    ref1, rw1 = theirs(x[0], x[0], x[0])
    torch.testing.assert_close(out1, ref1, rtol=0, atol=1e-12)
    torch.testing.assert_close(w1, rw1, rtol=0, atol=1e-12)


def test_mha_fully_masked_query_outputs_bias_not_nan():
    ours = MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(1, 4, 8)
    blocked = torch.zeros(4, 4, dtype=torch.bool)
    blocked[2] = True  # query 2 may attend nothing
    out, w = ours(x, x, x, attn_mask=blocked)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out[0, 2], ours.out_proj.bias)  # attention output 0, then the projection
    assert torch.equal(w[0, 2], torch.zeros(4))


def test_mha_dropout_weights_are_the_applied_ones():
    torch.manual_seed(0)
    ours = MultiheadAttention(16, 4, dropout=0.5, batch_first=True, dtype=F64)
    x = torch.randn(2, 12, 16, dtype=F64)
    clean = ours.eval()(x, x, x, average_attn_weights=False)[1]
    out, w = ours.train()(x, x, x, average_attn_weights=False)
    dropped = w == 0
    assert 0.3 < dropped.double().mean() < 0.7
    torch.testing.assert_close(w[~dropped], clean[~dropped] / 0.5)
    # the output is those weights applied to the projected values
    v = torch.nn.functional.linear(x, *[t.split(16)[2] for t in (ours.in_proj_weight, ours.in_proj_bias)])
    v = v.view(2, 12, 4, 4).transpose(1, 2)
    manual = ours.out_proj((w @ v).transpose(1, 2).reshape(2, 12, 16))
    torch.testing.assert_close(out, manual)


def test_mha_errors():
    with pytest.raises(ValueError, match="divisible"):
        MultiheadAttention(10, 3)
    mha = MultiheadAttention(8, 2)
    x = torch.randn(5, 2, 8)
    with pytest.raises(ValueError, match="attn_mask"):
        mha(x, x, x, attn_mask=torch.zeros(4, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask"):
        mha(x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_mha_nested_inputs():
    """Nested sequences of lengths 7, 4, 1 equal each sequence alone; the output is nested like the input."""
    ours, theirs = _pair(embed_dim=16, num_heads=4, batch_first=True)
    x, lengths = torch.randn(3, 7, 16, dtype=F64), [7, 4, 1]
    for layout in (torch.strided, torch.jagged):
        nested = torch.nested.as_nested_tensor([x[i, :n] for i, n in enumerate(lengths)], layout=layout)
        out, _ = ours(nested, nested, nested, need_weights=False)
        assert out.is_nested and out.layout == layout
        for i, (row, n) in enumerate(zip(out.unbind(), lengths, strict=True)):
            seq = x[i:i + 1, :n]
            torch.testing.assert_close(row, theirs(seq, seq, seq)[0][0], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="nested"):
        ours(nested, nested, nested, key_padding_mask=torch.zeros(3, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="batch_first"):
        MultiheadAttention(16, 4)(nested, nested, nested)


# Inside torch's transformer modules. Eval runs under no_grad: that is when torch takes its fused inference path
# (with gradients wanted it never does), so eval compares our attention with torch's fused kernel.
N, T, S, D = 3, 6, 7, 16
LENGTHS = (7, 5, 2)  # of the S source positions; target sequences keep T - 1, T - 3, T


def _with_our_attention(model):
    """A copy of torch's ``model`` whose every torch MultiheadAttention is ours with the same weights."""
    model = copy.deepcopy(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.MultiheadAttention):
                ours = MultiheadAttention(child.embed_dim, child.num_heads, dropout=child.dropout, dtype=F64,
                                          bias=child.in_proj_bias is not None, batch_first=child.batch_first)
                ours.load_state_dict(child.state_dict())
                setattr(parent, name, ours)
    return model


def _seq(length, batch_first):
    x = torch.randn(N, length, D, dtype=F64)
    return (x if batch_first else x.transpose(0, 1)).requires_grad_()


def _padding(lengths, size, dtype=torch.bool):
    """Right padding (True / -inf = padding), as TransformerEncoder needs to nest a batch. Every sequence keeps
    its first position, so no query attends to nothing even under a causal mask: torch gives NaN there on its
    Python path and 0 on its fused one, which is torch's difference, not ours to compare."""
    pad = torch.arange(size)[None] >= torch.tensor(lengths)[:, None]
    return pad if dtype == torch.bool else torch.zeros(pad.shape, dtype=dtype).masked_fill(pad, -math.inf)


def _causal(size, dtype=torch.bool):
    mask = torch.ones(size, size, dtype=torch.bool).triu(1)
    return mask if dtype == torch.bool else nn.Transformer.generate_square_subsequent_mask(size, dtype=dtype)


def _encoder_masks(kind, mask_name):
    torch.manual_seed(5)
    causal, pad = {mask_name: _causal(S), "is_causal": True}, {"src_key_padding_mask": _padding(LENGTHS, S)}
    return {"none": {}, "causal": causal, "padding": pad, "causal+padding": {**causal, **pad},
            "float+padding": {mask_name: torch.randn(S, S, dtype=F64),
                              "src_key_padding_mask": _padding(LENGTHS, S, F64)}}[kind]


def _decoder_masks(kind):
    torch.manual_seed(6)
    dtype = F64 if kind == "float" else torch.bool  # torch deprecates mixing bool and float masks
    pads = {"tgt_key_padding_mask": _padding((T - 1, T - 3, T), T, dtype),
            "memory_key_padding_mask": _padding(LENGTHS, S, dtype)}
    return {"none": {}, "causal+padding": {"tgt_mask": _causal(T), "tgt_is_causal": True, **pads},
            "float": {"tgt_mask": _causal(T, F64), "memory_mask": torch.randn(T, S, dtype=F64), **pads}}[kind]


def _compare_in_torch(theirs, inputs, kwargs, *, train, fused=True):
    """``fused=False``: in eval, against torch's Python path; its fused encoder layer reads an additive float
    mask as a boolean one (nonzero = blocked: NaN for a random mask), which is torch's limitation, not ours."""
    ours = _with_our_attention(theirs).train(train)
    theirs.train(train)
    torch.backends.mha.set_fastpath_enabled(fused)
    try:
        with torch.set_grad_enabled(train):
            out, ref = ours(*inputs, **kwargs), theirs(*inputs, **kwargs)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    if train:  # the gradients too: of the inputs and of every parameter, by name
        names = [n for n, _ in theirs.named_parameters()]
        mine = _grads([out], [*inputs, *(ours.get_parameter(n) for n in names)])
        want = _grads([ref], [*inputs, *(theirs.get_parameter(n) for n in names)])
        for a, b in zip(mine, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    return out


def _layer(cls, batch_first):
    return cls(D, 4, dim_feedforward=32, dropout=0.0, batch_first=batch_first, dtype=F64)


def _encoder(*, batch_first=True, nested=False, norm=None):
    return nn.TransformerEncoder(_layer(nn.TransformerEncoderLayer, batch_first), num_layers=3, norm=norm,
                                 enable_nested_tensor=nested)


ENCODER_MASKS = ["none", "causal", "padding", "causal+padding", "float+padding"]
MODES = pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])


@MODES
@pytest.mark.parametrize("masks", ENCODER_MASKS)
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("stacked", [False, True], ids=["layer", "encoder"])
def test_encoder_in_torch(stacked, batch_first, masks, train):
    torch.manual_seed(0)
    model = _encoder(batch_first=batch_first, norm=nn.LayerNorm(D, dtype=F64)) if stacked else \
        _layer(nn.TransformerEncoderLayer, batch_first)
    kwargs = _encoder_masks(masks, "mask" if stacked else "src_mask")
    _compare_in_torch(model, (_seq(S, batch_first),), kwargs, train=train, fused=masks != "float+padding")


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_encoder_nested_tensor_path():
    """enable_nested_tensor: in eval with a padding mask, TransformerEncoder nests the batch for its layers (and
    pads their output with zeros), so our attention gets nested tensors."""
    torch.manual_seed(1)
    pad = _padding(LENGTHS, S)
    out = _compare_in_torch(_encoder(nested=True), (_seq(S, batch_first=True),), {"src_key_padding_mask": pad},
                            train=False)
    assert torch.equal(out[pad], torch.zeros_like(out[pad]))  # the nested path ran


@MODES
@pytest.mark.parametrize("masks", ["none", "causal+padding", "float"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("stacked", [False, True], ids=["layer", "decoder"])
def test_decoder_in_torch(stacked, batch_first, masks, train):
    torch.manual_seed(2)
    layer = _layer(nn.TransformerDecoderLayer, batch_first)
    model = nn.TransformerDecoder(layer, num_layers=2, norm=nn.LayerNorm(D, dtype=F64)) if stacked else layer
    inputs = (_seq(T, batch_first), _seq(S, batch_first))
    _compare_in_torch(model, inputs, _decoder_masks(masks), train=train)


def _transformer(batch_first):
    return nn.Transformer(D, 4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=32, dropout=0.0,
                          batch_first=batch_first, dtype=F64)


def _transformer_masks():
    return {"src_key_padding_mask": _padding(LENGTHS, S), **_decoder_masks("causal+padding")}


@MODES
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True", "ignore:The PyTorch API of nested tensors")
def test_transformer_in_torch(batch_first, train):
    torch.manual_seed(3)
    inputs = (_seq(S, batch_first), _seq(T, batch_first))
    _compare_in_torch(_transformer(batch_first), inputs, _transformer_masks(), train=train)


def _models(kind):
    """(torch model, inputs, forward kwargs, attention modules it runs per forward)."""
    seq = _seq(S, batch_first=True)
    if kind == "encoder_layer":  # both masks: torch's fused layer would merge them (merge_masks)
        return _layer(nn.TransformerEncoderLayer, True), (seq,), _encoder_masks("float+padding", "src_mask"), 1
    if kind == "encoder":
        return _encoder(), (seq,), _encoder_masks("causal", "mask"), 3
    if kind == "nested_encoder":
        return _encoder(nested=True), (seq,), _encoder_masks("padding", "mask"), 3
    if kind == "decoder":
        model = nn.TransformerDecoder(_layer(nn.TransformerDecoderLayer, True), num_layers=2)
        return model, (_seq(T, True), seq), _decoder_masks("causal+padding"), 4
    return _transformer(batch_first=True), (seq, _seq(T, True)), _transformer_masks(), 6


@pytest.mark.parametrize("kind", ["encoder_layer", "encoder", "nested_encoder", "decoder", "transformer"])
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_our_attention_runs_in_torch_modules(kind, monkeypatch):
    """In eval under no_grad, where torch would take its fused path, every attention module runs ours: one call
    of our attention per module per forward, and torch's fused kernels are never called."""
    theirs, inputs, kwargs, attentions = _models(kind)
    ours = _with_our_attention(theirs).eval()
    calls = []

    def spy(*args, **options):
        calls.append(1)
        return real(*args, **options)

    def fused(*args, **options):
        raise AssertionError("torch's fused attention ran instead of ours")

    real = flashattn.nn.scaled_dot_product_attention
    monkeypatch.setattr(flashattn.nn, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", fused)
    monkeypatch.setattr(torch, "_native_multi_head_attention", fused)
    with torch.no_grad():
        for forwards in (1, 2):
            ours(*inputs, **kwargs)
            assert len(calls) == forwards * attentions


def _rotate(x, base, rotary_dim, interleaved):
    """Rotary by complex multiplication: pair i at position p turns by p * base^(-2i/r)."""
    n = x.shape[1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    angle = torch.arange(n, dtype=F64)[:, None] * base ** (-torch.arange(0, rotary_dim, 2, dtype=F64) / rotary_dim)
    turn = torch.polar(torch.ones_like(angle), angle)[None, :, None, :]
    if interleaved:
        pairs = torch.view_as_complex(rot.reshape(*rot.shape[:-1], -1, 2).contiguous())
        rot = torch.view_as_real(pairs * turn).flatten(-2)
    else:
        half = rotary_dim // 2
        pairs = torch.complex(rot[..., :half], rot[..., half:]) * turn
        rot = torch.cat([pairs.real, pairs.imag], dim=-1)
    return torch.cat([rot, rest], dim=-1)


def _self_attention_ref(m: SelfAttention, x):
    b, n, _ = x.shape
    qkv = m.qkv(x).view(b, n, m.num_heads + 2 * m.num_kv_heads, m.head_dim)
    q, k, v = qkv.split([m.num_heads, m.num_kv_heads, m.num_kv_heads], dim=2)
    if m.rotary:
        q, k = (_rotate(t, m.rotary_base, m.rotary_dim, m.rotary_interleaved) for t in (q, k))
    g = m.num_heads // m.num_kv_heads
    q, k, v = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(g, 1), v.transpose(1, 2).repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(m.head_dim)
    if m.softcap:
        s = m.softcap * torch.tanh(s / m.softcap)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    visible = j <= i if m.causal else torch.ones(n, n, dtype=torch.bool)
    if m.window_size[0] >= 0:
        visible &= j >= i - m.window_size[0]
    out = torch.softmax(s.masked_fill(~visible, -math.inf), dim=-1) @ v
    return m.out(out.transpose(1, 2).reshape(b, n, -1))


BLOCKS = [
    {"num_heads": 4},
    {"num_heads": 4, "num_kv_heads": 2, "rotary_interleaved": True},
    {"num_heads": 6, "num_kv_heads": 1, "head_dim": 10, "rotary_dim": 6, "bias": True},
    {"num_heads": 4, "num_kv_heads": 2, "window_size": (3, 0), "softcap": 5.0},
    {"num_heads": 4, "causal": False, "rotary": False},
]


@pytest.mark.parametrize("block", BLOCKS, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
def test_self_attention_matches_formula(block):
    torch.manual_seed(0)
    m = SelfAttention(24, dtype=F64, **block)
    x = torch.randn(2, 13, 24, dtype=F64, requires_grad=True)
    out, ref = m(x), _self_attention_ref(m, x)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    mine = _grads([out], [x, *m.parameters()])
    want = _grads([ref], [x, *m.parameters()])
    for a, b in zip(mine, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("block", BLOCKS[:4], ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_kv_cache_equals_recomputing(block, dtype):
    """Prefill 9 tokens, then decode 1, 1 and 3: every output equals the no-cache forward of the whole prefix."""
    torch.manual_seed(1)
    m = SelfAttention(24, dtype=dtype, **block).eval()
    x = torch.randn(2, 14, 24, dtype=dtype)
    cache = m.new_cache(2, 20)
    with torch.no_grad():
        full = m(x)
        pieces = [m(x[:, a:b], cache=cache) for a, b in ((0, 9), (9, 10), (10, 11), (11, 14))]
    assert cache.seqlens.tolist() == [14, 14]
    tol = 1e-12 if dtype == F64 else 2e-5
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=tol)
    cache.reset()
    assert cache.seqlens.tolist() == [0, 0]


def test_self_attention_errors():
    with pytest.raises(ValueError, match="num_kv_heads"):
        SelfAttention(24, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="rotary_dim"):
        SelfAttention(24, 4, rotary_dim=5)
    with pytest.raises(ValueError, match="causal"):
        SelfAttention(24, 4, causal=False).new_cache(1, 8)
    m = SelfAttention(24, 4)
    with pytest.raises(RuntimeError, match="no_grad"):
        m(torch.randn(1, 2, 24), cache=m.new_cache(1, 8))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="a CUDA graph needs a CUDA GPU"))])
def test_a_compiled_decode_step_equals_eager(device):
    """A decode step of ``SelfAttention`` under ``torch.compile(mode="reduce-overhead", fullgraph=True)``: one graph
    serves every step (the cache's lengths are a tensor) and equals the eager step, cache included; on a GPU it is
    captured in a CUDA graph, none skipped (the cache's tensors have static addresses, as Hugging Face's StaticCache
    marks its own: a graph that appends to its inputs is otherwise skipped)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    attn = SelfAttention(dim=64, num_heads=4, num_kv_heads=2, causal=True).to(device, dtype).eval()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda x, cache: attn(x, cache=cache), mode="reduce-overhead", fullgraph=True)
    with torch.inference_mode():
        eager_cache, compiled_cache = (attn.new_cache(batch_size=2, max_seqlen=32) for _ in range(2))
        assert all(getattr(t, "_dynamo_static_input_type", None) for t in (compiled_cache.k, compiled_cache.seqlens))
        prompt = torch.randn(2, 10, 64, device=device, dtype=dtype)
        attn(prompt, cache=eager_cache), attn(prompt, cache=compiled_cache)
        for _ in range(4):
            x = torch.randn(2, 1, 64, device=device, dtype=dtype)
            torch.testing.assert_close(compiled(x, compiled_cache), attn(x, cache=eager_cache))
        assert compiled_cache.seqlens.tolist() == eager_cache.seqlens.tolist() == [14, 14]
        torch.testing.assert_close(compiled_cache.k, eager_cache.k)
        another, reference = (attn.new_cache(batch_size=2, max_seqlen=32) for _ in range(2))
        attn(prompt, cache=another), attn(prompt, cache=reference)
        torch.testing.assert_close(compiled(x, another), attn(x, cache=reference))  # a new cache: the same graph
    assert counters["stats"]["unique_graphs"] == 1
    if device == "cuda":
        assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
