"""The release format unit: the published schema, keys, seeds, the payload codec, the typed manifest, the shard
reader, semver, v1 compatibility, verify's card and asset checks, declared configs and what readers see."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from builder_helpers import photo
from release_fixture import write_release

from builder import release_format as rf
from builder.engine import derive_seed
from builder.ledger import decode_payload, encode_payload
from builder.release_format import is_valid_key, metadata_json_schema, sanitize_key

REPO = Path(__file__).resolve().parents[1]


def test_published_schema_matches_code():
    assert json.loads((REPO / "docs" / "metadata.schema.json").read_text()) == metadata_json_schema()


def test_sanitize_key_is_valid_and_collision_free():
    names = ["a.b", "a_b", "a b", "ünï", "x/y", "plain-key_1"]
    keys = [sanitize_key(n) for n in names]
    assert all(is_valid_key(k) for k in keys)
    assert len(set(keys)) == len(keys)
    assert sanitize_key("plain-key_1") == "plain-key_1"


def test_seeds_depend_on_release_seed_and_key_only():
    assert derive_seed(0, "k1") == derive_seed(0, "k1")
    assert derive_seed(0, "k1") != derive_seed(1, "k1") != derive_seed(0, "k2")
    assert 0 <= derive_seed(123, "x") < 2**31


def test_payload_codec_round_trips_images_tensors_and_json():
    img = photo(3)
    tensor = torch.randn(2, 3, dtype=torch.float32)
    update = {"caption": "a photo", "n": 3, "x": 0.1, "none": None, "nested": [{"image": img, "t": tensor}]}
    back = decode_payload(encode_payload(update))
    assert back["caption"] == "a photo" and back["n"] == 3 and back["x"] == 0.1 and back["none"] is None
    back_image = back["nested"][0]["image"]
    assert (back_image.mode, back_image.size, back_image.tobytes()) == (img.mode, img.size, img.tobytes())
    assert torch.equal(back["nested"][0]["t"], tensor)


# ------------------------------------------------------------------------------------------------------------ the unit
def test_format_unit_imports_nothing_from_the_project_and_nothing_heavy():
    """Nothing but the one reader of structured input (``lance_pipeline.readers``, the lowest room) and the release
    kinds' registry (verify checks a kind's papers and Hub keys; the registry imports none of its targets)."""
    code = (
        "import sys, builder.release_format\n"
        "reader = ('lance_pipeline', 'lance_pipeline.readers', 'lance_pipeline.readers.structured', "
        "'lance_pipeline.release_kinds', 'lance_pipeline.registry')\n"
        "bad = sorted(m for m in sys.modules if m not in reader and m.split('.')[0] in ('lance_pipeline', "
        "'evaluation', 'dataset_cards',"
        " 'torch', 'numpy', 'PIL', 'jsonschema', 'yaml', 'datasets', 'webdataset', 'huggingface_hub')"
        " or (m.startswith('builder.') and not m.startswith('builder.release_format')))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == ""


def test_schema_and_features_are_generated_from_the_sample_record():
    """One description of the record: the schema's and the features' fields are SampleMetadata's, in its order."""
    schema = rf.metadata_json_schema()
    assert list(schema["properties"]) == list(rf.V1_FIELD_NAMES) == [f.name for f in fields(rf.SampleMetadata)][:-1]
    struct = next(f for f in rf.hf_features() if f["name"] == "json")["struct"]
    assert [f["name"] for f in struct] == list(rf.V1_FIELD_NAMES)
    assert schema["properties"]["edit_type"]["enum"] == [*rf.V1_EDIT_TYPES, None]
    # The method's live vocabulary still agrees with the frozen v1 one.
    from lance_pipeline.stage import RELEASE_EDIT_TYPES, SCORE_NAMES

    assert tuple(RELEASE_EDIT_TYPES) == rf.V1_EDIT_TYPES and tuple(SCORE_NAMES) == rf.V1_SCORE_NAMES


