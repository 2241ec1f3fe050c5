"""The cpu path's two ways of multiplying bf16/fp16 tiles (``flashattn.backends.cpu_tiles``): fp32 tiles, and the
CPU's dot-product instructions through each engine (oneDNN's brgemm, our AVX512_BF16 loop), each forced with
``FLASHATTN_CPU_TILES``. Every feature the kernel serves, forward and backward, against the float64 oracle by the
same-precision rule (the choice of tiles, the switch and the self-test: test_cpu_tile_choice.py). The native
engines' cases skip, with the reason, on a CPU without the instructions."""

from __future__ import annotations

import math

import pytest
import torch
from oracle import assert_close, attention_ref, check_against_oracle

import flashattn
from conftest import HAS_COMPILER, with_dropout_mask
from flashattn.backends import cpu, cpu_tiles
from flashattn.backends.spec import AttentionSpec

pytestmark = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: the C++ kernel cannot be built")
TILES = ("fp32", *cpu_tiles.ENGINES)


@pytest.fixture(params=TILES)
def tiles(request, monkeypatch):
    """Forces the cpu path, and its tile products for bf16/fp16 calls, for the test's body; yields the name."""
    name = request.param
    if name != "fp32":
        why = cpu_tiles.engine_status(torch.bfloat16, name)
        if why is not None:
            pytest.skip(f"{name} cannot run bf16 tiles here: {why}")
    monkeypatch.setenv(cpu_tiles.ENV, name)
    with flashattn.use_backend("cpu"):
        yield name


def _inputs(b, nq, nk, h, hk, d, dv=None, dtype=torch.bfloat16):
    torch.manual_seed(0)
    return [torch.randn(b, n, heads, dim, dtype=dtype, requires_grad=True)
            for n, heads, dim in ((nq, h, d), (nk, hk, d), (nk, hk, dv or d))]


FEATURES = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": (19, 7)},
    "softcap": {"softcap": 5.0, "causal": True},
    "alibi": {"alibi": True},
    "sink": {"sink": True, "causal": True},
}
SHAPES = [  # (b, nq, nk, h, hk, d, dv): odd head dims, q/k lengths that differ, GQA, a value head dim of its own
    (2, 113, 77, 4, 2, 40, None),
    (1, 1, 1025, 4, 1, 59, None),
    (1, 200, 130, 2, 2, 96, None),
    (1, 65, 90, 4, 2, 192, 128),
    # Two query blocks of one head and a last key tile of 8 keys: each tile packed once for both blocks.
    (1, 300, 520, 2, 1, 64, None),
]


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:6])) + (f"v{s[6]}" if s[6] else ""))
def test_every_feature_against_float64(tiles, feature, shape):
    b, nq, nk, h, hk, d, dv = shape
    q, k, v = _inputs(b, nq, nk, h, hk, d, dv)
    kwargs = {key: val for key, val in FEATURES[feature].items() if key not in ("alibi", "sink")}
    if FEATURES[feature].get("alibi"):
        kwargs["alibi_slopes"] = torch.rand(b, h) * 0.3
    if FEATURES[feature].get("sink"):
        kwargs["learnable_sink"] = torch.randn(h, requires_grad=True)
    out = flashattn.flash_attn_func(q, k, v, **kwargs)
    check_against_oracle(q, k, v, kwargs, out, grads=True)


def test_fp16_against_float64(tiles):
    """fp16 runs natively only with AMX-FP16 (oneDNN); elsewhere every tiles setting but fp32 refuses it clearly."""
    q, k, v = _inputs(1, 70, 90, 4, 2, 64, dtype=torch.float16)
    if tiles != "fp32" and cpu_tiles.engine_status(torch.float16, tiles) is not None:
        with pytest.raises(ValueError, match=f"{cpu_tiles.ENV}={tiles} cannot multiply torch.float16 tiles"):
            flashattn.flash_attn_func(q, k, v, causal=True)
        return
    out = flashattn.flash_attn_func(q, k, v, causal=True)
    check_against_oracle(q, k, v, {"causal": True}, out, grads=True)


