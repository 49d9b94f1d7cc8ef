"""The review's data side, without a server: study selection and per-reviewer order, blind views, the judgement store
(append-only, latest counts, another build's judgements ignored, export), agreement against an independent
computation, and the verdict rule."""

from __future__ import annotations

import itertools

import pandas as pd
import pytest
from release_fixture import write_release

from builder.review.index import ReleaseIndex, marked_words
from builder.review.server import ReviewSession
from builder.review.store import JudgementStore
from builder.review.study import QUESTIONS, Study, aggregate, agreement, reviewer_order, select


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return write_release(tmp_path_factory.mktemp("review") / "rel", originals_per_class=2, edits_per_original=4)


@pytest.fixture()
def index(release):
    return ReleaseIndex(release)


def test_a_study_selects_n_per_group_reproducibly_and_orders_each_reviewer_apart(index):
    study = Study(name="pilot", per_group=2, group_by="edit_type", seed=3, blind=True, shuffle=True)
    items = select(study, index)
    assert items == select(Study.from_dict(study.to_dict()), index)  # stored and reloaded: the same samples
    groups = {}
    for config, key in items:
        groups.setdefault(index.get(config, key).meta["edit_type"], []).append(key)
    edit_types = {s.meta["edit_type"] for (config, _), s in index.samples.items() if config == "counterfactual"}
    assert sorted(groups) == sorted(edit_types) and len(groups) > 1  # one group per edit type the release has
    assert all(len(keys) == 2 for keys in groups.values())
    assert select(Study(name="pilot", per_group=2, seed=4), index) != items  # another seed, another draw
    alice, bob = (reviewer_order(study, len(items), r) for r in ("alice", "bob"))
    assert sorted(alice) == sorted(bob) == list(range(len(items)))
    assert alice != bob and alice == reviewer_order(study, len(items), "alice")
    assert reviewer_order(Study(), 5, "alice") == [0, 1, 2, 3, 4]  # not shuffled: the release's order


def test_a_blind_view_shows_the_question_material_and_nothing_a_filter_decided(index, release):
    store = JudgementStore(release, index.manifest_sha)
    blind = ReviewSession(index, store, Study(name="b", blind=True, shuffle=True, show_original=False))
    view = blind.view(0)
    assert {"config", "key", "scores", "sensitive"}.isdisjoint(view) and view["original"] is None
    assert view["label"] and view["edited_caption"] and blind.image(0, original=True) is None
    open_view = ReviewSession(index, store, Study(name="o")).view(0)
    assert open_view["config"] == "counterfactual" and open_view["scores"] and open_view["original"]
    assert marked_words("a small dog on grass", "a large dog on grass") == [
        {"text": "a", "changed": False},
        {"text": "small", "changed": True},
        {"text": "dog on grass", "changed": False},
    ]


def test_the_store_appends_counts_the_latest_ignores_other_builds_and_exports(index, release, tmp_path):
    store = JudgementStore(release, index.manifest_sha)
    store.save_study("s", Study(name="s").to_dict())
    with pytest.raises(ValueError, match="already exists"):
        store.save_study("s", Study(name="s", seed=9).to_dict())
    (config, key), (config2, key2) = select(Study(), index)[:2]
    store.record("s", "alice", config, key, {"verdict": "reject"}, "the class changed")
    store.record("s", "alice", config, key, {"verdict": "accept"})  # went back and changed her mind
    JudgementStore(release, "0" * 64).record("s", "alice", config2, key2, {"verdict": "flag"})  # another build
    latest = store.latest(Study(name="s"))
    assert [(k, j.answer) for k, j in latest.items()] == [(("alice", config, key, "verdict"), "accept")]
    assert store.other_release_rows("s") == 1
    assert len(store.history("s")) == 3  # nothing is overwritten
    store.export(tmp_path / "j.csv", "s")
    store.export(tmp_path / "j.parquet", "s")
    for frame in (pd.read_csv(tmp_path / "j.csv"), pd.read_parquet(tmp_path / "j.parquet")):
        assert list(frame["answer"]) == ["reject", "accept", "flag"]
        assert {"reviewer", "at", "question", "answer", "reason", "release"} <= set(frame.columns)


