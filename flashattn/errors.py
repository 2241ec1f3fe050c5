"""The errors flashattn raises for bad arguments.

Python's convention is ``TypeError`` for the wrong kind of thing and ``ValueError`` for a bad value; ``flash_attn``
raises ``RuntimeError`` from its C++ checks (shapes, dtypes, block tables, indices out of range). Each error here is
both, so code written for either catches it:

    >>> try:
    ...     raise ArgumentError("flash_attn_func: dropout_p must be in [0, 1), got 1.5")
    ... except RuntimeError as err:
    ...     isinstance(err, ValueError)
    True
"""

from __future__ import annotations

__all__ = ["ArgumentError", "ArgumentTypeError", "as_argument_error"]


class ArgumentError(ValueError, RuntimeError):
    """A bad argument value: a ``ValueError`` that ``except RuntimeError`` (as for ``flash_attn``) catches too."""


class ArgumentTypeError(TypeError, RuntimeError):
    """An argument of the wrong type or dtype: a ``TypeError`` that ``except RuntimeError`` catches too."""


def as_argument_error(kind: type[Exception]) -> type[Exception]:
    """The class to raise for ``kind``: ValueError -> ArgumentError, TypeError -> ArgumentTypeError; any other
    (already specific) class as it is."""
    return {ValueError: ArgumentError, TypeError: ArgumentTypeError}.get(kind, kind)
