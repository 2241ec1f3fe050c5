"""The command line: `flashattn demo` end to end on tiny sizes, and the measurement helper."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flashattn.bench.measure import Case, measure
from flashattn.cli import main


def test_demo_runs_and_writes_json_and_png(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--seqlens", "64,128", "--repeats", "1", "--traffic-n", "128",
                 "--traffic-d", "16"]) == 0
    text = capsys.readouterr().out
    for expected in ("flash_attention_v2_backward", "crossover", "flash2_fwd", "sdpa"):
        assert expected in text
    results = json.loads((out / "demo.json").read_text())["results"]
    assert {r["impl"] for r in results} == {"flashattn", "sdpa", "plain"}
    assert all(r["seconds"] > 0 and r["peak_bytes"] >= 0 for r in results)
    assert (out / "demo.png").stat().st_size > 10_000


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_measure_reports_time_and_the_n_squared_memory_of_plain_attention(mode):
    plain = measure(Case("plain", 512, heads=2, headdim=16, repeats=1, mode=mode))  # a fresh process
    # S and P of plain attention are 2 x (2 heads x 512^2 float32) = 4 MiB at least.
    assert plain["seconds"] > 0 and plain["peak_bytes"] >= 2 * 2 * 512 * 512 * 4 * 0.9


def test_module_entry_point():
    done = subprocess.run([sys.executable, "-m", "flashattn", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and "flashattn" in done.stdout


@pytest.mark.parametrize("argv,message", [(["--decode", "--seqlens", "64"], "--seqlens not used with --decode"),
                                          (["--decode", "--causal", "true"], "--causal not used with --decode"),
                                          (["--batches", "1"], "--batches only go with --decode"),
                                          (["--decode", "--heads-q", "6", "--heads-kv", "4"], "not a multiple")])
def test_bench_rejects_options_of_the_other_sweep(argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["bench", "--device", "cpu", *argv])
