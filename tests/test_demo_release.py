"""The offline demo preset end to end: every stage on tiny local models, all four configs, complete metadata."""

from __future__ import annotations

import json

import pytest
from builder_helpers import (
    MEASURE_STAGES,
    METHOD_STAGES,
    SCREEN_STAGES,
    STRENGTH_SCREENS,
    cli,
    release_files,
)

from builder.cli import main
from builder.release_format import CONFIG_NAMES, EDIT_TYPES, SCORE_NAMES
from builder.release_format.verify import verify_release

pytestmark = pytest.mark.e2e  # the demo preset built through the CLI


@pytest.fixture(scope="module")
def demo(shared_release):
    """The demo as ``lance-cf build demo`` makes it (each model shared by the stages that use it), built once for the
    session; the tests here only read it."""
    return shared_release("demo")


def test_demo_populates_all_configs_with_complete_metadata(demo, tmp_path):
    import datasets

    assert verify_release(demo) == []
    manifest = json.loads((demo / "manifest.json").read_text())
    assert manifest["failures"] == []
    counts = {c: manifest["counts"][c]["total"] for c in CONFIG_NAMES}
    assert counts["original"] == counts["reconstructed"] == 5
    assert counts["counterfactual"] >= 5 and counts["lance_r"] >= 5
    assert set(manifest["stages"]) == METHOD_STAGES | SCREEN_STAGES | STRENGTH_SCREENS | MEASURE_STAGES
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
        # preservation against the source image (no masks in the demo: the outside fields are null)
        assert 0.0 < meta["preservation_lpips"] and -1.0 <= meta["preservation_ssim"] < 1.0
        assert meta["preservation_psnr"] > 0 and meta["preservation_psnr_outside"] is None
    assert {r["json"]["edit_type"] for r in rows["lance_r"]} == {None}
    card = (demo / "README.md").read_text()
    assert "reconstructions and counterfactuals are noise" in card
    assert manifest["stages"]["caption"]["model"] == "demo:tiny-blip2"
    for name in ("manifest.json", "README.md"):
        assert "demo-components" not in (demo / name).read_text()


def test_demo_rebuild_is_byte_identical(demo, shared_release, tmp_path, monkeypatch):
    """Same inputs and config, every model stage included: identical shards, manifest and card, even with the tiny
    models rebuilt in another cache directory (the release names them demo:NAME, never a local path). The reference
    shares each model between the stages that use it (the label check and three sensitive-edit screens: one
    all-MiniLM-L6-v2; four safety stages: one checker); the rebuild loads one per stage: same bytes."""
    monkeypatch.setenv("LANCE_CF_CACHE", str(tmp_path / "other-cache"))
    again = tmp_path / "again"
    # In this process (a new one would import torch, diffusers and transformers again: seconds of CPU), with the
    # counting hooks and the unshared map tests/load_counter.py installs in its own, undone when the test ends.
    unshared = _counting_loads_here(monkeypatch, "build", "demo", "--output", str(again), "--no-progress",
                                    "--device", "cpu")  # fmt: skip
    loads = shared_release.loads("demo")
    # The hook sees every load: label_check, screen, screen_lance_r and screen_strength each loaded their own.
    assert sum(unshared["sentence-transformers"].values()) == 4
    assert sum(loads["sentence-transformers"].values()) == 1  # all-MiniLM-L6-v2, once for four stages
    assert loads["safety-checker"] == {"tiny-safety-checker": 1}
    assert loads["stable-diffusion-unet"] == {"tiny-stable-diffusion": 1}
    assert release_files(again) == release_files(demo)


def _counting_loads_here(monkeypatch, *args: str) -> dict[str, dict[str, int]]:
    """``lance-cf ARGS`` in this process with every model load counted and no model shared between stages, as
    ``python tests/load_counter.py COUNTS --unshared -- ARGS`` counts them in a new one; the counts per model."""
    from collections import Counter

    import load_counter
    import sentence_transformers
    from diffusers import UNet2DConditionModel
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker

    from lance_pipeline.models import shared as shared_models

    counts = {kind: Counter() for kind in load_counter.COUNTS}
    monkeypatch.setattr(load_counter, "COUNTS", counts)
    # What install_hooks replaces, recorded so that monkeypatch puts it back (a class's own attribute, or none).
    monkeypatch.setattr(sentence_transformers, "SentenceTransformer", sentence_transformers.SentenceTransformer)
    for cls in (UNet2DConditionModel, StableDiffusionSafetyChecker):
        monkeypatch.setattr(cls, "from_pretrained", cls.from_pretrained)
    load_counter.install_hooks()
    monkeypatch.setattr(shared_models, "_SHARED", load_counter._NoSharing())
    assert main(list(args)) == 0
    return {kind: dict(counter) for kind, counter in counts.items()}


