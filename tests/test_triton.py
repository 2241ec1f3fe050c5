"""The Triton backend against the float64 oracle: on a GPU when there is one, else under TRITON_INTERPRET=1 on CPU
tensors (the root conftest.py). Small shapes: the interpreter runs every program in Python."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from oracle import attention_ref, check_against_oracle, feature_kwargs, make_inputs

import flashattn

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
if not GPU and os.environ.get("TRITON_INTERPRET") != "1":
    pytestmark = pytest.mark.skip(reason="no GPU and TRITON_INTERPRET is not set")

SHAPES = [
    (1, 1, 1, 1, 1, 16),
    (2, 37, 45, 4, 2, 40),  # GQA 2:1, q/k lengths differ
    (1, 50, 19, 3, 3, 59),  # Nq > Nk: causal leaves rows with no key
    (1, 33, 70, 2, 1, 96),  # MQA
]
FEATURES = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": (9, 4)},
    "softcap_alibi": {"softcap": 2.0, "alibi": True},
    "all": {"causal": True, "window_size": (20, 0), "softcap": 1.5, "alibi": True},
    "dropout": {"dropout_p": 0.2, "causal": True, "alibi": True},
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def on_device(*tensors):
    return [t.detach().to(DEVICE).requires_grad_(t.requires_grad) for t in tensors]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_and_gradients(shape, feature, dtype):
    if not GPU and dtype == torch.bfloat16 and feature not in ("plain", "all", "dropout"):
        pytest.skip("bf16 under the interpreter is computed upcast; a subset keeps the suite fast")
    b, nq, nk, h, hk, d = shape
    q, k, v = on_device(*make_inputs(*shape, dtype))
    kwargs = feature_kwargs(FEATURES[feature], b, h)
    if "alibi_slopes" in kwargs:
        kwargs["alibi_slopes"] = kwargs["alibi_slopes"].to(DEVICE)
    p = kwargs.pop("dropout_p", 0.0)
    with flashattn.use_backend("triton"):
        out, _, probs = flashattn.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True, **kwargs)
        # The oracle drops what the kernel reports it dropped (sign bit of S_dmask); the backward must agree.
        dropped = torch.signbit(probs) if p > 0 else None
        check_against_oracle(q, k, v, kwargs, out, dropped=dropped, dropout_p=p)


def test_lse_and_fully_masked_rows():
    q, k, v = on_device(*make_inputs(1, 40, 16, 2, 2, 32, torch.float32))
    with flashattn.use_backend("triton"):
        out, lse, none = flashattn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        (out.sum() + lse.clamp_min(-1e4).sum()).backward()
        _, _, probs = flashattn.flash_attn_func(q, k, v, causal=True, dropout_p=0.2, return_attn_probs=True)
    assert none is None
    _, ref_lse = attention_ref(q, k, v, causal=True)
    assert torch.equal(out[:, :24], torch.zeros_like(out[:, :24]))
    assert torch.isneginf(lse[:, :, :24]).all()
    torch.testing.assert_close(lse[:, :, 24:].double(), ref_lse[:, :, 24:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(probs.abs().sum(-1)[:, :, 24:].double(), torch.ones(1, 2, 16, dtype=torch.float64,
                               device=DEVICE), rtol=0, atol=1e-5)
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_dropout_is_the_same_as_the_cpu_path(dtype):
    """Both backends draw Philox4x32-10 at the same counters: the same weights are dropped, the same outputs."""
    q, k, v = make_inputs(2, 29, 41, 4, 2, 32, dtype)
    p = 0.25
    torch.manual_seed(11)
    with flashattn.use_backend("cpu"):
        ref_out, _, ref_probs = flashattn.flash_attn_func(q, k, v, dropout_p=p, causal=True, return_attn_probs=True)
        ref_grads = torch.autograd.grad(ref_out, (q, k, v), torch.ones_like(ref_out))
    torch.manual_seed(11)
    qd, kd, vd = on_device(q, k, v)
    with flashattn.use_backend("triton"):
        seed_device_out = flashattn.flash_attn_func(qd, kd, vd, dropout_p=p, causal=True, return_attn_probs=True)
        grads = torch.autograd.grad(seed_device_out[0], (qd, kd, vd), torch.ones_like(seed_device_out[0]))
    out, _, probs = seed_device_out
    if GPU:
        pytest.skip("the CUDA generator draws a different seed than the CPU one; masks checked on CPU only")
    visible = ref_probs != 0
    assert torch.equal(torch.signbit(probs)[visible], torch.signbit(ref_probs)[visible])
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
    for x, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(x, r, rtol=10 * tol, atol=10 * tol)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_sdpa_masks(kind):
    q, k, v = (torch.randn(2, 3, 30, 24, device=DEVICE) for _ in range(3))
    if kind == "bool":
        mask = torch.rand(2, 1, 30, 30, device=DEVICE) > 0.4
        mask[..., 0] = True
    else:
        mask = torch.randn(3, 30, 30, device=DEVICE)
    with flashattn.use_backend("triton"):
        ours = flashattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    theirs = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                              attn_mask=mask if kind == "bool" else mask.double())
    torch.testing.assert_close(ours.double(), theirs, rtol=1e-5, atol=1e-5)


def test_backward_is_deterministic_and_mask_gradients_are_refused():
    q, k, v = on_device(*make_inputs(2, 45, 45, 4, 1, 32, torch.float16))
    with flashattn.use_backend("triton"):
        out = flashattn.flash_attn_func(q, k, v, causal=True, deterministic=True)
        g = torch.randn_like(out)
        first = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
        second = torch.autograd.grad(out, (q, k, v), g)
        assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
        mask = torch.randn(45, 45, device=DEVICE, dtype=torch.float16, requires_grad=True)
        y = flashattn.scaled_dot_product_attention(*(t.transpose(1, 2)[:, :1] for t in (q, k, v)), attn_mask=mask)
        with pytest.raises(ValueError, match="attn_mask"):
            y.sum().backward()


def test_strided_inputs_are_read_in_place():
    base = torch.randn(2, 4, 50, 40, device=DEVICE)  # (B, H, N, D) memory seen as (B, N, H, D)
    q = k = v = base.transpose(1, 2)
    with flashattn.use_backend("triton"):
        out = flashattn.flash_attn_func(q, k, v, causal=True)
    ref, _ = attention_ref(q, k, v, causal=True)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_backend_choice_and_override(monkeypatch):
    from flashattn.backends import choose, get

    def select(q, v):
        return get(choose(q, v))

    cpu_q = torch.randn(1, 4, 1, 16)
    assert select(cpu_q, cpu_q).__name__.endswith(".cpu")
    meta_q = torch.empty(1, 4, 1, 16, device="meta")
    assert select(meta_q, meta_q).__name__.endswith(".cpu")  # not CUDA: the tiled path
    with flashattn.use_backend("triton"):
        assert select(cpu_q, cpu_q).__name__.endswith(".triton")
    monkeypatch.setenv("FLASHATTN_BACKEND", "triton")
    assert select(cpu_q, cpu_q).__name__.endswith(".triton")
    with flashattn.use_backend("cpu"):  # the context manager wins over the environment
        assert select(cpu_q, cpu_q).__name__.endswith(".cpu")
    monkeypatch.setenv("FLASHATTN_BACKEND", "cuda")
    assert select(cpu_q, cpu_q).__name__.endswith(".cuda")  # forced: it then refuses CPU tensors itself
    monkeypatch.setenv("FLASHATTN_BACKEND", "fast")
    with pytest.raises(ValueError, match="FLASHATTN_BACKEND must be one of auto, cpu, triton, cuda; got 'fast'"):
        select(cpu_q, cpu_q)
    with pytest.raises(ValueError, match="use_backend"):
        flashattn.use_backend("fast").__enter__()


def test_torch_compile_traces_the_triton_path():
    q, k, v = (torch.randn(1, 20, 2, 16, device=DEVICE) for _ in range(3))

    def f(q, k, v):
        return flashattn.flash_attn_func(q, k, v, causal=True) * 2

    torch._dynamo.reset()
    with flashattn.use_backend("triton"):
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(q, k, v), f(q, k, v))


def test_expanded_output_gradients():
    # out.sum() and lse.sum() hand the backward stride-0 (expanded) gradients; the kernels must read them as such.
    q, k, v = on_device(*make_inputs(1, 30, 30, 2, 2, 16, torch.float32))
    with flashattn.use_backend("triton"):
        out, lse, _ = flashattn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        grads = torch.autograd.grad(out.sum() + lse.sum(), (q, k, v))
    ref, ref_lse = attention_ref(q, k, v, causal=True)
    ref_grads = torch.autograd.grad(ref.sum() + ref_lse.sum(), (q, k, v))
    for x, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(x.double(), r.double(), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not GPU, reason="automatic choice of the triton backend needs CUDA tensors")
def test_cuda_tensors_run_triton_and_large_head_dims_fall_back():
    from flashattn.backends import choose, get

    def select(q, v):
        return get(choose(q, v))

    q = torch.randn(1, 8, 2, 64, device="cuda", dtype=torch.float16)
    assert select(q, q).__name__.endswith(".triton")
    big = torch.randn(1, 8, 2, 320, device="cuda", dtype=torch.float16)
    assert select(big, big).__name__.endswith(".cpu")
    assert select(q.double(), q.double()).__name__.endswith(".cpu")


@pytest.mark.parametrize("offset", [-20, 7, 40])
def test_diagonal_offset_matches_the_cpu_path(offset):
    """A block of a longer sequence (context parallelism): the causal/window diagonal moved by ``offset``, forward
    and backward, equal on both backends (the CPU path is checked against float64 in test_distributed)."""
    import dataclasses

    from flashattn.backends.spec import AttentionSpec, Saved
    from flashattn.ops import attention, attention_backward

    spec = dataclasses.replace(AttentionSpec(scale=0.25, window_left=30, window_right=0, bottom_right=False),
                               diagonal_offset=offset)
    q, k, v = (torch.randn(1, n, 2, 16, device=DEVICE) for n in (33, 40, 40))
    dout = torch.randn_like(q)
    results = {}
    for backend in ("cpu", "triton"):
        with flashattn.use_backend(backend):
            out, lse, _ = attention(q, k, v, spec)
            saved = Saved(q, k, v, out, lse)
            results[backend] = (out, lse, *attention_backward(dout, None, saved, spec, backend=backend))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), results["triton"], results["cpu"], strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5, msg=name)


TMA_CASES = {
    # (layout, batch, nq, nk, heads, kv heads, head dim, features)
    "flash_layout_causal": ("flash", 2, 70, 90, 4, 2, 64, {"causal": True}),
    "sdpa_layout_window": ("sdpa", 2, 45, 45, 2, 2, 40, {"window_size": (9, 3)}),  # heads in rows, dim < tile
    "flash_layout_softcap_alibi": ("flash", 1, 33, 50, 2, 1, 32, {"softcap": 2.0, "alibi": True}),
    "varlen_packed": ("varlen", 2, 37, 37, 2, 2, 32, {"causal": True}),
}


@pytest.mark.parametrize("case", TMA_CASES)
def test_tensor_descriptor_paths(case):
    """The TMA descriptor loads (on by default on sm_90) read the same tiles as the pointer loads: forced on under
    the interpreter, forward and gradients against float64, for both ways a layout maps onto a 2-D descriptor."""
    from flashattn.backends.triton import tma

    layout, b, nq, nk, h, hk, d, features = TMA_CASES[case]
    torch.manual_seed(0)
    q, k, v = make_inputs(b, nq, nk, h, hk, d, torch.float16)
    if layout == "sdpa":  # (batch, heads, L, E) memory seen as (batch, L, heads, E): each head's rows contiguous
        q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v))
    q, k, v = on_device(q, k, v)
    kwargs = feature_kwargs(features, b, h)
    if "alibi_slopes" in kwargs:
        kwargs["alibi_slopes"] = kwargs["alibi_slopes"].to(DEVICE)
    with flashattn.use_backend("triton"), tma.use(True):
        if layout == "varlen":
            cu = torch.tensor([0, 15, 37], dtype=torch.int32, device=DEVICE)
            flat = [t.detach()[0].requires_grad_() for t in (q, k, v)]
            out = flashattn.flash_attn_varlen_func(*flat, cu, cu, 22, 22, **kwargs)
            grads = torch.autograd.grad(out.sum(), flat)
            for lo, hi in ((0, 15), (15, 37)):
                piece = [t.detach()[None, lo:hi].double().requires_grad_() for t in flat]
                ref, _ = attention_ref(*piece, causal=True)
                torch.testing.assert_close(out[lo:hi].double(), ref[0], rtol=2e-3, atol=2e-3)
                ref_grads = torch.autograd.grad(ref.sum(), piece)
                for g, r in zip(grads, ref_grads, strict=True):
                    torch.testing.assert_close(g[lo:hi].double(), r[0], rtol=5e-3, atol=5e-3)
            return
        out = flashattn.flash_attn_func(q, k, v, **kwargs)
        check_against_oracle(q, k, v, kwargs, out)


def _shipped_tiles() -> list[tuple[int, int]]:
    if importlib.util.find_spec("triton") is None:
        return []
    from flashattn.backends.triton import configs

    return sorted({(c.block_m, c.block_n) for c in configs.shipped()})


@pytest.mark.parametrize("tile", _shipped_tiles(), ids=lambda t: f"{t[0]}x{t[1]}")
def test_every_shipped_tile(tile):
    """Each tile shape the per-architecture tables ship (interpreter runs use 32x32 otherwise), forced with
    ``configs.use``: lengths that cut a tile border on both sides, a causal band with whole and partial key tiles,
    GQA, forward and gradients against float64. Warps and stages do not change results (the interpreter ignores
    them); the health report compiles those."""
    from flashattn.backends.triton import configs

    block_m, block_n = tile
    b, nq, nk, h, hk, d = 1, block_m + 5, 2 * block_n + 7, 2, 1, 40
    torch.manual_seed(0)
    q, k, v = on_device(*make_inputs(b, nq, nk, h, hk, d, torch.float16))
    kwargs = {"causal": True}
    with flashattn.use_backend("triton"), configs.use(configs.KernelConfig(block_m, block_n, 4, 2)):
        out = flashattn.flash_attn_func(q, k, v, **kwargs)
    check_against_oracle(q, k, v, kwargs, out)


def test_batch_times_heads_past_the_grid_axis_limit(monkeypatch):
    """B x H = 70000 > 65535 (CUDA's limit on grid axes 1 and 2): every launch keeps its programs on axis 0 and
    within limits. The launches are recorded, not run (70000 programs are slow under the interpreter)."""
    from flashattn.backends import triton as backend
    from flashattn.backends.spec import AttentionSpec, Saved

    launch = importlib.import_module("flashattn.backends.triton.launch")  # the package exports a function "launch"
    grids = {}
    record = lambda kernel, grid, **kwargs: grids.setdefault(kernel.fn.__name__, grid)  # noqa: E731
    monkeypatch.setattr(backend, "launch", record)
    monkeypatch.setattr(launch, "launch", record)
    b, h, n, d = 35000, 2, 1, 16
    q = torch.zeros(b, n, h, d, dtype=torch.float16)
    spec = AttentionSpec(scale=0.25)
    backend.forward(q, q, q, spec)
    backend.backward(torch.zeros_like(q), None, Saved(q, q, q, q, torch.zeros(b, h, n)), spec)
    assert set(grids) == {"attention_forward_kernel", "attention_backward_preprocess_kernel",
                          "attention_backward_dkdv_kernel", "attention_backward_dq_kernel"}
    for name, grid in grids.items():
        assert grid[0] == b * h, (name, grid)  # one tile per (batch, head)
        assert all(n <= limit for n, limit in zip(grid, launch.GRID_LIMITS, strict=False)), (name, grid)


def test_a_grid_past_cuda_limits_is_a_value_error():
    from flashattn.backends.triton.kernels import merge_splits_kernel

    launch = importlib.import_module("flashattn.backends.triton.launch")

    with pytest.raises(ValueError, match=r"grid \(1, 70000\) exceeds"):
        launch.launch(merge_splits_kernel, (1, 70000))
