"""The command line: `flashattn demo` end to end on tiny sizes, the measurement helper, and the `flashattn bench`
subcommands' parsing: each has only its own options, --help with defaults, usage errors for bad values."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from flashattn.bench import load
from flashattn.bench.measure import Case, measure
from flashattn.cli import BENCH_COMMANDS, build_parser, main


def test_demo_runs_and_writes_json_and_png(tmp_path, capsys, monkeypatch):
    from flashattn import cli

    # Each case in this process: a fresh one per case (as the demo runs them) is the measure test's below.
    monkeypatch.setattr(cli, "measure", lambda case: measure(case, isolate=False))
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--seqlens", "64,128", "--repeats", "1", "--traffic-n", "128",
                 "--traffic-d", "16"]) == 0
    text = capsys.readouterr().out
    for expected in ("flash_attention_v2_backward", "crossover", "flash2_fwd", "sdpa"):
        assert expected in text
    data = json.loads((out / "demo.json").read_text())
    results = data["rows"]
    assert {r["impl"] for r in results} == {"flashattn", "sdpa", "plain"}
    meta = data["meta"]  # what a reader needs to judge the timings: threads, CPU, the load before timing
    assert meta["threads"] == torch.get_num_threads() and meta["cpu"] and meta["usable_cores"] >= 1
    assert "load_1m" in meta["load"] and "load_warning" in meta
    assert all(r["seconds"] > 0 and r["peak_bytes"] >= 0 for r in results)
    assert (out / "demo.png").stat().st_size > 10_000
    # the algorithm tile by tile, beside the plot: the page and its pictures
    assert "\"fa2\"" in (out / "explain.html").read_text() and (out / "explain.gif").stat().st_size > 10_000


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_measure_reports_time_and_the_n_squared_memory_of_plain_attention(mode):
    plain = measure(Case("plain", 512, heads=2, headdim=16, repeats=1, mode=mode))  # a fresh process
    # S and P of plain attention are 2 x (2 heads x 512^2 float32) = 4 MiB at least.
    assert plain["seconds"] > 0 and plain["peak_bytes"] >= 2 * 2 * 512 * 512 * 4 * 0.9


def test_demo_warns_on_a_busy_machine_before_timing(tmp_path, capsys, monkeypatch):
    from flashattn import cli

    monkeypatch.setattr(os, "getloadavg", lambda: (64.0, 64.0, 64.0))
    monkeypatch.setattr(load, "other_processes_cpu", lambda seconds=0: 0.0)
    # The warning is what is tested: the timings (a process each) and the pictures are the first demo test's.
    monkeypatch.setattr(cli, "measure", lambda case: {**vars(case), "seconds": 1e-3, "peak_bytes": 0})
    monkeypatch.setattr(cli, "_write_explain", lambda page, pictures: [])
    assert main(["demo", "--out", str(tmp_path), "--seqlens", "64", "--repeats", "1", "--traffic-n", "64",
                 "--traffic-d", "16"]) == 0
    assert "flashattn: warning: the machine is busy (1-minute load average 64.00" in capsys.readouterr().err
    assert json.loads((tmp_path / "demo.json").read_text())["meta"]["load_warning"].startswith("the machine is busy")


def test_info_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["info", "--help"])
    text = capsys.readouterr().out
    assert exit_.value.code == 0 and "usage: flashattn info [-h] [--json]" in text and "machine-readable" in text


def test_info_is_not_timed_so_takes_no_reading(capsys, monkeypatch):
    monkeypatch.setattr(load, "check", lambda: pytest.fail("info took a load reading"))
    assert main(["info", "--json"]) == 0 and json.loads(capsys.readouterr().out)["flashattn"]


def test_module_entry_point():
    done = subprocess.run([sys.executable, "-m", "flashattn", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and "flashattn" in done.stdout


@pytest.mark.parametrize("argv,message", [(["decode", "--seqlens", "64"], "unrecognized arguments: --seqlens"),
                                          (["decode", "--causal", "true"], "unrecognized arguments: --causal"),
                                          (["sweep", "--batches", "1"], "unrecognized arguments: --batches"),
                                          (["decode", "--heads-q", "6", "--heads-kv", "4"], "not a multiple")])
def test_bench_rejects_options_of_the_other_sweep(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", *argv, "--device", "cpu"])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv,option", [(["sweep", "--seqlens", "abc"], "--seqlens"),
                                         (["sweep", "--headdims", "64,x"], "--headdims"),
                                         (["sweep", "--dtype", "float8"], "--dtype"),
                                         (["sweep", "--tokens", "0"], "--tokens"),
                                         (["decode", "--batches", "1,-2"], "--batches"),
                                         (["decode", "--cache-seqlens", "list"], "--cache-seqlens"),
                                         (["cpu", "--heads", "four"], "--heads"),
                                         (["cpu", "--plain-limit-gib", "-1"], "--plain-limit-gib"),
                                         (["context-parallel", "--seqlen", "1e9"], "--seqlen"),
                                         (["context-parallel", "--heads", "6", "--heads-kv", "4"], "--heads-kv"),
                                         (["cuda-kernel", "--repeats", "none"], "--repeats")])
def test_a_bad_value_is_a_usage_error_not_a_traceback(argv, option, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: flashattn bench") and option in err
    assert "Traceback" not in err


def test_bench_needs_a_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench"])
    assert exit_.value.code == 2 and "sweep,decode,cpu,context-parallel,cuda-kernel" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["demo"], *(["bench", name] for name in BENCH_COMMANDS)], ids=" ".join)
def test_help_exits_0_and_shows_defaults(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    text = capsys.readouterr().out
    assert exit_.value.code == 0 and f"usage: flashattn {' '.join(argv)}" in text and "(default: " in text


def test_every_option_has_help():
    def parsers(parser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from parsers(sub)

    for parser in parsers(build_parser()):
        for action in parser._actions:
            assert action.help, f"{parser.prog} {'/'.join(action.option_strings) or action.dest} has no help"
