"""The card's "Label-kept judge" section: how many counterfactuals the judge says still show their class, and how far
to trust it (``lance-cf review calibrate``).

Read from the manifest only: its declaration (does any config carry ``judge_class_p``?) and its ``judge_calibration``
record, whose figures ``calibrate`` computed from the release's own samples and judgements. A release without judge
scores gets no section; one with scores but no calibration says "not calibrated" and states no share.
"""

from __future__ import annotations

from typing import Any

from builder import release_format as rf
from dataset_cards.markdown import code_span, md_escape
from dataset_cards.screening_section import judge_removed
from evaluation.judge_kept import RECORD

QUESTION = md_escape("“Does this image show a <class>?”")
STILL_CLASS = md_escape("“Is it still a <class>?”")
JUDGE_CLASS_FIELD = rf.JUDGE_CLASS_FIELD


def _number(value: Any, digits: int = 2, scale: float = 1.0) -> str:
    """A figure with ``digits`` decimals; anything but a number (a tampered manifest's) is shown escaped."""
    if value is None:
        return "—"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return md_escape(value)
    return f"{value * scale:.{digits}f}"


def _interval(interval: Any, digits: int = 2, scale: float = 1.0) -> str:
    if not isinstance(interval, list) or len(interval) != 2:
        return "no interval"
    return f"{_number(interval[0], digits, scale)}–{_number(interval[1], digits, scale)}"


def has_judge_scores(manifest: dict[str, Any]) -> bool:
    """Whether any config of the release declares the judge's class score (releases before v2 declare none)."""
    if not isinstance(manifest.get("release_spec"), dict):
        return False
    spec = rf.ReleaseSpec.from_dict(manifest["release_spec"])
    return any(c.field(JUDGE_CLASS_FIELD) is not None for c in spec.configs)


def _removed_at_build(manifest: dict[str, Any]) -> str:
    """A sentence when the build's judge stages removed samples (``filter_below``): the share above is of the
    samples left, not of every counterfactual made."""
    removed = sum(judge_removed(manifest).values())
    if not removed:
        return ""
    return (
        f" The build itself had removed {md_escape(removed)} samples below its `filter_below` (see the judge under "
        "ethics and limitations), so the share above is of the samples it released."
    )


def judge_section(manifest: dict[str, Any]) -> str:
    if not has_judge_scores(manifest):
        return ""
    record = manifest.get(RECORD)
    lines = ["## Label-kept judge", ""]
    if not isinstance(record, dict):
        lines += [
            f"Every edited or generated image carries {code_span(JUDGE_CLASS_FIELD)}, a vision-language model's "
            f"P(yes) for {QUESTION}. **Not calibrated**: no human study of this release has "
            "measured the judge's agreement with people, so this card states no share of counterfactuals that keep "
            "their class. Review a study that asks `still_class` (`lance-cf review RELEASE --questions still_class "
            f"--group-by {JUDGE_CLASS_FIELD} --per-group 20 --blind`) and run `lance-cf review calibrate` "
            "(docs/review.md).",
            "",
        ]
        return "\n".join(lines) + "\n"
    kept = record.get("kept") or {}
    judge = record.get("judge_human") or {}
    people = record.get("human_human") or {}
    study = record.get("study") or {}
    confidence = _number(record.get("confidence"), 0, 100)
    blind = (
        "blind: the reviewers did not see the judge's score"
        if study.get("blind") is True
        else "not blind: the reviewers could see the judge's score"
    )
    judges = [j for j in (record.get("judge") or {}).values() if isinstance(j, dict)]
    named = ", ".join(
        code_span(f"{j.get('model')}" + (f"@{j['revision']}" if j.get("revision") else "")) for j in judges
    )
    judge_text = f"The judge ({named})" if named else "The judge"
    configs = ", ".join(code_span(c) for c in kept.get("configs") or [])
    people_text = (
        f"human-human κ = {_number(people.get('kappa'))} ({confidence}% CI {_interval(people.get('kappa_ci'))}) on "
        f"{md_escape(people.get('items', 0))} items rated by two or more reviewers"
        if people.get("kappa") is not None
        else "human-human κ not measured (no item was rated by two reviewers)"
    )
    lines += [
        f"**{_number(kept.get('share'), 1, 100)}% ({confidence}% CI {_interval(kept.get('share_ci'), 1, 100)}%) of "
        f"counterfactuals judged to keep their class; judge-human κ = {_number(judge.get('cv_kappa'))} "
        f"({confidence}% CI {_interval(judge.get('cv_kappa_ci'))}) on {md_escape(judge.get('items', 0))} items "
        f"against {people_text}.**",
        "",
        f"{judge_text} scores {code_span(JUDGE_CLASS_FIELD)} (its P(yes) for {QUESTION}) and keeps "
        f"a sample at {code_span(RECORD + '.threshold')} = {_number(record.get('threshold'), 4)}: "
        f"{md_escape(kept.get('kept', 0))} of the {md_escape(kept.get('scored', 0))} scored samples of {configs} "
        f"(Wilson interval; {md_escape(kept.get('unscored', 0))} not scored). The threshold maximises Cohen's κ "
        f"against the human answers to {STILL_CLASS} of study {md_escape(study.get('name', ''))} "
        f"(v{md_escape(str((record.get('previous') or {}).get('version', '?')))}"
        f"; {blind}); the κ above is "
        f"{md_escape(judge.get('folds', '?'))}-fold cross-validated (each fold decided with a threshold chosen on "
        f"the others), not in-sample. AUROC of the score = {_number(judge.get('auroc'))} ({confidence}% CI "
        f"{_interval(judge.get('auroc_ci'))}). Intervals are percentile bootstraps over items with "
        f"{md_escape(judge.get('resamples', '?'))} resamples. The calibration removes nothing: `lance-cf eval` "
        "reports every metric on the judge-kept samples beside all of them." + _removed_at_build(manifest),
        "",
    ]
    return "\n".join(lines) + "\n"
