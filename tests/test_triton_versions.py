"""The Triton the tests run on is the one ``make test`` meant (FLASHATTN_EXPECT_TRITON: the oldest or the newest of
the supported range), and within the range pyproject declares."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from triton_versions import OLDEST, installed

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(installed() is None, reason="triton is not installed")


def _declared() -> SpecifierSet:
    # A regular expression, not tomllib: the tests run on Python 3.10 too.
    requirement = re.search(r'^triton = \["triton([^"]*)"\]', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    return SpecifierSet(requirement)


def test_the_running_triton_is_the_intended_one_and_in_the_declared_range():
    declared = _declared()
    assert installed() in declared, f"triton {installed()} is outside the declared range {declared}"
    assert OLDEST in declared and "3.5.0" not in declared
    from flashattn.backends.triton import tables  # which release's configs apply: the one imported

    assert ".".join(map(str, tables.TRITON)) == ".".join(installed().split(".")[:2])
    expected = os.environ.get("FLASHATTN_EXPECT_TRITON")
    if expected is not None:
        assert installed() == expected, f"make test meant triton {expected}, but {installed()} was imported"


def test_the_makefile_tests_both_ends_of_the_range():
    makefile = (ROOT / "Makefile").read_text()
    oldest = re.search(r"^TRITON_OLDEST := (\S+)", makefile, re.M).group(1)
    newest = re.search(r"^TRITON_NEWEST := (\S+)", makefile, re.M).group(1)
    declared = _declared()
    assert oldest == OLDEST and oldest in declared and newest in declared
    assert "FLASHATTN_EXPECT_TRITON=$(TRITON_NEWEST)" in makefile
