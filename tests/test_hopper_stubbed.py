"""The triton path's Hopper tier with its kernels compiled for sm_90 and their launches stubbed (a process without
Triton's interpreter, this file run as a script): a call the tier takes launches the warp-specialized kernel on that
call's own tensors (a launch plan replays it with its Gluon descriptors rebuilt around each call's q, k and v, never
a previous call's), its backward is the portable one unless forced (then its own one-pass kernel), every other
call, GPU or setting keeps the portable forward, and the forced tier's grids, maps and scalars are the call's
(grouped heads, FP8, packed sequences, bands and softcaps, padded head dims). Which calls it takes:
``test_hopper_tier.py``; its results on a GPU: gpu-check (the kernel smoke and the ``gluon`` step).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from triton_versions import needs_triton, recorded_on_oldest

from conftest import run_compiled

BF16 = torch.bfloat16


@needs_triton
@recorded_on_oldest("the Hopper tier's Gluon kernel (Gluon's API changes between releases)")
def test_stubbed_calls_launch_the_tier_on_their_own_tensors():
    seen = json.loads(run_compiled(__file__).strip().splitlines()[-1])
    assert seen["causal d64"] == [["attention_forward_ws_kernel", [8, 3]]]
    assert seen["each call's tensors"] == [["its own", "run"], ["its own", "replayed"], ["its own", "replayed"]]
    assert seen["training step"][0] == ["attention_forward_ws_kernel", [8, 3]]
    assert all("backward" in name for name, _ in seen["training step"][1:]) and len(seen["training step"]) > 1
    for portable in ("d128", "fp16", "GQA", "sm_80", "tier=portable d64"):
        assert [name for name, _ in seen[portable]] == ["attention_forward_kernel"], portable
    assert seen["tier=hopper d128"] == [["attention_forward_ws_kernel", [8, 3]]]
    # Forced, the backward is the tier's one-pass kernel between the portable preprocess (delta, -lse, dQ's sum
    # zeroed) and dQ's rounding, replayed by a plan the second time.
    backward = ["attention_backward_preprocess_kernel", "attention_backward_ws_kernel",
                "attention_backward_dq_convert_kernel"]
    assert seen["tier=hopper training step"] == [[backward, 3], [backward, 0]]
    # 4 query heads over 2 key heads: a program per (batch, key head) and 128 keys (300 keys: 3 blocks).
    assert [name for name, _ in seen["tier=hopper GQA backward"]] == backward
    assert seen["tier=hopper GQA backward"][1][1] == [2 * 2, 3]
    # Deterministic: the same backward kernel, handed the stream's zeroed counters (``tickets``; two per query head
    # and 64-row tile, and one per head a sequence: 2 x 4 x (2 + 10) = 96 of them), also when a plan replays it.
    deterministic = seen["tier=hopper deterministic"]
    assert [step[:3] for step in deterministic] == [[backward[1], [2 * 2, 3], 3], [backward[1], [2 * 2, 3], 0]]
    assert all(len(step[3]) == 1 and step[3][0][0] >= 96 and step[3][0][1] == 0 for step in deterministic)
    # torch.use_deterministic_algorithms(True) asks for the same, also of a call the fast path has seen before.
    assert seen["tier=hopper torch deterministic"] == [0, 0, 1]
    # FP8: the tier's forward on e4m3 q, k, v, V^T's map over (batch x kv heads x d, keys padded to 32: 320).
    assert seen["tier=hopper fp8"] == [["attention_forward_ws_kernel", [8, 3]], [2 * 4 * 64, 320]]
    # d=128: the same kernel and grid; d=256: backward_wide's, 64 keys a program (300 keys: 5 blocks).
    assert seen["tier=hopper d128 backward"][:2] == seen["tier=hopper GQA backward"][:2]
    wide = [backward[0], "attention_backward_wide_kernel", backward[2]]
    assert [name for name, _ in seen["tier=hopper d256 backward"]] == wide
    assert seen["tier=hopper d256 backward"][1][1] == [2 * 2, 5]
    # Padded head dims: the tier's forward and backward (backward_wide's on 256 columns, 64 keys a program), K's map
    # over the heads' own columns (2 x d) in tiles of the padded width (TMA boxes of 64 bf16 columns at most).
    for d, tile, kernel, blocks in ((40, 64, backward[1], 3), (96, 128, backward[1], 3), (192, 256, wide[1], 5)):
        launched, k_shape, k_block = seen[f"tier=hopper d{d}"]
        assert launched[0] == ["attention_forward_ws_kernel", [8, 3]] and launched[2] == [kernel, [2 * 2, blocks]]
        assert k_shape == [600, 2 * d] and k_block == [128 if tile < 256 else 64, 64]
    # 4 query heads over 2 key heads: K's tensor map spans (batch x keys, 2 x d), and the kernel's group is 2.
    assert seen["tier=hopper GQA"] == [["attention_forward_ws_kernel", [8, 3]], [600, 128], 2]
    # Packed sequences: a program per (sequence, head) and 128 rows of the longest (500: 4), the offsets the call's,
    # lse's rows as long as the total queries; the second call replays the first's plan with its own offsets.
    first, second = seen["tier=hopper varlen"]
    assert first == ["attention_forward_ws_kernel", [2 * 4, 4], 500, 600, False, True, True]
    assert second == ["attention_forward_ws_kernel", [2 * 4, 4], 500, 600, True, True, True]
    # Its training step: the tier's backward, a program per (sequence, kv head) and 128 keys of the longest (350: 3).
    assert seen["tier=hopper varlen backward"]["attention_backward_ws_kernel"] == [2 * 2, 3]
    # A sliding window and a softcap: no diagonal offset, bottom-right, left 100, right 0, and the softcap's two
    # factors, 2 log2(e) scale / c and c log2(e) (scale 64^-0.5).
    (name, grid), scalars = seen["tier=hopper window softcap"]
    assert [name, grid] == ["attention_forward_ws_kernel", [8, 3]]
    log2e = 1.4426950408889634
    assert scalars == [0, 1, 100, 0, pytest.approx(2 * log2e * 0.125 / 30), pytest.approx(30 * log2e)]


def _script() -> dict:
    import os

    import flashattn
    from flashattn.backends.triton.stub import stubbed_launches

    def run(arch: int, make, **kw) -> tuple[list, list]:
        with stubbed_launches(arch, keep_arguments=True) as launches, flashattn.use_backend("triton"):
            launches.clear()
            tensors = make()
            flashattn.flash_attn_func(*tensors, **kw)
            return [[name, list(grid[:2])] for name, grid, _ in launches.arguments], launches, tensors

    def dense(d=64, dtype=BF16, hk=4, grad=False):
        return lambda: [torch.randn(2, 300, h, d, dtype=dtype, requires_grad=grad) for h in (4, hk, hk)]

    seen = {"causal d64": run(90, dense(), causal=True)[0]}
    with stubbed_launches(90, keep_arguments=True) as launches, flashattn.use_backend("triton"):
        calls = []
        for _ in range(3):  # the first call of a signature records its plan, the later ones replay it
            launches.clear()
            q, k, v = dense()()
            out = flashattn.flash_attn_func(q, k, v)
            maps = [a.pointer for a in launches.arguments[0][2] if type(a).__name__ == "StubTensorMap"]
            pointers = [a.data_ptr() for a in launches.arguments[0][2] if isinstance(a, torch.Tensor)]
            own = maps == [t.data_ptr() for t in (q, k, v)] and out.data_ptr() in pointers
            calls.append(["its own" if own else "another's", "replayed" if launches.through_launcher == 0 else "run"])
        seen["each call's tensors"] = calls
    with stubbed_launches(90, keep_arguments=True) as launches, flashattn.use_backend("triton"):
        q, k, v = dense(grad=True)()
        out = flashattn.flash_attn_func(q, k, v, causal=True)
        launches.clear()
        out.backward(torch.ones_like(out))
        backward = [name for _, name in launches.stamps]
    seen["training step"] = seen["causal d64"] + [[name, []] for name in backward]
    seen["d128"] = run(90, dense(d=128))[0]
    seen["fp16"] = run(90, dense(dtype=torch.float16))[0]
    seen["GQA"] = run(90, dense(hk=2))[0]
    seen["sm_80"] = run(80, dense())[0]
    os.environ["FLASHATTN_TRITON_TIER"] = "portable"
    seen["tier=portable d64"] = run(90, dense())[0]
    os.environ["FLASHATTN_TRITON_TIER"] = "hopper"
    seen["tier=hopper d128"] = run(90, dense(d=128))[0]
    with stubbed_launches(90, keep_arguments=True) as launches, flashattn.use_backend("triton"):
        steps = []
        for _ in range(2):  # the second step's backward replays the first one's launch plan
            q, k, v = dense(grad=True)()
            out = flashattn.flash_attn_func(q, k, v, causal=True)
            launches.clear()
            out.backward(torch.ones_like(out))
            steps.append([[name for _, name in launches.stamps], launches.through_launcher])
        seen["tier=hopper training step"] = steps
        q, k, v = dense(hk=2, grad=True)()
        out = flashattn.flash_attn_func(q, k, v, causal=True)
        launches.clear()
        out.backward(torch.ones_like(out))
        seen["tier=hopper GQA backward"] = [[name, list(grid[:2])] for name, grid, _ in launches.arguments]
        for d in (128, 256):
            q, k, v = dense(d=d, hk=2, grad=True)()
            out = flashattn.flash_attn_func(q, k, v, causal=True)
            launches.clear()
            out.backward(torch.ones_like(out))
            seen[f"tier=hopper d{d} backward"] = [[name, list(grid[:2])] for name, grid, _ in launches.arguments]
        for _ in range(2):  # deterministic: dQ's adds take turns on zeroed int32 counters (the second: replayed)
            q, k, v = dense(hk=2, grad=True)()
            out = flashattn.flash_attn_func(q, k, v, causal=True, deterministic=True)
            launches.clear()
            out.backward(torch.ones_like(out))
            name, grid, arguments = launches.arguments[1]
            counters = [a for a in arguments if isinstance(a, torch.Tensor) and a.dtype == torch.int32]
            seen.setdefault("tier=hopper deterministic", []).append(
                [name, list(grid[:2]), launches.through_launcher, [[c.numel(), int(c.count_nonzero())]
                                                                   for c in counters]])
        for switch in (False, False, True):  # PyTorch's global switch, after the fast path learned the call
            torch.use_deterministic_algorithms(switch)
            q, k, v = dense(hk=2, grad=True)()
            out = flashattn.flash_attn_func(q, k, v, causal=True)
            launches.clear()
            out.backward(torch.ones_like(out))
            counters = [a for a in launches.arguments[1][2] if isinstance(a, torch.Tensor) and a.dtype == torch.int32]
            seen.setdefault("tier=hopper torch deterministic", []).append(len(counters))
        torch.use_deterministic_algorithms(False)
        for d in (40, 96, 192):  # padded tiles: 64, 128, 256 columns of the (batch x keys, 2 x d) view
            q, k, v = dense(d=d, hk=2, grad=True)()
            launches.clear()
            out = flashattn.flash_attn_func(q, k, v, causal=True)
            out.backward(torch.ones_like(out))
            k_map = [a for a in launches.arguments[0][2] if type(a).__name__ == "StubTensorMap"][1]
            seen[f"tier=hopper d{d}"] = [[[name, list(grid[:2])] for name, grid, _ in launches.arguments],
                                         k_map.shape, k_map.block]
    ones = torch.ones(2, 4)
    fp8 = lambda: [t.to(torch.float8_e4m3fn) for t in dense()()]  # noqa: E731
    names, launches, _ = run(90, fp8, q_descale=ones, k_descale=ones, v_descale=ones)
    maps = [a for a in launches.arguments[0][2] if type(a).__name__ == "StubTensorMap"]
    seen["tier=hopper fp8"] = [*names, maps[2].shape]
    def scalars(arguments) -> dict:
        """The launch's arguments from o_ptr on (the first tensor after the descriptors), by name."""
        from flashattn.backends.triton.hopper.forward import attention_forward_ws_kernel as kernel

        out = next(i for i, a in enumerate(arguments) if isinstance(a, torch.Tensor))
        return dict(zip(kernel.arg_names[kernel.arg_names.index("o_ptr"):], arguments[out:], strict=False))

    with stubbed_launches(90, keep_arguments=True) as launches, flashattn.use_backend("triton"):
        seen["tier=hopper varlen"] = []
        for q_cut, k_cut in ((100, 350), (250, 200)):  # the second call replays the first one's plan
            launches.clear()
            q, k, v = (torch.randn(n, h, 64, dtype=BF16) for n, h in ((600, 4), (700, 2), (700, 2)))
            cu_q = torch.tensor([0, q_cut, 600], dtype=torch.int32)
            cu_k = torch.tensor([0, k_cut, 700], dtype=torch.int32)
            flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 500, 350, causal=True)
            (name, grid, arguments), = [a for a in launches.arguments if a[0] != "check_varlen_kernel"]
            named = scalars(arguments)
            offsets = (named["cu_seqlens_q"], cu_q), (named["cu_seqlens_k"], cu_k)
            seen["tier=hopper varlen"].append(
                [name, list(grid[:2]), named["seqlen_q"], named["lse_pitch"], launches.through_launcher == 0,
                 *(torch.equal(launched, given) for launched, given in offsets)])
            if q_cut == 100:  # and a training step: the tier's backward on the same offsets, 128 keys a program
                q, k, v = (t.requires_grad_() for t in (q, k, v))
                out = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 500, 350, causal=True)
                launches.clear()
                out.backward(torch.ones_like(out))
                seen["tier=hopper varlen backward"] = {n: list(g[:2]) for n, g, _ in launches.arguments}
                launches.clear()
    names, launches, _ = run(90, dense(hk=2))
    arguments = launches.arguments[0][2]
    k_map = [a for a in arguments if type(a).__name__ == "StubTensorMap"][1]
    seen["tier=hopper GQA"] = [*names, k_map.shape, scalars(arguments)["group"]]
    names, launches, _ = run(90, dense(), window_size=(100, 0), softcap=30.0)
    named = scalars(launches.arguments[0][2])
    seen["tier=hopper window softcap"] = [*names, [named[k] for k in ("diagonal_offset", "bottom_right",
                                                                        "window_left", "window_right", "softcap_in",
                                                                        "softcap_out")]]
    return seen


if __name__ == "__main__":
    print(json.dumps(_script()))
    sys.exit(0)
