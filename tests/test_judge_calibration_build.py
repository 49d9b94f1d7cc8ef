"""The judge's calibration end to end on a release the engine built with the judge stage (a deterministic stand-in for
the VLM, tests/test_judge.py): the built card says "not calibrated"; two reviewers answer "still a <class>?"; review
agreement and review calibrate read the built release's own scores and stage record; the calibrated release verifies,
keeps every shard byte for byte and states the share the judge keeps, counted here from its shards; eval reports the
judge-kept view for both judged configs (counterfactual and LANCE-R)."""

from __future__ import annotations

import json

import pytest
from test_judge import JUDGE_ALL, StandInJudge, _build
from test_judge import tiny_judge as tiny_judge  # the fixture

from builder import release_format as rf
from builder.cli import main
from builder.release_format.verify import verify_release
from builder.review.index import ReleaseIndex
from builder.review.store import JudgementStore
from builder.review.study import QUESTIONS, Study, select

pytestmark = pytest.mark.e2e  # an engine build, a calibration and a lance-cf eval run


def _scores(release, config):
    manifest = rf.load_manifest(release)
    return [
        json.loads(members["json"])
        for shard in manifest.shards
        if shard.config == config
        for _, members in rf.iter_shard(release / shard.path, wanted={"json"})
    ]


def test_a_built_judged_release_is_not_calibrated_until_a_study_calibrates_it(
    tmp_path, monkeypatch, tiny_judge, capsys, cli
):
    _build(tmp_path, "judged", JUDGE_ALL, monkeypatch, judge=StandInJudge(), model=tiny_judge)
    release = tmp_path / "judged"
    card = (release / rf.CARD_NAME).read_text()
    section = card.split("## Label-kept judge", 1)[1].split("\n## ", 1)[0]
    assert "**Not calibrated**" in section and "%" not in section

    # Alice says a cat is still a cat and a dog is not (the stand-in agrees); Bob slips on the first dog.
    index = ReleaseIndex(release)
    store = JudgementStore(release, index.manifest_sha)
    study = Study(name="calib", questions=(QUESTIONS["still_class"],), blind=True, shuffle=True)
    store.save_study(study.name, study.to_dict())
    items = select(study, index)
    assert len(items) == 8 and {c for c, _ in items} == {"counterfactual"}
    first_dog = next(k for c, k in items if index.get(c, k).meta["label_name"] == "dog")
    for rater in ("alice", "bob"):
        for config, key in items:
            cat = index.get(config, key).meta["label_name"] == "cat"
            answer = "yes" if cat or (rater == "bob" and key == first_dog) else "no"
            store.record(study.name, rater, config, key, {"still_class": answer, "verdict": "accept"})

    assert main(["review", "agreement", str(release), "--study-name", "calib", "--resamples", "100"]) == 0
    judge = json.loads(capsys.readouterr().out)["judge"]
    # the tie (alice no, bob yes) on the first dog leaves it out; the other 7 the stand-in decides as people do
    assert judge["judge_human"]["items"] == 7 and judge["judge_human"]["kappa"] == 1.0
    assert judge["left_out"] == {"raters tied": 1} and judge["threshold_calibrated"] is False
    assert judge["human_human"]["items"] == 8 and judge["human_human"]["kappa"] == pytest.approx(0.75)
    # the judge against each rater on those 8 items: 15 of 16 labels agree, both sides half yes: kappa 0.875
    assert judge["judge_rater"]["labels"] == 16 and judge["judge_rater"]["kappa"] == pytest.approx(0.875)

    out = tmp_path / "calibrated"
    args = ["review", "calibrate", str(release), "--output", str(out), "--study-name", "calib", "--folds", "3"]
    assert main([*args, "--resamples", "200"]) == 0, capsys.readouterr().err
    assert verify_release(out) == []
    before, after = rf.load_manifest(release), rf.load_manifest(out)
    for shard in before.shards:
        assert (out / shard.path).read_bytes() == (release / shard.path).read_bytes()
    record = after.extra["judge_calibration"]
    assert record["judge"]["judge"] == before.stages["judge"]  # the stage record the build wrote
    threshold = record["threshold"]
    # the lowest score among the items people called still a cat: the stand-in's cat scores are all above its dogs'
    cats = [m["judge_class_p"] for m in _scores(release, "counterfactual") if m["label_name"] == "cat"]
    assert threshold == pytest.approx(min(cats))
    scores = [m["judge_class_p"] for m in _scores(out, "counterfactual")]
    kept = sum(p >= threshold for p in scores)
    assert (record["kept"]["scored"], record["kept"]["kept"]) == (len(scores), kept) == (8, 4)
    card = (out / rf.CARD_NAME).read_text()
    assert "**50.0% (95% CI" in card and "blind: the reviewers did not see the judge's score" in card

    eval_out = tmp_path / "eval"
    class_map = tmp_path / "map.txt"
    class_map.write_text("0\n1\n")  # the release's two classes on the model's first two outputs
    argv = ["eval", "--release", str(out), "--output", str(eval_out), "--no-pretrained", "--workers", "0"]
    argv += ["--class-map", str(class_map)]
    parsed = cli.parse([*argv, "--bootstrap", "20", "--no-insights", "--model", "test_vit"])
    assert parsed.func(parsed) == 0
    (results_path,) = eval_out.rglob("results.json")
    view = json.loads(results_path.read_text())["judge_kept"]
    lance_r = [m["judge_class_p"] for m in _scores(out, "lance_r")]
    assert view["configs"] == ["counterfactual", "lance_r"] and view["calibrated"] is True
    assert view["counts"]["counterfactual"] == {"kept": 4, "below": 4, "unscored": 0}
    assert view["counts"]["lance_r"]["kept"] == sum(p >= threshold for p in lance_r)
    assert view["metrics"]["original"]["n"] == 4  # the originals are not judged: all of them