def test_demo_croissant_reads_as_datasets_does(demo, tmp_path):
    """mlcroissant reads every config of the demo through croissant.json: same images, labels and metadata."""
    from croissant_check import assert_croissant_matches_datasets

    counts = json.loads((demo / "manifest.json").read_text())["counts"]
    assert assert_croissant_matches_datasets(demo, tmp_path) == sum(c["total"] for c in counts.values())


def test_clip_benchmark_reads_the_demo_like_datasets(demo, tmp_path, lance_cf):
    """CLIP_benchmark's own wds/ builder on the exported demo: every config (strength included), images and labels
    equal to what datasets reads; the demo's ImageNet label space gives CLIP's 1,000 class names."""
    pytest.importorskip("clip_benchmark")
    from test_clip_benchmark_export import assert_clip_benchmark_reads_like_datasets

    classes = assert_clip_benchmark_reads_like_datasets(demo, tmp_path / "cb", lance_cf, tmp_path / "hf")
    assert len(classes) == 1000


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


def test_demo_eval_reports_accuracy_against_strength_as_its_predictions_imply(demo, tmp_path):
    """lance-cf eval on the demo: the strength section, each image's failure point, both plots and the leaderboard
    column, checked against the per-sample predictions it wrote. A class map makes the random model right on the
    originals (its own top-1 on each original becomes that image's label), so failure points are defined."""
    import pandas as pd

    # timm's test_resnet (random weights, 160 px): what is checked is the harness's arithmetic on its predictions,
    # which does not depend on the model's size (resnet18 at 224 px cost most of the test's CPU time).
    args = ["--model", "test_resnet", "--no-pretrained", "--device", "cpu", "--workers", "0", "--no-insights"]
    args += ["--no-report", "--bootstrap", "50"]
    # The first run only gives the originals' predictions, which --limit keeps (the demo has five originals).
    cli("eval", "--release", str(demo), "--output", str(tmp_path / "first"), "--limit", "5", *args)
    name = json.loads((demo / "manifest.json").read_text())["name"]  # eval writes under OUTPUT/<release name>/
    first = pd.read_parquet(tmp_path / "first" / name / "test_resnet__random" / "predictions.parquet")
    indices = list(range(1000))  # a permutation: label L is scored by the model output its original got
    for label, top in first[first["config"] == "original"][["label", "top5"]].itertuples(index=False):
        target, current = int(top[0]), indices.index(int(top[0]))
        if current not in set(first["label"]):  # keep the labels already placed
            indices[label], indices[current] = target, indices[label]
    (tmp_path / "map.txt").write_text("\n".join(map(str, indices)) + "\n")
    printed = cli(
        "eval",
        "--release",
        str(demo),
        "--output",
        str(tmp_path / "eval"),
        "--class-map",
        str(tmp_path / "map.txt"),
        *args,
    )
    out = tmp_path / "eval" / name
    results = json.loads((out / "test_resnet__random" / "results.json").read_text())
    rows = pd.read_parquet(out / "test_resnet__random" / "predictions.parquet")
    section = results["strength"]
    originals = rows[rows["config"] == "original"].set_index("source_key")
    assert originals["correct1"].any()  # the class map put at least one original right
    strength = rows[rows["config"] == "strength"]
    assert (
        section["n"] == len(strength) == json.loads((demo / "manifest.json").read_text())["counts"]["strength"]["total"]
    )
    for point in section["overall"]["pooled"]["curve"]:  # every sample at each strength
        at = strength[(strength["strength"] - point["strength"]).abs() < 1e-9]
        assert point["n"] == len(at) and point["acc1"] == pytest.approx(100 * at["correct1"].mean())
        orig_p = originals.loc[at["source_key"], "p_gt"].to_numpy()
        assert point["delta_p_gt_mean"] == pytest.approx(100 * (orig_p - at["p_gt"].to_numpy()).mean())
    # the headline: the edits with a sample at every strength, the same ones at each
    levels = strength.groupby("counterfactual_key")["strength"].nunique()
    complete = levels[levels == len(section["overall"]["levels"])].index
    assert section["overall"]["headline"]["n_series"] == len(complete) > 0
    for point in section["overall"]["curve"]:
        at = strength[strength["counterfactual_key"].isin(complete)]
        at = at[(at["strength"] - point["strength"]).abs() < 1e-9]
        assert point["n"] == len(at) == len(complete) and point["acc1"] == pytest.approx(100 * at["correct1"].mean())
    for source_key, entry in section["images"].items():
        assert entry["original_correct"] == bool(originals.loc[source_key, "correct1"])
        wrong = strength[(strength["source_key"] == source_key) & ~strength["correct1"]]["strength"]
        expected = wrong.min() if entry["original_correct"] and len(wrong) else None
        assert entry["failure_point"] == (None if expected is None else pytest.approx(expected))
    assert (out / "test_resnet__random" / "strength.png").is_file() and (out / "strength.png").is_file()
    assert "test_resnet (random weights) strength: acc@1 area" in printed.stdout
    cli("leaderboard", str(out), "--output", str(tmp_path / "board"))
    table = pd.read_csv(tmp_path / "board" / "leaderboard.csv")
    assert table.loc[0, "strength_auc"] == pytest.approx(section["overall"]["auc_acc1"])
    assert (tmp_path / "board" / "strength.png").is_file()