def test_dropout_is_bit_identical_to_the_other_paths(tiles):
    q, k, v = _inputs(2, 70, 81, 4, 2, 40)
    out, dropped = with_dropout_mask(q, k, v, 0.2, {"causal": True})
    check_against_oracle(q, k, v, {"causal": True}, out, grads=True, dropped=dropped, dropout_p=0.2)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_masks_and_the_additive_masks_gradient(tiles, kind):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, 48, dtype=torch.bfloat16, requires_grad=True) for n in (70, 90, 90))
    if kind == "bool":
        mask = torch.rand(2, 1, 70, 90) > 0.3
        mask[:, :, 5] = False  # a row that sees no key
    else:
        mask = torch.randn(2, 4, 70, 90, dtype=torch.bfloat16, requires_grad=True)
    out = flashattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    flash = [t.transpose(1, 2) for t in (q, k, v)]
    dense = mask if kind == "bool" else mask.detach()
    ref, _ = attention_ref(*flash, mask=dense)
    base, _ = attention_ref(*flash, mask=dense, upcast=False)
    assert_close("out", out.transpose(1, 2), ref, base)
    if kind == "bool":
        assert torch.all(out[:, :, 5] == 0)
        return
    g = torch.randn_like(out)
    (dmask,) = torch.autograd.grad(out, mask, g)
    exact = mask.detach().double().requires_grad_()
    ref, _ = attention_ref(*[t.detach().double() for t in flash], mask=exact)
    (want,) = torch.autograd.grad(ref.transpose(1, 2), exact, g.double())
    base_mask = mask.detach().clone().requires_grad_()
    base, _ = attention_ref(*[t.detach() for t in flash], mask=base_mask, upcast=False)
    (base_grad,) = torch.autograd.grad(base.transpose(1, 2), base_mask, g.to(torch.bfloat16))
    assert_close("dmask", dmask, want, base_grad, factor=3.0, precision=torch.bfloat16)


