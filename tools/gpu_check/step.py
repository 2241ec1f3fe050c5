"""``python -m tools.gpu_check.step MODULE ARGS...``: run ``python -m MODULE ARGS...`` with the compile clock
started first (``clock.install``), so a step's compile seconds are counted whatever module it runs."""

from __future__ import annotations

import runpy
import sys

from . import clock

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m tools.gpu_check.step MODULE [ARGS...]")
    clock.install()
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
