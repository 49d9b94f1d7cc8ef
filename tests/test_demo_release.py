"""The offline demo preset end to end: every stage on tiny local models, all four configs, complete metadata."""

from __future__ import annotations

import json

import pytest
from builder_helpers import METHOD_STAGES, cli, release_files

from builder.release_format import CONFIG_NAMES, EDIT_TYPES, SCORE_NAMES
from builder.release_format.verify import verify_release

pytestmark = pytest.mark.e2e  # the demo preset built through the CLI


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    out = root / "release"
    cli("build", "demo", "--output", str(out), "--no-progress", "--device", "cpu")
    return out


def test_demo_populates_all_configs_with_complete_metadata(demo, tmp_path):
    import datasets

    assert verify_release(demo) == []
    manifest = json.loads((demo / "manifest.json").read_text())
    assert manifest["failures"] == []
    counts = {c: manifest["counts"][c]["total"] for c in CONFIG_NAMES}
    assert counts["original"] == counts["reconstructed"] == 5
    assert counts["counterfactual"] >= 5 and counts["lance_r"] >= 5
    assert set(manifest["stages"]) == METHOD_STAGES
    rows = {
        c: list(datasets.load_dataset(str(demo), c, split="test", cache_dir=str(tmp_path / "hf"))) for c in CONFIG_NAMES
    }
    originals = {r["__key__"]: r for r in rows["original"]}
    for row in rows["original"] + rows["reconstructed"]:
        meta = row["json"]
        assert meta["caption"].startswith("a photo of")
        assert meta["edit_type"] is None and meta["edited_caption"] is None
    for config in ("counterfactual", "lance_r"):
        for row in rows[config]:
            meta = row["json"]
            assert meta["source_key"] in originals
            assert meta["caption"] == originals[meta["source_key"]]["json"]["caption"]
            assert meta["edited_caption"] and meta["edited_caption"] != meta["caption"]
            assert meta["edited_span"] is not None and meta["original_span"] is not None
            assert 0.0 <= meta["self_replace"] <= 1.0
            clip_scores = ["clip_directional", "clip_image", "clip_text_original", "clip_text_edited"]
            assert all(isinstance(meta["scores"][s], float) for s in clip_scores)
            assert row["png"].size == (64, 64)
    for row in rows["counterfactual"] + rows["lance_r"]:
        assert row["json"]["editor"] == "prompt_to_prompt"  # which editor rendered it (comparable with ControlNet's)
    for row in rows["counterfactual"]:
        meta = row["json"]
        assert meta["edit_type"] in EDIT_TYPES
        assert all(isinstance(meta["scores"][s], float) for s in SCORE_NAMES)
    assert {r["json"]["edit_type"] for r in rows["lance_r"]} == {None}
    card = (demo / "README.md").read_text()
    assert "reconstructions and counterfactuals are noise" in card
    assert manifest["stages"]["caption"]["model"] == "demo:tiny-blip2"
    for name in ("manifest.json", "README.md"):
        assert "demo-components" not in (demo / name).read_text()


def test_demo_rebuild_is_byte_identical(demo, tmp_path, monkeypatch):
    """Same inputs and config, every model stage included: identical shards, manifest and card, even with the tiny
    models rebuilt in another cache directory (the release names them demo:NAME, never a local path)."""
    monkeypatch.setenv("LANCE_CF_CACHE", str(tmp_path / "other-cache"))
    again = tmp_path / "again"
    cli("build", "demo", "--output", str(again), "--no-progress", "--device", "cpu")
    assert release_files(again) == release_files(demo)


def test_demo_croissant_reads_as_datasets_does(demo, tmp_path):
    """mlcroissant reads every config of the demo through croissant.json: same images, labels and metadata."""
    from croissant_check import assert_croissant_matches_datasets

    counts = json.loads((demo / "manifest.json").read_text())["counts"]
    assert assert_croissant_matches_datasets(demo, tmp_path) == sum(c["total"] for c in counts.values())


def test_demo_strength_config_is_every_candidate_linked_to_its_counterfactual_and_original(demo, tmp_path):
    """The demo keeps every candidate of the sweep (keep_candidates): with its gates opened, each kept edit appears
    once per self-attention fraction, strength = 1 - self_replace, and the selected one is its counterfactual."""
    import datasets

    from lance_pipeline.editing.options import DEFAULT_SELF_REPLACE_SWEEP

    manifest = json.loads((demo / "manifest.json").read_text())
    assert manifest["stages"]["edit"]["prompt_to_prompt"]["keep_candidates"] is True
    load = {c: datasets.load_dataset(str(demo), c, split="test", cache_dir=str(tmp_path / "hf")) for c in CONFIG_NAMES}
    strength = datasets.load_dataset(str(demo), "strength", split="test", cache_dir=str(tmp_path / "hf"))
    assert strength.features["json"]["strength"].dtype == "float64"
    assert strength.features["json"]["selected"].dtype == "bool"
    counterfactuals = {r["__key__"]: r for r in load["counterfactual"]}
    originals = {r["__key__"] for r in load["original"]}
    by_edit: dict[str, list] = {}
    for row in strength:
        meta = row["json"]
        assert meta["source_key"] in originals
        assert meta["counterfactual_key"] in counterfactuals
        assert meta["strength"] == round(1 - meta["self_replace"], 10)
        assert meta["editor"] == "prompt_to_prompt" and meta["edit_type"] in EDIT_TYPES
        cf = counterfactuals[meta["counterfactual_key"]]["json"]
        assert (meta["source_key"], meta["edited_caption"], meta["edit_type"]) == (
            cf["source_key"],
            cf["edited_caption"],
            cf["edit_type"],
        )
        by_edit.setdefault(meta["counterfactual_key"], []).append(row)
    assert set(by_edit) == set(counterfactuals)
    for key, rows in by_edit.items():
        assert sorted(r["json"]["self_replace"] for r in rows) == sorted(DEFAULT_SELF_REPLACE_SWEEP)
        (selected,) = [r for r in rows if r["json"]["selected"]]
        assert selected["png"].tobytes() == counterfactuals[key]["png"].tobytes()
        assert selected["json"]["scores"] == counterfactuals[key]["json"]["scores"]
