"""Making text from data safe to put into a Markdown card (class names, captions, edit types, source names)."""

from __future__ import annotations

import re
from typing import Any

_LINE_BREAKS = re.compile(r"[\r\n\v\f\x1c-\x1e\x85\u2028\u2029]+")
_MD_SPECIAL = re.compile(r"([\\`*_\[\]|~#!])")  # mid-line, only these can start markup


def md_escape(text: Any) -> str:
    """Text from data made inert in Markdown and HTML, on one line.

    Line breaks become spaces (no heading, list or table row can be started), HTML's ``& < >`` become entities (no tag,
    no comment) and every Markdown punctuation character is backslash-escaped (no link, image, emphasis or table cell
    boundary). Text is always put mid-line, so line-start markers (`1.`, `-`, `+`) need no escape.
    """
    text = _LINE_BREAKS.sub(" ", str(text))
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MD_SPECIAL.sub(r"\\\1", text)


def code_span(text: Any) -> str:
    """``text`` as an inline code span that no backtick or line break in it can close or break."""
    text = _LINE_BREAKS.sub(" ", str(text))
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"
