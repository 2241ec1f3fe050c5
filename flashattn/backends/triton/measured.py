"""Kernel configs measured on a GPU: the entries that the tuning sweep (``python -m tools.gpu_tune``) found fastest,
which take precedence over the family's table (``tables.py``) and yield to its head-dim-pair and block-mask
overrides.

A family's entries live in ``measured/<family>.json`` (shipped with the package). ``FLASHATTN_TRITON_MEASURED``
names one more such file, read after them: how a tuning run times the comparison with what it just measured, and
how a user tries a sweep's result before it ships. The file format::

    {"family": "sm90",
     "entries": [{"kernel": "forward", "head_dim": 128, "weight": "plain", "config": [128, 128, 8, 2],
                  "device": "NVIDIA H100 80GB HBM3", "date": "2026-11-26", "triton": "3.6.0", ...}]}

    >>> parse({"family": "sm90", "entries": [{"kernel": "dq", "head_dim": 64, "weight": "plain",
    ...                                       "config": [128, 64, 8, 2]}]})["dq"][(64, "plain")]
    KernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .tables import KERNELS, WEIGHTS, KernelConfig

ENV = "FLASHATTN_TRITON_MEASURED"
FOLDER = Path(__file__).with_name("measured")
Measured = dict[str, dict[tuple[int, str], KernelConfig]]  # kernel -> (padded head dim, weight) -> config


def parse(data: dict) -> Measured:
    """A measured file's entries by kernel and (head dim, weight); an entry that names no known kernel or weight,
    or a config that is not four positive integers (five for dkdv, the last its ``split_d``), is an error naming
    it."""
    out: Measured = {}
    for entry in data.get("entries", []):
        kernel, weight, config = entry.get("kernel"), entry.get("weight"), entry.get("config")
        if kernel not in KERNELS or weight not in WEIGHTS:
            raise ValueError(f"a measured config names kernel {kernel!r} and weight {weight!r}; the kernels are "
                             f"{', '.join(KERNELS)}, the weights {', '.join(WEIGHTS)}")
        if not (isinstance(config, list) and len(config) in (4, 5) and all(isinstance(x, int) and x > 0 for x in config)
                and (len(config) == 4 or kernel == "dkdv")):
            raise ValueError(f"a measured config must be [block_m, block_n, num_warps, num_stages] (dkdv: and "
                             f"optionally split_d), got {config!r}")
        out.setdefault(kernel, {})[(int(entry["head_dim"]), weight)] = KernelConfig(*config)
    return out


def _read(folder: Path, extra: str | None, parser) -> list[tuple[str, object]]:
    """(family, ``parser(data)``) of each measured file: the shipped ones, then ``extra`` (default
    ``$FLASHATTN_TRITON_MEASURED``), in that order; a file that does not read or parse is an error naming it."""
    extra = os.environ.get(ENV) if extra is None else extra
    read = []
    for path in sorted(folder.glob("*.json")) + ([Path(extra)] if extra else []):
        try:
            data = json.loads(path.read_text())
            read.append((data["family"], parser(data)))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"flashattn: the measured Triton configs in {path} do not read: {e}") from e
    return read


def load(folder: Path = FOLDER, extra: str | None = None) -> dict[str, Measured]:
    """family -> its measured entries: the shipped files, then ``extra`` (default ``$FLASHATTN_TRITON_MEASURED``)
    on top of them."""
    found: dict[str, Measured] = {}
    for family, entries in _read(folder, extra, parse):
        for kernel, table in entries.items():
            found.setdefault(family, {}).setdefault(kernel, {}).update(table)
    return found


# --- the Hopper tier: its forward's schedule per head dim, and how its kernels compared with the portable ones --
# A family file's "tier" list (``tools/gpu_tune``'s ``tier`` and ``tier-backward`` steps):
#   {"kernel": "tier_forward", "dtype": "bfloat16", "head_dim": 64, "schedule": "pv+pingpong",
#    "vs_portable": 1.37, "worst": 1.12, "cases": 4, "device": ..., "date": ...}
#   {"kernel": "tier_backward", "dtype": "bfloat16", "head_dim": 128, "vs_portable": 1.3, "worst": 1.1, ...}
# ``vs_portable``: the geometric mean of its speed over the portable kernels' in the cases timed (causal and not, 1k
# and 8k tokens a sequence), ``worst`` the least of them. The tier reads it (``hopper.measured_faster``,
# ``launched_schedule``).
TierMeasured = dict[tuple[str, str, int], dict]  # (kernel, dtype name, head dim) -> entry
TIER_KERNELS = ("tier_forward", "tier_backward")


def parse_tier(data: dict) -> TierMeasured:
    """A measured file's tier entries by (kernel, dtype, head dim); a malformed one is an error naming what is
    wrong.

    >>> parse_tier({"tier": [{"kernel": "tier_forward", "dtype": "bfloat16", "head_dim": 128, "schedule": "pv",
    ...                       "vs_portable": 1.1, "worst": 1.02}]})[("tier_forward", "bfloat16", 128)]["schedule"]
    'pv'
    """
    out: TierMeasured = {}
    for entry in data.get("tier", []):
        kernel, ratios = entry.get("kernel"), (entry.get("vs_portable"), entry.get("worst"))
        if (kernel not in TIER_KERNELS or entry.get("dtype") not in ("bfloat16", "float16")
                or entry.get("head_dim") not in (64, 128, 256)
                or kernel == "tier_forward" and not isinstance(entry.get("schedule"), str)
                or not all(isinstance(r, (int, float)) and r > 0 for r in ratios)):
            raise ValueError(f"a measured tier entry needs kernel {' or '.join(TIER_KERNELS)}, dtype bfloat16 or "
                             "float16, head_dim 64, 128 or 256, positive vs_portable and worst, and (forward) a "
                             f"schedule string; got {entry!r}")
        out[(kernel, entry["dtype"], entry["head_dim"])] = entry
    return out


def load_tier(family: str = "sm90", folder: Path = FOLDER, extra: str | None = None) -> TierMeasured:
    """``family``'s tier entries: the shipped file's, then ``extra`` (default ``$FLASHATTN_TRITON_MEASURED``) over
    them."""
    found: TierMeasured = {}
    for read_family, entries in _read(folder, extra, parse_tier):
        if read_family == family:
            found.update(entries)
    return found
