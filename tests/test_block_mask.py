"""FlexAttention's ``BlockMask`` in ``flash_attn_func`` and ``scaled_dot_product_attention``: empty tiles skipped,
full tiles unmasked, partial tiles masked by ``mask_mod`` evaluated on them alone; against the float64 oracle given
the same mask densely, on every path (the Triton kernels walk the mask's block lists)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from oracle import assert_close, attention_ref, oracle_kwargs
from triton_versions import needs_triton

import flashattn
from conftest import with_dropout_mask
from flashattn import checks
from flashattn.backends import Request, explain

flex = pytest.importorskip("torch.nn.attention.flex_attention")
ROOT = Path(__file__).resolve().parents[1]


def _documents(n: int, cuts: list[int]) -> torch.Tensor:
    doc = torch.zeros(n, dtype=torch.long)
    for c in cuts:
        doc[c:] += 1
    return doc


def _mask_mods(nq: int, nk: int, device: str = "cpu"):
    doc = _documents(max(nq, nk), [nk // 5, nk // 2, nk // 2 + 3]).to(device)
    return {
        "document causal": (lambda b, h, q, k: (doc[q] == doc[k]) & (q >= k), None),
        "prefix-LM per head": (lambda b, h, q, k: (k < 17 + 9 * h) | (q >= k), 4),
        "sliding chunks": (lambda b, h, q, k: (q // 48 == k // 48) | ((q // 48) - 1 == k // 48), None),
        "dilated": (lambda b, h, q, k: ((q - k) % 3 == 0) & (k <= q), None),
    }


def _dense(mask_mod, heads, nq, nk, device="cpu"):
    return flex.create_mask(mask_mod, 1, heads or 1, nq, nk, device=device)


@pytest.mark.parametrize("pattern", ["document causal", "prefix-LM per head", "sliding chunks", "dilated"])
@pytest.mark.parametrize("block_size", [(128, 128), (64, 32)], ids=["128x128", "64x32"])
def test_patterns_against_float64(path, pattern, block_size):
    """Forward and gradients (the sink's included); the Triton forward, dK/dV and dQ kernels walk the block lists
    (dK/dV the transposed ones), their tiles dividing the mask's blocks."""
    if path.interpreted and (block_size != (64, 32) or pattern == "sliding chunks"):
        pytest.skip("under Triton's interpreter three patterns at 64 x 32 blocks (seconds each; a GPU runs all)")
    nq, nk, batch = (150, 170, 2 if pattern == "dilated" else 1) if path.interpreted else (300, 300, 2)
    mask_mod, heads = _mask_mods(nq, nk, path.device)[pattern]
    block_mask = flex.create_block_mask(mask_mod, None, heads, nq, nk, device=path.device, BLOCK_SIZE=block_size)
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, n, h, 40, device=path.device, requires_grad=True)
               for n, h in ((nq, 4), (nk, 2), (nk, 2)))
    sink = torch.randn(4, device=path.device, requires_grad=True)
    out = flashattn.flash_attn_func(q, k, v, block_mask=block_mask, learnable_sink=sink)
    ref, _ = attention_ref(q, k, v, mask=_dense(mask_mod, heads, nq, nk, path.device), sink=sink)
    g = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v, sink), g)
    want = torch.autograd.grad(ref, (q, k, v, sink), g.double())
    assert (out.double() - ref).abs().max() < 1e-5
    for x, r in zip(ours, want, strict=True):
        assert (x.double() - r).abs().max() < 1e-5 * (1 + r.abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_by_the_rule(path, dtype):
    """Odd lengths (113 queries, 1025 keys) with a per-batch document mask and other options on top."""
    nq, nk = 113, 1025
    path.skip_if_slow(2 * 4 * nq * nk)
    device = path.device
    doc_q, doc_k = (torch.arange(n, device=device) * 4 // n for n in (nq, nk))

    def mask_mod(b, h, q, k):
        return (doc_q[q] == doc_k[k]) | (k < 8 * (b + 1))

    block_mask = flex.create_block_mask(mask_mod, 2, None, nq, nk, device=device)
    dense = flex.create_mask(mask_mod, 2, 1, nq, nk, device=device)
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, n, h, 59, dtype=dtype, device=device, requires_grad=True)
               for n, h in ((nq, 4), (nk, 4), (nk, 4)))
    sink = torch.randn(4, device=device, requires_grad=True)
    kwargs = {"softcap": 6.0, "learnable_sink": sink}
    out = flashattn.flash_attn_func(q, k, v, block_mask=block_mask, **kwargs)
    ref, _ = attention_ref(q, k, v, mask=dense, **oracle_kwargs(kwargs))
    base, _ = attention_ref(q, k, v, mask=dense, upcast=False, **oracle_kwargs(kwargs))
    assert_close("out", out, ref, base)


