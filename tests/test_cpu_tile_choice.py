"""Which tiles the cpu path's bf16/fp16 calls take (``flashattn.backends.cpu_tiles``): the automatic choice and its
order, the ``FLASHATTN_CPU_TILES`` switch and its errors, what happens when the CPU lacks the instructions, the
build lacks an engine or an engine fails its self-test, the AVX2 switch, the engine named beside a figure, and the
decode rule (decode-sized forwards on AMX CPUs take the kernel's own AVX512_BF16 loop). A spy in place of the
kernel's operators records the ``tiles`` option of each call."""

from __future__ import annotations

import logging

import pytest
import torch
from oracle import assert_close, attention_ref

import flashattn
from conftest import HAS_COMPILER, run_compiled
from flashattn import fastpath
from flashattn.backends import cpu, cpu_build, cpu_tiles

pytestmark = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: the C++ kernel cannot be built")
TILES = ("fp32", *cpu_tiles.ENGINES)


def _inputs(b, nq, nk, h, hk, d, dtype=torch.bfloat16):
    torch.manual_seed(0)
    return [torch.randn(b, n, heads, d, dtype=dtype, requires_grad=True) for n, heads in ((nq, h), (nk, hk), (nk, hk))]


class _Spy:
    """The kernel's operators, recording the ``tiles`` option of each call."""

    def __init__(self, ops, engines=None):
        self.ops, self.tiles, self._engines = ops, [], engines

    def forward(self, *args, **kwargs):  # the options by name, or by position (the plans of repeated calls)
        self.tiles.append(kwargs["tiles"] if "tiles" in kwargs else args[5 + cpu.OPTION_NAMES.index("tiles")])
        return self.ops.forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        self.tiles.append(kwargs["tiles"])
        return self.ops.backward(*args, **kwargs)

    def engines(self):
        return self.ops.engines() if self._engines is None else self._engines


@pytest.fixture
def fresh_choice(monkeypatch):
    """The choice recomputed for the test (it is cached per process, and in the plans of repeated calls), and
    again after it."""
    def forget() -> None:
        cpu_tiles.engine_status.cache_clear()
        cpu_tiles.native.cache_clear()
        fastpath.clear()

    forget()
    yield
    forget()


def _spy(monkeypatch, engines=None) -> _Spy:
    assert cpu_build.status()[0]
    spy = _Spy(cpu_build.module(), engines)
    monkeypatch.setattr(cpu_build, "module", lambda: spy)
    fastpath.clear()  # plans kept by earlier tests call the kernel and tiles they were made with
    return spy


def _one_call(dtype=torch.bfloat16):
    q, k, v = _inputs(1, 20, 30, 2, 1, 32, dtype=dtype)
    with flashattn.use_backend("cpu"):
        flashattn.flash_attn_func(q, k, v, causal=True).sum().backward()


@pytest.mark.parametrize("value", TILES)
def test_the_switch_forces_the_tiles_of_bf16_calls_only(value, monkeypatch):
    if value != "fp32" and cpu_tiles.engine_status(torch.bfloat16, value) is not None:
        pytest.skip(f"{value} cannot run bf16 tiles here")
    monkeypatch.setenv(cpu_tiles.ENV, value)
    spy = _spy(monkeypatch)
    _one_call()
    _one_call(torch.float32)
    assert spy.tiles == [value, value, "fp32", "fp32"]


def test_auto_takes_the_first_engine_that_runs_else_fp32(monkeypatch):
    monkeypatch.delenv(cpu_tiles.ENV, raising=False)
    engine, why = cpu_tiles.native(torch.bfloat16)
    spy = _spy(monkeypatch)
    _one_call()
    assert spy.tiles == [engine or "fp32"] * 2, why
    assert cpu_tiles.ENGINES == ("amx", "onednn", "avx512bf16")
    if cpu_tiles.instructions(torch.bfloat16) is None and "amx" in spy.engines():
        assert engine == "amx", why  # where the process may use AMX, the own loop runs (and passed its self-test)


def test_a_cpu_without_the_instructions_takes_fp32_tiles(monkeypatch, fresh_choice):
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        monkeypatch.setattr(torch.cpu, probe, lambda: False, raising=False)  # older torch lacks some probes
    monkeypatch.delenv(cpu_tiles.ENV, raising=False)
    monkeypatch.delenv(cpu_build.ISA_ENV, raising=False)  # the probes, not the switch, say why here
    spy = _spy(monkeypatch)
    _one_call()
    assert spy.tiles == ["fp32", "fp32"]
    assert cpu_tiles.explain(torch.bfloat16) == ("fp32", "this CPU has neither AVX512_BF16 nor AMX")
    monkeypatch.setenv(cpu_tiles.ENV, "native")
    with pytest.raises(ValueError, match="FLASHATTN_CPU_TILES=native, but torch.bfloat16 tiles have no native engine"):
        _one_call()


def test_a_build_without_the_engines_takes_fp32_tiles_and_says_so(monkeypatch, fresh_choice, caplog):
    if cpu_tiles.instructions(torch.bfloat16) is not None:
        pytest.skip(cpu_tiles.instructions(torch.bfloat16))
    monkeypatch.delenv(cpu_tiles.ENV, raising=False)
    spy = _spy(monkeypatch, engines=[])
    with caplog.at_level(logging.INFO, logger="flashattn"):
        _one_call()
    assert spy.tiles == ["fp32", "fp32"]
    assert "no cpublas::brgemm" in cpu_tiles.explain(torch.bfloat16)[1]
    assert "amx: this CPU has no AMX-BF16, or its OS grants this process no AMX tile state" in (
        cpu_tiles.explain(torch.bfloat16)[1])
    assert sum("multiply fp32 tiles" in r.message for r in caplog.records) == 1


def test_an_engine_that_fails_its_self_test_is_not_used(monkeypatch, fresh_choice, caplog):
    if cpu_tiles.instructions(torch.bfloat16) is not None:
        pytest.skip(cpu_tiles.instructions(torch.bfloat16))
    monkeypatch.delenv(cpu_tiles.ENV, raising=False)
    monkeypatch.setattr(cpu_tiles, "self_test", lambda dtype, engine: "out differs from the fp32 tiles' by 9")
    spy = _spy(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="flashattn"):
        _one_call()
        _one_call()
    assert spy.tiles == ["fp32"] * 4
    warnings = [r.message for r in caplog.records if "failed their self-test" in r.message]
    built = [engine for engine in cpu_tiles.ENGINES if engine in spy.engines()]
    assert len(warnings) == len(built), warnings  # once per engine this build has, not per call
    monkeypatch.setenv(cpu_tiles.ENV, "onednn")
    with pytest.raises(ValueError, match="allowed here: auto, fp32$"):
        _one_call()


def test_the_self_test_catches_an_engine_that_raises_or_is_wrong(monkeypatch):
    """An engine the build declares but the CPU cannot run raises inside the kernel: the self-test says why."""
    assert cpu_build.status()[0]
    ops = cpu_build.module()

    class Broken:
        engines = ops.engines

        @staticmethod
        def forward(*args, **kwargs):
            if kwargs["tiles"] != "fp32":
                raise RuntimeError("brgemm: not supported on this CPU\nmore")
            return ops.forward(*args, **kwargs)

        backward = ops.backward

    monkeypatch.setattr(cpu_build, "module", lambda: Broken)
    assert cpu_tiles.self_test(torch.bfloat16, "onednn") == "RuntimeError: brgemm: not supported on this CPU"

    class Wrong(Broken):
        @staticmethod
        def forward(q, k, v, out, lse, **kwargs):  # computed on fp32 tiles whatever is asked: any CPU runs it
            ops.forward(q, k, v, out, lse, **{**kwargs, "tiles": "fp32"})
            if kwargs["tiles"] != "fp32":
                out.mul_(1.5)

        @staticmethod
        def backward(*args, **kwargs):
            return ops.backward(*args, **{**kwargs, "tiles": "fp32"})

    monkeypatch.setattr(cpu_build, "module", lambda: Wrong)
    assert cpu_tiles.self_test(torch.bfloat16, "onednn").startswith("out differs from the fp32 tiles'")


def test_bad_values_of_the_switch_are_named(monkeypatch):
    monkeypatch.setenv(cpu_tiles.ENV, "fastest")
    with pytest.raises(ValueError, match="FLASHATTN_CPU_TILES='fastest' is not one of auto, fp32, native, amx, onednn"):
        _one_call()


