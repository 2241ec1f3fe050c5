"""The Hopper tier's one-pass Gluon backward (``flashattn/backends/triton/hopper/backward.py``) compiled offline for
sm_90 (no GPU): warp specialization with register reallocation, TMA, every matmul on wgmma, dQ reduced with
atomics, no spills in the loops at d=64 and 256 (a few reloaded invariants at d=128), fewer main-loop instructions
a score than the portable two-pass kernels (``tools.offline.profile``: 0.375 for dK/dV plus about 0.2 for dQ at
d=64, 0.461 plus 0.284 at d=128, 2.984 plus 0.523 at d=256).

In a subprocess without ``TRITON_INTERPRET`` (the suite's conftest sets it; Gluon kernels compile only without it).
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

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [needs_triton,
              recorded_on_oldest("the Hopper tier's Gluon backward (Gluon's API changes between releases)")]
SHARED_LIMIT_SM90 = 232448
TWO_PASS_PER_SCORE = 0.375 + 0.2


# The unmasked loop's local-memory instructions a tile (loop invariants reloaded: the dQ sum's 32-bit offsets) at
# d=128, where dK and dV hold 128 registers a thread; none at d=64.
LOCAL_OPS_D128 = {False: 8, True: 24}
TWO_PASS_PER_SCORE_D128 = 0.461 + 0.284  # dK/dV and dQ kernels' main loops at d=128 (tools.offline.profile)
# At d=256 non-causal, since the band's and packed sequences' arguments, one consumer's key loop reloads one loop
# invariant (a row index of the wgmma layout) from local memory once a tile; causal, none.
LOCAL_OPS_D256 = {False: 1, True: 0}
TWO_PASS_PER_SCORE_D256 = 2.984 + 0.523  # at d=256 (dK/dV on 16-key mma.sync tiles)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_the_one_pass_backward_compiles_to_what_it_was_written_for(causal, head_dim, tmp_path):
    if importlib.util.find_spec("triton.experimental.gluon") is None:
        pytest.skip("this triton has no Gluon (triton.experimental.gluon)")
    out = tmp_path / "row.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [sys.executable, "-m", "tools.gluon.backward_profile", "--json", str(out), "--head-dim", str(head_dim),
            *(["--causal"] if causal else [])]
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["warps"] == 12 and {24, 240} <= set(r["setmaxnreg"])  # two consumer warpgroups and a producer warp
    assert r["shared_bytes"] <= SHARED_LIMIT_SM90
    assert r["tma_loads"] >= 4  # K, V, Q and dO
    assert r["ordering"] == [0, 0, 0]  # no semaphore, no fence: only deterministic calls order dQ's adds
    loops = r["loops"]  # each consumer's loops over query tiles: masked, unmasked, masked
    if head_dim == 64:
        assert loops and all(x["groups"] == 5 and x["red"] > 0 for x in loops)  # five wgmma groups a tile, dQ by RED
        assert sum(x["local"] for x in loops) == 0
        assert 0 < r["per_score"] < TWO_PASS_PER_SCORE
    elif head_dim == 128:  # dQ's product in two groups (each warpgroup's dS^T from shared memory), half the columns
        assert loops and all(x["groups"] == 6 and x["red"] > 0 for x in loops)
        lean = min(loops, key=lambda x: x["length"])
        assert lean["local"] <= LOCAL_OPS_D128[causal]
        assert 0 < r["per_score"] < TWO_PASS_PER_SCORE_D128
    else:  # backward_wide.py: S and dP split by keys, dK, dV and dQ by columns; P^T and dS^T exchanged
        assert loops and all(x["groups"] == 6 and x["red"] > 0 for x in loops)
        assert sum(x["local"] for x in loops) <= LOCAL_OPS_D256[causal]
        assert 0 < r["per_score"] < TWO_PASS_PER_SCORE_D256 / 3


def test_the_deterministic_backward_takes_turns_around_its_dq_adds(tmp_path):
    """``deterministic``: each consumer's tile loops wait for their turn (an acquire load by one thread while the
    tile's products run, then, only if the turn has not come, a relaxed poll in a loop nested in the tile loop and
    one more acquire) and pass it on after the adds (a GPU-scope fence, then the add), d=64 causal, with the
    unordered kernel's five wgmma groups a tile, no spill, fewer instructions a score than the two-pass
    backward's."""
    if importlib.util.find_spec("triton.experimental.gluon") is None:
        pytest.skip("this triton has no Gluon (triton.experimental.gluon)")
    out = tmp_path / "row.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [sys.executable, "-m", "tools.gluon.backward_profile", "--json", str(out), "--causal", "--deterministic"]
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    loops = r["loops"]
    assert len(loops) == 6 and all(x["groups"] == 5 and x["red"] > 0 and x["local"] == 0 for x in loops)
    # per tile loop: two acquires (L1 invalidated: the look at the turn under the products, and the one after a
    # relaxed poll where that look was early), a fence, a release add
    assert r["ordering"] == [12, 6, 6]
    assert r["spill_bytes"] == 0 and 0 < r["per_score"] < TWO_PASS_PER_SCORE
