"""Option types and options shared by the ``flashattn bench`` subcommands.

The types raise ``argparse.ArgumentTypeError``, so a bad value is a usage error (exit 2) naming the option,
never a traceback::

    >>> int_list("512,1024")
    [512, 1024]
    >>> int_list("abc")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: 'abc' is not a comma-separated list of positive integers
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import torch

DTYPES = ("float16", "bfloat16", "float32")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each option's help, except None (those depend on the device, and the help text says
    how) and a flag's False. Descriptions keep their line breaks (they hold example commands)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def plain(doc: str) -> str:
    """A module docstring as command-line help: without reST markup."""
    return doc.replace("``", "").replace("::\n", ":\n")


def _number(text: str, kind: type, accept, what: str):
    """``text`` as a ``kind`` (int or float) that ``accept`` holds true of, else argparse's usage error naming
    ``what`` was expected."""
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not accept(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, lambda x: x >= 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    return _number(text, int, lambda x: x >= 0, "a non-negative integer")


def positive_float(text: str) -> float:
    return _number(text, float, lambda x: x > 0, "a positive number")


def int_list(text: str) -> list[int]:
    """"512,1024" -> [512, 1024]: positive integers, comma-separated."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive integers")
    return values


def name_list(text: str) -> list[str]:
    """"sdpa,plain" -> ["sdpa", "plain"]; names are checked where they are used (an unknown baseline is a row of
    the report saying so, not an error)."""
    values = [x.strip() for x in text.split(",") if x.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} names nothing")
    return values


def choice_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """A type for comma-separated values, each one of ``choices``."""

    def parse(text: str) -> list[str]:
        values = name_list(text)
        bad = [v for v in values if v not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"{', '.join(bad)}: choose from {', '.join(choices)}")
        return values

    parse.__name__ = "list"
    return parse


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")


def add_per_device(p: argparse.ArgumentParser, flag: str, what: str, sweep: type, kind=positive_int) -> None:
    """``flag`` for a field of ``sweep`` whose default differs on a GPU and on CPU (``sweep.for_device``): None on the
    command line, the help shows both defaults, read from the sweep itself."""
    field = flag.lstrip("-").replace("-", "_")
    shown = [getattr(sweep.for_device(device), field) for device in ("cuda", "cpu")]
    shown = [",".join(map(str, x)) if isinstance(x, list) else x for x in shown]
    p.add_argument(flag, type=kind, default=None, help=f"{what} (default: {shown[0]} on a GPU; {shown[1]} on CPU)")


def add_output(p: argparse.ArgumentParser, stem: str, progress: bool = True) -> None:
    """--out, --name and (for commands with a progress bar) --quiet."""
    p.add_argument("--out", default="bench-output", help="folder for the JSON results and the plots")
    p.add_argument("--name", default=None, help=f"file stem of the results (default: {stem})")
    if progress:
        p.add_argument("--quiet", action="store_true", help="no progress bar")


def add_dtype(p: argparse.ArgumentParser, default: str = "bfloat16 on a GPU, float32 on CPU") -> None:
    p.add_argument("--dtype", default=None, choices=DTYPES, help=f"input dtype (default: {default})")
