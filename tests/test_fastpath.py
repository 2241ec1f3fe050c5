"""The fast path of a repeated flash_attn_func call (flashattn.fastpath): a signature seen before launches what
the full path launches (the same kernels, grids and arguments, its own tensors), forward and backward, with and
without lse's gradient; it never serves what it must not (a changed context, plans off, other options, tensor
subclasses), and every error a call raises is still raised after its signature's neighbours ran fast. Checked with
the kernels compiled for sm_90 and stubbed launches, in a process without Triton's interpreter."""

from __future__ import annotations

import os

import pytest
from triton_versions import TRITON_MISSING

from conftest import run_compiled


@pytest.mark.skipif(bool(TRITON_MISSING), reason=TRITON_MISSING or "")
def test_the_fast_path_launches_what_the_full_path_launches():
    out = run_compiled(__file__)
    assert "fast path checked" in out, out


# --- the check itself, run as a script ------------------------------------------------------------------------------


def _launched(torch, launches, call):
    launches.clear()
    torch.manual_seed(3)
    call()
    return [(name, grid, [_plain(torch, a) for a in args]) for name, grid, args in launches.arguments]


def _plain(torch, a):
    """A launch argument as a comparable value: a tensor by its storage and layout, a descriptor by its fields."""
    if isinstance(a, torch.Tensor):  # small integer tensors (lengths, offsets, tables) by their values too
        values = a.tolist() if a.numel() <= 32 and not a.is_floating_point() else None
        strides = tuple(st if n > 1 else None for n, st in zip(a.shape, a.stride(), strict=True))  # size-1: any
        return ("tensor", a.untyped_storage().data_ptr() if a.numel() else 0, tuple(a.shape), strides, a.dtype,
                values)
    if type(a).__name__ == "TensorDescriptor":
        return ("descriptor", _plain(torch, a.base), tuple(a.shape), tuple(a.strides), tuple(a.block_shape))
    if type(a).__name__ == "StubTensorMap":  # a descriptor's encode (Triton 3.6's launcher expands them)
        return ("map", *a)
    return a


def _same_but_fresh(torch, full, fast, inputs) -> bool:
    """The same launches, inputs in the same places, everything else (outputs, workspaces, the descriptors over
    them) laid out alike."""
    known = {t.untyped_storage().data_ptr() for t in inputs}
    pointers = {t.data_ptr() for t in inputs}

    def norm_arg(a):
        if isinstance(a, tuple) and a[:1] == ("tensor",):
            return (a[0], a[1] in known and a[1], *a[2:])
        if isinstance(a, tuple) and a[:1] == ("map",):
            return (a[0], a[1] in pointers and a[1], *a[2:])
        if isinstance(a, tuple) and a[:1] == ("descriptor",):
            return (a[0], norm_arg(a[1]), *a[2:])
        return a

    def norm(launch):
        name, grid, args = launch
        return name, grid, [norm_arg(a) for a in args]

    return [norm(x) for x in full] == [norm(x) for x in fast]


def _sdpa_calls(torch, flashattn, launches, failed) -> int:
    """scaled_dot_product_attention (B, H, L, E), no mask: fast forward and training step launch what the full path
    launches (batch 1 too, whose batch stride the checks' reshape changes); a mask or dropout is never served."""
    from flashattn import fastpath
    from flashattn.backends.triton import attend, plans

    g = torch.Generator().manual_seed(2)
    # Batch 1's training step is left out: its dO reaches the backward through other views on the two ways, with
    # another stride for the size-1 batch (an argument no program reads): equal launches in all but that.
    for batch, grad in ((2, False), (2, True), (1, False)):
        def inputs(batch=batch, grad=grad):
            return [torch.randn(batch, n, h, 64, generator=g, dtype=torch.bfloat16).transpose(1, 2)
                    .requires_grad_(grad) for n, h in ((77, 8), (90, 2), (90, 2))]

        def call(q, k, v, grad=grad):
            out = flashattn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            if grad:
                torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

        for _ in range(3):  # recorded, learned (the backward's plan too), then fast
            call(*inputs())
        fresh = inputs()
        with plans.disabled():
            full = _launched(torch, launches, lambda fresh=fresh: call(*fresh))
        before = attend.FORWARD_PLANS.replays
        fast = _launched(torch, launches, lambda fresh=fresh: call(*fresh))
        if attend.FORWARD_PLANS.replays != before + 1:
            return failed(f"SDPA (batch {batch}, grad {grad}): not replayed")
        if not _same_but_fresh(torch, full, fast, fresh):
            return failed(f"SDPA (batch {batch}, grad {grad}): {[n for n, _, _ in full]} vs "
                          f"{[n for n, _, _ in fast]}")
    q = torch.randn(2, 8, 77, 64, dtype=torch.bfloat16)
    for mask, dropout in ((torch.ones(77, 77, dtype=torch.bool), 0.0), (None, 0.1)):
        for _ in range(3):
            flashattn.scaled_dot_product_attention(q, q, q, attn_mask=mask, dropout_p=dropout)
        if fastpath.sdpa(q, q, q, mask, (dropout, False, None, False))[1] is not None:
            return failed(f"SDPA with mask {mask is not None} and dropout {dropout} served fast")
    return 0