@pytest.mark.parametrize(("softcap", "shape"), [(4.0, "documents"), (0.0, "band")])
def test_block_masks(tiles, softcap, shape):
    """Partial tiles read the mask; without softcap a band's full tiles take the fused pass (the row sums it keeps
    apart, cpu_vec.h's lanes, join the masked tiles' sums)."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    nq, nk = 113, 300
    doc_q, doc_k = (torch.arange(n) * 3 // n for n in (nq, nk))

    def mask_mod(b, h, q, k):
        if shape == "band":
            return (k <= q + 170) & (k >= q + 20) | (k < 8)
        return (doc_q[q] == doc_k[k]) & (k <= q + 200)

    block_mask = flex.create_block_mask(mask_mod, 1, None, nq, nk, device="cpu", BLOCK_SIZE=(64, 32))
    dense = flex.create_mask(mask_mod, 1, 1, nq, nk, device="cpu")
    q, k, v = _inputs(1, nq, nk, 4, 2, 40)
    out = flashattn.flash_attn_func(q, k, v, block_mask=block_mask, softcap=softcap)
    ref, _ = attention_ref(q, k, v, mask=dense, softcap=softcap)
    base, _ = attention_ref(q, k, v, mask=dense, softcap=softcap, upcast=False)
    assert_close("out", out, ref, base)
    g = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g.double())
    base_g = torch.autograd.grad(base, (q, k, v), g)
    magnitude = max(r.abs().max().item() for r in want)
    for name, x, r, bl in zip(("dq", "dk", "dv"), ours, want, base_g, strict=True):
        assert_close(name, x, r, bl, factor=3.0, magnitude=magnitude)


def test_varlen_against_each_sequence(tiles):
    lengths = [1, 113, 40, 257]
    torch.manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), h, 64, dtype=torch.bfloat16, requires_grad=True) for h in (4, 2, 2))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = flashattn.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        piece = [t[start:end].detach()[None].requires_grad_() for t in (q, k, v)]
        ref, _ = attention_ref(*piece, causal=True)
        base, _ = attention_ref(*piece, causal=True, upcast=False)
        assert_close("out", out[start:end], ref[0], base[0])
        want = torch.autograd.grad(ref, piece, g[start:end][None].double())
        base_g = torch.autograd.grad(base, piece, g[start:end][None])
        magnitude = max(r.abs().max().item() for r in want)
        for name, x, r, bl in zip(("dq", "dk", "dv"), grads, want, base_g, strict=True):
            assert_close(name, x[start:end], r[0], bl[0], factor=3.0, magnitude=magnitude)


def test_calls_from_several_threads_at_once_match_the_same_calls_one_by_one(tiles):
    """The packed key tiles live in blocks kept between calls (a fresh page costs a fault): calls of different sizes
    from four threads at once, forward and backward, each get blocks of their own."""
    from concurrent.futures import ThreadPoolExecutor

    def call(qkv: list[torch.Tensor]) -> list[torch.Tensor]:
        out = flashattn.flash_attn_func(*qkv, causal=True)
        return [out.detach(), *torch.autograd.grad(out, qkv, torch.ones_like(out))]

    sizes = [300, 129, 257, 64, 513, 200, 301, 160]
    inputs = [_inputs(1, size, size + 30, 4, 2, 64, dtype=torch.bfloat16 if size % 2 else torch.float32)
              for size in sizes]  # here: the random generator is not for threads
    one_by_one = [call(qkv) for qkv in inputs]
    with ThreadPoolExecutor(4) as pool:
        at_once = list(pool.map(call, inputs))
    for size, want, got in zip(sizes, one_by_one, at_once, strict=True):
        for name, w, g in zip(("out", "dq", "dk", "dv"), want, got, strict=True):
            torch.testing.assert_close(g, w, msg=lambda m, size=size, name=name: f"{name}, {size} queries: {m}")


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("seqlen_q", [1, 7])
def test_kv_cache_decode_and_prefill(tiles, paged, seqlen_q):
    """Decode's split key range (a long cache, batch 1), GQA packed per tile, a sequence with no keys."""
    torch.manual_seed(0)
    b, hk, h, d, cache, page = 3, 2, 8, 64, 1100, 64
    lens = torch.tensor([1100, 0, 333], dtype=torch.int32)
    k = torch.randn(b, cache, hk, d, dtype=torch.bfloat16)
    v = torch.randn(b, cache, hk, d, dtype=torch.bfloat16)
    q = torch.randn(b, seqlen_q, h, d, dtype=torch.bfloat16)
    sink = torch.randn(h)
    kwargs = {"cache_seqlens": lens, "causal": True, "learnable_sink": sink, "softcap": 8.0}
    if paged:
        pages = cache // page + 1
        k_pages = torch.zeros(b * pages, page, hk, d, dtype=torch.bfloat16)
        v_pages = torch.zeros_like(k_pages)
        table = torch.randperm(b * pages).view(b, pages).to(torch.int32)
        for i in range(b):
            for j in range(pages):
                rows = slice(j * page, min((j + 1) * page, cache))
                n = rows.stop - rows.start
                k_pages[table[i, j], :n], v_pages[table[i, j], :n] = k[i, rows], v[i, rows]
        out = flashattn.flash_attn_with_kvcache(q, k_pages, v_pages, block_table=table, **kwargs)
    else:
        out = flashattn.flash_attn_with_kvcache(q, k, v, **kwargs)
    for i, n in enumerate(lens.tolist()):
        if n == 0:
            assert torch.all(out[i] == 0)
            continue
        ref, _ = attention_ref(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], causal=True, sink=sink, softcap=8.0)
        base, _ = attention_ref(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], causal=True, sink=sink, softcap=8.0,
                                upcast=False)
        assert_close("out", out[i:i + 1], ref, base)


