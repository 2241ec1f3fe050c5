"""Launch plans (flashattn.backends.triton.plans): a replayed call launches exactly what the path's full Python
launches for the same inputs: the same kernels, grids and arguments, the call's own tensors in their places (never a
previous call's), fresh outputs and workspaces. Checked on the kernels compiled for sm_90 with stubbed launches
(which record every argument), in a process without Triton's interpreter, for every kind of call plans serve: dense,
GQA, masks, ALiBi, sinks, dropout, windows, packed sequences, KV caches (dense, paged, appending, growing), SDPA's
layout and the backward (two passes and one)."""

from __future__ import annotations

import os

import pytest
from triton_versions import TRITON_MISSING

from conftest import run_compiled


@pytest.mark.skipif(bool(TRITON_MISSING), reason=TRITON_MISSING or "")
def test_replayed_launches_equal_the_full_path():
    out = run_compiled(__file__)
    assert "cases replayed: " in out, out


@pytest.mark.skipif(bool(TRITON_MISSING), reason=TRITON_MISSING or "")
def test_a_view_of_inputs_sharing_a_storage_is_not_planned():
    """k and v unbound from one kv tensor share a storage: a view the call makes of either cannot be told from a
    view of the other, and a later call of the same signature may bring them apart, so no plan is made."""
    import torch

    from flashattn.backends.triton import plans

    kv = torch.randn(4, 2, 8)
    k, v = kv.unbind(1)
    slot, _ = plans._tracer([k, v], [], set())
    assert slot(k) == ("in", 0, None) and slot(v) == ("in", 1, None)  # the inputs themselves: known
    with pytest.raises(plans._Untraceable):
        slot(v[None])
    k2, v2 = k.clone(), v.clone()
    apart, _ = plans._tracer([k2, v2], [], set())
    assert apart(v2[None])[:2] == ("in", 1)  # on their own storages, a view is traced to its input



@pytest.mark.skipif(bool(TRITON_MISSING), reason=TRITON_MISSING or "")
def test_an_argument_of_unknown_type_is_not_baked_into_a_plan():
    """A kernel argument that is neither a tensor, a traced descriptor nor a plain value (here an object shaped as a
    TMA descriptor, which holds its tensor's address) would launch every replay on the first call's memory: no plan
    is made."""
    import inspect
    from types import SimpleNamespace

    import torch

    from flashattn.backends.triton import plans

    q, out = torch.randn(4, 8), torch.empty(4, 8)
    kernel = SimpleNamespace(signature=inspect.signature(lambda q_desc, o_ptr, n, modes: None))

    def recorded(q_desc) -> plans.Recording:
        kwargs = dict(q_desc=q_desc, o_ptr=out, n=4, modes=(1, "x", None, 2.0))
        return plans.Recording([(kernel, None, (1,), kwargs)], {plans._storage_of(out)})

    assert plans._constant((1, "x", None, 2.0, (True,))) and not plans._constant((1, q))
    foreign = SimpleNamespace(base=q, shape=[4, 8], strides=[8, 1], block_shape=[4, 8])
    assert plans.build(recorded(foreign), [q], [out]) is None
    assert plans.build(recorded((q,)), [q], [out]) is None  # a bundle of tensors, as before
    # (that every kind of call the path makes is still planned: test_replayed_launches_equal_the_full_path)

# --- the check itself, run as a script ------------------------------------------------------------------------------


@pytest.mark.skipif(bool(TRITON_MISSING), reason=TRITON_MISSING or "")
def test_a_tensor_map_is_encoded_once_per_base_pointer():
    """A plan's descriptor slot encodes a tensor map per base pointer (the rest of what it encodes is fixed) and
    hands the same map back for a pointer it has seen; it keeps a bounded number."""
    from flashattn.backends.triton import entry

    encodes = []

    def fill(pointer, *fields):
        encodes.append(pointer)
        return (pointer, fields)

    maps = entry.TensorMaps(fill, (3, 2))
    assert maps(64) == (64, (3, 2)) and maps(128) == (128, (3, 2))
    assert maps(64) is maps(64) and encodes == [64, 128]
    for pointer in range(1, 2 * maps.LIMIT):
        assert maps(pointer * 16)[0] == pointer * 16
    assert len(maps._maps) <= maps.LIMIT


