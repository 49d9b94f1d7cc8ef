"""The label-kept judge against people, on releases whose counterfactuals carry planted judge scores.

The judge here is a deterministic stand-in: each counterfactual has a planted truth (does it still show its class?),
the stand-in's ``judge_class_p`` agrees with it with a planted rate, and two reviewers answer ``still_class`` from the
same truth with planted slips (and an "unsure" now and then). Every figure the product reports (kappa at a threshold,
AUROC, their bootstrap intervals, the human-human kappa, the cross-validated threshold and kappa, the kept share and
its Wilson interval) is checked against an independent computation: scikit-learn's ``cohen_kappa_score`` and
``roc_auc_score`` on the same arrays, a bootstrap and a cross-validation written out here, and the shards read back.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from judge_fixture import RATERS, planted_answer, review, write_judged_release
from release_fixture import write_release

from builder import release_format as rf
from builder.cli import main
from builder.release_format.verify import verify_release
from builder.review.index import ReleaseIndex
from builder.review.study import QUESTIONS, Study, select


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("judged")
    return write_judged_release(tmp / "rel", tmp)


@pytest.fixture(scope="module")
def reviewed(judged, tmp_path_factory):
    """A copy of the judged release with a study of every counterfactual, both reviewers answering."""
    copy = tmp_path_factory.mktemp("reviewed") / "rel"
    shutil.copytree(judged, copy)
    study = Study(name="calib", questions=(QUESTIONS["still_class"],), seed=7)
    return copy, study, review(copy, study)


# -- the independent computation --------------------------------------------------------------------------------------
def labels_by_hand(release: Path, items):
    """Human majority (ties and unsure dropped), judge score, and the rater pairs, from the planted answers."""
    index = ReleaseIndex(release)
    human, judge, kept, pairs, pair_items = [], [], [], [], []
    for config, key in sorted(items):
        answers = {r: planted_answer(r, key) for r in RATERS}
        given = {r: int(a == "yes") for r, a in answers.items() if a in ("yes", "no")}
        if len(given) == 2:
            pair_items.append(len(pair_items))
            pairs.append((len(pair_items) - 1, given["alice"], given["bob"]))
        if not given or sum(given.values()) * 2 == len(given):
            continue
        score = index.get(config, key).meta["judge_class_p"]
        if score is None:
            continue
        kept.append((config, key))
        human.append(int(sum(given.values()) * 2 > len(given)))
        judge.append(score)
    return kept, np.array(human), np.array(judge), pairs


def seed_by_hand(*parts) -> int:
    return int.from_bytes(hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).digest()[:8], "big")


def bootstrap_by_hand(statistic, n: int, resamples: int, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(resamples):
        idx = rng.integers(0, n, size=n)
        try:
            value = statistic(idx)
        except ValueError:  # roc_auc_score with one class
            continue
        if value is not None and not math.isnan(value):
            values.append(value)
    return list(np.percentile(values, [2.5, 97.5]))


def sk_kappa(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if len(set(a.tolist()) | set(b.tolist())) < 2:
        return None
    from sklearn.metrics import cohen_kappa_score

    return cohen_kappa_score(a, b)


# -- tests ------------------------------------------------------------------------------------------------------------
def test_a_study_stratified_by_judge_score_draws_per_bin_reproducibly(judged, tmp_path):
    index = ReleaseIndex(judged)
    study = Study(name="strat", group_by="judge_class_p", judge_bins=4, per_group=3, seed=2)
    items = select(study, index)
    assert items == select(Study.from_dict(study.to_dict()), index)  # stored and reloaded: the same draw

    def bin_of(key):
        score = index.get("counterfactual", key).meta["judge_class_p"]
        return "unscored" if score is None else str(min(int(score * 4), 3))

    chosen, available = {}, {}
    for key in index.keys("counterfactual"):
        available[bin_of(key)] = available.get(bin_of(key), 0) + 1
    for _, key in items:
        chosen[bin_of(key)] = chosen.get(bin_of(key), 0) + 1
    assert sorted(available) == ["0", "1", "2", "3", "unscored"]
    assert chosen == {b: min(3, n) for b, n in available.items()}  # 3 of every bin (all of a smaller one)
    assert select(Study(name="strat", group_by="judge_class_p", judge_bins=4, per_group=3, seed=3), index) != items
    # a copy elsewhere draws the same samples (the draw is keyed by names, not paths)
    moved = tmp_path / "elsewhere" / "x"
    shutil.copytree(judged, moved)
    assert select(study, ReleaseIndex(moved)) == items
    plain = write_release(tmp_path / "plain", originals_per_class=1, edits_per_original=2)
    with pytest.raises(ValueError, match="carry no judge score"):
        select(Study(name="s", group_by="judge_class_p", per_group=2), ReleaseIndex(plain))
    assert "judge_bins" not in Study(name="old").to_dict()  # a study stored before judge bins keeps its settings


@pytest.mark.slow
def test_agreement_reports_judge_and_human_kappas_that_equal_an_independent_computation(reviewed, capsys):
    from sklearn.metrics import cohen_kappa_score, roc_auc_score  # here, not at collection: only slow tests use it

    release, study, items = reviewed
    assert main(["review", "agreement", str(release), "--study-name", study.name, "--resamples", "200"]) == 0
    out = json.loads(capsys.readouterr().out)["judge"]
    kept, human, judge, pairs = labels_by_hand(release, items)
    assert out["threshold"] == 0.5 and out["threshold_calibrated"] is False
    decision = (judge >= 0.5).astype(int)
    jh = out["judge_human"]
    assert jh["items"] == len(kept) > 30 and 0 < human.sum() < len(human)
    assert jh["kappa"] == pytest.approx(cohen_kappa_score(decision, human), abs=1e-6)
    assert jh["auroc"] == pytest.approx(roc_auc_score(human, judge), abs=1e-6)
    seed = seed_by_hand(seed_by_hand(study.seed, study.name, "agreement"), "judge_human")
    kappa_ci = bootstrap_by_hand(lambda i: sk_kappa(decision[i], human[i]), len(kept), 200,
                                 seed_by_hand(seed, "kappa"))  # fmt: skip
    auroc_ci = bootstrap_by_hand(lambda i: roc_auc_score(human[i], judge[i]), len(kept), 200,
                                 seed_by_hand(seed, "auroc"))  # fmt: skip
    assert jh["kappa_ci"] == pytest.approx(kappa_ci, abs=1e-6) and jh["resamples"] == 200
    assert jh["auroc_ci"] == pytest.approx(auroc_ci, abs=1e-6)
    assert jh["kappa_ci"][0] < jh["kappa"] < jh["kappa_ci"][1]
    # human-human: Cohen's kappa of alice against bob on the items both answered yes or no
    hh = out["human_human"]
    a, b = np.array([p[1] for p in pairs]), np.array([p[2] for p in pairs])
    assert hh["items"] == hh["pairs"] == len(pairs) and hh["raters"] == 2
    assert hh["kappa"] == pytest.approx(cohen_kappa_score(a, b), abs=1e-6)
    hh_seed = seed_by_hand(seed_by_hand(study.seed, study.name, "agreement"), "human_human")
    assert hh["kappa_ci"] == pytest.approx(bootstrap_by_hand(lambda i: sk_kappa(a[i], b[i]), len(a), 200, hh_seed),
                                           abs=1e-6)  # fmt: skip
    # the judge against each single rater, on the items both raters answered and the judge scored
    index = ReleaseIndex(release)
    both = [(config, key) for config, key in sorted(items)
            if all(planted_answer(r, key) in ("yes", "no") for r in RATERS)
            and index.get(config, key).meta["judge_class_p"] is not None]  # fmt: skip
    rows = [[(int(index.get(c, k).meta["judge_class_p"] >= 0.5), int(planted_answer(r, k) == "yes")) for r in RATERS]
            for c, k in both]  # fmt: skip
    flat = np.array([x for row in rows for x in row])
    jr = out["judge_rater"]
    assert (jr["items"], jr["labels"]) == (len(both), 2 * len(both))
    assert jr["kappa"] == pytest.approx(cohen_kappa_score(flat[:, 0], flat[:, 1]), abs=1e-6)

    def pooled(idx):
        picked = np.array([x for i in idx for x in rows[i]])
        return sk_kappa(picked[:, 0], picked[:, 1])

    jr_seed = seed_by_hand(seed_by_hand(study.seed, study.name, "agreement"), "judge_rater")
    assert jr["kappa_ci"] == pytest.approx(bootstrap_by_hand(pooled, len(both), 200, jr_seed), abs=1e-6)
    assert main(["review", "agreement", str(release), "--study-name", study.name, "--threshold", "0.3",
                 "--resamples", "100"]) == 0  # fmt: skip
    at = json.loads(capsys.readouterr().out)["judge"]["judge_human"]
    assert at["kappa"] == pytest.approx(cohen_kappa_score((judge >= 0.3).astype(int), human), abs=1e-6)


def cv_by_hand(items, human, judge, folds: int, seed: int):
    """Stratified folds dealt by a hash of (seed, config, key); per fold the kappa-best score of the other folds."""
    fold = {}
    for label in (0, 1):
        members = sorted((i for i in range(len(items)) if human[i] == label),
                         key=lambda i: seed_by_hand(seed, "fold", *items[i]))  # fmt: skip
        for rank, i in enumerate(members):
            fold[i] = rank % folds

    def best(idx):
        scores = sorted(set(judge[idx].tolist()))
        kappas = [sk_kappa((judge[idx] >= t).astype(int), human[idx]) for t in scores]
        top = max(k for k in kappas if k is not None)
        return next(t for t, k in zip(scores, kappas, strict=True) if k is not None and k == pytest.approx(top))

    decision = np.zeros(len(items), dtype=int)
    thresholds = []
    for k in range(folds):
        train = np.array([fold[i] != k for i in range(len(items))])
        t = best(np.flatnonzero(train))
        thresholds.append(t)
        decision[~train] = (judge[~train] >= t).astype(int)
    return best(np.arange(len(items))), thresholds, decision


@pytest.mark.slow
def test_calibrate_writes_the_next_version_with_every_shard_byte_identical_and_figures_from_its_own_data(
    reviewed, tmp_path, capsys
):
    from sklearn.metrics import cohen_kappa_score

    release, study, items = reviewed
    out = tmp_path / "calibrated"
    code = main(["review", "calibrate", str(release), "--output", str(out), "--study-name", study.name,
                 "--folds", "4", "--resamples", "300"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert verify_release(out) == []
    before, after = rf.load_manifest(release), rf.load_manifest(out)
    assert after.version == "1.1.0" and after.configs == before.configs
    assert [s.to_dict() for s in after.shards] == [s.to_dict() for s in before.shards]
    for shard in before.shards:  # the judge never changes a shard byte of an existing config
        assert (out / shard.path).read_bytes() == (release / shard.path).read_bytes()

    record = after.extra["judge_calibration"]
    assert record["judge"] == {"judge": before.stages["judge"]}  # the judge whose threshold this is
    kept, human, judge, pairs = labels_by_hand(release, items)
    seed = seed_by_hand(study.seed, study.name, "calibrate")
    threshold, fold_thresholds, decision = cv_by_hand(kept, human, judge, 4, seed)
    jh = record["judge_human"]
    assert record["threshold"] == pytest.approx(threshold) and jh["fold_thresholds"] == pytest.approx(fold_thresholds)
    assert jh["cv_kappa"] == pytest.approx(cohen_kappa_score(decision, human), abs=1e-6)
    in_sample = cohen_kappa_score((judge >= threshold).astype(int), human)
    assert jh["cv_kappa"] <= in_sample + 1e-9  # the reported kappa is the held-out one
    assert jh["cv_kappa_ci"] == pytest.approx(
        bootstrap_by_hand(lambda i: sk_kappa(decision[i], human[i]), len(kept), 300, seed_by_hand(seed, "cv_kappa")),
        abs=1e-6,
    )
    a, b = np.array([p[1] for p in pairs]), np.array([p[2] for p in pairs])
    assert record["human_human"]["kappa"] == pytest.approx(cohen_kappa_score(a, b), abs=1e-6)

    # the kept share, counted from the new release's own shards, and its Wilson interval
    scores = [
        json.loads(m["json"])["judge_class_p"]
        for s in after.shards
        if s.config == "counterfactual"
        for _, m in rf.iter_shard(out / s.path)
    ]
    scored = [p for p in scores if p is not None]
    n_kept = sum(p >= threshold for p in scored)
    share = record["kept"]
    assert (share["scored"], share["kept"], share["unscored"]) == (len(scored), n_kept, len(scores) - len(scored))
    from statsmodels.stats.proportion import proportion_confint

    lo, hi = proportion_confint(n_kept, len(scored), alpha=0.05, method="wilson")
    assert share["share_ci"] == pytest.approx([lo, hi], abs=1e-6)

    card = (out / rf.CARD_NAME).read_text()
    sentence = (
        f"**{100 * n_kept / len(scored):.1f}% (95% CI {100 * lo:.1f}–{100 * hi:.1f}%) of counterfactuals judged to "
        f"keep their class; judge-human κ = {cohen_kappa_score(decision, human):.2f} "
        f"(95% CI {jh['cv_kappa_ci'][0]:.2f}–{jh['cv_kappa_ci'][1]:.2f}) on {len(kept)} items against human-human "
        f"κ = {cohen_kappa_score(a, b):.2f}"
    )
    assert sentence in card, card
    assert "Not calibrated" not in card and "not blind: the reviewers could see the judge's score" in card
    # the same judgements give the same bytes
    again = tmp_path / "again"
    assert main(["review", "calibrate", str(release), "--output", str(again), "--study-name", study.name,
                 "--folds", "4", "--resamples", "300"]) == 0  # fmt: skip
    assert (again / rf.MANIFEST_NAME).read_bytes() == (out / rf.MANIFEST_NAME).read_bytes()


@pytest.mark.slow
def test_a_release_without_a_study_says_not_calibrated_and_one_without_scores_says_nothing(judged, tmp_path, capsys):
    from dataset_cards.card import render_release_card

    card = render_release_card(judged, json.loads((judged / rf.MANIFEST_NAME).read_text()))
    section = card.split("## Label-kept judge", 1)[1].split("\n## ", 1)[0]
    assert "**Not calibrated**" in section and "%" not in section and "κ =" not in section
    plain = write_release(tmp_path / "plain", originals_per_class=1, edits_per_original=2)
    assert "Label-kept judge" not in render_release_card(plain, json.loads((plain / rf.MANIFEST_NAME).read_text()))
    # calibrate refuses what it cannot do, in one line
    copy = tmp_path / "copy"
    shutil.copytree(judged, copy)
    review(copy, Study(name="verdicts-only"))
    assert main(["review", "calibrate", str(copy), "--output", str(tmp_path / "o1"), "--study-name",
                 "verdicts-only"]) == 2  # fmt: skip
    assert "does not ask 'still_class'" in capsys.readouterr().err
    few = Study(name="few", questions=(QUESTIONS["still_class"],), per_group=1)
    review(copy, few)
    assert main(["review", "calibrate", str(copy), "--output", str(tmp_path / "o2"), "--study-name", "few"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "give fewer --folds" in err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_the_judge_section_of_a_tampered_record_carries_nothing_raw(judged):
    from test_text_paths import HOSTILE, _raw

    from dataset_cards.judge_section import judge_section

    manifest = json.loads((judged / rf.MANIFEST_NAME).read_text())
    manifest["judge_calibration"] = {
        "threshold": HOSTILE[0],
        "confidence": HOSTILE[1],
        "study": {"name": HOSTILE[2], "blind": HOSTILE[3]},
        "judge": {"judge": {"model": HOSTILE[3], "revision": HOSTILE[4]}},
        "previous": {"version": HOSTILE[5]},
        "judge_human": {
            "cv_kappa": HOSTILE[6],
            "cv_kappa_ci": [HOSTILE[0], 1],
            "folds": HOSTILE[1],
            "items": HOSTILE[2],
        },
        "human_human": {"kappa": HOSTILE[4], "kappa_ci": HOSTILE[5], "items": HOSTILE[3]},
        "kept": {"share": HOSTILE[0], "share_ci": [0.1, HOSTILE[6]], "configs": [HOSTILE[4]], "kept": HOSTILE[1]},
    }
    text = judge_section(manifest)
    assert "## Label-kept judge" in text and _raw(text) == [], _raw(text)
    assert "&lt;img src=x onerror=alert(1)&gt;" in text
    assert "not blind" in text  # a blind flag that is not true is not taken as blind


def test_the_judge_section_says_what_the_build_removed_before_the_share(judged):
    """With filter_below, the build's judge removed samples before any study: the kept share is of those released,
    and the section says so with the manifest's own count; without removals it says nothing of the kind."""
    from dataset_cards.judge_section import judge_section

    manifest = json.loads((judged / rf.MANIFEST_NAME).read_text())
    manifest["judge_calibration"] = {
        "threshold": 0.5,
        "confidence": 95,
        "study": {"name": "s", "blind": True},
        "judge_human": {"cv_kappa": 0.5, "cv_kappa_ci": [0.2, 0.7], "folds": 4, "items": 30},
        "human_human": {"kappa": 0.6, "kappa_ci": [0.3, 0.8], "items": 10},
        "kept": {"share": 0.8, "share_ci": [0.7, 0.9], "configs": ["counterfactual"], "kept": 8, "scored": 10},
    }
    assert "The calibration removes nothing" in judge_section(manifest)
    assert "The build itself had removed" not in judge_section(manifest)
    manifest["screening"] = {
        "judge": {"kind": "judge", "removed_by_config": {"counterfactual": 3}},
        "judge_lance_r": {"kind": "judge", "removed_by_config": {"lance_r": 2}},
        "safety": {"kind": "safety", "removed_by_config": {"counterfactual": 7}},  # not the judge's
    }
    assert "The build itself had removed 5 samples below its `filter_below`" in judge_section(manifest)
