"""The card section that lists where a release departs from the papers of the modes that built it.

The rows come from the one table of deviations (``lance_pipeline.deviations``), chosen from the release's manifest, so
the card, docs/method.md and Croissant's limitations say the same. Empty for a release no mode's rows apply to.
"""

from __future__ import annotations

from typing import Any

from lance_pipeline.deviations import MODES, deviations_for, render_table


def deviations_section(manifest: dict[str, Any]) -> str:
    """``## Deviations from the papers`` with one table per mode, or ``""``."""
    rows = deviations_for(manifest)
    if not rows:
        return ""
    parts = [
        "## Deviations from the papers\n\n"
        "Where this release departs from the published method (the full table per mode, with the settings that are "
        "off here, is in the tool's `docs/method.md`):\n"
    ]
    for mode in MODES.values():
        mine = [d for d in rows if d.mode == mode.name]
        if mine:
            parts.append(f"**{mode.title}** ({mode.paper})\n\n{render_table(mine, with_applies=False)}")
    return "\n".join(parts) + "\n"
