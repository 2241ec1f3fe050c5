"""The triton path's Hopper tier (``flashattn.backends.triton.hopper``): which forwards and backwards it takes
(``declines``, ``backward_declines``) and what its launchers refuse. What the calls it takes launch, compiled for
sm_90 with the launches stubbed: ``test_hopper_stubbed.py``; its results on a GPU: gpu-check (the kernel smoke and
the ``gluon`` step).
"""

from __future__ import annotations

import sys

import pytest
import torch
from triton_versions import needs_triton, recorded_on_oldest

from flashattn.backends.spec import AttentionSpec, KeyCache, Varlen
from flashattn.backends.triton import hopper

BF16 = torch.bfloat16


def _qkv(b=2, nq=300, nk=300, h=4, hk=4, d=64, dtype=BF16):
    q = torch.empty(b, nq, h, d, dtype=dtype)
    k, v = (torch.empty(b, nk, hk, d, dtype=dtype) for _ in range(2))
    return q, k, v


@pytest.fixture(autouse=True)
def _any_triton(monkeypatch):
    """The routing rule's tests hold on any Triton: the release the kernel needs is taken to be the one here."""
    from flashattn.backends.triton import installed_release

    monkeypatch.setattr(hopper, "GLUON_RELEASE", installed_release())


CAUSAL = AttentionSpec(scale=0.125, window_right=0)
FULL = AttentionSpec(scale=0.125)
BAND = "window or softcap (run by FLASHATTN_TRITON_TIER=hopper until a GPU has checked them)"


@pytest.mark.parametrize("case, why", [
    ((_qkv(), CAUSAL), None),
    ((_qkv(), FULL), None),
    ((_qkv(nq=1, nk=1025), FULL), "decode-shaped (the portable decode kernel)"),
    ((_qkv(nq=17, nk=1025), FULL), None),
    ((_qkv(nq=300, nk=100), CAUSAL), None),  # bottom-right, as the kernel aligns it
    ((_qkv(nq=300, nk=100), AttentionSpec(scale=0.125, window_right=0, bottom_right=False)), BAND),
    ((_qkv(), AttentionSpec(scale=0.125, window_right=0, bottom_right=False)), None),  # the same diagonal
    ((_qkv(), AttentionSpec(scale=0.125, window_left=64, window_right=0)), BAND),
    ((_qkv(), AttentionSpec(scale=0.125, window_right=0, diagonal_offset=128)), BAND),
    ((_qkv(), AttentionSpec(scale=0.125, softcap=30.0)), BAND),
    ((_qkv(), AttentionSpec(scale=0.125, softcap=30.0, dropout_p=0.1)), "dropout"),
    ((_qkv(), AttentionSpec(scale=0.125, dropout_p=0.1)), "dropout"),
    ((_qkv(), AttentionSpec(scale=0.125, alibi_slopes=torch.ones(4))), "alibi"),
    ((_qkv(), AttentionSpec(scale=0.125, sink=torch.zeros(4))), "sink"),
    ((_qkv(), AttentionSpec(scale=0.125, attn_mask=torch.ones(1, 1, 300, 300, dtype=torch.bool))), "mask"),
    ((_qkv(), AttentionSpec(scale=-0.125)), "scale"),
    ((_qkv(hk=2), FULL), "grouped heads (run by FLASHATTN_TRITON_TIER=hopper until a GPU has checked them)"),
    ((_qkv(hk=3), FULL), "head dims or grouped heads"),  # 3 kv heads for 4 query heads
    ((_qkv(d=128), FULL), "not measured faster than the portable forward"),
    ((_qkv(d=96), FULL), "not measured faster than the portable forward"),  # (padded: forced only)
    ((_qkv(d=100), FULL), "head dims or grouped heads"),  # not a multiple of 8: a TMA row is 16 bytes
    ((_qkv(d=264), FULL), "head dims or grouped heads"),
    ((_qkv(dtype=torch.float16), FULL), "not measured faster than the portable forward"),
    ((_qkv(dtype=torch.float32), FULL), "dtype or layout"),
])
def test_which_forwards_the_tier_takes(case, why):
    (q, k, v), spec = case
    assert hopper.declines(q, k, v, spec, probs=False, arch=90) == why