def test_metadata_encoding_validates_and_names_the_field():
    meta = rf.empty_metadata("k1", "k1", 3, "cat", 7)
    assert rf.encode_metadata(meta) == rf.encode_metadata({**meta, "label": 3})
    with pytest.raises(ValueError, match="'colour'.* not declared"):
        rf.encode_metadata({**meta, "colour": "red"})
    with pytest.raises(ValueError, match="edit_type 'repaint' is not one of"):
        rf.encode_metadata({**meta, "edit_type": "repaint"})
    with pytest.raises(ValueError, match="'label' is 'x', expected an integer"):
        rf.encode_metadata({**meta, "label": "x"})
    with pytest.raises(ValueError, match=r"score\(s\) \['sharpness'\] are not declared"):
        rf.encode_metadata({**meta, "scores": {"sharpness": 1.0}})
    assert json.loads(rf.encode_metadata({**meta, "self_replace": 1}))["self_replace"] == 1.0


def test_manifest_missing_a_field_is_an_error_naming_it(tmp_path):
    root = write_release(tmp_path / "r", label_names=["cat", "dog"], labels=(0, 1), edits_per_original=1)
    manifest = json.loads((root / rf.MANIFEST_NAME).read_text())
    assert rf.Manifest.from_dict(manifest).to_dict() == manifest  # typed view round-trips exactly
    for field in ("name", "counts", "label_space", "release_spec", "assets"):
        with pytest.raises(rf.ManifestError, match=f"required field '{field}' is missing"):
            rf.Manifest.from_dict({k: v for k, v in manifest.items() if k != field})
    with pytest.raises(rf.ManifestError, match="required field 'counts.original' is missing"):
        rf.Manifest.from_dict({**manifest, "counts": {}})
    with pytest.raises(rf.ManifestError, match="format_version 9 is not one this tool reads.*upgrade"):
        rf.Manifest.from_dict({**manifest, "format_version": 9})
    extra = {**manifest, "build": {"threads": 1}}  # keys of other parts of the tool are kept, not dropped
    assert rf.Manifest.from_dict(extra).to_dict() == extra


def test_shard_reader_is_strict(tmp_path):
    import io
    import tarfile

    path = tmp_path / "dup.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for name in ("a.cls", "a.cls", "a.png"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"1"))
    with pytest.raises(ValueError, match="member 'a.cls' appears twice"):
        list(rf.iter_shard(path))


def test_semver_with_packaging():
    assert rf.parse_release_version("1.2.3") < rf.parse_release_version("1.10.0")
    assert rf.parse_release_version("2.0.0-rc1") < rf.parse_release_version("2.0.0")
    for bad in ("1.0", "v1.0.0", "1.0.0.0", "1!1.0.0", "1.0.0+local", "one", 1.0):
        assert not rf.is_release_version(bad), bad
    with pytest.raises(ValueError, match="version '1.0': expected a semantic version"):
        rf.parse_release_version("1.0")


# ------------------------------------------------------------------------------------ v1 releases stay readable
def test_v1_release_as_the_old_code_wrote_it_verifies_renders_and_evaluates(tmp_path):
    from dataset_cards import render_release_card
    from evaluation.release_reader import open_release

    root = write_release(tmp_path / "v1", label_names=["cat", "dog", "zebra"], labels=(0, 2), format_version=1)
    manifest = json.loads((root / rf.MANIFEST_NAME).read_text())
    assert manifest["format_version"] == 1 and "release_spec" not in manifest and "assets" not in manifest
    assert rf.verify_release(root) == []
    render_release_card(root, manifest)
    assert rf.verify_release(root) == []  # the card's YAML is the v1 one: cls stays int64
    info = {i["config_name"]: i for i in rf.read_card_yaml(root / rf.CARD_NAME)["dataset_info"]}
    assert {"name": "cls", "dtype": "int64"} in info["counterfactual"]["features"]
    release = open_release(root)
    assert release.configs == list(rf.CONFIG_NAMES)


