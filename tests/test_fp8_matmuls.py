"""FP8 q, k and v multiplied as they are (FlashAttention-3's FP8 forward): on the Triton path, float8_e4m3fn inputs
on FP8 tensor cores (NVIDIA sm_89 and newer; the interpreter here) run both matmuls in FP8, q's and k's descales
scaling the scores and P rounded to FP8 for P V. The bar is FlashAttention-3's: twice the error, against float64
on the dequantized values, of the same computation in float64 with P rounded where the kernel rounds it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import oracle
import pytest
import torch
from test_fp8 import PATHS, _dequantized, _error, _quantized, _reference
from triton_versions import TRITON_MISSING

import flashattn
from flashattn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

INTERPRETED = TRITON_MISSING is None and os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason=TRITON_MISSING or "TRITON_INTERPRET is not set")


def _reference_rounded_probs(q, k, v, *, causal=False):
    """Attention in float64 as an FP8 forward computes it: P = exp(S - rowmax) rounded to float8_e4m3fn for P V,
    the denominator summed before rounding (``oracle.attention_ref``'s ``round_probs``)."""
    return oracle.attention_ref(q, k, v, causal=causal, round_probs=torch.float8_e4m3fn)[0]


def _inputs(b=2, nq=37, nk=113, h=4, hk=2, d=64, dtype=torch.float8_e4m3fn, seed=0):
    torch.manual_seed(seed)
    scales = [torch.rand(b, hk) + 0.25 for _ in range(3)]
    q, k, v = (_quantized(torch.randn(b, n, heads, d), s, dtype)
               for n, heads, s in ((nq, h, scales[0]), (nk, hk, scales[1]), (nk, hk, scales[2])))
    return (q, k, v), scales


def _counting_transposes(monkeypatch) -> list:
    """The launcher's copies of v with its keys contiguous, which only the FP8 matmul mode makes, as (name, v's
    shape): ``interleaved_values`` for dense v, ``keys_contiguous`` for packed."""
    from flashattn.backends.triton import attend

    calls = []
    for name in ("keys_contiguous", "interleaved_values"):
        original = getattr(attend, name)
        monkeypatch.setattr(attend, name, lambda v, name=name, original=original:
                            calls.append((name, v.shape)) or original(v))
    return calls


@needs_interpreter
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_matmuls_round_p_as_flashattention_3_does(causal, monkeypatch):
    (q, k, v), scales = _inputs()
    transposes = _counting_transposes(monkeypatch)
    with flashattn.use_backend("triton"):
        out = flash_attn_func(q, k, v, causal=causal, q_descale=scales[0], k_descale=scales[1], v_descale=scales[2])
    # 113 keys: the interleaved values end in a partial group of 32, padded with zero keys
    assert [name for name, _ in transposes] == ["interleaved_values"] and out.dtype == torch.bfloat16
    wide = [_dequantized(t, s) for t, s in zip((q, k, v), scales, strict=True)]
    truth = _reference(*wide, causal=causal)
    same_way = _error(_reference_rounded_probs(*wide, causal=causal), truth)
    assert _error(out, truth) <= 2 * same_way, (_error(out, truth), same_way)
    # The rounding of P is what it costs: more than bf16 attention over the same values loses.
    bf16 = _error(_reference(*(t.bfloat16() for t in wide), causal=causal, dtype=torch.bfloat16), truth)
    assert same_way > bf16


@pytest.mark.parametrize("path", PATHS)
def test_fp8_varlen_batches_on_every_path(path, monkeypatch):
    """flash_attn_varlen_func with FP8 q, k, v and descales per sequence: FP8 matmuls on Triton (P rounded), the
    widened tiles elsewhere (twice bf16 attention's error over the same values)."""
    torch.manual_seed(3)
    lengths_q, lengths_k, h, hk, d = [5, 40], [33, 70], 4, 2, 64
    scales = [torch.rand(2, hk) + 0.25 for _ in range(3)]
    dense = [[_quantized(torch.randn(1, n, heads, d), s[i : i + 1], torch.float8_e4m3fn) for i, n in enumerate(ns)]
             for ns, heads, s in ((lengths_q, h, scales[0]), (lengths_k, hk, scales[1]), (lengths_k, hk, scales[2]))]
    packed = [torch.cat([t[0] for t in parts]) for parts in dense]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                  for n in (lengths_q, lengths_k))
    transposes = _counting_transposes(monkeypatch) if path == "triton" else []
    with flashattn.use_backend(path):
        out = flash_attn_varlen_func(*packed, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True,
                                     q_descale=scales[0], k_descale=scales[1], v_descale=scales[2])
    assert out.dtype == torch.bfloat16 and out.shape == packed[0].shape[:2] + (d,)
    assert [name for name, _ in transposes] == (["keys_contiguous"] if path == "triton" else [])
    for i in range(2):
        wide = [_dequantized(parts[i], s[i : i + 1]) for parts, s in zip(dense, scales, strict=True)]
        truth = _reference(*wide, causal=True)
        if path == "triton":
            bar = _error(_reference_rounded_probs(*wide, causal=True), truth)
        else:
            bar = _error(_reference(*(t.bfloat16() for t in wide), causal=True, dtype=torch.bfloat16), truth)
        rows = slice(int(cu_q[i]), int(cu_q[i + 1]))
        assert _error(out[rows][None], truth) <= 2 * bar, (i, _error(out[rows][None], truth), bar)


