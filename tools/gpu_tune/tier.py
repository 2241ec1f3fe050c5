"""gpu-tune's ``tier`` step read back: from the Gluon forward's timing (``tools.gluon.gpu_run``'s ``gluon.json``),
each head dim's fastest correct schedule and how it compares with the portable forward, as the entries of a
measured file's ``tier`` list (``flashattn/backends/triton/measured.py``), which the Hopper tier reads (its
schedule, and whether ``auto`` takes it: ``hopper.TAKES_OVER``).

    >>> rows = [dict(impl=impl, d=64, causal=c, seqlen=n, tflops=t) for impl, c, n, t in (
    ...     ("flashattn-portable", True, 1024, 100.0), ("gluon pv+pingpong", True, 1024, 130.0),
    ...     ("gluon qk", True, 1024, 90.0))]
    >>> [(e["schedule"], e["vs_portable"]) for e in pick(rows)]
    [('pv+pingpong', 1.3)]
"""

from __future__ import annotations

import math

PORTABLE = "flashattn-portable"  # gpu_run's row of flash_attn_func with FLASHATTN_TRITON_TIER=portable
PREFIX = "gluon "
HEAD_DIMS = (64, 128, 256)  # the tiles' own (padded head dims run their tile's schedule)


def pick(rows: list[dict]) -> list[dict]:
    """One entry per head dim (bf16, as gpu_run times it): the schedule with the best geometric mean of its speed
    over the portable forward's, among those timed in every case (causal or not, each length) the portable forward
    was; ``worst`` its least ratio. Rows without a speed (an error, a variant that failed its correctness) count as
    not timed."""
    portable = {(r["d"], r["causal"], r["seqlen"]): r["tflops"] for r in rows
                if r.get("impl") == PORTABLE and r.get("tflops")}
    entries = []
    for d in sorted({key[0] for key in portable} & set(HEAD_DIMS)):
        cases = [key for key in portable if key[0] == d]
        ratios: dict[str, dict] = {}
        for r in rows:
            key = (r.get("d"), r.get("causal"), r.get("seqlen"))
            if str(r.get("impl", "")).startswith(PREFIX) and r.get("tflops") and key in cases:
                ratios.setdefault(r["impl"][len(PREFIX):], {})[key] = r["tflops"] / portable[key]
        complete = {name: list(by.values()) for name, by in ratios.items() if len(by) == len(cases)}
        if not complete:
            continue
        mean = {name: math.exp(sum(map(math.log, rs)) / len(rs)) for name, rs in complete.items()}
        best = max(mean, key=mean.get)
        entries.append({"kernel": "tier_forward", "dtype": "bfloat16", "head_dim": d, "schedule": best,
                        "vs_portable": round(mean[best], 3), "worst": round(min(complete[best]), 3),
                        "cases": len(cases)})
    return entries