# --------------------------------------------------------------------------------- verify: card YAML and assets
@pytest.fixture
def carded(tmp_path):
    from dataset_cards import render_release_card

    root = write_release(tmp_path / "rel", label_names=["cat", "dog", "zebra"], labels=(0, 1, 2))
    render_release_card(root, json.loads((root / rf.MANIFEST_NAME).read_text()))
    assert rf.verify_release(root) == []
    return root


def test_verify_catches_an_edited_card_yaml(carded):
    card = carded / rf.CARD_NAME
    text = card.read_text()
    count = rf.load_manifest(carded).counts["counterfactual"]["total"]
    edits = [
        (f"num_examples: {count}", f"num_examples: {count + 1}", "num_examples"),
        ("dtype: float64", "dtype: float32", "dtype"),
        ("name: __url__", "name: __source__", "__url__"),
        ("'0': cat", "'0': lion", "cat"),
        ("license: other", "license: mit", "license"),
    ]
    for old, new, named in edits:
        assert old in text, old
        card.write_text(text.replace(old, new, 1))
        problems = rf.verify_release(carded)
        assert problems and named in problems[0] and "does not match the manifest" in problems[0], (old, problems)
    card.write_text(text)
    assert rf.verify_release(carded) == []


def test_verify_catches_an_edited_gallery_png(carded):
    from PIL import Image

    manifest = rf.load_manifest(carded)
    assert manifest.assets, "the release records its gallery"
    first = carded / manifest.assets[0].path
    image = Image.open(first).convert("RGB")
    image.putpixel((0, 0), (1, 2, 3))
    image.save(first)
    assert rf.verify_release(carded) == [
        f"{manifest.assets[0].path}: card asset does not match the sha256 the manifest records (modified)"
    ]
    first.unlink()
    assert rf.verify_release(carded) == [f"{manifest.assets[0].path}: card asset missing"]


# ------------------------------------------------------------------------------------------ open release configs
def test_a_declared_config_with_extra_fields_writes_verifies_and_loads(tmp_path):
    """A generation mode's config (one per shift, with a 'shift' field): schema, features, card and load follow."""
    import datasets

    from builder.croissant import write_release_croissant
    from dataset_cards import render_release_card

    shift = rf.ConfigSpec(
        "shift_snow",
        "generated images of each class in snow",
        (
            rf.FieldSpec("shift", "string", enum=("snow", "fog"), description="the distribution shift"),
            rf.FieldSpec("clip_shift_score", "float64"),
        ),
    )
    spec = rf.lance_release_spec(["original", "shift_snow"], extra=(shift,))
    root = tmp_path / "gen"
    names = ["cat", "dog"]
    rows = {"original": [], "shift_snow": []}
    for label, name in enumerate(names):
        key = f"src{label}"
        rows["original"].append(
            rf.ShardSample(
                key,
                "png",
                _png(label),
                label,
                rf.encode_metadata(rf.empty_metadata(key, key, label, name, label), spec, "original"),
            )
        )
        meta = {**rf.empty_metadata(f"{key}_snow", key, label, name, label), "shift": "snow", "clip_shift_score": 1}
        rows["shift_snow"].append(
            rf.ShardSample(f"{key}_snow", "png", _png(10 + label), label, rf.encode_metadata(meta, spec, "shift_snow"))
        )
    with pytest.raises(ValueError, match="config 'original': metadata field.*'shift'"):
        rf.encode_metadata({**rf.empty_metadata("k", "k", 0, "cat", 0), "shift": "snow"}, spec, "original")
    with pytest.raises(ValueError, match="'shift' is 'rain', expected one of"):
        rf.encode_metadata({**rf.empty_metadata("k", "k", 0, "cat", 0), "shift": "rain"}, spec, "shift_snow")
    shards, counts = [], {}
    for config, samples in rows.items():
        shards.append(rf.write_shard(root, config, 0, samples).to_dict())
        tally = rf.Tally()
        for sample in samples:
            tally.add(sample.label, None)
        counts[config] = tally.to_dict()
    manifest = {
        "format_version": rf.FORMAT_VERSION, "name": "gen", "version": "1.0.0",
        "tool": {"name": "lance-counterfactuals", "version": "0"}, "image_format": "png",
        "configs": list(spec.names), "empty_configs": [], "release_spec": spec.to_dict(), "config": {},
        "config_hash": "sha256:0", "seed": 0,
        "source": {"spec": "demo", "kind": "demo", "num_samples": 2, "imagenet_derived": False, "license": "mit"},
        "label_space": {"name": "custom", "num_classes": 2, "names": names}, "stages": {}, "packages": {},
        "counts": counts, "failures": [], "shards": shards, "assets": [],
    }  # fmt: skip
    rf.seal_manifest(manifest)
    (root / rf.MANIFEST_NAME).write_bytes(rf.canonical_json(manifest))
    (root / rf.TIMM_INFO_NAME).write_bytes(rf.canonical_json(rf.timm_info(manifest)))
    text = render_release_card(root, manifest)
    write_release_croissant(root, manifest)
    assert rf.verify_release(root) == []
    assert "generated images of each class in snow" in text and "| `shift_snow` | `shift` | string |" in text
    schema = rf.metadata_json_schema(spec, "shift_snow")
    assert schema["properties"]["shift"] == {"enum": ["snow", "fog", None]}
    ds = datasets.load_dataset(str(root), "shift_snow", split="test")
    assert ds[0]["json"]["shift"] == "snow" and ds[0]["json"]["clip_shift_score"] == 1.0
    assert ds.features["cls"].names == names


