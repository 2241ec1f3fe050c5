"""Which tensors the kernels may read as plain data: the kinds of tensor, beyond dtype and shape.

A kernel reads a tensor through its data pointer and strides. That is right for a dense (strided) tensor and for
a subclass that keeps its data the ordinary way (``torch.nn.Parameter``, ``x.as_subclass(MyTensor)``), and wrong
for everything else, whatever its ``shape`` and ``dtype`` say: a nested tensor's rows are ragged, a sparse or MKL-DNN
tensor has no strides, and a wrapper subclass (``DTensor``, ``MaskedTensor``, a quantized tensor, anything with a
``__torch_dispatch__``) holds its values elsewhere or computes them. Those are refused here with the argument's name
and type, never read. PyTorch's ``CausalBias`` (``torch.nn.attention.bias``) is a subclass that holds no values at
all: ``scaled_dot_product_attention`` takes it for what it means (``checks.sdpa``), everything else refuses it.

The tensors torch.compile and torch.export trace with (fake and functional tensors) and ``torch.func``'s wrappers
stand for plain tensors and are accepted.
"""

from __future__ import annotations

import torch

from ..errors import as_argument_error

_DEFAULT_DISPATCH = torch.Tensor.__torch_dispatch__


def is_causal_bias(t: object) -> bool:
    """Whether ``t`` is a ``torch.nn.attention.bias.CausalBias`` (without importing it where torch lacks it)."""
    return type(t).__name__ == "CausalBias" and type(t).__module__ == "torch.nn.attention.bias"


def _traced(t: torch.Tensor) -> bool:
    """Fake and functional tensors: what torch.compile, torch.export and make_fx trace a plain tensor as."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(t, (FakeTensor, FunctionalTensor))


def _problem(t: torch.Tensor) -> str | None:
    """Why ``t`` cannot be read as plain data, or None."""
    kind = type(t)
    if (kind is torch.Tensor or kind is torch.nn.Parameter) and t.layout == torch.strided and not t.is_nested:
        return None  # the common case, first
    if is_causal_bias(t):
        return ("a CausalBias, which holds no values: it is a mask for scaled_dot_product_attention's attn_mask "
                "(flash_attn_func's causal=True is its lower-right variant)")
    if t.is_nested:
        return ("a nested tensor, whose sequences are ragged; pass them packed: flash_attn_varlen_func(x.values(), "
                "..., cu_seqlens_q=x.offsets(), ...), or use scaled_dot_product_attention, which takes jagged ones")
    if t.layout != torch.strided:
        return f"a {t.layout} tensor, which has no strides to read; pass x.to_dense()"
    if getattr(kind, "__torch_dispatch__", _DEFAULT_DISPATCH) is not _DEFAULT_DISPATCH and not _traced(t):
        hint = "; for a DTensor: x.full_tensor() or x.to_local()" if kind.__name__ == "DTensor" else ""
        return (f"a {kind.__module__}.{kind.__name__}, a tensor subclass whose values are not plain data the "
                f"kernels can read; pass a plain torch.Tensor{hint}")
    return None


def validate_plain(fn: str, name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` if the kernels may read it as plain data (a dense tensor, or a subclass that keeps its data the
    ordinary way), else a TypeError naming ``fn``, the argument and the type."""
    problem = _problem(t)
    if problem is not None:
        raise as_argument_error(TypeError)(f"{fn}: {name} is {problem}")
    return t
