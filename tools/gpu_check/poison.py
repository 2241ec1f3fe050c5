"""NaN-poisoned allocations for gpu-check's smoke: an output element a kernel forgets to write shows up."""

from __future__ import annotations

import math
from contextlib import contextmanager


@contextmanager
def poisoned():
    """``torch.empty``, ``empty_like`` and ``Tensor.new_empty`` hand out NaN-filled float tensors meanwhile: an
    output element a kernel forgets to write shows up as NaN."""
    import torch

    saved = [(torch, "empty", torch.empty), (torch, "empty_like", torch.empty_like),
             (torch.Tensor, "new_empty", torch.Tensor.new_empty)]

    def poison(make):
        def made(*args, **kwargs):
            t = make(*args, **kwargs)
            return t.fill_(math.nan) if t.is_floating_point() else t

        return made

    for owner, name, make in saved:
        setattr(owner, name, poison(make))
    try:
        yield
    finally:
        for owner, name, make in saved:
            setattr(owner, name, make)
