"""The HTML pages of evaluation (a model's report, the leaderboard, the editors' side by side), rendered from the
Jinja2 templates in ``evaluation/templates/`` with autoescape on: every value from data (class names, captions, model
names, error messages) is escaped by the template engine, never by hand.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from builder.release_format.text_out import html_environment

TEMPLATES = Path(__file__).with_name("templates")


@cache
def _environment() -> Any:
    import jinja2

    return html_environment(jinja2.FileSystemLoader(str(TEMPLATES)))  # autoescaped (builder.release_format.text_out)


def render_page(template: str, **context: Any) -> str:
    """The page ``templates/<template>`` rendered with ``context``."""
    return _environment().get_template(template).render(**context)
