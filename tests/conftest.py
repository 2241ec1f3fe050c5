"""Fixtures shared by the test files (the repository root's conftest.py sets up Triton's interpreter)."""

from __future__ import annotations

import shutil

import pytest

import flashattn
from flashattn.backends import cpu_kernel

HAS_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))


@pytest.fixture(params=["kernel", "tiled"])
def cpu_path(request):
    """Runs the test on the cpu backend twice: on the C++ kernel (skipped without a compiler) and on the tiled
    PyTorch path that replaces it where it cannot be built."""
    if request.param == "kernel" and not HAS_COMPILER:
        pytest.skip("no C++ compiler")
    with cpu_kernel.use(request.param == "kernel"), flashattn.use_backend("cpu"):
        yield