def test_rows_that_see_no_key_are_zero_with_lse_minus_inf(tiles):
    q, k, v = (t.detach() for t in _inputs(1, 40, 9, 2, 2, 32))
    spec = AttentionSpec(scale=32**-0.5, window_right=0)  # bottom-right causal: query i sees keys up to i - 31
    out, lse, _ = cpu.forward(q, k, v, spec)
    assert torch.all(out[:, :31] == 0) and not torch.isnan(out).any()
    assert torch.all(lse[:, :, :31] == -math.inf) and torch.isfinite(lse[:, :, 31:]).all()
    ref, _ = attention_ref(q, k, v, causal=True)
    base, _ = attention_ref(q, k, v, causal=True, upcast=False)
    assert_close("out", out, ref, base)


@pytest.mark.parametrize("top", [3.0, 40.0], ids=["within-headroom", "past-headroom"])
@pytest.mark.parametrize("trend", [1, -1], ids=["rising", "falling"])
def test_scores_that_rise_or_fall_across_the_key_tiles(tiles, trend, top):
    """Keys scaled from 0.1 to `top` along the sequence (or back): a row's scores rise from one key tile to the
    next within the fused pass's headroom (weights kept against a stale maximum while their sum stays below 2^64)
    or far past it (2^200: weights that would overflow unless the pass is redone), or fall away; forward and
    backward against float64."""
    q, k, v = (t.detach() for t in _inputs(1, 300, 700, 2, 1, 64))
    k = (k.float() * torch.linspace(0.1, top, 700)[None, :, None, None] ** trend).to(k.dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    for causal in (False, True):
        out = flashattn.flash_attn_func(q, k, v, causal=causal)
        check_against_oracle(q, k, v, {"causal": causal}, out, grads=True)


@pytest.mark.parametrize("later", [3.0, 60.0], ids=["within-headroom", "past-headroom"])
def test_a_first_tile_whose_later_scores_pass_its_first_ones(tiles, later):
    """The fused pass takes a row's first visible tile against the largest of its first 16 scores: keys after the
    16th scaled by `later` put the tile's maximum a little above that reference, or so far above it (2^300) that
    the weights would overflow unless the pass is redone; forward and backward against float64."""
    q, k, v = (t.detach() for t in _inputs(1, 300, 300, 2, 1, 64))
    k = k.float()
    k[:, 16:] *= later
    q, k, v = (t.requires_grad_() for t in (q, k.to(v.dtype), v))
    for causal in (False, True):
        out = flashattn.flash_attn_func(q, k, v, causal=causal)
        check_against_oracle(q, k, v, {"causal": causal}, out, grads=True)


def test_a_nan_in_a_query_row_makes_that_row_nan_and_no_other(tiles):
    """A NaN score reaches its row's output as NaN, as in PyTorch, never a weight of 0 (the fused softmax pass of
    the 16-bit tiles finds a row's maximum without NaN checks); a NaN key reaches every row that sees it."""
    q, k, v = (t.detach() for t in _inputs(1, 300, 300, 2, 2, 64))
    q[0, 5, 1, 3] = float("nan")
    for causal in (False, True):
        out = flashattn.flash_attn_func(q, k, v, causal=causal)
        nan_rows = torch.isnan(out).any(dim=-1)
        assert nan_rows[0, 5, 1] and nan_rows.sum() == 1, (causal, nan_rows.nonzero().tolist())
    q[0, 5, 1, 3], k[0, 260, 0, 7] = 0.0, float("nan")
    out = flashattn.flash_attn_func(q, k, v, causal=True)  # rows 260 and later see key 260
    nan_rows = torch.isnan(out).any(dim=-1)[0, :, 0]
    assert nan_rows[260:].all() and not nan_rows[:260].any()
