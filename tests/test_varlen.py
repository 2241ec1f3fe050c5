"""flash_attn_varlen_*: packed batches of different lengths on every path, against the float64 oracle per sequence;
dropout identical across paths; clear errors for bad offsets."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_close, attention_ref

import flashattn

# (query lengths, key lengths): empty and single-token sequences, q and k lengths that differ.
LENGTHS = [([5, 0, 17, 1], [9, 3, 17, 1]), ([33], [20]), ([1, 12], [30, 12])]
FEATURES = {
    "plain": {},
    "causal": {"causal": True},
    "window_softcap_alibi": {"window_size": (6, 2), "softcap": 1.5, "alibi": True},
}


def packed(lengths_q, lengths_k, h, hk, d, dtype, device):
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=device)
          for n in (lengths_q, lengths_k)]
    q = torch.randn(sum(lengths_q), h, d, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.randn(sum(lengths_k), hk, d, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    return q, k, v, cu[0], cu[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda x: "-".join(map(str, x[0])))
def test_each_sequence_matches_the_oracle(path, lengths, feature, dtype):
    lq, lk = lengths
    h, hk, d, batch = 4, 2, 24, len(lq)
    q, k, v, cu_q, cu_k = packed(lq, lk, h, hk, d, dtype, path.device)
    kwargs = dict(FEATURES[feature])
    alibi = torch.rand(batch, h, device=q.device) * 0.3 if kwargs.pop("alibi", False) else None
    out, lse, _ = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), alibi_slopes=alibi,
                                                   return_attn_probs=True, **kwargs)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    assert out.shape == (sum(lq), h, d) and lse.shape == (h, sum(lq))
    oracle = {"causal": kwargs.get("causal", False), "window": kwargs.get("window_size", (-1, -1)),
              "softcap": kwargs.get("softcap", 0.0)}
    for i in range(batch):
        sq, eq, sk, ek = cu_q[i].item(), cu_q[i + 1].item(), cu_k[i].item(), cu_k[i + 1].item()
        if eq == sq:
            continue
        qi, ki, vi = (t.detach()[None, s:e].requires_grad_() for t, s, e in ((q, sq, eq), (k, sk, ek), (v, sk, ek)))
        slopes = None if alibi is None else alibi[i : i + 1]
        ref, ref_lse = attention_ref(qi, ki, vi, alibi=slopes, **oracle)
        base, _ = attention_ref(qi, ki, vi, alibi=slopes, upcast=False, **oracle)
        assert_close(f"out[{i}]", out[sq:eq], ref[0], base[0])
        finite = torch.isfinite(ref_lse[0])
        assert torch.isneginf(lse[:, sq:eq][~finite]).all()
        torch.testing.assert_close(lse[:, sq:eq][finite].double(), ref_lse[0][finite], rtol=2e-3, atol=2e-3)
        gi = g[None, sq:eq]
        ref_g = torch.autograd.grad(ref, (qi, ki, vi), gi.double())
        base_g = torch.autograd.grad(base, (qi, ki, vi), gi)
        magnitude = max(r.abs().max().item() if r.numel() else 0.0 for r in ref_g)
        for name, x, r, bl in zip(("dq", "dk", "dv"), (grads[0][sq:eq], grads[1][sk:ek], grads[2][sk:ek]), ref_g,
                                  base_g, strict=True):
            assert_close(f"{name}[{i}]", x, r[0], bl[0], factor=3.0, magnitude=magnitude)
    # keys of a sequence with no queries get no gradient
    empty = [i for i in range(batch) if lq[i] == 0]
    for i in empty:
        assert not grads[1][cu_k[i] : cu_k[i + 1]].any()


def test_dropout_is_identical_on_every_path(path):
    """The same weights dropped as on the torch path (its S_dmask), the same outputs and gradients."""
    lq, lk = [7, 0, 20], [9, 4, 20]
    q, k, v, cu_q, cu_k = packed(lq, lk, 2, 2, 16, torch.float32, path.device)
    results = {}
    for name in (path.name, "torch"):
        torch.manual_seed(3)
        with flashattn.use_backend(name):
            out, _, probs = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 20, dropout_p=0.3, causal=True,
                                                             return_attn_probs=True)
            torch.manual_seed(3)
            again = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 20, dropout_p=0.3, causal=True)
        results[name] = probs, out, again, *torch.autograd.grad(again, (q, k, v), torch.ones_like(again))
    visible = results["torch"][0] != 0
    assert torch.equal(torch.signbit(results["torch"][0])[visible], torch.signbit(results[path.name][0])[visible])
    for a, b in zip(results[path.name][1:], results["torch"][1:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_packed_variants_agree(path):
    q, k, v, cu, _ = packed([3, 8], [3, 8], 2, 2, 16, torch.float32, path.device)
    base = flashattn.flash_attn_varlen_func(q, k, v, cu, cu, 8, 8, causal=True)
    qkv = torch.stack([q, k, v], dim=1)
    torch.testing.assert_close(flashattn.flash_attn_varlen_qkvpacked_func(qkv, cu, 8, causal=True), base)
    kv = torch.stack([k, v], dim=1)
    torch.testing.assert_close(flashattn.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 8, 8, causal=True), base)


def test_strided_offsets_read_as_their_values(path):
    """Offsets that are a strided view (every other element of a buffer) give the call of their values: the kernels
    read the offsets without a stride, so the checks hand them a copy."""
    q, k, v, cu, _ = packed([3, 8], [3, 8], 2, 2, 16, torch.float32, path.device)
    strided = torch.stack([cu, torch.full_like(cu, 99)], dim=1).flatten()[::2]
    assert strided.stride() == (2,) and strided.tolist() == cu.tolist()
    torch.testing.assert_close(flashattn.flash_attn_varlen_func(q, k, v, strided, strided, 8, 8, causal=True),
                               flashattn.flash_attn_varlen_func(q, k, v, cu, cu, 8, 8, causal=True))


BAD = [
    ({"cu_seqlens_q": torch.tensor([0, 3, 10])}, TypeError, "cu_seqlens_q must have dtype torch.int32"),
    ({"cu_seqlens_q": torch.tensor([0, 6, 4, 10], dtype=torch.int32)}, ValueError, "must be non-decreasing"),
    ({"cu_seqlens_q": torch.tensor([1, 3, 10], dtype=torch.int32)}, ValueError, "must start at 0"),
    ({"cu_seqlens_k": torch.tensor([0, 3, 9], dtype=torch.int32)}, ValueError, r"cu_seqlens_k\[-1\] = 9 must equal"),
    ({"cu_seqlens_k": torch.tensor([0, 10], dtype=torch.int32)}, ValueError, "same batch"),
    ({"max_seqlen_q": 5}, ValueError, "max_seqlen_q = 5 is smaller than the longest sequence, 7"),
    ({"block_table": torch.zeros(2, 1, dtype=torch.int32)}, ValueError, "block_table"),
    ({"q": torch.randn(2, 10, 4, 16)}, ValueError, "q must have 3 dimensions"),
]


@pytest.mark.parametrize("overrides,error,message", BAD, ids=lambda x: None)
def test_bad_offsets_get_clear_errors(overrides, error, message):
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    args = {"q": torch.randn(10, 4, 16), "k": torch.randn(10, 2, 16), "v": torch.randn(10, 2, 16),
            "cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": 7, "max_seqlen_k": 7, **overrides}
    with pytest.raises(error, match=message):
        flashattn.flash_attn_varlen_func(**args)
