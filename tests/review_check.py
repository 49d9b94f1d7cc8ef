"""One check of ``review apply`` for a release of any kind (LANCE, ControlNet, interfaces, discovery): two reviewers
judge the first samples of the kind's default study, and the next version keeps every sample, verifies, and holds
exactly the accepted and rejected ones in their configs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from builder import release_format as rf
from builder.release_format.verify import verify_release
from builder.review.apply import apply_review
from builder.review.index import ReleaseIndex
from builder.review.store import JudgementStore
from builder.review.study import Study, select


def assert_review_apply_keeps_every_sample(release: Path, tmp_path: Path) -> dict:
    """Review a copy of ``release`` (the judgements live in its working area) and apply it; returns the new
    manifest. Alice and Bob agree on the first sample (accept) and the second (reject); they disagree on the third."""
    reviewed_from = tmp_path / "reviewed-from"
    shutil.copytree(release, reviewed_from)
    index = ReleaseIndex(reviewed_from)
    store = JudgementStore(reviewed_from, index.manifest_sha)
    study = Study(name="check")
    store.save_study(study.name, study.to_dict())
    items = select(study, index)
    assert len(items) >= 3, f"{release}: the default study selects {len(items)} sample(s)"
    verdicts = {"alice": ["accept", "reject", "accept"], "bob": ["accept", "reject", "reject"]}
    for reviewer, answers in verdicts.items():
        for (config, key), verdict in zip(items, answers, strict=False):
            reason = "not the class any more" if verdict == "reject" else None
            store.record(study.name, reviewer, config, key, {"verdict": verdict}, reason)

    out = tmp_path / "reviewed"
    apply_review(reviewed_from, out)
    assert verify_release(out) == []
    before = rf.load_manifest(release)
    after = json.loads((out / rf.MANIFEST_NAME).read_text())
    assert after["configs"] == [*before.configs, "review_accepted", "review_rejected"]
    for config in before.configs:
        assert after["counts"][config] == before.counts[config]  # nothing deleted
    assert after["review"]["verdicts"] == {
        "accepted": 1, "rejected": 1, "flagged": 1, "unreviewed": len(items) - 3,
    }  # fmt: skip

    after_manifest = rf.load_manifest(out)
    accepted, rejected = items[0], items[1]
    accepted_rows = _metadata(out, after_manifest, "review_accepted")
    rejected_rows = _metadata(out, after_manifest, "review_rejected")
    assert [(m["review_config"], m["review_verdict"]) for m in accepted_rows] == [(accepted[0], "accepted")]
    assert [(m["review_config"], m["review_reasons"]) for m in rejected_rows] == [
        (rejected[0], "not the class any more")
    ]
    return after


def _metadata(release: Path, manifest: rf.Manifest, config: str) -> list[dict]:
    """Every sample's metadata (``KEY.json``) of one config, in shard order."""
    return [
        json.loads(members["json"])
        for shard in manifest.shards
        if shard.config == config
        for _, members in rf.iter_shard(release / shard.path, wanted={"json"})
    ]
