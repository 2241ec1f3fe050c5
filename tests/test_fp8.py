"""FP8 inputs, FlashAttention-3's interface: q, k, v (or a KV cache) in float8 with per (batch, kv head) descales.
Ground truth is float64 on the dequantized values; the bar is twice the error of PyTorch's attention in bfloat16
over the same dequantized values (what a bf16 model reading the FP8 cache would compute)."""

from __future__ import annotations

import os

import oracle
import pytest
import torch
import torch.nn.functional as F
from triton_versions import TRITON_MISSING

import flashattn
from flashattn import flash_attn_func, flash_attn_with_kvcache
from flashattn.backends import cpu_build

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _quantized(x: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    """x (B, N, H, D) over scale (B, Hk) repeated to x's heads, in ``dtype``."""
    return (x / scale.repeat_interleave(x.shape[2] // scale.shape[1], 1)[:, None, :, None]).to(dtype)


def _dequantized(x: torch.Tensor, scale: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    return x.to(dtype) * scale.to(dtype).repeat_interleave(x.shape[2] // scale.shape[1], 1)[:, None, :, None]


def _reference(q, k, v, *, causal=False, lengths=None, dtype=torch.float64):
    """Plain attention in ``dtype`` (flash layout, GQA, bottom-right causal, keys past ``lengths`` unseen)."""
    q, k, v = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    nq, nk = q.shape[2], k.shape[2]
    seen = torch.ones(q.shape[0], 1, nq, nk, dtype=torch.bool)
    if lengths is not None:
        seen &= torch.arange(nk)[None, None, None, :] < lengths.view(-1, 1, 1, 1)
    if causal:
        ends = (lengths if lengths is not None else torch.full((q.shape[0],), nk)).view(-1, 1, 1, 1)
        seen &= torch.arange(nk).view(1, 1, 1, -1) <= torch.arange(nq).view(1, 1, -1, 1) + ends - nq
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=q.shape[-1] ** -0.5)
    return torch.nan_to_num(out).transpose(1, 2)


def _counting(forward, calls: list):
    """The kernel's forward, recording each call's kv_format."""
    def counted(*args, **kwargs):
        calls.append(kwargs.get("kv_format", 0))
        return forward(*args, **kwargs)
    return counted


def _error(x, truth) -> float:
    return float((x.double() - truth).abs().max())


# The C++ kernel where it is built; the Triton kernels under the interpreter (CPU tensors; a GPU runs gpu-check).
PATHS = (["torch"] + (["cpu"] if cpu_build.status()[0] else [])
         + (["triton"] if TRITON_MISSING is None and os.environ.get("TRITON_INTERPRET") == "1" else []))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_forward_matches_float64_on_the_dequantized_values(dtype, causal, path):
    torch.manual_seed(0)
    b, nq, nk, h, hk, d = 2, 37, 113, 4, 2, 40
    scales = [torch.rand(b, hk) + 0.25 for _ in range(3)]
    q, k, v = (_quantized(torch.randn(b, n, heads, d), s, dtype)
               for n, heads, s in ((nq, h, scales[0]), (nk, hk, scales[1]), (nk, hk, scales[2])))
    with flashattn.use_backend(path):
        out = flash_attn_func(q, k, v, causal=causal, q_descale=scales[0], k_descale=scales[1], v_descale=scales[2])
    assert out.dtype == torch.bfloat16 and out.shape == (b, nq, h, d)
    wide = [_dequantized(t, s) for t, s in zip((q, k, v), scales, strict=True)]
    truth = _reference(*wide, causal=causal)
    baseline = _error(_reference(*(t.bfloat16() for t in wide), causal=causal, dtype=torch.bfloat16), truth)
    if path == "triton" and dtype == torch.float8_e4m3fn:  # FP8 matmuls, P rounded: tests/test_fp8_matmuls.py
        baseline = _error(oracle.attention_ref(*wide, causal=causal, round_probs=dtype)[0], truth)
    assert _error(out, truth) <= 2 * baseline, (_error(out, truth), baseline)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_an_fp8_cache_read_by_16_bit_queries(paged, q_dtype, path):
    torch.manual_seed(1)
    b, h, hk, d, capacity, page = 3, 8, 2, 64, 40, 7
    k_scale, v_scale = torch.rand(b, hk) + 0.5, torch.rand(b, hk) + 0.5
    lengths = torch.tensor([5, 0, 29], dtype=torch.int32)  # sequence 1 sees only its new tokens
    keys, values = torch.randn(b, capacity, hk, d), torch.randn(b, capacity, hk, d)
    k_new, v_new = torch.randn(b, 2, hk, d, dtype=q_dtype), torch.randn(b, 2, hk, d, dtype=q_dtype)
    k_cache, v_cache = _quantized(keys, k_scale, FP8[0]), _quantized(values, v_scale, FP8[0])
    q = torch.randn(b, 2, h, d, dtype=q_dtype)
    kwargs = {"cache_seqlens": lengths, "causal": True, "k_descale": k_scale, "v_descale": v_scale}
    if paged:  # each sequence's positions on pages in a shuffled order, one page left over
        pages_per_seq = -(-capacity // page)
        order = torch.randperm(b * pages_per_seq + 1)[: b * pages_per_seq].view(b, pages_per_seq)
        k_pages = torch.zeros(b * pages_per_seq + 1, page, hk, d, dtype=FP8[0])
        v_pages = torch.zeros_like(k_pages)
        for i in range(b):
            for p in range(pages_per_seq):
                rows = slice(p * page, min((p + 1) * page, capacity))
                n = rows.stop - rows.start
                k_pages[order[i, p], :n], v_pages[order[i, p], :n] = k_cache[i, rows], v_cache[i, rows]
        with flashattn.use_backend(path):
            out = flash_attn_with_kvcache(q, k_pages, v_pages, k_new, v_new, block_table=order.int(), **kwargs)
        flat = [torch.cat([pages[order[i]].flatten(0, 1)[:capacity][None] for i in range(b)]) for pages in
                (k_pages, v_pages)]
        k_cache, v_cache = flat
    else:
        with flashattn.use_backend(path):
            out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, **kwargs)
    assert out.dtype == q_dtype
    ends = lengths + 2
    for i in range(b):  # the new tokens were quantized into the cache with its descales
        stored = _dequantized(k_cache[i : i + 1, lengths[i] : ends[i]], k_scale[i : i + 1])
        assert torch.allclose(stored, k_new[i : i + 1].double(), rtol=0.07, atol=0.02 * float(k_scale[i].max()))
    wide_k, wide_v = _dequantized(k_cache, k_scale), _dequantized(v_cache, v_scale)
    truth = _reference(q, wide_k, wide_v, causal=True, lengths=ends)
    baseline = _error(_reference(q, wide_k.to(q_dtype), wide_v.to(q_dtype), causal=True, lengths=ends,
                                 dtype=q_dtype), truth)
    assert _error(out, truth) <= 2 * baseline + 1e-6, (_error(out, truth), baseline)


def test_fp8_new_keys_are_copied_and_16_bit_ones_saturate():
    k_cache, v_cache = (torch.zeros(1, 4, 1, 2, dtype=FP8[0]) for _ in range(2))
    q = torch.randn(1, 1, 1, 2, dtype=torch.bfloat16)
    big = torch.tensor([[[[1000.0, -1e6]]]], dtype=torch.bfloat16)
    flash_attn_with_kvcache(q, k_cache, v_cache, big, big, cache_seqlens=0, k_descale=torch.ones(1, 1),
                            v_descale=torch.full((1, 1), 2.0))
    assert k_cache[0, 0, 0].float().tolist() == [448.0, -448.0]  # e4m3fn's largest finite value, not inf or NaN
    assert v_cache[0, 0, 0].float().tolist() == [448.0, -448.0]
    exact = torch.tensor([[[[1.5, -0.25]]]]).to(FP8[0])
    flash_attn_with_kvcache(q, k_cache, v_cache, exact, exact, cache_seqlens=1)
    assert torch.equal(k_cache[0, 1].view(torch.uint8), exact[0, 0].view(torch.uint8))


def test_nan_in_an_fp8_cache_reaches_the_rows_that_see_it_and_no_row_past_the_length():
    k_cache = torch.zeros(1, 3, 1, 4, dtype=FP8[0])
    v_cache = torch.zeros_like(k_cache)
    v_cache[0, 2, 0, 0] = float("nan")  # e4m3fn has NaN (and no inf)
    q = torch.randn(1, 3, 1, 4, dtype=torch.bfloat16)
    assert flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=3)[0, :, 0, 0].isnan().all()
    assert not flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=2).isnan().any()


def test_an_empty_fp8_cache_row_outputs_zero():
    k_cache, v_cache = (torch.randn(2, 5, 1, 8).to(FP8[0]) for _ in range(2))
    q = torch.randn(2, 1, 2, 8, dtype=torch.bfloat16)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([0, 5], dtype=torch.int32),
                                       return_softmax_lse=True)
    assert out[0].eq(0).all() and torch.isneginf(lse[0]).all() and not out.isnan().any()


@pytest.mark.parametrize(("kwargs", "error", "words"), [
    ({"k_descale": torch.ones(2, 3)}, ValueError, ["k_descale", "(batch, nheads_k) = (2, 2)", "(2, 3)"]),
    ({"v_descale": torch.ones(2, 2, dtype=torch.float64)}, TypeError, ["v_descale", "float32", "float64"]),
    ({"k_descale": [[1.0, 1.0]]}, TypeError, ["k_descale", "list"]),
    ({"q_descale": torch.ones(2, 2)}, ValueError, ["q_descale scales FP8 inputs", "bfloat16"]),
])
def test_bad_descales_are_errors_naming_them(kwargs, error, words):
    cache = torch.zeros(2, 4, 2, 8, dtype=FP8[0])
    q = torch.randn(2, 1, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(error) as e:
        flash_attn_with_kvcache(q, cache, cache, cache_seqlens=2, **kwargs)
    assert str(e.value).startswith("flash_attn_with_kvcache: ") and all(w in str(e.value) for w in words), e.value


def test_what_fp8_inputs_do_not_go_with():
    x = torch.randn(1, 4, 2, 8).to(FP8[0])
    with pytest.raises(ValueError, match="dropout_p must be 0 with FP8 inputs"):
        flash_attn_func(x, x, x, dropout_p=0.1)
    with pytest.raises(TypeError, match="float16 or bfloat16"):  # an FP8 cache, float32 queries
        flash_attn_with_kvcache(torch.randn(1, 1, 2, 8), x, x)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="dropout_p must be 0 with FP8 inputs"):
        flashattn.flash_attn_varlen_func(x[0], x[0], x[0], cu, cu, 4, 4, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"k_descale must have shape \(batch, nheads_k\) = \(1, 2\), got \(2, 2\)"):
        flashattn.flash_attn_varlen_func(x[0], x[0], x[0], cu, cu, 4, 4, k_descale=torch.ones(2, 2))
    with pytest.raises(TypeError, match="has dtype torch.float8_e4m3fn but q has torch.bfloat16"):
        flash_attn_func(x.bfloat16(), x, x)


def test_fp8_probabilities_are_refused_by_name():
    x = torch.randn(1, 4, 2, 8).to(FP8[0])
    with pytest.raises(ValueError, match="return_attn_probs is not available with FP8 inputs"):
        flash_attn_func(x, x, x, return_attn_probs=True)


@pytest.mark.skipif(not cpu_build.status()[0], reason="the C++ CPU kernel is not built here")
@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_the_cpu_kernel_widens_fp8_tiles_as_the_torch_path_reads_them(dtype, paged, monkeypatch):
    """The C++ kernel (FP8 rows widened tile by tile, k's descale folded into q, v's on each output row) against
    the torch path, on a decode step and a chunked prefill, GQA 4:1, split across the threads."""
    torch.manual_seed(3)
    b, h, hk, d, capacity = 2, 8, 2, 96, 300
    k_cache, v_cache = (_quantized(torch.randn(b, capacity, hk, d) * 3, torch.ones(b, hk), dtype) for _ in range(2))
    scales = {"k_descale": torch.rand(b, hk) + 0.5, "v_descale": torch.rand(b, hk) + 0.5}
    lengths = torch.tensor([113, 290], dtype=torch.int32)
    table = None
    if paged:  # pages of 25 rows, in reverse order
        table = torch.arange(b * 12).flip(0).view(b, 12).int()
        k_cache, v_cache = (c.view(b * 12, 25, hk, d).flip(0).contiguous() for c in (k_cache, v_cache))
    calls = []
    monkeypatch.setattr(cpu_build.module(), "forward", _counting(cpu_build.module().forward, calls), raising=False)
    rows = [(table[i].long()[:, None] * 25 + torch.arange(25)).flatten()[:capacity] if paged else None
            for i in range(b)]
    wide = [torch.cat([_dequantized((c.flatten(0, 1)[rows[i]] if paged else c[i])[None], s[i : i + 1])
                       for i in range(b)]) for c, s in ((k_cache, scales["k_descale"]), (v_cache, scales["v_descale"]))]
    for nq in (1, 7):
        q = torch.randn(b, nq, h, d, dtype=torch.bfloat16)
        with flashattn.use_backend("cpu"):
            out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True, block_table=table,
                                          **scales)
        truth = _reference(q, *wide, causal=True, lengths=lengths)
        baseline = _error(_reference(q, *(w.bfloat16() for w in wide), causal=True, lengths=lengths,
                                     dtype=torch.bfloat16), truth)
        assert _error(out, truth) <= 2 * baseline, (nq, _error(out, truth), baseline)
    # The C++ kernel ran both calls on FP8 bytes (a first CPU call in a process also runs the engines' self-test).
    assert calls[-2:] == [1 + (dtype == torch.float8_e5m2)] * 2
def test_self_attention_generates_with_an_fp8_cache_close_to_its_bf16_one():
    from flashattn.nn import SelfAttention

    torch.manual_seed(2)
    layer = SelfAttention(64, 4, 2).to(torch.bfloat16).eval()
    x = torch.randn(2, 9, 64, dtype=torch.bfloat16)
    outs = {}
    for dtype in (torch.bfloat16, FP8[0]):
        cache = layer.new_cache(batch_size=2, max_seqlen=16, dtype=dtype)
        with torch.no_grad():
            layer(x[:, :8], cache=cache)  # prefill, then one decoding step
            outs[dtype] = layer(x[:, 8:], cache=cache)
        assert cache.k.dtype == dtype and cache.seqlens.tolist() == [9, 9]
    assert cache.k_descale.shape == (2, 2)
    gap = (outs[FP8[0]].float() - outs[torch.bfloat16].float()).abs().max()
    assert 0 < gap < 0.05 * outs[torch.bfloat16].float().abs().max(), gap  # e4m3's 3 mantissa bits, not garbage


@pytest.mark.skipif(not cpu_build.status()[0], reason="the C++ CPU kernel is not built here")
@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kv_heads", [1, 2], ids=["one-head", "heads-packed-together"])
def test_the_cpu_kernel_widens_every_fp8_byte_exactly(dtype, q_dtype, kv_heads):
    """One visible key: the output is its value row, every one of the 256 bytes (NaN, inf, subnormals, zeros)
    widened by the kernel, exactly as torch converts it. With two kv heads and four sequences a decode task packs
    both heads' rows, widening them inside the packing (on AVX-512); one head widens each row before."""
    every = torch.arange(256, dtype=torch.uint8)
    rows = torch.stack([every, every.flip(0)])[:kv_heads]  # the second head reads the bytes in reverse order
    v_cache = rows.view(dtype).view(1, 1, kv_heads, 256).expand(4, 1, kv_heads, 256).contiguous()
    k_cache = torch.zeros(4, 1, kv_heads, 256, dtype=dtype)
    q = torch.zeros(4, 1, 2 * kv_heads, 256, dtype=q_dtype)
    with flashattn.use_backend("cpu"):
        out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=1)
    want = rows.view(dtype).to(q_dtype).repeat_interleave(2, dim=0).expand(4, 2 * kv_heads, 256)
    same = (out[:, 0] == want) | (out[:, 0].isnan() & want.isnan())
    assert same.all(), rows[0][~same[0, 0]].tolist()


FP8_COMPILE = """
import sys, torch
from flashattn.backends.spec import AttentionSpec, Descale, KeyCache
from flashattn.backends.triton import attend
from tools.offline.compile import compiled_launches, kernel_counts
for arch, dtype, nq in ((90, torch.float8_e4m3fn, 1), (90, torch.float8_e5m2, 256), (80, torch.float8_e4m3fn, 1),
                        (80, torch.float8_e4m3fn, 256)):
    q, cache, ones = torch.empty(2, nq, 32, 128, dtype=torch.bfloat16), torch.empty(2, 4096, 8, 128, dtype=dtype), \\
        torch.ones(2, 8)
    cached = KeyCache(torch.zeros(2, dtype=torch.int32), torch.full((2,), 4096, dtype=torch.int32), 4096)
    spec = AttentionSpec(scale=0.088, window_right=0, cache=cached, descale=Descale(ones, ones, ones))
    for launch in compiled_launches(arch, lambda: attend.forward(q, cache, cache, spec)):
        if launch.name == "attention_forward_kernel":
            c = kernel_counts(launch)
            print(arch, dtype, nq, c.spill_bytes, c.hgmma + c.hmma)
"""


@pytest.mark.skipif(TRITON_MISSING is not None, reason=TRITON_MISSING or "")
def test_the_triton_kernels_read_fp8_caches_compiled_for_hopper_and_ampere():
    """Compiled offline through the real launcher: for sm_90 a decode step on an e4m3fn cache and a prefill chunk
    on an e5m2 one, for sm_80 (no e4m3fn conversion in Triton: bytes widened by integer code) a decode step and a
    prefill chunk on e4m3fn ones; each widening its tiles in registers, without spills and on the tensor cores."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", FP8_COMPILE], capture_output=True, text=True, env=env, timeout=600,
                          cwd=Path(__file__).resolve().parents[1])
    rows = [line.split() for line in done.stdout.splitlines()]
    assert len(rows) == 4, done.stderr[-3000:]
    for arch, dtype, nq, spills, matmuls in rows:
        assert int(spills) == 0 and int(matmuls) > 0, (arch, dtype, nq, spills, matmuls)


@pytest.mark.skipif(not cpu_build.status()[0], reason="the C++ CPU kernel is not built here")
@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_fp8_prefill_on_the_cpu_widens_keys_once(dtype, monkeypatch):
    """A prefill long enough for several query blocks per kv head hands the C++ kernel its FP8 keys and values
    widened whole, once (not once per block and tile), and FP8 queries widened by its own code; the result keeps
    the bf16 rule."""
    torch.manual_seed(5)
    b, n, h, hk, d = 1, 300, 4, 2, 64
    scales = [torch.rand(b, hk) + 0.25 for _ in range(3)]
    q, k, v = (_quantized(torch.randn(b, n, heads, d), s, dtype) for heads, s in ((h, scales[0]), (hk, scales[1]),
                                                                                  (hk, scales[2])))
    calls = []
    monkeypatch.setattr(cpu_build.module(), "forward", _counting(cpu_build.module().forward, calls), raising=False)
    with flashattn.use_backend("cpu"):
        out = flash_attn_func(q, k, v, causal=True, q_descale=scales[0], k_descale=scales[1], v_descale=scales[2])
    assert calls and not any(calls)  # 16-bit keys and values reached the kernel (kv_format 0)
    wide = [_dequantized(t, s) for t, s in zip((q, k, v), scales, strict=True)]
    truth = _reference(*wide, causal=True)
    baseline = _error(_reference(*(t.bfloat16() for t in wide), causal=True, dtype=torch.bfloat16), truth)
    assert _error(out, truth) <= 2 * baseline, (_error(out, truth), baseline)


def _widen_kernel():
    """A kernel storing ``tiles.widened`` of a uint8 vector as bf16 (jit functions resolve names at module scope)."""
    import triton
    import triton.language as tl

    from flashattn.backends.triton.kernels import tiles

    globals()["widened"] = tiles.widened

    @triton.jit
    def widen_kernel(src, dst, N: tl.constexpr):
        o = tl.arange(0, N)
        tl.store(dst + o, widened(tl.load(src + o), tl.bfloat16))  # noqa: F821 (bound above, at module scope)

    return widen_kernel


@pytest.mark.skipif(TRITON_MISSING is not None or os.environ.get("TRITON_INTERPRET") != "1",
                    reason=TRITON_MISSING or "TRITON_INTERPRET is not set")
def test_the_triton_kernels_widen_e4m3fn_bytes_exactly_where_triton_cannot():
    """Before sm_89 Triton has no float8_e4m3fn conversion: the kernels read such caches as bytes and widen them with
    integer code (``tiles.widened``), exactly: every one of the 256 bytes, and a decode step equal to the native
    conversion's to the bit."""
    from flashattn.backends.triton import attend

    widen_kernel = _widen_kernel()
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256, dtype=torch.bfloat16)
    widen_kernel[(1,)](every, out, N=256)
    want = every.view(torch.float8_e4m3fn).to(torch.bfloat16)
    assert torch.equal(out.isnan(), want.isnan()) and int(out.isnan().sum()) == 2
    assert torch.equal(out[~out.isnan()], want[~want.isnan()])

    torch.manual_seed(2)
    k_cache, v_cache = (_quantized(torch.randn(2, 96, 2, 64), torch.ones(2, 2), FP8[0]) for _ in range(2))
    q = torch.randn(2, 1, 8, 64, dtype=torch.float16)
    kwargs = {"cache_seqlens": torch.tensor([70, 96], dtype=torch.int32), "k_descale": torch.rand(2, 2) + 0.5,
              "v_descale": torch.rand(2, 2) + 0.5}
    with flashattn.use_backend("triton"):
        native = flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
        attend_e4m3 = attend.e4m3_as_bytes
        try:
            attend.e4m3_as_bytes = lambda: True
            as_bytes = flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
        finally:
            attend.e4m3_as_bytes = attend_e4m3
    assert torch.equal(native, as_bytes)
