"""The one path for text from data into Markdown prose, an HTML page or a CSV file.

- **Markdown** (the card, through ``dataset_cards.markdown``, and the prose of ``croissant.json``): ``md_escape`` for
  prose, ``code_span`` for inline code; both return ``Markdown``, text marked as safe to print.

- **HTML** (the evaluation report, the leaderboard and side-by-side pages, the discovery report): ``html_environment``
  is the only Jinja2 environment for pages. Autoescape is on and ``|safe`` is not used by any template, so every
  ``{{ value }}`` is escaped by the engine; a missing value is an error, not an empty cell. The review page is static
  HTML whose script writes data with ``textContent`` only.
- **CSV** (``review export``, the leaderboard, the shift correlations, timm-format results): ``write_csv`` writes a pandas
  frame (``write_csv_rows``: rows of pre-formatted cells, with the text columns named) with every
  text cell (and column name) passed through ``csv_cell``, which neutralises a cell a spreadsheet would run as a
  formula (one starting with ``= + - @``, a tab or a carriage return, OWASP's list) by prefixing ``'``. Numbers are
  written as numbers: a negative score stays ``-0.5``.

``tests/test_text_paths.py`` fails when package code writes CSV or builds a Jinja2 environment any other way.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

FORMULA_LEADS = ("=", "+", "-", "@", "\t", "\r")

LINE_BREAKS = re.compile(r"[\r\n\v\f\x1c-\x1e\x85\u2028\u2029]+")
_MD_SPECIAL = re.compile(r"([\\`*_\[\]|~#!])")  # mid-line, only these can start markup


class Markdown(str):
    """Text that is Markdown already: escaped data, or composed only of escaped data and the code's own markup."""

    __slots__ = ()


def md_escape(text: Any) -> Markdown:
    """Text from data made inert in Markdown and HTML, on one line.

    Line breaks become spaces (no heading, list or table row can be started), HTML's ``& < >`` become entities (no tag,
    no comment) and every Markdown punctuation character is backslash-escaped (no link, image, emphasis or table cell
    boundary). Text is always put mid-line, so line-start markers (`1.`, `-`, `+`) need no escape.
    """
    text = LINE_BREAKS.sub(" ", str(text))
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return Markdown(_MD_SPECIAL.sub(r"\\\1", text))


_NOT_FOR_CODE = re.compile(r"[<>|]|!\[|\]\(")  # could read as HTML, a table cell's end, an image or a link


def code_span(text: Any) -> Markdown:
    """``text`` as an inline code span that no backtick or line break in it can close or break. Text that could read
    as markup outside a span (HTML, a table cell's end, an image or a link) is shown escaped instead (``md_escape``):
    inert either way, and never present raw in the card."""
    text = LINE_BREAKS.sub(" ", str(text))
    if _NOT_FOR_CODE.search(text):
        return md_escape(text)
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return Markdown(f"{fence}{pad}{text}{pad}{fence}")


def csv_cell(value: Any) -> Any:
    """``value`` as a CSV cell no spreadsheet evaluates: a string starting like a formula gets a leading ``'``."""
    if isinstance(value, str) and value.startswith(FORMULA_LEADS):
        return "'" + value
    return value


def write_csv(frame: Any, path: Path | str) -> None:
    """Write a pandas ``frame`` to ``path`` as CSV (no index), every text cell and column name through ``csv_cell``."""
    frame = frame.rename(columns=lambda c: csv_cell(str(c)))
    for column in frame.columns:
        if frame[column].dtype == object or str(frame[column].dtype) in ("string", "str"):
            frame[column] = frame[column].map(csv_cell)
    frame.to_csv(path, index=False)


def write_csv_rows(path: Path | str, columns: list[str], rows: list[dict[str, Any]], text_columns: set[str]) -> None:
    """Write ``rows`` (dicts keyed by ``columns``) to ``path`` as CSV, replacing it atomically. Cells of
    ``text_columns`` and the column names go through ``csv_cell``; the others are written as given, so numbers already
    formatted as text (``-0.5``, as timm's results files write them) stay numbers."""
    import csv

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow([csv_cell(str(c)) for c in columns])
        for row in rows:
            writer.writerow([csv_cell(row.get(c)) if c in text_columns else row.get(c) for c in columns])
    tmp.replace(path)


def html_environment(loader: Any, **filters: Any) -> Any:
    """The Jinja2 environment of every HTML page: ``loader`` (a ``jinja2`` loader) finds the templates, ``filters``
    are added to the environment's. Autoescape on, undefined values an error, trailing newlines kept."""
    import jinja2

    env = jinja2.Environment(
        loader=loader,
        autoescape=True,  # HTML throughout: every {{ value }} is escaped; no template uses |safe
        undefined=jinja2.StrictUndefined,  # a missing value is an error, not an empty cell
        keep_trailing_newline=True,
    )
    env.filters.update(filters)
    return env
