"""``lance-cf review calibrate RELEASE --output NEW``: the next version of a release, with its judge calibrated.

The judge stage scores each counterfactual with ``judge_class_p``; a review study that asked ``still_class`` gives the
human labels. Calibration (``builder.review.calibration``) picks the judge's threshold on those labels with stratified,
seeded cross-validation and measures its agreement with people beside the people's agreement with each other. The new
release (version ``MAJOR.(MINOR+1).0``, or ``--version``) holds every shard of the old one copied byte for byte (the
manifest lists the very same shard records), and the manifest's ``judge_calibration`` holds the threshold, the
cross-validated kappa, the AUROC, the human-human kappa (each with its bootstrap interval and the number of resamples),
and the share of the release's scored counterfactuals the judge keeps at the threshold, counted from the release's own
samples; the card states it. Nothing is filtered: eval reports the judge-kept subset beside the full one.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from builder import release_format as rf
from builder.review.apply import check_new_output, choose_study, next_version, reseal_next_version
from builder.review.calibration import (
    CONFIDENCE,
    DEFAULT_FOLDS,
    DEFAULT_RESAMPLES,
    JUDGE_CLASS_FIELD,
    QUESTION,
    calibrate_threshold,
    has_judge_scores,
    human_human,
    kept_share,
    labelled_items,
    seed_of,
)
from builder.review.index import ReleaseIndex
from builder.review.store import JudgementStore
from builder.review.study import default_configs, select

logger = logging.getLogger(__name__)

RECORD = "judge_calibration"  # the manifest's record of a calibration (read by the card and by eval)


def judge_stages(manifest: dict[str, Any]) -> dict[str, Any]:
    """The judge stages' records in the manifest's ``stages`` (``role: judge``: model, revision, questions), by
    stage name: the judge whose threshold this is."""
    stages = manifest.get("stages") or {}
    return {
        name: entry
        for name, entry in sorted(stages.items())
        if isinstance(entry, dict) and entry.get("role") == "judge"
    }


def judged_configs(index: ReleaseIndex) -> list[str]:
    """The configs whose share the card states: the kind's counterfactual configs that declare the judge's score."""
    spec = index.manifest.release_spec
    return [c for c in default_configs(index) if has_judge_scores(spec, [c])]


def calibrate_release(
    release: Path,
    output: Path,
    *,
    study_name: str | None = None,
    version: str | None = None,
    folds: int = DEFAULT_FOLDS,
    resamples: int = DEFAULT_RESAMPLES,
) -> dict[str, Any]:
    """Write the calibrated release to ``output`` (new or empty); return its manifest."""
    release, output = Path(release), Path(output)
    check_new_output(release, output)
    if resamples < 100:
        raise ValueError(f"--resamples {resamples}: a 95% bootstrap interval needs at least 100 resamples")
    index = ReleaseIndex(release)
    old = index.manifest
    if not has_judge_scores(old.release_spec):
        raise ValueError(f"{release} carries no judge score ({JUDGE_CLASS_FIELD}): run the judge stage first")
    store = JudgementStore(release, index.manifest_sha)
    study = choose_study(store, study_name)
    if QUESTION not in [q.id for q in study.questions]:
        raise ValueError(
            f"study {study.name!r} does not ask {QUESTION!r}: calibrate on a study with --questions {QUESTION} "
            f"(e.g. --group-by {JUDGE_CLASS_FIELD} --per-group 20 --blind)"
        )
    version = version or next_version(old.version)
    rf.parse_release_version(version)

    # 1. The figures, from the study's judgements and the release's own samples.
    items = select(study, index)
    labelled = labelled_items(index, store.latest(study), items)
    seed = seed_of(study.seed, study.name, "calibrate")
    calibration = calibrate_threshold(labelled, folds, resamples, seed)
    people = human_human(labelled, resamples, seed_of(seed, "human_human"))
    kept = kept_share(index, judged_configs(index), calibration["threshold"])

    # 2. Every shard, byte for byte, and the old manifest with the new version and the calibration.
    record = {
        "field": JUDGE_CLASS_FIELD,
        "question": QUESTION,
        "study": study.to_dict(),
        "judge": judge_stages(old.raw or old.to_dict()),
        "previous": {"name": old.name, "version": old.version, "manifest_sha256": old.manifest_sha256},
        "confidence": CONFIDENCE,
        "threshold": calibration["threshold"],
        "judge_human": calibration,
        "human_human": people,
        "left_out": labelled.left_out,
        "kept": kept,
    }
    manifest = reseal_next_version(release, output, index, {RECORD: record}, version)
    logger.info(
        "judge calibrated: %s %s -> %s (threshold %s, cross-validated kappa %s)",
        old.name, old.version, version, calibration["threshold"], calibration["cv_kappa"],
    )  # fmt: skip
    return manifest