@pytest.mark.skipif(bool(TRITON_MISSING), reason=TRITON_MISSING or "")
def test_a_descriptor_expands_as_the_launcher_expands_it():
    """``entry.expansion`` writes out what Triton 3.6's ``make_tensordesc_arg`` passes for a descriptor: the encode's
    arguments and the constants after the map (FP4-padded: the last dim doubled in both), or, unlowered, the
    decomposed fields after the base."""
    from flashattn.backends.triton.entry import expansion

    fields = {"shape": [128, 64], "strides": [64, 1], "block_shape": [32, 64], "padding": "zero"}
    meta = {"swizzle": 3, "elem_size": 1, "elem_type": 0, "block_size": [32, 128], "fp4_padded": False}
    encode, after = expansion(fields, meta)
    assert encode[-3:] == ([128, 64], [64, 1], 0) and after == (128, 64, 64, 1)
    encode, after = expansion(fields, {**meta, "fp4_padded": True})
    assert encode[-3] == [128, 128] and after == (128, 128, 64, 1)
    assert fields["shape"] == [128, 64]  # the plan's own fields untouched
    assert expansion(fields, None) == (None, (128, 64, 64, 1, False, 128, 64, 64, 1))


@pytest.mark.skipif(bool(TRITON_MISSING), reason=TRITON_MISSING or "")
def test_the_path_launches_on_its_tensors_device(monkeypatch):
    """Triton launches on the current device: the path's forward and backward make their tensors' GPU current
    first when it is another (a model spread over GPUs in one process), and leave it alone otherwise."""
    import torch

    from flashattn.backends.triton import attend

    entered = []

    class Guard:
        def __init__(self, device):
            entered.append(device)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class OnGpu:
        is_cuda = True

        def __init__(self, index):
            self.device = torch.device("cuda", index)

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", Guard)
    step = attend.on_tensors_device(lambda first, x, *, y: (x, y, list(entered)))
    assert step(OnGpu(0), 1, y=2) == (1, 2, [])
    assert step(OnGpu(1), 1, y=2) == (1, 2, [torch.device("cuda", 1)])
    assert attend.forward.__wrapped__ and attend.backward.__wrapped__  # both entry points guarded


def _cases(torch, flashattn):
    """name -> a function of a seed returning (call, the tensors it reads), each call of one signature."""
    bf16, dev = torch.bfloat16, "cpu"

    def dense(seed, h=8, hk=2, d=128, n=100, dtype=bf16, grad=False, unaligned=False, **kwargs):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(2, n, heads, d, generator=g, dtype=dtype, device=dev, requires_grad=grad)
                   for heads in (h, hk, hk))
        if unaligned:  # q one element into its storage: not 16-byte aligned, another plan
            q = torch.randn(2 * n * h * d + 1, generator=g, dtype=dtype)[1:].view(2, n, h, d)
        if not grad:
            return (lambda: flashattn.flash_attn_func(q, k, v, **kwargs)), [q, k, v]
        out_grad = torch.randn(2, n, h, d, generator=g, dtype=dtype)

        def train():
            out, lse, _ = flashattn.flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
            torch.autograd.grad((out, lse), (q, k, v), (out_grad, torch.ones_like(lse)))

        return train, [q, k, v, out_grad]

    def with_tensors(seed, **kwargs):
        g = torch.Generator().manual_seed(seed)
        slopes = torch.rand(8, generator=g)
        sink = torch.randn(8, generator=g)
        call, tensors = dense(seed, alibi_slopes=slopes, learnable_sink=sink, **kwargs)
        return call, [*tensors, slopes, sink]

    def sdpa(seed, mask_dtype=None):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(2, 8, 77, 64, generator=g, dtype=bf16) for _ in range(3))
        mask = None if mask_dtype is None else (torch.randn(77, 77, generator=g) > 0 if mask_dtype == "bool" else
                                                 torch.randn(1, 8, 77, 77, generator=g))
        return (lambda: flashattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)), [q, k, v, mask]

    def varlen(seed):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(150, heads, 64, generator=g, dtype=bf16) for heads in (4, 2, 2))
        cu = torch.tensor([0, 50, 51, 150], dtype=torch.int32)
        return (lambda: flashattn.flash_attn_varlen_func(q, k, v, cu, cu, 99, 99, causal=True)), [q, k, v, cu]

    def decode(seed, seqlens="tensor", paged=False, append=False, leftpad=False, length=None):
        g = torch.Generator().manual_seed(seed)
        shape = (16, 64) if paged else (3, 1024)
        k_cache, v_cache = (torch.randn(*shape, 2, 128, generator=g, dtype=bf16) for _ in range(2))
        q = torch.randn(2, 1, 8, 128, generator=g, dtype=bf16)
        table = torch.randperm(16, generator=g).to(torch.int32).view(2, 8) if paged else None
        lengths = length if length is not None else 300 + seed % 7  # a growing cache: other lengths, one plan
        cache_seqlens = torch.tensor([lengths, lengths - 9], dtype=torch.int32) if seqlens == "tensor" else lengths
        new = [torch.randn(2, 1, 2, 128, generator=g, dtype=bf16) for _ in range(2)] if append else [None, None]
        pad = torch.tensor([3, 0], dtype=torch.int32) if leftpad else None
        call = lambda: flashattn.flash_attn_with_kvcache(  # noqa: E731
            q, k_cache, v_cache, *new, cache_seqlens=cache_seqlens, block_table=table, cache_leftpad=pad, causal=True)
        tensors = [q, k_cache, v_cache, *new, table, pad, cache_seqlens if seqlens == "tensor" else None]
        return call, tensors

    def one_pass(seed, **kwargs):  # the one-pass backward: dQ's sums zeroed, added up, then rounded (16-bit)
        call, tensors = dense(seed, grad=True, causal=True, **{"d": 64, **kwargs})

        def run():
            os.environ["FLASHATTN_TRITON_BACKWARD"] = "one-pass"
            try:
                call()
            finally:
                del os.environ["FLASHATTN_TRITON_BACKWARD"]

        return run, tensors

    return {
        "dense causal GQA": lambda s: dense(s, causal=True),
        "window, softcap, fp16": lambda s: dense(s, d=64, dtype=torch.float16, window_size=(17, 3), softcap=5.0),
        "ALiBi and sinks": lambda s: with_tensors(s, causal=True),
        "dropout": lambda s: dense(s, dropout_p=0.2),
        "float32": lambda s: dense(s, d=40, dtype=torch.float32, causal=True),
        "an unaligned q": lambda s: dense(s, unaligned=True),
        "SDPA layout": lambda s: sdpa(s),
        "SDPA boolean mask": lambda s: sdpa(s, "bool"),
        "SDPA additive mask": lambda s: sdpa(s, "float"),
        "varlen": varlen,
        "decode, int lengths": lambda s: decode(s, seqlens="int"),
        "decode, tensor lengths": lambda s: decode(s),
        "decode, paged": lambda s: decode(s, paged=True),
        "decode, appending": lambda s: decode(s, append=True),
        "decode, left padding": lambda s: decode(s, leftpad=True),
        "training step": lambda s: dense(s, grad=True, causal=True),
        "training step, dropout and window": lambda s: dense(s, grad=True, dropout_p=0.1, window_size=(30, 0)),
        "training step, one pass": one_pass,
        "training step, one pass, float32": lambda s: one_pass(s, d=40, dtype=torch.float32),
    }


