"""The card's leaderboard table, rendered from evaluation results JSONs.

One function (``leaderboard_section``) puts it into the card; it moves to evaluation's leaderboard once that exposes
its renderer (issue 9 §5: one leaderboard, owned by evaluation).
"""

from __future__ import annotations

from typing import Any

from builder import release_format as rf


def _metric(value: Any, *names: str) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, dict):
        for name in names:
            if isinstance(value.get(name), (int, float)):
                return float(value[name])
    return None


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _leaderboard_configs(results: list[dict]) -> list[str]:
    present = {c for r in results if isinstance(r.get("metrics"), dict) for c in r["metrics"]}
    return [c for c in rf.CONFIG_NAMES if c in present] + sorted(present - set(rf.CONFIG_NAMES))


def model_name(result: dict[str, Any]) -> str:
    """The model's name in a results JSON (``lance-cf eval`` writes ``model: {name, slug, ...}``; a string is accepted)."""
    model = result.get("model")
    if isinstance(model, dict):
        return str(model.get("name") or model.get("slug") or "?")
    return str(model or "?")


def weights_label(result: dict[str, Any]) -> str | None:
    """How a results JSON's weights differ from the model's pretrained ones (``None`` for pretrained or unknown).

    The same architecture evaluated with random weights or a local checkpoint must not read as the pretrained model.
    """
    model = result.get("model")
    weights = model.get("weights") if isinstance(model, dict) else None
    weights_id = str(weights.get("id") or "") if isinstance(weights, dict) else ""
    if weights_id == "random" or weights_id.startswith("random:"):
        return "random weights"
    if weights_id.startswith("checkpoint:"):
        return f"checkpoint {weights_id.rsplit(':', 1)[-1][:12]}"
    return None


def leaderboard_rows(results: list[dict]) -> list[dict[str, Any]]:
    """One row per results JSON with metrics (failed runs are left out), best counterfactual top-1 first."""
    results = [r for r in results if isinstance(r.get("metrics"), dict) and r.get("status", "ok") != "error"]
    configs = _leaderboard_configs(results)
    rows = []
    for result in results:
        metrics = result["metrics"]
        delta_source = metrics.get("counterfactual") or next(
            (m for m in metrics.values() if isinstance(m, dict) and "delta_acc1" in m), {}
        )
        by_edit = (result.get("sensitivity") or {}).get("by_edit_type") or {}
        # The most sensitive edit type: the largest paired drop in top-1 accuracy.
        scored = {t: _metric(v, "paired_delta_acc1", "delta_acc1", "acc1") for t, v in by_edit.items()}
        scored = {t: v for t, v in scored.items() if v is not None}
        worst = min(scored, key=lambda t: scored[t]) if scored else None
        release = result.get("release") or {}
        weights = weights_label(result)
        rows.append(
            {
                "model": f"`{model_name(result)}`" + (f" ({weights})" if weights else ""),
                "release": f"v{release.get('version', '?')}",
                "acc1": [_fmt(_metric(metrics.get(c), "acc1")) for c in configs],
                "delta_acc1": _fmt(_metric(delta_source, "delta_acc1")),
                "delta_acc5": _fmt(_metric(delta_source, "delta_acc5")),
                "worst_edit": f"{worst} ({_fmt(scored[worst])})" if worst else "—",
                "_sort": _metric(metrics.get("counterfactual"), "acc1") or 0.0,
            }
        )
    rows.sort(key=lambda r: (-r["_sort"], r["model"]))
    return rows


def leaderboard_markdown(results: list[dict]) -> str:
    """The leaderboard table (Markdown) for evaluation results JSONs; empty string when there are none."""
    if not leaderboard_rows(results):
        return ""
    configs = _leaderboard_configs(results)
    header = ["model", "release", *(f"{c} acc@1" for c in configs), "Δ acc@1", "Δ acc@5", "most sensitive edit"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in leaderboard_rows(results):
        cells = [row["model"], row["release"], *row["acc1"], row["delta_acc1"], row["delta_acc5"], row["worst_edit"]]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Δ is counterfactual minus original accuracy; lower means more sensitive to the edits."]
    return "\n".join(lines) + "\n"


LEADERBOARD_HEADING = "## Leaderboard\n"
LEADERBOARD_ANCHOR = "## How it was built\n"


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
