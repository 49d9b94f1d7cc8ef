"""The one path for text into a Markdown card: every value the card template prints is Markdown already.

Text from data (class names, captions, edit types, source names, study answers, release names) goes through
``md_escape`` (prose), ``code_span`` (inline code) or ``code_text`` (inside a code block or backticks the template
writes); each returns ``Markdown``, a string marked as safe to print. A section that composes escaped parts into
Markdown of its own marks its result with ``Markdown(...)``. The card template is rendered with ``card_value`` as its
``finalize``: a plain string reaching it is an error naming the value, so a new card value or section that skips the
escaper fails the first test that renders a card instead of putting raw data into README.md.
"""

from __future__ import annotations

import re
from typing import Any

from builder.release_format.text_out import LINE_BREAKS, Markdown, code_span, md_escape

__all__ = ["Markdown", "card_value", "code_span", "code_text", "markdown_template", "md_escape"]
_CODE_UNSAFE = re.compile(r"[`\"\\]")  # what could close a code span or a string literal in the card's snippets


def code_text(text: Any) -> Markdown:
    """``text`` for a place inside code the template writes (a fenced snippet, a string literal in it, backticks):
    on one line, with no backtick, double quote or backslash (each becomes ``'``, ``'`` and ``/``), so it can neither
    close the code nor the string around it. Release names, versions, config names and repository ids never hold
    them (they are checked when written); a tampered manifest's do not get out of the code."""
    text = LINE_BREAKS.sub(" ", str(text))
    return Markdown(_CODE_UNSAFE.sub(lambda m: "/" if m.group() == "\\" else "'", text))


def card_value(value: Any) -> Any:
    """The card template's ``finalize``: ``Markdown`` and numbers are printed, anything else is refused."""
    if isinstance(value, Markdown) or value is None:
        return value
    if isinstance(value, bool | int | float):
        return str(value)
    raise TypeError(
        f"card value {str(value)[:80]!r} is not Markdown: pass data through md_escape, code_span or code_text "
        "(dataset_cards.markdown), or mark a section composed of escaped parts with Markdown(...)"
    )


def markdown_template(source: str):
    """A Jinja2 template for Markdown whose every ``{{ value }}`` goes through ``card_value``."""
    import jinja2

    return jinja2.Environment(finalize=card_value).from_string(source)