def test_which_backwards_the_tier_takes(monkeypatch):
    """The one-pass Gluon backward: forced only (FLASHATTN_TRITON_TIER=hopper), head dims that are multiples of 8 up
    to 256, key/value heads dividing the query heads, full or causal, deterministic too (dQ's atomic adds then wait
    their turn on counters: ``launch_backward``)."""
    q, k, v = _qkv()
    assert hopper.backward_declines(q, k, v, q, CAUSAL, arch=90).startswith("the tier's backward runs under")
    monkeypatch.setenv("FLASHATTN_TRITON_TIER", "hopper")
    assert hopper.backward_declines(q, k, v, q, CAUSAL, arch=90) is None
    assert hopper.backward_declines(q, k, v, q, FULL, arch=90) is None
    assert hopper.backward_declines(q, k, v, q, AttentionSpec(scale=0.125, deterministic=True), arch=90) is None
    assert hopper.backward_declines(*_qkv(d=128), _qkv(d=128)[0], FULL, arch=90) is None  # dQ's columns split
    for d in (8, 40, 96, 192):  # padded up to 64, 128, 256
        assert hopper.backward_declines(*_qkv(d=d), _qkv(d=d)[0], FULL, arch=90) is None
    assert hopper.backward_declines(*_qkv(d=60), _qkv(d=60)[0], FULL, arch=90) == "head dims or grouped heads"
    assert hopper.backward_declines(*_qkv(d=256), _qkv(d=256)[0], FULL, arch=90) is None  # backward_wide.py
    assert hopper.backward_declines(*_qkv(hk=2), q, FULL, arch=90) is None  # GQA: dK, dV summed over each group
    assert hopper.backward_declines(*_qkv(hk=3), q, FULL, arch=90) == "head dims or grouped heads"
    assert hopper.backward_declines(q, k, v, q, AttentionSpec(scale=0.125, dropout_p=0.1), arch=90) == "dropout"
    assert hopper.backward_declines(q, k, v, q.transpose(1, 2).contiguous().transpose(1, 2), FULL,
                                    arch=90).startswith("dout not contiguous")
    assert hopper.backward_declines(q, k, v, q, FULL, arch=80) == "not sm_90 (80)"


def test_the_fp8_forward_is_forced_only_and_reads_interleaved_values(monkeypatch):
    """FP8 (e4m3 q, k, v with descales): the tier's forward multiplies them on FP8 tensor cores, reading v as
    ``attend.interleaved_values`` lays it out (keys contiguous, padded to groups of 32); only under
    FLASHATTN_TRITON_TIER=hopper until a GPU has checked it, and never the FP8 training mode's calls."""
    from flashattn.backends.spec import Descale
    from flashattn.backends.triton.attend import interleaved_values

    e4m3 = torch.float8_e4m3fn
    q, k, v = (t.to(e4m3) for t in _qkv(d=128, hk=2))
    ones = torch.ones(2, 2)
    spec = AttentionSpec(scale=0.125, descale=Descale(ones, ones, ones))
    wide = interleaved_values(v)
    assert hopper.declines(q, k, wide, spec, probs=False, arch=90, values_interleaved=True) == (
        "FP8 (run by FLASHATTN_TRITON_TIER=hopper until a GPU has checked it)")
    monkeypatch.setenv("FLASHATTN_TRITON_TIER", "hopper")
    assert hopper.declines(q, k, wide, spec, probs=False, arch=90, values_interleaved=True) is None
    assert hopper.declines(q, k, wide, spec, probs=False, arch=90).startswith("FP8 without interleaved values")
    assert hopper.declines(q, k, wide[:, :-1], spec, probs=False, arch=90, values_interleaved=True) == (
        "head dims or grouped heads")  # not whole groups of 32 keys
    training = AttentionSpec(scale=0.125, descale=Descale(ones, ones, ones), fp8_training=True)
    assert hopper.declines(q, k, wide, training, probs=False, arch=90, values_interleaved=True).startswith("FP8 w")
    no_descales = AttentionSpec(scale=0.125)
    assert hopper.declines(q, k, wide, no_descales, probs=False, arch=90, values_interleaved=True).startswith("FP8 w")
    assert hopper.declines(q.bfloat16(), k, wide, spec, probs=False, arch=90, values_interleaved=True) == (
        "dtype or layout")