def _png(seed: int) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (seed * 40 % 256, 10, 20)).save(buf, format="PNG")
    return buf.getvalue()


# ------------------------------------------------------------------------------------ what a loaded row carries
def test_datasets_and_timm_read_a_release_with_class_names(carded):
    import datasets
    import timm.data

    ds = datasets.load_dataset(str(carded), "counterfactual", split="test")
    assert ds.column_names == ["__key__", "__url__", "cls", "png", "json"]  # every column the card documents
    assert ds.features["cls"].names == ["cat", "dog", "zebra"]
    flat = ds.flatten()
    assert {"json.edit_type", "json.source_key", "json.label_name"} <= set(flat.column_names)
    weather = ds.filter(lambda row: row["json"]["edit_type"] == "weather")
    assert len(weather) == sum(1 for t in flat["json.edit_type"] if t == "weather") > 0
    text = (carded / rf.CARD_NAME).read_text()
    assert "| `__url__` | string |" in text and "ds.flatten()" in text
    timm_ds = timm.data.create_dataset("wds/lance", root=str(carded), split="counterfactual", input_img_mode="RGB")
    image, label = next(iter(timm_ds))
    assert image.size == (48, 48) and label in (0, 1, 2) and len(timm_ds) == len(ds)


def test_class_label_names_are_made_unique():
    assert rf.class_label_names(["crane", "tench", "crane"]) == ["crane (0)", "tench", "crane (2)"]


def test_reader_checks_the_manifest_hash_while_streaming(tmp_path):
    root = write_release(tmp_path / "r", label_names=["cat", "dog"], labels=(0, 1), edits_per_original=1)
    shard = rf.load_manifest(root).shards[0]
    path = root / shard.path
    samples = list(rf.iter_shard(path, expected_sha256=shard.sha256))
    assert len(samples) == shard.samples
    data = bytearray(path.read_bytes())
    data[600] ^= 0xFF  # inside the first member's data: same length, still a valid tar
    path.write_bytes(bytes(data))
    read = []
    with pytest.raises(rf.ShardIntegrityError, match="modified after it was built"):
        for item in rf.iter_shard(path, expected_sha256=shard.sha256):
            read.append(item)
    assert len(read) == shard.samples  # every sample was streamed before the mismatch was known


