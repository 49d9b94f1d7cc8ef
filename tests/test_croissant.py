"""croissant.json: generated from the release format, read by mlcroissant exactly as `datasets` reads the release,
checked by verify; the card's Hub metadata and the viewer statement."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from io import BytesIO

import numpy as np
import pytest
from croissant_check import assert_croissant_matches_datasets, mlcroissant_issues, mlcroissant_records
from PIL import Image
from release_fixture import write_release

from builder import release_format as rf
from builder.croissant import write_release_croissant
from builder.release_format import iter_shard


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    # two classes, several shards per config, every edit type: small, and every code path of the index
    return write_release(tmp_path_factory.mktemp("croissant") / "r", labels=(1, 207), originals_per_class=2)


def test_context_is_mlcroissants_croissant_1_1_context():
    from mlcroissant._src.core.context import Context, CroissantVersion
    from mlcroissant._src.core.rdf import make_context

    ctx = Context()
    ctx.conforms_to = CroissantVersion.V_1_1
    assert rf.croissant.CONTEXT == make_context(ctx)


@pytest.mark.slow
def test_mlcroissant_reads_the_same_records_as_datasets(release, tmp_path):
    assert rf.verify_release(release) == []
    assert assert_croissant_matches_datasets(release, tmp_path) == sum(
        c["total"] for c in rf.load_manifest(release).counts.values()
    )


def test_the_published_document_has_no_error_and_no_warning(release, tmp_path, monkeypatch):
    from builder.publish import stage_croissant

    staging = tmp_path / "staging"
    staging.mkdir()
    manifest = rf.read_manifest_dict(release)
    for config in manifest["configs"]:
        (staging / rf.index_path(config)).parent.mkdir(exist_ok=True)
        (staging / rf.index_path(config)).write_bytes((release / rf.index_path(config)).read_bytes())
    monkeypatch.setenv("HF_ENDPOINT", "https://user:secret@hub.example")
    document = stage_croissant(staging, manifest, "org/name")
    assert mlcroissant_issues(staging / rf.CROISSANT_NAME) == []
    assert document["url"] == "https://hub.example/datasets/org/name"  # credentials never published
    # what publish adds describes the publication; the rest is the release's own document
    own = json.loads((release / rf.CROISSANT_NAME).read_bytes())
    assert {k: v for k, v in document.items() if k not in ("url", "datePublished")} == own


def test_a_release_date_is_datePublished_and_mlcroissant_has_no_remark(release, tmp_path):
    """The config's release_date (an input, like the version) dates the release's own croissant.json: mlcroissant
    then reports no error and no warning, and verify accepts it."""
    import shutil

    dated = tmp_path / "dated"
    shutil.copytree(release, dated)
    manifest = rf.read_manifest_dict(dated)
    manifest["config"]["release_date"] = "2026-11-26"
    (dated / "manifest.json").write_bytes(rf.canonical_json(rf.seal_manifest(manifest)))
    write_release_croissant(dated, rf.Manifest.from_dict(manifest))
    assert json.loads((dated / rf.CROISSANT_NAME).read_text())["datePublished"] == "2026-11-26"
    assert mlcroissant_issues(dated / rf.CROISSANT_NAME) == []
    assert rf.verify_release(dated) == []


def test_release_date_is_a_date_and_absent_configs_hash_as_before():
    import dataclasses

    from builder.config import load_config

    config = dataclasses.replace(load_config("lance"), source="demo")
    assert "release_date" not in config.to_dict()  # every config written before the key hashes unchanged
    dated = dataclasses.replace(config, release_date="2026-11-26")
    dated.validate()
    assert dated.to_dict()["release_date"] == "2026-11-26" and dated.config_hash() != config.config_hash()
    for bad in ("2026-13-01", "26-11-2026", "yesterday"):
        with pytest.raises(ValueError, match=f"release_date '{bad}': expected a date as YYYY-MM-DD"):
            dataclasses.replace(config, release_date=bad).validate()


def test_every_declared_field_is_a_typed_described_field(release):
    document = json.loads((release / rf.CROISSANT_NAME).read_bytes())
    manifest = rf.load_manifest(release)
    record_sets = {r["@id"]: r for r in document["recordSet"]}
    assert [n["classes/name"] for n in record_sets["classes"]["data"]] == manifest.label_names
    for config in manifest.configs:
        fields = {f["@id"].removeprefix(f"{config}/"): f for f in record_sets[config]["field"]}
        assert set(fields) == {"key", "image", *rf.V1_FIELD_NAMES}
        assert all(f["description"] and f["dataType"] for f in fields.values())
        assert fields["label"]["references"] == {"field": {"@id": "classes/index"}}
        scores = {s["@id"].rsplit("/", 1)[1] for s in fields["scores"]["subField"]}
        assert scores == set(manifest.release_spec.score_names)
    shards = {d["@id"]: d for d in document["distribution"] if d["@type"] == "cr:FileObject"}
    for shard in manifest.shards:
        assert shards[shard.path]["sha256"] == shard.sha256
        assert shards[shard.path]["contentSize"] == f"{shard.bytes} B"
    for key in rf.croissant.REQUIRED_ABOUT:
        assert document[key], key


def test_rewriting_gives_the_same_bytes(release, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(release, copy)
    write_release_croissant(copy, rf.read_manifest_dict(copy))
    for rel in [rf.CROISSANT_NAME, *(rf.index_path(c) for c in rf.load_manifest(copy).configs)]:
        assert (copy / rel).read_bytes() == (release / rel).read_bytes(), rel


@pytest.mark.parametrize("tamper", ["index_row", "index_missing", "stray_index", "croissant_sha", "croissant_rai"])
def test_verify_catches_an_index_or_croissant_that_disagrees_with_the_release(release, tmp_path, tamper):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(release, copy)
    manifest = rf.load_manifest(copy)
    index = copy / rf.index_path("counterfactual")
    document = json.loads((copy / rf.CROISSANT_NAME).read_bytes())
    if tamper == "index_row":  # one caption changed, the index rewritten with the declared schema
        _, rows = rf.croissant.read_index_rows(index)
        rows[0]["caption"] = "a photo of something else"
        index.write_bytes(rf.croissant.index_bytes(rows, manifest.release_spec, "counterfactual"))
        expected = "index/counterfactual.parquet: row 0 does not match the shards' metadata"
    elif tamper == "index_missing":
        index.unlink()
        expected = "index/counterfactual.parquet: missing"
    elif tamper == "stray_index":
        (copy / rf.INDEX_DIR / "old.parquet").write_bytes(index.read_bytes())
        expected = "index/old.parquet: file not listed"
    elif tamper == "croissant_sha":
        document["distribution"][0]["sha256"] = "0" * 64
        (copy / rf.CROISSANT_NAME).write_bytes(rf.canonical_json(document))
        expected = "croissant.json: does not match the manifest: distribution[0].sha256"
    else:
        del document["rai:dataLimitations"]
        (copy / rf.CROISSANT_NAME).write_bytes(rf.canonical_json(document))
        expected = "croissant.json: required field(s) rai:dataLimitations missing"
    problems = rf.verify_release(copy, check_images=False)
    assert any(p.startswith(expected) for p in problems), problems


def test_mlcroissant_sees_a_changed_shard(release, tmp_path):
    """The sha256 croissant.json records is the one mlcroissant checks before reading a shard."""
    import mlcroissant as mlc

    copy = tmp_path / "copy"
    shutil.copytree(release, copy)
    shard = copy / rf.load_manifest(copy).shards_of("original")[0].path
    shard.write_bytes(shard.read_bytes() + b"\0" * 512)
    with pytest.raises(mlc.GenerationError):
        mlcroissant_records(copy, "original")


# ------------------------------------------------------------------------------------------------ card metadata
def test_card_metadata_uses_the_hub_vocabularies(release):
    """The keys the Hub indexes a dataset by: values from the vocabularies `datasets` ships for them, accepted by
    huggingface_hub's DatasetCardData (round trip), the papers as arxiv: tags."""
    from importlib import resources

    from huggingface_hub import DatasetCard

    resources_dir = resources.files("datasets") / "utils" / "resources"
    creators = json.loads((resources_dir / "creators.json").read_text())
    sizes = json.loads((resources_dir / "size_categories.json").read_text())
    meta = rf.card_metadata(rf.load_manifest(release))
    assert set(meta["annotations_creators"]) <= set(creators["annotations"])
    assert set(meta["language_creators"]) <= set(creators["language"])
    assert meta["size_categories"][0] in sizes
    assert meta["source_datasets"] == ["extended|imagenet-1k"]  # the fixture's labels are ImageNet's
    assert "arxiv:2305.19164" in meta["tags"]
    card = DatasetCard((release / rf.CARD_NAME).read_text())
    for key, value in meta.items():
        assert card.data.to_dict()[key] == value, key


