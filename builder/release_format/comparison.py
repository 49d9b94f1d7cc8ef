"""The record of an editor comparison, as a release's manifest holds it (``editor_comparison``) and as ``lance-cf
compare-editors`` writes it (``fidelity.json``, ``evaluation.fidelity.side_by_side``): read and checked here for the
two commands that put it on a card (``add-comparison``, a release's next version; ``publish-comparison``, a published
repo's card)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lance_pipeline.readers import read_json

COMPARISON_FILE = "fidelity.json"  # what compare-editors writes (evaluation.fidelity.side_by_side)
RECORDED_KEYS = ("releases", "models", "shared_sources", "sources_with_counterfactuals", "clip", "masks", "table")
RELEASE_KEYS = ("name", "version", "config_hash", "manifest_sha256", "counterfactuals", "sources")


def read_comparison(comparison: Path) -> dict[str, Any]:
    """The comparison of ``compare-editors``' output folder (or its ``fidelity.json``), checked: every key the card
    states is there. Raises ValueError (one line) naming the file and what to do."""
    path = Path(comparison)
    path = path / COMPARISON_FILE if path.is_dir() else path
    if not path.is_file():
        raise ValueError(
            f"{comparison}: no {COMPARISON_FILE}; give the --output folder of `lance-cf compare-editors` (or its "
            f"{COMPARISON_FILE})"
        )
    data = read_json(path, what=str(path))
    rerun = "run `lance-cf compare-editors` again with this version of lance-cf"
    if not isinstance(data, dict) or any(key not in data for key in RECORDED_KEYS):
        missing = [k for k in RECORDED_KEYS if not isinstance(data, dict) or k not in data]
        raise ValueError(f"{path}: not a compare-editors comparison (no {', '.join(missing)}); {rerun}")
    if not isinstance(data["table"], list) or not data["table"]:
        raise ValueError(f"{path}: its table is empty; {rerun}")
    for entry in data["releases"] if isinstance(data["releases"], list) else [None]:
        if not isinstance(entry, dict) or any(key not in entry for key in RELEASE_KEYS):
            raise ValueError(f"{path}: a release entry lacks {', '.join(RELEASE_KEYS)}; {rerun}")
    return {key: data[key] for key in RECORDED_KEYS}