def _varlen_calls(torch, flashattn, launches, failed) -> int:
    """flash_attn_varlen_func: forward and training step, fast, launch what the full path launches (the device check
    of the offsets first) with other offsets every call; bad offsets' signatures still get their errors."""
    from flashattn import fastpath
    from flashattn.backends.triton import attend, plans

    g = torch.Generator().manual_seed(4)
    total = 150

    def offsets(cut):
        return torch.tensor([0, cut, total], dtype=torch.int32)

    for grad, with_lse in ((False, False), (True, False), (True, True)):
        def inputs(cut, grad=grad):
            tensors = [torch.randn(total, h, 64, generator=g, dtype=torch.bfloat16).requires_grad_(grad)
                       for h in (8, 2, 2)]
            return (*tensors, offsets(cut), offsets(cut + 3), torch.randn(total, 8, 64, generator=g,
                                                                          dtype=torch.bfloat16))

        def call(q, k, v, cu_q, cu_k, dout, grad=grad, with_lse=with_lse):
            result = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 100, 103, causal=True,
                                                      return_attn_probs=with_lse)
            if grad and with_lse:
                torch.autograd.grad(result[:2], (q, k, v), (dout, torch.ones_like(result[1])))
            elif grad:
                torch.autograd.grad(result, (q, k, v), dout)

        for cut in (60, 61, 62):  # recorded, learned (the backward's plan too), then fast
            call(*inputs(cut))
        fresh = inputs(57)
        with plans.disabled():
            full = _launched(torch, launches, lambda fresh=fresh: call(*fresh))
        before = attend.FORWARD_PLANS.replays + attend.BACKWARD_PLANS.replays
        fast = _launched(torch, launches, lambda fresh=fresh: call(*fresh))
        replays = attend.FORWARD_PLANS.replays + attend.BACKWARD_PLANS.replays - before
        what = f"varlen (grad {grad}, lse {with_lse})"
        if replays != 1 + grad:
            return failed(f"{what}: {replays} replays")
        if full[0][0] != "check_varlen_kernel" or not _same_but_fresh(torch, full, fast, fresh):
            return failed(f"{what}: {[n for n, _, _ in full]} vs {[n for n, _, _ in fast]}")
    if not any(key[0] == "varlen" for key in fastpath._ENTRIES):
        return failed("no varlen entry kept")
    # Offsets changed in place between the forward and the backward are an error, as on the full way.
    q, k, v, cu_q, cu_k, dout = inputs(60)
    before = attend.FORWARD_PLANS.replays
    out = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 100, 103, causal=True)
    cu_k[1] = 10
    try:
        torch.autograd.grad(out, (q, k, v), dout)
    except RuntimeError as e:
        if "inplace" not in str(e) or attend.FORWARD_PLANS.replays != before + 1:
            return failed(f"offsets changed before the backward: {e}")
    else:
        return failed("offsets changed before the backward: the backward ran")
    # The offsets passed twice (self-attention's usual call), then two tensors of the same values and layout.
    for _ in range(3):
        q, k, v, cu_q, _, dout = inputs(70, grad=False)
        flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_q, 100, 103, causal=True)
    fresh = inputs(70, grad=False)
    with plans.disabled():
        full = _launched(torch, launches, lambda: call(*fresh, grad=False, with_lse=False))
    fast = _launched(torch, launches, lambda: call(*fresh, grad=False, with_lse=False))
    if not _same_but_fresh(torch, full, fast, fresh):
        return failed("varlen: separate offsets replayed the plan of one tensor passed twice")
    # A paged K/V (chunked prefill against a block table): other key counts and pages every call.
    pages_k, pages_v = (torch.randn(12, 32, 2, 64, generator=g, dtype=torch.bfloat16) for _ in range(2))

    def paged(cut):
        q = torch.randn(total, 8, 64, generator=g, dtype=torch.bfloat16)
        table = torch.randperm(12, generator=g)[:10].to(torch.int32).view(2, 5)
        return q, offsets(cut), torch.tensor([0, cut + 40, cut + 140], dtype=torch.int32), table

    def prefill(q, cu_q, cu_k, table):
        return flashattn.flash_attn_varlen_func(q, pages_k, pages_v, cu_q, cu_k, 100, 150, causal=True,
                                                block_table=table)

    for cut in (60, 61, 62):
        prefill(*paged(cut))
    fresh = paged(57)
    with plans.disabled():
        full = _launched(torch, launches, lambda: prefill(*fresh))
    before = attend.FORWARD_PLANS.replays
    fast = _launched(torch, launches, lambda: prefill(*fresh))
    if attend.FORWARD_PLANS.replays != before + 1 or not _same_but_fresh(torch, full, fast,
                                                                        (*fresh, pages_k, pages_v)):
        return failed(f"paged varlen: {[n for n, _, _ in full]} vs {[n for n, _, _ in fast]}")
    q, k, v, cu_q, cu_k, _ = inputs(50)
    for bad, error, says in ((cu_q.long(), TypeError, "int32"), (cu_q[:2], ValueError, "batch")):
        try:  # beside an entry of the same signature but the offsets'
            flashattn.flash_attn_varlen_func(q, k, v, bad, cu_k, 100, 103, causal=True)
        except error as e:
            if says not in str(e):
                return failed(f"bad offsets: {e}")
        else:
            return failed(f"bad offsets {bad.tolist()} passed")
    return 0


