"""The budgeted run of gpu-check's steps and its command line (the package docstring says what it does)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from . import clock, headlines, pack, plan
from .plan import ROOT, Step

DEFAULT_BUDGET = 420.0
GRACE = 8.0  # seconds between the interrupt and the kill of a step that overran
RESERVE = GRACE + 4.0  # kept back from the steps: the last grace period and the final packing


def _environment(step: Step, work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({k: v.format(out=work) for k, v in step.env.items()})
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    env[clock.ENV] = str(work / f"{step.name}.compile.jsonl")
    return env


def run_step(step: Step, work: Path, allowed: float) -> None:
    """Run ``step`` for at most ``allowed`` seconds (its whole process group), its output into ``<name>.log``."""
    step.allowed = allowed
    args = [a.format(out=work, allowed=int(allowed)) for a in step.args]  # {allowed}: a step's own budget
    log = (work / f"{step.name}.log").open("w")
    stdout = (work / step.stdout_to).open("w") if step.stdout_to else log
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "tools.gpu_check.step", *args], stdout=stdout,
                            stderr=log if step.stdout_to else subprocess.STDOUT, env=_environment(step, work),
                            cwd=ROOT, start_new_session=True, preexec_fn=_interruptible)
    try:
        code = proc.wait(timeout=max(allowed, 0.1))
        step.status = "ok" if code == 0 else f"failed ({code})"
    except subprocess.TimeoutExpired:
        _stop(proc)
        step.status = "stopped (budget)"
    finally:
        step.seconds = time.perf_counter() - start
        log.close()
        if stdout is not log:
            stdout.close()
    if step.stdout_to and step.status != "ok":
        log_text = (work / step.stdout_to).read_text()
        with (work / f"{step.name}.log").open("a") as f:  # a failed step's stdout belongs in its log
            f.write("\n--- stdout ---\n" + log_text)
    events = work / f"{step.name}.compile.jsonl"
    step.compile = clock.total(events)  # the sums go into gpu-check.json; the events themselves are noise
    events.unlink(missing_ok=True)
    step.headline = headlines.headline(work, step)


def _interruptible() -> None:
    """In a step's process before it starts: SIGINT back to its default, which a shell's background job (gpu-check
    started with ``&``) inherits ignored, so that ``_stop``'s interrupt reaches the step."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT to the step's process group (pytest writes its report, benchmarks their partial rows), then kill."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=GRACE)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run(steps: list[Step], *, work: Path, dest: Path, budget: float, header: dict,
        after_step: Callable[[], None] | None = None) -> list[Step]:
    """Every step in order within ``budget`` seconds; ``after_step()`` after each (a caller's own results), then
    the results rewritten into ``dest``."""
    start = time.perf_counter()
    tool = header.get("tool", "gpu-check")
    for step in steps:
        remaining = budget - RESERVE - (time.perf_counter() - start)
        allowed = min(step.share * budget, remaining)
        if allowed < step.least:
            step.status = "skipped (budget)"
            print(f"[{tool}] {step.name}: skipped (budget: {max(remaining, 0):.0f} s left, needs "
                  f"{step.least:.0f})", flush=True)
        else:
            print(f"[{tool}] {step.name} (up to {allowed:.0f} s) ...", flush=True)
            run_step(step, work, allowed)
            print(f"[{tool}] {step.name}: {step.status} in {step.seconds:.0f} s. {step.headline}", flush=True)
        header["seconds"] = time.perf_counter() - start
        if after_step is not None:
            after_step()
        pack.write(dest, work, steps, header)
    return steps


