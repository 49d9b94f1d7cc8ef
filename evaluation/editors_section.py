"""The card's ``## Editors compared`` section: the cross-editor table of ``lance-cf compare-editors`` and its plot
(evaluation's section of the card, as the leaderboard's is ``evaluation.leaderboard.leaderboard_section``; text from
data through the card's escaper, ``md_escape`` and ``code_span``, which ``dataset_cards.markdown`` re-exports).

``lance-cf compare-editors --release A --release B ... --output CMP`` writes ``CMP/fidelity.json`` (the table, the
releases compared, the shared source images, the models whose results gave the accuracy columns). ``lance-cf
add-comparison RELEASE CMP --output NEW`` (``builder.review.comparison``) records it in the manifest of the release's next
version (:data:`COMPARISON_RECORD`); from there every render of the card (``dataset_cards.card``), the build's and publish's, writes the section
and the plot (``assets/editors-compared.png``, hashed in the manifest like the gallery, uploaded with the card and
linked by that relative path, which the Hub resolves inside the repository). ``lance-cf publish-comparison`` refreshes
the section of a published repo's card instead (``evaluation.publish_comparison``, :func:`replace_editors_section`).

The table's Markdown is ``evaluation.fidelity.table_markdown``'s (text cells through the card's escaper), the column
glossary ``evaluation.fidelity.COLUMN_NOTE`` and the plot ``evaluation.fidelity.plot_fidelity``: one owner each, shared
with ``fidelity.md`` and ``fidelity.png``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from builder import release_format as rf
from builder.release_format.text_out import code_span, md_escape
from evaluation.fidelity import COLUMN_NOTE, plot_fidelity, table_markdown
from evaluation.leaderboard import LEADERBOARD_ANCHOR, replace_card_section

COMPARISON_RECORD = rf.EDITOR_COMPARISON  # the manifest's record of a comparison (builder.review.comparison)
EDITORS_HEADING = "## Editors compared\n"
PLOT_PATH = rf.COMPARISON_PLOT


def comparison_of(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest's editor comparison record, or None (the release carries none)."""
    record = manifest.get(COMPARISON_RECORD)
    return record if isinstance(record, dict) and isinstance(record.get("table"), list) else None


def write_comparison_plot(output_dir: Path, manifest: dict[str, Any]) -> list[dict[str, str]]:
    """Write the comparison's plot under ``output_dir`` (``PLOT_PATH``) and return its asset entry; ``[]`` (and no
    file) for a release without a comparison. The bytes depend only on the recorded table, so the builder records
    their hash in the manifest and a re-render (publish) writes the same file."""
    path = Path(output_dir) / PLOT_PATH
    record = comparison_of(manifest)
    if record is None or not record["table"]:
        path.unlink(missing_ok=True)
        return []
    path.parent.mkdir(parents=True, exist_ok=True)
    plot_fidelity(record["table"], path)
    return [{"path": PLOT_PATH}]


def _is_this_release(entry: dict[str, Any], manifest: dict[str, Any]) -> bool:
    """A compared release with this release's name and config hash (a version that carries it holds its shards)."""
    return entry.get("name") == manifest.get("name") and entry.get("config_hash") == manifest.get("config_hash")


def editors_section(manifest: dict[str, Any], plot: str | None = PLOT_PATH) -> str:
    """The card's ``## Editors compared`` section (heading, what was compared, table, plot, trailing blank line), or
    ``""`` for a release whose manifest records no comparison.

    Args:
        manifest: The release's manifest (its :data:`COMPARISON_RECORD`).
        plot: The plot's path relative to the card (None: no image line).
    """
    record = comparison_of(manifest)
    if record is None:
        return ""
    table = record["table"]
    releases = [r for r in record.get("releases") or [] if isinstance(r, dict)]
    editors: dict[str, list[str]] = {}
    for row in table:
        names = editors.setdefault(str(row.get("release")), [])
        if row.get("editor") not in names:
            names.append(row.get("editor"))
    lines = [
        EDITORS_HEADING,
        f"`lance-cf compare-editors` compared {len(releases)} releases built from the same source images, one editor "
        "each:\n",
        "| release | version | config hash | editor | counterfactuals (source images) |",
        "|---|---|---|---|---|",
    ]
    for entry in releases:
        label = str(entry.get("label") or entry.get("name"))
        name = md_escape(entry.get("name")) + (" (this release's samples)" if _is_this_release(entry, manifest) else "")
        lines.append(
            f"| {name} | {code_span(entry.get('version'))} | {code_span(entry.get('config_hash'))} | "
            f"{', '.join(code_span(e) for e in editors.get(label, [])) or '—'} | "
            f"{md_escape(entry.get('counterfactuals', '—'))} ({md_escape(entry.get('sources', '—'))}) |"
        )
    models = [str(m) for m in record.get("models") or []]
    clip = record.get("clip") or {}
    lines += [
        "",
        f"{md_escape(record.get('shared_sources', 0))} source images have counterfactuals in every release; each "
        "release's rows are over all of its own counterfactuals (the edits its gates kept). "
        + (
            f"The accuracy drop is that of the model set {', '.join(code_span(m) for m in models)}, scored by "
            "`lance-cf eval` on each release (a release without results of a model has no row for it). "
            if models
            else "No model's results were given: the accuracy columns are empty. "
        )
        + "The costs are what each release's edit stage counted by forward hooks at build time (network "
        "forward-equivalents and FLOPs, per kept edit), not estimates. "
        + (
            f"CLIP image similarity: {code_span(clip.get('model'))} ({md_escape(clip.get('pretrained') or 'local')})."
            if clip
            else "The CLIP image similarity was not measured (`--no-clip`)."
        ),
        "",
        f"Columns: {md_escape(COLUMN_NOTE)}",
        "",
        table_markdown(table, escaped=True).rstrip("\n"),
        "",
    ]
    if plot:
        lines += [f"![Editors compared: per edit type and editor]({plot})", ""]
    return "\n".join(lines) + "\n"


def replace_editors_section(card_text: str, manifest: dict[str, Any], plot: str | None = PLOT_PATH) -> str:
    """Refresh the ``## Editors compared`` section of an already rendered card (no shards needed), keeping everything
    else: the section is put where the card template puts it, before ``## How it was built``."""
    return replace_card_section(card_text, EDITORS_HEADING, editors_section(manifest, plot), LEADERBOARD_ANCHOR)
