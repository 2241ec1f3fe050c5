"""Checked signatures: a call whose tensors and options were checked once is not checked again.

The checks of a call depend only on its signature: each tensor's type, shape, dtype, device and layout, and the
option values. A signature that passed once passes again, so its result (the ``AttentionSpec``, which holds no
tensor when the call passes no optional one) is remembered and the next call of that signature skips the checks
(a few microseconds instead of tens: a decode step calls attention once per layer and token). Only calls whose
every other argument is a plain value (None, a bool, int, float, str, or a tuple of them) and whose tensors are
plain tensors (or parameters) are remembered; anything else (a tensor option, a mask, scales, a list, a tensor
subclass) is checked every time, and a failing call is never remembered, so every error is raised as before.
Under ``torch.compile`` the checks run as written (they are traced once).
"""

from __future__ import annotations

import torch

_PLAIN = frozenset((type(None), bool, int, float, str))


def _plain(value: object) -> bool:
    kind = type(value)
    return kind in _PLAIN or (kind is tuple and all(type(x) in _PLAIN for x in value))


class Signatures:
    """Results of passed checks by signature: ``key`` builds one (None: not rememberable), ``get`` and ``put``."""

    LIMIT = 4096  # signatures kept; past it the memo starts over

    def __init__(self):
        self._results: dict[tuple, object] = {}

    @staticmethod
    def key(fn: str, tensors: tuple, options: tuple) -> tuple | None:
        """The signature of a call of ``fn`` with ``tensors`` (each must be a tensor) and ``options`` (each must be
        a plain value); None when the call is not to be remembered."""
        if torch.compiler.is_compiling():
            return None
        described = []
        for t in tensors:
            kind = type(t)
            if kind is not torch.Tensor and kind is not torch.nn.Parameter:
                return None  # subclasses are checked every time (some refuse even .shape: CausalBias on torch 2.7)
            described.append((kind, t.shape, t.dtype, t.device, t.layout, t.is_nested))
        kinds = []
        for option in options:  # a loop, not all(generator): this runs on every call
            kind = type(option)
            if kind not in _PLAIN and not (kind is tuple and _plain(option)):
                return None
            kinds.append(kind)
        # The options' types too: False == 0 == 0.0 as keys, and the checks refuse a bool where they take a number.
        return fn, tuple(described), options, tuple(kinds)

    def get(self, key: tuple | None) -> object | None:
        return None if key is None else self._results.get(key)

    def put(self, key: tuple | None, result: object) -> None:
        if key is None:
            return
        if len(self._results) >= self.LIMIT:
            self._results.clear()
        self._results[key] = result
