"""Eval's second view: every metric again on the samples the label-kept judge keeps, beside the full view.

On a release whose counterfactuals carry a deterministic stand-in judge's scores (tests/judge_fixture.py), the
``judge_kept`` section must equal the full computation run on the rows kept by hand (originals and other unjudged
configs whole; judged samples with ``judge_class_p >= threshold``), at the release's calibrated threshold, or at 0.5
marked uncalibrated; a release without judge scores has no such section. One run of ``lance-cf eval`` (a tiny random
timm model) checks that the section reaches results.json and the report.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from judge_fixture import review, write_judged_release
from release_fixture import write_release

from builder import release_format as rf
from builder.review.calibrate import RECORD, calibrate_release
from builder.review.calibration import JUDGE_CLASS_FIELD, UNCALIBRATED_THRESHOLD
from builder.review.study import QUESTIONS, Study
from dataset_cards import judge_section
from evaluation import judge_kept
from evaluation.metrics import compute_metrics
from evaluation.results import validate_results
from lance_pipeline.screening import judge


def _unit(*parts) -> float:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "big") / 2**64


def prediction_rows(release) -> list[dict]:
    """Planted predictions of every sample, as ``predict_release`` writes rows (top-1 right 70% of the time)."""
    manifest = rf.load_manifest(release)
    rows = []
    for shard in manifest.shards:
        for key, members in rf.iter_shard(release / shard.path, wanted={"json"}):
            meta = json.loads(members["json"])
            right = _unit("right", key) < 0.7
            label = meta["label"]
            top = [label, label + 1, label + 2, label + 3, label + 4] if right else [label + 1, label, 0, 2, 3]
            rows.append({
                "config": shard.config, "key": key, "source_key": meta["source_key"], "label": label,
                "label_name": meta["label_name"], "edit_type": meta["edit_type"], "caption": meta["caption"],
                "edited_caption": meta["edited_caption"], "original_span": meta["original_span"],
                "edited_span": meta["edited_span"], "p_gt": round(_unit("p", key), 4), "correct1": right,
                "correct5": True, "top5": top, "top5_prob": [0.5, 0.2, 0.1, 0.1, 0.1], "strength": None,
                "counterfactual_key": None, "judge_class_p": meta.get(JUDGE_CLASS_FIELD),
            })  # fmt: skip
    return rows


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("judged-eval")
    judged = write_judged_release(tmp / "rel", tmp)
    reviewed = tmp / "reviewed"
    shutil.copytree(judged, reviewed)
    study = Study(name="calib", questions=(QUESTIONS["still_class"],), seed=1)
    review(reviewed, study)
    calibrated = tmp / "calibrated"
    calibrate_release(reviewed, calibrated, study_name="calib", folds=3, resamples=100)
    plain = write_release(tmp / "plain", originals_per_class=1, edits_per_original=2)
    return {"judged": judged, "calibrated": calibrated, "plain": plain}


def _metrics(rows, manifest, label_names):
    return compute_metrics(rows, label_names, n_boot=50, seed=3, metrics=None, manifest=manifest)


@pytest.mark.parametrize("which", ["judged", "calibrated"])
def test_the_judge_kept_view_equals_the_metrics_of_the_rows_kept_by_hand(releases, which):
    release = releases[which]
    manifest = json.loads((release / rf.MANIFEST_NAME).read_text())
    names = manifest["label_space"]["names"]
    rows = prediction_rows(release)
    results = _metrics(rows, manifest, names)
    view = results["judge_kept"]
    calibration = manifest.get(RECORD)
    threshold = calibration["threshold"] if calibration else UNCALIBRATED_THRESHOLD
    assert (view["threshold"], view["calibrated"]) == (threshold, calibration is not None)
    assert view["configs"] == ["counterfactual"] and view["field"] == JUDGE_CLASS_FIELD
    by_hand = [
        r for r in rows
        if r["config"] != "counterfactual" or (r["judge_class_p"] is not None and r["judge_class_p"] >= threshold)
    ]  # fmt: skip
    counterfactuals = [r for r in rows if r["config"] == "counterfactual"]
    kept = sum(r in by_hand for r in counterfactuals)
    unscored = sum(r["judge_class_p"] is None for r in counterfactuals)
    assert view["counts"] == {"counterfactual": {"kept": kept, "below": len(counterfactuals) - kept - unscored,
                                                 "unscored": unscored}}  # fmt: skip
    assert 0 < kept < len(counterfactuals) and unscored > 0
    alone = _metrics(by_hand, None, names)  # the same computation on the kept rows alone, no judge involved
    for section in ("metrics", "sensitivity", "sensitivity_by_config"):
        assert view[section] == alone[section], section
    assert results["metrics"]["counterfactual"]["n"] == len(counterfactuals)  # the full view is untouched
    assert view["metrics"]["counterfactual"]["n"] == kept
    full = {**results, "schema": "lance-cf/eval-results", "schema_version": 3, "status": "ok", "error": None}
    full |= {"model": {"name": "m"}, "release": {"name": "r", "version": "1", "manifest_sha256": "x"}}
    full |= {"tool": {"version": "0"}, "options": {}, "limit": None}
    validate_results(full)
    bad = json.loads(json.dumps(full))
    bad["judge_kept"]["threshold"] = 2
    with pytest.raises(ValueError, match="judge_kept.threshold"):
        validate_results(bad)


def test_a_release_without_judge_scores_has_no_judge_kept_view(releases):
    release = releases["plain"]
    manifest = json.loads((release / rf.MANIFEST_NAME).read_text())
    results = _metrics(prediction_rows(release), manifest, manifest["label_space"]["names"])
    assert "judge_kept" not in results
    # the names the view reads are the ones the judge stage and calibrate write
    assert judge_kept.FIELD == JUDGE_CLASS_FIELD == judge_section.JUDGE_CLASS_FIELD == judge.JUDGE_CLASS_FIELD.name
    assert judge_kept.RECORD == RECORD == judge_section.RECORD
    assert judge_kept.UNCALIBRATED_THRESHOLD == UNCALIBRATED_THRESHOLD


@pytest.mark.slow
def test_lance_cf_eval_writes_the_view_into_results_and_the_report(releases, tmp_path, cli):
    out = tmp_path / "eval"
    argv = ["eval", "--release", str(releases["calibrated"]), "--output", str(out), "--no-pretrained"]
    argv += ["--workers", "0", "--bootstrap", "50", "--no-insights", "--model", "test_vit"]
    args = cli.parse(argv)
    assert args.func(args) == 0
    (results_path,) = out.rglob("results.json")
    results = json.loads(results_path.read_text())
    validate_results(results)
    threshold = json.loads((releases["calibrated"] / rf.MANIFEST_NAME).read_text())[RECORD]["threshold"]
    view = results["judge_kept"]
    assert view["threshold"] == threshold and view["calibrated"] is True
    assert view["metrics"]["counterfactual"]["n"] == view["counts"]["counterfactual"]["kept"]
    report = (results_path.parent / "report.html").read_text()
    assert "Judge-kept samples" in report and f"at least {threshold}" in report
