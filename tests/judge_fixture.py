"""A release whose counterfactuals carry planted scores of a deterministic stand-in judge, and two planted reviewers.

Each counterfactual has a planted truth (does it still show its class?); the stand-in's ``judge_class_p`` agrees with
it 80% of the time, one sample in 12 is unscored, and the reviewers answer ``still_class`` from the same truth with
planted slips and an "unsure" now and then. The fields are declared as the judge stage declares them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from release_fixture import write_card, write_manifest, write_release

from builder import release_format as rf
from builder.review.index import ReleaseIndex
from builder.review.store import JudgementStore
from builder.review.study import Study, select
from lance_pipeline.screening import judge

# the judge stage's declaration, as a release declares it (the stand-in fills the fields the real judge fills)
JUDGE_FIELDS = tuple(rf.FieldSpec(**vars(f)) for f in judge.JUDGE_FIELDS)
RATERS = ("alice", "bob")


def _unit(*parts) -> float:
    """A planted number in [0, 1) from the sample's key (the stand-in is deterministic)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def truth(key: str) -> int:
    return int(_unit("truth", key) < 0.6)


def planted_score(key: str) -> float | None:
    """Agrees with the truth 80% of the time; one sample in 12 is unscored (the judge skipped it)."""
    if _unit("skip", key) < 1 / 12:
        return None
    agree = _unit("agree", key) < 0.8
    label = truth(key) if agree else 1 - truth(key)
    spread = _unit("score", key)
    return round(0.5 + 0.5 * spread, 4) if label else round(0.5 * spread, 4)


def planted_answer(rater: str, key: str) -> str:
    u = _unit("rater", rater, key)
    if u < 0.06:
        return "unsure"
    return ("yes" if truth(key) else "no") if u < 0.88 else ("no" if truth(key) else "yes")


def write_judged_release(root: Path, tmp: Path, *, judged: bool = True) -> Path:
    """The fixture release with its counterfactuals re-written to declare and carry the stand-in's scores."""
    base = write_release(tmp / f"base-{root.name}", originals_per_class=4, edits_per_original=4)
    manifest = json.loads((base / rf.MANIFEST_NAME).read_text())
    old = rf.load_manifest(base)
    extra = JUDGE_FIELDS if judged else ()
    spec = rf.ReleaseSpec(
        tuple(
            rf.ConfigSpec(c.name, c.description, (*c.fields, *extra)) if c.name == "counterfactual" else c
            for c in old.release_spec.configs
        ),
        old.release_spec.edit_types,
        old.release_spec.score_names,
    )
    root.mkdir(parents=True)
    shards, counts = [], {}
    for config in old.configs:
        tally = rf.Tally()
        samples = []
        for shard in old.shards:
            if shard.config != config:
                continue
            for key, members in rf.iter_shard(base / shard.path):
                meta = json.loads(members["json"])
                if config == "counterfactual" and judged:
                    score = planted_score(key)
                    meta["judge_class_p"] = score
                    meta["judge_edit_p"] = None if score is None else round(_unit("edit", key), 4)
                tally.add(meta["label"], meta["edit_type"])
                samples.append(rf.ShardSample(key, "png", members["png"], meta["label"],
                                              rf.encode_metadata(meta, spec, config)))  # fmt: skip
        for i, start in enumerate(range(0, len(samples), 8)):
            shards.append(rf.write_shard(root, config, i, samples[start : start + 8]).to_dict())
        counts[config] = tally.to_dict()
    manifest = {k: v for k, v in manifest.items() if k not in ("manifest_sha256", "assets")}
    manifest.update(shards=shards, counts=counts, release_spec=spec.to_dict())
    if judged:  # the stage's record, as the judge stage writes it (role, model, questions)
        manifest["stages"]["judge"] = {"role": "judge", "model": "stand-in-judge", "revision": None,
                                       "class_question": judge.CLASS_QUESTION}  # fmt: skip
    write_manifest(root, manifest)
    write_card(root, manifest)
    return root


def review(release: Path, study: Study) -> list[tuple[str, str]]:
    """The two planted reviewers answer ``still_class`` (and a verdict) for every sample of the study."""
    index = ReleaseIndex(release)
    store = JudgementStore(release, index.manifest_sha)
    store.save_study(study.name, study.to_dict())
    items = select(study, index)
    for rater in RATERS:
        for config, key in items:
            answer = planted_answer(rater, key)
            verdict = "accept" if answer == "yes" else "reject"
            answers = {"still_class": answer, "verdict": verdict} if study.questions else {"verdict": verdict}
            store.record(study.name, rater, config, key, answers, "the class changed" if verdict == "reject" else None)
    return items
