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