def test_review_apply_on_the_demo_release_keeps_every_sample_verifies_and_loads(demo, tmp_path):
    """Judgements of two reviewers folded into the next version: every sample kept, the review in each sample's
    metadata, accepted and rejected configs, verify passes, `datasets` loads every config, and applying the same
    judgements again gives the same bytes."""
    import shutil

    import datasets

    from builder import release_format as rf
    from builder.review.store import JudgementStore
    from builder.review.study import QUESTIONS, Study

    release = tmp_path / "reviewed-from"
    shutil.copytree(demo, release)
    before = rf.load_manifest(release)
    store = JudgementStore(release, before.manifest_sha256)
    study = Study(name="demo", questions=(QUESTIONS["still_class"],))
    store.save_study("demo", study.to_dict())
    keys = [("counterfactual", k) for k in _keys_of(release, "counterfactual")]
    plan = {"alice": ["accept", "reject", "accept", "flag"], "bob": ["accept", "reject", "reject", "accept"]}
    for reviewer, verdicts in plan.items():
        for (config, key), verdict in zip(keys, verdicts, strict=False):
            reason = "the edit is not visible" if verdict == "reject" else None
            store.record("demo", reviewer, config, key, {"still_class": "yes", "verdict": verdict}, reason)
    outputs = []
    for name in ("v1", "v2"):  # the command in this process: its imports are paid once
        assert main(["review", "apply", str(release), "--output", str(tmp_path / name)]) == 0
        outputs.append(tmp_path / name)
    assert release_files(outputs[0]) == release_files(outputs[1])  # byte-deterministic
    out = outputs[0]
    assert verify_release(out) == []
    after = json.loads((out / "manifest.json").read_text())
    assert after["version"] == "1.1.0" and after["configs"] == [*before.configs, "review_accepted", "review_rejected"]
    for config in before.configs:
        assert after["counts"][config] == before.counts[config]  # every sample kept
    assert after["review"]["verdicts"] == {
        "accepted": 1, "rejected": 1, "flagged": 2, "unreviewed": len(keys) - 4,
    }  # fmt: skip
    assert after["review"]["raters"] == 2 and after["review"]["agreement"]["verdict"]["items"] == 4
    for config in after["configs"]:
        rows = list(datasets.load_dataset(str(out), config, split="test", cache_dir=str(tmp_path / "hf")))
        assert len(rows) == after["counts"][config]["total"]
        if config == "review_rejected":
            assert [r["json"]["review_reasons"] for r in rows] == ["the edit is not visible"]
            assert rows[0]["json"]["review_config"] == "counterfactual"
        if config == "counterfactual":
            verdicts = sorted(r["json"]["review_verdict"] for r in rows)
            assert verdicts.count("unreviewed") == len(keys) - 4 and verdicts.count("flagged") == 2
    card = (out / "README.md").read_text()
    assert "## Human review" in card and "| rejected | 1 |" in card and "Changes from v1.0.0 to v1.1.0" in card
    from croissant_check import assert_croissant_matches_datasets

    assert assert_croissant_matches_datasets(out, tmp_path / "croissant") == sum(
        c["total"] for c in after["counts"].values()
    )  # croissant.json follows the declared review fields and configs
    croissant = json.loads((out / "croissant.json").read_text())
    assert croissant["rai:dataAnnotationProtocol"][0].startswith("2 people reviewed samples of counterfactual")


def _keys_of(release, config):
    from builder import release_format as rf

    manifest = rf.load_manifest(release)
    return sorted(key for shard in manifest.shards_of(config) for key, _ in rf.iter_shard(release / shard.path))
