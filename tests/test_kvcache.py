"""flash_attn_with_kvcache and paged flash_attn_varlen_func, on every path, against an independent float64
reference per sequence: decode and prefill with and without appending, GQA/MQA, causal/window/softcap/alibi,
in-place cache appends checked bit for bit (dense, cache_batch_idx, paged), rotary in both styles, paged caches
with shuffled pages, split-KV, softmax_lse, sequences with no keys, and clear errors for bad arguments."""

from __future__ import annotations

import math

import pytest
import torch
from oracle import assert_close, attention_ref, max_err

import flashattn

# Triton's interpreter computes bfloat16 unreliably; bf16 only where a GPU runs the kernels.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


# ---------------------------------------------------------------------------------------------------------------
# The reference: the cache and the attention written out literally, one sequence at a time.


def rotate(x, cos, sin, pos, interleaved):
    """Rotary embedding of x (n, heads, d) at positions pos (n,), in x's dtype; dims past rotary_dim untouched."""
    rd = 2 * cos.shape[1]
    c = cos[pos].to(x.dtype)[:, None, :]
    s = sin[pos].to(x.dtype)[:, None, :]
    x0, x1 = (x[..., 0:rd:2], x[..., 1:rd:2]) if interleaved else (x[..., : rd // 2], x[..., rd // 2 : rd])
    r0, r1 = x0 * c - x1 * s, x0 * s + x1 * c
    rot = torch.stack([r0, r1], dim=-1).flatten(-2) if interleaved else torch.cat([r0, r1], dim=-1)
    return torch.cat([rot, x[..., rd:]], dim=-1)


def as_list(value, batch, default):
    if value is None:
        return [default] * batch
    if isinstance(value, int):
        return [value] * batch
    return [int(x) for x in value.tolist()]


def slot(b, p, block_table, cache_batch_idx, page_size):
    """Where logical position p of sequence b lives in the cache: (row or page, index)."""
    if block_table is not None:
        return int(block_table[b, p // page_size]), p % page_size
    return (b if cache_batch_idx is None else int(cache_batch_idx[b])), p


def logical(cache, b, block_table, cache_batch_idx):
    """Sequence b's whole cache, (positions, heads_k, d), in logical order."""
    if block_table is not None:
        return cache[block_table[b].long()].flatten(0, 1)
    return cache[b if cache_batch_idx is None else int(cache_batch_idx[b])]


def kvcache_ref(q, k_cache, v_cache, k=None, v=None, *, upcast=True, rotary_cos=None, rotary_sin=None,
                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None,
                **_ignored):
    """flash_attn_with_kvcache by the letter of its specification, in float64 (upcast) or the inputs' dtype.

    Takes the caches as they were before the call. Returns out (B, Nq, H, D), lse (B, H, Nq), the caches after
    the append (in the computing dtype) and a bool mask (cache.shape[:2]) of the slots the append wrote.
    """
    dtype = torch.float64 if upcast else q.dtype
    batch, sq = q.shape[:2]
    kc, vc = k_cache.to(dtype).clone(), v_cache.to(dtype).clone()
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=q.device)
    full = block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]
    seqlens = as_list(cache_seqlens, batch, full)
    leftpad = as_list(cache_leftpad, batch, 0)
    new = 0 if k is None else k.shape[1]
    per_token = causal or tuple(window_size) != (-1, -1)
    outs, lses = [], []
    for b in range(batch):
        cs, lp = seqlens[b], leftpad[b]
        qb = q[b].to(dtype)
        if rotary_cos is not None:
            # Rotary positions are cache positions (flash_attn's kernel and its test): cache_seqlens + t.
            pos = torch.arange(sq, device=q.device) * per_token + cs
            qb = rotate(qb, rotary_cos, rotary_sin, pos, rotary_interleaved)
        if k is not None:
            kb, vb = k[b].to(dtype), v[b].to(dtype)
            if rotary_cos is not None:
                pos = torch.arange(new, device=q.device) + cs
                kb = rotate(kb, rotary_cos, rotary_sin, pos, rotary_interleaved)
            for t in range(new):
                row, idx = slot(b, cs + t, block_table, cache_batch_idx, k_cache.shape[1])
                kc[row, idx], vc[row, idx] = kb[t], vb[t]
                written[row, idx] = True
        keys = logical(kc, b, block_table, cache_batch_idx)[lp : cs + new]
        vals = logical(vc, b, block_table, cache_batch_idx)[lp : cs + new]
        slopes = None if alibi_slopes is None else alibi_slopes.reshape(-1, q.shape[2]).expand(batch, -1)[b : b + 1]
        o, lse = attention_ref(qb[None], keys[None], vals[None], scale=softmax_scale, causal=causal,
                               window=window_size, softcap=softcap, alibi=slopes, upcast=upcast)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses), kc, vc, written


def check_lse(lse, ref_lse, base_lse, dtype):
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    assert not torch.isnan(lse).any(), "NaN in softmax_lse"
    finite = torch.isfinite(ref_lse)
    assert torch.isneginf(lse[~finite]).all(), "rows that see no key must have lse -inf"
    assert torch.isfinite(lse[finite]).all()
    err = max_err(lse[finite], ref_lse[finite])
    # fp32 scores are accurate to ~1e-6; in low precision the (rotated) inputs' rounding moves the scores as much
    # as it moves the same-precision baseline's.
    bound = 1e-4 if dtype == torch.float32 else 2 * max_err(base_lse[finite], ref_lse[finite]) + 2e-3
    assert err <= bound, f"softmax_lse: max error {err:.3g} > allowed {bound:.3g}"


def run_and_check(q, k_cache, v_cache, k=None, v=None, **kwargs):
    """Calls flash_attn_with_kvcache and checks out, lse and the caches (in place) against the reference."""
    k0, v0 = k_cache.clone(), v_cache.clone()
    out, lse = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, return_softmax_lse=True, **kwargs)
    ref, ref_lse, k_ref, v_ref, written = kvcache_ref(q, k0, v0, k, v, **kwargs)
    base, base_lse, *_ = kvcache_ref(q, k0, v0, k, v, upcast=False, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close("out", out, ref, base)
    check_lse(lse, ref_lse, base_lse, q.dtype)
    check_cache(k_cache, v_cache, k0, v0, k_ref, v_ref, written, rotated=kwargs.get("rotary_cos") is not None)
    return out, lse


def check_cache(k_cache, v_cache, k0, v0, k_ref, v_ref, written, rotated=False):
    """The append wrote exactly the new slots (v, and k unless rotated, bit for bit) and nothing else."""
    assert torch.equal(k_cache[~written], k0[~written]), "k_cache changed outside the appended slots"
    assert torch.equal(v_cache[~written], v0[~written]), "v_cache changed outside the appended slots"
    assert torch.equal(v_cache, v_ref.to(v_cache.dtype)), "v_cache: appended values differ"
    if not rotated:
        assert torch.equal(k_cache, k_ref.to(k_cache.dtype)), "k_cache: appended keys differ"
    else:
        # rotary computed in any precision >= the cache's, then rounded: within ~1 ulp of the magnitudes involved
        eps = torch.finfo(k_cache.dtype).eps
        scale = k_ref[written].abs().max().item() if written.any() else 0.0
        torch.testing.assert_close(k_cache[written].double(), k_ref[written].double(), rtol=eps,
                                   atol=4 * eps * (1 + scale), msg="k_cache: rotated appended keys differ")


def randn(*shape, dtype, device):
    return torch.randn(*shape, dtype=dtype, device=device)


def seqlens_arg(seqlens, device):
    return torch.tensor(seqlens, dtype=torch.int32, device=device) if isinstance(seqlens, list) else seqlens


def paged(k_cache, v_cache, page_size, spare=3):
    """The dense caches (B, S, Hk, D), S a multiple of page_size, scattered into shuffled pages among spare ones.

    Returns (k_pages, v_pages, block_table)."""
    batch, s, hk, d = k_cache.shape
    per_seq = s // page_size
    total = batch * per_seq + spare
    table = torch.randperm(total, device=k_cache.device)[: batch * per_seq].view(batch, per_seq)
    pages = []
    for cache in (k_cache, v_cache):
        p = torch.randn(total, page_size, hk, d, dtype=cache.dtype, device=cache.device)
        p[table.flatten()] = cache.reshape(batch * per_seq, page_size, hk, d)
        pages.append(p)
    return pages[0], pages[1], table.to(torch.int32)


# ---------------------------------------------------------------------------------------------------------------
# 1. Decode and prefill against the reference.

CASES = {
    "decode_append_gqa": dict(batch=3, sq=1, new=1, h=4, hk=2, d=32, s=40, seqlens=[0, 5, 39]),
    "decode_append_mqa_causal": dict(batch=2, sq=1, new=1, h=4, hk=1, d=16, s=40, seqlens=[17, 3], causal=True),
    "decode_whole_cache": dict(batch=2, sq=1, new=0, h=2, hk=2, d=32, s=33, seqlens=None),
    "decode_int_seqlens": dict(batch=2, sq=1, new=0, h=4, hk=2, d=16, s=40, seqlens=25),
    "prefill_append_causal_int": dict(batch=2, sq=7, new=7, h=4, hk=2, d=32, s=40, seqlens=10, causal=True),
    "prefill_append_window_softcap_alibi": dict(batch=3, sq=5, new=5, h=4, hk=2, d=16, s=40, seqlens=[0, 9, 30],
                                                window_size=(6, 2), softcap=1.5, alibi=True, softmax_scale=0.3),
    "prefill_short_cache_causal": dict(batch=2, sq=9, new=0, h=2, hk=1, d=16, s=30, seqlens=[4, 20], causal=True),
    "q_and_new_lengths_differ": dict(batch=2, sq=3, new=5, h=4, hk=2, d=16, s=40, seqlens=[0, 30], causal=True),
    "prefill_append_noncausal_mqa": dict(batch=2, sq=6, new=6, h=4, hk=1, d=32, s=40, seqlens=[3, 0]),
}
SHAPE_KEYS = ("batch", "sq", "new", "h", "hk", "d", "s", "seqlens", "alibi")


def build(case, dtype, device):
    c = CASES[case] if isinstance(case, str) else case
    q = randn(c["batch"], c["sq"], c["h"], c["d"], dtype=dtype, device=device)
    k_cache, v_cache = (randn(c["batch"], c["s"], c["hk"], c["d"], dtype=dtype, device=device) for _ in range(2))
    k = v = None
    if c["new"]:
        k, v = (randn(c["batch"], c["new"], c["hk"], c["d"], dtype=dtype, device=device) for _ in range(2))
    kwargs = {key: val for key, val in c.items() if key not in SHAPE_KEYS}
    if c.get("alibi"):
        kwargs["alibi_slopes"] = torch.rand(c["batch"], c["h"], device=device) * 0.3
    if c["seqlens"] is not None:
        kwargs["cache_seqlens"] = seqlens_arg(c["seqlens"], device)
    return q, k_cache, v_cache, k, v, kwargs


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_decode_and_prefill_match_the_reference(path, case, dtype):
    q, k_cache, v_cache, k, v, kwargs = build(case, dtype, path.device)
    run_and_check(q, k_cache, v_cache, k, v, **kwargs)


def test_plain_call_returns_only_out(path):
    q, k_cache, v_cache, k, v, kwargs = build("prefill_append_causal_int", torch.float32, path.device)
    k0, v0 = k_cache.clone(), v_cache.clone()
    out = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kwargs)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    ref, _, *_ = kvcache_ref(q, k0, v0, k, v, **kwargs)
    assert_close("out", out, ref, ref)


