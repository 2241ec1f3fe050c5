"""`flashattn bench` on tiny CPU sizes: the sweep, baselines that cannot run, FLOP counts and speed ratios; the
decode sweep (`--decode`): bytes moved, copy bandwidth, skipped cases, JSON and plot."""

from __future__ import annotations

import json

import pytest

import flashattn
from flashattn.bench import decode, harness
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


def test_decode_bytes_are_the_cache_rows_read_plus_q_and_out():
    case = decode.DecodeCase(batch=2, cache_len=1000, heads_q=8, heads_kv=2, headdim=64, dtype="float16")
    # K and V: 2 x (2 sequences x 1000 positions x 2 kv heads x 64) x 2 bytes; q and out: 2 x (2 x 1 x 8 x 64) x 2.
    assert case.cache_bytes == 1_024_000
    assert case.bytes_moved == 1_024_000 + 2 * 2048 == 1_028_096
    assert decode.DecodeCase(batch=1, cache_len=65536).bytes_moved == 2 * 65536 * 4 * 128 * 2 + 2 * 32 * 128 * 2


def test_decode_cli_writes_rows_goal_and_plot(tmp_path, capsys):
    out = tmp_path / "decode"
    assert main(["bench", "--decode", "--device", "cpu", "--quiet", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "of copy" in text and "speedup" in text and "decode-cpu.png" in text
    data = json.loads((out / "decode-cpu.json").read_text())
    meta, rows = data["meta"], data["rows"]
    assert meta["copy_bandwidth"]["gbps"] > 0 and meta["sweep"]["heads_q"] == 8 and meta["goal"] is None
    assert len(rows) == 2 * 2 * 2  # batches x cache lengths x (ours, baseline)
    for r in rows:
        assert r["seconds"] > 0 and r["host_seconds"] > 0 and r["gbps"] > 0
        assert r["bw_fraction"] == pytest.approx(r["gbps"] / meta["copy_bandwidth"]["gbps"])
        assert r["bytes_moved"] == decode.DecodeCase(r["batch"], r["cache_len"], 8, 1, 64, "float32").bytes_moved
    ours = [r for r in rows if r["impl"] == "flashattn"]
    assert len(ours) == 4 and all(r["baseline"] == "sdpa" and r["speedup"] > 0 for r in ours)
    assert all(r["max_abs_diff"] < 1e-4 for r in ours)  # the same attention as SDPA over the same cache
    assert (out / "decode-cpu.png").stat().st_size > 10_000


def test_decode_passes_cache_seqlens_as_a_tensor_and_num_splits(tmp_path):
    out = tmp_path / "decode"
    assert main(["bench", "--decode", "--device", "cpu", "--quiet", "--out", str(out), "--name", "t",
                 "--batches", "3", "--cache-lens", "100", "--cache-seqlens", "tensor", "--num-splits", "2",
                 "--repeats", "1"]) == 0
    rows = json.loads((out / "t.json").read_text())["rows"]
    assert [(r["impl"], r["batch"], r["cache_seqlens"], r["num_splits"]) for r in rows] == [
        ("flashattn", 3, "tensor", 2), ("sdpa", 3, "tensor", 2)]
    assert rows[0]["max_abs_diff"] < 1e-4


def test_decode_skips_a_cache_that_does_not_fit_without_allocating_it():
    case = decode.DecodeCase(batch=2**20, cache_len=2**20, device="cpu", dtype="float32")  # 4 PiB of cache
    rows = decode.measure_case(case, ["flashattn", "sdpa"], copy_gbps=1.0, headroom_gib=0)
    assert [r["impl"] for r in rows] == ["flashattn", "sdpa"]
    assert case.memory_bytes / 2**30 == 4 * 2**20 + 48  # the caches, and q plus two outputs (16 GiB each)
    assert all(r["seconds"] is None and r["error"].startswith("skipped: needs 4194352.0 GiB") for r in rows)
    assert "skipped: needs" in decode.table(rows, {"gbps": 1.0})


def test_decode_reports_a_missing_implementation_and_still_measures_the_baseline(monkeypatch, tmp_path):
    monkeypatch.delattr(flashattn, "flash_attn_with_kvcache", raising=False)
    sweep = decode.DecodeSweep.for_device("cpu")
    sweep.batches, sweep.cache_lens, sweep.repeats = [1], [64], 1
    rows, copy = decode.run(sweep, progress=False)
    assert rows[0]["impl"] == "flashattn" and "unavailable: AttributeError" in rows[0]["error"]
    assert "flash_attn_with_kvcache" in rows[0]["error"]
    assert [r["impl"] for r in rows[1:]] == ["sdpa"] and rows[1]["bw_fraction"] > 0
    assert decode.write(rows, copy, sweep, tmp_path, "d")[-1].name == "d.png"


def test_decode_goal_is_our_fraction_at_batch_1_and_64k():
    point = {"batch": 1, "cache_len": 65536}
    rows = [{"impl": "sdpa", "bw_fraction": 0.9, **point}, {"impl": "flashattn", "bw_fraction": 0.82, **point},
            {"impl": "flashattn", "bw_fraction": 0.1, "batch": 4, "cache_len": 65536}]
    assert decode.goal(rows) == {"target_batch": 1, "target_cache_len": 65536, "target_bw_fraction": 0.8,
                                 "bw_fraction": 0.82, "met": True}
    assert decode.goal(rows[:1]) is None


def test_cuda_kernel_is_timed_forward_only_and_is_not_a_baseline():
    sweep = harness.Sweep(seqlens=[128], headdims=[64], causals=[False], modes=["fwd", "bwd"],
                          impls=[harness.OURS, harness.OURS_CUDA, "sdpa"], device="cpu")
    cases = {(c.impl, c.mode) for c in sweep.cases()}
    assert (harness.OURS_CUDA, "fwd") in cases and (harness.OURS_CUDA, "bwd") not in cases
    point = {"seqlen": 128, "headdim": 64, "causal": False, "mode": "fwd"}
    rows = [{"impl": harness.OURS, "tflops": 1.0, **point}, {"impl": harness.OURS_CUDA, "tflops": 4.0, **point},
            {"impl": "sdpa", "tflops": 2.0, **point}]
    harness.add_ratios(rows)
    assert rows[0]["best_baseline"] == "sdpa" and rows[0]["speedup"] == 0.5
