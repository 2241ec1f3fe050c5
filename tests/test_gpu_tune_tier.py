"""gpu-tune's ``tier`` step (``tools/gpu_tune/tier.py``): the Hopper tier's forward schedule per head dim picked
from the Gluon forward's timing beside the portable forward, written into the measured table's ``tier`` list, and
that list deciding which schedule the tier launches and whether ``FLASHATTN_TRITON_TIER=auto`` takes the tier."""

from __future__ import annotations

import json

import pytest
import torch
from triton_versions import needs_triton, recorded_on_oldest

from flashattn.backends.spec import AttentionSpec
from flashattn.backends.triton import hopper, measured
from tools.gpu_tune.runner import merge
from tools.gpu_tune.tier import pick, pick_backward

CASES = [(causal, n) for causal in (True, False) for n in (1024, 8192)]


def _rows(d: int, portable: float, **variants: list[float]) -> list[dict]:
    """gpu_run's speed rows at head dim d: the portable forward at ``portable`` TFLOP/s in every case, each
    variant at its list's speeds (None: not timed there)."""
    rows = [dict(impl="flashattn-portable", d=d, causal=c, seqlen=n, tflops=portable) for c, n in CASES]
    for name, speeds in variants.items():
        rows += [dict(impl=f"gluon {name.replace('_', '+')}", d=d, causal=c, seqlen=n, tflops=t)
                 for (c, n), t in zip(CASES, speeds, strict=True) if t is not None]
    return rows


def test_the_fastest_schedule_timed_in_every_case_is_picked():
    """The best geometric mean over the portable forward wins among the schedules timed in every case (one that
    failed a case's correctness is not timed there and cannot win); head dims other than the tiles' are left out."""
    rows = _rows(64, 100.0, pv_pingpong=[130.0, 120.0, 140.0, 110.0], qk=[200.0, 200.0, None, 200.0])
    rows += _rows(128, 100.0, pv=[90.0, 95.0, 99.0, 97.0]) + _rows(96, 100.0, pv=[150.0] * 4)
    rows.append(dict(impl="gluon pv", d=128, causal=True, seqlen=1024, error="OutOfResources"))
    entries = {e["head_dim"]: e for e in pick(rows)}
    assert sorted(entries) == [64, 128]
    assert entries[64]["schedule"] == "pv+pingpong" and entries[64]["worst"] == 1.1 and entries[64]["cases"] == 4
    assert entries[64]["vs_portable"] == pytest.approx((1.3 * 1.2 * 1.4 * 1.1) ** 0.25, abs=1e-3)
    assert entries[128]["schedule"] == "pv" and entries[128]["vs_portable"] < 1
    assert pick(_rows(64, 100.0)) == [] and pick([]) == []


def test_merge_writes_the_tier_entries_with_their_provenance(tmp_path):
    header = {"device": "NVIDIA H200", "date": "2026-11-29", "versions": {"triton": "3.6.0"}, "commit": "abc"}
    (tmp_path / "gluon.json").write_text(json.dumps({"speed": _rows(128, 100.0, pv=[110.0, 120.0, 105.0, 130.0])}))
    table = merge(tmp_path, header)
    assert table["family"] == "sm90" and table["entries"] == []
    (entry,) = table["tier"]
    assert entry["device"] == "NVIDIA H200" and entry["commit"] == "abc" and entry["schedule"] == "pv"
    assert measured.parse_tier(table)[("tier_forward", "bfloat16", 128)] == entry
    assert merge(tmp_path / "none", header)["tier"] == []  # no tier step (smoke, or not sm_90)


def test_the_backward_entry_compares_the_tiers_backward_with_the_portable_one(tmp_path):
    """``tier-backward``: flashattn-hopper's backward over flashattn's (the portable one) in every case, bf16 "bwd"
    rows only; a head dim where the tier misses a case gets no entry. Written beside the forward's entries when the
    run reached the tier (its ``gluon.json`` not skipped)."""
    def row(impl, d, causal, n, tflops, mode="bwd"):
        return dict(impl=impl, headdim=d, causal=causal, seqlen=n, mode=mode, dtype="bfloat16", tflops=tflops)

    rows = [row("flashattn", d, c, n, 100.0) for d in (64, 128) for c, n in CASES]
    rows += [row("flashattn-hopper", 128, c, n, t) for (c, n), t in zip(CASES, (150.0, 120.0, 90.0, 200.0),
                                                                         strict=True)]
    rows += [row("flashattn-hopper", 64, True, 1024, 300.0), row("flashattn-hopper", 64, False, 1024, 1.0, "fwd")]
    (entry,) = pick_backward(rows)
    assert entry["kernel"] == "tier_backward" and entry["head_dim"] == 128 and entry["worst"] == 0.9
    assert entry["vs_portable"] == pytest.approx((1.5 * 1.2 * 0.9 * 2.0) ** 0.25, abs=1e-3)
    header = {"device": "NVIDIA H200", "date": "2026-11-29", "versions": {}, "commit": "abc"}
    (tmp_path / "tier-backward.json").write_text(json.dumps({"rows": rows}))
    (tmp_path / "gluon.json").write_text(json.dumps({"skipped": "not sm_90"}))
    assert merge(tmp_path, header)["tier"] == []
    (tmp_path / "gluon.json").write_text(json.dumps({"speed": []}))
    assert [e["kernel"] for e in merge(tmp_path, header)["tier"]] == ["tier_backward"]