def test_forced_it_takes_grouped_heads(monkeypatch):
    monkeypatch.setenv("FLASHATTN_TRITON_TIER", "hopper")
    for hk in (1, 2):  # MQA, GQA
        assert hopper.declines(*_qkv(hk=hk), FULL, probs=False, arch=90) is None
    assert hopper.declines(*_qkv(hk=3), FULL, probs=False, arch=90) == "head dims or grouped heads"


def test_forced_it_takes_head_dims_between_on_padded_tiles(monkeypatch):
    """Multiples of 8 up to 256 run on tiles of 64, 128 or 256 columns (``forward.tile_dim``); FP8 at those three."""
    from flashattn.backends.spec import Descale
    from flashattn.backends.triton.attend import interleaved_values
    from flashattn.backends.triton.hopper.forward import TILE_DIMS, tile_dim

    assert hopper.TILE_DIMS == TILE_DIMS  # (the routing module's copy: it loads no Gluon)
    monkeypatch.setenv("FLASHATTN_TRITON_TIER", "hopper")
    assert [tile_dim(d) for d in (8, 40, 64, 72, 96, 136, 192, 256)] == [64, 64, 64, 128, 128, 256, 256, 256]
    for d in (8, 40, 96, 192):
        assert hopper.declines(*_qkv(d=d, hk=2), CAUSAL, probs=False, arch=90) is None
    for d in (4, 60, 100, 264):
        assert hopper.declines(*_qkv(d=d), FULL, probs=False, arch=90) == "head dims or grouped heads"
        with pytest.raises(ValueError, match=f"head dim {d} not supported"):
            tile_dim(d)
    q, k, v = (t.to(torch.float8_e4m3fn) for t in _qkv(d=96))
    ones = torch.ones(2, 4)
    spec = AttentionSpec(scale=0.125, descale=Descale(ones, ones, ones))
    assert hopper.declines(q, k, interleaved_values(v), spec, probs=False, arch=90, values_interleaved=True) == (
        "FP8 at a padded head dim")


def test_forced_it_takes_windows_and_softcaps_forward_and_backward(monkeypatch):
    """Both kernels read any band (left, right, either alignment, a diagonal offset) and a softcap."""
    monkeypatch.setenv("FLASHATTN_TRITON_TIER", "hopper")
    q, k, v = _qkv(nq=300, nk=500)
    for spec in (AttentionSpec(scale=0.125, window_left=64, window_right=0),
                 AttentionSpec(scale=0.125, window_left=100, window_right=30, bottom_right=False),
                 AttentionSpec(scale=0.125, window_right=0, diagonal_offset=-7),
                 AttentionSpec(scale=0.125, softcap=30.0),
                 AttentionSpec(scale=0.125, window_left=64, softcap=50.0)):
        assert hopper.declines(q, k, v, spec, probs=False, arch=90) is None, spec
        assert hopper.backward_declines(q, k, v, q, spec, arch=90) is None, spec
    assert hopper.backward_declines(q, k, v, q, AttentionSpec(scale=0.125, diagonal_offset=2**30), arch=90) == (
        "too large for the grid or 32-bit offsets")
    assert hopper.declines(q, k, v, AttentionSpec(scale=0.125, softcap=30.0, sink=torch.zeros(4)), probs=False,
                           arch=90) == "sink"


