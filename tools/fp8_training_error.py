"""How far the FP8 training mode (``flash_attn_func(..., fp8=True)``) lands from exact attention, next to bf16.

For random q, k, v (bf16, flash layout) and a random dout, each row of the table is one computation's largest
error, relative to the largest magnitude of the exact result, for out, dq, dk and dv:

- ``bf16``: flash_attn_func on the inputs, against float64 attention on the same inputs;
- ``fp8 mode``: flash_attn_func(..., fp8=True), against float64 attention on the same (unquantized) inputs: what
  a model sees, the quantization of q, k and v included;
- ``fp8 kernel``: the same call against float64 attention at the quantized values (what the tests bound);
- ``bf16 at quantized``: PyTorch's bf16 attention at the quantized values (P rounded to e4m3 where the path rounds
  it), against the same float64: the tests' baseline.

    PYTHONPATH=. python3 -m tools.fp8_training_error --path cpu --seqlens 512,2048 --out /tmp/fp8-error.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

from tools.gpu_check.plan import TESTS


def _attention(q, k, v, *, causal: bool, round_probs=None, dtype=torch.float64):
    """The suite's textbook attention (``tests/oracle.py``) in float64, or in the inputs' dtype for a lower
    ``dtype``; ``round_probs``: P rounded as an FP8 forward rounds it."""
    sys.path.insert(0, str(TESTS))
    import oracle

    inputs = [t.to(dtype) for t in (q, k, v)]
    return oracle.attention_ref(*inputs, causal=causal, round_probs=round_probs, upcast=dtype == torch.float64)[0]


def _quantized_values(x: torch.Tensor, heads_k: int) -> torch.Tensor:
    from flashattn.quantize import amax_scales, from_fp8, to_fp8

    scale = amax_scales(x, heads_k=heads_k)
    return from_fp8(to_fp8(x, scale), scale, torch.float64)


def _errors(result: list[torch.Tensor], truth: list[torch.Tensor]) -> dict[str, float]:
    names = ("out", "dq", "dk", "dv")
    pairs = zip(names, result, truth, strict=True)
    return {n: float((r.double() - t).abs().max() / t.abs().max()) for n, r, t in pairs}


def _run(fn, inputs: list[torch.Tensor], dout: torch.Tensor) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(dout.to(out.dtype))
    return [out.detach(), *(t.grad for t in leaves)]


def measure(path: str, seqlen: int, *, heads=(8, 2), head_dim=128, causal=True, seed=0) -> dict:
    import flashattn

    torch.manual_seed(seed)
    h, hk = heads
    q, k, v = (torch.randn(1, seqlen, n, head_dim, dtype=torch.bfloat16) for n in (h, hk, hk))
    dout = torch.randn(1, seqlen, h, head_dim, dtype=torch.float64)
    exact = _run(lambda *x: _attention(*x, causal=causal), [q, k, v], dout)
    at_quantized = [_quantized_values(t, hk) for t in (q, k, v)]
    exact_quantized = _run(lambda *x: _attention(*x, causal=causal), at_quantized, dout)
    rounds = torch.float8_e4m3fn if path == "triton" else None
    with flashattn.use_backend(path):
        bf16 = _run(lambda *x: flashattn.flash_attn_func(*x, causal=causal), [q, k, v], dout)
        fp8 = _run(lambda *x: flashattn.flash_attn_func(*x, causal=causal, fp8=True), [q, k, v], dout)
    baseline = _run(lambda *x: _attention(*x, causal=causal, round_probs=rounds, dtype=torch.bfloat16),
                    [t.bfloat16() for t in at_quantized], dout)
    return {"path": path, "seqlen": seqlen, "heads": list(heads), "head_dim": head_dim, "causal": causal,
            "bf16": _errors(bf16, exact), "fp8 mode": _errors(fp8, exact), "fp8 kernel": _errors(fp8, exact_quantized),
            "bf16 at quantized": _errors(baseline, exact_quantized)}


def table(rows: list[dict]) -> str:
    lines = ["| path | tokens | computation | out | dq | dk | dv |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        for name in ("bf16", "fp8 mode", "fp8 kernel", "bf16 at quantized"):
            e = row[name]
            lines.append(f"| {row['path']} | {row['seqlen']} | {name} | " +
                         " | ".join(f"{e[n]:.2e}" for n in ("out", "dq", "dk", "dv")) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", default="cpu", help="cpu, torch or triton (CPU tensors under TRITON_INTERPRET=1)")
    parser.add_argument("--seqlens", default="512,2048")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = [measure(args.path, int(n)) for n in args.seqlens.split(",")]
    print(table(rows))
    if args.out:
        meta = {"python": sys.version.split()[0], "torch": torch.__version__, "machine": platform.processor()}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
