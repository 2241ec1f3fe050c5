"""The Hopper tier's Gluon FlashAttention-3-style forward (``flashattn/backends/triton/hopper/forward.py``) compiled
offline for sm_90 (no GPU): the Hopper techniques it was written to express are in the SASS.

Three variants of the shipped schedule are compiled (head dim 128 non-causal, 64 causal, 256 causal) in a subprocess
without ``TRITON_INTERPRET`` (the suite's conftest sets it; Gluon kernels compile only without it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from triton_versions import needs_triton, recorded_on_oldest

ROOT = Path(__file__).resolve().parents[1]  # tools/ is imported from the checkout

pytestmark = [needs_triton,
              recorded_on_oldest("the experimental Gluon forward (Gluon's API changes between releases)")]

# Our tl forward on sm_90 at the same shape (python -m tools.offline.profile), 128 x 128 tiles.
TL_PER_SCORE = {128: 0.238, 64: 0.222}
SHARED_LIMIT_SM90 = 232448
# The bf16 kernel's unmasked loop in the launched schedules (``forward.LAUNCHED``), instructions a tile.
BF16_LAUNCHED_LOOP = {128: 495, 64: 453, 256: 423}
# Failures that say the machine cannot compile for sm_90, not that the kernel is wrong.
ENVIRONMENTAL = ("No module named 'triton.experimental.gluon'", "FileNotFoundError")


def _profiled(tmp_path_factory, *flags: str, cases: str = "128:0,64:1,256:1") -> dict:
    if importlib.util.find_spec("triton.experimental.gluon") is None:
        pytest.skip("this triton has no Gluon (triton.experimental.gluon)")
    out = tmp_path_factory.mktemp("gluon") / "measured.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tools.gluon.profile", "--cases", cases, *flags, "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT,
    )
    if done.returncode != 0 and any(word in done.stderr for word in ENVIRONMENTAL):
        pytest.skip(f"cannot compile for sm_90 here: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr[-3000:]
    return {(r["head_dim"], r["causal"]): r for r in json.loads(out.read_text())}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return _profiled(tmp_path_factory)


@pytest.fixture(scope="module")
def fp8_rows(tmp_path_factory):
    return _profiled(tmp_path_factory, "--fp8", "--launched")


@pytest.fixture(scope="module")
def band_rows(tmp_path_factory):
    return _profiled(tmp_path_factory, "--launched", "--window", "100:0", "--softcap", "30", "--packed",
                     cases="64:0,128:0")


@pytest.mark.parametrize("case", [(128, False), (64, True)])
def test_fa3_techniques_in_sass(rows, case):
    r = rows[case]
    head_dim = case[0]
    assert r["spill_bytes"] == 0
    assert r["shared_bytes"] <= SHARED_LIMIT_SM90
    # Warp specialization: 4 + 4 consumer warps and a producer warp padded to a warpgroup.
    assert r["warps"] == 12
    # Register reallocation (USETMAXREG): consumers up to 240, the producer down to 24.
    assert {24, 240} <= set(r["setmaxnreg"])
    assert r["hgmma"] > 0 and r["hgmma_groups"] >= 4
    assert r["tma_loads"] >= 4  # two Q tiles, K, V
    # Async wgmma: in each consumer's main loop a QK^T group stays in flight under the softmax (tl's: 0).
    assert r["schedule"]["overlap"] == "qk"
    assert sum(kind == "qk" and gap >= 100 for kind, gap in r["retired"]) >= 2
    assert max(r["overlap"]) >= 100  # as sass.hgmma_overlap() sees it
    assert 0 < r["per_score"] < TL_PER_SCORE[head_dim]


def test_head_dim_256_fits_with_pv_under_the_softmax(rows):
    """d=256: 64-key tiles, O's 128 registers a thread beside S without spills, Q and two K and two V stages in
    192 KiB, and FlashAttention-3's schedule: each P V group stays in flight under the next softmax."""
    r = rows[256, True]
    assert r["spill_bytes"] == 0 and r["shared_bytes"] <= SHARED_LIMIT_SM90 and r["shared_bytes"] >= 192 * 1024
    assert r["warps"] == 12 and {24, 240} <= set(r["setmaxnreg"])
    assert r["hgmma"] > 0 and r["tma_loads"] >= 4
    assert r["schedule"]["overlap"] == "pv"
    assert sum(kind == "pv" and gap >= 100 for kind, gap in r["retired"]) >= 2


def test_the_fp8_forward_multiplies_fp8_and_moves_p_within_threads(rows, fp8_rows):
    """The FP8 forward (e4m3 q, k, v; V^T tiles) in the schedule the tier launches: no spills, half the shared
    memory of bf16's rings, every matmul on FP8 wgmma (``QGMMA``), and P handed to P V with its keys in the values'
    interleaved order and converted just before it, so the main loop is no longer than bf16's in the same schedule
    (the portable FP8 forward's was 568 instructions a tile against bf16's 487: 40 shuffles, selects and byte
    permutes; P carried over the back edge as e4m3 made it 641 against 495)."""
    for case in ((128, False), (64, True), (256, True)):
        r, bf16 = fp8_rows[case], rows[case]
        assert r["fp8"] and r["spill_bytes"] == 0 and r["warps"] == 12 and {24, 240} <= set(r["setmaxnreg"])
        assert r["shared_bytes"] < 0.6 * bf16["shared_bytes"]
        assert r["schedule"]["overlap"] == "pv"  # LAUNCHED's
        assert 0 < r["loop"] <= BF16_LAUNCHED_LOOP[case[0]]
        assert sum(kind == "pv" and gap >= 100 for kind, gap in r["retired"]) >= 2  # P V under the softmax


def test_a_window_and_a_softcap_add_a_masked_loop_and_a_reciprocal_a_score(band_rows):
    """A sliding window (left 100, right 0) with a softcap on packed sequences, in the schedule the tier launches
    (the kernel's every branch but FP8's): no spill in a loop
    (8 bytes saved once at the program's start), three key loops a consumer (the left edge's masked tiles, the
    unmasked ones, the right edge's), the softcap as -1 / (2^y + 1) (one MUFU.RCP a score, 64 a thread and tile:
    in the three loops and the peeled first tile of both consumers, 8 x 64), and the unmasked loop at most 5
    instructions a score longer than the plain kernel's (the softcap's multiply, exponential, add and reciprocal:
    4)."""
    for d in (64, 128):
        r = band_rows[d, False]
        assert r["loop_spills"] == 0 and r["spill_bytes"] <= 8
        assert r["warps"] == 12 and {24, 240} <= set(r["setmaxnreg"])
        assert r["band_loops"] == 6
        assert r["reciprocals"] >= 8 * 64
        assert BF16_LAUNCHED_LOOP[d] < r["loop"] <= BF16_LAUNCHED_LOOP[d] + 5 * 64
