"""The Hopper tier's one-pass backward kernels on the GPU, alone: dQ, dK and dV against float64, case by case.

``tools.gluon.gpu_run`` runs ``check_backward(d, causal)`` in a child process with a timeout for d 64, 128 and 256 and
the padded head dims between (``gpu_run.PADDED_DIMS``; a barrier protocol that is wrong deadlocks rather than fails),
beside the forward's variants. Each case launches the kernel ``hopper.backward.launch_arguments`` picks, on its own
inputs: lse and out from float64 attention, ``neg_lse2`` and ``delta`` from them as the portable preprocess writes them,
the fp32 dQ sum zeroed and dK, dV poisoned with NaN first. The bound is the tolerance rule's for gradients: at most 3x
plain bf16 attention's error against float64 (its gradients by autograd), plus one bf16 ulp of the reference's largest
magnitude. The shapes cross every tile edge the kernels have: 1 row, odd lengths, more queries than keys (causal rows
that see no key: their dQ 0), grouped heads (a program sums dK and dV over its group); and on two of them sliding
windows of either alignment and softcaps (``BANDS``). Deterministic launches (dQ's adds ordered on semaphores) on
the grouped shape, plain and under the first window, each run twice: the two dQs must be the same bits and the
semaphores back at zero.

``--dry`` in ``gpu_run`` replaces the kernel by autograd on the CPU, so the harness is tested without a GPU.
"""

from __future__ import annotations

import math

# (batch, seqlen_q, seqlen_k, heads, kv_heads)
SHAPES = ((1, 1, 1, 2, 2), (2, 113, 113, 3, 3), (2, 173, 251, 2, 2), (1, 300, 100, 2, 2), (2, 173, 251, 6, 2),
          (1, 1025, 1025, 2, 1))
HEAD_DIMS = (64, 128, 256)
# (window, top-left aligned, softcap) on SHAPES[2] and SHAPES[4]; causal cases take right = 0
BANDS = (((77, 20), False, 0.0), ((150, -1), False, 30.0), ((300, 40), True, 20.0))
PLAIN = ((-1, -1), False, 0.0)


def _reference(causal: bool, band) -> dict:
    window, top_left, softcap = band
    return dict(causal=causal, window=window, bottom_right=not top_left, softcap=softcap)


def _grads(q, k, v, dout, *, causal: bool, upcast: bool, band=PLAIN):
    """(dq, dk, dv) of plain attention by autograd, in float64 or the inputs' dtype."""
    import torch

    from tests.oracle import attention_ref

    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, _ = attention_ref(*leaves, upcast=upcast, **_reference(causal, band))
    grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
    return [g.to(torch.float64) for g in grads]


def _kernel_grads(q, k, v, dout, *, causal: bool, dry: bool, band=PLAIN, semaphores=None):
    """(dq, dk, dv) from the tier's backward kernel (``dry``: autograd in the inputs' dtype on the CPU);
    ``semaphores``: deterministic, on these zeroed counters."""
    import torch

    if dry:
        return _grads(q, k, v, dout, causal=causal, upcast=False, band=band)
    from flashattn.backends.triton.hopper.backward import launch_arguments
    from tests.oracle import attention_ref

    out, lse = attention_ref(q, k, v, **_reference(causal, band))  # float64; lse -inf where a row sees no key
    delta = (dout.double() * out).sum(-1).transpose(1, 2).float().contiguous()
    # -lse in log2 units; -inf where a row sees no key (its weights 2^-inf = 0), as the preprocess writes it
    neg_lse2 = torch.where(torch.isfinite(lse), -lse / math.log(2), -math.inf).float().contiguous()
    dq_sum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    window, top_left, softcap = band
    kernel, grid, kwargs = launch_arguments(q, k, v, dout, (neg_lse2, delta), (dq_sum, dk, dv), causal=causal,
                                            scale=q.shape[-1] ** -0.5, window=window, top_left=top_left,
                                            softcap=softcap, dq_semaphores=semaphores)
    kernel[grid](**kwargs)
    torch.cuda.synchronize()
    return [g.to(torch.float64) for g in (dq_sum, dk, dv)]


def check_backward(d: int, causal: bool, dry: bool) -> dict:
    """Every shape at head dim d, and the bands on two: {'ok', 'cases': [{shape, band, ok, errors, bounds, nan}]}."""
    import torch

    from tests.oracle import max_err

    device = "cpu" if dry else "cuda"
    torch.manual_seed(0)
    cases = []
    plain = [(shape, PLAIN, False) for shape in (SHAPES[:2] if dry else SHAPES)]
    bands = [(shape, band, False) for shape in (SHAPES[2], SHAPES[4]) for band in BANDS]
    ordered = [(SHAPES[4], band, True) for band in (PLAIN, BANDS[0])]  # (two more compilations a child)
    for (b, nq, nk, h, hk), band, deterministic in plain + (bands[:1] if dry else bands + ordered):
        q, dout = (torch.randn(b, nq, h, d, dtype=torch.bfloat16, device=device) for _ in range(2))
        k, v = (torch.randn(b, nk, hk, d, dtype=torch.bfloat16, device=device) for _ in range(2))
        ref = _grads(q, k, v, dout, causal=causal, upcast=True, band=band)
        base = _grads(q, k, v, dout, causal=causal, upcast=False, band=band)
        ordering = {}
        if deterministic:
            from flashattn.backends.triton.hopper.backward import semaphores_needed

            ordering["semaphores"] = torch.zeros(semaphores_needed(q), dtype=torch.int32, device=device)
        ours = _kernel_grads(q, k, v, dout, causal=causal, dry=dry, band=band, **ordering)
        repeats = True
        if deterministic:  # the same bits again, and the counters left at zero
            again = _kernel_grads(q, k, v, dout, causal=causal, dry=dry, band=band, **ordering)
            repeats = all(torch.equal(a, b) for a, b in zip(ours, again, strict=True)) and not (
                ordering["semaphores"].any())
        eps = torch.finfo(torch.bfloat16).eps
        errors = [max_err(g, r) for g, r in zip(ours, ref, strict=True)]
        bounds = [3 * max_err(g, r) + eps * (1 + r.abs().max().item()) for g, r in zip(base, ref, strict=True)]
        nan = any(bool(torch.isnan(g).any()) for g in ours)
        ok = not nan and repeats and all(e <= bound for e, bound in zip(errors, bounds, strict=True))
        cases.append(dict(shape=[b, nq, nk, h, hk], band=list(band), ok=ok, errors=errors, bounds=bounds, nan=nan,
                          deterministic=deterministic, repeats=repeats))
    return {"ok": all(c["ok"] for c in cases), "cases": cases}
