"""The backend contract: every backend satisfies ``flashattn.backends.Backend``, the op's schema is the options
type's, and the backward of a call runs on the backend that ran its forward."""

from __future__ import annotations

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
    assert again == spec
    assert AttentionSpec.from_args(AttentionSpec(scale=1.0).as_args()) == AttentionSpec(scale=1.0)
    with pytest.raises(ValueError, match="more than"):
        AttentionSpec.from_args((*spec.as_args(), 1))


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
    assert backends.choose("cpu", torch.float32, 16) == "cpu"
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
