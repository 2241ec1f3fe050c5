"""What only the triton path has: determinism of its backward, its one-pass backward, TMA descriptor loads, every
shipped tile, grid limits.
On a GPU when there is one, else under TRITON_INTERPRET=1 on CPU tensors (the root conftest.py); small shapes: the
interpreter runs every program in Python. Every feature on every path is in the feature files (the ``path``
fixture)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from oracle import attention_ref, check_against_oracle, feature_kwargs, make_inputs
from triton_versions import needs_triton

import flashattn
from conftest import with_dropout_mask

pytestmark = needs_triton
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


def test_backward_is_deterministic():
    q, k, v = on_device(*make_inputs(2, 45, 45, 4, 1, 32, torch.float16))
    with flashattn.use_backend("triton"):
        out = flashattn.flash_attn_func(q, k, v, causal=True, deterministic=True)
        g = torch.randn_like(out)
        first = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
        second = torch.autograd.grad(out, (q, k, v), g)
        assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


ONE_PASS_CASES = {
    # (dtype, batch, nq, nk, heads, kv heads, head dim, features): fp16 sums in an accumulator then rounded, fp32
    # into dq itself; bf16 (fp32 outputs under the interpreter) as fp32
    "fp16_gqa_causal": (torch.float16, 2, 37, 45, 4, 2, 40, {"causal": True}),
    "fp16_mqa_window_softcap_alibi": (torch.float16, 1, 50, 19, 3, 1, 59, {"window_size": (9, 4), "softcap": 2.0,
                                                                          "alibi": True}),
    "fp32_dropout": (torch.float32, 1, 33, 70, 2, 1, 32, {"dropout_p": 0.2, "causal": True}),
    "bf16_plain": (torch.bfloat16, 1, 1, 1, 1, 1, 16, {}),
}


def _check_call(q, k, v, kwargs):
    """``flash_attn_func``'s out and gradients against float64 (dropout's mask read from the torch path)."""
    kwargs = dict(kwargs)
    if "dropout_p" in kwargs:
        p = kwargs.pop("dropout_p")
        out, dropped = with_dropout_mask(q, k, v, p, kwargs)
        check_against_oracle(q, k, v, kwargs, out, dropped=dropped, dropout_p=p)
    else:
        check_against_oracle(q, k, v, kwargs, flashattn.flash_attn_func(q, k, v, **kwargs))


@pytest.mark.parametrize("case", ONE_PASS_CASES)
def test_the_one_pass_backward(case, monkeypatch, poisoned):
    """``FLASHATTN_TRITON_BACKWARD=one-pass``: dQ summed by the dK/dV kernel's atomics (into a NaN-poisoned
    accumulator the preprocess zeroes), gradients against float64 as the two-pass backward's."""
    dtype, b, nq, nk, h, hk, d, features = ONE_PASS_CASES[case]
    monkeypatch.setenv("FLASHATTN_TRITON_BACKWARD", "one-pass")
    torch.manual_seed(0)
    q, k, v = on_device(*make_inputs(b, nq, nk, h, hk, d, dtype))
    kwargs = feature_kwargs(features, b, h)
    if "alibi_slopes" in kwargs:
        kwargs["alibi_slopes"] = kwargs["alibi_slopes"].to(DEVICE)
    with flashattn.use_backend("triton"):
        _check_call(q, k, v, kwargs)


