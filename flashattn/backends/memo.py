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
    """The answers for the few tensors seen last, each with an ``extra`` key compared by ``==``. An in-place write
    bumps a tensor's version counter, which invalidates its answer; a tensor that died cannot be confused with a
    new one at the same address (the entry holds a weak reference).

    Example::

        >>> cache, t = PerTensor(), torch.zeros(3)
        >>> cache.get(t, "sum", lambda: 1), cache.get(t, "sum", lambda: 2)
        (1, 1)
    """

    def __init__(self, slots: int = 4) -> None:
        self.slots, self.entries = slots, []  # (weakref, version, extra, value), newest first

    def get(self, tensor: torch.Tensor, extra: object, compute: Callable[[], T]) -> T:
        for ref, version, seen, value in self.entries:
            if ref() is tensor and version == tensor._version and seen == extra:
                return value
        value = compute()
        self.entries = [(weakref.ref(tensor), tensor._version, extra, value), *self.entries[: self.slots - 1]]
        return value
