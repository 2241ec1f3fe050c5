"""gpu-check's ``tier`` smoke case: a forward and backward through ``flash_attn_func`` whose forward the triton path's
Hopper tier runs (``flashattn/backends/triton/hopper/``), judged against float64 like every other case: the tier's
routing, its out and lse as the portable backward reads them, on the GPU.

``FLASHATTN_TRITON_TIER=hopper`` for the case, so every dtype and head dim its kernel can run is checked (by default
it takes bf16 at head dim 64 alone), with the smoke's grouped key/value heads (the kernel's own step, ``gluon``,
checks as many key as query heads too); where the tier's one-pass backward runs (d=64), again with as many key as
query heads, so that backward is checked as well; ``declined`` (and why) where it cannot run.
"""

from __future__ import annotations

import dataclasses


def check_tier(case, sizes, device: str, check_fwd_bwd) -> dict:
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
        return errors