def test_the_one_pass_backward_on_packed_sequences(monkeypatch):
    monkeypatch.setenv("FLASHATTN_TRITON_BACKWARD", "one-pass")
    torch.manual_seed(1)
    cu = torch.tensor([0, 15, 37], dtype=torch.int32, device=DEVICE)
    q, k, v = on_device(*(t[0] for t in make_inputs(1, 37, 37, 4, 2, 32, torch.float16)))
    with flashattn.use_backend("triton"):
        out = flashattn.flash_attn_varlen_func(q, k, v, cu, cu, 22, 22, causal=True)
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), g)
    for lo, hi in ((0, 15), (15, 37)):
        piece = [t.detach()[None, lo:hi].double().requires_grad_() for t in (q, k, v)]
        ref, _ = attention_ref(*piece, causal=True)
        ref_grads = torch.autograd.grad(ref, piece, g[None, lo:hi].double())
        for ours, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(ours[lo:hi].double(), r[0], rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("features", [{"causal": True}, {"window_size": (9, 4), "softcap": 2.0, "alibi": True},
                                      {"dropout_p": 0.2, "causal": True}])
def test_dkdv_split_over_the_head_dim(features, monkeypatch):
    """``KernelConfig.split_d`` = 2: two dK/dV programs per key block, each summing half the head dim's columns
    (96 = 64 + 32: the second half's columns past the head dim read 0), GQA, against float64; the one-pass
    backward, whose dQ needs each tile's dS once, runs unsplit under such a config."""
    from flashattn.backends.triton import configs

    torch.manual_seed(2)
    b, nq, nk, h, hk, d = 1, 50, 39, 4, 2, 96
    q, k, v = on_device(*make_inputs(b, nq, nk, h, hk, d, torch.float16))
    kwargs = feature_kwargs(features, b, h)
    if "alibi_slopes" in kwargs:
        kwargs["alibi_slopes"] = kwargs["alibi_slopes"].to(DEVICE)
    with flashattn.use_backend("triton"), configs.use(configs.KernelConfig(32, 32, 4, 1, 2), ("dkdv", "dkdv_one_pass")):
        _check_call(q, k, v, kwargs)
        if "dropout_p" not in kwargs:
            monkeypatch.setenv("FLASHATTN_TRITON_BACKWARD", "one-pass")
            _check_call(q, k, v, kwargs)


@pytest.mark.parametrize("setting,deterministic,launched", [
    ("one-pass", False, ["preprocess", "dkdv", "dq_convert"]),
    ("one-pass", True, ["preprocess", "dkdv", "dq"]),  # deterministic calls keep the two passes
    ("two-pass", False, ["preprocess", "dkdv", "dq"]),
    ("auto", False, ["preprocess", "dkdv", "dq"]),
])
def test_which_backward_runs(setting, deterministic, launched, monkeypatch):
    """The kernels each setting launches (recorded, not run); an unknown setting is an error that names it."""
    from flashattn.backends.spec import AttentionSpec, Saved
    from flashattn.backends.triton import attend as backend
    from flashattn.backends.triton import launch

    names = []
    record = lambda kernel, grid, **kwargs: names.append(kernel.fn.__name__)  # noqa: E731
    monkeypatch.setattr(backend, "launch", record)
    monkeypatch.setattr(launch, "launch", record)
    monkeypatch.setenv("FLASHATTN_TRITON_BACKWARD", setting)
    q = torch.zeros(1, 8, 2, 16, dtype=torch.float16)
    spec = AttentionSpec(scale=0.25, deterministic=deterministic)
    with backend.plans.disabled():
        backend.backward(torch.zeros_like(q), None, Saved(q, q, q, q, torch.zeros(1, 2, 8)), spec)
    assert names == [f"attention_backward_{name}_kernel" for name in launched]
    monkeypatch.setenv("FLASHATTN_TRITON_BACKWARD", "fused")
    with pytest.raises(ValueError, match="FLASHATTN_TRITON_BACKWARD='fused' is not one of auto, one-pass, two-pass"):
        backend.backward(torch.zeros_like(q), None, Saved(q, q, q, q, torch.zeros(1, 2, 8)), spec)


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
    from flashattn.backends.spec import AttentionSpec, Saved
    from flashattn.backends.triton import attend as backend
    from flashattn.backends.triton import launch
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
    from flashattn.backends.triton import launch
    from flashattn.backends.triton.kernels import attention_backward_preprocess_kernel

    with pytest.raises(ValueError, match=r"grid \(1, 70000\) exceeds"):
        launch.launch(attention_backward_preprocess_kernel, (1, 70000))
