"""gpu-check's first step: ``flashattn info``'s facts (versions, the device, the path each call gets), what
Triton's cache keys are made of here, and, when the checkout holds a cache built elsewhere (``.gpu-cache/probe``, by
``python -m tools.gpu_check.cache --probe .gpu-cache/probe --target 90``), whether this machine's Triton reuses
it (``tools.gpu_check.cache``): one JSON document on stdout."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from flashattn import info

from . import cache
from .plan import ROOT

CARRIED_PROBE = ROOT / ".gpu-cache" / "probe"


def carried_probe() -> dict | None:
    """The probe kernel compiled against a copy of the prebuilt cache: {"hit": ...} (None when there is none)."""
    if not CARRIED_PROBE.is_dir():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "cache"
        shutil.copytree(CARRIED_PROBE, copy)
        done = subprocess.run([sys.executable, "-m", "tools.gpu_check.cache", "--probe", str(copy)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout)["probe"]


if __name__ == "__main__":
    facts = info.collect()
    try:
        facts["triton_cache"] = {**cache.facts(), "carried_probe": carried_probe()}
    except Exception as err:  # no triton: the rest of the report still matters
        facts["triton_cache"] = {"error": f"{type(err).__name__}: {err}"}
    json.dump(facts, sys.stdout, indent=1, default=str)
    print()