# ---------------------------------------------------------------------------------------------------------------
# 2. The append: exactly the new slots, in every cache layout.

LAYOUTS = ["dense", "cache_batch_idx", "paged"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_append_writes_exactly_the_new_slots(path, layout, dtype):
    device = path.device
    batch, sq, new, h, hk, d, s = 3, 4, 4, 4, 2, 16, 24
    seqlens = torch.tensor([0, 11, 20], dtype=torch.int32, device=device)
    q = randn(batch, sq, h, d, dtype=dtype, device=device)
    k, v = (randn(batch, new, hk, d, dtype=dtype, device=device) for _ in range(2))
    kwargs = {"cache_seqlens": seqlens, "causal": True}
    if layout == "cache_batch_idx":
        # more cache rows than sequences, used in a shuffled order
        k_cache, v_cache = (randn(batch + 2, s, hk, d, dtype=dtype, device=device) for _ in range(2))
        kwargs["cache_batch_idx"] = torch.randperm(batch + 2, device=device)[:batch].to(torch.int32)
    else:
        k_cache, v_cache = (randn(batch, s, hk, d, dtype=dtype, device=device) for _ in range(2))
    if layout == "paged":
        k_cache, v_cache, kwargs["block_table"] = paged(k_cache, v_cache, page_size=8)
    run_and_check(q, k_cache, v_cache, k, v, **kwargs)


def test_cache_batch_idx_reads_the_chosen_rows(path):
    """Each sequence attends its own cache row, whatever the order: same output as the rows gathered densely."""
    device = path.device
    q = randn(2, 3, 2, 16, dtype=torch.float32, device=device)
    k_cache, v_cache = (randn(4, 20, 2, 16, dtype=torch.float32, device=device) for _ in range(2))
    idx = torch.tensor([3, 1], dtype=torch.int32, device=device)
    seqlens = torch.tensor([20, 9], dtype=torch.int32, device=device)
    out = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, cache_batch_idx=idx)
    dense = flashattn.flash_attn_with_kvcache(q, k_cache[idx.long()], v_cache[idx.long()], cache_seqlens=seqlens)
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)