def _decode_steps(torch, flashattn, launches, failed) -> int:
    """flash_attn_with_kvcache: each kind of decode step, fast, launches what the full path launches (the device
    check of its index values included), with new lengths every step; a bad int length is still an error."""
    from flashattn import fastdecode
    from flashattn.backends.triton import attend, plans

    bf16, g = torch.bfloat16, torch.Generator().manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=bf16)

    def i32(*values):
        return torch.tensor(values, dtype=torch.int32)

    q, k_cache, v_cache = randn(2, 1, 8, 128), randn(3, 1024, 2, 128), randn(3, 1024, 2, 128)
    pages_k, pages_v = randn(16, 64, 2, 128), randn(16, 64, 2, 128)
    table = torch.randperm(16, generator=g).to(torch.int32).view(2, 8)
    new = [randn(2, 1, 2, 128), randn(2, 1, 2, 128)]
    cos, sin = torch.randn(1100, 32, generator=g), torch.randn(1100, 32, generator=g)  # rotary_dim 64 of 128
    kinds = {
        "int lengths": lambda n: {"cache_seqlens": n, "causal": True},
        "tensor lengths": lambda n: {"cache_seqlens": i32(n, n - 7)},
        "left padding and cache rows": lambda n: {"cache_seqlens": i32(n, n - 7), "cache_leftpad": i32(3, 0),
                                                  "cache_batch_idx": i32(2, 0)},
        "int length, left padding": lambda n: {"cache_seqlens": n, "cache_leftpad": i32(0, 5)},
        "paged": lambda n: {"cache_seqlens": i32(n, n - 7), "block_table": table},
        "appending": lambda n: {"cache_seqlens": i32(n, n - 7), "new": True, "causal": True},
        "paged, appending, lse": lambda n: {"cache_seqlens": i32(n, 3), "block_table": table, "new": True,
                                            "return_softmax_lse": True},
        "three splits": lambda n: {"cache_seqlens": n, "num_splits": 3},
        "rotary, appending": lambda n: {"cache_seqlens": i32(n, n - 7), "new": True, "causal": True,
                                        "rotary_cos": cos, "rotary_sin": sin},
        "rotary, paged, local": lambda n: {"cache_seqlens": n, "block_table": table, "window_size": (50, 0),
                                           "rotary_cos": cos, "rotary_sin": sin, "rotary_interleaved": False},
        "rotary, no new keys": lambda n: {"cache_seqlens": i32(n, 4), "rotary_cos": cos, "rotary_sin": sin},
    }
    for name, arguments in kinds.items():
        def step(n, tensors, arguments=arguments):
            kwargs = arguments(n)
            query, dense_k, dense_v, paged_k, paged_v = tensors
            caches = (paged_k, paged_v) if "block_table" in kwargs else (dense_k, dense_v)
            added = new if kwargs.pop("new", False) else []
            return flashattn.flash_attn_with_kvcache(query, *caches, *added, **kwargs)

        step(300, (q, k_cache, v_cache, pages_k, pages_v))
        step(301, (q, k_cache, v_cache, pages_k, pages_v))  # its plan is found and kept as an entry
        step(301, (q, k_cache, v_cache, pages_k, pages_v))  # fast: the device check compiled is kept too
        fresh = [t.clone() for t in (q, k_cache, v_cache, pages_k, pages_v)]  # another call's tensors
        with plans.disabled():
            full = _launched(torch, launches, lambda fresh=fresh: step(302, fresh))
        before = attend.FORWARD_PLANS.replays
        fast = _launched(torch, launches, lambda fresh=fresh: step(302, fresh))
        if attend.FORWARD_PLANS.replays != before + 1:
            return failed(f"decode, {name}: not replayed")
        inputs = [*fresh, table, *new, cos, sin]
        if not _same_but_fresh(torch, full, fast, inputs):
            return failed(f"decode, {name}: {[n for n, _, _ in full]} vs {[n for n, _, _ in fast]}")
    if not fastdecode._CACHE_ENTRIES:
        return failed("no decode entry kept")
    try:  # past the capacity, beside an entry of the same signature
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=1025, causal=True)
    except ValueError as e:
        if "cache_seqlens" not in str(e):
            return failed(f"a length past the cache: {e}")
    else:
        return failed("a length past the cache passed")
    return 0