def test_reader_modes_evaluation_needs_limit_striding_and_failed_samples(tmp_path):
    """The one reader serves evaluation: a limit (the rest still hashed), striding workers that together see every
    sample once, and a broken shard that fails the sample being read instead of raising."""
    root = write_release(tmp_path / "r", label_names=["cat", "dog"], labels=(0, 1), originals_per_class=3, shard_size=5)
    shard = next(s for s in rf.load_manifest(root).shards if s.samples == 5)
    path = root / shard.path
    every = [key for key, _ in rf.iter_shard(path)]
    # --limit 2: two samples, and the whole file is still hashed (a changed byte after them is caught)
    assert [k for k, _ in rf.iter_shard(path, limit=2, expected_sha256=shard.sha256)] == every[:2]
    assert [k for k, _ in rf.iter_shard(path, limit=2)] == every[:2]
    # two workers striding from a running index: each sample belongs to exactly one
    owned = [
        [k for k, m in rf.iter_shard(path, select=lambda i, w=w: i % 2 == w, start_index=7) if m is not None]
        for w in (0, 1)
    ]
    assert sorted(owned[0] + owned[1]) == sorted(every) and not set(owned[0]) & set(owned[1])
    # truncated: the sample being read fails as data, the earlier ones are read, then the hash check fails
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    items = []
    with pytest.raises(rf.ShardIntegrityError):
        for item in rf.iter_shard(path, errors="sample", name=shard.path, expected_sha256=shard.sha256):
            items.append(item)
    assert isinstance(items[-1][1], rf.UnreadableSample) and items[-1][0] in every
    assert "truncated or corrupt" in items[-1][1].reason and shard.path in items[-1][1].reason
    assert all(isinstance(m, dict) for _, m in items[:-1]) and [k for k, _ in items[:-1]] == every[: len(items) - 1]
    with pytest.raises(ValueError, match="not a valid tar archive"):
        list(rf.iter_shard(path))  # verify's mode: an error
    # not a tar at all: one failed sample, key unknown
    path.write_bytes(b"not a tar archive" * 40)
    assert [(k, type(m).__name__) for k, m in rf.iter_shard(path, errors="sample")] == [("?", "UnreadableSample")]


def test_verify_accepts_a_card_config_outside_the_data_but_not_one_inside(carded):
    import yaml

    card = carded / rf.CARD_NAME
    text = card.read_text()
    end = text.index("\n---", 4)
    header = yaml.safe_load(text[4:end])
    for path, ok in (("results/leaderboard.tar", True), ("data/extra/test-*.tar", False)):
        changed = {**header, "configs": [*header["configs"], {"config_name": "extra", "data_files": path}]}
        changed["configs"][-1]["data_files"] = [{"split": "train", "path": path}]
        card.write_text(f"---\n{yaml.safe_dump(changed, sort_keys=False)}{text[end + 1 :]}")
        problems = rf.verify_release(carded)
        assert (problems == []) is ok, (path, problems)


def test_a_v1_release_written_by_the_v1_code_is_still_read(tmp_path):
    """tests/data/v1-release was written by the v1 code (release_format.py and release_fixture.py of commit c0d9eb5:
    USTAR tars with members in png/cls/json order, a v1 manifest and card). verify, the card and eval read it."""
    import shutil

    from dataset_cards import render_release_card
    from evaluation.release_reader import open_release

    root = shutil.copytree(REPO / "tests" / "data" / "v1-release", tmp_path / "v1")
    manifest = rf.load_manifest(root)
    assert manifest.format_version == 1 and manifest.release_spec == rf.V1_SPEC
    assert rf.verify_release(root) == []
    release = open_release(root)
    assert release.configs == list(rf.CONFIG_NAMES)
    samples = [s for _, s in rf.iter_shard(release.shards["counterfactual"][0], errors="sample")]
    assert len(samples) == manifest.counts["counterfactual"]["total"] and all("json" in s for s in samples)
    text = render_release_card(root, manifest.to_dict())
    assert "- Source: `fixture`" in text and rf.verify_release(root) == []