def test_forced_it_takes_packed_sequences_forward_and_backward(monkeypatch):
    """flash_attn_varlen_func's layout: (total, heads, d) q, k and v with their offsets, forced only until a GPU has
    checked it; decode-shaped by the longest query, not the total."""
    q, k = torch.empty(600, 4, 64, dtype=BF16), torch.empty(700, 2, 64, dtype=BF16)
    offsets = torch.tensor([0, 300, 600], dtype=torch.int32), torch.tensor([0, 350, 700], dtype=torch.int32)
    spec = AttentionSpec(scale=0.125, window_right=0, varlen=Varlen(*offsets, 300, 350))
    assert hopper.declines(q, k, k, spec, probs=False, arch=90) == (
        "packed sequences (run by FLASHATTN_TRITON_TIER=hopper until a GPU has checked them)")
    monkeypatch.setenv("FLASHATTN_TRITON_TIER", "hopper")
    assert hopper.declines(q, k, k, spec, probs=False, arch=90) is None
    short = AttentionSpec(scale=0.125, varlen=Varlen(torch.tensor([0, 1, 2], dtype=torch.int32), offsets[1], 1, 350))
    assert hopper.declines(q[:2], k, k, short, probs=False, arch=90) == "decode-shaped (the portable decode kernel)"
    assert hopper.declines(q[None], k[None], k[None], spec, probs=False, arch=90) == "dtype or layout"
    assert hopper.backward_declines(q, k, k, q, spec, arch=90) is None
    assert hopper.backward_declines(q[None], k[None], k[None], q[None], spec, arch=90) == "dtype or layout"


@needs_triton
@recorded_on_oldest("the Hopper tier's Gluon kernel (Gluon's API changes between releases)")
def test_a_side_past_every_key_is_unbounded_and_offsets_stay_32_bit(monkeypatch):
    """The kernel's band bounds are 32-bit (row + diagonal + side): a window side past every key reaches it as
    unbounded (``masking.kernel_side``), and a diagonal offset that could carry them past 2^31 is declined."""
    from flashattn.backends.triton import launch

    seen = {}
    monkeypatch.setattr(launch, "launch", lambda kernel, grid, **kwargs: seen.update(kwargs))
    q = torch.zeros(1, 300, 2, 64, dtype=BF16)
    for left, right, want in ((2**31 - 1, 100, (False, True, 0, 100)), (50, sys.maxsize, (True, False, 50, 0))):
        hopper.launch_forward(q, q, q, torch.empty_like(q), torch.empty(1, 2, 300),
                              AttentionSpec(scale=0.125, window_left=left, window_right=right))
        assert (seen["LEFT"], seen["RIGHT"], seen["window_left"], seen["window_right"]) == want
    monkeypatch.setenv("FLASHATTN_TRITON_TIER", "hopper")
    assert hopper.declines(q, q, q, AttentionSpec(scale=0.125, diagonal_offset=2**30), probs=False, arch=90) == (
        "too large for the grid or 32-bit offsets")
    assert hopper.declines(q, q, q, AttentionSpec(scale=0.125, diagonal_offset=-2**20), probs=False, arch=90) is None


def test_it_declines_what_it_cannot_read_or_address(monkeypatch):
    q, k, v = _qkv()
    assert hopper.declines(q, k, v, FULL, probs=True, arch=90) == "probabilities"
    assert hopper.declines(q, k, v, FULL, probs=False, arch=80) == "not sm_90 (80)"
    assert hopper.declines(q, k, v, FULL, probs=False, arch=0) == "not sm_90 (the interpreter)"
    assert hopper.declines(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, FULL, probs=False,
                           arch=90).startswith("not contiguous")
    shifted = torch.empty(q.numel() + 1, dtype=BF16)[1:].view(q.shape)  # 2 bytes past an aligned start
    assert hopper.declines(shifted, k, v, FULL, probs=False, arch=90).startswith("not contiguous or not 16-byte")
    wide = torch.empty(70_000, 32, 1, 64, dtype=BF16)  # batch x heads on the grid's first axis: no 65535 limit
    assert hopper.declines(wide, wide, wide, FULL, probs=False, arch=90) is None
    tall = torch.empty(1, 65535 * 128 + 1, 1, 64, dtype=BF16)  # query blocks past the second axis (never touched)
    assert hopper.declines(tall, tall, tall, FULL, probs=False, arch=90) == "too large for the grid or 32-bit offsets"
    # The backward's grid counts 64-key blocks: 65535 * 64 + 1 keys under a short query are too many.
    short, keys = torch.empty(1, 64, 1, 64, dtype=BF16), torch.empty(1, 65535 * 64 + 1, 1, 64, dtype=BF16)
    monkeypatch.setenv("FLASHATTN_TRITON_TIER", "hopper")
    assert hopper.backward_declines(short, keys, keys, short, FULL, arch=90) == (
        "too large for the grid or 32-bit offsets")
    assert hopper.backward_declines(short, keys[:, :65535 * 64], keys[:, :65535 * 64], short, FULL, arch=90) is None
    monkeypatch.delenv("FLASHATTN_TRITON_TIER")
    with monkeypatch.context() as patch:
        patch.setattr(hopper, "GLUON_RELEASE", (0, 1))  # another Triton: its Gluon is another API
        assert hopper.declines(q, k, v, FULL, probs=False, arch=90).endswith(", not (0, 1)")
    cache = AttentionSpec(scale=0.125, cache=KeyCache(None, torch.ones(2, dtype=torch.int32), max_seqlen_k=300))
    assert hopper.declines(q, k, v, cache, probs=False, arch=90) == "cache"


