"""One tuning step: ``python -m tools.gpu_tune.sweep --group backward --dtype bfloat16 --head-dim 128 --out DIR``.

For each kernel of the group (``problems.GROUPS``; the backward's dK/dV first, then dQ with dK/dV's winner), every
candidate (``space.candidates``) is compiled in parallel worker processes (their Triton cache is this process's,
so the timed launches load instead of compiling), its health read from what the device compiled, its results
checked against the table's config, and then timed here: the median of ``--repeats`` launches, each with CUDA
events, cycling through input sets so that no call finds its inputs in the L2 cache, causal and not. The winner
has the lowest geometric mean of its times over the table config's. ``<name>.json`` in ``--out`` is rewritten after
every candidate, so a step stopped at any moment keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from .problems import GROUPS, Problem
from .space import KernelConfig, candidates, compiled, compiled_health

KERNEL_NAMES = {"forward": "attention_forward_kernel", "decode": "attention_forward_kernel",
                "dkdv": "attention_backward_dkdv_kernel", "dq": "attention_backward_dq_kernel"}
AGREEMENT = 0.02  # a candidate's results may differ from the table config's by this much of their largest value


def config_list(cfg: KernelConfig) -> list[int]:
    """A config as the measured files write it: four integers, a fifth where dK/dV's head dim is split."""
    return [cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, *([cfg.split_d] if cfg.split_d > 1 else [])]


def _arch(smoke: bool):
    """This GPU's architecture (10 x major + minor, or its gfx name); under the interpreter, sm_90 stands in."""
    if smoke:
        return 90
    if torch.version.hip:
        return torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
    major, minor = torch.cuda.get_device_capability()
    return 10 * major + minor


def family_name(smoke: bool) -> str:
    from flashattn.backends.triton.families import family

    return family(_arch(smoke)).name


def _shipped(kernel: str, problem: Problem):
    """The config the launcher gives a plain call of ``problem`` today (table, or a measured entry already
    shipped)."""
    from flashattn.backends.triton import configs

    d = configs.table_key(problem.head_dim, problem.head_dim)
    return configs.lookup(kernel, _arch(problem.smoke), d, "plain")


def _forcing(fixed: dict):
    """A context forcing each kernel in ``fixed`` ({kernel: KernelConfig}) to its config."""
    from contextlib import ExitStack

    from flashattn.backends.triton import configs

    stack = ExitStack()
    for kernel, cfg in fixed.items():
        stack.enter_context(configs.use(cfg, (kernel,)))
    return stack


def _results(problem: Problem, fixed: dict, causal: bool, inputs: dict):
    with _forcing(fixed):
        out = problem.call(inputs, causal=causal)()
    return [t.float() for t in (out if isinstance(out, (tuple, list)) else [out])]


def _compile_one(args) -> dict:
    """In a worker: launch ``cfg`` once at the problem's sizes (both causal and not), so it compiles into the shared
    Triton cache; its health, or the error that stopped it."""
    problem, kernel, fixed, family = args
    before = {id(k) for _, k in compiled()}
    inputs = problem.inputs(0)
    try:
        for causal in (False, True):
            _results(problem, fixed, causal, inputs)
    except Exception as e:  # OutOfResources (shared memory), a compiler failure: the candidate is out
        return {"problems": [f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"]}
    return compiled_health((KERNEL_NAMES[kernel],), before, family)


def _time(calls: list, repeats: int, smoke: bool) -> float:
    """Median milliseconds of the ``calls`` (one per input set, cycled through), after a warm-up."""
    for call in calls[: 1 if smoke else 2]:
        call()
    samples = []
    for i in range(repeats):
        call = calls[i % len(calls)]
        if smoke:
            start = time.perf_counter()
            call()
            samples.append((time.perf_counter() - start) * 1e3)
            continue
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        call()
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end))
    return statistics.median(samples)