def _fleiss_by_hand(ratings: list[list[str]]) -> float:
    """Fleiss (1971), written out: ratings[item] = one category per rater."""
    categories = sorted({c for row in ratings for c in row})
    n, raters = len(ratings), len(ratings[0])
    counts = [[row.count(c) for c in categories] for row in ratings]
    p_j = [sum(row[j] for row in counts) / (n * raters) for j in range(len(categories))]
    p_i = [(sum(c * c for c in row) - raters) / (raters * (raters - 1)) for row in counts]
    p_bar, p_e = sum(p_i) / n, sum(p * p for p in p_j)
    return (p_bar - p_e) / (1 - p_e)


def _cohen_by_hand(a: list[str], b: list[str]) -> float:
    categories = sorted(set(a) | set(b))
    n = len(a)
    observed = sum(x == y for x, y in zip(a, b, strict=True)) / n
    expected = sum((a.count(c) / n) * (b.count(c) / n) for c in categories)
    return (observed - expected) / (1 - expected)


def test_agreement_equals_an_independent_computation(index, release):
    store = JudgementStore(release, index.manifest_sha)
    items = select(Study(), index)[:8]
    cycle = itertools.cycle(["yes", "no", "yes", "unsure", "no", "yes", "yes"])
    ratings = {r: [next(cycle) for _ in items] for r in ("alice", "bob", "carol")}
    verdicts = {"alice": ["accept"] * 5 + ["reject"] * 3, "bob": ["accept"] * 4 + ["reject"] * 4}
    verdicts["carol"] = ["accept", "flag", "accept", "accept", "flag", "reject", "accept", "reject"]
    for reviewer in ratings:
        for i, (config, key) in enumerate(items):
            reason = "the class changed" if verdicts[reviewer][i] == "reject" else None
            answers = {"still_class": ratings[reviewer][i], "verdict": verdicts[reviewer][i]}
            store.record("k", reviewer, config, key, answers, reason)
    latest = store.latest(Study(name="k", questions=[QUESTIONS["still_class"]]))
    stats = agreement(latest, ["still_class"], items)
    for question, table in (("still_class", ratings), ("verdict", verdicts)):
        rows = [[table[r][i] for r in ("alice", "bob", "carol")] for i in range(len(items))]
        assert stats[question]["fleiss_kappa"] == pytest.approx(_fleiss_by_hand(rows), abs=1e-6)
        assert stats[question]["raters"] == 3 and stats[question]["items"] == 8
        assert stats[question]["cohen_kappa"] is None  # three raters
    two = {k: v for k, v in latest.items() if k[0] != "carol"}
    pair = agreement(two, ["still_class"], items)["still_class"]
    assert pair["cohen_kappa"] == pytest.approx(_cohen_by_hand(ratings["alice"], ratings["bob"]), abs=1e-6)
    reviews = aggregate(latest, items)
    first, sixth = reviews[items[0]], reviews[items[5]]
    assert (first.verdict, first.raters, first.agreement) == ("accepted", 3, 1.0)
    assert (sixth.verdict, sixth.reasons, round(sixth.agreement, 4)) == ("rejected", ["the class changed"], 1.0)
    assert (reviews[items[4]].verdict, reviews[items[4]].agreement) == ("flagged", 0.0)  # accept, reject, flag
    assert reviews[items[1]].answers["verdict"] == {"accept": 2, "flag": 1}


def test_the_index_refuses_a_modified_shard(release, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(release, copy)
    shard = sorted((copy / "data" / "counterfactual").iterdir())[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # the tar's zero padding: still a valid archive, no longer the sealed bytes
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="modified after it was built"):
        ReleaseIndex(copy)
