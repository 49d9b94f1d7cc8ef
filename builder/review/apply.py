"""``lance-cf review apply RELEASE --output NEW``: the next version of a release, with its human review.

The new release holds every sample of the old one, byte for byte the same images; each sample of a reviewed config
carries its review in its metadata (``review_verdict``, ``review_reasons``, ``review_answers``, ``review_raters``,
``review_agreement``; ``unreviewed`` where the study did not select it). Two configs are added: ``review_accepted``
(the samples the reviewers accepted) and ``review_rejected`` (those they rejected, with the reasons), each sample
naming the config it was reviewed in (``review_config``). Flagged and unreviewed samples stay only in their own config:
nothing is deleted. The manifest's ``review`` holds the study, the counts and the agreement (Fleiss' and Cohen's
kappa with the numbers of items and raters); the card shows them. Reviewers are counted, never named.

The output depends only on the release and on the latest judgement of each reviewer per sample and question (not on
when they were made), so applying the same judgements twice gives byte-identical releases; it verifies and publishes
as every release does.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from builder import release_format as rf
from builder.release import seal_release
from builder.review.index import ReleaseIndex
from builder.review.store import JudgementStore
from builder.review.study import ItemReview, Study, aggregate, agreement, select

logger = logging.getLogger(__name__)

ACCEPTED, REJECTED = "review_accepted", "review_rejected"
VERDICT_VALUES = ("accepted", "rejected", "flagged", "unreviewed")
REVIEW_FIELDS = (
    rf.FieldSpec(
        "review_verdict", "string", VERDICT_VALUES, "the reviewers' verdict (a strict majority; else flagged)"
    ),
    rf.FieldSpec("review_reasons", "string", description="why reviewers rejected it ('; '-separated)"),
    rf.FieldSpec(
        "review_answers", "string", description="JSON object: question -> answer -> reviewers (the verdict too)"
    ),
    rf.FieldSpec("review_raters", "int64", description="how many reviewers judged it"),
    rf.FieldSpec("review_agreement", "float64", description="share of reviewer pairs with the same verdict"),
)
ORIGIN_FIELD = rf.FieldSpec("review_config", "string", description="the config the sample was reviewed in")


def choose_study(store: JudgementStore, name: str | None) -> Study:
    studies = store.studies()
    if name is None:
        if len(studies) != 1:
            listed = ", ".join(studies) or "none (review the release first: lance-cf review RELEASE)"
            raise ValueError(f"name the study to apply with --study-name (studies: {listed})")
        name = studies[0]
    spec = store.study_spec(name)
    if spec is None:
        raise ValueError(f"no study {name!r} in {store.path} (studies: {', '.join(studies) or 'none'})")
    return Study.from_dict(spec, where=f"study {name!r}")


def check_new_output(release: Path, output: Path) -> None:
    """Refuse an ``--output`` for a next version that is the release itself or a directory with anything in it."""
    if output.resolve() == release.resolve():
        raise ValueError(f"--output {output} is the release itself; give a new directory for the next version")
    if output.exists() and (not output.is_dir() or any(p.name != rf.WORK_DIR for p in output.iterdir())):
        raise ValueError(f"--output {output} exists and is not empty; give a new directory")


def next_version(version: str) -> str:
    """The next minor version: a review changes the release's data (new configs, new fields), not its images."""
    parsed = rf.parse_release_version(version)
    major, minor, _ = parsed.release
    return f"{major}.{minor + 1}.0"


def reseal_next_version(
    release: Path, output: Path, index: ReleaseIndex, update: dict[str, Any], version: str
) -> dict[str, Any]:
    """The next version of a release whose samples do not change: every shard copied byte for byte (the new manifest
    lists the very same shard records, and each copy is checked against them), the old manifest with ``version`` and
    ``update``, sealed (card, gallery, croissant) with the old one as the changelog's previous release.

    Args:
        index: ``ReleaseIndex(release)``: its samples go through the release's declared invariants again.
        update: manifest fields to add or replace (e.g. a calibration, an editor comparison).

    Returns:
        The new manifest.
    """
    old = index.manifest
    output.mkdir(parents=True, exist_ok=True)
    for shard in old.shards:
        target = output / shard.path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(release / shard.path, target)
        if rf.file_sha256(target) != (shard.sha256, shard.bytes):
            raise ValueError(f"{target}: the copy of {shard.path} differs from the manifest's record; copy again")
    invariants = rf.InvariantCheck(old.release_spec, old.configs)
    for (config, key), sample in sorted(index.samples.items()):
        invariants.add(config, sample.meta, f"{config}:{key}")
    manifest = {k: v for k, v in (old.raw or old.to_dict()).items() if k not in ("manifest_sha256", "assets")}
    manifest.update(update, version=version)
    seal_release(output, manifest, invariants, previous_manifest=old.raw)
    return manifest


def review_fields(review: ItemReview) -> dict[str, Any]:
    return {
        "review_verdict": review.verdict,
        "review_reasons": "; ".join(review.reasons) or None,
        "review_answers": json.dumps(review.answers, sort_keys=True, separators=(",", ":")) if review.answers else None,
        "review_raters": review.raters,
        "review_agreement": review.agreement,
    }


