"""`flashattn bench` on tiny CPU sizes: the sweep (`sweep`), baselines that cannot run, FLOP counts and speed
ratios; the decode sweep (`decode`): bytes moved, copy bandwidth, skipped cases, JSON and plot; `cpu`,
`cuda-kernel --smoke` and `context-parallel` (gloo, one rank) end to end; the shared table, plot and writer; the
busy-machine warning and the meta block every result file carries (threads, CPU model, load before timing)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

import flashattn
from conftest import nvrtc_available
from flashattn import host
from flashattn.bench import context_parallel, decode, load, report, sweep
from flashattn.bench.measure import OURS, OURS_CUDA, Case
from flashattn.cli import main


def assert_meta_describes_the_machine(meta: dict, in_this_process: bool = True) -> None:
    """What every result file's meta must hold for a reader to judge its timings."""
    assert meta["threads"] == torch.get_num_threads() if in_this_process else meta["threads"] >= 1
    assert meta["cpu"] == host.cpu_model() and meta["cpu"]
    assert meta["cores"] == os.cpu_count() and meta["usable_cores"] == host.usable_cores()
    assert set(meta["load"]) == {"load_1m", "other_cpu", "usable_cores"}, meta["load"]
    assert meta["load_warning"] is None or meta["load_warning"].startswith("the machine is busy")


def test_bench_cli_writes_rows_ratios_and_plots(tmp_path, capsys):
    out = tmp_path / "bench"
    argv = ["bench", "sweep", "--device", "cpu", "--seqlens", "32,64", "--headdims", "16", "--modes", "fwd,bwd",
            "--tokens", "128", "--hidden", "32", "--repeats", "1", "--in-process", "--quiet", "--out", str(out),
            "--baselines", "sdpa,plain,no-such-kernel"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "ours/best" in text and "no-such-kernel: unavailable" in text
    data = json.loads((out / "bench-cpu.json").read_text())
    assert_meta_describes_the_machine(data["meta"])
    rows = data["rows"]
    measured = [r for r in rows if "seqlen" in r]
    assert len(measured) == 2 * 1 * 2 * 2 * 3  # seqlens x headdims x causal x modes x implementations
    assert all(r["tflops"] > 0 and r["peak_bytes"] >= 0 for r in measured)
    ours = [r for r in measured if r["impl"] == "flashattn"]
    assert all(r["best_baseline"] in ("sdpa", "plain") and r["speedup"] > 0 for r in ours)
    assert {r["batch"] for r in measured if r["seqlen"] == 32} == {4} and {r["heads"] for r in measured} == {2}
    for suffix in ("tflops", "memory"):
        assert (out / f"bench-cpu-{suffix}.png").stat().st_size > 10_000


def test_the_fp8_modes_are_timed_beside_ours_and_never_its_baseline(tmp_path):
    rows = sweep.run(sweep.Sweep(seqlens=[64], headdims=[32], causals=[False], modes=["fwd", "bwd"],
                                 dtype="bfloat16", device="cpu", tokens=128, hidden=64, repeats=1, isolate=False,
                                 impls=[OURS, "sdpa", "flashattn-fp8", "flashattn-fp8-train"]), progress=False)
    fp8 = [r for r in rows if r["impl"] == "flashattn-fp8"]
    assert [r["mode"] for r in fp8] == ["fwd"] and fp8[0]["tflops"] > 0  # forward only
    train = [r for r in rows if r["impl"] == "flashattn-fp8-train"]
    assert [r["mode"] for r in train] == ["fwd", "bwd"] and all(r["tflops"] > 0 for r in train)
    assert all(r["best_baseline"] == "sdpa" for r in rows if r["impl"] == OURS)


def test_bench_rejects_unknown_modes(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "sweep", "--device", "cpu", "--modes", "forward"])
    assert exit_.value.code == 2 and "--modes" in capsys.readouterr().err


def test_cuda_only_baselines_are_reported_unavailable_on_cpu():
    reasons = sweep.available(["sdpa", "sdpa-cudnn"], "cpu", "float32")
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
    sweep.add_ratios(rows)
    assert rows[0]["best_baseline"] == "sdpa-cudnn" and rows[0]["speedup"] == pytest.approx(1.2)
    assert "device_speedup" not in rows[0] and "kernels" not in sweep.table(rows)  # the CPU: no queued timing


