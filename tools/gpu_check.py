"""``python -m tools.gpu_check``: everything a session with a GPU must run, in one command, into one folder. A
developer's tool, run at a checkout's root (it runs the test suite): ``make gpu-check``.

    python -m tools.gpu_check --out benchmarks/results/gpu-check-{device}-{date}    # on a GPU (make gpu-check)
    python -m tools.gpu_check --smoke --out /tmp/gpu-check                          # anywhere: every step, tiny

Steps, each a subprocess with its own time limit, its output in ``<out>/<step>.log``:

- ``info``: versions, devices, compilers, which backend a call gets (``info.json``);
- ``health``, ``profile``: the offline kernel health report and main-loop profile (``health.json``,
  ``profile.json``), compiled on the CPU in the background while the GPU tests run;
- ``tests``: the GPU test suite, bf16 included (``tests.xml``, JUnit);
- ``cuda-kernel``: the CUDA C++ kernel's compile, accuracy and timing (``cuda-kernel-*.json``);
- ``sweep-d64``, ``sweep-d128``: ours against SDPA's flash, efficient and cuDNN backends and compiled
  FlexAttention, forward and backward, causal and not, N 512-16k at 16k tokens (``sweep-d*.json`` and plots);
- ``decode``: one decode step against a KV cache, as a fraction of copy bandwidth (``decode.json``);
- ``block-mask``: 16 documents in one sequence as a FlexAttention ``BlockMask``, against varlen and a dense mask
  (``block-mask.json``).

Then one table: each step's status, seconds and headline, also written to ``gpu-check.json``. ``--smoke`` runs
every step at toy sizes on the CPU (the tests cover it); without ``--smoke`` a machine without CUDA is refused.
Exit status 1 when a step failed or ran out of time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from flashattn.tables import table

# The suites that run kernels on the GPU; the rest (docs, examples, offline compiles) need no GPU.
GPU_TESTS = ("test_triton.py", "test_cuda_backend.py", "test_kvcache.py", "test_varlen.py", "test_dropin.py",
             "test_flash_api.py", "test_sdpa.py", "test_autograd.py", "test_nn.py", "test_backends.py",
             "test_merge.py", "test_sinks.py", "test_value_head_dim.py", "test_block_mask.py")
SWEEP_BASELINES = "sdpa-flash,sdpa-efficient,sdpa-cudnn,flex"


@dataclass
class Step:
    name: str
    args: list[str]  # after ``python -m``
    timeout: float
    background: bool = False  # CPU-only: runs beside the first foreground step
    interpreter_off: bool = False  # compiles offline: TRITON_INTERPRET must not reach it
    stdout_to: str | None = None  # file (in the output folder) that receives stdout
    status: str = "pending"
    seconds: float = 0.0
    headline: str = ""
    extra: dict = field(default_factory=dict)


def _device_arch() -> str:
    """The GPU's architecture for the health step (every table compiled for the card the run measures), else
    sm_80 and sm_90."""
    if torch.cuda.is_available():
        from flashattn.backends.triton import device_arch

        return str(device_arch(0))  # 10 x major + minor, or a ROCm GPU's gfx name
    return "80,90"


def steps(out: Path, smoke: bool, jobs: int) -> list[Step]:
    py = ["flashattn"]
    bench = [*py, "bench"]
    if smoke:
        return [
            Step("info", [*py, "info", "--json"], 120, stdout_to="info.json"),
            Step("health", ["tools.offline.health", "--head-dims", "64", "--tables", "forward",
                            "--variants", "plain", "--archs", _device_arch(), "--json", str(out / "health.json")],
                 300, background=True, interpreter_off=True),
            Step("profile", ["tools.offline.profile", "--head-dims", "64", "--causal", "false",
                             "--json", str(out / "profile.json")], 300, background=True, interpreter_off=True),
            Step("tests", ["pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={out / 'tests.xml'}",
                           str(_tests_dir() / "test_info.py")], 300),
            Step("cuda-kernel", [*bench, "cuda-kernel", "--smoke", "--out", str(out)], 300, interpreter_off=True),
            Step("sweep-d16", [*bench, "sweep", "--device", "cpu", "--seqlens", "64", "--headdims", "16",
                               "--causal", "false", "--modes", "fwd", "--baselines", "sdpa", "--repeats", "1",
                               "--tokens", "64", "--hidden", "32", "--in-process", "--quiet", "--out", str(out),
                               "--name", "sweep-d16"], 300),
            Step("decode", [*bench, "decode", "--device", "cpu", "--batches", "1", "--cache-lens", "64",
                            "--heads-q", "2", "--heads-kv", "1", "--headdim", "16", "--repeats", "1", "--quiet",
                            "--out", str(out), "--name", "decode"], 300),
            Step("block-mask", [*bench, "block-mask", "--device", "cpu", "--seqlens", "512", "--docs", "4",
                                "--heads", "2", "--headdim", "16", "--repeats", "1", "--quiet", "--out", str(out),
                                "--name", "block-mask"], 300),
        ]
    sweep = [*bench, "sweep", "--modes", "fwd,bwd", "--baselines", SWEEP_BASELINES, "--quiet", "--out", str(out)]
    return [
        Step("info", [*py, "info", "--json"], 60, stdout_to="info.json"),
        Step("health", ["tools.offline.health", "--jobs", str(jobs), "--head-dims",
                        "16,32,64,128,256,192:128,256:128,96:64,128:64", "--block-masks", "both", "--archs",
                        _device_arch(), "--json", str(out / "health.json")], 540, background=True,
             interpreter_off=True),
        Step("profile", ["tools.offline.profile", "--json", str(out / "profile.json")], 300,
             background=True, interpreter_off=True),
        Step("tests", ["pytest", "-q", "-n", str(min(jobs, 8)), "-p", "no:cacheprovider",
                       f"--junitxml={out / 'tests.xml'}", *(str(_tests_dir() / t) for t in GPU_TESTS)], 240),
        Step("cuda-kernel", [*bench, "cuda-kernel", "--quiet", "--out", str(out)], 90),
        Step("sweep-d64", [*sweep, "--headdims", "64", "--name", "sweep-d64"], 150),
        Step("sweep-d128", [*sweep, "--headdims", "128", "--name", "sweep-d128"], 150),
        Step("decode", [*bench, "decode", "--quiet", "--out", str(out), "--name", "decode"], 90),
        Step("block-mask", [*bench, "block-mask", "--dtype", "bfloat16", "--quiet", "--out", str(out),
                            "--name", "block-mask"], 150),
    ]


ROOT = Path(__file__).resolve().parents[1]  # the checkout: tools/ and tests/ live here


def _tests_dir() -> Path:
    return ROOT / "tests"


def _run(step: Step, out: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not (step.interpreter_off and k == "TRITON_INTERPRET")}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))  # tools.* from anywhere
    log = out / f"{step.name}.log"
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", *step.args], capture_output=True, text=True, env=env,
                              timeout=step.timeout)
        step.status = "ok" if done.returncode == 0 else f"failed ({done.returncode})"
        stdout, stderr = done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:
        step.status = f"timeout ({step.timeout:.0f} s)"
        stdout, stderr = _text(e.stdout), _text(e.stderr)
    step.seconds = time.perf_counter() - start
    log.write_text(stdout + ("\n--- stderr ---\n" + stderr if stderr else ""))
    if step.stdout_to and step.status == "ok":
        (out / step.stdout_to).write_text(stdout)
    try:
        step.headline = HEADLINES.get(step.name.split("-")[0], lambda o, s: "")(out, step)
    except Exception as e:  # a summary that cannot be read is itself a finding, not a crash
        step.headline = f"(no summary: {type(e).__name__}: {e})"


def _text(x) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def _tests(out: Path, step: Step) -> str:
    suites = ET.parse(out / "tests.xml").getroot()
    suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
    total, failures, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    step.extra["failed"] = failed
    return f"{total - failures - errors - skipped} passed, {failures + errors} failed, {skipped} skipped"


def _health(out: Path, step: Step) -> str:
    from flashattn.backends.triton.families import arch_name

    rows = json.loads((out / "health.json").read_text())
    bad = [r for r in rows if r["problems"]]
    step.extra["problems"] = [f"{r['kernel']}{' [block mask]' if r.get('block_mask') else ''} {arch_name(r['arch'])} "
                              f"d{r['head_dim']} {r['variant']}: "
                              f"{'; '.join(r['problems'])}" for r in bad]
    return f"{len(rows)} configs, {len(bad)} with problems"


def _profile(out: Path, step: Step) -> str:
    rows = json.loads((out / "profile.json").read_text())
    per = {}
    for r in rows:
        per.setdefault((r["head_dim"], r["causal"]), {})[r["kernel"].split("_")[-2]] = r["per_score"]
    fwd = max(p.get("forward", 0) for p in per.values())
    bwd = max(p.get("dkdv", 0) + p.get("dq", 0) for p in per.values())
    return f"inst/score (sm_90): forward <= {fwd:.3f}, dK/dV + dQ <= {bwd:.3f}"


def _bench_rows(out: Path, pattern: str) -> list[dict]:
    found = sorted(out.glob(pattern))
    return json.loads(found[-1].read_text())["rows"] if found else []


def _sweep(out: Path, step: Step) -> str:
    rows = [r for r in _bench_rows(out, f"{step.name}.json") if r.get("speedup")]
    if not rows:
        return "no point with both ours and a baseline measured"
    worst = min(rows, key=lambda r: r["speedup"])
    step.extra["speedups"] = {f"{r['mode']} N={r['seqlen']} {'causal' if r['causal'] else 'full'}":
                              round(r["speedup"], 3) for r in rows}
    faster = sum(r["speedup"] >= 1 for r in rows)
    return (f"ours faster than the best baseline at {faster}/{len(rows)} points; worst {worst['speedup']:.2f}x "
            f"({worst['mode']}, N={worst['seqlen']}, {'causal' if worst['causal'] else 'full'}, vs "
            f"{worst['best_baseline']})")


def _decode(out: Path, step: Step) -> str:
    data = json.loads((out / "decode.json").read_text())
    goal = data.get("meta", {}).get("goal")
    rows = [r for r in data["rows"] if r.get("speedup")]
    best = max((r["speedup"] for r in rows), default=0)
    text = f"{len(rows)} cases, best speed-up vs SDPA {best:.3g}x"
    if goal and goal.get("bw_fraction") is not None:
        verdict = "met" if goal["met"] else "not met"
        text += f"; {goal['bw_fraction']:.0%} of copy bandwidth at the goal point ({verdict})"
    return text


def _block_mask(out: Path, step: Step) -> str:
    data = json.loads((out / "block-mask.json").read_text())
    points = [p for p in data["summary"] if p.get("vs_varlen") is not None or p.get("vs_dense") is not None]
    if not points:
        return "no complete case"
    top = max(p["seqlen"] for p in points)
    parts = [f"{p['mode']} {p['vs_varlen'] or float('nan'):.2f}x varlen, {p['vs_dense'] or float('nan'):.3f}x dense"
             for p in points if p["seqlen"] == top]
    return f"N={top}: " + "; ".join(parts) + " (targets <= 1.2x, <= 0.125x)"


def _cuda_kernel(out: Path, step: Step) -> str:
    found = sorted(out.glob("cuda-kernel-*.json"))
    data = json.loads(found[-1].read_text())
    accuracy = data.get("accuracy", [])
    bad = [a for a in accuracy if not a["passes"]]
    step.extra["compile"] = data["meta"].get("compile")
    if not accuracy:
        return "NVRTC compile for sm_90 only (smoke)"
    return f"compiled; {len(accuracy) - len(bad)}/{len(accuracy)} accuracy checks within 2x SDPA's error"


HEADLINES = {"tests": _tests, "health": _health, "profile": _profile, "sweep": _sweep, "decode": _decode,
             "block": _block_mask, "cuda": _cuda_kernel, "info": lambda out, step: "info.json"}


def run(out: Path, *, smoke: bool, jobs: int) -> list[Step]:
    """Run every step into ``out``: the background ones in a thread beside the foreground ones."""
    out.mkdir(parents=True, exist_ok=True)
    plan = steps(out, smoke, jobs)
    background = [s for s in plan if s.background]
    worker = threading.Thread(target=lambda: [_run(s, out) for s in background])
    worker.start()
    for s in (s for s in plan if not s.background):
        print(f"[gpu-check] {s.name} ...", flush=True)
        _run(s, out)
        print(f"[gpu-check] {s.name}: {s.status} in {s.seconds:.0f} s", flush=True)
    worker.join()
    return plan


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="gpu-check-{device}-{date}",
                   help="folder for every result, log and the summary; {device} and {date} are filled in")
    p.add_argument("--smoke", action="store_true", help="every step at toy sizes on the CPU (no GPU needed)")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1),
                   help="processes for the offline compiles and the tests")


def command(args: argparse.Namespace) -> int:
    if not args.smoke and not torch.cuda.is_available():
        print("tools.gpu_check: no CUDA device here; --smoke runs every step at toy sizes on the CPU",
              file=sys.stderr)
        return 2
    device = "cpu" if args.smoke else torch.cuda.get_device_name()
    slug = "-".join(device.lower().replace("nvidia", "").split())
    out = Path(args.out.format(device=slug, date=datetime.date.today().isoformat()))
    start = time.perf_counter()
    plan = run(out, smoke=args.smoke, jobs=args.jobs)
    total = time.perf_counter() - start
    print(f"\ngpu-check on {device} in {total:.0f} s "
          f"({'smoke' if args.smoke else 'full'}), results in {out}/")
    print(table([[s.name, s.status, f"{s.seconds:.0f}", s.headline] for s in plan],
                       ["step", "status", "seconds", "summary"]))
    summary = {"device": device, "smoke": args.smoke, "seconds": round(total, 1), "command": args.command_line,
               "steps": [asdict(s) for s in plan]}
    (out / "gpu-check.json").write_text(json.dumps(summary, indent=1))
    return 0 if all(s.status == "ok" for s in plan) else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_check", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.command_line = ["python", "-m", "tools.gpu_check", *argv]
    return command(args)


if __name__ == "__main__":
    sys.exit(main())