def test_sdpa_takes_it_as_attn_mask(path):
    nq, nk = 200, 260
    path.skip_if_slow(2 * 4 * nq * nk)
    mask_mod, _ = _mask_mods(nq, nk, path.device)["document causal"]
    block_mask = flex.create_block_mask(mask_mod, None, None, nq, nk, device=path.device)
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, h, n, 32, device=path.device) for h, n in ((4, nq), (2, nk), (2, nk)))
    out = flashattn.scaled_dot_product_attention(q, k, v, attn_mask=block_mask, enable_gqa=True)
    dense = _dense(mask_mod, None, nq, nk, path.device)
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=dense,
                                                            enable_gqa=True).nan_to_num(0.0)
    assert (out.double() - want).abs().max() < 1e-5


def test_rows_that_see_nothing_output_zero(path):
    def mask_mod(b, h, q, k):
        return (q >= 50) & (k <= q)  # queries 0..49 see no key

    block_mask = flex.create_block_mask(mask_mod, None, None, 80, 80, device=path.device, BLOCK_SIZE=32)
    q, k, v = (torch.randn(1, 80, 2, 16, device=path.device, requires_grad=True) for _ in range(3))
    out, lse, _ = flashattn.flash_attn_func(q, k, v, block_mask=block_mask, return_attn_probs=True)
    assert torch.equal(out[:, :50], torch.zeros_like(out[:, :50]))
    assert torch.isneginf(lse[..., :50]).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_with_causal_and_dropout_it_is_the_intersection(path):
    def mask_mod(b, h, q, k):
        return (q // 40) != (k // 40) + 1  # every block but the one just below the diagonal band

    path.skip_if_slow(2 * 160 * 160)
    block_mask = flex.create_block_mask(mask_mod, None, None, 160, 160, device=path.device, BLOCK_SIZE=32)
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 160, 2, 16, device=path.device, requires_grad=True) for _ in range(3))
    out, dropped = with_dropout_mask(q, k, v, 0.25, {"causal": True, "block_mask": block_mask})
    dense = _dense(mask_mod, None, 160, 160, path.device)
    ref, _ = attention_ref(q, k, v, causal=True, mask=dense, dropped=dropped, dropout_p=0.25)
    assert (out.double() - ref).abs().max() < 1e-5


