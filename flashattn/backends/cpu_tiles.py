"""How the ``cpu`` path multiplies the tiles of bf16 and fp16 calls on this machine: ``"fp32"`` (each tile converted
to fp32, sgemm) or on the CPU's 16-bit dot-product instructions (fp32 accumulation, P and dS rounded to 16 bits as
FlashAttention's GPU kernels do), through one of three engines (``flashattn/csrc/cpu_gemm16.h``):

- ``amx``: the kernel's own AMX tile loop (``flashattn/csrc/cpu_amx.h``), bf16 only, where the CPU has AMX-BF16 and
  the OS grants the process its tile state;
- ``onednn``: ATen's ``cpublas::brgemm``, oneDNN's micro-kernel (AMX where present, else AVX512_BF16); bf16, and
  fp16 on CPUs with AMX-FP16;
- ``avx512bf16``: the kernel's own ``_mm512_dpbf16_ps`` loop, bf16 only, for torch builds without the former.

The automatic choice (``FLASHATTN_CPU_TILES=auto``, the default) takes the first engine, in that order, that the
CPU has the instructions for (AVX512_BF16 or AMX for bf16; AMX-FP16 for fp16: fp16 is never rounded to bf16), the
build compiled, and that passes a self-test against the fp32 tiles (a small causal call, forward and backward, once
per process); otherwise fp32 tiles, with one log line saying why. ``FLASHATTN_CPU_TILES`` forces ``fp32``,
``native`` (the automatic engine, an error where there is none) or an engine by name (an error where it cannot
run); float32 and float64 calls always compute in their own precision.

Example::

    >>> choose(torch.float32)
    'fp32'
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from . import cpu_build

ENV = "FLASHATTN_CPU_TILES"
ENGINES = ("amx", "onednn", "avx512bf16")  # the automatic choice's order
DESCRIPTIONS = {"amx": "the CPU's AMX tiles in the kernel's own loop",
                "onednn": "the CPU's dot-product instructions through oneDNN's brgemm (ATen's cpublas)",
                "avx512bf16": "the CPU's AVX512_BF16 dot products in the kernel's own loop"}
CHOICES = ("auto", "fp32", "native", *ENGINES)
HALF_DTYPES = (torch.bfloat16, torch.float16)
_log = logging.getLogger("flashattn")


def _cpu_has(probe: str) -> bool:
    """torch's own CPU probe ``torch.cpu._is_<probe>_supported()``; False where this torch has none."""
    return bool(getattr(torch.cpu, f"_is_{probe}_supported", lambda: False)())


def instructions(dtype: torch.dtype) -> str | None:
    """None if this CPU has dot-product instructions for ``dtype``, else why not (``FLASHATTN_CPU_ISA=avx2`` hides
    them: the kernel then runs as on an AVX2-only CPU)."""
    if dtype in HALF_DTYPES and os.environ.get(cpu_build.ISA_ENV, "").strip().lower() == "avx2":
        return f"{cpu_build.ISA_ENV}=avx2 hides them (as on a CPU without AVX512_BF16 or AMX)"
    if dtype == torch.bfloat16:
        if _cpu_has("avx512_bf16") or _cpu_has("amx_tile"):
            return None
        return "this CPU has neither AVX512_BF16 nor AMX"
    if dtype == torch.float16:
        return None if _cpu_has("amx_fp16") else "this CPU has no AMX-FP16 (fp16 is never rounded to bf16)"
    return f"{str(dtype).removeprefix('torch.')} tiles are multiplied in their own precision"


@functools.cache
def engine_status(dtype: torch.dtype, engine: str) -> str | None:
    """None if ``engine`` multiplies ``dtype`` tiles here (instructions, build, self-test), else why not."""
    why = instructions(dtype)
    if why is not None:
        return why
    if engine in ("avx512bf16", "amx") and dtype != torch.bfloat16:
        return f"{engine} multiplies bf16 only"
    built, why = cpu_build.status()
    if not built:
        return f"the C++ kernel is not available ({why})"
    if engine not in cpu_build.module().engines():
        return {"onednn": "the torch this kernel was built against has no cpublas::brgemm",
                "avx512bf16": "the compiler does not target AVX512_BF16 here",
                "amx": "this CPU has no AMX-BF16, or its OS grants this process no AMX tile state"}.get(
                    engine, f"no engine {engine!r}")
    failure = self_test(dtype, engine)
    if failure is not None:
        _log.warning("flashattn: the cpu path's %s tile products failed their self-test on %s (%s); they are not "
                     "used", engine, str(dtype).removeprefix("torch."), failure)
    return failure


@functools.cache
def native(dtype: torch.dtype) -> tuple[str | None, str]:
    """(the engine the automatic choice takes for ``dtype``, or None; the reason)."""
    missing = instructions(dtype)
    if missing is not None:
        return None, missing
    reasons = []
    for engine in ENGINES:
        why = engine_status(dtype, engine)
        if why is None:
            return engine, f"{DESCRIPTIONS[engine]}, self-tested against fp32 tiles"
        reasons.append(f"{engine}: {why}")
    # The instructions are there, the engines are not: worth one line.
    _log.info("flashattn: %s CPU calls multiply fp32 tiles (%s)", str(dtype).removeprefix("torch."), "; ".join(reasons))
    return None, "; ".join(reasons)