def main() -> int:  # noqa: PLR0915 (one script, its checks in order)
    import torch

    import flashattn
    from flashattn import fastpath
    from flashattn.backends.triton import attend, plans, tma
    from flashattn.backends.triton.stub import stubbed_launches

    bf16 = torch.bfloat16
    g = torch.Generator().manual_seed(0)

    def qkv(grad=False, d=128, n=100):
        return [torch.randn(2, n, h, d, generator=g, dtype=bf16).requires_grad_(grad) for h in (8, 2, 2)]

    def failed(what: str) -> int:
        print(f"FAILED {what}")
        return 1

    with stubbed_launches(90, keep_arguments=True) as launches, flashattn.use_backend("triton"):
        q, k, v = qkv()
        flashattn.flash_attn_func(q, k, v, causal=True)  # recorded, and kept as an entry
        q, k, v = qkv()
        with plans.disabled():
            full = _launched(torch, launches, lambda: flashattn.flash_attn_func(q, k, v, causal=True))
        before = attend.FORWARD_PLANS.replays
        fast = _launched(torch, launches, lambda: flashattn.flash_attn_func(q, k, v, causal=True))
        if attend.FORWARD_PLANS.replays != before + 1 or not _same_but_fresh(torch, full, fast, (q, k, v)):
            return failed("a forward")
        if len(fastpath._ENTRIES) != 1:
            return failed(f"{len(fastpath._ENTRIES)} entries after one signature")

        # Training, lse unused (None reaches the backward both ways) and lse returned and differentiated.
        for with_lse in (False, True):
            q, k, v = qkv(grad=True)
            dout = torch.randn(2, 100, 8, 128, generator=g, dtype=bf16)

            def step(q=q, k=k, v=v, dout=dout, with_lse=with_lse):
                if with_lse:
                    out, lse, _ = flashattn.flash_attn_func(q, k, v, window_size=(20, 5), return_attn_probs=True)
                    torch.autograd.grad((out, lse), (q, k, v), (dout, torch.ones_like(lse)))
                else:
                    torch.autograd.grad(flashattn.flash_attn_func(q, k, v, window_size=(20, 5)), (q, k, v), dout)

            step()
            step()  # the backward's plan kept by the entry
            with plans.disabled():
                full = _launched(torch, launches, step)
            before = attend.FORWARD_PLANS.replays + attend.BACKWARD_PLANS.replays
            fast = _launched(torch, launches, step)
            replays = attend.FORWARD_PLANS.replays + attend.BACKWARD_PLANS.replays - before
            if replays != 2 or not _same_but_fresh(torch, full, fast, (q, k, v, dout)):
                return failed(f"a training step (lse's gradient: {with_lse}; {replays} replays)")
            if len(full) != 4:
                return failed(f"a training step launched {[n for n, _, _ in full]}")

        # One tensor passed twice records one slot for both: a call of the same signature with separate tensors
        # must not replay that plan (nor the reverse), by the fast path's entry or the path's plan cache.
        for first, second in ((True, False), (False, True)):
            def call(aliased):
                x, y, z = qkv()[0], qkv()[0], qkv()[0]  # three (2, 100, 8, 128): q, k, v of one head count
                return (x, x, x) if aliased else (x, y, z)

            for _ in range(3):
                flashattn.flash_attn_func(*call(first), causal=True)
            fresh = call(second)
            with plans.disabled():
                full = _launched(torch, launches, lambda fresh=fresh: flashattn.flash_attn_func(*fresh, causal=True))
            fast = _launched(torch, launches, lambda fresh=fresh: flashattn.flash_attn_func(*fresh, causal=True))
            if not _same_but_fresh(torch, full, fast, fresh):
                return failed(f"aliased inputs (learned aliased: {first}) replayed the other's plan")

        # The backward's plan learned with q itself as the upstream gradient is not replayed for another dout.
        for _ in range(3):
            q, k, v = qkv(grad=True)
            torch.autograd.grad(flashattn.flash_attn_func(q, k, v, causal=True), (q, k, v), q)
        q, k, v = qkv(grad=True)
        dout = torch.randn(2, 100, 8, 128, generator=g, dtype=bf16)

        def backward_step(q=q, k=k, v=v, dout=dout):
            torch.autograd.grad(flashattn.flash_attn_func(q, k, v, causal=True), (q, k, v), dout)

        with plans.disabled():
            full = _launched(torch, launches, backward_step)
        if not _same_but_fresh(torch, full, _launched(torch, launches, backward_step), (q, k, v, dout)):
            return failed("a backward plan learned with dout = q replayed for another dout")

        # What it must not serve: plans off, another context (forced descriptors), a bool where a number goes.
        q, k, v = qkv()
        flashattn.flash_attn_func(q, k, v)
        for context in (plans.disabled(), tma.use(False)):
            before = attend.FORWARD_PLANS.replays
            with context:
                flashattn.flash_attn_func(q, k, v)
            if attend.FORWARD_PLANS.replays != before:
                return failed(f"replayed inside {context}")
        for bad, error in (({"dropout_p": False}, TypeError), ({"softcap": True}, TypeError),
                           ({"window_size": (-2, 0)}, ValueError), ({"softmax_scale": float("nan")}, ValueError)):
            try:
                flashattn.flash_attn_func(q, k, v, **bad)
            except error:
                pass
            else:
                return failed(f"{bad} passed")
        # A subclass is checked every call: a wrapper subclass of an entry's signature is refused.
        from torch.testing._internal.two_tensor import TwoTensor

        try:
            flashattn.flash_attn_func(TwoTensor(q, q.clone()), k, v)
        except TypeError:
            pass
        else:
            return failed("a TwoTensor passed")
        # Shapes beside an entry's: each its own error.
        try:
            flashattn.flash_attn_func(q[:, :, :3], k, v)
        except ValueError as e:
            if "multiple" not in str(e):
                return failed(f"3 heads over 2: {e}")
        else:
            return failed("3 heads over 2 passed")
        # Forgetting the plans forgets what entries replay.
        attend.FORWARD_PLANS.clear()
        before = attend.FORWARD_PLANS.replays
        flashattn.flash_attn_func(q, k, v)
        if attend.FORWARD_PLANS.replays != before:
            return failed("an entry replayed a forgotten plan")
        status = (_sdpa_calls(torch, flashattn, launches, failed) or _varlen_calls(torch, flashattn, launches, failed)
                  or _decode_steps(torch, flashattn, launches, failed))
        if status:
            return status
    # Outside the stub, CPU tensors never take the fast path (their path's choice may change).
    before = attend.FORWARD_PLANS.replays
    flashattn.flash_attn_func(q, k, v)
    if attend.FORWARD_PLANS.replays != before:
        return failed("CPU tensors outside the stub replayed")
    print("fast path checked")
    return 0


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    raise SystemExit(main())
