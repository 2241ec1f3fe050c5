"""``python -m tools.gpu_check --smoke``: every step of the GPU session's one command runs at toy sizes on the CPU,
writes its results into one folder, and the summary reads them back."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["info", "health", "profile", "tests", "cuda-kernel", "sweep-d16", "decode", "block-mask"]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the health and profile steps need triton")
def test_smoke_runs_every_step(tmp_path):
    out = tmp_path / "check"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--smoke", "--jobs", "1", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    summary = json.loads((out / "gpu-check.json").read_text())
    steps = {s["name"]: s for s in summary["steps"]}
    assert list(steps) == STEPS
    not_ok = {name: (s["status"], (out / f"{name}.log").read_text()[-2000:]) for name, s in steps.items()
              if s["status"] != "ok"}
    if "cuda-kernel" in not_ok and "nvrtc" in not_ok["cuda-kernel"][1].lower():
        not_ok.pop("cuda-kernel")  # no NVRTC on this machine: the CUDA backend's own tests say so
    assert not not_ok, not_ok
    for name in ("info.json", "health.json", "profile.json", "tests.xml", "sweep-d16.json", "decode.json",
                 "block-mask.json"):
        assert (out / name).stat().st_size > 0, name
    assert steps["tests"]["headline"].endswith("0 failed, 0 skipped")
    assert steps["health"]["headline"] == "2 configs, 0 with problems"
    assert "forward <=" in steps["profile"]["headline"]
    assert steps["block-mask"]["headline"].startswith("N=512: fwd")
    # The table names every step and its status.
    table = done.stdout[done.stdout.index("step"):]
    assert all(name in table for name in STEPS)
    assert done.returncode == 0, done.stdout[-3000:]


def test_without_a_gpu_the_full_check_is_refused(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--out", str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 2
    assert "--smoke" in done.stderr
    assert not (tmp_path / "x").exists()
