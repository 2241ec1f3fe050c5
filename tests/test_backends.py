"""The backend contract: every backend satisfies ``flashattn.backends.Backend``, the op's schema is the options
type's, and the backward of a call runs on the backend that ran its forward."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect

import pytest
import torch

import flashattn
from flashattn import backends
from flashattn.backends.spec import AttentionSpec, KeyCache, Varlen

TRITON = importlib.util.find_spec("triton") is not None
NAMES = ["cpu", "cuda", pytest.param("triton", marks=pytest.mark.skipif(not TRITON, reason="triton missing"))]


def _parameters(fn) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("name", NAMES)
def test_every_backend_satisfies_the_protocol(name):
    module = backends.get(name)
    assert isinstance(module, backends.Backend)
    assert name == module.NAME
    for method in ("unsupported", "forward", "backward"):
        assert _parameters(getattr(module, method)) == _parameters(getattr(backends.Backend, method)), method


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
def test_backward_runs_on_the_backend_of_its_forward(monkeypatch):
    """A forward under use_backend("triton") is differentiated by triton even when backward runs outside the block
    (where the automatic choice for these CPU tensors is cpu)."""
    from flashattn.backends import cpu

    def refuse(*args, **kwargs):
        raise AssertionError("the backward ran on the cpu backend")

    monkeypatch.setattr(cpu, "backward", refuse)
    q, k, v = (torch.randn(1, 9, 2, 16, requires_grad=True) for _ in range(3))
    with flashattn.use_backend("triton"):
        out = flashattn.flash_attn_func(q, k, v, causal=True)
    assert backends.choose(q, v) == "cpu"
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def _block_sparse(mask_mod):
    """A block mask of 16 x 16 blocks over the (6, 9) scores below, per head, as the checker converts it."""
    from torch.nn.attention.flex_attention import create_block_mask

    from flashattn.checks.blocks import validate_block_mask

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
    }


@pytest.mark.skipif(not TRITON, reason="triton missing")
def test_every_option_is_served_or_refused():
    """Every option reaches every backend: cpu and triton compute the same result with it, and the CUDA backend,
    which serves a subset, names it when it cannot."""
    from flashattn.backends import cpu, cuda, triton

    options = _options_one_at_a_time()
    assert set(options) == {f.name for f in dataclasses.fields(AttentionSpec)}
    for name, fields in options.items():
        spec = AttentionSpec(**{"scale": 0.25, **fields})
        q, k, v = torch.randn(2, 6, 4, 16), torch.randn(2, 9, 2, 16), torch.randn(2, 9, 2, 16)
        if spec.varlen is not None:
            q, k, v = q.flatten(0, 1)[:12], k.flatten(0, 1), v.flatten(0, 1)
        plain = cpu.forward(q, k, v, AttentionSpec(scale=0.25))[0] if spec.varlen is None else None
        got = [backend.forward(q, k, v, spec)[0] for backend in (cpu, triton)]
        torch.testing.assert_close(got[1], got[0], rtol=1e-5, atol=1e-5, msg=name)
        if plain is not None and name != "deterministic":
            assert not torch.allclose(got[0], plain), f"{name} changed nothing"
        supported = name in ("scale", "bottom_right", "diagonal_offset", "deterministic")
        q64, k64, v64 = (torch.zeros(*t.shape[:-1], 64, dtype=torch.float16) for t in (q, k, v))
        reason = cuda.unsupported(q64, k64, v64, spec)
        assert (reason is None or "CUDA tensors" in reason) if supported else reason is not None, (name, reason)
