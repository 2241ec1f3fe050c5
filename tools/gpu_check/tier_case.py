"""gpu-check's ``tier`` smoke case: a forward and backward through ``flash_attn_func`` whose forward the triton path's
Hopper tier runs (``flashattn/backends/triton/hopper/``), judged against float64 like every other case: the tier's
routing, its out and lse as the portable backward reads them, on the GPU.

``FLASHATTN_TRITON_TIER=hopper`` for the case, so every dtype and head dim its kernel can run is checked (by default
it takes bf16 at head dim 64 alone), with the smoke's grouped key/value heads (the kernel's own step, ``gluon``,
checks as many key as query heads too); with as many key as query heads again, so that the tier's one-pass
backward (d=64, 128, 256) is checked as well, with a sliding window and a softcap (errors named "band ...": the
tier's forward, the portable backward from its out and lse), and with bf16 the tier's FP8 forward (the
``fp8-matmul`` check);
``declined`` (and why) where it cannot run. On a GPU in a child process
with a time limit (``CHILD_TIMEOUT_S``): the tier's kernels are the ones whose barriers can hang.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

# The tier's kernels synchronise their warps through mbarriers: a wrong protocol hangs rather than fails. On a GPU
# each case runs in a child process, killed after this long (a case takes seconds), so a hang costs one case, not
# its smoke worker's remaining ones.
CHILD_TIMEOUT_S = 180


def check_tier(case, sizes, device: str, check_fwd_bwd, check_fp8=None) -> dict:
    """The case's errors; ``check_fp8`` (the smoke's ``fp8-matmul`` check): with the bf16 case, the tier's FP8
    forward too, where it takes the call (errors named "fp8 ...")."""
    if device == "cuda" and os.environ.get(_CHILD) != "1":
        return _in_child(case, sizes, device)
    import torch

    from flashattn.backends.spec import AttentionSpec
    from flashattn.backends.triton import hopper
    from flashattn.errors import ArgumentError

    dtype, d = getattr(torch, case.dtype), case.head_dim
    q = torch.empty(sizes.batch, sizes.nq, sizes.heads, d, dtype=dtype, device=device)
    k = torch.empty(sizes.batch, sizes.nk, sizes.heads_k, d, dtype=dtype, device=device)
    with hopper.using("hopper"):
        why = hopper.declines(q, k, k, AttentionSpec(scale=d**-0.5, window_right=0 if case.causal else -1),
                              probs=False)
        if why:
            raise ArgumentError(f"tier: the Hopper tier's path cannot run this call: {why}")
        errors = check_fwd_bwd(case, sizes, device)
        # As many key as query heads too: there the backward is the tier's own one-pass kernel where it runs.
        mha = dataclasses.replace(sizes, heads_k=sizes.heads)
        if hopper.backward_declines(q, q, q, q, AttentionSpec(scale=d**-0.5)) is None:
            errors.update({f"mha {name}": error for name, error in check_fwd_bwd(case, mha, device).items()})
        window = _window(case, sizes)
        band = AttentionSpec(scale=d**-0.5, window_left=window[0], window_right=0 if case.causal else window[1],
                             softcap=SOFTCAP)
        if hopper.declines(q, k, k, band, probs=False) is None:
            errors.update({f"band {name}": error for name, error in _check_band(case, sizes, device).items()})
        if check_fp8 is not None and case.dtype == "bfloat16" and _takes_fp8(q, k, case.causal):
            errors.update({f"fp8 {name}": error for name, error in check_fp8(case, sizes, device).items()})
        return errors


SOFTCAP = 30.0


def _window(case, sizes) -> tuple[int, int]:
    """A band narrower than the keys on both sides, so that its tiles are skipped, masked and whole."""
    return max(sizes.nk // 3, 1), max(sizes.nk // 5, 1)


def _check_band(case, sizes, device: str) -> dict:
    """flash_attn_func with a sliding window (causal: its right side 0) and a softcap, forward and backward, judged
    against float64 like every case."""
    from .smoke import _forward_backward, _inputs, _judge

    q, k, v = _inputs(case, sizes, device)
    window = _window(case, sizes)
    out, grads = _forward_backward(q, k, v, causal=case.causal, window_size=window, softcap=SOFTCAP)
    return _judge((q, k, v), out, grads, causal=case.causal, window=window, softcap=SOFTCAP)


def _takes_fp8(q, k, causal: bool) -> bool:
    """Whether the tier's forward runs an FP8 call of these shapes (the smoke's ``fp8-matmul`` inputs)."""
    import torch

    from flashattn.backends.spec import AttentionSpec, Descale
    from flashattn.backends.triton import hopper
    from flashattn.backends.triton.attend import interleaved_values

    q8, k8 = q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn)
    ones = torch.ones(q.shape[0], k.shape[2], device=q.device)
    spec = AttentionSpec(scale=q.shape[-1] ** -0.5, window_right=0 if causal else -1,
                         descale=Descale(ones, ones, ones))
    return hopper.declines(q8, k8, interleaved_values(k8), spec, probs=False, values_interleaved=True) is None


_CHILD = "FLASHATTN_GPU_CHECK_TIER_CHILD"


def _in_child(case, sizes, device: str) -> dict:
    """``check_tier`` in a child process (``run_case`` there, so the same seed and poisoning), its outcome raised
    here as ``run_case`` expects: errors, a decline, a wrong result, a fault, or a hang (a wrong result)."""
    from flashattn.errors import ArgumentError

    from .plan import ROOT

    env = {**os.environ, _CHILD: "1",
           "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    payload = json.dumps({"case": dataclasses.asdict(case), "sizes": dataclasses.asdict(sizes), "device": device})
    try:
        done = subprocess.run([sys.executable, "-m", "tools.gpu_check.tier_case", payload], capture_output=True,
                              text=True, env=env, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"tier: no result within {CHILD_TIMEOUT_S} s (a kernel that never finishes: a barrier "
                             "protocol that deadlocks)") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"tier: its child process exited {done.returncode}: {done.stderr.strip()[-300:]}")
    row = json.loads(lines[-1])
    if row["status"] == "ok":
        return row["errors"]
    if row["status"] == "declined":
        raise ArgumentError(f"tier: the Hopper tier's path cannot run this call: {row['reason']}")
    if row["status"] == "wrong":
        raise AssertionError(row["reason"])
    raise RuntimeError(row["reason"])


def _main(payload: str) -> int:
    from .smoke import Case, Sizes, run_case

    given = json.loads(payload)
    print(json.dumps(run_case(Case(**given["case"]), Sizes(**given["sizes"]), given["device"])))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1]))