def carried_cache() -> dict | None:
    """Unpack a prebuilt Triton cache (``make gpu-cache``: ``.gpu-cache/triton.tgz`` in the checkout) into a
    temporary folder, for every step's ``TRITON_CACHE_DIR``; None when the checkout has none or one is set already."""
    archive = ROOT / ".gpu-cache" / "triton.tgz"
    if not archive.is_file() or os.environ.get("TRITON_CACHE_DIR"):
        return None
    target = Path(tempfile.mkdtemp(prefix="triton-cache-"))
    with tarfile.open(archive) as tar:
        tar.extractall(target, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return {"dir": str(target / "triton"), "entries": sum(1 for _ in (target / "triton").iterdir())}


def cache_index(cache_dir: Path, work: Path, carried: set[str], samples: int = 3) -> None:
    """``triton-cache.json`` in the work folder: every kernel in the Triton cache the steps used, by name and key,
    and whether the prebuilt cache brought it (``carried``); with the IR of a few forward kernels compiled here
    (``triton-ir/``): what to diff against a cache built offline when its keys do not match."""
    entries, copied = [], 0
    for entry in sorted(p for p in cache_dir.iterdir() if p.is_dir()) if cache_dir.is_dir() else []:
        names = [f.name.removesuffix(".json") for f in entry.glob("*.json") if not f.name.startswith("__grp__")]
        entries.append({"hash": entry.name, "name": names[0] if names else None, "carried": entry.name in carried})
        if entry.name not in carried and names and names[0] == "attention_forward_kernel" and copied < samples:
            for ir in [*entry.glob("*.ttir"), *entry.glob("*.source")][:1]:
                (work / "triton-ir").mkdir(exist_ok=True)
                shutil.copy(ir, work / "triton-ir" / f"{entry.name[:16]}{ir.suffix}")
                copied += 1
    hits = sum(e["carried"] for e in entries)
    (work / "triton-cache.json").write_text(json.dumps({"dir": str(cache_dir), "carried": len(carried),
                                                         "entries": entries, "carried_present": hits}, indent=1))


def _commit() -> str:
    """The checkout's commit, ``-dirty`` when the working tree differs from it."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=ROOT,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def _versions() -> str:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    return f"Python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton_version}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                   help=f"seconds for the whole run, compiles included (default {DEFAULT_BUDGET:.0f})")
    p.add_argument("--out", default="benchmarks/results/gpu-check-{device}-{date}",
                   help="the output folder, {device} and {date} filled in (default %(default)s); the OUT "
                        "environment variable, when set, names it instead")
    p.add_argument("--smoke", action="store_true", help="every step at toy sizes on the CPU (no GPU needed)")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1),
                   help="processes for the kernel smoke and the tests")
    p.add_argument("--steps", default=None,
                   help="comma-separated: only these steps, in plan order (a targeted rerun); default all")


class Start(NamedTuple):
    """Where a run's results go and what it says of itself: ``dest`` (the output folder: $OUT when set, else
    ``--out``), ``work`` (where the steps write: a temporary folder when $OUT is set, else ``dest``), the ``header``
    of its summary, and the steps chosen."""

    dest: Path
    work: Path
    header: dict
    steps: list[Step]


def start(args: argparse.Namespace, *, tool: str, steps: list[Step]) -> Start | int:
    """The set-up gpu-check and gpu-tune share: the device check, ``--budget``'s floor, the folders, the header and
    ``--steps``; an exit status (2) with the reason on stderr where the run cannot start."""
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print(f"{tool}: no CUDA device here; --smoke runs every step at toy sizes on the CPU", file=sys.stderr)
        return 2
    if args.budget < 2 * RESERVE:
        print(f"{tool}: --budget must be at least {2 * RESERVE:.0f} seconds, got {args.budget:g}", file=sys.stderr)
        return 2
    device = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    slug = "-".join(device.lower().replace("nvidia", "").replace("(smoke)", "smoke").split())
    if os.environ.get("OUT"):  # an output folder for the result files alone: the steps work in a temporary one
        dest = Path(os.environ["OUT"])
        work = Path(tempfile.mkdtemp(prefix=f"{tool}-"))
    else:
        dest = work = Path(args.out.format(device=slug, date=date))
    work.mkdir(parents=True, exist_ok=True)
    header = {"tool": tool, "device": device, "date": date, "versions": _versions(), "budget": args.budget,
              "seconds": 0.0, "commit": _commit(), "command": args.command_line, "smoke": args.smoke}
    if args.steps:
        chosen = args.steps.split(",")
        unknown = [name for name in chosen if name not in {s.name for s in steps}]
        if unknown:
            print(f"{tool}: --steps names {', '.join(unknown)}; the steps are {', '.join(s.name for s in steps)}",
                  file=sys.stderr)
            return 2
        steps = [s for s in steps if s.name in chosen]
    return Start(dest, work, header, steps)


def finish(begun: Start, *, also: str = "") -> int:
    """The findings, the line saying where the results are (``also``: files beyond the three) and the step table,
    printed last; the exit status (1 when a step failed or was stopped)."""
    steps, header = begun.steps, begun.header
    print()
    print(pack.details(steps, begun.work))
    print(f"{header['tool']} on {header['device']} in {header['seconds']:.0f} s of {header['budget']:.0f}; results "
          f"in {begun.dest}/ ({', '.join(pack.files(header['tool']))}{also})")
    print(pack.step_table(steps))
    return 0 if all(s.status in ("ok", "skipped (budget)") for s in steps) else 1


def command(args: argparse.Namespace) -> int:
    begun = start(args, tool="gpu-check", steps=(plan.smoke if args.smoke else plan.full)(args.jobs))
    if isinstance(begun, int):
        return begun
    dest, work, header, steps = begun
    cache = carried_cache()
    if cache:
        header["triton_cache"] = cache
        for step in steps:
            step.env.setdefault("TRITON_CACHE_DIR", cache["dir"])
    cache_dir = Path(cache["dir"]) if cache else Path(os.environ.get("TRITON_CACHE_DIR")
                                                      or Path.home() / ".triton" / "cache")
    carried = {p.name for p in cache_dir.iterdir()} if cache else set()
    try:
        run(steps, work=work, dest=dest, budget=args.budget, header=header)
        if not args.smoke:
            cache_index(cache_dir, work, carried)
            pack.write(dest, work, steps, header)
    finally:
        if cache:
            shutil.rmtree(cache_dir.parent, ignore_errors=True)
    return finish(begun)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    package_doc = sys.modules[__package__].__doc__
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_check", description=package_doc.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.command_line = ["python", "-m", "tools.gpu_check", *argv]
    return command(args)