def test_an_implementation_runs_in_its_own_environment(monkeypatch):
    from flashattn.bench import measure

    monkeypatch.setenv("FLASHATTN_TRITON_TIER", "portable")
    monkeypatch.delenv("FLASHATTN_TRITON_BACKWARD", raising=False)
    with measure._environment("flashattn-one-pass"):
        assert os.environ["FLASHATTN_TRITON_BACKWARD"] == "one-pass"
    with measure._environment("flashattn-hopper"):
        assert os.environ["FLASHATTN_TRITON_TIER"] == "hopper"
    assert "FLASHATTN_TRITON_BACKWARD" not in os.environ and os.environ["FLASHATTN_TRITON_TIER"] == "portable"


def test_a_gpu_row_also_compares_the_kernels_alone():
    """With the GPU's time alone (calls queued ahead), a short call's host time drops out of the ratio: here ours
    is slower end to end (host-bound) but faster on the device."""
    point = {"seqlen": 1024, "headdim": 64, "causal": False, "mode": "fwd"}
    rows = [{"impl": OURS, "tflops": 100.0, "device_tflops": 400.0, "seconds": 1e-3, **point},
            {"impl": "sdpa-cudnn", "tflops": 200.0, "device_tflops": 320.0, "seconds": 5e-4, **point},
            {"impl": "sdpa-flash", "tflops": 150.0, "device_tflops": 160.0, "seconds": 7e-4, **point}]
    sweep.add_ratios(rows)
    assert rows[0]["speedup"] == pytest.approx(0.5) and rows[0]["device_speedup"] == pytest.approx(1.25)
    assert "kernels" in sweep.table(rows) and "1.25" in sweep.table(rows)


def test_decode_bytes_are_the_cache_rows_read_plus_q_and_out():
    case = decode.DecodeCase(batch=2, cache_len=1000, heads_q=8, heads_kv=2, headdim=64, dtype="float16")
    # K and V: 2 x (2 sequences x 1000 positions x 2 kv heads x 64) x 2 bytes; q and out: 2 x (2 x 1 x 8 x 64) x 2.
    assert case.cache_bytes == 1_024_000
    assert case.bytes_moved == 1_024_000 + 2 * 2048 == 1_028_096
    assert decode.DecodeCase(batch=1, cache_len=65536).bytes_moved == 2 * 65536 * 4 * 128 * 2 + 2 * 32 * 128 * 2


