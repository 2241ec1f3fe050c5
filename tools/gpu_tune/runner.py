"""gpu-tune's plan, the measured table it assembles after every step, and its command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tools.gpu_check import headlines
from tools.gpu_check.plan import SDPA_BASELINES, Step
from tools.gpu_check.runner import DEFAULT_BUDGET, finish, run, start

MARGIN = 1.02  # a faster config is adopted when it beats the table's by this much (the timings' noise is ~1%)
# In order of value: the most used calls first (bf16, d = 128, forward then backward), so a run cut off early
# still returns them. The tables do not tell fp16 from bf16 (the same tiles and instructions): bf16 is timed.
TUNED = (("forward", 128), ("backward", 128), ("forward", 64), ("backward", 64), ("decode", 128),
         ("forward", 256), ("backward", 256), ("decode", 64))


def steps(*, smoke: bool, jobs: int, measured: str) -> list[Step]:
    # The portable kernels are what the sweeps tune and the comparison times (their tables: the Hopper tier stays
    # out of both); the tier's own step picks its schedules.
    interpret = {"TRITON_INTERPRET": "1", "FLASHATTN_CPU_KERNEL": "0"} if smoke else {}
    interpret["FLASHATTN_TRITON_TIER"] = "portable"
    plan = []
    for group, d in TUNED[:3] if smoke else TUNED:
        name = f"{'fwd' if group == 'forward' else 'bwd' if group == 'backward' else 'decode'}-d{d}"
        args = ["tools.gpu_tune.sweep", "--group", group, "--head-dim", str(16 if smoke else d), "--out", "{out}",
                "--name", name, "--jobs", str(jobs)] + (["--smoke"] if smoke else [])
        share = 0.16 if d == 128 and group != "decode" else 0.1
        plan.append(Step(name, args, share, 2 if smoke else 25, env=dict(interpret), reader="tune"))
    if not smoke:  # the Hopper tier's forward schedules (sm_90 alone: skipped elsewhere), checked, then timed
        # beside the portable forward with the configs just measured (``tier.pick``)
        plan.append(Step("tier", ["tools.gluon.gpu_run", "--out", "{out}", "--budget", "{allowed}", "--jobs",
                                  str(jobs)], 0.2, 60, env={"FLASHATTN_TRITON_MEASURED": measured}, reader="gluon"))
        # The tier's one-pass backward (forced) beside the portable backward (the tier kept out of "flashattn")
        plan.append(Step("tier-backward", ["flashattn", "bench", "sweep", "--seqlens", "1024,8192", "--headdims",
                                           "64,128,256", "--modes", "bwd", "--baselines", "flashattn-hopper",
                                           "--tokens", "16384", "--repeats", "20", "--quiet", "--out", "{out}",
                                           "--name", "tier-backward"], 0.1, 30,
                         env={"FLASHATTN_TRITON_MEASURED": measured, "FLASHATTN_TRITON_TIER": "portable"},
                         reader="headline"))
    compare = ["flashattn", "bench", "sweep", "--modes", "fwd,bwd", "--quiet", "--out", "{out}", "--name", "compare"]
    if smoke:
        compare += ["--seqlens", "64", "--headdims", "16", "--causal", "false", "--baselines", "sdpa", "--repeats",
                    "1", "--tokens", "64", "--hidden", "32", "--in-process", "--device", "cpu"]
    else:
        compare += ["--seqlens", "1024,4096,16384,32768", "--headdims", "64,128,256", "--baselines", SDPA_BASELINES,
                    "--tokens", "32768", "--repeats", "10", "--ceilings"]
    # The comparison runs with the configs just measured: the launcher reads them from this file.
    plan.append(Step("compare", compare, 1.0, 3 if smoke else 60, env={**interpret, "FLASHATTN_TRITON_MEASURED":
                                                                      measured}, reader="headline"))
    return plan


def merge(work: Path, header: dict) -> dict:
    """The measured table from every tuning step's winners so far: what ``measured-<family>.json`` holds."""
    entries, family = [], None
    for path in sorted(work.glob("*-d*.json")):
        data = json.loads(path.read_text())
        family = data.get("family", family)
        for kernel, w in data.get("winners", {}).items():
            speedup = 1 / w["vs_shipped"]
            adopted = w["config"] if speedup >= MARGIN else w["shipped_config"]  # within noise: keep the table's
            entries.append({"kernel": kernel, "head_dim": data["head_dim"], "weight": "plain", "config": adopted,
                            "fastest": w["config"],
                            "shipped_config": w["shipped_config"], "ms": w["ms"], "shipped_ms": w["shipped_ms"],
                            "tflops": w.get("tflops"), "speedup": round(speedup, 3),
                            "dtype": data["dtype"], "device": header["device"], "date": header["date"],
                            "versions": header["versions"], "commit": header["commit"]})
    from .tier import pick, pick_backward

    tier_entries = []
    gluon, backward = work / "gluon.json", work / "tier-backward.json"  # the tier steps' (skipped off sm_90)
    if gluon.exists() and not json.loads(gluon.read_text()).get("skipped") and family in (None, "sm90"):
        tier_entries = pick(json.loads(gluon.read_text()).get("speed", []))
        if backward.exists():
            tier_entries += pick_backward(json.loads(backward.read_text()).get("rows", []))
    provenance = {key: header[key] for key in ("device", "date", "versions", "commit")}
    return {"family": family or ("sm90" if tier_entries else None), "entries": entries,
            "tier": [{**e, **provenance} for e in tier_entries]}


