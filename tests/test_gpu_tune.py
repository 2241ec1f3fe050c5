"""``python -m tools.gpu_tune``: the time-budgeted tuning sweep, here at toy sizes under Triton's interpreter
(``--smoke``): its steps run within the budget, every result lands in the output folder (the measured table with its
provenance included), and a measured table is what the launcher then uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton_versions import needs_triton

from flashattn.backends.triton import configs, measured
from flashattn.backends.triton.tables import KernelConfig

ROOT = Path(__file__).resolve().parents[1]


@needs_triton
def test_the_smoke_run_returns_a_measured_table_through_out(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OUT": str(out)}
    done = subprocess.run([sys.executable, "-m", "tools.gpu_tune", "--smoke", "--budget", "60", "--steps",
                           "fwd-d128,bwd-d128"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode in (0, 1), done.stderr[-3000:]
    names = sorted(p.name for p in out.iterdir())
    assert names == ["gpu-tune.json", "gpu-tune.tgz", "measured-sm90.json", "summary.md"], names
    assert len(names) <= 8
    steps = {s["name"]: s for s in json.loads((out / "gpu-tune.json").read_text())["steps"]}
    assert steps["fwd-d128"]["status"] == "ok", steps["fwd-d128"]
    assert "forward: 2/2 timed" in steps["fwd-d128"]["headline"]
    assert done.stdout.rstrip().splitlines()[-1].split()[0] == "bwd-d128"  # the table is printed last
    table = json.loads((out / "measured-sm90.json").read_text())
    entry = next(e for e in table["entries"] if e["kernel"] == "forward")
    assert entry["shipped_config"] == [128, 128, 8, 2]  # sm90's table at head dim 16 (the smoke's)
    adopted = measured.parse(table)["forward"][(16, "plain")]
    assert adopted == KernelConfig(*(entry["fastest"] if entry["speedup"] >= 1.02 else entry["shipped_config"]))
    for field in ("device", "date", "versions", "commit", "ms", "shipped_ms", "speedup", "fastest"):
        assert field in entry, field
    assert entry["device"] == "cpu (smoke)"


def test_a_measured_entry_wins_over_the_table_and_yields_to_overrides(tmp_path, monkeypatch):
    path = tmp_path / "sm90.json"
    path.write_text(json.dumps({"family": "sm90", "entries": [
        {"kernel": "forward", "head_dim": 128, "weight": "plain", "config": [64, 32, 4, 3]},
        {"kernel": "dkdv", "head_dim": 128, "weight": "plain", "config": [16, 32, 4, 2]}]}))
    table = configs.lookup("forward", 90, 128, "plain")
    loaded = measured.load(folder=tmp_path / "none", extra=str(path))
    monkeypatch.setattr(configs, "MEASURED", loaded)
    assert configs.lookup("forward", 90, 128, "plain") == KernelConfig(64, 32, 4, 3) != table
    assert configs.lookup("forward", 90, 128, "light") == configs.TABLES["sm90"]["forward"][(128, "light")]
    own = configs.TABLES["sm90"]["forward"][(128, "plain")]  # packed or cached calls, and the offline profile
    assert configs.lookup("forward", 90, 128, "plain", measured=False) == own
    with configs.tables_only():
        assert configs.lookup("forward", 90, 128, "plain") == own
    assert configs.lookup("forward", 80, 128, "plain") == configs.TABLES["sm80"]["forward"][(128, "plain")]
    assert KernelConfig(16, 32, 4, 2) in configs.shipped()  # so the offline health compiles it
    pair = configs.OVERRIDES["sm90"].get("dkdv", {})
    for key, cfg in pair.items():  # a head-dim pair's or block mask's own entry still decides
        if key[1] == "plain" and (isinstance(key[0], tuple) and max(key[0]) == 128 or key[2]):
            assert configs.lookup("dkdv", 90, key[0], "plain", block_mask=key[2]) == cfg


@pytest.mark.parametrize(("entry", "message"), [
    ({"kernel": "fwd", "head_dim": 64, "weight": "plain", "config": [64, 64, 4, 2]}, "names kernel 'fwd'"),
    ({"kernel": "dq", "head_dim": 64, "weight": "plain", "config": [64, 64, 4]}, r"must be \[block_m"),
    ({"kernel": "dq", "head_dim": 256, "weight": "plain", "config": [64, 64, 4, 1, 2]}, "optionally split_d"),
])
def test_a_bad_measured_file_is_an_error_naming_it(tmp_path, entry, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"family": "sm90", "entries": [entry]}))
    with pytest.raises(ValueError, match=message) as e:
        measured.load(folder=tmp_path / "none", extra=str(path))
    assert str(path) in str(e.value)


def test_the_candidates_start_with_the_table_config_and_stay_plausible():
    from tools.gpu_tune.space import candidates

    shipped = KernelConfig(32, 64, 4, 1)
    found = candidates("dkdv", 128, "sm90", shipped=shipped, limit=20)
    assert found[0] == shipped and len(found) == len(set(found)) == 20
    for cfg in found:  # dK and dV of BLOCK_N keys at d = 128 in fp32, over the program's threads
        assert cfg.block_n * 128 * 2 // (32 * cfg.num_warps) <= 160, cfg
    assert candidates("forward", 64, "sm90", shipped=KernelConfig(128, 128, 8, 2), smoke=True)[0].block_m == 128
    assert all(c.split_d == 1 for c in found)  # below head dim 256 dK and dV are never split


def test_head_dim_256_tries_split_dkdv_programs_and_a_measured_file_keeps_them(tmp_path):
    from tools.gpu_tune.space import candidates
    from tools.gpu_tune.sweep import config_list

    found = candidates("dkdv", 256, "sm90", shipped=KernelConfig(32, 16, 4, 1), limit=64)
    split = [c for c in found if c.split_d == 2]
    assert split and KernelConfig(16, 64, 4, 1, 2) in found  # a 64-key block, wgmma-sized, in two programs
    assert all(max(c.block_m, c.block_n) < 128 for c in found if c.split_d == 1)
    assert config_list(KernelConfig(16, 128, 8, 1, 2)) == [16, 128, 8, 1, 2]
    assert config_list(KernelConfig(16, 128, 8, 1)) == [16, 128, 8, 1]
    path = tmp_path / "split.json"
    path.write_text(json.dumps({"family": "sm90", "entries": [
        {"kernel": "dkdv", "head_dim": 256, "weight": "plain", "config": [16, 128, 8, 1, 2]}]}))
    loaded = measured.load(folder=tmp_path / "none", extra=str(path))
    assert loaded["sm90"]["dkdv"][256, "plain"] == KernelConfig(16, 128, 8, 1, 2)


@needs_triton
def test_the_launcher_takes_measured_entries_for_dense_calls_only(monkeypatch):
    """The sweep times q, k and v dense: packed sequences and KV caches compile to other loops and keep the table's
    health-checked entry."""
    from flashattn.backends.spec import AttentionSpec, Varlen
    from flashattn.backends.triton import launch

    timed = KernelConfig(64, 32, 4, 3)
    monkeypatch.setattr(configs, "MEASURED", {"sm90": {"forward": {(128, "plain"): timed}}})
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "target_arch", lambda: 90)
    q = k = v = torch.empty(2, 64, 2, 128, dtype=torch.bfloat16)
    dense = AttentionSpec(scale=0.1)
    assert launch.config("forward", q, launch.CallShape(q, k, v, dense), dense, heavy=False) == timed
    cu = torch.tensor([0, 64, 128], dtype=torch.int32)
    packed = torch.empty(128, 2, 128, dtype=torch.bfloat16)
    varlen = AttentionSpec(scale=0.1, varlen=Varlen(cu, cu, 64, 64))
    shape = launch.CallShape(packed, packed, packed, varlen)
    assert launch.config("forward", packed, shape, varlen, heavy=False) == configs.TABLES["sm90"]["forward"][
        (128, "plain")] != timed
