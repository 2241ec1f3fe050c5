"""`flashattn bench` on tiny CPU sizes: the sweep, baselines that cannot run, FLOP counts and speed ratios."""

from __future__ import annotations

import json

import pytest

from flashattn.bench import harness
from flashattn.bench.measure import Case
from flashattn.cli import main


def test_bench_cli_writes_rows_ratios_and_plots(tmp_path, capsys):
    out = tmp_path / "bench"
    argv = ["bench", "--device", "cpu", "--seqlens", "32,64", "--headdims", "16", "--modes", "fwd,bwd",
            "--tokens", "128", "--hidden", "32", "--repeats", "1", "--in-process", "--quiet", "--out", str(out),
            "--baselines", "sdpa,plain,no-such-kernel"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "ours/best" in text and "no-such-kernel: unavailable" in text
    rows = json.loads((out / "bench-cpu.json").read_text())["rows"]
    measured = [r for r in rows if "seqlen" in r]
    assert len(measured) == 2 * 1 * 2 * 2 * 3  # seqlens x headdims x causal x modes x implementations
    assert all(r["tflops"] > 0 and r["peak_bytes"] >= 0 for r in measured)
    ours = [r for r in measured if r["impl"] == "flashattn"]
    assert all(r["best_baseline"] in ("sdpa", "plain") and r["speedup"] > 0 for r in ours)
    assert {r["batch"] for r in measured if r["seqlen"] == 32} == {4} and {r["heads"] for r in measured} == {2}
    for suffix in ("tflops", "memory"):
        assert (out / f"bench-cpu-{suffix}.png").stat().st_size > 10_000


def test_bench_rejects_unknown_modes():
    with pytest.raises(SystemExit, match="--modes"):
        main(["bench", "--device", "cpu", "--modes", "forward"])


def test_cuda_only_baselines_are_reported_unavailable_on_cpu():
    reasons = harness.available(["sdpa", "sdpa-cudnn"], "cpu", "float32")
    assert reasons["sdpa"] is None
    assert reasons["sdpa-cudnn"]  # no cuDNN attention on CPU: a reason, not a crash


@pytest.mark.parametrize("causal,mode,factor", [(False, "fwd", 1.0), (True, "fwd", 0.5), (False, "bwd", 2.5),
                                                 (True, "fwd+bwd", 1.75)])
def test_flop_count(causal, mode, factor):
    case = Case("flashattn", 1024, batch=2, heads=3, headdim=64, causal=causal, mode=mode)
    assert case.flops == pytest.approx(4 * 2 * 3 * 1024**2 * 64 * factor)


def test_speedup_is_against_the_best_baseline_of_the_same_point():
    point = {"seqlen": 512, "headdim": 64, "causal": False, "mode": "fwd"}
    rows = [{"impl": "flashattn", "tflops": 300.0, **point}, {"impl": "sdpa-flash", "tflops": 200.0, **point},
            {"impl": "sdpa-cudnn", "tflops": 250.0, **point},
            {"impl": "sdpa-cudnn", "tflops": 999.0, **point, "causal": True},
            {"impl": "plain", "tflops": None, "error": "skipped", **point}]
    harness.add_ratios(rows)
    assert rows[0]["best_baseline"] == "sdpa-cudnn" and rows[0]["speedup"] == pytest.approx(1.2)
