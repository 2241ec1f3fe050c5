"""``python -m tools.gluon.gpu_run``, gpu-check's ``gluon`` step: the Gluon forward's correctness on a Hopper GPU
before its timing. Without a GPU its harness runs with plain attention in the kernel's place (``--dry``): a wrong
kernel must be reported wrong, a stopped run must keep what it measured, gpu-check must summarise it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from triton_versions import needs_triton, recorded_on_oldest

ROOT = Path(__file__).resolve().parents[1]


def needs_gluon(test):
    """The harness reads the schedules from the Hopper tier's kernel module, written against Gluon's 3.6 API."""
    recorded = recorded_on_oldest("the experimental Gluon forward (Gluon's API changes between releases)")
    return needs_triton(recorded(test))


def _dry_run(out: Path) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "tools.gluon.gpu_run", "--dry", "--jobs", "2", "--out", str(out),
                           "--budget", "120"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)


@needs_gluon
def test_dry_run_checks_then_times_and_writes_its_results(tmp_path):
    done = _dry_run(tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "gluon.json").read_text())
    assert len(report["correctness"]) == 3 and all(r["ok"] for r in report["correctness"].values())
    assert "backward-d64-full" in report["correctness"]  # the tier's backward kernels, after the forward's
    shapes = [c["shape"] for c in next(iter(report["correctness"].values()))["cases"]]
    assert [1, 1, 1, 2, 2] in shapes and [1, 300, 100, 2, 2] in shapes  # seqlen 1; more queries than keys
    assert [2, 173, 251, 6, 2] in shapes and [1, 300, 100, 3, 1] in shapes  # GQA, MQA
    bands = {(tuple(c["window"]), c["top_left"], c["softcap"])
             for r in report["correctness"].values() for c in r.get("cases", []) if "window" in c}
    assert {((77, 20), False, 0.0), ((-1, -1), False, 30.0), ((300, 40), True, 20.0)} <= bands
    packed = [c for r in report["correctness"].values() for c in r.get("cases", []) if c.get("packed")]
    assert len(packed) == 3 * 5 and {c["shape"][1] for c in packed} == {113, 1, 300, 1025, 200}
    impls = {r["impl"] for r in report["speed"]}
    assert {"sdpa-cudnn", "sdpa-flash", "flashattn"} <= impls and any(i.startswith("gluon") for i in impls)
    assert done.stdout.strip().splitlines()[-1].split()[3] in impls  # the table comes last


@needs_gluon
@pytest.mark.parametrize("fault", ["off by 0.05", "nan", "lse", "no softcap", "no window", "bottom-right"])
def test_a_wrong_kernel_fails_its_case(fault, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from tools.gluon import gpu_run

    plain = gpu_run._kernel(True)

    def wrong(q, k, v, causal, schedule, window=(-1, -1), top_left=False, softcap=0.0):
        band = {"no softcap": dict(window=window, top_left=top_left, softcap=0.0),
                "no window": dict(window=(-1, -1), top_left=top_left, softcap=softcap),
                "bottom-right": dict(window=window, top_left=False, softcap=softcap)}
        out, lse = plain(q, k, v, causal, schedule, **band.get(fault, dict(window=window, top_left=top_left,
                                                                             softcap=softcap)))
        out, lse = out.clone(), lse.clone()
        if fault == "lse":
            lse[0, 0, -1] += 0.01
        elif fault in ("off by 0.05", "nan"):
            out[0, -1, 0, 0] = float("nan") if fault == "nan" else out[0, -1, 0, 0] + 0.05
        return out, lse

    monkeypatch.setattr(gpu_run, "_kernel", lambda dry, programs=None: wrong)
    launched = gpu_run._variants().index(gpu_run._launched(64))  # the schedule whose bands are checked
    report = gpu_run.check_case(64, False, launched, dry=True)
    assert not report["ok"]
    failed = [c for c in report["cases"] if not c["ok"]]
    if fault in ("no softcap", "no window", "bottom-right"):  # the band cases that use it, and no other
        uses = {"no softcap": lambda c: c["softcap"] > 0, "no window": lambda c: c["window"] != [-1, -1],
                "bottom-right": lambda c: c["top_left"] and c["shape"][1] != c["shape"][2]}[fault]
        assert failed and all(uses(c) for c in failed)
    else:
        assert len(failed) >= len(gpu_run.SHAPES) - 1


@needs_gluon
def test_a_packed_launch_that_mixes_up_sequences_fails(monkeypatch):
    """Each packed sequence is judged on its own: answering one with another's keys and values fails those."""
    monkeypatch.syspath_prepend(str(ROOT))
    from tools.gluon import gpu_run

    right = gpu_run._packed_kernel(True)

    def wrong(qs, ks, vs, causal, schedule, **band):
        return right(qs, ks[1:] + ks[:1], vs[1:] + vs[:1], causal, schedule, **band)

    monkeypatch.setattr(gpu_run, "_packed_kernel", lambda dry, programs=None: wrong)
    report = gpu_run.check_case(64, True, gpu_run._variants().index(gpu_run._launched(64)), dry=True)
    failed = [c for c in report["cases"] if not c["ok"]]
    assert not report["ok"] and failed and all(c.get("packed") for c in failed)