def apply_review(
    release: Path, output: Path, *, study_name: str | None = None, version: str | None = None
) -> dict[str, Any]:
    """Write the reviewed release to ``output`` (new or empty); return its manifest."""
    release, output = Path(release), Path(output)
    check_new_output(release, output)
    index = ReleaseIndex(release)
    store = JudgementStore(release, index.manifest_sha)
    study = choose_study(store, study_name)
    items = select(study, index)
    latest = store.latest(study)
    if not any(q == "verdict" for (_, _, _, q) in latest):
        ignored = store.other_release_rows(study.name)
        hint = f" ({ignored} judgement(s) were of another build of this release)" if ignored else ""
        raise ValueError(f"study {study.name!r} has no judgement of this release{hint}: review it first")
    reviews = aggregate(latest, items)
    stats = agreement(latest, [q.id for q in study.questions], items)
    old = index.manifest
    if {ACCEPTED, REJECTED} & set(old.configs):
        raise ValueError(f"{release} is already a reviewed release; apply a review to the release it was made from")
    reviewed = [c for c in old.configs if any(c == config for config, _ in items)]
    version = version or next_version(old.version)
    rf.parse_release_version(version)

    # 1. The declaration: the reviewed configs gain the review fields; two configs gather accepted and rejected.
    spec = _review_spec(old.release_spec, old.configs, reviewed)
    shard_samples = int(old.config.get("shard_max_samples") or 1000)
    shard_bytes = int(old.config.get("shard_max_bytes") or (1 << 30))
    ext = old.image_ext

    # 2. Every config, sample for sample, with the review fields where reviewed.
    shards: list[dict[str, Any]] = []
    counts: dict[str, Any] = {}
    invariants = rf.InvariantCheck(spec, [*old.configs, ACCEPTED, REJECTED])
    gathered: dict[str, list[tuple[str, str]]] = {ACCEPTED: [], REJECTED: []}

    def write(config: str, rows) -> None:
        tally = rf.Tally()

        def samples():
            for key, label, meta, image in rows:
                data = rf.encode_metadata(meta, spec, config)
                invariants.add(config, meta)
                tally.add(label, meta.get("edit_type"))
                yield rf.ShardSample(key, ext, image, label, data)

        for i, group in enumerate(rf.group_into_shards(samples(), shard_samples, shard_bytes)):
            shards.append(rf.write_shard(output, config, i, group).to_dict())
        counts[config] = tally.to_dict()

    def rows_of(config: str):
        for key in index.keys(config):
            sample = index.get(config, key)
            meta = dict(sample.meta)
            if config in reviewed:
                review = reviews.get((config, key), ItemReview("unreviewed"))
                meta.update(review_fields(review))
                if review.verdict in ("accepted", "rejected"):
                    gathered[ACCEPTED if review.verdict == "accepted" else REJECTED].append((config, key))
            yield key, sample.label, meta, index.image(sample)

    output.mkdir(parents=True, exist_ok=True)
    for config in old.configs:
        write(config, rows_of(config))
    added = []
    for config, members in gathered.items():
        if not members:
            continue
        keys = [key for _, key in members]
        if len(set(keys)) != len(keys):
            raise ValueError(f"two reviewed configs share a sample key; {config} cannot hold both")
        added.append(config)
        write(config, _gathered_rows(index, reviews, sorted(members, key=lambda m: m[1])))

    # 3. The manifest: the old one, with the new version, configs, declaration, counts, shards and the review.
    verdicts = {v: sum(r.verdict == v for r in reviews.values()) for v in VERDICT_VALUES}
    reasons: dict[str, int] = {}
    for r in reviews.values():
        for reason in r.reasons:
            reasons[reason] = reasons.get(reason, 0) + 1
    manifest = {k: v for k, v in (old.raw or old.to_dict()).items() if k not in ("manifest_sha256", "assets")}
    configs = [*old.configs, *added]
    manifest.update(
        version=version,
        configs=configs,
        release_spec=spec.restricted(configs).to_dict(),
        counts=counts,
        shards=shards,
        review={
            "study": study.to_dict(),
            "previous": {"name": old.name, "version": old.version, "manifest_sha256": old.manifest_sha256},
            "configs": reviewed,
            "items": len(items),
            "raters": len({r for (r, _, _, q) in latest if q == "verdict"}),
            "verdicts": verdicts,
            "reasons": dict(sorted(reasons.items())),
            "agreement": stats,
            "added_configs": added,
        },
    )
    seal_release(output, manifest, invariants, previous_manifest=old.raw)
    logger.info("review applied: %s %s -> %s (%s)", old.name, old.version, version, verdicts)
    return manifest


def _gathered_rows(index: ReleaseIndex, reviews: dict, members: list[tuple[str, str]]):
    for config, key in members:
        sample = index.get(config, key)
        meta = dict(sample.meta)
        meta.update(review_fields(reviews[(config, key)]))
        meta["review_config"] = config
        yield key, sample.label, meta, index.image(sample)


def _review_spec(old: rf.ReleaseSpec, configs: list[str], reviewed: list[str]) -> rf.ReleaseSpec:
    declared = []
    union: dict[str, rf.FieldSpec] = {}
    for config in old.configs:
        if config.name not in configs:
            continue
        if config.name not in reviewed:
            declared.append(config)
            continue
        clash = sorted({f.name for f in config.fields} & {f.name for f in (*REVIEW_FIELDS, ORIGIN_FIELD)})
        if clash:
            raise ValueError(f"config {config.name!r} already has review field(s) {clash}: apply a review once")
        declared.append(rf.ConfigSpec(config.name, config.description, (*config.fields, *REVIEW_FIELDS)))
        for f in config.fields:
            if f.name in union and union[f.name].dtype != f.dtype:
                raise ValueError(f"field {f.name!r} has two types across the reviewed configs: cannot gather them")
            union.setdefault(f.name, f)
    names = ", ".join(reviewed)
    gathered = (*union.values(), *REVIEW_FIELDS, ORIGIN_FIELD)
    declared.append(rf.ConfigSpec(ACCEPTED, f"samples of {names} that reviewers accepted (human review)", gathered))
    declared.append(rf.ConfigSpec(REJECTED, f"samples of {names} that reviewers rejected, with reasons", gathered))
    return rf.ReleaseSpec(tuple(declared), old.edit_types, old.score_names)