class Sweep:
    """The step's state, written to ``<out>/<name>.json`` after every candidate."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.problem = Problem(args.group, args.dtype, args.head_dim, smoke=args.smoke)
        self.family = family_name(args.smoke)
        self.path = Path(args.out) / f"{args.name}.json"
        self.data = {"name": args.name, "family": self.family, "group": args.group, "dtype": args.dtype,
                     "head_dim": args.head_dim, "problem": vars(self.problem), "rows": [], "winners": {}}
        l2 = 0 if args.smoke else getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
        self.sets = [self.problem.inputs(seed) for seed in range(self.problem.rotation(l2))]

    def write(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.partial")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)

    def tune(self, kernel: str, fixed: dict) -> None:
        shipped = _shipped(kernel, self.problem)
        todo = candidates(kernel, self.problem.head_dim, self.family, shipped=shipped, smoke=self.args.smoke,
                          limit=self.args.limit)
        jobs = [(self.problem, kernel, {**fixed, kernel: cfg}, self.family) for cfg in todo]
        if self.args.jobs > 1 and not self.args.smoke:
            import multiprocessing

            with ProcessPoolExecutor(self.args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
                healths = list(pool.map(_compile_one, jobs))
        elif self.args.smoke:  # the interpreter compiles nothing: no health to read
            healths = [{} for _ in jobs]
        else:
            healths = [_compile_one(job) for job in jobs]
        reference = {c: _results(self.problem, {**fixed, kernel: shipped}, c, self.sets[0]) for c in (False, True)}
        base = None
        for cfg, health in zip(todo, healths, strict=True):
            row = {"kernel": kernel, "config": config_list(cfg),
                   "shipped": cfg == shipped, "health": health, "ms": {}}
            self.data["rows"].append(row)
            if health.get("problems"):
                row["status"] = "unhealthy"
                self.write()
                continue
            row["status"] = self._measure(row, {**fixed, kernel: cfg}, reference)
            if cfg == shipped:
                base = row["ms"]
            if row["status"] == "ok" and base:
                row["vs_shipped"] = math.exp(statistics.fmean(math.log(row["ms"][c] / base[c]) for c in base))
                best = self.data["winners"].get(kernel)
                if best is None or row["vs_shipped"] < best["vs_shipped"]:
                    self.data["winners"][kernel] = {**row, "shipped_config": [shipped.block_m, shipped.block_n,
                                                                              shipped.num_warps, shipped.num_stages],
                                                    "shipped_ms": base}
            self.write()

    def _measure(self, row: dict, forced: dict, reference: dict) -> str:
        for causal in (False, True):
            try:
                got = _results(self.problem, forced, causal, self.sets[0])
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                return "failed"
            worst = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-6)) for a, b in
                        zip(got, reference[causal], strict=True))
            if not math.isfinite(worst) or worst > AGREEMENT:
                row["error"] = f"differs from the table config's results by {worst:.3g} of their largest"
                return "wrong"
            with _forcing(forced):
                calls = [self.problem.call(s, causal=causal) for s in self.sets]
                ms = _time(calls, self.args.repeats, self.args.smoke)
            key = "causal" if causal else "full"
            row["ms"][key] = ms
            row.setdefault("tflops", {})[key] = self.problem.flops(causal=causal) / ms / 1e9
        return "ok"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.gpu_tune.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--group", required=True, choices=tuple(GROUPS))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--out", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--limit", type=int, default=24, help="the most candidates per kernel")
    p.add_argument("--smoke", action="store_true", help="toy sizes on the CPU, under Triton's interpreter")
    args = p.parse_args(argv)
    if args.smoke:
        args.repeats = 1
    sweep = Sweep(args)
    fixed: dict = {}
    try:
        for kernel in GROUPS[args.group]:
            sweep.tune(kernel, fixed)
            winner = sweep.data["winners"].get(kernel)
            if winner:
                from flashattn.backends.triton.tables import KernelConfig

                fixed[kernel] = KernelConfig(*winner["config"])
    except KeyboardInterrupt:  # the budget ran out: what was measured is written
        sweep.data["interrupted"] = True
    sweep.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
