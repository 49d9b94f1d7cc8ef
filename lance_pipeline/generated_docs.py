"""Tables in the docs that are generated from the code's own data (edit types, deviations from the papers): one way
to rewrite the generated block of a page, and one command line for each table's module."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


def update_block(path: str | Path, begin: str, end: str, body: str, what: str) -> bool:
    """Replace what stands between the markers ``begin`` and ``end`` of ``path`` by ``body``; whether it changed.

    Raises:
        ValueError: the page has no such block (``what`` names the table in the message).
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if begin not in text or end not in text:
        raise ValueError(f"{path} has no generated {what} block ({begin!r} ... {end!r})")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    new = f"{head}{begin}\n{body}{end}{tail}"
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def run(module: str, update_docs: Callable[[str], bool], argv: list[str] | None = None) -> int:
    """``python -m MODULE docs/method.md``: regenerate that module's block of the page."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write(f"usage: python -m {module} docs/method.md\n")
        return 2
    changed = update_docs(args[0])
    sys.stdout.write(f"{args[0]}: {'updated' if changed else 'up to date'}\n")
    return 0
