"""``python -m tools.gpu_check``: the time-budgeted GPU check. Its steps run in order of value within a budget, a
step that overruns is stopped without losing what came before, every result lands in at most 8 files of the output
folder (rewritten after each step), and the kernel smoke names what is wrong. Here at toy sizes on the CPU
(``--smoke``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest
from triton_versions import needs_triton

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["info", "smoke", "tests", "headline", "decode", "block-mask", "cuda-kernel"]
STATUSES = ("ok", "skipped (budget)", "stopped (budget)")



def _gpu_check(out: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "tools.gpu_check", "--smoke", "--jobs", "1", *args],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def _returned(out: Path) -> list[Path]:
    """The result files of the output folder, asserting the check's promise: at most 8 files, at most 2 folders
    down (a summary, a JSON and an archive, however many steps ran)."""
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8, files
    assert all(len(p.relative_to(out).parts) <= 3 for p in files), files
    return files


def _archive(out: Path) -> dict[str, bytes]:
    with tarfile.open(out / "gpu-check.tgz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


@needs_triton
def test_smoke_run_fits_its_budget_and_returns_three_files(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    done = _gpu_check(out, "--budget", "90")
    assert sorted(p.name for p in _returned(out)) == ["gpu-check.json", "gpu-check.tgz", "summary.md"]
    summary = json.loads((out / "gpu-check.json").read_text())
    assert summary["seconds"] <= 90, summary["seconds"]
    steps = {s["name"]: s for s in summary["steps"]}
    assert list(steps) == STEPS
    assert all(s["status"] in STATUSES for s in steps.values()), {n: s["status"] for n, s in steps.items()}
    assert steps["smoke"]["status"] == "ok", (out / "summary.md").read_text()
    assert steps["smoke"]["headline"] == "34 cases: 34 ok"
    archive = _archive(out)
    for name in ("summary.md", "gpu-check.json", "info.json", "smoke.json", "smoke.log"):
        assert archive.get(name), name
    assert "info.log" in archive
    assert json.loads(archive["info.json"])["triton_cache"]["triton"]
    if steps["tests"]["status"] == "ok":
        lines = archive["tests.jsonl"].decode().splitlines()
        assert lines and all(json.loads(line)["outcome"] == "passed" for line in lines)
    if steps["headline"]["status"] == "ok":
        headline = json.loads(archive["headline.json"])
        assert headline["meta"]["ceilings"]["matmul_tflops"] > 0
        assert {r["impl"] for r in headline["rows"]} == {"flashattn", "sdpa"}
    # The step table comes last, naming every step.
    tail = done.stdout[done.stdout.rindex("step"):]
    assert all(name in tail for name in STEPS)
    assert done.returncode == (0 if all(s["status"] != "stopped (budget)" for s in steps.values()) else 1)


@needs_triton
def test_a_tiny_budget_ends_on_time_with_later_steps_skipped(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    done = _gpu_check(out, "--budget", "24")  # the least it takes
    summary = json.loads((out / "gpu-check.json").read_text())
    assert summary["seconds"] <= 24
    statuses = [s["status"] for s in summary["steps"]]
    assert statuses[-1] == "skipped (budget)" and "skipped (budget)" in (out / "summary.md").read_text()
    assert all(s in STATUSES for s in statuses), statuses
    assert done.returncode in (0, 1)


def test_an_overrunning_step_is_stopped_and_earlier_results_are_kept(tmp_path, monkeypatch):
    """A step that would run for minutes is interrupted at its allowance; the step before it keeps its files in
    the archive, the overrunning one its log and what it wrote, and the next one still gets its turn."""
    from tools.gpu_check import plan, runner

    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "quick_step.py").write_text("import sys\nfrom pathlib import Path\n"
                                           "Path(sys.argv[1], 'quick.json').write_text('{\"done\": 1}')\n")
    (modules / "slow_step.py").write_text(textwrap.dedent("""
        import sys, time
        from pathlib import Path
        Path(sys.argv[1], 'slow-partial.json').write_text('{"rows": 1}')
        print('started', flush=True)
        time.sleep(300)
    """))
    monkeypatch.setenv("PYTHONPATH", str(modules))
    steps = [plan.Step("quick", ["quick_step", "{out}"], 0.5, 1), plan.Step("slow", ["slow_step", "{out}"], 0.3, 1),
             plan.Step("after", ["quick_step", "{out}"], 0.5, 1), plan.Step("last", ["slow_step", "{out}"], 1.0, 60)]
    work, dest = tmp_path / "work", tmp_path / "dest"
    work.mkdir()
    header = {"device": "test", "date": "today", "versions": "", "budget": 40, "seconds": 0, "commit": "x",
              "command": ["test"]}
    runner.run(steps, work=work, dest=dest, budget=40, header=header)
    assert [s.status for s in steps] == ["ok", "stopped (budget)", "ok", "skipped (budget)"]
    assert steps[1].seconds < 0.3 * 40 + runner.GRACE + 2
    archive = _archive(dest)
    assert json.loads(archive["quick.json"]) == {"done": 1}
    assert json.loads(archive["slow-partial.json"]) == {"rows": 1}
    assert "started" in archive["slow.log"].decode()
    assert "stopped (budget)" in (dest / "summary.md").read_text()


@needs_triton
@pytest.mark.parametrize("fault", ["wrong", "fault", "declined"])
def test_the_kernel_smoke_names_what_went_wrong(fault, monkeypatch):
    """A kernel whose output is off, one that raises, and a call the Triton path refuses: each case's status
    and reason say which and where."""
    import torch

    import flashattn
    from flashattn.errors import ArgumentError
    from tools.gpu_check import smoke

    real = flashattn.flash_attn_func

    def broken(q, k, v, **kwargs):
        if fault == "fault":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if fault == "declined":
            raise ArgumentError("flashattn: the triton path cannot run this call on x: it takes y. Let flashattn "
                                "choose")
        return real(q, k, v, **kwargs) * 1.01

    monkeypatch.setattr(flashattn, "flash_attn_func", broken)
    row = smoke.run_case(smoke.Case("fwd+bwd", "float32", 16, True), smoke.TINY, "cpu")
    assert row["status"] == fault
    assert {"wrong": "out: max error", "fault": "illegal memory access", "declined": "it takes y"}[fault] in \
        row["reason"]
    assert torch.is_grad_enabled()


@needs_triton
def test_an_interrupted_kernel_smoke_still_reports_what_finished(tmp_path):
    """gpu-check stops an overrunning step with SIGINT to its process group: the smoke then writes smoke.json with
    the cases done and the rest marked not run, instead of leaving only its workers' logs."""
    import signal
    import time

    env = {**os.environ, "TRITON_INTERPRET": "1", "FLASHATTN_CPU_KERNEL": "0", "PYTHONPATH": str(ROOT)}
    def child() -> None:
        # SIGINT as gpu-check's parent sees it: a shell's background job inherits it ignored, and the smoke would
        # then run to its end. At the lowest priority, so that on a loaded machine the smoke cannot run through all
        # its tiny cases between its first result and this process's interrupt.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.nice(19)

    proc = subprocess.Popen([sys.executable, "-m", "tools.gpu_check.smoke", "--tiny", "--jobs", "1", "--out",
                             str(tmp_path)], cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, preexec_fn=child)
    deadline = time.monotonic() + 240
    log = tmp_path / "smoke-0.jsonl"
    while not (log.exists() and log.read_text().endswith("\n")) and time.monotonic() < deadline \
            and proc.poll() is None:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)
    proc.communicate(timeout=120)
    data = json.loads((tmp_path / "smoke.json").read_text())
    assert data["counts"]["ok"] >= 1 and data["counts"]["ok"] + data["counts"]["not run"] == len(data["cases"])
    assert data["counts"]["not run"] > 0
    assert all(r["reason"] == "interrupted: the step ran out of time" for r in data["cases"]
               if r["status"] == "not run")
    assert not list(tmp_path.glob("smoke-*.jsonl"))


