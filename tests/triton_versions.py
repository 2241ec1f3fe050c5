"""Which Triton the tests run on: the supported range is pyproject's ``triton`` extra, and ``make test`` runs the
Triton tests on both of its ends (the oldest in .venv, the newest from .venv/triton-newest)."""

from __future__ import annotations

import importlib.util

import pytest

OLDEST = "3.6.0"  # the range's lower bound: torch 2.11's Triton, the one on the GPU machines


def installed() -> str | None:
    """The version of the Triton that ``import triton`` loads, or None."""
    if importlib.util.find_spec("triton") is None:
        return None
    import triton

    return triton.__version__


def recorded_on_oldest(what: str) -> pytest.MarkDecorator:
    """Skip a test whose expectations were recorded with the oldest Triton (instruction counts, Gluon's API)."""
    version = installed()
    return pytest.mark.skipif(version not in (None, OLDEST),
                              reason=f"{what} was recorded with triton {OLDEST}; this is triton {version}")


def missing() -> str | None:
    """Why the Triton kernels cannot be tested here (not installed, or a release outside the kernels' range, as
    older torch pins), else None."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    from flashattn.backends.triton import unsupported_release

    return unsupported_release()


# Here, not in conftest.py: processes that tests spawn import test modules with the checkout's root first on
# sys.path, where another conftest.py lies.
TRITON_MISSING = missing()
needs_triton = pytest.mark.skipif(TRITON_MISSING is not None, reason=TRITON_MISSING or "")