def test_the_avx2_switch_hides_the_engines_and_builds_for_avx2(monkeypatch, fresh_choice):
    """``FLASHATTN_CPU_ISA=avx2`` (what ``make test`` runs the CPU-kernel tests under a second time): bf16 takes fp32
    tiles for the switch's stated reason, ``native`` is refused as on an AVX2-only CPU, and the build targets
    x86-64-v3 with AVX2 vectors; an unknown value is named."""
    if cpu_build.isa() != "avx2":
        monkeypatch.setenv(cpu_build.ISA_ENV, "avx2")
        try:
            cpu_build.isa()
        except ValueError as e:
            pytest.skip(str(e))
    assert "-march=x86-64-v3" in cpu_build.compile_flags() and "-DCPU_CAPABILITY=AVX2" in cpu_build.compile_flags()
    monkeypatch.delenv(cpu_tiles.ENV, raising=False)
    assert cpu_tiles.explain(torch.bfloat16)[0] == "fp32"
    assert "FLASHATTN_CPU_ISA=avx2 hides them" in cpu_tiles.explain(torch.bfloat16)[1]
    monkeypatch.setenv(cpu_tiles.ENV, "native")
    with pytest.raises(ValueError, match="no native engine"):
        cpu_tiles.choose(torch.bfloat16)
    monkeypatch.setenv(cpu_build.ISA_ENV, "avx9000")
    with pytest.raises(ValueError, match="FLASHATTN_CPU_ISA='avx9000' is not one of native, avx2"):
        cpu_build.isa()


def test_the_engine_label_names_the_instructions_behind_a_figure(monkeypatch, fresh_choice):
    """What ``bench cpu --roofline`` prints beside each figure: the kernel's own AMX tiles, AMX where oneDNN's
    brgemm runs on an AMX CPU, the kernel's own AVX512_BF16 loop by that name, and fp32 tiles by the vector width
    the build compiled for."""
    monkeypatch.setattr(cpu_tiles, "choose", lambda dtype: "amx")
    assert cpu_tiles.engine_label(torch.bfloat16) == "AMX (own tiles)"
    monkeypatch.setattr(cpu_tiles, "choose", lambda dtype: "onednn")
    monkeypatch.setattr(cpu_tiles, "_cpu_has", lambda probe: probe == "amx_tile")
    assert cpu_tiles.engine_label(torch.bfloat16) == "AMX (oneDNN brgemm)"
    monkeypatch.setattr(cpu_tiles, "_cpu_has", lambda probe: probe == "avx512_bf16")
    assert cpu_tiles.engine_label(torch.bfloat16) == "AVX512_BF16 (oneDNN brgemm)"
    monkeypatch.setattr(cpu_tiles, "choose", lambda dtype: "avx512bf16")
    assert cpu_tiles.engine_label(torch.bfloat16) == "AVX512_BF16 (own loop)"
    monkeypatch.setattr(cpu_tiles, "choose", lambda dtype: "fp32")
    for capability, label in (("AVX512", "AVX-512 fp32"), ("AVX2", "AVX2 fp32"), ("DEFAULT", "fp32")):
        monkeypatch.setattr(cpu_build, "capability_flags", lambda c=capability: [f"-DCPU_CAPABILITY={c}"])
        assert cpu_tiles.engine_label(torch.float32) == label
    assert cpu_tiles.engine_label(torch.float64) == "fp64"


