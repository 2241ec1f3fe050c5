"""Each step's one-line summary, read back from the files it wrote in the work folder (``HEADLINES[name](work,
step)``), and the longer sections of ``summary.md`` (``details``). A reader that finds nothing says so; one that
breaks reports the error as the headline instead of ending the run."""

from __future__ import annotations

import json
from pathlib import Path

from .plan import Step
from .pytest_plugin import read as read_test_log

OURS = "flashattn"


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _info(work: Path, step: Step) -> str:
    facts = _json(work / "info.json")
    versions = facts.get("versions", {})
    devices = facts.get("cuda", {}).get("devices") or []
    device = devices[0].get("name") if devices and isinstance(devices[0], dict) else "no GPU"
    cache = facts.get("triton_cache", {})
    step.extra.update(versions=versions, triton_cache=cache)
    probe = cache.get("carried_probe")
    reuse = "" if not probe else f"; prebuilt cache probe {'reused' if probe.get('hit') else 'not reused'}"
    return (f"{device}; torch {versions.get('torch')}, triton {versions.get('triton')}, Python "
            f"{versions.get('python')}; triton_key {cache.get('triton_key')}{reuse}")


def _smoke(work: Path, step: Step) -> str:
    data = _json(work / "smoke.json")
    step.extra["not_ok"] = {r["case"]: f"{r['status']}: {r.get('reason', '')}" for r in data["cases"]
                            if r["status"] != "ok"}
    return f"{len(data['cases'])} cases: " + ", ".join(f"{n} {s}" for s, n in data["counts"].items() if n)


def _tests(work: Path, step: Step) -> str:
    log = read_test_log(work / f"{step.name}.jsonl")
    step.extra["failures"] = log["failures"]
    step.extra["slowest"] = log["slowest"]
    return f"{log['passed']} passed, {log['failed']} failed, {log['skipped']} skipped"


def _rows(work: Path, name: str) -> list[dict]:
    path = work / f"{name}.json"
    return _json(path)["rows"] if path.exists() else []


def headline_points(rows: list[dict]) -> list[dict]:
    """One dict per (mode, head dim, causal, seqlen): each implementation's TFLOP/s (3 significant digits), ours
    over each other's as ``vs <impl>``, and each first call's seconds (compiles included) under ``first_call``."""
    points: dict[tuple, dict] = {}
    for r in rows:
        if "seqlen" not in r:
            continue
        key = (r["mode"], r["headdim"], r["causal"], r["seqlen"])
        point = points.setdefault(key, {"mode": key[0], "d": key[1], "mask": "causal" if key[2] else "full",
                                        "N": key[3], "impls": []})
        point["impls"].append(r["impl"])
        point[r["impl"]] = float(f"{r['tflops']:.3g}") if r.get("tflops") else None
        if r.get("first_call_seconds") is not None:
            point.setdefault("first_call", {})[r["impl"]] = round(r["first_call_seconds"], 1)
    for point in points.values():
        for impl in point["impls"]:
            if impl != OURS and point.get(OURS) and point.get(impl):
                point[f"vs {impl}"] = round(point[OURS] / point[impl], 2)
    return list(points.values())


def _sweep(work: Path, step: Step) -> str:
    data = _json(work / f"{step.name}.json")
    points = headline_points(data["rows"])
    step.extra["points"] = points
    step.extra["ceilings"] = data.get("meta", {}).get("ceilings")
    rated = [p for p in points if p.get(OURS)]
    if not rated:
        return "ours measured at no point"
    parts = []
    for impl in dict.fromkeys(i for p in rated for i in p["impls"] if i != OURS):
        ratios = [p[f"vs {impl}"] for p in rated if p.get(f"vs {impl}")]
        if ratios:
            parts.append(f"vs {impl} {min(ratios):.2f}-{max(ratios):.2f}x")
    tflops = [p[OURS] for p in rated]
    return f"ours {min(tflops):.3g}-{max(tflops):.3g} TFLOP/s at {len(rated)} points; " + "; ".join(parts)


