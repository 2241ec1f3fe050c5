"""The documentation cannot go stale: every ```python block of the README and docs/*.md runs as written (one
namespace per file, top to bottom), and docs/api.md is what docs/build_api.py generates from the docstrings,
none of which documents an argument its function does not take."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_examples_run(page):
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    if page.name == "README.md":
        assert blocks, "the README has a Python example"
    namespace = {"__name__": f"docs_{page.stem}"}
    for block in blocks:
        exec(compile(block, str(page.relative_to(ROOT)), "exec"), namespace)


def test_api_reference_is_current_and_docstrings_match_signatures():
    result = subprocess.run([sys.executable, str(ROOT / "docs" / "build_api.py"), "--check"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_docs_link_to_existing_files():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