def test_decode_cli_writes_rows_goal_and_plot(tmp_path, capsys):
    out = tmp_path / "decode"
    assert main(["bench", "decode", "--device", "cpu", "--quiet", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "of copy" in text and "speedup" in text and "decode-cpu.png" in text
    data = json.loads((out / "decode-cpu.json").read_text())
    meta, rows = data["meta"], data["rows"]
    assert_meta_describes_the_machine(meta)
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
    assert main(["bench", "decode", "--device", "cpu", "--quiet", "--out", str(out), "--name", "t",
                 "--batches", "3", "--cache-lens", "100", "--cache-seqlens", "tensor", "--num-splits", "2",
                 "--repeats", "1"]) == 0
    rows = json.loads((out / "t.json").read_text())["rows"]
    assert [(r["impl"], r["batch"], r["cache_seqlens"], r["num_splits"]) for r in rows] == [
        ("flashattn", 3, "tensor", 2), ("sdpa", 3, "tensor", 2)]
    assert rows[0]["max_abs_diff"] < 1e-4


def test_decode_profile_lists_each_calls_kernels(tmp_path, capsys):
    """``--profile`` splits a call's time by kernel (on a CPU its operators): ours runs the CPU kernel's forward."""
    out = tmp_path / "decode"
    assert main(["bench", "decode", "--device", "cpu", "--quiet", "--out", str(out), "--name", "t", "--batches", "1",
                 "--cache-lens", "64", "--repeats", "1", "--profile"]) == 0
    text = capsys.readouterr().out
    assert "where a call's device time goes" in text and "batch 1, cache 64, flashattn: " in text
    rows = {r["impl"]: r for r in json.loads((out / "t.json").read_text())["rows"]}
    ours = rows["flashattn"]["kernels"]
    assert any("forward" in t["name"] for t in ours) and all(t["seconds"] >= 0 and t["launches"] > 0 for t in ours)
    assert rows["sdpa"]["kernels"]


def test_decode_times_an_fp8_cache_beside_the_same_cache_in_16_bits(tmp_path, capsys):
    out = tmp_path / "decode"
    assert main(["bench", "decode", "--device", "cpu", "--quiet", "--out", str(out), "--name", "t", "--batches", "1",
                 "--cache-lens", "64", "--dtype", "bfloat16", "--cache-dtype", "float8_e4m3fn", "--repeats", "1"]) == 0
    assert "vs 16-bit" in capsys.readouterr().out
    rows = {r["impl"]: r for r in json.loads((out / "t.json").read_text())["rows"]}
    assert list(rows) == ["flashattn", "flashattn-16bit-cache", "sdpa"]
    # Each counts the bytes it reads: the FP8 cache half the 16-bit one's.
    assert rows["flashattn"]["cache_dtype"] == "float8_e4m3fn" and rows["flashattn-16bit-cache"]["cache_dtype"] == ""
    assert rows["flashattn-16bit-cache"]["bytes_moved"] > rows["flashattn"]["bytes_moved"]
    ours = rows["flashattn"]
    assert ours["speedup_over_16bit_cache"] == pytest.approx(rows["flashattn-16bit-cache"]["seconds"] / ours["seconds"])


def test_decode_skips_a_cache_that_does_not_fit_without_allocating_it():
    case = decode.DecodeCase(batch=2**20, cache_len=2**20, device="cpu", dtype="float32")  # 4 PiB of cache
    rows = decode.measure_case(case, ["flashattn", "sdpa"], copy_gbps=1.0, headroom_gib=0)
    assert [r["impl"] for r in rows] == ["flashattn", "sdpa"]
    assert case.memory_bytes / 2**30 == 4 * 2**20 + 48  # the caches, and q plus two outputs (16 GiB each)
    assert all(r["seconds"] is None and r["error"].startswith("skipped: needs 4194352.0 GiB") for r in rows)
    assert "skipped: needs" in decode.table(rows, {"gbps": 1.0})


def test_decode_reports_a_missing_implementation_and_still_measures_the_baseline(monkeypatch, tmp_path):
    monkeypatch.delattr(flashattn, "flash_attn_with_kvcache", raising=False)
    plan = decode.DecodeSweep.for_device("cpu")
    plan.batches, plan.cache_lens, plan.repeats = [1], [64], 1
    rows, copy = decode.run(plan, progress=False)
    assert rows[0]["impl"] == "flashattn" and "unavailable: AttributeError" in rows[0]["error"]
    assert "flash_attn_with_kvcache" in rows[0]["error"]
    assert [r["impl"] for r in rows[1:]] == ["sdpa"] and rows[1]["bw_fraction"] > 0
    assert decode.write(rows, copy, plan, tmp_path, "d")[-1].name == "d.png"


def test_decode_goal_is_our_fraction_at_batch_1_and_64k():
    point = {"batch": 1, "cache_len": 65536}
    rows = [{"impl": "sdpa", "bw_fraction": 0.9, **point}, {"impl": "flashattn", "bw_fraction": 0.82, **point},
            {"impl": "flashattn", "bw_fraction": 0.1, "batch": 4, "cache_len": 65536}]
    assert decode.goal(rows) == {"target_batch": 1, "target_cache_len": 65536, "target_bw_fraction": 0.8,
                                 "bw_fraction": 0.82, "met": True}
    assert decode.goal(rows[:1]) is None


def test_cuda_kernel_is_timed_forward_only_and_is_not_a_baseline():
    plan = sweep.Sweep(seqlens=[128], headdims=[64], causals=[False], modes=["fwd", "bwd"],
                       impls=[OURS, OURS_CUDA, "sdpa"], device="cpu")
    cases = {(c.impl, c.mode) for c in plan.cases()}
    assert (OURS_CUDA, "fwd") in cases and (OURS_CUDA, "bwd") not in cases
    point = {"seqlen": 128, "headdim": 64, "causal": False, "mode": "fwd"}
    rows = [{"impl": OURS, "tflops": 1.0, **point}, {"impl": OURS_CUDA, "tflops": 4.0, **point},
            {"impl": "sdpa", "tflops": 2.0, **point}]
    sweep.add_ratios(rows)
    assert rows[0]["best_baseline"] == "sdpa" and rows[0]["speedup"] == 0.5


def test_cpu_subcommand_measures_fwd_and_fwd_bwd_and_leaves_big_plain_attention_out(tmp_path, capsys):
    out = tmp_path / "cpu"
    # 4e-5 GiB admits plain attention's N x N tensors at N = 32 (16 and 32 KiB) but not at N = 64 (64, 128 KiB).
    assert main(["bench", "cpu", "--seqlens", "32,64", "--heads", "2", "--headdims", "16", "--repeats", "1",
                 "--plain-limit-gib", "0.00004", "--in-process", "--quiet", "--out", str(out), "--name", "c"]) == 0
    text = capsys.readouterr().out
    assert "ours/sdpa time" in text and "TFLOP/s" in text and "MiB" in text
    data = json.loads((out / "c.json").read_text())
    rows = data["rows"]
    assert len(rows) == 2 * 2 * 2 + 2  # modes x seqlens x (ours, sdpa), and plain only at N = 32
    assert {(r["impl"], r["seqlen"]) for r in rows if r["impl"] == "plain"} == {("plain", 32)}
    assert {r["mode"] for r in rows} == {"fwd", "fwd+bwd"} and all(r["seconds"] > 0 for r in rows)
    assert all(r["device"] == "cpu" and r["dtype"] == "float32" and r["batch"] == 1 for r in rows)
    meta = data["meta"]
    assert_meta_describes_the_machine(meta)
    assert meta["command"].startswith("flashattn bench cpu --seqlens 32,64") and meta["torch"] == torch.__version__
    assert meta["device"] == "cpu" and meta["date"][:4].isdigit() and meta["sweep"]["seqlens"] == [32, 64]
    assert (out / "c.png").stat().st_size > 10_000


def test_cpu_subcommand_covers_dtypes_causal_and_a_competing_load(tmp_path, capsys):
    out = tmp_path / "cpu"
    assert main(["bench", "cpu", "--seqlens", "32", "--heads", "2", "--headdims", "16", "--repeats", "1",
                 "--dtypes", "float32,bfloat16", "--causal", "both", "--load", "--load-seconds", "60",
                 "--plain-limit-gib", "0.00004", "--in-process", "--quiet", "--out", str(out), "--name", "c"]) == 0
    data = json.loads((out / "c.json").read_text())
    keys = {(r["dtype"], r["causal"], r["mode"], r["impl"]) for r in data["rows"]}
    assert len(keys) == 2 * 2 * 2 * 3 and all(r["seconds"] > 0 for r in data["rows"])
    assert data["meta"]["sweep"]["load"] is True and "one competing busy process" in capsys.readouterr().out


def test_cpu_roofline_reports_against_the_measured_ceilings_and_skips_what_would_take_too_long(
        tmp_path, capsys, monkeypatch):
    from flashattn.bench import roofline

    monkeypatch.setattr(roofline, "PRODUCT_SIZE", {"float32": 128, "bfloat16": 128, "float16": 32})
    monkeypatch.setattr(roofline, "READ_GIB", 0.01)
    monkeypatch.setattr(roofline, "DECODE", dataclasses.replace(roofline.DECODE, cache_len=256, repeats=2))
    out = tmp_path / "roofline"
    # 1e-9 s: every case after the first of its line is predicted too slow.
    assert main(["bench", "cpu", "--roofline", "--seqlens", "32,64", "--headdims", "16", "--heads", "2",
                 "--dtypes", "bfloat16", "--causal", "no", "--repeats", "1", "--max-case-seconds", "1e-9",
                 "--in-process", "--quiet", "--out", str(out), "--name", "r"]) == 0
    text = capsys.readouterr().out
    assert "ceilings: product rate float32" in text and "of rate" in text and "x SDPA" in text
    assert "of the read bandwidth" in text
    data = json.loads((out / "r.json").read_text())
    meta, rows = data["meta"], data["rows"]
    assert set(meta["ceilings"]["product_gflops"]) == {"float32", "bfloat16", "float16"}
    assert meta["ceilings"]["read_gbps"] > 0 and meta["cpu_flags"] == host.cpu_flags()
    first, last = meta["ceilings"]["measured"]  # before and after the cases; each limit the higher reading
    assert meta["ceilings"]["read_gbps"] == max(first["read_gbps"], last["read_gbps"])
    assert meta["ceilings"]["product_gflops"] == {d: max(first["product_gflops"][d], last["product_gflops"][d])
                                                  for d in first["product_gflops"]}
    assert "the higher of two readings" in text
    assert meta["tiles"] == {"bfloat16": roofline.tiles_dtype("bfloat16")}
    grid = [r for r in rows if r["mode"] != "decode"]
    measured = [r for r in grid if r.get("seconds")]
    assert {(r["impl"], r["mode"], r["seqlen"]) for r in measured} == {
        (impl, mode, 32) for impl in roofline.IMPLS for mode in ("fwd", "fwd+bwd")}
    assert all(r["error"].startswith("skipped: predicted") for r in grid if r["seqlen"] == 64)
    for r in measured:
        rate = meta["ceilings"]["product_gflops"][r["ceiling"]]
        assert r["of_rate"] == pytest.approx(r["tflops"] * 1e3 / rate)
    assert all(r["speedup"] > 0 for r in measured if r["impl"] == OURS)
    decode_rows = [r for r in rows if r["mode"] == "decode"]
    assert {r["impl"] for r in decode_rows} == set(roofline.IMPLS)
    assert all(r["of_read_bandwidth"] == pytest.approx(r["gbps"] / meta["ceilings"]["read_gbps"])
               for r in decode_rows)


def test_cpu_roofline_ceilings_keep_the_higher_reading_and_say_how_far_they_drifted():
    from flashattn.bench import roofline

    first = {"product_gflops": {"float32": 300.0, "bfloat16": 2000.0}, "read_gbps": 20.0}
    last = {"product_gflops": {"float32": 330.0, "bfloat16": 1500.0}, "read_gbps": 20.0}
    limits = roofline.higher_ceilings(first, last)
    assert limits["product_gflops"] == {"float32": 330.0, "bfloat16": 2000.0} and limits["read_gbps"] == 20.0
    assert limits["measured"] == [first, last]
    assert roofline.drift(limits) == pytest.approx(0.25)  # bf16: 1500 against 2000
    assert roofline.drift(first) == 0.0
    # The widest drift on any limit, wherever it sits: the first dtype, the bandwidth.
    slow = {"product_gflops": {"float32": 150.0, "bfloat16": 2000.0}, "read_gbps": 20.0}
    assert roofline.drift(roofline.higher_ceilings(first, slow)) == pytest.approx(0.5)
    thin = {"product_gflops": first["product_gflops"], "read_gbps": 5.0}
    assert roofline.drift(roofline.higher_ceilings(first, thin)) == pytest.approx(0.75)


def test_cpu_flags_names_the_instruction_sets_that_matter(monkeypatch):
    import io

    line = "flags\t\t: fpu avx2 fma avx512f avx512bw avx512_bf16 amx_tile\n"
    monkeypatch.setattr(host, "open", lambda *a, **k: io.StringIO("model name\t: x\n" + line), raising=False)
    assert host.cpu_flags() == ["avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_tile"]


def test_the_competing_load_is_busy_and_stopped_at_the_end():
    from flashattn.bench.cpu import competing_load

    with competing_load(60) as busy:
        assert busy.poll() is None  # running
    assert busy.poll() is not None  # stopped with the block, long before its own 60 s
    with competing_load(0.01) as busy:
        busy.wait(timeout=30)  # and it stops by itself at its deadline
        assert busy.returncode == 0


def test_cpu_model_falls_back_to_platform_without_proc_cpuinfo(monkeypatch):
    def missing(*args, **kwargs):
        raise FileNotFoundError("/proc/cpuinfo")

    monkeypatch.setattr(host, "open", missing, raising=False)
    monkeypatch.setattr(host.platform, "processor", lambda: "test-cpu")
    assert host.cpu_model() == "test-cpu"


@pytest.mark.skipif(not nvrtc_available(), reason="needs NVRTC")
def test_cuda_kernel_smoke_compiles_and_writes_the_file(tmp_path, capsys):
    assert main(["bench", "cuda-kernel", "--smoke", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("cuda-kernel-smoke-*.json")
    data = json.loads(path.read_text())
    assert data["meta"]["compile"]["arch"] == "sm_90" and data["meta"]["compile"]["seconds"] > 0
    assert data["meta"]["device"] == "none (smoke)" and data["rows"] == [] and data["accuracy"] == []
    assert_meta_describes_the_machine(data["meta"])
    assert "compile for sm_90" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_kernel_without_a_gpu_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "cuda-kernel", "--out", "unused"])
    assert exit_.value.code == 2 and "needs a CUDA device (or --smoke)" in capsys.readouterr().err


def test_context_parallel_builds_a_standalone_torchrun_command_with_this_interpreter(monkeypatch):
    import argparse
    import sys

    p = argparse.ArgumentParser()
    context_parallel.add_arguments(p)
    args = p.parse_args(["--device", "cpu", "--nproc-per-node", "3", "--seqlen", "96", "--out", "x"])
    assert context_parallel.torchrun_command(args) == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
        "-m", "flashattn.bench.context_parallel", "--device", "cpu", "--seqlen", "96", "--batch", "1", "--heads",
        "32", "--heads-kv", "8", "--headdim", "128", "--repeats", "10", "--out", "x"]
    args = p.parse_args(["--device", "cpu"])
    assert context_parallel.torchrun_command(args)[5] == "1"  # one CPU rank unless asked for more


def test_context_parallel_runs_every_layout_on_one_gloo_rank(tmp_path, capsys):
    """The subcommand starts torchrun, whose one rank times every layout on CPU and writes the results."""
    out = tmp_path / "cp"
    assert main(["bench", "context-parallel", "--device", "cpu", "--nproc-per-node", "1", "--seqlen", "64",
                 "--heads", "2", "--heads-kv", "2", "--headdim", "16", "--repeats", "1", "--out", str(out)]) == 0
    data = json.loads((out / "context-parallel-w1.json").read_text())
    assert [r["layout"] for r in data["rows"]] == ["ring", "zigzag", "allgather", "ulysses"]
    assert all(r["world"] == 1 and r["fwd_s"] > 0 and r["fwd_bwd_s"] > 0 for r in data["rows"])
    assert all(r["sent_bytes"] == {"fwd": 0, "bwd": 0} for r in data["rows"])  # nothing to send with one rank
    assert data["meta"]["backend"] == "gloo" and data["meta"]["world"] == 1
    assert_meta_describes_the_machine(data["meta"], in_this_process=False)  # with the reading its parent took


def test_context_parallel_rank_records_the_reading_its_parent_took(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (7.5, 0.0, 0.0))
    monkeypatch.setattr(load, "other_processes_cpu", lambda seconds=0: 0.0)
    out = tmp_path / "cp"
    assert main(["bench", "context-parallel", "--device", "cpu", "--nproc-per-node", "1", "--seqlen", "32",
                 "--heads", "1", "--heads-kv", "1", "--headdim", "16", "--repeats", "1", "--out", str(out)]) == 0
    meta = json.loads((out / "context-parallel-w1.json").read_text())["meta"]
    assert meta["load"]["load_1m"] == 7.5 and meta["load_warning"].startswith("the machine is busy")


def test_sent_bytes_follow_the_layout_formulas():
    # 4 ranks, a local block of 1 x 256 x 2 kv heads x 64 bf16 = 64 KiB (q: 8 heads, 256 KiB).
    ring = context_parallel.sent_bytes("ring", 4, 1, 256, 8, 2, 64, 2)
    assert ring == {"fwd": 3 * 2 * 65536, "bwd": 3 * 2 * (65536 + 131072) + 2 * 131072}
    gather = context_parallel.sent_bytes("allgather", 4, 1, 256, 8, 2, 64, 2)
    assert gather == {"fwd": 0.75 * 2 * 4 * 65536, "bwd": 0.75 * 4 * 4 * 65536}
    assert context_parallel.sent_bytes("ulysses", 4, 1, 256, 8, 2, 64, 2)["fwd"] == 0.75 * (2 * 262144 + 2 * 65536)


def test_table_aligns_dict_and_list_rows_and_prints_missing_cells_as_dashes():
    rows = [{"impl": "flashattn", "seqlen": 64, "seconds": 0.5, "tflops": None},
            {"impl": "sdpa", "seqlen": 64, "seconds": 0.25, "tflops": 1e-5}]
    lines = report.table(report.wide(rows, ("seqlen",)),
                         ["seqlen", *report.per_impl(["flashattn", "sdpa"], report.MS, report.TFLOPS)]).splitlines()
    assert lines[0].split() == ["flashattn", "sdpa"]
    assert lines[1].split() == ["seqlen", "ms", "TFLOP/s", "ms", "TFLOP/s"]
    assert lines[3].split() == ["64", "500", "-", "250", "1e-05"]
    assert report.table([["a", 1], ["bb", 22]], ["x", "y"]).splitlines() == [" x   y", "--  --", " a   1", "bb  22"]


def test_plot_draws_a_metric_against_cache_length_with_panels(tmp_path):
    rows = [{"impl": impl, "batch": b, "cache_len": n, "bw_fraction": 0.1 * b + n / 1e4}
            for impl in ("flashattn", "sdpa") for b in (1, 4) for n in (256, 1024)]
    figure = report.Figure("t", ("bw_fraction",), x="cache_len", lines=("batch",), cols=("impl",), goal=0.8)
    assert report.plot(rows, tmp_path / "p.png", figure) and (tmp_path / "p.png").stat().st_size > 10_000
    assert not report.plot([{"impl": "x", "error": "unavailable"}], tmp_path / "q.png", figure)


def _cpu_bench(out) -> list[str]:
    return ["bench", "cpu", "--seqlens", "32", "--heads", "1", "--headdim", "16", "--repeats", "1", "--in-process",
            "--quiet", "--out", str(out), "--name", "c"]


@pytest.mark.parametrize("loadavg,other,says", [((8.0, 1.0, 1.0), 0.0, "1-minute load average 8.00 on"),
                                                 ((0.0, 0.0, 0.0), 64.0, "other processes are using 64.00 of")])
def test_a_busy_machine_is_warned_about_before_timing_and_recorded(loadavg, other, says, tmp_path, capsys,
                                                                    monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: loadavg)
    monkeypatch.setattr(load, "other_processes_cpu", lambda seconds=0: other)
    assert main(_cpu_bench(tmp_path)) == 0
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith("flashattn: warning: the machine is busy (") and says in line
    assert line.endswith("timings may be unreliable")
    meta = json.loads((tmp_path / "c.json").read_text())["meta"]
    assert meta["load_warning"] in line and meta["load"] == {"load_1m": loadavg[0], "other_cpu": other,
                                                              "usable_cores": host.usable_cores()}


def test_a_quiet_machine_gets_no_warning_but_its_load_is_recorded(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(load, "other_processes_cpu", lambda seconds=0: 0.0)
    assert main(_cpu_bench(tmp_path)) == 0
    assert "warning" not in capsys.readouterr().err
    meta = json.loads((tmp_path / "c.json").read_text())["meta"]
    assert meta["load_warning"] is None and meta["load"]["load_1m"] == 0.0


def test_no_load_average_is_not_an_error(tmp_path, monkeypatch):
    monkeypatch.delattr(os, "getloadavg")  # as on Windows
    monkeypatch.setattr(load, "other_processes_cpu", lambda seconds=0: None)
    assert host.load_average() is None and load.warning(load.reading()) is None
    assert main(_cpu_bench(tmp_path)) == 0
    meta = json.loads((tmp_path / "c.json").read_text())["meta"]
    assert meta["load"]["load_1m"] is None and meta["load_warning"] is None


def test_other_processes_cpu_is_sampled_from_proc_stat():
    if not os.path.exists("/proc/stat"):
        pytest.skip("Linux only")
    # Ticks of 10 ms: each of the two readings rounds every CPU's count and our own time down, up to ~0.06 s in all,
    # so the sample is long enough for that to stay under half a core (0.05 s read 2.78 on 2 cores once).
    other = load.other_processes_cpu(0.2)
    assert other is not None and 0 <= other <= host.usable_cores() + 0.5


def test_meta_outside_the_command_line_has_no_reading():
    meta = report.meta("cpu", ["test"])
    assert meta["load"] is None and meta["load_warning"] is None and meta["threads"] >= 1