@needs_triton
def test_the_kernel_smoke_passes_the_real_kernels_and_poisons_their_outputs(monkeypatch):
    """On the interpreted kernels every check passes; and an output the kernel leaves unwritten is NaN, so the
    smoke would call it wrong."""
    import torch

    from tools.gpu_check import smoke

    for kernel in smoke.KERNELS:
        row = smoke.run_case(smoke.Case(kernel, "bfloat16", 16, False), smoke.TINY, "cpu")
        if kernel in smoke.GPU_ONLY:  # the Hopper tier: declined, and why (d=16 runs padded; the tiny case's
            # queries are too few for its 128-row programs)
            assert row["status"] == "declined" and "decode-shaped" in row["reason"], row
            continue
        assert row["status"] == "ok", row
    with smoke.poisoned():
        assert torch.empty(3).isnan().all() and torch.empty_like(torch.ones(2)).isnan().all()
        assert not torch.empty(3, dtype=torch.int32).is_floating_point()
    assert not torch.empty(3).fill_(0).isnan().any()


@needs_triton
def test_the_tier_case_runs_in_a_child_that_a_hang_cannot_stop_its_worker(monkeypatch):
    """On a GPU the tier's case (kernels whose barriers can hang) runs in a child process: its outcome comes back
    as the worker's own would (here on the CPU: declined, and why), and a child past its time limit is a wrong
    result that names the likely hang."""
    from flashattn.errors import ArgumentError
    from tools.gpu_check import smoke, tier_case

    case = smoke.Case("tier", "bfloat16", 16, False)
    with pytest.raises(ArgumentError, match="path cannot run this call: decode-shaped"):
        tier_case._in_child(case, smoke.TINY, "cpu")
    monkeypatch.setattr(tier_case, "CHILD_TIMEOUT_S", 0.01)
    with pytest.raises(AssertionError, match="no result within 0.01 s"):
        tier_case._in_child(case, smoke.TINY, "cpu")


