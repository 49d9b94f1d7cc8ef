"""The HTML pages of evaluation (a model's report, the leaderboard, the editors' side by side), rendered from the
Jinja2 templates in ``evaluation/templates/`` with autoescape on: every value from data (class names, captions, model
names, error messages) is escaped by the template engine, never by hand.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).with_name("templates")


@cache
def _environment() -> Any:
    import jinja2

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        autoescape=True,  # HTML throughout: every {{ value }} is escaped unless a template says otherwise
        undefined=jinja2.StrictUndefined,  # a missing value is an error, not an empty cell
        keep_trailing_newline=True,
    )


def render_page(template: str, **context: Any) -> str:
    """The page ``templates/<template>`` rendered with ``context``."""
    return _environment().get_template(template).render(**context)