def test_decode_sized_forwards_on_amx_take_the_own_bf16_loop(monkeypatch, fresh_choice):
    """On an AMX CPU the automatic choice multiplies a forward of at most ``DECODE_ROWS`` query rows per kv head on
    the kernel's own AVX512_BF16 loop (AMX's 16-row tiles idle there); more rows, other CPUs, a switch that names
    the engine, and the backward keep their choice. The calls agree with the fp32 tiles either way."""
    if cpu_tiles.engine_status(torch.bfloat16, "avx512bf16") is not None:
        pytest.skip(f"avx512bf16 cannot run here ({cpu_tiles.engine_status(torch.bfloat16, 'avx512bf16')})")
    monkeypatch.setattr(cpu_tiles, "choose", lambda dtype: "onednn" if dtype == torch.bfloat16 else "fp32")
    monkeypatch.setattr(cpu_tiles, "_cpu_has", lambda probe: probe in ("amx_tile", "avx512_bf16"))
    rows = cpu_tiles.DECODE_ROWS
    assert cpu_tiles.choose_forward(torch.bfloat16, rows) == "avx512bf16"
    assert cpu_tiles.choose_forward(torch.bfloat16, rows + 1) == "onednn"
    with monkeypatch.context() as own:  # the kernel's own AMX tiles idle the same rows
        own.setattr(cpu_tiles, "choose", lambda dtype: "amx")
        assert cpu_tiles.choose_forward(torch.bfloat16, rows) == "avx512bf16"
        assert cpu_tiles.choose_forward(torch.bfloat16, rows + 1) == "amx"
    assert cpu_tiles.choose_forward(torch.float32, 1) == "fp32"
    monkeypatch.setenv(cpu_tiles.ENV, "onednn")
    assert cpu_tiles.choose_forward(torch.bfloat16, 1) == "onednn"
    monkeypatch.delenv(cpu_tiles.ENV)
    monkeypatch.setattr(cpu_tiles, "_cpu_has", lambda probe: probe == "avx512_bf16")  # no AMX: oneDNN's own choice
    assert cpu_tiles.choose_forward(torch.bfloat16, 1) == "onednn"
    monkeypatch.setattr(cpu_tiles, "_cpu_has", lambda probe: probe in ("amx_tile", "avx512_bf16"))
    spy = _spy(monkeypatch)
    for nq, group in ((1, 4), (2, 2), (1, 8), (3, 2)):  # rows 4, 4, 8, 6
        q, k, v = _inputs(1, nq, 41, 2 * group, 2, 64)
        cache = [torch.cat([t.detach(), torch.zeros_like(t.detach())], dim=1) for t in (k, v)]  # 41 of 82 used
        decoded = flashattn.flash_attn_with_kvcache(q.detach(), *cache, cache_seqlens=41, causal=True)
        with flashattn.use_backend("cpu"):
            out = flashattn.flash_attn_func(q, k, v, causal=True)
        out.sum().backward()
        want = "avx512bf16" if nq * group <= rows else "onednn"
        assert spy.tiles[-3:] == [want, want, "onednn"], (nq, group, spy.tiles)
        ref, _ = attention_ref(q.detach(), k.detach(), v.detach(), causal=True)
        base, _ = attention_ref(q.detach(), k.detach(), v.detach(), causal=True, upcast=False)
        assert_close("out", out.detach(), ref, base)
        assert_close("decoded", decoded, ref, base)


def test_the_own_amx_tiles_pass_their_self_test_where_the_process_may_use_amx():
    """Where the CPU has AMX-BF16 and the OS grants this process the tile state (the build then lists ``amx``), the
    kernel's own AMX loop agrees with the fp32 tiles: a broken loop fails here rather than only skipping its cases
    in test_cpu_tiles.py."""
    if "amx" not in cpu_build.module().engines():
        pytest.skip("this CPU or its OS offers this process no AMX tiles")
    assert cpu_tiles.self_test(torch.bfloat16, "amx") is None


_INTERLEAVED = """
import os, torch, flashattn
torch.manual_seed(0)
q, k, v, dout = (torch.randn(1, 300, heads, 64, dtype=torch.bfloat16) for heads in (4, 2, 2, 4))


def run(name):
    grads = [t.clone().requires_grad_() for t in (q, k, v)]
    if name == "sdpa":
        qt, kt, vt = (t.transpose(1, 2) for t in grads)
        out = torch.nn.functional.scaled_dot_product_attention(
            qt, kt.repeat_interleave(2, 1), vt.repeat_interleave(2, 1), is_causal=True).transpose(1, 2)
    else:
        os.environ["FLASHATTN_CPU_TILES"] = name
        with flashattn.use_backend("cpu"):
            out = flashattn.flash_attn_func(*grads, causal=True)
    out.backward(dout)
    return torch.cat([out.detach().flatten()] + [t.grad.flatten() for t in grads])


first = {name: run(name) for name in NAMES}
for _ in range(2):
    for name in NAMES:
        assert torch.equal(run(name), first[name]), name
print("unchanged")
"""


def test_the_amx_tiles_and_onednns_share_the_threads_tile_state(tmp_path):
    """The AMX tile configuration is per thread: forwards and backwards on the own AMX loop between ones on oneDNN's
    brgemm (ours with ``onednn`` tiles, and PyTorch's bf16 SDPA, which runs on it on AMX CPUs) change neither's
    results. In a process of its own: a thread left with a stale configuration dies of SIGILL."""
    if cpu_tiles.engine_status(torch.bfloat16, "amx") is not None:
        pytest.skip(f"amx cannot run bf16 tiles here: {cpu_tiles.engine_status(torch.bfloat16, 'amx')}")
    names = ["sdpa", "amx"] + (["onednn"] if cpu_tiles.engine_status(torch.bfloat16, "onednn") is None else [])
    script = tmp_path / "interleaved.py"
    script.write_text(f"NAMES = {names!r}\n" + _INTERLEAVED)
    assert run_compiled(str(script)).strip().endswith("unchanged")