@needs_triton
def test_a_one_pass_case_where_two_passes_run_is_declined(monkeypatch):
    """On sm_90 at head dim 128 the 16-bit one-pass tiles are declined (tables.ONE_PASS): the case says so instead
    of timing two passes under its name (or stopping its worker)."""
    from flashattn.backends.triton import launch
    from tools.gpu_check import smoke

    monkeypatch.setattr(launch, "target_arch", lambda: 90)
    row = smoke.run_case(smoke.Case("one-pass", "bfloat16", 128, False), smoke.TINY, "cpu")
    assert row["status"] == "declined" and "two passes run on sm90 at head dim 128" in row["reason"], row


@needs_triton
def test_the_cache_probe_compiles_for_a_target_and_hits_the_second_time(tmp_path):
    """What decides whether a Triton cache built here is reused on the GPU machine: the same key facts, and a
    probe kernel that hits the carried cache."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    runs = [json.loads(subprocess.run(
        [sys.executable, "-m", "tools.gpu_check.cache", "--facts", "--probe", str(tmp_path), "--target", "90"],
        capture_output=True, text=True, check=True, cwd=ROOT, env=env, timeout=300).stdout) for _ in range(2)]
    assert [r["probe"]["hit"] for r in runs] == [False, True]
    assert runs[0]["probe"]["hash"] == runs[1]["probe"]["hash"]
    facts = runs[0]["facts"]
    assert facts["python"] == ".".join(map(str, sys.version_info[:3]))
    assert len(facts["triton_key"]) == 16 and facts["ptxas"]["version"]


def test_test_paths_can_be_limited_to_the_triton_path(monkeypatch):
    """FLASHATTN_TEST_PATHS=triton (gpu-check's test step) deselects the cpu and torch paths' tests and keeps the
    rest; an unknown path name is a usage error, not a silent empty run."""
    from types import SimpleNamespace

    import conftest

    def item(path=None):
        return SimpleNamespace(name=str(path), callspec=SimpleNamespace(params={} if path is None else {"path": path}))

    deselected = []
    config = SimpleNamespace(hook=SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)))
    items = [item("triton"), item("cpu"), item("torch"), item(), SimpleNamespace(name="plain")]
    monkeypatch.setenv("FLASHATTN_TEST_PATHS", "triton")
    conftest.pytest_collection_modifyitems(config, items)
    assert [i.name for i in items] == ["triton", "None", "plain"]
    assert [i.name for i in deselected] == ["cpu", "torch"]
    monkeypatch.setenv("FLASHATTN_TEST_PATHS", "trition")
    with pytest.raises(pytest.UsageError, match="FLASHATTN_TEST_PATHS names trition"):
        conftest.pytest_collection_modifyitems(config, [item("cpu")])


def test_without_a_gpu_the_full_check_is_refused(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    done = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--out", str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 2
    assert "--smoke" in done.stderr
    assert not (tmp_path / "x").exists()


def test_the_cache_index_names_each_kernel_and_what_was_carried(tmp_path):
    """After a GPU run, ``triton-cache.json`` lists the cache's kernels (carried or compiled there) and keeps the IR
    of a few forward kernels compiled on the device, to diff against an offline build whose keys missed."""
    from tools.gpu_check.runner import cache_index

    cache, work = tmp_path / "cache", tmp_path / "work"
    work.mkdir()
    for key, name in (("aa11", "attention_forward_kernel"), ("bb22", "attention_backward_dq_kernel"),
                      ("cc33", "attention_forward_kernel")):
        (cache / key).mkdir(parents=True)
        (cache / key / f"{name}.json").write_text("{}")
        (cache / key / f"__grp__{name}.json").write_text("{}")
        (cache / key / f"{name}.source").write_text(f"module {key}")
    cache_index(cache, work, carried={"cc33"})
    index = json.loads((work / "triton-cache.json").read_text())
    assert [(e["hash"], e["name"], e["carried"]) for e in index["entries"]] == [
        ("aa11", "attention_forward_kernel", False), ("bb22", "attention_backward_dq_kernel", False),
        ("cc33", "attention_forward_kernel", True)]
    assert index["carried_present"] == 1
    assert [p.name for p in (work / "triton-ir").iterdir()] == ["aa11.source"]


def test_the_host_step_reads_each_budget_against_sdpa(tmp_path):
    """gpu-check's host step: each budgeted entry point's microseconds per call beside SDPA's, and the verdict."""
    from tools.gpu_check.headlines import headline
    from tools.gpu_check.plan import Step, full

    assert any(step.name == "host" and "--mode" in step.args for step in full(4))
    budgets = {"fwd": {"us": 12.5, "limit_us": 20.0, "against": "sdpa", "met": True},
               "train": {"us": 95.0, "limit_us": 80.0, "against": "sdpa", "met": False},
               "decode": {"us": 30.0, "limit_us": None, "against": "sdpa", "met": False}}
    (tmp_path / "host.json").write_text(json.dumps({"meta": {"budgets": budgets}, "rows": []}))
    step = Step("host", [], 0.1, 1)
    text = headline(tmp_path, step)
    assert text == "fwd 12.5 us vs SDPA 20 (met); train 95 us vs SDPA 80 (not met); decode 30 us", text
    assert step.extra["budgets"] == budgets
