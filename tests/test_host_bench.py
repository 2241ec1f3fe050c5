"""`flashattn bench host` in its stubbed mode: the Triton kernels compiled for sm_90 and their launches recorded on
a CPU (flashattn.backends.triton.stub), end to end through the command line in a process without Triton's
interpreter: every entry point's launches, in order, the medians --json writes, the budgets judged, the plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton_versions import TRITON_MISSING

import flashattn
from flashattn.backends import Request, explain
from flashattn.bench import host
from flashattn.cli import main

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(bool(TRITON_MISSING), reason=TRITON_MISSING or "")


def _compiled_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled kernels, stubbed launches
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
    return env


def test_stubbed_launches_time_every_entry_point(tmp_path):
    entries = ["fwd", "train", "decode", "decode_tensor_seqlens", "varlen", "sdpa", "decode_paged", "varlen_train"]
    medians = tmp_path / "host.json"
    done = subprocess.run(
        [sys.executable, "-m", "flashattn", "bench", "host", "--mode", "stub", "--calls", "3", "--entries",
         ",".join(entries), "--out", str(tmp_path), "--json", str(medians)],
        env=_compiled_env(), capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    written = json.loads(medians.read_text())
    assert written["mode"] == "stub" and written["machine"]["cpu"]
    assert all(written[e] > 0 for e in entries)
    every = json.loads((tmp_path / "host-stub.json").read_text())["rows"]
    rows = {r["entry"]: r for r in every if r["impl"] == "flashattn"}
    floor = [r for r in every if r["impl"] == "autograd"]  # torch's own share of a training step, beside it
    assert [r["entry"] for r in floor] == ["train"] and floor[0]["us"] > 0
    assert rows["fwd"]["launches"] == ["attention_forward_kernel"]
    assert rows["train"]["launches"] == ["attention_forward_kernel", "attention_backward_preprocess_kernel",
                                         "attention_backward_dkdv_kernel", "attention_backward_dq_kernel"]
    assert rows["decode"]["launches"][0] == "attention_forward_kernel"
    assert rows["varlen"]["launches"] == ["check_varlen_kernel", "attention_forward_kernel"]  # offsets checked
    for row in rows.values():  # each launch after the one before, the last one before the call returns
        times = row["us_to_each_launch"]
        assert times == sorted(times) and row["us"] == times[-1] <= row["us_to_return"]
    meta = json.loads((tmp_path / "host-stub.json").read_text())["meta"]
    assert set(meta["budgets"]) == {"fwd", "train", "decode", "decode_tensor_seqlens", "varlen", "varlen_train"}
    assert "fwd" in done.stdout and (tmp_path / "host-stub.png").stat().st_size > 5_000


def test_the_stub_is_refused_under_the_interpreter_and_serves_cpu_tensors_only_inside():
    pytest.importorskip("triton")
    from flashattn.backends.triton.stub import stubbed_launches

    request = Request("cpu", torch.bfloat16, 128, 128)
    if os.environ.get("TRITON_INTERPRET") == "1":
        with pytest.raises(RuntimeError, match="unset it"), stubbed_launches(90):
            pass
    else:  # pragma: no cover (the suite runs under the interpreter without a GPU)
        with stubbed_launches(90), flashattn.use_backend("triton"):
            assert explain(request)[0] == "triton"
    with flashattn.use_backend("auto"):
        assert explain(request)[0] != "triton"


def test_gpu_mode_without_a_gpu_is_a_usage_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: --mode gpu is valid")
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "host", "--mode", "gpu"])
    assert exit_.value.code == 2 and "--mode gpu needs a CUDA device" in capsys.readouterr().err


def test_budgets_are_judged_stubbed_against_the_issue_and_on_a_gpu_against_sdpa():
    rows = [{"entry": "fwd", "impl": "flashattn", "us": 25.0}, {"entry": "decode", "impl": "flashattn", "us": 40.0},
            {"entry": "decode", "impl": "sdpa", "us": 45.0}]
    stub = host.budgets_met(rows, "stub")
    assert stub["fwd"]["met"] and not stub["decode"]["met"] and stub["decode"]["limit_us"] == 30.0
    gpu = host.budgets_met(rows, "gpu")
    assert gpu["decode"]["met"] and gpu["decode"]["against"] == "sdpa" and not gpu["fwd"]["met"]


def test_gpu_mode_says_where_a_queued_calls_time_goes(monkeypatch):
    """Beside the wall time per queued call: how long a call took to return and how many ran by their launch plan,
    so that a GPU's figure can be read (host-bound or kernel-bound; planned or the full Python). The GPU's queue
    is played by a no-op synchronize and a call that replays a plan every other time."""
    from flashattn.backends.triton import attend

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(attend.FORWARD_PLANS, "replays", 0)
    made = [0]

    def call():
        made[0] += 1
        attend.FORWARD_PLANS.replays += made[0] % 2

    row = host.measure_queued(call, 10)
    assert row["calls"] == 10 and row["plan_replays"] == 5  # the 3 warm-up calls are not counted
    assert 0 < row["us_to_return"] <= row["us"] * 1.5
    rows = [{"entry": "decode", "impl": "flashattn", **row}, {"entry": "decode", "impl": "sdpa", "us": 1e6,
                                                            "us_to_return": 2.0}]
    text = host.table(rows, "gpu")
    assert "returns  plans" in text.splitlines()[0] and "5/10" in text.splitlines()[1]
