"""The pytest plugin of gpu-check's test step (``-p tools.gpu_check.pytest_plugin``): in the controller and in every
xdist worker it starts the compile clock (``clock.install``), and the controller appends each test's outcome to
the JSON-lines file named by ``GPU_CHECK_TEST_LOG`` as it arrives, so a run stopped at its time limit still
reports every test it finished (JUnit XML is written only at the end)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from . import clock

TEST_LOG = "GPU_CHECK_TEST_LOG"
_WORKER = []  # set in an xdist worker, whose reports reach the controller's hook too: only the controller logs


def pytest_configure(config) -> None:
    if os.environ.get(clock.ENV):
        clock.install()
    if hasattr(config, "workerinput"):
        _WORKER.append(True)


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get(TEST_LOG)
    if not path or _WORKER:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed") or (
            report.when == "teardown" and report.outcome == "failed"):
        reason = ""
        if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            reason = str(report.longrepr[2])
        elif report.outcome == "failed":
            reason = str(report.longrepr)[-1500:]
        with open(path, "a") as f:
            f.write(json.dumps({"test": report.nodeid, "when": report.when, "outcome": report.outcome,
                                "seconds": round(report.duration, 2), "reason": reason}) + "\n")


def read(path) -> dict:
    """{"passed": n, "failed": n, "skipped": n, "failures": [nodeid: reason], "slowest": [...]} from the log."""
    rows = []
    if os.path.exists(path):
        for line in Path(path).read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for r in rows:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    failures = {r["test"]: r["reason"] for r in rows if r["outcome"] == "failed"}
    slowest = sorted(rows, key=lambda r: -r["seconds"])[:10]
    return {**counts, "failures": failures, "slowest": [(r["test"], r["seconds"]) for r in slowest]}
