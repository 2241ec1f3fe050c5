"""gpu-tune's ``tier`` and ``tier-backward`` steps read back: from the Gluon forward's timing (``tools.gluon.gpu_run``'s
``gluon.json``), each head dim's fastest correct schedule and how it compares with the portable forward; from
``flashattn bench sweep --modes bwd`` (``tier-backward.json``), how the tier's one-pass backward compares with the
portable backward; as the entries of a measured file's ``tier`` list (``flashattn/backends/triton/measured.py``),
which the Hopper tier reads (its schedule, and where ``auto`` takes it: ``hopper.TAKES_OVER``).

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
        entries.append(_ratio_entry("tier_forward", d, complete[best], schedule=best))
    return entries


def _ratio_entry(kernel: str, d: int, ratios: list[float], **extra) -> dict:
    mean = math.exp(sum(map(math.log, ratios)) / len(ratios))
    return {"kernel": kernel, "dtype": "bfloat16", "head_dim": d, **extra, "vs_portable": round(mean, 3),
            "worst": round(min(ratios), 3), "cases": len(ratios)}


def pick_backward(rows: list[dict]) -> list[dict]:
    """One ``tier_backward`` entry per head dim: ``flashattn-hopper``'s backward over ``flashattn``'s (the step runs
    it with ``FLASHATTN_TRITON_TIER=portable``: the portable backward) in every case the portable one was timed,
    bf16, "bwd" rows (``flashattn bench sweep``'s fields: impl, headdim, causal, seqlen, mode, tflops)."""
    def speeds(impl):
        return {(r["headdim"], r["causal"], r["seqlen"]): r["tflops"] for r in rows
                if r.get("impl") == impl and r.get("mode") == "bwd" and r.get("dtype", "bfloat16") == "bfloat16"
                and r.get("tflops")}

    portable, tier = speeds("flashattn"), speeds("flashattn-hopper")
    entries = []
    for d in sorted({key[0] for key in portable} & set(HEAD_DIMS)):
        cases = [key for key in portable if key[0] == d]
        if all(key in tier for key in cases):
            entries.append(_ratio_entry("tier_backward", d, [tier[key] / portable[key] for key in cases]))
    return entries
