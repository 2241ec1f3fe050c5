"""Environment variables read on every call: ``Variable(name).get()`` is ``os.environ.get(name)`` at the cost of a
dictionary lookup.

``os.environ.get`` encodes the name and decodes the value each time (about 0.6 us), and a call reads several of
them (the forced path, the interpreter, launch plans), which is a sizeable part of what a repeated GPU call costs
the host. ``os.environ`` keeps its encoded entries in ``_data`` (every change made through it, and so every
``monkeypatch.setenv``, updates it); a ``Variable`` looks its encoded name up there and decodes a value only when
it changed. Where ``os.environ`` does not look like that, it is ``os.environ.get``.

Example::

    >>> name = "PATH"
    >>> Variable(name).get() == os.environ.get(name), Variable(name + "_NOT_SET").get("default")
    (True, 'default')
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

_DATA = getattr(os.environ, "_data", None)
_ENCODE = getattr(os.environ, "encodekey", None)
_DECODE = getattr(os.environ, "decodevalue", None)


class Variable:
    """One environment variable, read at each ``get``."""

    __slots__ = ("_key", "_raw", "_value", "name")

    def __init__(self, name: str):
        self.name = name
        fast = isinstance(_DATA, dict) and _ENCODE is not None and _DECODE is not None
        self._key = _ENCODE(name) if fast else None
        self._raw = self._value = None

    def get(self, default: str | None = None) -> str | None:
        if self._key is None:
            return os.environ.get(self.name, default)
        raw = _DATA.get(self._key)
        if raw is None:
            return default
        if raw is not self._raw:  # changed since the last read: decode it once
            self._raw, self._value = raw, _DECODE(raw)
        return self._value


@contextmanager
def setting(name: str, value: str) -> Iterator[None]:
    """``name=value`` in the environment inside the block, the caller's value (or its absence) after: for tools
    that run under one setting of a variable the package reads at each call (launch plans, which hold such
    variables in their context, follow it)."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved
