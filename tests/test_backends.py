"""The paths' contract and the one rule that picks a path: every path's module satisfies
``flashattn.backends.Backend`` and declares what it serves in the terms of ``Request``; the automatic choice walks
``ORDER`` and says why it passed paths over; a forced path that cannot serve a call is refused before it runs; the
op's schema is the options type's; the backward of a call runs on the path that ran its forward."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from triton_versions import TRITON_MISSING

import flashattn
from flashattn import backends
from flashattn.backends import Request, explain
from flashattn.backends.spec import AttentionSpec, Descale, KeyCache, Varlen

TRITON = TRITON_MISSING is None  # installed, in the kernels' release range
NAMES = ["cpu", "torch", "cuda", pytest.param("triton", marks=pytest.mark.skipif(not TRITON, reason="no triton"))]


def _parameters(fn) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("name", NAMES)
def test_every_path_satisfies_the_protocol(name):
    module = backends.get(name)
    assert isinstance(module, backends.Backend)
    assert name == module.NAME
    for method in ("forward", "backward"):
        assert _parameters(getattr(module, method)) == _parameters(getattr(backends.Backend, method)), method
    assert _parameters(backends.PATHS[name].serves) == [("request", inspect.Parameter.POSITIONAL_OR_KEYWORD)]


def _cuda(dtype=torch.float16, head_dim=64, **fields) -> Request:
    return Request("cuda", dtype, head_dim, fields.pop("head_dim_v", head_dim), **fields)


@pytest.mark.skipif(not TRITON, reason="no triton: CUDA calls run on the torch path")
def test_cuda_calls_walk_triton_then_torch(monkeypatch):
    monkeypatch.delenv("FLASHATTN_BACKEND", raising=False)
    assert explain(_cuda()) == ("triton", "auto: triton (the Triton kernels) serves it")
    for request, why in [(_cuda(torch.float64), "float64"), (_cuda(head_dim=320), "320"),
                         (_cuda(head_dim=192, head_dim_v=288), "288"),
                         (_cuda(mask_blocks=(24, 128), features=("block mask",)), "multiples of 16")]:
        name, reason = explain(request)
        assert name == "torch" and reason.startswith("auto: triton declines: ") and why in reason, reason
    assert explain(Request("mps", torch.float16, 64, 64)) == ("torch", "auto: torch (tiled PyTorch) serves it")


@pytest.mark.skipif(not TRITON, reason="no triton: CUDA calls run on the torch path")
def test_a_mask_that_needs_its_gradient_is_not_sent_to_triton(monkeypatch):
    """The bug of issue 23: on CUDA, SDPA with an additive mask that requires grad went to the Triton kernels,
    whose backward has no mask gradient, and failed there. The choice now reads the mask gradient."""
    monkeypatch.delenv("FLASHATTN_BACKEND", raising=False)
    name, reason = explain(_cuda(features=("attn_mask",), mask_grad=True))
    assert name == "torch" and "gradient of an additive attn_mask" in reason
    assert explain(_cuda(features=("attn_mask",)))[0] == "triton"  # the same mask without its gradient


@pytest.mark.skipif(not TRITON, reason="no triton")
def test_a_mask_gradient_end_to_end_where_triton_comes_first(monkeypatch):
    """The same through the public API: CPU tensors stand in for CUDA ones (triton first in their order, run by
    the interpreter); SDPA with a learnable additive mask gets the mask's gradient right, from the path that has
    it, and the same call without the gradient runs on triton."""
    from oracle import assert_close

    from flashattn.backends.triton import interpreting

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 to run the triton path on CPU tensors")
    monkeypatch.setitem(backends.ORDER, "cpu", ("triton", "torch"))
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 16) for _ in range(3))
    mask = torch.randn(1, 2, 24, 24, requires_grad=True)
    out = flashattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    (grad,) = torch.autograd.grad(out.square().sum(), mask)
    m64 = mask.detach().double().requires_grad_()
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=m64)
    (ref_grad,) = torch.autograd.grad(ref.square().sum(), m64)
    assert_close("dmask", grad, ref_grad, ref_grad)
    from flashattn.backends.spec import AttentionSpec as Spec

    frozen = Request.of(q, k, v, Spec(scale=0.25, attn_mask=mask.detach()))
    assert explain(frozen)[0] == "triton"


def test_forcing_a_path_and_its_refusals(monkeypatch):
    monkeypatch.delenv("FLASHATTN_BACKEND", raising=False)
    cpu_call = Request("cpu", torch.float32, 16, 16)
    with flashattn.use_backend("torch"):
        assert explain(cpu_call) == ("torch", "forced by use_backend()")
    monkeypatch.setenv("FLASHATTN_BACKEND", "torch")
    assert explain(cpu_call) == ("torch", "forced by FLASHATTN_BACKEND")
    with flashattn.use_backend("auto"):  # the context manager wins over the environment
        assert explain(cpu_call)[0] in ("cpu", "torch")
    monkeypatch.setenv("FLASHATTN_BACKEND", "cuda")
    with pytest.raises(ValueError, match=r"the cuda path cannot run this call on cpu float16 tensors of head dim 64 "
                                         r"\(forced by FLASHATTN_BACKEND\): .*CUDA tensors.*Let flashattn choose"):
        explain(Request("cpu", torch.float16, 64, 64))
    monkeypatch.setenv("FLASHATTN_BACKEND", "fast")
    with pytest.raises(ValueError, match="FLASHATTN_BACKEND must be one of auto, triton, cpu, torch, cuda; got 'fast'"):
        explain(cpu_call)
    with pytest.raises(ValueError, match="use_backend"):
        flashattn.use_backend("fast").__enter__()


def test_cpu_keeps_its_older_meaning_when_forced(monkeypatch):
    """Settings made when "cpu" named the kernel and the tiled path both keep running: forced "cpu" takes the
    torch path for what the kernel does not serve (CUDA tensors, returned probabilities)."""
    monkeypatch.delenv("FLASHATTN_BACKEND", raising=False)
    with flashattn.use_backend("cpu"):
        name, why = explain(Request("cuda", torch.float64, 64, 64))
        assert name == "torch" and why.startswith("'cpu' forced by use_backend(): cpu declines: ")
        assert explain(Request("cpu", torch.float32, 64, 64, features=("return_attn_probs",)))[0] == "torch"
        q = k = v = torch.randn(1, 6, 2, 8)
        out, _, probs = flashattn.flash_attn_func(q, k, v, dropout_p=0.5, return_attn_probs=True)
        assert probs.shape == (1, 2, 6, 6)


def test_request_names_what_a_call_uses():
    q = torch.randn(1, 5, 4, 16, requires_grad=True)
    k, v = torch.randn(1, 7, 2, 16), torch.randn(1, 7, 2, 8)
    spec = AttentionSpec(scale=0.25, window_left=3, window_right=0, softcap=2.0, dropout_p=0.1,
                         attn_mask=torch.zeros(1, 1, 5, 7, requires_grad=True))
    request = Request.of(q, k, v, spec, return_probs=True)
    assert request == Request("cpu", torch.float32, 16, 8, features=("attn_mask", "dropout", "softcap", "window",
                                                                    "return_attn_probs"),
                              mask_blocks=None, mask_grad=True, grad=True)
    with torch.no_grad():
        assert not Request.of(q, k, v, spec).grad and not Request.of(q, k, v, spec).mask_grad
    with pytest.raises(ValueError, match="unknown feature 'causal'"):
        request.uses("causal")


def test_options_type_round_trips_through_the_op_arguments():
    t = torch.arange(3, dtype=torch.int32)
    spec = AttentionSpec(scale=0.3, window_left=4, window_right=0, bottom_right=False, diagonal_offset=-2,
                         softcap=5.0, dropout_p=0.1, deterministic=True, seed=torch.zeros(1, dtype=torch.int64),
                         alibi_slopes=torch.ones(1, 2), attn_mask=torch.ones(1, 1, 3, 3, dtype=torch.bool),
                         varlen=Varlen(t, t, 2, 2), cache=KeyCache(t, t + 1, 5, batch_idx=t, num_splits=3))
    again = AttentionSpec.from_args(spec.as_args())
    assert all(a is b or a == b for a, b in zip(again.as_args(), spec.as_args(), strict=True))
    assert again.varlen.cu_seqlens_q is t and again.cache.batch_idx is t and again.cache.num_splits == 3
    assert AttentionSpec.from_args(AttentionSpec(scale=1.0).as_args()).varlen is None
    with pytest.raises(ValueError, match="more than"):
        AttentionSpec.from_args((*spec.as_args(), 1))


def test_options_the_schema_cannot_carry_are_refused_at_definition():
    import dataclasses

    from flashattn.backends import spec as spec_module

    @dataclasses.dataclass(frozen=True, eq=False)
    class WithOptionalFloat(AttentionSpec):
        sink: float | None = None

    with pytest.raises(TypeError, match="sink"):
        spec_module._plan(WithOptionalFloat)


def test_the_op_schema_is_derived_from_the_options_type():
    names = [a.name for a in torch.ops.flashattn.attention.default._schema.arguments]
    spec_names = [part.split()[1] for part in AttentionSpec.op_schema().split(", ")]
    assert names == ["q", "k", "v", *spec_names, "backend", "return_probs"]
    backward = [a.name for a in torch.ops.flashattn.attention_backward.default._schema.arguments]
    assert backward == ["dout", "dlse", "q", "k", "v", "out", "lse", *spec_names, "backend", "mask_grad"]


@pytest.mark.skipif(not TRITON, reason="triton missing")
def test_backward_runs_on_the_path_of_its_forward(monkeypatch):
    """A forward under use_backend() is differentiated by that path even when backward runs outside the block,
    where the automatic choice for the same tensors is another path: triton on CPU tensors (the interpreter) while
    auto picks cpu or torch; on a GPU, torch on CUDA tensors while auto picks triton."""
    from flashattn.backends import cpu, tiled
    from flashattn.backends.triton import attend, interpreting

    on_gpu = torch.cuda.is_available() and not interpreting()
    device, forced, others = ("cuda", "torch", (attend,)) if on_gpu else ("cpu", "triton", (cpu, tiled))

    def refuse(*args, **kwargs):
        raise AssertionError("the backward ran on another path")

    for other in others:
        monkeypatch.setattr(other, "backward", refuse)
    q, k, v = (torch.randn(1, 9, 2, 16, device=device, requires_grad=True) for _ in range(3))
    with flashattn.use_backend(forced):
        out = flashattn.flash_attn_func(q, k, v, causal=True)
    assert backends.choose(q, k, v, AttentionSpec(scale=0.25)) != forced
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def _block_sparse(mask_mod):
    """A block mask of 16 x 16 blocks over the (6, 9) scores below, per head, as the checker converts it."""
    from torch.nn.attention.flex_attention import create_block_mask

    from flashattn.checks.block_mask import validate_block_mask

    mask = create_block_mask(mask_mod, None, 4, 6, 9, device="cpu", BLOCK_SIZE=16)
    return validate_block_mask("test", "block_mask", mask, batch=2, nheads=4, nq=6, nk=9, ref=torch.zeros(1))


def _options_one_at_a_time():
    """A non-default value for every field of AttentionSpec, on a (2, 6, 4, 16) q and (2, 9, 2, 16) k/v; adding a
    field without adding it here fails ``test_every_option_is_served_or_refused``."""
    t32 = torch.int32
    cu_q, cu_k = torch.tensor([0, 5, 12], dtype=t32), torch.tensor([0, 9, 18], dtype=t32)
    return {
        "scale": {"scale": 0.3},
        "window_left": {"window_left": 2},
        "window_right": {"window_right": 1},
        "bottom_right": {"bottom_right": False, "window_right": 0},
        "diagonal_offset": {"diagonal_offset": 3, "window_right": 0},
        "softcap": {"softcap": 2.0},
        "dropout_p": {"dropout_p": 0.3, "seed": torch.tensor([7])},
        "deterministic": {"deterministic": True},
        "seed": {"dropout_p": 0.3, "seed": torch.tensor([11])},
        "alibi_slopes": {"alibi_slopes": torch.rand(1, 4)},
        "sink": {"sink": torch.randn(4)},
        "attn_mask": {"attn_mask": torch.randn(2, 1, 6, 9)},
        "block_sparse": {"block_sparse": _block_sparse(lambda b, h, q, k: (q + h) % 3 != k % 2)},
        "varlen": {"varlen": Varlen(cu_q, cu_k, 7, 9)},
        "cache": {"cache": KeyCache(torch.tensor([1, 0], dtype=t32), torch.tensor([8, 9], dtype=t32), 9)},
        "descale": {"descale": Descale(*(torch.rand(2, 2) + 0.5 for _ in range(3)))},
        "fp8_training": {"fp8_training": True},
    }


# Options whose inputs the generic comparison cannot make (FP8 tensors): their own test files cover every path
# (the training mode is the op's: it hands the paths FP8 inputs with their descale, tests/test_fp8_training.py).
TESTED_APART = {"descale", "fp8_training"}


@pytest.mark.skipif(not TRITON, reason="triton missing")
def test_every_option_is_served_or_refused():
    """Every option reaches every path: cpu, torch and triton compute the same result with it, and the cuda path,
    which serves a subset, names it when it cannot."""
    from flashattn.backends import cpu, cpu_build, cuda, tiled
    from flashattn.backends.triton import attend, interpreting
    from flashattn.backends.triton import serves as triton_serves

    # The Triton kernels take these CPU tensors under the interpreter only (on a GPU, test_triton runs them);
    # the C++ kernel where it is built (FLASHATTN_CPU_KERNEL=0 turns it off).
    paths = [p for p, runs in ((cpu, cpu_build.status()[0]), (tiled, True), (attend, interpreting())) if runs]
    options = _options_one_at_a_time()
    assert set(options) == {f.name for f in dataclasses.fields(AttentionSpec)}
    for name, fields in options.items():
        spec = AttentionSpec(**{"scale": 0.25, **fields})
        if name in TESTED_APART:  # FP8 inputs: every path serves them, tests/test_fp8.py checks each
            fp8 = torch.randn(1, 4, 2, 16).to(torch.float8_e4m3fn)
            request = Request.of(torch.randn(1, 4, 2, 16, dtype=torch.bfloat16), fp8, fp8, spec)
            assert cpu.serves(request) is None or not cpu_build.status()[0]
            assert triton_serves(request) is None or not interpreting()
            continue
        q, k, v = torch.randn(2, 6, 4, 16), torch.randn(2, 9, 2, 16), torch.randn(2, 9, 2, 16)
        if spec.varlen is not None:
            q, k, v = q.flatten(0, 1)[:12], k.flatten(0, 1), v.flatten(0, 1)
        plain = paths[0].forward(q, k, v, AttentionSpec(scale=0.25))[0] if spec.varlen is None else None
        got = [path.forward(q, k, v, spec)[0] for path in paths]
        for other in got[1:]:
            torch.testing.assert_close(other, got[0], rtol=1e-5, atol=1e-5, msg=name)
        if plain is not None and name != "deterministic":
            assert not torch.allclose(got[0], plain), f"{name} changed nothing"
        supported = name in ("scale", "bottom_right", "diagonal_offset", "deterministic")
        q64, k64, v64 = (torch.zeros(*t.shape[:-1], 64, dtype=torch.float16) for t in (q, k, v))
        reason = cuda.serves(Request.of(q64, k64, v64, spec)._replace(device="cuda"))
        assert (reason is None or "CUDA tensors" in reason) if supported else reason is not None, (name, reason)
