"""The ``flash_attn::`` custom ops: registered once, under the names flash_attn gives them."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable

import torch

_log = logging.getLogger("flashattn")


def register_op(name: str, impl: Callable, fake: Callable, *, mutates_args: tuple[str, ...], schema: str):
    """``torch.ops.flash_attn.<name>`` running ``impl`` on every device, with ``fake`` for ``torch.compile``.

    Where the op already exists (this module imported again, or a real flash_attn imported before
    ``install_as_flash_attn(force=True)``) the existing one is returned: torch allows one implementation per name.
    """
    existing = getattr(torch.ops.flash_attn, name, None) if _namespace_has(name) else None
    if existing is not None:
        _log.info("flashattn: torch.ops.flash_attn.%s is already registered; using it", name)
        return existing

    @functools.wraps(impl)
    def without_autograd(*args, **kwargs):
        # flash_attn's private ops record no graph (its autograd Functions call them inside their forward);
        # flashattn's own op underneath would record one for inputs that require grad.
        with torch.no_grad():
            return impl(*args, **kwargs)

    # Libraries read the ops' defaults with inspect.getfullargspec(op._init_fn) (ring-flash-attention does), which
    # does not follow functools.wraps: the signature itself must say them.
    without_autograd.__signature__ = inspect.signature(impl)

    op = torch.library.custom_op(f"flash_attn::{name}", without_autograd, mutates_args=mutates_args, schema=schema)
    op.register_fake(fake)
    return op


def _namespace_has(name: str) -> bool:
    try:
        getattr(torch.ops.flash_attn, name)
    except (AttributeError, RuntimeError):
        return False
    return True
