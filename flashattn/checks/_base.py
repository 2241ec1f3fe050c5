"""The building blocks of every check: the error, tensors, dtypes and devices, head counts, and scalar options.

Each ``validate_*`` raises a ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind, bad value), each
also a ``RuntimeError`` as ``flash_attn``'s errors are (``flashattn.errors``), whose message starts with the
function the user called, then names the argument, the value received and what is allowed.
"""

from __future__ import annotations

import math
import numbers
import operator

import torch

from ..backends.spec import FP8_DTYPES, accumulation_dtype
from ..errors import as_argument_error
from .kinds import validate_plain

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DTYPE_NAMES = "float16, bfloat16, float32 or float64"


def fail(fn: str, message: str, kind: type[Exception] = ValueError) -> Exception:
    """The error to raise: ``kind(f"{fn}: {message}")``, where a ValueError or TypeError is also a RuntimeError
    (``flashattn.errors``: what ``flash_attn``'s C++ checks raise)."""
    return as_argument_error(kind)(f"{fn}: {message}")


def validate_tensor(fn: str, name: str, t: object, ndim: int | None, layout: str, *,
                    fp8: bool = False) -> torch.Tensor:
    """A floating-point tensor with ``ndim`` dimensions (None: at least 2), described as ``layout`` in the
    error; FP8 ones too where ``fp8``."""
    if not isinstance(t, torch.Tensor):
        raise fail(fn, f"{name} must be a torch.Tensor of shape {layout}, got {type(t).__name__}", TypeError)
    validate_plain(fn, name, t)
    if ndim is None and t.dim() < 2:
        raise fail(fn, f"{name} must have at least 2 dimensions {layout}, got shape {tuple(t.shape)}")
    if ndim is not None and t.dim() != ndim:
        raise fail(fn, f"{name} must have {ndim} dimensions {layout}, got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES and not (fp8 and t.dtype in FP8_DTYPES):
        names = _DTYPE_NAMES.replace(" or ", ", ") + ", float8_e4m3fn or float8_e5m2" if fp8 else _DTYPE_NAMES
        raise fail(fn, f"{name} has dtype {t.dtype}; supported dtypes are {names}", TypeError)
    return t


def unit_stride(t: torch.Tensor | None) -> torch.Tensor | None:
    """An index tensor (offsets, lengths, rows, a block table) as the kernels read it, its last dim at unit stride
    (they index it without that stride): a copy where it has another (``cu[::2]``), else ``t`` itself.

        >>> unit_stride(torch.arange(6, dtype=torch.int32)[::2]).stride()
        (1,)
    """
    return t if t is None or t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def validate_same(fn: str, named: dict[str, torch.Tensor]) -> None:
    """All tensors share the first one's dtype and device."""
    (first, t0), *rest = named.items()
    for name, t in rest:
        if t.dtype != t0.dtype:
            raise fail(fn, f"{name} has dtype {t.dtype} but {first} has {t0.dtype}; all must match", TypeError)
        if t.device != t0.device:
            raise fail(fn, f"{name} is on {t.device} but {first} is on {t0.device}; all must be on one device")


def validate_heads(fn: str, *, nheads: int, nheads_k: int, names: tuple[str, str]) -> None:
    """Grouped-query attention: the query heads are a multiple of the key/value heads."""
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise fail(fn, f"the number of heads in {names[0]} ({nheads}) must be a multiple of the number of heads in "
                       f"{names[1]} ({nheads_k}) for grouped-query attention")


def validate_head_dim(fn: str, name: str, head_dim: int) -> None:
    if head_dim < 1:
        raise fail(fn, f"{name} has head dim {head_dim}; the head dim (last dimension) must be at least 1")


def validate_real(fn: str, name: str, value: object) -> float:
    """A finite real number: Python and NumPy numbers, or a one-element tensor (as PyTorch accepts for scale)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise fail(fn, f"{name} must be a real number, got {value!r}", TypeError)
    if not math.isfinite(value):
        raise fail(fn, f"{name} must be finite, got {value!r}")
    return float(value)


def validate_int(fn: str, name: str, value: object) -> int:
    """An integer: anything ``operator.index`` accepts (Python and NumPy integers, 0-d integer tensors), as the
    C++ bindings of flash_attn do; floats are refused."""
    try:
        return operator.index(value)
    except TypeError:
        raise fail(fn, f"{name} must be an integer, got {value!r}", TypeError) from None


def validate_flag(fn: str, name: str, value: object) -> bool:
    """A flag of the ``flash_attn_*`` functions: anything with a numeric truth value (bool, 0/1, NumPy booleans,
    a one-element tensor), as flash_attn takes it. Strings, None and containers are refused: their truth value
    says nothing about the flag."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return bool(value)
    numeric = isinstance(value, numbers.Number) or type(value).__name__ in ("bool_", "bool")
    if isinstance(value, bool) or (numeric and not isinstance(value, complex)):
        return bool(value)
    raise fail(fn, f"{name} must be a bool (or 0/1), got {value!r}", TypeError)


def validate_dropout(fn: str, dropout_p: object) -> float:
    p = validate_real(fn, "dropout_p", dropout_p)
    if not 0.0 <= p < 1.0:
        raise fail(fn, f"dropout_p must be in [0, 1), got {dropout_p!r}")
    return p


def validate_scale(fn: str, name: str, scale: object, headdim: int) -> float:
    if scale is None:
        return headdim**-0.5 if headdim > 0 else 1.0
    return validate_real(fn, name, scale)


def validate_window(fn: str, window_size: object, causal: bool) -> tuple[int, int]:
    """(left, right) from any pair of integers: a tuple or list, a tensor or array of two (flash_attn's own tests
    pass ``torch.randint(0, n, (2,))``); the right side is 0 when ``causal``."""
    try:
        pair = [operator.index(w) for w in window_size]
    except TypeError:
        pair = None
    if pair is None or len(pair) != 2:
        raise fail(fn, f"window_size must be a pair of ints (left, right), got {window_size!r}", TypeError)
    left, right = pair
    if left < -1 or right < -1:
        raise fail(fn, f"window_size values must be >= -1 (-1 means unbounded), got {tuple(pair)}")
    # flash_attn: causal is the window's right edge at the diagonal.
    return (left, 0) if causal else (left, right)


def validate_softcap(fn: str, softcap: object) -> float:
    c = validate_real(fn, "softcap", softcap)
    if c < 0:
        raise fail(fn, f"softcap must be >= 0 (0 disables it), got {softcap!r}")
    return c


def validate_bool(fn: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise fail(fn, f"{name} must be a bool, got {value!r}", TypeError)
    return value


def validate_count(fn: str, name: str, value: object, minimum: int = 0, meaning: str = "0 chooses automatically"
                   ) -> int:
    """An integer >= ``minimum`` (see ``validate_int``); ``meaning`` explains the smallest value in the error."""
    value = validate_int(fn, name, value)
    if value < minimum:
        raise fail(fn, f"{name} must be >= {minimum} ({meaning}), got {value}")
    return value


def validate_alibi(fn: str, slopes: object, *, batch: int, nheads: int, ref: torch.Tensor) -> torch.Tensor | None:
    """ALiBi slopes (nheads,) or (batch, nheads) -> (1 or batch, nheads) in the accumulation dtype."""
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor):
        raise fail(fn, f"alibi_slopes must be a torch.Tensor or None, got {type(slopes).__name__}", TypeError)
    validate_plain(fn, "alibi_slopes", slopes)
    if not slopes.is_floating_point():
        raise fail(fn, f"alibi_slopes must be a floating-point tensor, got dtype {slopes.dtype}", TypeError)
    if slopes.device != ref.device:
        raise fail(fn, f"alibi_slopes is on {slopes.device} but q is on {ref.device}")
    if slopes.requires_grad and torch.is_grad_enabled():
        raise fail(fn, "alibi_slopes receives no gradient (as in flash_attn); pass alibi_slopes.detach()")
    if tuple(slopes.shape) not in ((nheads,), (batch, nheads)):
        raise fail(fn, f"alibi_slopes must have shape (nheads,) = ({nheads},) or (batch, nheads) = ({batch}, "
                       f"{nheads}), got {tuple(slopes.shape)}")
    return slopes.reshape(-1, nheads).to(accumulation_dtype(ref.dtype))


def validate_sink(fn: str, sink: object, *, nheads: int, ref: torch.Tensor) -> torch.Tensor | None:
    """A learnable sink logit per head, (nheads,) of any float dtype (it may require grad) -> the accumulation
    dtype; the conversion stays in the autograd graph, so the gradient reaches the caller's tensor."""
    if sink is None:
        return None
    if not isinstance(sink, torch.Tensor):
        raise fail(fn, f"learnable_sink must be a torch.Tensor of shape (nheads,) or None, got {type(sink).__name__}",
                   TypeError)
    validate_plain(fn, "learnable_sink", sink)
    if not sink.is_floating_point():
        raise fail(fn, f"learnable_sink must be a floating-point tensor, got dtype {sink.dtype}", TypeError)
    if sink.device != ref.device:
        raise fail(fn, f"learnable_sink is on {sink.device} but q is on {ref.device}")
    if tuple(sink.shape) != (nheads,):
        raise fail(fn, f"learnable_sink must have shape (nheads,) = ({nheads},), got {tuple(sink.shape)}")
    return sink.to(accumulation_dtype(ref.dtype))