def explain(dtype: torch.dtype) -> tuple[str, str]:
    """(the tiles a ``dtype`` call of the cpu path uses, why), under ``FLASHATTN_CPU_TILES``."""
    if dtype not in HALF_DTYPES:
        return "fp32" if dtype != torch.float64 else "fp64", instructions(dtype) or ""
    mode = _mode()
    if mode == "fp32":
        return "fp32", f"{ENV}=fp32"
    if mode in ENGINES:
        why = engine_status(dtype, mode)
        if why is not None:
            raise ValueError(f"flashattn cpu path: {ENV}={mode} cannot multiply {dtype} tiles: {why}; allowed here: "
                             f"{', '.join(allowed(dtype))}")
        return mode, f"{ENV}={mode}"
    engine, why = native(dtype)
    if engine is None and mode == "native":
        raise ValueError(f"flashattn cpu path: {ENV}=native, but {dtype} tiles have no native engine here ({why}); "
                         f"allowed here: {', '.join(allowed(dtype))}")
    return engine or "fp32", why


def choose(dtype: torch.dtype) -> str:
    """The ``tiles`` option of the kernel for a ``dtype`` call: "fp32", "amx", "onednn" or "avx512bf16"."""
    if dtype not in HALF_DTYPES:
        return "fp32"
    return explain(dtype)[0]


# Query rows per kv head (a decode step's token times the GQA group) up to which a forward on an AMX CPU multiplies
# on the kernel's own AVX512_BF16 loop: AMX's 16-row tiles idle three quarters of their rows there, and the loop
# ran decode 10-35% faster (one token, GQA 1, 2 and 4, batch 1 to 8, 512 to 8192 keys, 1 and 2 threads, on a
# Xeon with AMX); from 8 rows on AMX was 12-16% ahead.
DECODE_ROWS = 4


def choose_forward(dtype: torch.dtype, rows: int) -> str:
    """``choose`` for a forward whose sequences have at most ``rows`` query rows per kv head (queries times the GQA
    group): the automatic choice takes ``avx512bf16`` over AMX tiles for at most ``DECODE_ROWS``; an
    engine the switch names is kept.

        >>> choose_forward(torch.float32, 1)
        'fp32'
    """
    tiles = choose(dtype)  # (a prefill's choice is this alone: the row count is tested first)
    if (rows <= DECODE_ROWS and tiles in ("amx", "onednn") and _mode() in ("auto", "native") and _cpu_has("amx_tile")
            and engine_status(dtype, "avx512bf16") is None):
        return "avx512bf16"
    return tiles


def engine_label(dtype: torch.dtype) -> str:
    """The instructions that multiply a ``dtype`` call's tiles here, for reports beside a figure: ``AMX``,
    ``AVX512_BF16`` (oneDNN's brgemm or the kernel's own loop), or the vector width of fp32 (fp64) tiles on the BLAS
    and the kernel's row passes: ``AVX-512 fp32``, ``AVX2 fp32``, ``fp32`` elsewhere."""
    tiles = choose(dtype)
    if tiles == "amx":
        return "AMX (own tiles)"
    if tiles == "onednn":
        return "AMX (oneDNN brgemm)" if _cpu_has("amx_tile") else "AVX512_BF16 (oneDNN brgemm)"
    if tiles == "avx512bf16":
        return "AVX512_BF16 (own loop)"
    precision = "fp64" if dtype == torch.float64 else "fp32"
    capability = next((flag for flag in cpu_build.capability_flags() if flag.startswith("-DCPU_CAPABILITY=")), "")
    width = capability.removeprefix("-DCPU_CAPABILITY=")
    return {"AVX512": f"AVX-512 {precision}", "AVX2": f"AVX2 {precision}"}.get(width, precision)


def allowed(dtype: torch.dtype) -> list[str]:
    """The values of ``FLASHATTN_CPU_TILES`` that run ``dtype`` calls here."""
    engines = [engine for engine in ENGINES if engine_status(dtype, engine) is None]
    return ["auto", "fp32", *(["native"] if engines else []), *engines]


def _mode() -> str:
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"flashattn cpu path: {ENV}={value!r} is not one of {', '.join(CHOICES)}")
    return value


def self_test(dtype: torch.dtype, engine: str) -> str | None:
    """None if ``engine`` agrees with the fp32 tiles on a small causal GQA call with an odd head dim, forward and
    backward, within what rounding P and dS to 16 bits explains; else what went wrong."""
    generator = torch.Generator().manual_seed(0)
    b, nq, nk, h, hk, d = 1, 37, 70, 4, 2, 37

    def random(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    q, k, v, dout = random(b, nq, h, d), random(b, nk, hk, d), random(b, nk, hk, d), random(b, nq, h, d)
    try:
        results = {tiles: _run(q, k, v, dout, tiles) for tiles in ("fp32", engine)}
    except Exception as err:  # an engine the torch build declares but cannot run here
        return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    for name, want, got in zip(("out", "lse", "dq", "dk", "dv"), results["fp32"], results[engine], strict=True):
        want, got = want.float(), got.float()
        error = (got - want).abs().max().item()
        bound = 0.05 * (1.0 + want.abs().max().item())
        if not error <= bound:  # NaN fails too
            return f"{name} differs from the fp32 tiles' by {error:.3g} (allowed {bound:.3g})"
    return None


def _run(q, k, v, dout, tiles: str):
    """(out, lse, dq, dk, dv) of a dense causal call on the kernel's operators, with ``tiles``."""
    ops = cpu_build.module()
    nq, nk = q.shape[1], k.shape[1]
    options = {"seqs": None, "block_table": None, "diagonal": nk - nq, "scale": q.shape[-1] ** -0.5, "softcap": 0.0,
               "left": -1, "right": 0, "block_m": 16, "block_n": 32, "alibi": None, "sink": None, "dropout_p": 0.0,
               "seed": 0, "counter_rows": 0, "counter_cols": 0, "mask": None, "tile_kind": None, "partial_id": None,
               "partial_masks": None, "tiles": tiles}
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], nq)
    ops.forward(q, k, v, out, lse, **options)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    ops.backward(q, k, v, out, dout, lse, None, dq, dk, dv, None, **options)
    return out, lse, dq, dk, dv
