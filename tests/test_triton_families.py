"""GPU families and the launch-time guard: every architecture maps to a family with a config for every call, an
unlisted one gets the conservative family with one log line, and a config the device's shared memory refuses steps
down instead of failing (on a fake device: compiled offline, no GPU needed)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from triton_versions import needs_triton

pytestmark = needs_triton
ROOT = Path(__file__).resolve().parents[1]


def test_every_architecture_has_a_config_for_every_call():
    from flashattn.backends.triton import configs, families

    assert set(families.ARCHITECTURES.values()) == set(configs.FAMILIES) == set(configs.TABLES)
    for arch, name in families.ARCHITECTURES.items():
        assert configs.family(arch).name == name
        for kernel in configs.KERNELS:
            for d in (16, 32, 64, 128, 256, (128, 64), (256, 128)):
                for weight in configs.WEIGHTS:
                    for block_mask in (False, True):
                        assert configs.lookup(kernel, arch, d, weight, block_mask=block_mask).block_m >= 16


def test_shared_memory_and_tensor_cores_by_family():
    from flashattn.backends.triton import families, tma

    kib = {arch: families.family(arch).shared_bytes // 1024 for arch in families.ARCHITECTURES}
    assert kib == {75: 64, 80: 163, 86: 99, 87: 163, 89: 99, 90: 227, 100: 227, 103: 227, 120: 99, 121: 99,
                   "gfx90a": 64, "gfx942": 64, "gfx1100": 64, "gfx1101": 64, "gfx1102": 64}
    # Descriptors only where the matmuls are warpgroup-wide: not on consumer Blackwell's mma.sync, nor on AMD.
    assert [arch for arch in families.ARCHITECTURES if tma.enabled(arch)] == [90, 100, 103]
    assert not tma.enabled(0)  # the interpreter
    warps = {arch: families.family(arch).warp_size for arch in families.ARCHITECTURES if isinstance(arch, str)}
    assert warps == {"gfx90a": 64, "gfx942": 64, "gfx1100": 32, "gfx1101": 32, "gfx1102": 32}


@pytest.mark.parametrize("arch,vendor", [(130, "cuda"), ("gfx1250", "hip")])
def test_an_unlisted_architecture_gets_its_vendors_conservative_family_once(caplog, arch, vendor):
    from flashattn.backends.triton import families

    with caplog.at_level(logging.WARNING, logger="flashattn"):
        first = families.family(arch)
        second = families.family(arch)
    assert first is second and first.name == families.CONSERVATIVE[vendor]
    same_vendor = [f for a, name in families.ARCHITECTURES.items() if families.vendor(a) == vendor
                   for f in [families.FAMILIES[name]]]
    assert first.shared_bytes == min(f.shared_bytes for f in same_vendor)
    assert len(caplog.records) == 1 and families.arch_name(arch) in caplog.records[0].getMessage()


def test_where_the_one_pass_backward_runs_and_on_which_tiles(monkeypatch):
    """``FLASHATTN_TRITON_BACKWARD=one-pass`` on the families with one-pass entries, not for entries declined there
    (sm_90's 16-bit head dims 128 and 256), deterministic calls or special ones; its own tile where dK/dV's spills,
    else dK/dV's table entry (not a measured one: those timed the two-pass kernel)."""
    from flashattn.backends.triton import configs

    def runs(arch, entry=(64, "plain"), **kwargs):
        return configs.one_pass_backward(arch, **{"deterministic": False, "special": False, **kwargs}, entry=entry)

    assert not runs(90)  # auto: two passes
    monkeypatch.setenv("FLASHATTN_TRITON_BACKWARD", "one-pass")
    assert runs(90) and runs(80) and runs(0) and runs(90, (32, "plain")) and runs(90, (128, "fp32-light"))
    assert not runs(90, (128, "plain")) and not runs(90, (256, "heavy")) and not runs(90, ((128, 64), "light"))
    assert not runs(86) and not runs(100) and not runs("gfx942")  # families whose one-pass tiles are unchecked
    assert not runs(90, deterministic=True) and not runs(90, special=True)
    assert configs.lookup("dkdv_one_pass", 90, 64, "heavy") == configs.ONE_PASS["sm90"][64, "heavy"]
    assert configs.lookup("dkdv_one_pass", 90, 64, "plain") == configs.lookup("dkdv", 90, 64, "plain", measured=False)
    monkeypatch.setenv("FLASHATTN_TRITON_BACKWARD", "two-pass")
    assert not runs(90)


def test_a_rocm_gpu_is_keyed_by_its_gfx_name(monkeypatch):
    from types import SimpleNamespace

    import torch

    from flashattn.backends import triton as triton_path

    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(gcnArchName="gfx942:sramecc+:xnack-"))
    assert triton_path.device_arch(0) == "gfx942"