def test_the_backward_launcher_refuses_what_its_kernels_do_not_read():
    """``backward.launch_arguments`` is reached by ``backward_declines``'s calls and by tools that launch the kernels
    directly: a dQ sum, lse or delta of another dtype or shape, or unaligned rows, would be read wrongly."""
    from flashattn.backends.triton.hopper import backward

    q, k, v = _qkv(b=1, nq=64, nk=64, h=2, hk=2)
    stats = (torch.zeros(1, 2, 64), torch.zeros(1, 2, 64))
    grads = (torch.zeros(q.shape), torch.empty_like(k), torch.empty_like(v))
    kernel, grid, _ = backward.launch_arguments(q, k, v, q, stats, grads, causal=False, scale=0.125)
    assert kernel is backward.attention_backward_ws_kernel and grid == (2, 1)
    bad = [
        ((q, k, v, q, stats, (grads[0].bfloat16(), *grads[1:])), "dq_sum must be float32"),
        ((q, k, v, q, (stats[0][:, :1], stats[1]), grads), "neg_lse2 and delta must be float32"),
        ((q, k, v, q, (stats[0], stats[1].double()), grads), "neg_lse2 and delta must be float32"),
        ((torch.empty(q.numel() + 1, dtype=BF16)[1:].view(q.shape), k, v, q, stats, grads), "16-byte aligned"),
    ]
    q_odd, k_odd, v_odd = _qkv(b=1, nq=64, nk=64, h=2, hk=2, d=100)
    bad.append(((q_odd, k_odd, v_odd, q_odd, stats,
                 (torch.zeros(q_odd.shape), torch.empty_like(k_odd), torch.empty_like(v_odd))),
                r"head dim 100 not supported \(multiples of 8 up to 256\)"))
    for args, why in bad:
        with pytest.raises(ValueError, match=why):
            backward.launch_arguments(*args, causal=False, scale=0.125)


def test_the_environment_variable_chooses(monkeypatch):
    q, k, v = _qkv(d=128, dtype=torch.float16)
    monkeypatch.setenv("FLASHATTN_TRITON_TIER", "hopper")
    assert hopper.declines(q, k, v, FULL, probs=False, arch=90) is None  # wherever it can run
    monkeypatch.setenv("FLASHATTN_TRITON_TIER", "portable")
    assert hopper.declines(*_qkv(), FULL, probs=False, arch=90) == "FLASHATTN_TRITON_TIER=portable"
    with hopper.using("auto"):  # a tool's block: the variable set inside, the caller's back after
        assert hopper.declines(*_qkv(), FULL, probs=False, arch=90) is None
    assert hopper.tier() == "portable"
    with pytest.raises(ValueError, match="chosen='fast' is not one of"), hopper.using("fast"):
        pass
    monkeypatch.setenv("FLASHATTN_TRITON_TIER", "fast")
    with pytest.raises(ValueError, match="FLASHATTN_TRITON_TIER='fast' is not one of auto, portable, hopper"):
        hopper.declines(*_qkv(), FULL, probs=False, arch=90)