@pytest.mark.parametrize(
    ("source", "stages", "kind", "arxiv", "sources"),
    [
        ({"kind": "generate", "spec": "generate:imagenet"}, [{"name": "g", "type": "shift_generation"}],
         "interfaces", ["2302.07865"], ["original"]),
        ({"kind": "discovery", "spec": "discovery:x"}, [], "discovery", ["2208.08831"], ["original"]),
        ({"kind": "imagefolder", "spec": "imagefolder:photos"}, [{"name": "e", "type": "controlnet_edit"}],
         "controlnet", ["2502.04378", "2305.19164"], ["extended|other"]),
        ({"kind": "hf", "spec": "hf:org/photos:train"}, [], "lance", ["2305.19164"], ["extended|org/photos"]),
    ],
)  # fmt: skip
def test_each_kind_cites_its_papers_and_sources(release, source, stages, kind, arxiv, sources):
    data = rf.read_manifest_dict(release)
    data = {**data, "source": {**data["source"], **source, "imagenet_derived": False}}
    data["config"] = {**data["config"], "stages": stages}
    manifest = rf.Manifest.from_dict(data)
    assert rf.release_kind(manifest).name == kind
    meta = rf.card_metadata(manifest)
    assert [t for t in meta["tags"] if t.startswith("arxiv:")] == [f"arxiv:{a}" for a in arxiv]
    assert meta["source_datasets"] == sources
    recorded = rf.Manifest.from_dict({**data, "kind": "discovery"})  # a recorded kind wins over recognition
    assert rf.release_kind(recorded).name == "discovery"