def test_strided_index_tensors_read_as_their_values(path):
    """Lengths, left padding and cache rows that are strided views (every other element of a buffer) give the call
    of their values: the kernels read them without a stride, so the checks hand them copies."""
    device = path.device
    q = randn(2, 1, 2, 16, dtype=torch.float32, device=device)
    k_cache, v_cache = (randn(4, 20, 2, 16, dtype=torch.float32, device=device) for _ in range(2))

    def strided(*values):
        return torch.tensor([x for v in values for x in (v, -7)], dtype=torch.int32, device=device)[::2]

    given = {"cache_seqlens": (20, 9), "cache_leftpad": (2, 0), "cache_batch_idx": (3, 1)}
    out = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, **{n: strided(*v) for n, v in given.items()})
    want = flashattn.flash_attn_with_kvcache(
        q, k_cache, v_cache, **{n: torch.tensor(v, dtype=torch.int32, device=device) for n, v in given.items()})
    torch.testing.assert_close(out, want, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# 3. Rotary embeddings.


def rotary_tables(seqlen_ro, rotary_dim, dtype, device):
    angle = torch.rand(seqlen_ro, rotary_dim // 2, device=device, dtype=torch.float64) * 2 * math.pi
    return angle.cos().to(dtype), angle.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("mode", ["noncausal", "causal", "window"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
def test_rotary_with_leftpad(path, interleaved, mode, dtype):
    device = path.device
    batch, sq, new, h, hk, d, s = 3, 3, 3, 4, 2, 32, 32
    rotary_dim = 16 if interleaved else 32 - 8 * (mode == "window")  # < headdim, and == headdim once
    q = randn(batch, sq, h, d, dtype=dtype, device=device)
    k, v = (randn(batch, new, hk, d, dtype=dtype, device=device) for _ in range(2))
    k_cache, v_cache = (randn(batch, s, hk, d, dtype=dtype, device=device) for _ in range(2))
    cos, sin = rotary_tables(s, rotary_dim, dtype, device)
    kwargs = {
        "cache_seqlens": torch.tensor([5, 20, 9], dtype=torch.int32, device=device),
        "cache_leftpad": torch.tensor([2, 0, 9], dtype=torch.int32, device=device),
        "rotary_cos": cos, "rotary_sin": sin, "rotary_interleaved": interleaved,
        "causal": mode == "causal", "window_size": (4, 1) if mode == "window" else (-1, -1),
    }
    run_and_check(q, k_cache, v_cache, k, v, **kwargs)


def test_rotary_positions_are_not_a_no_op(path):
    """Guards the reference itself: q rotated at the cache length, not at 0, changes the result."""
    device = path.device
    q = randn(1, 1, 2, 16, dtype=torch.float32, device=device)
    k, v = (randn(1, 1, 2, 16, dtype=torch.float32, device=device) for _ in range(2))
    k_cache, v_cache = (randn(1, 16, 2, 16, dtype=torch.float32, device=device) for _ in range(2))
    cos, sin = rotary_tables(16, 16, torch.float32, device)
    kwargs = {"cache_seqlens": 7, "rotary_cos": cos, "rotary_sin": sin}
    out, _ = run_and_check(q, k_cache.clone(), v_cache.clone(), k, v, **kwargs)
    unrotated, *_ = kvcache_ref(q, k_cache, v_cache, k, v, cache_seqlens=7)
    assert max_err(out, unrotated) > 1e-3


# ---------------------------------------------------------------------------------------------------------------
# 4. Paged caches: shuffled pages give the dense result.

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("page_size", [1, 3, 16, 256])
def test_paged_equals_dense(path, page_size, dtype):
    if page_size == 256 and path.interpreted:
        pytest.skip("too slow under Triton's interpreter")
    device = path.device
    batch, sq, new, h, hk, d = 3, 2, 2, 4, 2, 16
    per_seq = max(1, 48 // page_size) if page_size < 256 else 2
    s = per_seq * page_size
    seqlens = torch.tensor([0, s // 2 - 1, s - new], dtype=torch.int32, device=device)
    q = randn(batch, sq, h, d, dtype=dtype, device=device)
    k, v = (randn(batch, new, hk, d, dtype=dtype, device=device) for _ in range(2))
    k_dense, v_dense = (randn(batch, s, hk, d, dtype=dtype, device=device) for _ in range(2))
    k_pages, v_pages, table = paged(k_dense, v_dense, page_size)
    kwargs = {"cache_seqlens": seqlens, "causal": True}
    dense_out, dense_lse = flashattn.flash_attn_with_kvcache(q, k_dense, v_dense, k, v, return_softmax_lse=True,
                                                             **kwargs)
    paged_out, paged_lse = run_and_check(q, k_pages, v_pages, k, v, block_table=table, **kwargs)
    # the paged caches now hold the dense caches' contents, the spare pages untouched
    torch.testing.assert_close(paged_out, dense_out, rtol=0, atol=2e-5 if dtype == torch.float32 else 2e-3)
    torch.testing.assert_close(paged_lse, dense_lse, rtol=0, atol=2e-5)
    for pages, dense in ((k_pages, k_dense), (v_pages, v_dense)):
        assert torch.equal(pages[table.long()].flatten(1, 2), dense)


def test_paged_whole_table_without_seqlens(path):
    """Without cache_seqlens a paged cache is as long as its block table: block_table.shape[1] * page_size."""
    device = path.device
    q = randn(2, 2, 2, 16, dtype=torch.float32, device=device)
    k_dense, v_dense = (randn(2, 15, 2, 16, dtype=torch.float32, device=device) for _ in range(2))
    k_pages, v_pages, table = paged(k_dense, v_dense, page_size=5)
    run_and_check(q, k_pages, v_pages, block_table=table, causal=True)


# ---------------------------------------------------------------------------------------------------------------
# 5. Split-KV: any number of splits merges to the unsplit result.


@pytest.mark.parametrize("layout", ["dense_causal", "paged_window"])
def test_num_splits_match_unsplit(path, layout):
    device = path.device
    batch, sq, new, h, hk, d, s = 2, 3, 3, 4, 2, 16, 60
    q = randn(batch, sq, h, d, dtype=torch.float32, device=device)
    k, v = (randn(batch, new, hk, d, dtype=torch.float32, device=device) for _ in range(2))
    k_cache, v_cache = (randn(batch, s, hk, d, dtype=torch.float32, device=device) for _ in range(2))
    kwargs = {"cache_seqlens": torch.tensor([57, 4], dtype=torch.int32, device=device)}
    if layout == "dense_causal":
        kwargs["causal"] = True
    else:
        k_cache, v_cache, kwargs["block_table"] = paged(k_cache, v_cache, page_size=4)
        kwargs.update(window_size=(20, 0), softcap=2.0)
    results = {}
    for splits in (1, 0, 2, 3, 7, 64):
        kc, vc = k_cache.clone(), v_cache.clone()
        results[splits] = run_and_check(q, kc, vc, k, v, num_splits=splits, **kwargs)
    for splits, (out, lse) in results.items():
        torch.testing.assert_close(out, results[1][0], rtol=1e-5, atol=1e-5, msg=f"num_splits={splits}")
        torch.testing.assert_close(lse, results[1][1], rtol=1e-5, atol=1e-5, msg=f"num_splits={splits}")


def test_num_splits_low_precision(path):
    q, k_cache, v_cache, k, v, kwargs = build("prefill_append_window_softcap_alibi", torch.float16, path.device)
    for splits in (2, 5):
        run_and_check(q, k_cache.clone(), v_cache.clone(), k, v, num_splits=splits, **kwargs)


@pytest.mark.parametrize("path", ["triton"], indirect=True)
def test_a_split_launch_merges_in_place_and_leaves_its_counters_at_zero(path):
    """Split-KV merges in the forward launch itself: the program of each query block that finishes last merges the
    splits and sets the block's arrival counter back to zero, so the next launch in the stream finds them all zero
    (a counter left behind would leave that block unmerged in every later launch)."""
    from flashattn.backends.triton.tickets import tickets

    q, k_cache, v_cache, k, v, kwargs = build("prefill_append_window_softcap_alibi", torch.float32, path.device)
    for splits in (3, 3, 5):  # the same launch twice, then another grid
        run_and_check(q, k_cache.clone(), v_cache.clone(), k, v, num_splits=splits, **kwargs)
        counters = tickets(q.device, 1)
        assert counters.numel() >= 1024 and not counters.any()


# ---------------------------------------------------------------------------------------------------------------
# 6./7. softmax_lse, and sequences that see no key.


def test_lse_is_the_logsumexp_of_the_scaled_scores(path):
    device = path.device
    q = randn(2, 4, 2, 16, dtype=torch.float32, device=device) * 2
    k_cache, v_cache = (randn(2, 30, 2, 16, dtype=torch.float32, device=device) for _ in range(2))
    seqlens = torch.tensor([30, 13], dtype=torch.int32, device=device)
    _, lse = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, softmax_scale=0.4,
                                               causal=True, return_softmax_lse=True)
    assert lse.shape == (2, 2, 4) and lse.dtype == torch.float32
    for b, n in enumerate(seqlens.tolist()):
        s = torch.einsum("qhd,khd->hqk", q[b].double(), k_cache[b, :n].double()) * 0.4
        visible = torch.arange(n, device=device)[None, :] <= torch.arange(4, device=device)[:, None] + n - 4
        expected = s.masked_fill(~visible, -math.inf).logsumexp(-1)
        torch.testing.assert_close(lse[b].double(), expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_sequence_with_no_keys(path, dtype):
    """Left padding that swallows a whole cache (L_b = 0): out 0, lse -inf, no NaN; the other sequences intact."""
    device = path.device
    q = randn(3, 2, 4, 16, dtype=dtype, device=device)
    k_cache, v_cache = (randn(3, 20, 2, 16, dtype=dtype, device=device) for _ in range(2))
    kwargs = {"cache_seqlens": torch.tensor([6, 20, 0], dtype=torch.int32, device=device),
              "cache_leftpad": torch.tensor([6, 3, 0], dtype=torch.int32, device=device), "causal": True}
    out, lse = run_and_check(q, k_cache, v_cache, **kwargs)
    for b in (0, 2):
        assert not out[b].any() and torch.isneginf(lse[b]).all()
    assert torch.isfinite(lse[1]).all()


# ---------------------------------------------------------------------------------------------------------------
# 8. Bad arguments get clear errors.


def bad_args():
    q = torch.randn(2, 1, 4, 16)
    k_cache, v_cache = torch.randn(2, 10, 2, 16), torch.randn(2, 10, 2, 16)
    k, v = torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    seqlens = torch.tensor([3, 4], dtype=torch.int32)
    cos = torch.randn(10, 4)
    base = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "cache_seqlens": seqlens}
    return [
        ("k_without_v", {**base, "v": None}, r"\bv\b"),
        ("k_without_seqlens", {**base, "cache_seqlens": None}, "cache_seqlens"),
        ("int64_seqlens", {**base, "cache_seqlens": seqlens.long()}, "cache_seqlens"),
        ("rotary_cos_without_sin", {**base, "rotary_cos": cos}, "rotary_sin"),
        ("rotary_too_wide", {**base, "rotary_cos": torch.randn(10, 9), "rotary_sin": torch.randn(10, 9)}, "rotary"),
        ("headdim_mismatch", {**base, "k_cache": torch.randn(2, 10, 2, 8), "v_cache": torch.randn(2, 10, 2, 8),
                              "k": None, "v": None}, "k_cache|head"),
        ("heads_not_divisible", {**base, "q": torch.randn(2, 1, 3, 16)}, "head"),
        ("block_table_with_batch_idx", {**base, "block_table": torch.zeros(2, 2, dtype=torch.int32),
                                        "k_cache": torch.randn(4, 5, 2, 16), "v_cache": torch.randn(4, 5, 2, 16),
                                        "cache_batch_idx": torch.tensor([0, 1], dtype=torch.int32)},
         "cache_batch_idx|block_table"),
        ("cache_fewer_rows_than_batch", {**base, "k_cache": torch.randn(1, 10, 2, 16),
                                         "v_cache": torch.randn(1, 10, 2, 16)}, "at least batch rows"),
        ("int64_block_table", {**base, "block_table": torch.zeros(2, 2, dtype=torch.int64),
                               "k_cache": torch.randn(4, 5, 2, 16), "v_cache": torch.randn(4, 5, 2, 16)},
         "block_table"),
        # Past what its block_table row can hold (flash_attn's own test matches "block_table" here): one page of 5.
        ("paged_cache_overflow", {**base, "block_table": torch.zeros(2, 1, dtype=torch.int32), "cache_seqlens":
                                  torch.tensor([5, 2], dtype=torch.int32), "k_cache": torch.randn(4, 5, 2, 16),
                                  "v_cache": torch.randn(4, 5, 2, 16)},
         r"cache_seqlens\[0\] = 5 plus 1 new keys does not fit the 5 positions its block_table row gives it "
         r"\(1 page of 5\)"),
    ]


@pytest.mark.parametrize("index", range(len(bad_args())), ids=[name for name, _, _ in bad_args()])
def test_bad_arguments_get_clear_errors(index):
    _, args, message = bad_args()[index]
    with pytest.raises((ValueError, TypeError), match=message):
        flashattn.flash_attn_with_kvcache(**args)


def test_cache_with_more_rows_than_batch_uses_the_first_rows(path):
    """A preallocated cache for 5 sequences serving 3: sequence b uses row b, as in flash_attn."""
    device = path.device
    q = randn(3, 1, 4, 16, dtype=torch.float32, device=device)
    k, v = (randn(3, 1, 2, 16, dtype=torch.float32, device=device) for _ in range(2))
    k_cache, v_cache = (randn(5, 12, 2, 16, dtype=torch.float32, device=device) for _ in range(2))
    seqlens = torch.tensor([4, 0, 11], dtype=torch.int32, device=device)
    k_rows, v_rows = k_cache[:3].clone(), v_cache[:3].clone()
    spare_k, spare_v = k_cache[3:].clone(), v_cache[3:].clone()
    out = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True)
    want = flashattn.flash_attn_with_kvcache(q, k_rows, v_rows, k, v, cache_seqlens=seqlens, causal=True)
    assert torch.equal(out, want)
    assert torch.equal(k_cache[:3], k_rows) and torch.equal(v_cache[:3], v_rows)
    assert torch.equal(k_cache[3:], spare_k) and torch.equal(v_cache[3:], spare_v)


# ---------------------------------------------------------------------------------------------------------------
# 9. Paged flash_attn_varlen_func.

VARLEN_FEATURES = {"plain": {}, "causal": {"causal": True},
                   "window_softcap_alibi": {"window_size": (5, 1), "softcap": 1.5, "alibi": True}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("feature", VARLEN_FEATURES)
@pytest.mark.parametrize("page_size", [1, 3])
def test_paged_varlen_matches_dense_varlen(path, page_size, feature, dtype):
    device = path.device
    lq, lk = [5, 0, 12, 1], [9, 3, 17, 1]
    batch, h, hk, d = len(lq), 4, 2, 16
    per_seq = -(-max(lk) // page_size) + 1  # a spare table column, pointing at random pages
    num_pages = batch * per_seq + 2
    k_pages, v_pages = (randn(num_pages, page_size, hk, d, dtype=dtype, device=device) for _ in range(2))
    table = torch.randperm(num_pages, device=device)[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=device)
                  for n in (lq, lk))
    q = randn(sum(lq), h, d, dtype=dtype, device=device)
    k = torch.cat([k_pages[table[b].long()].flatten(0, 1)[:n] for b, n in enumerate(lk)])
    v = torch.cat([v_pages[table[b].long()].flatten(0, 1)[:n] for b, n in enumerate(lk)])
    kwargs = dict(VARLEN_FEATURES[feature])
    alibi = torch.rand(batch, h, device=device) * 0.3 if kwargs.pop("alibi", False) else None
    k0, v0 = k_pages.clone(), v_pages.clone()
    out = flashattn.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max(lq), max(lk), alibi_slopes=alibi,
                                           block_table=table, **kwargs)
    dense = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), alibi_slopes=alibi, **kwargs)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.equal(k_pages, k0) and torch.equal(v_pages, v0)
    torch.testing.assert_close(out, dense, rtol=0, atol=2e-5 if dtype == torch.float32 else 2e-3)
    oracle = {"causal": kwargs.get("causal", False), "window": kwargs.get("window_size", (-1, -1)),
              "softcap": kwargs.get("softcap", 0.0)}
    for b in range(batch):
        sq, eq, sk, ek = cu_q[b].item(), cu_q[b + 1].item(), cu_k[b].item(), cu_k[b + 1].item()
        if eq == sq:
            continue
        slopes = None if alibi is None else alibi[b : b + 1]
        ref, _ = attention_ref(q[None, sq:eq], k[None, sk:ek], v[None, sk:ek], alibi=slopes, **oracle)
        base, _ = attention_ref(q[None, sq:eq], k[None, sk:ek], v[None, sk:ek], alibi=slopes, upcast=False, **oracle)
        assert_close(f"out[{b}]", out[sq:eq], ref[0], base[0])


def test_paged_varlen_runs_with_grad_to_q_only(path):
    """As in flash_attn, a paged K/V runs with a q that requires grad: the gradient reaches q; the cache gets none,
    and asking for it fails when the backward runs, with a clear message. Dropout and probabilities are refused."""
    device = path.device
    cu = torch.tensor([0, 3, 7], dtype=torch.int32, device=device)
    q = randn(7, 2, 16, dtype=torch.float32, device=device)
    k_pages, v_pages = (randn(6, 2, 2, 16, dtype=torch.float32, device=device) for _ in range(2))
    table = torch.tensor([[4, 0, 1], [5, 2, 3]], dtype=torch.int32, device=device)
    args = (cu, cu, 4, 4)
    dout = torch.randn_like(q)
    with pytest.raises(ValueError, match="block_table|dropout"):
        flashattn.flash_attn_varlen_func(q.detach(), k_pages, v_pages, *args, dropout_p=0.1, block_table=table)
    q_grad = q.detach().requires_grad_()
    out = flashattn.flash_attn_varlen_func(q_grad, k_pages, v_pages, *args, block_table=table)
    (dq,) = torch.autograd.grad(out, q_grad, dout)
    k_grad = k_pages.detach().requires_grad_()
    out_k = flashattn.flash_attn_varlen_func(q.detach(), k_grad, v_pages, *args, block_table=table)
    with pytest.raises(RuntimeError, match="paged K/V .* receives no gradient"):
        out_k.sum().backward()
    for b in range(2):
        start, end = cu[b].item(), cu[b + 1].item()
        keys, vals = (t[table[b].long()].flatten(0, 1)[: end - start] for t in (k_pages, v_pages))
        q_ref = q.detach()[None, start:end].double().requires_grad_()
        ref, _ = attention_ref(q_ref, keys[None], vals[None])
        base, _ = attention_ref(q.detach()[None, start:end], keys[None], vals[None], upcast=False)
        assert_close(f"out[{b}]", out[start:end], ref[0], base[0])
        (dq_ref,) = torch.autograd.grad(ref, q_ref, dout[None, start:end].double())
        torch.testing.assert_close(dq[start:end].double(), dq_ref[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_every_output_element_is_written(path, num_splits, poisoned):
    """Outputs are allocated NaN-poisoned: an element a path forgets to write (a split with no keys, a sequence
    with none, the GQA decode rows) shows up as NaN."""
    device = path.device
    q = torch.randn(3, 1, 4, 16, device=device)
    k_cache, v_cache = (torch.randn(3, 40, 2, 16, device=device) for _ in range(2))
    lengths = torch.tensor([0, 40, 7], dtype=torch.int32, device=device)
    out, lse = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True,
                                                 num_splits=num_splits, return_softmax_lse=True)
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[0] == 0).all() and (lse[0] == -math.inf).all()
