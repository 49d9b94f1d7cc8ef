"""The card's "Human review" section: what reviewers decided and how much they agreed (``lance-cf review apply``).

Read from the manifest's ``review`` record only; empty for a release that was not reviewed.
"""

from __future__ import annotations

from typing import Any

from dataset_cards.markdown import code_span, md_escape


def _kappa(value: Any) -> str:
    """A statistic with three decimals; anything but a number (a tampered manifest's) is shown escaped."""
    if value is None:
        return "—"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return md_escape(value)
    return f"{value:.3f}"


def review_section(manifest: dict[str, Any]) -> str:
    review = manifest.get("review")
    if not review:
        return ""
    study = review.get("study") or {}
    verdicts = review.get("verdicts") or {}
    counts = manifest.get("counts") or {}
    configs = ", ".join(code_span(c) for c in review.get("configs") or [])
    selection = (
        f"{md_escape(study['per_group'])} per {md_escape(str(study.get('group_by')))}"
        if study.get("per_group")
        else "every sample"
    )
    settings = [selection, "blind" if study.get("blind") else "not blind"]
    settings.append("an order of their own per reviewer" if study.get("shuffle") else "one order")
    settings.append("originals shown" if study.get("show_original", True) else "originals hidden")
    questions = "; ".join(
        f"“{md_escape(str(q.get('text')).replace('{class}', '<class>').replace('{edit}', '<edit>'))}” "
        f"({', '.join(md_escape(a) for a in q.get('answers') or [])})"
        for q in study.get("questions") or []
        if isinstance(q, dict)
    )
    previous = review.get("previous") or {}
    lines = [
        "## Human review",
        "",
        f"{md_escape(review.get('raters', 0))} reviewer(s) judged samples of {configs} with `lance-cf review` (study "
        f"{md_escape(study.get('name', ''))}: {', '.join(settings)}; seed {md_escape(study.get('seed', 0))}) in "
        f"v{md_escape(str(previous.get('version', '?')))}; this version adds their judgements. Each sample of the "
        "reviewed configs carries `review_verdict` (a strict majority of its reviewers accepts or rejects; anything "
        "else is `flagged`), `review_reasons`, `review_answers`, `review_raters` and `review_agreement`.",
        "",
    ]
    if questions:
        lines += [f"Questions: {questions}.", ""]
    lines += ["| verdict | samples |", "|---|---|"]
    lines += [f"| {v} | {md_escape(verdicts.get(v, 0))} |" for v in ("accepted", "rejected", "flagged", "unreviewed")]
    lines.append("")
    added = review.get("added_configs") or []
    if added:
        shown = ", ".join(f"{code_span(c)} ({md_escape(counts.get(c, {}).get('total', 0))})" for c in added)
        lines += [f"Configs {shown} gather the accepted and the rejected samples; nothing was removed.", ""]
    reasons = review.get("reasons") or {}
    if reasons:
        lines += ["| a reviewer's reason for rejecting | samples |", "|---|---|"]
        lines += [f"| {md_escape(r)} | {md_escape(n)} |" for r, n in reasons.items()]
        lines.append("")
    stats = review.get("agreement") or {}
    if stats:
        lines += [
            "Agreement (Fleiss' κ over the samples every rater of the question judged; Cohen's κ with two raters):",
            "",
            "| question | raters | samples | Fleiss' κ | Cohen's κ | observed agreement |",
            "|---|---|---|---|---|---|",
        ]
        for question, entry in stats.items():
            observed = entry.get("observed_agreement")
            lines.append(
                f"| {md_escape(question)} | {md_escape(entry.get('raters', 0))} | {md_escape(entry.get('items', 0))} | "
                f"{_kappa(entry.get('fleiss_kappa'))} | {_kappa(entry.get('cohen_kappa'))} | {_kappa(observed)} |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"
