"""Generate docs/api.md from the docstrings of every public name.

    python docs/build_api.py          # rewrite docs/api.md
    python docs/build_api.py --check  # exit 1 if docs/api.md is stale (tests/test_docs.py does this in CI)

Also refuses docstrings that document an argument the signature does not have (``Args:`` entries).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "api.md"

# (module, one-line role). Names come from each module's __all__, in that order.
MODULES = [
    ("flashattn", "The attention functions: drop-ins for flash_attn and torch SDPA."),
    ("flashattn.padding", "Padding <-> packed conversion for the varlen functions (flash_attn.bert_padding)."),
    ("flashattn.nn", "Modules: MultiheadAttention, SelfAttention with a KV cache."),
    ("flashattn.integrations.transformers", "Hugging Face transformers: attn_implementation=\"flashattn\"."),
    ("flashattn.distributed", "Context parallelism over torch.distributed."),
    ("flashattn.reference", "The FlashAttention derivation in NumPy, and the HBM-traffic counter."),
]

_ARG_LINE = re.compile(r"^ {4}(\*{0,2}[A-Za-z_][\w]*(?:, \*{0,2}[A-Za-z_][\w]*)*)(?: \([^)]*\))?:(?: |$)")


def documented_args(doc: str) -> list[str]:
    """The names an ``Args:`` section documents (entries indented 4 spaces under the header)."""
    names, inside = [], False
    for line in doc.splitlines():
        if line.strip() in ("Args:", "Arguments:", "Parameters:"):
            inside = True
            continue
        if inside:
            if line and not line.startswith(" "):  # the next section header ends it
                inside = False
                continue
            match = _ARG_LINE.match(line)
            if match:
                names += [n.lstrip("*") for n in match.group(1).split(", ")]
    return names


class _Annotation:
    """An annotation shown as written (``from __future__ import annotations`` keeps them as strings, which
    inspect would print quoted)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _unquoted(annotation):
    return _Annotation(annotation) if isinstance(annotation, str) else annotation


def _signature(obj) -> inspect.Signature | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params = [p.replace(annotation=_unquoted(p.annotation)) for p in sig.parameters.values()]
    return sig.replace(parameters=params, return_annotation=_unquoted(sig.return_annotation))


def problems(obj, qualname: str) -> list[str]:
    """What is wrong with obj's docstring: missing, or documenting arguments it does not take."""
    doc = inspect.getdoc(obj)
    if not doc:
        return [f"{qualname}: no docstring"]
    sig = _signature(obj)
    if sig is None or not (inspect.isfunction(obj) or inspect.isclass(obj)):
        return []
    params = set(sig.parameters)
    return [f"{qualname}: docstring documents {name!r}, which is not an argument of {qualname}{sig}"
            for name in documented_args(doc) if name not in params]


def _entry(module: str, name: str, obj) -> str:
    kind = "class" if inspect.isclass(obj) else "function" if callable(obj) else "constant"
    sig = _signature(obj) if kind != "constant" else None
    head = f"### `{module}.{name}`\n\n"
    if sig is not None:
        head += f"```text\n{kind} {name}{sig}\n```\n\n"
    # A constant's getdoc is its type's docstring: show its value instead.
    body = inspect.getdoc(obj) if kind != "constant" else f"{name} = {obj!r}"
    # Docstrings are plain text with doctest examples: fence them so Markdown keeps the layout.
    text = head + "```text\n" + body + "\n```\n"
    if inspect.isclass(obj):
        for attr, member in vars(obj).items():
            if attr.startswith("_") or not callable(member) or not inspect.getdoc(member):
                continue
            text += f"\n#### `{name}.{attr}{_signature(member) or ''}`\n\n```text\n{inspect.getdoc(member)}\n```\n"
    return text


def build() -> tuple[str, list[str]]:
    parts = ["# API reference\n",
             "Generated from the docstrings by `python docs/build_api.py`; `make test` fails when this file is "
             "stale. Shapes use flash_attn's names: B batch, N sequence length, H heads, D head dim.\n"]
    errors = []
    for module_name, role in MODULES:
        module = importlib.import_module(module_name)
        parts.append(f"## `{module_name}`\n\n{role}\n")
        for name in module.__all__:
            if name.startswith("__"):
                continue
            obj = getattr(module, name)
            errors += problems(obj, f"{module_name}.{name}") if callable(obj) else []
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if not attr.startswith("_") and inspect.isfunction(member):
                        errors += problems(member, f"{module_name}.{name}.{attr}")
            parts.append(_entry(module_name, name, obj))
    return "\n".join(parts), errors


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if docs/api.md is stale")
    args = parser.parse_args(argv)
    text, errors = build()
    for error in errors:
        print(error, file=sys.stderr)
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        if current != text:
            print(f"{OUTPUT} is stale: run python docs/build_api.py", file=sys.stderr)
            return 1
        return 1 if errors else 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT} ({len(text.splitlines())} lines)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
