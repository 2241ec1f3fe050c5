"""Every shipped Triton kernel configuration compiles, for every architecture of its GPU family (sm_75, 80, 86,
89, 90, 100, 120; AMD gfx90a, gfx942, gfx1100), without register spills inside its loops (a value or two spilled
before the loops and reloaded after them is allowed: a few instructions a program; on AMD no VGPR spilled to scratch
memory), within the architecture's shared memory per block (AMD: LDS), and on its matrix instructions: HMMA
everywhere on NVIDIA, wgmma (HGMMA) on sm_90 and tcgen05 on sm_100 where the tile allows, MFMA on CDNA, WMMA on
RDNA 3 (no GPU needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from triton_versions import needs_triton

ROOT = Path(__file__).resolve().parents[1]  # tools/ is imported from the checkout

# Each test compiles one head dim's kernels offline (_health: up to 900 s), the longest tests of the suite (125 s
# for d=128 from a cold Triton cache on 2 cores): past pyproject's per-test limit, not past _health's own.
pytestmark = [needs_triton, pytest.mark.timeout(960)]
HEAD_DIMS = (16, 32, 64, 128, 256, "192:128", "96:64")
OTHER_ARCHS = (75, 86, 89, 100, 120, "gfx90a", "gfx942", "gfx1100")  # the families beside sm80 and sm90


def _health(tmp_path, *args: str) -> list[dict]:
    """The health report's rows for ``args``; fails on any problem."""
    # A subprocess without TRITON_INTERPRET: under the interpreter @triton.jit functions cannot be compiled.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "health.json"
    done = subprocess.run([sys.executable, "-m", "tools.offline.health", *args, "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert out.exists(), done.stderr[-3000:]
    rows = json.loads(out.read_text())
    bad = [f"{r['kernel']}{'[block mask]' if r['block_mask'] else ''} {r['arch']} d={r['head_dim']}"
           f" {r['variant']}: {'; '.join(r['problems'])}" for r in rows if r["problems"]]
    assert not bad, "\n".join(bad)
    assert done.returncode == 0
    return rows


# Each head dim compiles 40 kernels for sm_80 and sm_90 and the one-pass dK/dV's (7 at d=128), 3-4 CPU-minutes from
# a cold Triton cache: make test checks the most used (the kernel profile and block-mask tests compile d=64 for
# sm_90 too), `make health` and gpu-check's health step every shipped table, the MLA-style q/k:v pairs included.
@pytest.mark.parametrize("head_dim", [128, *(pytest.param(d, marks=pytest.mark.health) for d in HEAD_DIMS
                                             if d != 128)])
def test_shipped_configs_are_healthy(head_dim, tmp_path):
    from flashattn.backends.triton.configs import WEIGHTS
    from tools.offline.health import TABLES, served

    rows = _health(tmp_path, "--head-dims", str(head_dim), "--archs", "80,90", "--calls", "laden")
    dims = tuple(map(int, head_dim.split(":"))) if isinstance(head_dim, str) else head_dim
    # three kernels (the forward with two tables) x five weights x two targets, and the one-pass dK/dV's entries
    assert len(rows) >= 4 * 5 * 2
    assert len(rows) == sum(served(table, dims, arch, weight) for table in TABLES for weight in WEIGHTS
                            for arch in (80, 90))
    hopper = [r for r in rows
              if r["arch"] == 90 and not r["variant"].startswith("fp32") and "decode" not in r["kernel"]]
    # Every fp16/bf16 matmul on wgmma but dK/dV's with dropout and a mask at d=128 (16 x 16 tiles).
    if isinstance(head_dim, int) and head_dim <= 128:
        exempt = ("attention_backward_dkdv_kernel", "heavy")
        assert all(r["hgmma"] > 0 for r in hopper if head_dim != 128 or (r["kernel"], r["variant"]) != exempt)
    # TMA feeds every kernel on wgmma (decode's paged keys are gathered page by page; below 64 rows, mma.sync).
    # Head dims that are not powers of two (the pairs' 192 and 96) load through pointers where a descriptor's box,
    # padded to a power of two, would read the next head's columns (tma.view).
    assert all(r["tma_loads"] > 0 for r in hopper if r["hgmma"] > 0 and r["head_dim"] & (r["head_dim"] - 1) == 0
               and r["head_dim_v"] & (r["head_dim_v"] - 1) == 0)


# The other families in make test: the most used calls (head dim 128, plain; 64 on sm_75 and RDNA 3, whose backward
# serves no more), the forward and both backward kernels, laden and dense, about a CPU-minute each (AMD's: seconds).
# `make health` runs every table in every call (dense, causal, varlen, paged, decode's dense cache).
@pytest.mark.parametrize("arch", OTHER_ARCHS)
def test_every_family_is_healthy_at_its_largest_common_head_dim(arch, tmp_path):
    from flashattn.backends.triton.families import family

    head_dim = min(128, family(arch).max_grad_head_dim)
    rows = _health(tmp_path, "--head-dims", str(head_dim), "--archs", str(arch), "--variants", "plain",
                   "--tables", "forward,dkdv,dq", "--calls", "laden,dense")
    assert len(rows) == 6 and {r["arch"] for r in rows} == {arch} and {r["call"] for r in rows} == {"laden", "dense"}


# The calls users launch specialize differently from the laden one: on CDNA the fp32 forward at head dim 128 shipped a
# tile whose dense (and causal, and varlen) launches pipeline their loads through 67,584 bytes of LDS, over the
# 65,536 a workgroup has, while the laden, paged one took 34,816. Seconds on AMD's backend.
@pytest.mark.parametrize("arch", ["gfx90a", "gfx942"])
def test_cdna_fp32_forward_fits_its_lds_in_every_call(arch, tmp_path):
    rows = _health(tmp_path, "--head-dims", "128", "--archs", arch, "--variants", "fp32-light", "--tables",
                   "forward,decode")
    assert {r["call"] for r in rows} == {"laden", "dense", "causal", "varlen", "paged"}
    assert max(r["shared_bytes"] for r in rows) <= 65536


@pytest.mark.health
@pytest.mark.parametrize("arch", OTHER_ARCHS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_other_families_are_healthy(arch, head_dim, tmp_path):
    from flashattn.backends.triton.configs import WEIGHTS
    from tools.offline.health import TABLES, calls_of, served

    rows = _health(tmp_path, "--head-dims", str(head_dim), "--archs", str(arch))
    dims = tuple(map(int, head_dim.split(":"))) if isinstance(head_dim, str) else head_dim
    assert len(rows) == sum(len(calls_of(table, weight, False)) for table in TABLES for weight in WEIGHTS
                            if served(table, dims, arch, weight))


# The kernels as they walk a block mask (decode's tiles too: a forward of <= 16 query rows), including the pairs
# that share a padded entry with the MLA ones, for every family: `make health` and gpu-check's health step.
@pytest.mark.health
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256, "192:128", "256:128", "96:64", "128:64"])
def test_block_mask_configs_are_healthy(head_dim, tmp_path):
    rows = _health(tmp_path, "--head-dims", str(head_dim), "--block-masks", "with")
    assert len(rows) >= 4 * 5 * 6 and all(r["block_mask"] for r in rows)  # sm_75: the backward to head dim 128


def test_block_mask_entries_come_first_for_pairs_too():
    """A call with a block mask takes the override for its pair with a block mask, then the pair's own, then its
    larger head dim's with a block mask, before the family's table (a (128, 64) forward would otherwise get the
    128 x 128 tile that spills with a block mask)."""
    from flashattn.backends.triton import configs

    overrides, table = configs.OVERRIDES["sm90"], configs.TABLES["sm90"]
    override = overrides["forward"][(128, "plain", True)]
    assert configs.lookup("forward", 90, (128, 64), "plain", block_mask=True) == override
    assert configs.lookup("forward", 90, 128, "plain", block_mask=True) == override
    assert configs.lookup("forward", 90, 128, "plain", measured=False) == table["forward"][(128, "plain")] != override
    pair = overrides["decode"][((256, 128), "fp32-heavy", True)]
    assert configs.lookup("decode", 90, (256, 128), "fp32-heavy", block_mask=True) == pair
    own = overrides["dq"][((256, 128), "plain", False)]  # the pair's own entry, with or without a block mask
    assert configs.lookup("dq", 90, (256, 128), "plain") == own
    assert configs.lookup("dq", 90, (256, 128), "plain", block_mask=True) == own
    assert configs.lookup("dq", 90, (256, 128), "heavy") == table["dq"][(256, "heavy")]
