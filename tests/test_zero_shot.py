"""Zero-shot CLIP classifiers in ``lance-cf eval``: scored through the same harness as timm models.

The model is the tiny random-weight open_clip export of ``lance_pipeline.tiny`` loaded as ``open_clip:DIR`` (the same
loader as a pretrained tag). The expected probabilities are computed independently here: open_clip's own model and
preprocessing, CLIP's zero-shot rule written out (mean of the normalised prompt embeddings, normalised; logits
``logit_scale * cos``).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from release_fixture import write_release
from test_eval_harness import read_release_images

from evaluation.harness import EvalOptions
from evaluation.models import ModelSpec
from evaluation.zero_shot import SIMPLE_TEMPLATE, class_names_for, load_template_set
from lance_pipeline.tiny.clip_components import create_tiny_open_clip

NAMES = ["cat", "dog", "fire truck", "tree"]
REL = "lance-fixture"


def independent_probs(clip_dir, samples, templates: list[str]) -> dict[str, np.ndarray]:
    import open_clip

    model, preprocess = open_clip.create_model_from_pretrained("local-dir:" + str(clip_dir))
    tokenizer = open_clip.get_tokenizer("local-dir:" + str(clip_dir))
    model.eval()
    with torch.no_grad():
        columns = []
        for name in NAMES:
            text = model.encode_text(tokenizer([t.format(name) for t in templates]))
            text = text / text.norm(dim=-1, keepdim=True)
            mean = text.mean(0)
            columns.append(mean / mean.norm())
        weights = torch.stack(columns, 1)
        probs = {}
        for items in samples.values():
            for meta, image in items:
                feat = model.encode_image(preprocess(image)[None])
                feat = feat / feat.norm(dim=-1, keepdim=True)
                logits = model.logit_scale.exp() * feat @ weights
                probs[meta["key"]] = logits.softmax(-1)[0].numpy()
    return probs


@pytest.fixture(scope="module")
def zero_shot_run(tmp_path_factory, cli, single_thread_torch):
    import os

    root = write_release(tmp_path_factory.mktemp("release") / "rel", labels=(0, 1, 2, 3), label_names=NAMES,
                         originals_per_class=2, edits_per_original=2)  # fmt: skip
    clip_dir = create_tiny_open_clip(tmp_path_factory.mktemp("clip") / "tinyclip")
    out = tmp_path_factory.mktemp("eval")
    cache = tmp_path_factory.mktemp("cache")
    old = os.environ.get("LANCE_CF_CACHE")
    os.environ["LANCE_CF_CACHE"] = str(cache)
    args = cli.parse(
        ["eval", "--release", str(root), "--model", f"open_clip:{clip_dir}", "--templates", "simple"]
        + ["--templates", "openai", "--output", str(out), "--bootstrap", "20", "--no-insights", "--workers", "0"]
    )
    assert args.func(args) == 0
    yield {"root": root, "clip_dir": clip_dir, "out": out, "cache": cache, "cli": cli}
    if old is None:
        os.environ.pop("LANCE_CF_CACHE")
    else:
        os.environ["LANCE_CF_CACHE"] = old


def _results(run, templates: str):
    spec = ModelSpec(f"open_clip:{run['clip_dir']}", templates=load_template_set(templates))
    folder = run["out"] / REL / spec.slug
    return json.loads((folder / "results.json").read_text()), pd.read_parquet(folder / "predictions.parquet")


@pytest.mark.slow
@pytest.mark.parametrize("templates", ["simple", "openai"])
def test_zero_shot_probabilities_match_clip_rule(zero_shot_run, templates):
    results, predictions = _results(zero_shot_run, templates)
    samples = read_release_images(zero_shot_run["root"])
    expected = independent_probs(zero_shot_run["clip_dir"], samples, list(load_template_set(templates).templates))
    assert len(predictions) == sum(len(v) for v in samples.values())
    for row in predictions.itertuples():
        probs = expected[row.key]
        assert row.p_gt == pytest.approx(float(probs[row.label]), abs=2e-4)
        assert row.correct1 == (int(np.argmax(probs)) == row.label)
    # the same metrics a timm model gets, computed by the same harness
    assert results["status"] == "ok" and results["model"]["num_classes"] == 4
    assert "counterfactual" in results["metrics"] and "acc1" in results["metrics"]["counterfactual"]
    assert (zero_shot_run["out"] / REL / results["model"]["slug"] / "report.html").is_file()


@pytest.mark.slow
def test_results_record_templates_class_names_and_no_machine_path(zero_shot_run):
    simple, _ = _results(zero_shot_run, "simple")
    openai, _ = _results(zero_shot_run, "openai")
    zs = simple["model"]["zero_shot"]
    assert zs["templates"] == {"name": "simple", "digest": load_template_set("simple").digest, "count": 1}
    assert openai["model"]["zero_shot"]["templates"]["count"] == 80
    assert zs["class_names"]["source"] == "release label_space.names"
    assert simple["model"]["name"] == "open_clip:local-dir:tinyclip"
    assert str(zero_shot_run["clip_dir"].parent) not in json.dumps(simple)
    assert simple["model"]["slug"] != openai["model"]["slug"]
    assert simple["run"]["key"] != openai["run"]["key"]
    # the text classifier is cached under a digest of (text weights, templates, class names)
    cached = {p.stem for p in (zero_shot_run["cache"] / "zero-shot").glob("*.safetensors")}
    assert cached == {zs["classifier_sha256"], openai["model"]["zero_shot"]["classifier_sha256"]}


@pytest.mark.slow
def test_cached_classifier_is_reused(zero_shot_run, monkeypatch):
    import open_clip

    from evaluation.zero_shot import create_zero_shot_model

    def refuse(*args, **kwargs):
        raise AssertionError("the cached classifier should have been used")

    monkeypatch.setattr(open_clip, "build_zero_shot_classifier", refuse)
    model = create_zero_shot_model(
        f"open_clip:{zero_shot_run['clip_dir']}", load_template_set("simple"), NAMES, "custom"
    )
    simple, _ = _results(zero_shot_run, "simple")
    assert model.zero_shot_info["classifier_sha256"] == simple["model"]["zero_shot"]["classifier_sha256"]
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 4)


def test_template_sets_and_class_names():
    openai = load_template_set("openai")
    assert len(openai.templates) == 80 and openai.templates[0] == "a bad photo of a {}."
    assert load_template_set("simple").templates == (SIMPLE_TEMPLATE,)
    names, source = class_names_for([f"n{i}" for i in range(1000)], "imagenet-1k")
    assert source == "open_clip.zero_shot_metadata.IMAGENET_CLASSNAMES" and names[0] == "tench"
    assert class_names_for(NAMES, "custom") == (NAMES, "release label_space.names")


def test_template_file_and_bad_input(tmp_path):
    path = tmp_path / "mine.txt"
    path.write_text("a photo of a {c}.\n# comment\n\nart of the {}.\n")
    assert load_template_set(str(path)).templates == ("a photo of a {}.", "art of the {}.")
    path.write_text("no marker here\n")
    with pytest.raises(ValueError, match="class-name marker"):
        load_template_set(str(path))
    with pytest.raises(ValueError, match="neither a template set"):
        load_template_set(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="zero-shot"):
        ModelSpec("resnet18", templates=load_template_set("simple"))
    with pytest.raises(ValueError, match="open_clip:ARCH/PRETRAINED"):
        ModelSpec("open_clip:ViT-B-32")


def test_declared_models_name_the_clip_weights(cli):
    from evaluation.cli import declared_models

    args = cli.parse(["eval", "--release", "x", "--model", "open_clip:ViT-B-32/laion2b_s34b_b79k", "--output", "o",
                      "--no-insights"])  # fmt: skip
    needs = declared_models(args)
    assert len(needs) == 1 and "zero-shot classifier" in needs[0].role
    args = cli.parse(["eval", "--release", "x", "--model", "open_clip:ViT-B-32/openai", "--no-pretrained",
                      "--output", "o", "--no-insights"])  # fmt: skip
    assert declared_models(args) == []


@pytest.mark.slow
def test_random_weights_are_seeded(single_thread_torch):
    from evaluation.zero_shot import create_zero_shot_model

    simple = load_template_set("simple")
    a = create_zero_shot_model("open_clip:RN50/openai", simple, NAMES, "custom", pretrained=False, seed=3)
    b = create_zero_shot_model("open_clip:RN50/openai", simple, NAMES, "custom", pretrained=False, seed=3)
    assert torch.equal(a.classifier, b.classifier)
    assert a.pretrained_cfg["input_size"] == (3, 224, 224) and a.zero_shot_info["clip"]["source"] == "random"


TIMM_RESULTS = "/work/shared/data/timm-results/results-imagenet.csv"


@pytest.fixture(scope="module")
def board(zero_shot_run, tmp_path_factory):
    from evaluation.leaderboard import write_leaderboard

    out = tmp_path_factory.mktemp("board")
    written = write_leaderboard([zero_shot_run["out"]], out, n_boot=200, seed=0)
    return {"out": out, "written": written}


@pytest.mark.slow
def test_leaderboard_has_template_columns_note_and_sensitivity(zero_shot_run, board):
    simple, simple_pred = _results(zero_shot_run, "simple")
    openai, _ = _results(zero_shot_run, "openai")
    df = pd.read_csv(board["out"] / "leaderboard.csv")
    assert sorted(df["templates"]) == ["openai", "simple"]
    assert set(df["templates_digest"]) == {load_template_set(t).digest for t in ("openai", "simple")}
    markdown = (board["out"] / "leaderboard.md").read_text()
    assert "different prompt template sets (openai, simple)" in markdown
    from dataset_cards.markdown import md_escape

    # a local folder is named by its folder name and its files' digest
    digest = simple["model"]["weights"]["id"].rsplit(":", 1)[-1][:12]
    assert md_escape(f"tinyclip ({digest}) [simple templates]") in markdown and "## Template sensitivity" in markdown
    table = pd.read_csv(board["out"] / "template_sensitivity.csv")
    assert len(table) == 1
    row = table.iloc[0]
    a, b = (openai, simple) if row["templates_a"] == "openai" else (simple, openai)
    # the point estimates are the two results' own figures
    for res, suffix in ((a, "a"), (b, "b")):
        overall = res["sensitivity"]["overall"]
        assert row[f"paired_top1_diff_{suffix}"] == pytest.approx(overall["paired_delta_acc1"])
        assert row[f"original_top1_{suffix}"] == pytest.approx(overall["orig_acc1"])
    assert row["delta_paired_top1_diff"] == pytest.approx(row["paired_top1_diff_b"] - row["paired_top1_diff_a"])
    assert row["delta_original_top1_ci_low"] <= row["delta_original_top1"] <= row["delta_original_top1_ci_high"]
    assert (board["out"] / "template_sensitivity.png").is_file()
    assert "Template sensitivity" in (board["out"] / "leaderboard.html").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("where", ["eval", "leaderboard"])
def test_timm_format_csv_reads_like_timm_results(zero_shot_run, board, where):
    folder = zero_shot_run["out"] / REL if where == "eval" else board["out"]
    timm = pd.read_csv(TIMM_RESULTS)
    for config in ("original", "reconstructed", "counterfactual", "lance_r"):
        ours = pd.read_csv(folder / f"results-{REL}-{config}.csv")
        assert list(ours.columns[:9]) == list(timm.columns[:9])
        for column in ("img_size", "top1", "top1_err", "param_count", "crop_pct"):
            assert pd.api.types.is_numeric_dtype(ours[column]), column
        assert list(ours["top1"]) == sorted(ours["top1"], reverse=True)
        assert (ours["top1"] + ours["top1_err"]).round(3).eq(100.0).all()
        simple, _ = _results(zero_shot_run, "simple")
        mine = ours[ours["templates"] == "simple"].iloc[0]
        assert mine["top1"] == pytest.approx(simple["metrics"][config]["acc1"], abs=5e-4)
        assert mine["interpolation"] == "bicubic" and mine["img_size"] == 32


def test_new_weights_in_the_same_open_clip_folder_are_a_new_result(tmp_path):
    """open_clip:DIR is identified by its files' digest: other weights in the same folder change the weights id, the
    run key (so eval never skips them as already evaluated) and the results folder; the machine path is never in
    the id."""
    from safetensors.torch import load_file, save_file

    from evaluation.harness import run_key
    from evaluation.release_reader import open_release
    from lance_pipeline.tiny.clip_components import WEIGHTS_NAME

    clip_dir = create_tiny_open_clip(tmp_path / "tinyclip")
    release = open_release(write_release(tmp_path / "rel", labels=(0, 1), label_names=NAMES[:2], edits_per_original=1))
    before = ModelSpec(f"open_clip:{clip_dir}", templates=load_template_set("simple"))
    assert before.weights_id.startswith("local-dir:sha256:") and str(tmp_path) not in before.weights_id
    weights = load_file(clip_dir / WEIGHTS_NAME)
    weights["logit_scale"] = weights["logit_scale"] + 1.0
    save_file(weights, clip_dir / WEIGHTS_NAME)
    after = ModelSpec(f"open_clip:{clip_dir}", templates=load_template_set("simple"))
    assert after.weights_id != before.weights_id and after.slug != before.slug
    options = EvalOptions(device="cpu", batch_size=8, workers=0)
    assert run_key(release, after, options) != run_key(release, before, options)
    # the same files elsewhere: the same identity
    moved = tmp_path / "elsewhere" / "tinyclip"
    shutil.copytree(clip_dir, moved)
    assert ModelSpec(f"open_clip:{moved}", templates=load_template_set("simple")).weights_id == after.weights_id


def test_an_open_clip_folder_without_its_files_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"needs open_clip_config\.json and \.safetensors weights"):
        ModelSpec(f"open_clip:{tmp_path / 'empty'}", templates=load_template_set("simple"))


def test_templates_without_a_zero_shot_model_are_refused_in_one_line_before_any_model_loads(tmp_path, capsys):
    """Templates are loaded only for zero-shot models, and ``--templates`` with timm models alone is still refused."""
    from builder.cli import main

    release = write_release(tmp_path / "rel", labels=(0, 1), label_names=NAMES[:2], edits_per_original=1)
    out = tmp_path / "out"
    argv = ["eval", "--release", str(release), "--model", "resnet18", "--no-pretrained", "--output", str(out)]
    assert main([*argv, "--templates", "simple"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--templates applies to zero-shot models (--model open_clip:...); none was given" in err
    assert len(err.splitlines()) == 1 and not list(out.rglob("results.json"))