def test_smaller_steps_down_to_the_smallest_tile():
    from flashattn.backends.triton.configs import KernelConfig
    from flashattn.backends.triton.fit import smaller

    cfg, steps = KernelConfig(128, 64, 8, 3), []
    while cfg is not None:
        steps.append(cfg)
        cfg = smaller(cfg)
    assert steps[-1] == KernelConfig(16, 16, 8, 1)
    cost = [c.block_m * c.block_n * c.num_stages for c in steps]
    assert cost == sorted(cost, reverse=True) and len(set(cost)) == len(cost)  # every step needs less


def _fake_device(limit: int, calls: list):
    """A launch that needs block_m x block_n x stages bytes of shared memory on a device with ``limit``."""
    from triton.runtime.errors import OutOfResources

    def run(cfg):
        calls.append(cfg)
        need = cfg.block_m * cfg.block_n * cfg.num_stages
        if need > limit:
            raise OutOfResources(need, limit, "shared memory")

    return run


def test_launch_fitting_steps_down_logs_and_remembers(caplog):
    from flashattn.backends.triton import configs, fit

    first, calls = configs.KernelConfig(128, 128, 8, 2), []
    with caplog.at_level(logging.WARNING, logger="flashattn"):
        fit.launch_fitting(first, _fake_device(64 * 64, calls), kernel="forward", what="test kernel A")
    assert calls[0] == first and calls[-1].block_m * calls[-1].block_n * calls[-1].num_stages <= 64 * 64
    assert len(caplog.records) == len(calls) - 1 and "test kernel A" in caplog.records[0].getMessage()
    fitted, calls[:] = calls[-1], []
    fit.launch_fitting(first, _fake_device(64 * 64, calls), kernel="forward", what="test kernel A")
    assert calls == [fitted]  # the next call starts from the config that fitted


def test_launch_fitting_keeps_forced_configs_and_fails_clearly():
    from triton.runtime.errors import OutOfResources

    from flashattn.backends.triton import configs, fit

    cfg = configs.KernelConfig(64, 64, 4, 1)
    with configs.use(cfg), pytest.raises(OutOfResources):  # a forced config is launched as it is
        fit.launch_fitting(cfg, _fake_device(16, []), kernel="dq", what="test kernel B")
    with pytest.raises(ValueError, match="test kernel C: even a 16x16 tile"):
        fit.launch_fitting(cfg, _fake_device(16, []), kernel="dq", what="test kernel C")

    def out_of_threads(cfg):
        raise OutOfResources(1024, 512, "threads")

    with pytest.raises(OutOfResources, match="threads"):  # not about shared memory: not stepped down
        fit.launch_fitting(cfg, out_of_threads, kernel="dq", what="test kernel D")

_GUARD = """
import json, sys, torch
from flashattn.backends.spec import AttentionSpec, Saved
from flashattn.backends.triton import attend, configs
from tools.offline.compile import compiled_launches
arch, limit = int(sys.argv[1]), int(sys.argv[2])
q, k, v = (torch.empty(2, 256, 4, 128, dtype=torch.float16) for _ in range(3))
spec = AttentionSpec(scale=0.125, window_left=-1, window_right=0)
def call():
    out, lse, _ = attend.forward(q, k, v, spec)
    lse = torch.empty(2, 4, 256)
    attend.backward(torch.empty_like(q), None, Saved(q, k, v, q, lse), spec)
rows = [dict(name=c.name, shared=c.kernel.metadata.shared, block_m=c.kwargs["BLOCK_M"], block_n=c.kwargs["BLOCK_N"],
             stages=c.kernel.metadata.num_stages) for c in compiled_launches(arch, call, max_shared=limit)
        if "BLOCK_N" in c.kwargs]
table = {k: vars(configs.lookup(k, arch, 128, "plain")) for k in ("forward", "dkdv", "dq")}
print(json.dumps(dict(rows=rows, table=table)))
"""


