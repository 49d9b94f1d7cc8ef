"""The card section that lists where a release departs from the papers of the modes that built it.

The rows come from the tables of deviations the release's kind lists (``lance_pipeline.deviations``,
``ReleaseKind.deviations``), chosen from the release's manifest, so the card, docs/method.md and Croissant's limitations
say the same. Empty for a release no row applies to.
"""

from __future__ import annotations

from typing import Any

from lance_pipeline.deviations import render_table, tables_for


def deviations_section(manifest: dict[str, Any]) -> str:
    """``## Deviations from the papers`` with one table per system, or ``""``."""
    tables = tables_for(manifest)
    if not tables:
        return ""
    parts = [
        "## Deviations from the papers\n\n"
        "Where this release departs from the published method (the full table per mode, with the settings that are "
        "off here, is in the tool's `docs/method.md`):\n"
    ]
    for table, rows in tables:
        parts.append(f"**{table.title}** ({table.paper})\n\n{render_table(rows, with_applies=False)}")
    return "\n".join(parts) + "\n"