@needs_interpreter
@pytest.mark.parametrize("case", ["e5m2", "16-bit q, FP8 cache", "head dim 16"])
def test_other_fp8_calls_widen_their_tiles(case, monkeypatch):
    """e5m2 (P would keep 2 mantissa bits), 16-bit queries on an FP8 cache and head dims below an FP8 matmul's k
    step widen FP8 tiles to 16 bits instead."""
    (q, k, v), scales = _inputs(dtype=torch.float8_e5m2 if case == "e5m2" else torch.float8_e4m3fn,
                                d=16 if case == "head dim 16" else 64)
    transposes = _counting_transposes(monkeypatch)
    with flashattn.use_backend("triton"):
        if case.startswith("16-bit"):
            out = flash_attn_with_kvcache(_dequantized(q, scales[0], torch.bfloat16), k, v, k_descale=scales[1],
                                          v_descale=scales[2])
        else:
            out = flash_attn_func(q, k, v, q_descale=scales[0], k_descale=scales[1], v_descale=scales[2])
    assert not transposes and out.dtype == torch.bfloat16 and not out.isnan().any()


FP8_MATMUL_COMPILE = """
import collections, os, sys, torch
from flashattn.backends.spec import AttentionSpec, Descale, Saved
from flashattn.backends.triton import attend
from tools.offline.compile import compiled_launches, cubin_report, kernel_counts
os.environ["FLASHATTN_FP8_BACKWARD"] = "1"
q, kv, ones = (torch.empty(2, 2048, 32, 128, dtype=torch.float8_e4m3fn),
               torch.empty(2, 2048, 8, 128, dtype=torch.float8_e4m3fn), torch.ones(2, 8))
out, dout = torch.empty(2, 2048, 32, 128, dtype=torch.bfloat16), torch.randn(2, 2048, 32, 128)
lse = torch.zeros(2, 32, 2048)
spec = AttentionSpec(scale=128 ** -0.5, window_right=0, descale=Descale(ones, ones, ones))
calls = {"attention_forward_kernel": lambda: attend.forward(q, kv, kv, spec),
         "backward": lambda: attend.backward(dout.bfloat16(), None, Saved(q, kv, kv, out, lse), spec)}
for arch in (89, 90, 100, 120):
    for call in calls.values():
        for launch in compiled_launches(arch, call):
            if launch.name in ("attention_forward_kernel", "attention_backward_dkdv_kernel",
                               "attention_backward_dq_kernel"):
                sass = cubin_report(launch.kernel.asm["cubin"]).sass
                fp8 = sum(i.opcode.startswith(("QMMA", "QGMMA", "UTCQMMA")) for i in sass.instructions)
                wide = sum(i.opcode.startswith(("HMMA", "HGMMA", "UTCHMMA")) for i in sass.instructions)
                loop = sass.main_loop()
                shuffles = sum(i.opcode.startswith("SHFL") for i in sass.instructions[loop.start:loop.end + 1]) \\
                    if loop else 0
                print(launch.name, arch, kernel_counts(launch).spill_bytes, fp8, wide, shuffles)
"""


@pytest.mark.skipif(TRITON_MISSING is not None, reason=TRITON_MISSING or "")
@pytest.mark.timeout(960)  # 124 s from a cold Triton cache on 2 cores; the compiles' own limit is 900 s
def test_fp8_matmuls_compile_to_fp8_tensor_core_instructions():
    """Compiled offline through the real launcher (causal prefill, d=128, forward and FP8 backward): QMMA on sm_89
    and sm_120 (mma.sync),
    QGMMA on sm_90 (wgmma), UTCQMMA on sm_100 (tcgen05), no 16-bit matmul left and no spill. Where P reaches the
    P V matmul from registers (not sm_100's tensor memory), the main loop shuffles only for the rows' maxima and
    sums (8 SHFL, as bf16's): P itself stays in its threads (interleaved values; 16-24 SHFL without)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", FP8_MATMUL_COMPILE], capture_output=True, text=True, env=env,
                          timeout=900, cwd=Path(__file__).resolve().parents[1])
    rows = [line.split() for line in done.stdout.splitlines()]
    forward = [row[1:] for row in rows if row[0] == "attention_forward_kernel"]
    assert [row[0] for row in forward] == ["89", "90", "100", "120"], done.stderr[-3000:]
    for arch, spills, fp8, wide, shuffles in forward:
        assert int(spills) == 0 and int(fp8) > 0 and int(wide) == 0, (arch, spills, fp8, wide)
        assert arch == "100" or int(shuffles) <= 8, (arch, shuffles)
    # The FP8 backward (FLASHATTN_FP8_BACKWARD=1): S and dP on FP8 tensor cores, dV, dK, dQ on 16-bit ones, in both
    # kernels on every family. (sm_90's dK/dV spills 88 bytes on its shipped tile; not asserted until timed.)
    backward = [row for row in rows if row[0] != "attention_forward_kernel"]
    assert len(backward) == 8, done.stderr[-3000:]
    for name, arch, _spills, fp8, wide, _shuffles in backward:
        assert int(fp8) > 0 and int(wide) > 0, (name, arch, fp8, wide)