@needs_gluon
@pytest.mark.parametrize("fault", ["dq off by 0.5", "dk nan", "dv of the other head", "band ignored"])
def test_a_wrong_backward_fails_its_case(fault, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from tools.gluon import gpu_backward

    plain = gpu_backward._kernel_grads

    def wrong(q, k, v, dout, *, causal, dry, band=gpu_backward.PLAIN):
        band = gpu_backward.PLAIN if fault == "band ignored" else band
        dq, dk, dv = (g.clone() for g in plain(q, k, v, dout, causal=causal, dry=dry, band=band))
        if fault == "dk nan":
            dk[0, -1, 0, 0] = float("nan")
        elif fault == "dq off by 0.5":
            dq[0, -1, 0, 0] += 0.5
        elif fault == "dv of the other head":  # a key/value head's gradients written to its neighbour's place
            dv = dv.flip(2)
        return dq, dk, dv

    monkeypatch.setattr(gpu_backward, "_kernel_grads", wrong)
    report = gpu_backward.check_backward(64, True, dry=True)
    assert not report["ok"] and not report["cases"][-1]["ok"]


def test_gpu_check_runs_it_within_its_share_and_summarises_it(tmp_path):
    from tools.gpu_check.headlines import headline
    from tools.gpu_check.plan import Step, full

    step = next(s for s in full(4) if s.name == "gluon")
    assert step.args[0] == "tools.gluon.gpu_run" and "{allowed}" in step.args
    rows = [dict(impl=impl, d=64, causal=True, seqlen=8192, tflops=t)
            for impl, t in (("gluon pv", 300.0), ("gluon qk", 360.0), ("sdpa-cudnn", 450.0), ("flashattn", 240.0))]
    data = {"correctness": {"a": {"ok": True}, "b": {"ok": False, "error": "timed out after 34 s (a deadlock?)"}},
            "speed": rows, "speed_error": ""}
    (tmp_path / "gluon.json").write_text(json.dumps(data))
    probe = Step("gluon", [], 0.2, 1)
    assert headline(tmp_path, probe) == "1/2 variants correct; best at N=8192: d64 causal 360 (0.80x sdpa-cudnn, " \
                                       "1.50x flashattn)"
    assert probe.extra["failed"] == {"b": "timed out after 34 s (a deadlock?)"}
    (tmp_path / "gluon.json").write_text(json.dumps({**data, "skipped": "NVIDIA A100 is sm_80, not sm_90"}))
    assert headline(tmp_path, Step("gluon", [], 0.2, 1)) == "skipped: NVIDIA A100 is sm_80, not sm_90"
