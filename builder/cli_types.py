"""Option types of every ``lance-cf`` command: numbers the parser refuses in its one-line error instead of letting a
command meet them (``--port 70000`` raised ``OverflowError`` deep in the socket library; ``--seed`` with 5,000 digits
and ``--lr nan`` were accepted).

``bound_numeric_options`` is applied by ``builder.cli.build_parser`` to the whole parser tree, so an option a command
declares with ``type=int`` or ``type=float`` is parsed by ``bounded_int`` or ``finite_float`` without the command
doing anything; a command with a narrower range (a port, a count) declares its own type from here.
"""

from __future__ import annotations

import argparse
import math
import re

MAX_INT_DIGITS = 18  # fits a signed 64-bit integer: SQLite, numpy and torch seeds all take it
_INT = re.compile(rf"[+-]?[0-9]{{1,{MAX_INT_DIGITS}}}")


def bounded_int(value: str) -> int:
    """An integer of at most ``MAX_INT_DIGITS`` ASCII digits."""
    text = value.strip()
    if not _INT.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected an integer of at most {MAX_INT_DIGITS} digits, got {value[:40]!r}")
    return int(text)


def finite_float(value: str) -> float:
    """A finite number (``nan``, ``inf`` and ``1e999`` are refused)."""
    try:
        number = float(value) if len(value) <= 64 else math.nan
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value[:40]!r}") from None
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {value[:40]!r}")
    return number


def port_number(value: str) -> int:
    """A TCP port, 0 to 65535 (0: a free one)."""
    number = bounded_int(value)
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 0 to 65535 (0: a free one), got {number}")
    return number


def bound_numeric_options(parser: argparse.ArgumentParser) -> None:
    """Give every ``type=int`` / ``type=float`` option of ``parser`` and its subcommands, at any depth, the bounded
    type above."""
    for action in parser._actions:
        if action.type is int:
            action.type = bounded_int
        elif action.type is float:
            action.type = finite_float
        if isinstance(action, argparse._SubParsersAction):
            for sub in {id(p): p for p in action.choices.values()}.values():
                bound_numeric_options(sub)