def test_a_device_with_less_shared_memory_gets_smaller_tiles():
    """Compiled offline for an A100 (sm_80) that, on this fake device, has only 48 KiB of shared memory per block:
    every kernel steps down from its table entry to a config within 48 KiB, and the call completes."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, do not interpret
    limit = 48 * 1024
    done = subprocess.run([sys.executable, "-c", _GUARD, "80", str(limit)], capture_output=True, text=True,
                          env=env, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    rows, table = found["rows"], found["table"]
    assert [r["name"] for r in rows] == ["attention_forward_kernel", "attention_backward_dkdv_kernel",
                                         "attention_backward_dq_kernel"]
    assert all(r["shared"] <= limit for r in rows)
    for row, kernel in zip(rows, ("forward", "dkdv", "dq"), strict=True):
        entry = table[kernel]
        stepped = (row["block_m"], row["block_n"], row["stages"]) != (entry["block_m"], entry["block_n"],
                                                                       entry["num_stages"])
        assert stepped, f"{kernel}: the table's {entry} fits 48 KiB: this test no longer tests the guard"
    assert "needs" in done.stderr and "this GPU allows 49152 per block" in done.stderr


def test_the_turing_backward_declines_head_dims_over_64(monkeypatch):
    """On sm_75 dK/dV spills at every tile from head dim 128 on (Triton's matmuls are FMA there): the triton path
    declines such gradients, so the choice passes them to the torch path, and keeps the forward."""
    import torch

    import flashattn.backends.triton as triton_path
    from flashattn.backends.request import Request
    from flashattn.backends.triton import families

    monkeypatch.setattr(triton_path, "interpreting", lambda: False)
    monkeypatch.setattr(triton_path, "_gpu_family", lambda index: families.family(75))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    request = Request("cuda", torch.float16, 128, 128, grad=True)
    assert "up to 64 on sm75" in triton_path.serves(request)
    assert triton_path.serves(request._replace(grad=False)) is None
    assert triton_path.serves(request._replace(head_dim=64, head_dim_v=64)) is None
    monkeypatch.setattr(triton_path, "_gpu_family", lambda index: families.family(86))
    assert triton_path.serves(request) is None


def test_turing_declines_block_masks_past_head_dim_128(monkeypatch):
    """On sm_75 the kernels walking a block mask spill in every tile for fp32 with dropout or a mask at head dim 192
    (the MLA pair): the triton path leaves block-mask calls past head dim 128 to the torch path there, and only
    there."""
    import torch

    import flashattn.backends.triton as triton_path
    from flashattn.backends.request import Request
    from flashattn.backends.triton import families

    monkeypatch.setattr(triton_path, "interpreting", lambda: False)
    monkeypatch.setattr(triton_path, "_gpu_family", lambda index: families.family(75))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    request = Request("cuda", torch.float32, 192, 128, features=("block mask",), mask_blocks=(128, 128))
    assert "block masks at head dims up to 128 on sm75" in triton_path.serves(request)
    assert triton_path.serves(request._replace(features=())) is None
    assert triton_path.serves(request._replace(head_dim=128)) is None
    monkeypatch.setattr(triton_path, "_gpu_family", lambda index: families.family(86))
    assert triton_path.serves(request) is None


def test_calls_no_tile_compiles_on_the_installed_triton_are_declined(monkeypatch):
    """tables.DECLINED (from _TRITON_DECLINES, by the installed release): Triton 3.9's AMD backend compiles CDNA's dQ
    with dropout or a mask at head dim 32 in no tile, so those backward calls go to the torch path there; the forward,
    other options, head dims and families are served."""
    import torch

    import flashattn.backends.triton as triton_path
    from flashattn.backends.request import Request
    from flashattn.backends.triton import families, tables

    assert bool(tables.DECLINED) == (tables.TRITON is not None and tables.TRITON >= (3, 9))
    monkeypatch.setattr(tables, "DECLINED", {"cdna3": {("dq", 32, "heavy")}})
    monkeypatch.setattr(triton_path, "interpreting", lambda: False)
    monkeypatch.setattr(triton_path, "_gpu_family", lambda index: families.family("gfx942"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    request = Request("cuda", torch.bfloat16, 32, 32, features=("dropout",), grad=True)
    assert "dq kernel for head dim 32 with dropout or a mask on cdna3" in triton_path.serves(request)
    assert triton_path.serves(request._replace(grad=False)) is None
    assert triton_path.serves(request._replace(features=("softcap",))) is None
    assert triton_path.serves(request._replace(head_dim=64, head_dim_v=64)) is None
    assert "head dim 32" in triton_path.serves(request._replace(head_dim=24, head_dim_v=32))  # padded to 32
    monkeypatch.setattr(triton_path, "_gpu_family", lambda index: families.family(90))
    assert triton_path.serves(request) is None