def test_only_partial_tiles_are_evaluated():
    """The conversion keeps a tile map and the partial tiles' element masks: for a document mask, a few tiles per
    query block, never Nq x Nk."""
    n, docs = 4096, 16
    doc = torch.arange(n) * docs // n
    block_mask = flex.create_block_mask(lambda b, h, q, k: (doc[q] == doc[k]) & (q >= k), None, None, n, n,
                                        device="cpu")
    q = torch.randn(1, n, 2, 16)
    blocks = checks.check_flash("f", q, q, q, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                block_mask=block_mask).spec.block_sparse
    kind = blocks.tile_kind
    assert kind.shape == (1, 1, n // 128, n // 128)
    partial = int((kind == 1).sum())
    assert blocks.partial_masks.shape == (partial, 128, 128)
    assert partial <= 3 * (n // 128)  # the diagonal and the document boundaries
    assert int((kind == 0).sum()) > kind.numel() // 2  # most tiles are skipped


@needs_triton
def test_triton_probabilities_follow_the_block_mask():
    """``return_attn_probs`` (dropout's S_dmask) walks the same block lists as the output: zero where the mask
    hides, the torch path's values elsewhere."""
    from conftest import GPU, INTERPRETED

    pytest.importorskip("triton")
    if not GPU and not INTERPRETED:
        pytest.skip("no GPU and TRITON_INTERPRET is not set")
    device = "cuda" if GPU else "cpu"
    mask_mod, _ = _mask_mods(96, 96, device)["document causal"]
    block_mask = flex.create_block_mask(mask_mod, None, None, 96, 96, device=device, BLOCK_SIZE=32)
    torch.manual_seed(5)
    q, k, v = (torch.randn(1, 96, 2, 16, device=device) for _ in range(3))
    probs = {}
    for backend in ("torch", "triton"):
        with flashattn.use_backend(backend):
            torch.manual_seed(6)  # the same dropout seed
            probs[backend] = flashattn.flash_attn_func(q, k, v, dropout_p=0.2, block_mask=block_mask,
                                                       return_attn_probs=True)[2]
    hidden = ~_dense(mask_mod, None, 96, 96, device)[0, 0]
    assert torch.equal(probs["triton"][..., hidden], torch.zeros_like(probs["triton"][..., hidden]))
    torch.testing.assert_close(probs["triton"], probs["torch"], atol=1e-5, rtol=1e-4)


def test_masks_that_share_block_lists_convert_apart():
    """Two hand-built masks sharing one index tensor but listing different counts are two masks (the conversion
    cache keys every list); indices past a row's count may be -1 padding, which FlexAttention never reads."""
    n, bs = 64, 16
    blocks = n // bs
    order = torch.arange(blocks, dtype=torch.int32).expand(1, 1, blocks, blocks).contiguous()
    none = torch.zeros(1, 1, blocks, dtype=torch.int32)
    every = flex.BlockMask.from_kv_blocks(none, order, torch.full((1, 1, blocks), blocks, dtype=torch.int32), order,
                                          BLOCK_SIZE=bs)
    causal_count = torch.arange(1, blocks + 1, dtype=torch.int32).view(1, 1, blocks)
    block_causal = flex.BlockMask.from_kv_blocks(none, order, causal_count, order, BLOCK_SIZE=bs)
    padded = order.masked_fill(order >= causal_count[..., None], -1)
    padded_causal = flex.BlockMask.from_kv_blocks(none, torch.zeros_like(padded), causal_count, padded,
                                                  BLOCK_SIZE=bs)
    q, k, v = (torch.randn(1, n, 2, 16, dtype=torch.float64) for _ in range(3))
    dense_causal = (torch.arange(n)[:, None] // bs) >= (torch.arange(n)[None, :] // bs)
    ref_every, _ = attention_ref(q, k, v)
    ref_causal, _ = attention_ref(q, k, v, mask=dense_causal)
    assert (flashattn.flash_attn_func(q, k, v, block_mask=every) - ref_every).abs().max() < 1e-12
    for mask in (block_causal, padded_causal):
        assert (flashattn.flash_attn_func(q, k, v, block_mask=mask) - ref_causal).abs().max() < 1e-12
    # Masks made and dropped in turn: a new count tensor may take a dead one's address, never its conversion.
    del every, block_causal, padded_causal
    for i in range(12):
        counts = causal_count if i % 2 else torch.full((1, 1, blocks), blocks, dtype=torch.int32)
        mask = flex.BlockMask.from_kv_blocks(none, order, counts.clone(), order, BLOCK_SIZE=bs)
        ref = ref_causal if i % 2 else ref_every
        assert (flashattn.flash_attn_func(q, k, v, block_mask=mask) - ref).abs().max() < 1e-12, i
        del mask


def test_blocks_the_triton_tiles_cannot_divide_go_to_the_torch_path(monkeypatch):
    monkeypatch.delenv("FLASHATTN_BACKEND", raising=False)
    odd = Request("cuda", torch.bfloat16, 64, 64, ("block mask",), mask_blocks=(24, 128))
    assert explain(odd)[0] == "torch"
    assert explain(odd._replace(mask_blocks=(64, 128)))[0] in ("triton", "torch")  # torch without triton


@pytest.mark.parametrize("make,error,match", [
    (lambda: "dense", TypeError, "BlockMask"),
    (lambda: flex.create_block_mask(lambda b, h, q, k: q >= k, None, None, 64, 64, device="cpu"), ValueError,
     r"\(Q_LEN, KV_LEN\) = \(64, 64\)"),
    (lambda: flex.create_block_mask(lambda b, h, q, k: q >= k, 3, None, 96, 96, device="cpu"), ValueError,
     r"\(B, H\) = \(3, 1\)"),
])
def test_bad_block_masks_are_named(make, error, match):
    q = torch.randn(2, 96, 4, 16)
    with pytest.raises(error, match=match):
        flashattn.flash_attn_func(q, q, q, block_mask=make())


def test_a_mask_mod_that_returns_no_booleans_is_named():
    block_mask = flex.create_block_mask(lambda b, h, q, k: q >= k, None, None, 96, 96, device="cpu")
    block_mask.mask_mod = lambda b, h, q, k: (q - k).float()
    q = torch.randn(1, 96, 2, 16)
    with pytest.raises(TypeError, match="boolean"):
        flashattn.flash_attn_func(q, q, q, block_mask=block_mask)


def test_a_mask_shared_by_layers_is_converted_once():
    """Every layer of a model passes the same BlockMask: its tiles are derived once, and again only when the
    mask changes (its mask_mod here)."""
    from flashattn.checks.block_mask import validate_block_mask

    block_mask = flex.create_block_mask(lambda b, h, q, k: q >= k, None, None, 96, 96, device="cpu", BLOCK_SIZE=32)
    q = torch.randn(1, 96, 2, 16)

    def convert():
        return validate_block_mask("f", "block_mask", block_mask, batch=1, nheads=2, nq=96, nk=96, ref=q)

    first = convert()
    assert convert() is first
    block_mask.mask_mod = lambda b, h, q, k: q > k
    changed = convert()
    assert changed is not first and not torch.equal(changed.partial_masks, first.partial_masks)


_OFFLINE = """
import dataclasses, json, torch
from torch.nn.attention.flex_attention import create_block_mask
from flashattn import checks
from flashattn.backends.spec import Saved
from flashattn.backends.triton import attend as backend
from tools.offline import compile as offline
n = 1024
doc = torch.arange(n) * 4 // n
mask = create_block_mask(lambda b, h, q, k: (doc[q] == doc[k]) & (q >= k), None, None, n, n, device="cpu")
rows = {}
for d in (64, 128):
    q = torch.zeros(1, n, 4, d, dtype=torch.bfloat16)
    spec = checks.check_flash("f", q, q, q, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                              block_mask=mask).spec
    def run():
        backend.forward(q, q, q, spec)
        backend.backward(q, None, Saved(q, q, q, q, torch.zeros(1, 4, n)), spec)
    rows.update({f"{c.name} d={d}": offline.kernel_counts(c).__dict__ for c in offline.compiled_launches(90, run)
                 if "preprocess" not in c.name})
# return_attn_probs with dropout: the probabilities loop walks the block lists too
spec = dataclasses.replace(spec, dropout_p=0.1, seed=torch.zeros(1, dtype=torch.int64))
probs = offline.compiled_launches(90, lambda: backend.forward(q, q, q, spec, return_probs=True))
print(json.dumps({"probs": [offline.kernel_counts(c).loop_spills for c in probs]}))
print(json.dumps(rows))
"""


@needs_triton
def test_triton_block_kernels_compile_for_hopper():
    """The interpreter runs the kernels as Python; the compiler is stricter (a loop-carried name may not change
    type). Compile the block-mask launches for sm_90 as a real call would (no GPU needed)."""
    import json
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _OFFLINE], capture_output=True, text=True, env=env, timeout=600,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    *_, probs, rows = (json.loads(line) for line in done.stdout.strip().splitlines())
    assert probs == {"probs": [0]}
    assert {f"attention_{k}_kernel d={d}" for k in ("forward", "backward_dkdv", "backward_dq")
            for d in (64, 128)} <= set(rows)
    for name, counts in rows.items():
        assert counts["loop_spills"] == 0 and counts["hgmma"] > 0, (name, counts)


def test_a_block_mask_works_under_inference_mode(path):
    """Serving code runs under ``torch.inference_mode()``, where the tiles derived from the mask are inference
    tensors without a version counter: they are computed each call instead of kept, with the same result as
    outside inference mode (first seen on an H200, in gpu-check's block-mask benchmark)."""
    nq = nk = 96
    mask_mod, heads = _mask_mods(nq, nk, path.device)["document causal"]
    q, k, v = (torch.randn(1, n, h, 32, device=path.device) for n, h in ((nq, 4), (nk, 2), (nk, 2)))
    block_mask = flex.create_block_mask(mask_mod, None, heads, nq, nk, device=path.device, BLOCK_SIZE=(32, 32))
    want = flashattn.flash_attn_func(q, k, v, block_mask=block_mask)
    with torch.inference_mode():
        twice = [flashattn.flash_attn_func(q, k, v, block_mask=block_mask) for _ in range(2)]
        inner = flex.create_block_mask(mask_mod, None, heads, nq, nk, device=path.device, BLOCK_SIZE=(32, 32))
        made_inside = flashattn.flash_attn_func(q, k, v, block_mask=inner)
    for got in (*twice, made_inside):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