def _decode(work: Path, step: Step) -> str:
    data = _json(work / "decode.json")
    goal = data.get("meta", {}).get("goal")
    rows = [r for r in data["rows"] if r.get("speedup")]
    best = max((r["speedup"] for r in rows), default=0)
    text = f"{len(rows)} cases, best speed-up vs SDPA {best:.3g}x"
    if goal and goal.get("bw_fraction") is not None:
        verdict = "met" if goal["met"] else "not met"
        text += f"; {goal['bw_fraction']:.0%} of copy bandwidth at the goal point ({verdict})"
    return text


def _block_mask(work: Path, step: Step) -> str:
    data = _json(work / "block-mask.json")
    points = [p for p in data["summary"] if p.get("vs_varlen") is not None or p.get("vs_dense") is not None]
    if not points:
        return "no complete case"
    top = max(p["seqlen"] for p in points)

    def ratio(x) -> str:
        return "n/a" if x is None else f"{x:.3g}x"

    parts = [f"{p['mode']} {ratio(p['vs_varlen'])} varlen, {ratio(p['vs_dense'])} dense" for p in points
             if p["seqlen"] == top]
    return f"N={top}: " + "; ".join(parts) + " (targets <= 1.2x, <= 0.125x)"


def _host(work: Path, step: Step) -> str:
    data = _json(work / "host.json")
    verdicts = data.get("meta", {}).get("budgets") or {}
    step.extra["budgets"] = verdicts
    parts = [f"{entry} {v['us']:.3g} us vs SDPA {v['limit_us']:.3g} ({'met' if v['met'] else 'not met'})"
             if v.get("limit_us") is not None else f"{entry} {v['us']:.3g} us" for entry, v in verdicts.items()]
    return "; ".join(parts) if parts else "no budgeted entry measured"


def _cuda_kernel(work: Path, step: Step) -> str:
    data = _json(work / "cuda-kernel.json")
    accuracy = data.get("accuracy", [])
    bad = [a for a in accuracy if not a["passes"]]
    step.extra["compile"] = data["meta"].get("compile")
    if not accuracy:
        return "NVRTC compile for sm_90 only (smoke)"
    return f"compiled; {len(accuracy) - len(bad)}/{len(accuracy)} accuracy checks within 2x SDPA's error"


def _gluon(work: Path, step: Step) -> str:
    data = _json(work / "gluon.json")
    if data.get("skipped"):
        return f"skipped: {data['skipped']}"
    checked = data["correctness"]
    passed = sum(r.get("ok", False) for r in checked.values())
    step.extra["failed"] = {n: r.get("error") or [c for c in r.get("cases", []) if not c["ok"]]
                            for n, r in checked.items() if not r.get("ok")}
    rows = [r for r in data["speed"] if r.get("tflops")]
    line = f"{passed}/{len(checked)} variants correct"
    if not rows:
        return f"{line}; speed: {data.get('speed_error') or 'no rows'}"
    top = max(r["seqlen"] for r in rows)
    parts = []
    for d, causal in sorted({(r["d"], r["causal"]) for r in rows}, reverse=True):
        at = {r["impl"]: r["tflops"] for r in rows if (r["d"], r["causal"], r["seqlen"]) == (d, causal, top)}
        best = max((t for name, t in at.items() if name.startswith("gluon")), default=None)
        if best is None:
            continue
        vs = [f"{best / at[name]:.2f}x {name}" for name in ("sdpa-cudnn", OURS) if at.get(name)]
        parts.append(f"d{d} {'causal' if causal else 'full'} {best:.0f} ({', '.join(vs)})")
    return f"{line}; best at N={top}: " + "; ".join(parts)


HEADLINES = {"info": _info, "smoke": _smoke, "tests": _tests, "tests-cuda": _tests, "headline": _sweep,
             "sweep-d64": _sweep, "sweep-d128": _sweep, "decode": _decode, "block-mask": _block_mask,
             "host": _host, "cuda-kernel": _cuda_kernel, "gluon": _gluon}


def headline(work: Path, step: Step) -> str:
    reader = HEADLINES.get(step.reader or step.name)
    if reader is None:
        return ""
    try:
        return reader(work, step)
    except FileNotFoundError as e:
        return f"(no results: {Path(e.filename).name} was not written)"
    except Exception as e:  # a summary that cannot be read is itself a finding, not a crash
        return f"(no summary: {type(e).__name__}: {e})"