@pytest.mark.parametrize("entry", [{"head_dim": 96}, {"dtype": "float32"}, {"vs_portable": 0}, {"schedule": 3},
                                   {"kernel": "forward"}, {"schedule": None}])
def test_a_bad_tier_entry_is_an_error_naming_its_file(tmp_path, entry):
    good = {"kernel": "tier_forward", "dtype": "bfloat16", "head_dim": 128, "schedule": "pv", "vs_portable": 1.1,
            "worst": 1.0}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"family": "sm90", "entries": [], "tier": [{**good, **entry}]}))
    with pytest.raises(ValueError, match="measured tier entry") as e:
        measured.load_tier(folder=tmp_path / "none", extra=str(path))
    assert str(path) in str(e.value)


def _measured(tmp_path, monkeypatch, tier: list[dict]):
    """A measured file of these tier entries in force (``FLASHATTN_TRITON_MEASURED``), the tier on ``auto``; the
    caller clears ``hopper._tier_measured``'s cache when done."""
    path = tmp_path / "sm90.json"
    path.write_text(json.dumps({"family": "sm90", "entries": [], "tier": tier}))
    monkeypatch.setenv("FLASHATTN_TRITON_MEASURED", str(path))
    monkeypatch.setenv("FLASHATTN_TRITON_TIER", "auto")
    hopper._tier_measured.cache_clear()
    return path


@needs_triton
@recorded_on_oldest("the Hopper tier's Gluon kernel (Gluon's API changes between releases)")
def test_measured_tier_entries_decide_auto_and_the_launched_schedule(tmp_path, monkeypatch):
    """A measured entry overrides the built-in rule both ways (d=128 taken at 1.1x with no case below 0.98x, d=64
    declined at 0.95x) and names the schedule launched (fp16 takes bf16's; FP8 and unmeasured head dims keep
    ``forward.LAUNCHED``); a schedule that is none of the variants is an error."""
    from flashattn.backends.triton.hopper.forward import LAUNCHED, Schedule

    def entry(d, schedule, vs, worst):
        return {"kernel": "tier_forward", "dtype": "bfloat16", "head_dim": d, "schedule": schedule,
                "vs_portable": vs, "worst": worst}

    path = _measured(tmp_path, monkeypatch, [entry(128, "pv+pingpong persistent", 1.1, 0.99),
                                             entry(64, "qk", 0.95, 0.9)])
    try:
        q = torch.empty(2, 300, 4, 128, dtype=torch.bfloat16)
        spec = AttentionSpec(scale=0.125, window_right=0)
        assert hopper.declines(q, q, q, spec, probs=False, arch=90) is None
        small = q[..., :64].contiguous()
        assert hopper.declines(small, small, small, spec, probs=False, arch=90) == (
            "not measured faster than the portable forward")
        assert hopper.launched_schedule(torch.bfloat16, 128) == Schedule("pv", True, persistent=True)
        assert hopper.launched_schedule(torch.float16, 128) == Schedule("pv", True, persistent=True)
        assert hopper.launched_schedule(torch.float8_e4m3fn, 128) == LAUNCHED[128]
        assert hopper.launched_schedule(torch.bfloat16, 256) == LAUNCHED[256]
        path.write_text(json.dumps({"family": "sm90", "tier": [entry(128, "fastest", 1.1, 1.0)]}))
        hopper._tier_measured.cache_clear()
        with pytest.raises(ValueError, match="'fastest'"):
            hopper.launched_schedule(torch.bfloat16, 128)
    finally:
        hopper._tier_measured.cache_clear()


@needs_triton
@recorded_on_oldest("the Hopper tier's Gluon kernel (Gluon's API changes between releases)")
def test_a_measured_backward_entry_lets_auto_take_the_tiers_backward(tmp_path, monkeypatch):
    """``auto`` takes the tier's one-pass backward only where a ``tier_backward`` entry timed it faster: its dtype and
    head dim, dense, as many key as query heads, causal or full, not deterministic; never without an entry."""
    _measured(tmp_path, monkeypatch, [
        {"kernel": "tier_backward", "dtype": "bfloat16", "head_dim": 128, "vs_portable": 1.2, "worst": 1.05}])
    try:
        q = torch.empty(2, 300, 4, 128, dtype=torch.bfloat16)
        causal = AttentionSpec(scale=0.125, window_right=0)
        assert hopper.backward_declines(q, q, q, q, causal, arch=90) is None
        assert hopper.backward_declines(q, q, q, q, AttentionSpec(scale=0.125), arch=90) is None
        later = "the tier's backward runs under FLASHATTN_TRITON_TIER=hopper until a GPU has measured it faster"
        kv = q[:, :, :2].contiguous()
        small = q[..., :64].contiguous()
        for args, spec in (((q, kv, kv, q), causal), ((small, small, small, small), causal),
                           ((q, q, q, q), AttentionSpec(scale=0.125, deterministic=True)),
                           ((q, q, q, q), AttentionSpec(scale=0.125, window_left=64, window_right=0))):
            assert hopper.backward_declines(*args, spec, arch=90) == later
        assert hopper.backward_declines(q, q, q, q, causal, arch=80) == "not sm_90 (80)"
        monkeypatch.setenv("FLASHATTN_TRITON_TIER", "portable")
        assert hopper.backward_declines(q, q, q, q, causal, arch=90) == "FLASHATTN_TRITON_TIER=portable"
    finally:
        hopper._tier_measured.cache_clear()
