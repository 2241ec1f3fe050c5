"""Answers kept per tensor: every layer of a model passes the same padding mask, position ids or block mask, so
what is derived from one (a varlen plan, a block mask's tiles, the kernels' block lists) is computed once per
forward, not once per layer and again in the backward."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


class PerTensor:
    """The answers for the few tensors seen last, each with an ``extra`` key compared by ``==`` and ``also``
    tensors (None allowed) that must be the same objects at the same versions. An in-place write bumps a tensor's
    version counter, which invalidates its answer; a tensor that died cannot be confused with a new one at the
    same address (the entry holds weak references). Inference-mode tensors, which have no version counter, are
    never kept.

    Example::

        >>> cache, t = PerTensor(), torch.zeros(3)
        >>> cache.get(t, "sum", lambda: 1), cache.get(t, "sum", lambda: 2)
        (1, 1)
    """

    def __init__(self, slots: int = 4) -> None:
        self.slots, self.entries = slots, []  # (weak references, versions, extra, value), newest first

    def get(self, tensor: torch.Tensor, extra: object, compute: Callable[[], T], *,
            also: tuple[torch.Tensor | None, ...] = ()) -> T:
        keys = (tensor, *also)
        if any(t is not None and t.is_inference() for t in keys):
            # An inference-mode tensor keeps no version counter, so an in-place write to it could not be told
            # from the tensor the answer was for: computed each time (a model's mask made outside inference
            # mode, the usual case, is still kept).
            return compute()
        versions = tuple(None if t is None else t._version for t in keys)
        for refs, seen_versions, seen, value in self.entries:
            if (len(refs) == len(keys) and all((r is None and t is None) or (r is not None and r() is t)
                                               for r, t in zip(refs, keys, strict=True))
                    and seen_versions == versions and seen == extra):
                return value
        value = compute()
        refs = tuple(None if t is None else weakref.ref(t) for t in keys)
        self.entries = [(refs, versions, extra, value), *self.entries[: self.slots - 1]]
        return value
