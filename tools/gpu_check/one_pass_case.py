"""gpu-check's ``one-pass`` smoke case: ``fwd+bwd`` with the one-pass backward (``FLASHATTN_TRITON_BACKWARD=one-pass``:
dQ summed by atomics in the dK/dV kernel, then rounded), judged against float64 like every other case; ``declined``
where the setting runs two passes (a GPU family without one-pass configs, or an entry without a healthy one:
``configs.ONE_PASS``).
"""

from __future__ import annotations


def check_one_pass(case, sizes, device: str, check_fwd_bwd) -> dict:
    from flashattn.backends.triton import configs
    from flashattn.backends.triton.launch import target_arch
    from flashattn.errors import ArgumentError

    with configs.backward_passes("one-pass"):
        arch, weight = target_arch(), "fp32-light" if case.dtype == "float32" else "plain"
        if not configs.one_pass_backward(arch, deterministic=False, special=False, entry=(case.head_dim, weight)):
            raise ArgumentError(f"one-pass: the one-pass path cannot run this call: two passes run on "
                                f"{configs.family(arch).name} at head dim {case.head_dim}, {weight}")
        return check_fwd_bwd(case, sizes, device)