def test_gpu_checks_smoke_runs_its_calls_through_the_tier(monkeypatch):
    """gpu-check's ``tier`` case: FLASHATTN_TRITON_TIER=hopper while it runs (restored after), the smoke's grouped
    key/value heads, a sliding window with a softcap where the tier takes them (errors named "band ..."), and a
    case the tier declines is reported as declined, not run on the portable kernel."""
    import os

    from tools.gpu_check import smoke, tier_case
    from tools.gpu_check.tier_case import check_tier

    monkeypatch.setenv("FLASHATTN_TRITON_TIER", "auto")
    seen, asked = [], []

    def fwd_bwd(case, sizes, device):
        seen.append((sizes.heads_k, os.environ["FLASHATTN_TRITON_TIER"]))
        return {"out": 0.0}

    def declines(q, k, v, spec, **kw):
        asked.append(spec)
        return None

    monkeypatch.setattr(hopper, "declines", declines)
    monkeypatch.setattr(tier_case, "_check_band", lambda case, sizes, device: {"out": 0.25})
    case = smoke.Case("tier", "bfloat16", 64, True)
    assert check_tier(case, smoke.FULL, "cpu", fwd_bwd) == {"out": 0.0, "band out": 0.25}
    assert seen == [(smoke.FULL.heads_k, "hopper")] and smoke.FULL.heads_k < smoke.FULL.heads
    band = asked[1]  # the tier asked about the band the check runs: a window on the left, causal, a softcap
    assert (band.window_left, band.window_right, band.softcap) == (smoke.FULL.nk // 3, 0, tier_case.SOFTCAP)
    assert os.environ["FLASHATTN_TRITON_TIER"] == "auto"
    # With bf16, the FP8 check runs too where the tier takes FP8 (here: every call), its errors named "fp8 ...".
    fp8_runs = []
    fp8 = lambda c, s, dev: fp8_runs.append(os.environ["FLASHATTN_TRITON_TIER"]) or {"out": 0.5}  # noqa: E731
    assert check_tier(case, smoke.FULL, "cpu", fwd_bwd, fp8) == {"out": 0.0, "band out": 0.25, "fp8 out": 0.5}
    assert fp8_runs == ["hopper"]
    assert "fp8 out" not in check_tier(smoke.Case("tier", "float16", 64, True), smoke.FULL, "cpu", fwd_bwd, fp8)
    monkeypatch.setattr(hopper, "declines", lambda *a, **kw: "not sm_90 (80)")
    with pytest.raises(Exception, match="cannot run this call: not sm_90"):
        check_tier(case, smoke.FULL, "cpu", fwd_bwd)
    assert len(seen) == 3 and os.environ["FLASHATTN_TRITON_TIER"] == "auto"


def test_gpu_checks_band_case_judges_the_band_it_runs():
    """The band check itself, on the CPU path here: flash_attn_func's window and softcap and the float64 oracle's
    are the same function (a harness that disagreed with itself would fail every GPU)."""
    from tools.gpu_check import smoke
    from tools.gpu_check.tier_case import _check_band

    for causal in (True, False):
        errors = _check_band(smoke.Case("tier", "float32", 64, causal), smoke.FULL, "cpu")
        assert set(errors) == {"out", "dq", "dk", "dv"} and max(errors.values()) < 1e-4


def test_gpu_checks_tier_case_asks_the_tier_about_fp8(monkeypatch):
    """Whether the tier's FP8 forward takes the smoke's shapes: forced, on sm_90, at every head dim it runs."""
    from tools.gpu_check.tier_case import _takes_fp8

    monkeypatch.setattr(hopper, "_target_declines", lambda arch: None)  # as on an sm_90 GPU with Triton 3.6
    q, k, _ = _qkv(d=128, hk=2)
    assert not _takes_fp8(q, k, causal=True)  # auto: not until a GPU has checked it
    monkeypatch.setenv("FLASHATTN_TRITON_TIER", "hopper")
    assert _takes_fp8(q, k, causal=True) and _takes_fp8(*_qkv(d=256)[:2], causal=False)
    assert not _takes_fp8(*_qkv(d=96)[:2], causal=False)
