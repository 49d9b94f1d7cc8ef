"""The judge-kept view: every metric again on the samples the label-kept judge says still show their class.

A release whose configs carry the judge stage's ``judge_class_p`` (its P(yes) for "Does this image show a {class}?")
gets a second view beside the full one in results.json, the section ``judge_kept``: the samples of the judged configs
whose score is at least the threshold, with every sample of the configs the judge does not score (the originals each
pair is measured against). The threshold is the release's calibrated one (``judge_calibration.threshold``, written by
``lance-cf review calibrate`` from a human study); a release that was never calibrated gets the view at 0.5 (the judge
says yes more likely than no), marked ``calibrated: false`` so that no one reads it as a measured cut. A judged sample
without a score is not kept (the judge did not say it keeps its class) and is counted. Nothing is removed from the
full view.
"""

from __future__ import annotations

from typing import Any

from builder import release_format as rf

SECTION = "judge_kept"  # the results JSON's section (evaluation.results declares it)
FIELD = rf.JUDGE_CLASS_FIELD  # the judge stage's class score, as the release format names it
RECORD = "judge_calibration"  # builder.review.calibrate.RECORD: the manifest's record of a calibration
UNCALIBRATED_THRESHOLD = 0.5  # builder.review.calibration.UNCALIBRATED_THRESHOLD (a test checks the two agree)


def judge_view(manifest: dict[str, Any] | None) -> dict[str, Any] | None:
    """Which configs the judge scores and at which threshold the view keeps their samples; None for a release whose
    configs carry no judge score (no view)."""
    if not manifest or not isinstance(manifest.get("release_spec"), dict):
        return None
    spec = rf.ReleaseSpec.from_dict(manifest["release_spec"])
    judged = [c.name for c in spec.configs if c.field(FIELD) is not None and c.name in (manifest.get("configs") or [])]
    if not judged:
        return None
    record = manifest.get(RECORD)
    threshold = record.get("threshold") if isinstance(record, dict) else None
    calibrated = isinstance(threshold, int | float) and not isinstance(threshold, bool) and 0.0 <= threshold <= 1.0
    return {
        "field": FIELD,
        "threshold": float(threshold) if calibrated else UNCALIBRATED_THRESHOLD,
        "calibrated": calibrated,
        "configs": judged,
    }


def kept_rows(rows: list[dict[str, Any]], view: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The prediction rows of the view, and per judged config how many were kept, left out and unscored."""
    judged = set(view["configs"])
    counts = {c: {"kept": 0, "below": 0, "unscored": 0} for c in view["configs"]}
    kept = []
    for row in rows:
        config = row["config"]
        if config not in judged:
            kept.append(row)
            continue
        score = row.get(FIELD)
        if score is None:
            counts[config]["unscored"] += 1
        elif score >= view["threshold"]:
            counts[config]["kept"] += 1
            kept.append(row)
        else:
            counts[config]["below"] += 1
    return kept, counts


def validate_judge_kept(section: Any) -> None:
    """Check a results JSON's ``judge_kept`` section; raise ``ValueError`` naming the first bad field."""
    if not isinstance(section, dict):
        raise ValueError(f"results JSON field '{SECTION}' must be an object")
    threshold = section.get("threshold")
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0.0 <= threshold <= 1.0:
        raise ValueError(f"results JSON field '{SECTION}.threshold' must be a number in [0, 1], got {threshold!r:.60}")
    if not isinstance(section.get("calibrated"), bool):
        raise ValueError(f"results JSON field '{SECTION}.calibrated' must be true or false")
    counts = section.get("counts")
    if not isinstance(counts, dict) or not all(
        isinstance(c, dict) and all(isinstance(c.get(k), int) and c[k] >= 0 for k in ("kept", "below", "unscored"))
        for c in counts.values()
    ):
        raise ValueError(f"results JSON field '{SECTION}.counts' must map configs to kept / below / unscored counts")
    metrics = section.get("metrics")
    if not isinstance(metrics, dict):
        raise ValueError(f"results JSON field '{SECTION}.metrics' must be an object")
    for config, entry in metrics.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("n"), int):
            raise ValueError(f"results JSON field '{SECTION}.metrics.{config}.n' must be an integer")