def _describe(torch, args, inputs):
    """A launch's arguments with each tensor named by the input it is (or views), else by its layout (a buffer
    the call allocated); small integer tensors also by their values (lengths, offsets, the dropout seed)."""
    storages = {t.untyped_storage().data_ptr(): i for i, t in enumerate(inputs) if t is not None}
    pointers = {t.data_ptr(): i for i, t in enumerate(inputs) if t is not None}

    def one(a):
        if isinstance(a, torch.Tensor):
            values = a.tolist() if a.numel() <= 16 and not a.is_floating_point() else None
            owner = storages.get(a.untyped_storage().data_ptr())
            where = ("input", owner, a.storage_offset()) if owner is not None else ("allocated",)
            return (*where, tuple(a.shape), a.stride(), a.dtype, values)
        if type(a).__name__ == "TensorDescriptor":
            return ("descriptor", one(a.base), tuple(a.shape), tuple(a.strides), tuple(a.block_shape), a.padding)
        if type(a).__name__ == "StubTensorMap":  # a descriptor's encode (Triton 3.6): its pointer, by input
            return ("tensor map", pointers.get(a.pointer, "elsewhere"), *a[1:])
        return a

    return [one(a) for a in args]


def main() -> int:
    import contextlib

    import torch

    import flashattn
    from flashattn.backends.triton import attend, installed_release, plans
    from flashattn.backends.triton.stub import stubbed_launches

    replayed = 0
    direct = installed_release() == (3, 6)  # entry.py: other releases launch by the launcher
    with stubbed_launches(90, keep_arguments=True) as launches, flashattn.use_backend("triton"):
        for name, make in _cases(torch, flashattn).items():
            make(1)[0]()  # the record (or a replay of an earlier case's plan: the same signature)
            call, tensors = make(2)  # new tensors of the same signature
            seen = {}
            for mode in ("full", "replay"):
                launches.clear()
                torch.manual_seed(7)  # the same dropout seed both times
                if mode == "full":
                    with plans.disabled():
                        call()
                else:
                    replays = attend._FORWARD_PLANS.replays + attend._BACKWARD_PLANS.replays
                    call()
                    replays = attend._FORWARD_PLANS.replays + attend._BACKWARD_PLANS.replays - replays
                    # Triton 3.6: each replayed launch to the kernel's C entry (with dropout, a training step's
                    # forward runs its full Python: below)
                    if direct and launches.through_launcher and name != "training step, dropout and window":
                        print(f"FAILED {name}: {launches.through_launcher} replayed launches ran the launcher")
                        return 1
                # With each launch's leading arguments (stream, function, cooperative, PDL, scratch, metadata,
                # hooks) but the launch metadata, which only hooks read (the JIT's LazyDict; a plan's None).
                seen[mode] = [(n, g, head[:7] + head[8:], _describe(torch, a, tensors))
                              for (n, g, a), head in zip(launches.arguments, launches.heads, strict=True)]
            if seen["full"] != seen["replay"]:
                for (n, g, h, a), (_, g2, h2, b) in zip(seen["full"], seen["replay"], strict=False):
                    if h != h2:
                        print(f"{name}: {n} leading arguments {h} vs {h2}")
                    diff = [(i, x, y) for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
                    print(f"{name}: {n} grid {g} vs {g2}: {diff[:4]}")
                print(f"FAILED {name}")
                return 1
            if "one pass" in name and any("dq_kernel" in n for n, *_ in seen["replay"]):
                print(f"FAILED {name}: the one-pass backward launched the dQ kernel")
                return 1
            # The forward's plan and the backward's; with dropout, return_attn_probs returns the probabilities,
            # which a plan does not (the forward runs its full Python).
            expected = 1 + (name.startswith("training step") and "dropout" not in name)
            if replays != expected:
                print(f"FAILED {name}: {replays} of its {expected} launch plans replayed")
                return 1
            replayed += 1
        # A growing cache keeps its plan while the longest length stays within one power of two.
        before = len(attend._FORWARD_PLANS)
        g = torch.Generator().manual_seed(0)
        k_cache, v_cache = (torch.randn(3, 4096, 2, 128, generator=g, dtype=torch.bfloat16) for _ in range(2))
        q = torch.randn(2, 1, 8, 128, generator=g, dtype=torch.bfloat16)
        for length in range(1100, 1110):  # launches sized for 2048 keys, below the capacity
            flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=length, causal=True)
        if len(attend._FORWARD_PLANS) - before != 1:
            print(f"FAILED: a growing cache made {len(attend._FORWARD_PLANS) - before} plans")
            return 1
        # k and v on one storage (unbound from a packed kv) when a plan is recorded, then on two of the same
        # strides: the replay must read each from its own tensor.
        g = torch.Generator().manual_seed(5)
        q = torch.randn(150, 4, 64, generator=g, dtype=torch.bfloat16)
        cu = torch.tensor([0, 50, 51, 150], dtype=torch.int32)
        kv = torch.randn(150, 2, 2, 64, generator=g, dtype=torch.bfloat16)
        apart = [torch.randn(150, 2, 2, 64, generator=g, dtype=torch.bfloat16) for _ in range(2)]
        for k_, v_ in ((kv[:, 0], kv[:, 1]), (kv[:, 0], kv[:, 1]), (apart[0][:, 0], apart[1][:, 1])):
            seen = {}
            for mode in ("full", "replay"):
                launches.clear()
                with plans.disabled() if mode == "full" else contextlib.nullcontext():
                    flashattn.flash_attn_varlen_func(q, k_, v_, cu, cu, 99, 99, causal=True)
                seen[mode] = [(n, gr, _describe(torch, a, [q, k_, v_, cu])) for n, gr, a in launches.arguments]
            if seen["full"] != seen["replay"]:
                print("FAILED k and v on one storage, then on two")
                return 1
        # FLASHATTN_LAUNCH_PLANS=0: the full launch code every time.
        os.environ["FLASHATTN_LAUNCH_PLANS"] = "0"
        call, _ = _cases(torch, flashattn)["dense causal GQA"](3)
        replays = attend._FORWARD_PLANS.replays
        call()
        del os.environ["FLASHATTN_LAUNCH_PLANS"]
        if attend._FORWARD_PLANS.replays != replays:
            print("FAILED: FLASHATTN_LAUNCH_PLANS=0 still replayed a plan")
            return 1
    print(f"cases replayed: {replayed}")
    return 0


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    raise SystemExit(main())