def test_viewer_statement_names_the_configs_over_the_conversion_limit(release, tmp_path):
    from dataset_cards import render_release_card

    data = rf.read_manifest_dict(release)
    manifest = rf.Manifest.from_dict(data)
    assert rf.viewer_statement(manifest).startswith("The Hub's dataset viewer shows the whole release")
    shards = [dict(s) for s in data["shards"]]
    for shard in shards:
        if shard["config"] == "counterfactual":
            shard["bytes"] = rf.VIEWER_MAX_PARQUET_BYTES  # several shards: together over the limit
    big = rf.Manifest.from_dict({**data, "shards": shards})
    assert list(rf.viewer_partial_configs(big)) == ["counterfactual"]
    statement = rf.viewer_statement(big)
    assert "only part of this release" in statement and "5,000,000,000 bytes" in statement
    assert "counterfactual (" in statement and "original (" not in statement
    card = render_release_card(release, data, output_dir=tmp_path)
    assert rf.viewer_statement(manifest) in card and "[`croissant.json`](croissant.json)" in card
    assert "[LANCE: Stress-testing Visual Models" in card and "(https://arxiv.org/abs/2305.19164)" in card


_READ_WITH_DEFAULTS = """
import hashlib, json, sys
import mlcroissant as mlc
out = {}
for release in sys.argv[1:]:
    records = mlc.Dataset(release + "/croissant.json").records("original")
    out[release] = {r["original/key"].decode(): hashlib.sha256(r["original/image"].tobytes()).hexdigest() for r in records}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_two_releases_read_in_one_process_give_their_own_records(tmp_path):
    """mlcroissant with its default settings caches an archive's extraction under its path in croissant.json, in
    every later process too: two releases (same configs, same keys, other images) read in one process, then one of
    them rebuilt with other images and read again, each give their own images."""

    def images(release):
        manifest = rf.load_manifest(release)
        out = {}
        for shard in manifest.shards_of("original"):
            for key, members in iter_shard(release / shard.path, wanted={manifest.image_ext}):
                pixels = np.asarray(Image.open(BytesIO(members[manifest.image_ext])).convert("RGB"))
                out[key] = hashlib.sha256(pixels.tobytes()).hexdigest()
        return out

    first = write_release(tmp_path / "first", labels=(1,), originals_per_class=2, configs=("original",), seed=1)
    second = write_release(tmp_path / "second", labels=(1,), originals_per_class=2, configs=("original",), seed=2)
    assert images(first).keys() == images(second).keys() and images(first) != images(second)
    # mlcroissant's defaults: no CROISSANT_CACHE, its cache under the (fresh) home folder
    env = {k: v for k, v in os.environ.items() if k != "CROISSANT_CACHE"} | {"HOME": str(tmp_path / "home")}

    def read(*releases):
        proc = subprocess.run(
            [sys.executable, "-c", _READ_WITH_DEFAULTS, *map(str, releases)], capture_output=True, text=True, env=env
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    got = read(first, second)
    assert got == {str(first): images(first), str(second): images(second)}
    assert (tmp_path / "home" / ".cache" / "croissant").is_dir()  # the default cache was the one used
    # The first release rebuilt in place with other images: a later process reads the new ones, not the cache's.
    shutil.rmtree(first)
    write_release(first, labels=(1,), originals_per_class=2, configs=("original",), seed=3)
    assert read(first) == {str(first): images(first)} != {str(first): got[str(first)]}
