"""The card's ``## Leaderboard`` section: evaluation's one leaderboard table, embedded, and refreshed in place.

The table itself is ``evaluation.leaderboard.leaderboard_markdown`` (evaluation owns results, their validation and the
leaderboard); the card only places it under its heading, or replaces it in an already rendered card.
"""

from __future__ import annotations

from evaluation.leaderboard import leaderboard_markdown as evaluation_leaderboard

LEADERBOARD_HEADING = "## Leaderboard\n"
LEADERBOARD_ANCHOR = "## How it was built\n"


def leaderboard_markdown(results: list[dict]) -> str:
    """Evaluation's ranked table for results JSONs of one release ("" when none succeeded)."""
    return evaluation_leaderboard(results) if results else ""


def leaderboard_section(results: list[dict]) -> str:
    """The card's ``## Leaderboard`` section (heading, table, trailing blank line), or ``""`` without results."""
    table = leaderboard_markdown(results)
    return f"{LEADERBOARD_HEADING}\n{table}\n" if table else ""


def replace_leaderboard_section(card_text: str, results: list[dict]) -> str:
    """Refresh the leaderboard of an already rendered card (no shards needed), keeping everything else."""
    section = leaderboard_section(results)
    start = card_text.find("\n" + LEADERBOARD_HEADING)
    if start >= 0:
        start += 1
        end = card_text.find("\n## ", start + len(LEADERBOARD_HEADING))
        end = len(card_text) if end < 0 else end + 1
        return card_text[:start] + section + card_text[end:]
    anchor = card_text.find("\n" + LEADERBOARD_ANCHOR)
    if anchor < 0:
        return card_text.rstrip("\n") + "\n\n" + section
    return card_text[: anchor + 1] + section + card_text[anchor + 1 :]