def _tune_headline(work: Path, step: Step) -> str:
    data = json.loads((work / f"{step.name}.json").read_text())
    rows = data["rows"]
    parts = []
    for kernel in dict.fromkeys(r["kernel"] for r in rows):
        mine = [r for r in rows if r["kernel"] == kernel]
        ok = sum(r.get("status") == "ok" for r in mine)
        w = data["winners"].get(kernel)
        best = (f"{'x'.join(map(str, w['config'][:2]))}/{w['config'][2]}w/{w['config'][3]}s "
                f"{1 / w['vs_shipped']:.2f}x the table's") if w else "no winner"
        parts.append(f"{kernel}: {ok}/{len(mine)} timed, {best}")
    return "; ".join(parts) + (" (interrupted)" if data.get("interrupted") else "")


headlines.HEADLINES["tune"] = _tune_headline


def command(args: argparse.Namespace) -> int:
    measured_name = "measured.json"
    begun = start(args, tool="gpu-tune", steps=steps(smoke=args.smoke, jobs=args.jobs, measured=measured_name))
    if isinstance(begun, int):
        return begun
    dest, work, header, plan = begun
    measured = work / measured_name
    measured.write_text('{"family": "none", "entries": []}\n')  # the comparison reads it, even before any winner
    for step in plan:  # the comparison's launcher reads the table this run measured
        if "FLASHATTN_TRITON_MEASURED" in step.env:
            step.env["FLASHATTN_TRITON_MEASURED"] = str(measured)

    def after_step() -> None:  # the measured table, current after every step, for the archive and the next steps
        table = merge(work, header)
        if table["family"]:  # one entry per line: a committed file reads and diffs by entry
            text = (f'{{"family": "{table["family"]}", "entries": [\n'
                    + ",\n".join(json.dumps(e) for e in table["entries"]) + "\n], \"tier\": [\n"
                    + ",\n".join(json.dumps(e) for e in table["tier"]) + "\n]}\n")
            measured.write_text(text)
            (dest / f"measured-{table['family']}.json").write_text(text)

    run(plan, work=work, dest=dest, budget=args.budget, header=header, after_step=after_step)
    return finish(begun, also=", measured-<family>.json")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    doc = sys.modules[__package__].__doc__
    p = argparse.ArgumentParser(prog="python -m tools.gpu_tune", description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                   help=f"seconds for the whole run, compiles included (default {DEFAULT_BUDGET:.0f})")
    p.add_argument("--out", default="benchmarks/results/gpu-tune-{device}-{date}",
                   help="the output folder, {device} and {date} filled in (default %(default)s); the OUT "
                        "environment variable, when set, names it instead")
    p.add_argument("--smoke", action="store_true", help="every step at toy sizes on the CPU (no GPU needed)")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="processes compiling candidates")
    p.add_argument("--steps", default=None, help="comma-separated: only these steps, in plan order")
    args = p.parse_args(argv)
    args.command_line = ["python", "-m", "tools.gpu_tune", *argv]
    return command(args)
