"""gpu-check's results, rewritten after every step so a run stopped at any moment returns all it finished: into
the output folder (``--out``, or ``$OUT`` when set), three files: ``summary.md`` (the table and each step's findings),
``gpu-check.json`` (every step's status, seconds, compile counts and details) and ``gpu-check.tgz`` (the work
folder: every log, JSON, XML and plot, the two files above included; members relative, so ``tar xzf`` into
``benchmarks/results/gpu-check-<device>-<date>/`` gives the folder to commit). Each file is written beside its
final name and renamed into place, so a reader never sees half of one."""

from __future__ import annotations

import io
import json
import os
import tarfile
from dataclasses import asdict
from pathlib import Path

from flashattn.tables import table

from .plan import Step


def files(tool: str = "gpu-check") -> tuple[str, str, str]:
    """The three result files of ``tool`` (gpu-check, or gpu-tune, which packs its results the same way)."""
    return "summary.md", f"{tool}.json", f"{tool}.tgz"
LOG_LIMIT = 2 * 2**20  # the tail of each log that goes into the archive


def step_table(plan: list[Step]) -> str:
    rows = []
    for s in plan:
        c = s.compile
        compiled = (f"{c['kernel_seconds'] + c['launcher_seconds']:.0f} s ({c['kernels']} kernels, "
                    f"{c['cache_hits']} hits)" if c else "")
        rows.append([s.name, s.status, f"{s.seconds:.0f}", f"{s.allowed:.0f}", compiled, s.headline])
    return table(rows, ["step", "status", "seconds", "allowed", "compiling", "summary"])


def _headline_table(points: list[dict]) -> str:
    impls = list(dict.fromkeys(i for p in points for i in p["impls"]))
    ratios = list(dict.fromkeys(k for p in points for k in p if k.startswith("vs ")))
    return table([{**p, **{k: "-" if p.get(k) is None else p[k] for k in impls + ratios}} for p in points],
                 ["mode", "d", "mask", "N", *impls, *ratios])


def details(plan: list[Step], work: Path) -> str:
    """The findings under the table: the smoke's matrix and failures, failed tests, the speed table."""
    out = []
    for s in plan:
        if s.name == "smoke" and (work / "smoke.json").exists():
            from .smoke import matrix

            cases = json.loads((work / "smoke.json").read_text())["cases"]
            out += ["## Kernel smoke", "", "```", matrix(cases), "```", ""]
            out += [f"- {name}: {why}" for name, why in s.extra.get("not_ok", {}).items()] + [""]
        elif s.name.startswith("tests") and s.extra.get("failures"):
            out += [f"## {s.name}: failures", ""]
            out += [f"- `{t}`: {(why.strip().splitlines() or [''])[-1][:300]}" for t, why in
                    list(s.extra["failures"].items())[:40]] + [""]
        elif s.extra.get("points"):
            ceilings = s.extra.get("ceilings") or {}
            out += [f"## {s.name}: TFLOP/s (ours / theirs)", ""]
            if ceilings:
                out += ["Ceilings measured in the same run: " + ", ".join(f"{k} {v}" for k, v in ceilings.items()), ""]
            out += ["```", _headline_table(s.extra["points"]), "```", ""]
    return "\n".join(out)


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _archive(work: Path, skip: set[Path]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in sorted(work.rglob("*")):
            if not path.is_file() or path in skip or path.name.startswith("."):
                continue
            data = path.read_bytes()
            if path.suffix == ".log" and len(data) > LOG_LIMIT:
                data = b"[... cut: the last %d bytes follow]\n" % LOG_LIMIT + data[-LOG_LIMIT:]
            info = tarfile.TarInfo(str(path.relative_to(work)))
            info.size, info.mtime = len(data), int(path.stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def write(dest: Path, work: Path, plan: list[Step], header: dict) -> None:
    """Write the three files (``files(header["tool"])``) into ``dest`` (and the first two into ``work``, for the
    archive)."""
    tool = header.get("tool", "gpu-check")
    summary_name, json_name, archive_name = files(tool)
    summary = {**header, "steps": [asdict(s) for s in plan]}
    lines = [f"# {tool} on {header['device']}, {header['date']}", "",
             f"{header['versions']}; budget {header['budget']:.0f} s, {header['seconds']:.0f} s used; "
             f"commit {header['commit']}; `{' '.join(header['command'])}`"
             + (f"; prebuilt Triton cache: {header['triton_cache']['entries']} kernels" if header.get("triton_cache")
                else ""), "",
             "```", step_table(plan), "```", "", details(plan, work)]
    text = "\n".join(lines).encode()
    payload = json.dumps(summary, indent=1, default=str).encode()
    for folder in {dest, work}:
        folder.mkdir(parents=True, exist_ok=True)
        _replace(folder / summary_name, text)
        _replace(folder / json_name, payload)
    _replace(dest / archive_name, _archive(work, skip={work / archive_name}))
