"""The torch the tests run on is the one ``make test`` meant (FLASHATTN_EXPECT_TORCH: an end of the declared range,
or the GPU machines' release), and within the range pyproject declares."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _declared() -> SpecifierSet:
    # A regular expression, not tomllib: the tests run on Python 3.10 too.
    return SpecifierSet(re.search(r'^    "torch([^"]*)",', (ROOT / "pyproject.toml").read_text(), re.M).group(1))


def test_the_running_torch_is_the_intended_one_and_in_the_declared_range():
    running = Version(torch.__version__.split("+")[0])
    assert running in _declared(), f"torch {running} is outside the declared range {_declared()}"
    makefile = (ROOT / "Makefile").read_text()
    oldest = re.search(r"^TORCH_OLDEST := (\S+)", makefile, re.M).group(1)
    major, minor = map(int, oldest.split(".")[:2])
    # The oldest release make test runs is the oldest pyproject declares.
    assert Version(oldest) in _declared() and Version(f"{major}.{minor - 1}") not in _declared()
    expected = os.environ.get("FLASHATTN_EXPECT_TORCH")
    if expected is None:
        pytest.skip("FLASHATTN_EXPECT_TORCH is unset: a run outside make test's torch range")
    assert str(running) == expected, f"meant torch {expected}, running {running} ({torch.__file__})"
