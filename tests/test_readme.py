"""The README's usage example runs as written."""

from __future__ import annotations

import re
from pathlib import Path


def test_readme_python_examples_run():
    text = (Path(__file__).parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "the README has a Python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})
