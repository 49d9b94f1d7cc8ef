"""Evaluating a dataset-interfaces release and its card section.

The per-shift metric (Vendrow et al.) in results.json, the report and the leaderboard; a LANCE release and an
interfaces release side by side in one leaderboard; the card's shifts / thresholds / yields section. Every number is
checked against one recomputed here from predictions made independently (``datasets`` + timm, outside the harness).

The classifier is timm's ``test_resnet`` with random weights whose head is fitted to chosen answers (a stand-in:
random 1000-way weights would score 0% everywhere, and every drop would be 0 whatever the code did).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from builder_helpers import cli

SHIFTS = ["in_the_snow", "pencil_sketch"]
DEMO_CLASSES = [281, 652, 657, 698, 967]  # the demo and demo-star releases' classes (demo-star: 281, 652, 967)
MIN_PER_CLASS = 2  # demo-star has 2 images per class and shift; the paper's 5 would leave no class


# ------------------------------------------------------------------------------------------------------ unit: metric
def _rows(spec: dict[str, dict[int, list[bool]]]) -> list[dict]:
    return [
        {"config": config, "label": label, "correct1": ok}
        for config, per_class in spec.items()
        for label, oks in per_class.items()
        for ok in oks
    ]


def test_shift_metrics_follow_the_per_class_rule_against_base_on_the_same_classes():
    from evaluation.interfaces.shift_results import shift_metrics

    spec = {
        "base": {0: [True] * 5, 1: [True, False] * 3, 2: [False] * 5, 3: [True] * 6},
        # class 2 has only 4 snow images: excluded, and its (bad) base accuracy must not count either
        "in_the_snow": {0: [True, False, False, False, False], 1: [False] * 6, 2: [True] * 4, 3: [True] * 5},
    }
    section = shift_metrics(_rows(spec), [], min_per_class=5, n_boot=500, seed=3)
    entry = section["shifts"]["in_the_snow"]
    # independently: classes 0, 1, 3 qualify; shift acc = mean(20, 0, 100); base acc = mean(100, 50, 100)
    assert entry["classes"] == 3 and entry["classes_excluded"] == [2] and entry["n"] == 20
    assert entry["accuracy"] == pytest.approx((20 + 0 + 100) / 3)
    assert entry["base_accuracy"] == pytest.approx((100 + 50 + 100) / 3)
    assert entry["drop"] == pytest.approx(entry["base_accuracy"] - entry["accuracy"])
    low, high = entry["drop_ci"]
    per_class_drops = [80.0, 50.0, 0.0]
    assert min(per_class_drops) <= low <= entry["drop"] <= high <= max(per_class_drops)
    assert "base" not in section["shifts"] and section["base_by_class"]["1"] == {"n": 6, "acc1": 50.0}
    # no class with enough images: no number, and nothing invented
    empty = shift_metrics(_rows(spec), [], min_per_class=7, n_boot=10)["shifts"]["in_the_snow"]
    assert empty["classes"] == 0 and empty["drop"] is None and empty["accuracy"] is None
    with pytest.raises(ValueError, match="'base'"):
        shift_metrics(_rows({"in_the_snow": spec["in_the_snow"]}), [])


def test_results_validation_checks_the_interfaces_section():
    from evaluation.results import validate_results

    results = {
        "schema": "lance-cf/eval-results",
        "schema_version": 2,
        "status": "ok",
        "model": {"name": "m"},
        "release": {"name": "r", "version": "1.0.0", "manifest_sha256": "x"},
        "metrics": {"base": {"n": 4, "acc1": 50.0}},
        "tool": {"version": "0"},
        "options": {},
        "limit": None,
    }
    validate_results(results)  # a LANCE results JSON without the section stays valid
    entry = {"min_per_class": 5, "classes": 1, "classes_excluded": [], "accuracy": 1.0, "base_accuracy": 2.0}
    results["interfaces"] = {"shifts": {"snow": {**entry, "drop": 1.0, "drop_ci": [0.0, 2.0], "n": 5}}}
    validate_results(results)
    results["interfaces"]["shifts"]["snow"]["drop"] = "big"
    with pytest.raises(ValueError, match="interfaces.shifts.snow.drop"):
        validate_results(results)
    results["interfaces"] = {"shifts": {"snow": {**entry, "drop": None, "drop_ci": None}}}
    with pytest.raises(ValueError, match="interfaces.shifts.snow.n"):
        validate_results(results)


def test_a_rejected_config_is_never_scored_as_a_shift():
    from evaluation.interfaces.shift_results import shift_metrics, shift_rows
    from evaluation.metrics import compute_metrics

    spec = {
        "base": {0: [True] * 5, 1: [True] * 5},
        "in_the_snow": {0: [True] * 5, 1: [False] * 5},
        "rejected": {0: [False] * 5, 1: [False] * 5},  # what the filter threw out: a drop of 100 if it were scored
        "extra": {0: [False] * 5, 1: [False] * 5},  # a config the release does not declare as a shift
    }
    from evaluation.metric_registry import PREDICTION_COLUMNS

    blank = dict.fromkeys(PREDICTION_COLUMNS)
    rows = [{**blank, **r, "key": str(i), "source_key": str(i), "label_name": "x", "p_gt": 0.5,
             "correct5": r["correct1"]} for i, r in enumerate(_rows(spec))]  # fmt: skip
    manifest = {"source": {"kind": "generate", "shifts": [{"name": "base"}, {"name": "in_the_snow"}]}}
    section = compute_metrics(rows, ["tench", "goldfish"], n_boot=10, release_configs=list(spec), manifest=manifest)[
        "interfaces"
    ]
    assert list(section["shifts"]) == ["in_the_snow"] and section["not_shifts"] == ["extra", "rejected"]
    assert section["shifts"]["in_the_snow"]["drop"] == pytest.approx(50.0)
    # without the release's declaration, rejected is still no shift
    assert "rejected" not in shift_metrics(_rows(spec), [], n_boot=10)["shifts"]
    # results written before this rule held a rejected entry: it never enters the leaderboard's shift table
    legacy = {"status": "ok", "model": {"name": "m"}, "release": {"name": "r", "configs": ["base", "rejected"]},
              "interfaces": {"shifts": {"rejected": {"n": 10, "classes": 2, "classes_excluded": [], "accuracy": 0.0,
                                                     "base_accuracy": 100.0, "drop": 100.0, "drop_ci": None}}}}  # fmt: skip
    assert shift_rows([legacy]) == []


def test_card_yields_thresholds_and_object_rule_from_the_manifest():
    from dataset_cards.interfaces_section import interfaces_section, shift_yields

    manifest = {
        "source": {
            "kind": "generate",
            "per_class": 3,
            "shifts": [
                {"name": "base", "prompt": "A photo of a <TOKEN>", "threshold": None, "provenance": "paper, Table 1",
                 "paper_yield": 0.926},
                {"name": "in_the_snow", "prompt": "A photo of a <TOKEN> in the snow", "threshold": 0.16,
                 "shift_caption": "a photo in the snow", "provenance": "paper, Table 1", "paper_yield": 0.732},
            ],
        },
        "stages": {"filter": {"type": "shift_filter", "object_rule": "per_class", "object_thresholds": "t.json",
                              "object_thresholds_data": {
                                  "clip": {"model": "ViT-H-14", "pretrained": "laion2b_s32b_b79k"}, "percentile": 5.0,
                                  "percentile_is_default": True, "source": "imagenet:val",
                                  "classes": {"tench": {"images": 50}, "goldfish": {"images": 48}}}}},
        "build": {"routing": {"generate": {"groups": {
            "base": {"1": {"base": 3}, "2": {"base": 2, "not_released": 1}},
            "in_the_snow": {"1": {"in_the_snow": 1, "rejected": 2}, "2": {"not_released": 3}},
        }}}},
    }  # fmt: skip
    assert shift_yields(manifest) == {
        "base": {"kept": 5, "rejected": 0, "not_released": 1},
        "in_the_snow": {"kept": 1, "rejected": 2, "not_released": 3},
    }
    text = interfaces_section(manifest)
    assert "per class, as in the paper" in text and "5th percentile" in text and "`imagenet:val`" in text
    assert "the percentile's default (5) is lance-cf's choice" in text and "48 to 50 (2 classes)" in text
    assert "| `base` | A photo of a &lt;TOKEN&gt; | – | none (no shift criterion) | paper, Table 1 |" in text
    assert "| `in_the_snow` | A photo of a &lt;TOKEN&gt; in the snow | a photo in the snow | 0.16 |" in text
    assert text.rstrip().count("\n| `") == 2 and "| 1 | 2 | 3 | 73.2% |" in text and "| 5 | 0 | 1 | 92.6% |" in text
    # an explicit global threshold or no object filter is stated as not the paper's rule
    manifest["stages"]["filter"] = {"type": "shift_filter", "object_rule": "global", "object_threshold": 0.2}
    assert "one threshold for every class, 0.2" in interfaces_section(manifest)
    manifest["stages"]["filter"] = {"type": "shift_filter", "object_rule": "off"}
    assert "**not filtered**" in interfaces_section(manifest)
    assert interfaces_section({"source": {"kind": "imagefolder"}}) == ""


# ---------------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def releases(shared_release):
    return {"star": shared_release("demo-star"), "demo": shared_release("demo")}


def _wanted_prediction(config: str, meta: dict, index: int) -> int:
    """The class the stand-in classifier is fitted to predict: right on base/original, wrong on every second snow
    image, on every pencil sketch and on weather edits, so that every drop differs from 0 in a known direction."""
    label = int(meta["label"])
    wrong = DEMO_CLASSES[(DEMO_CLASSES.index(label) + 1) % len(DEMO_CLASSES)]
    if config == "pencil_sketch" or (config == "in_the_snow" and index % 2) or meta.get("edit_type") == "weather":
        return wrong
    return label


@pytest.fixture(scope="module")
def model_and_checkpoint(releases, tmp_path_factory, single_thread_torch):
    """timm's ``test_resnet`` (random weights) whose head is fitted by least squares on the demo images' features to
    predict :func:`_wanted_prediction` (only the demo classes compete): a deterministic stand-in with varied answers."""
    import datasets
    import timm
    import torch
    from safetensors.torch import save_file
    from timm.data import create_transform, resolve_data_config

    torch.manual_seed(0)
    model = timm.create_model("test_resnet", pretrained=False).eval()
    transform = create_transform(**resolve_data_config({}, model=model, use_test_size=True))
    feats, targets = [], []
    for release, configs in ((releases["star"], ["base", *SHIFTS]), (releases["demo"], ["original", "counterfactual"])):
        for config in configs:
            for index, row in enumerate(datasets.load_dataset(str(release), config, split="test")):
                with torch.no_grad():
                    x = transform(row["png"].convert("RGB"))[None]
                    feats.append(model.forward_head(model.forward_features(x), pre_logits=True)[0])
                targets.append(DEMO_CLASSES.index(_wanted_prediction(config, row["json"], index)))
    # the noise images' features differ little: fit on standardised features, then fold the scaling into the head
    features = torch.stack(feats).double()
    mean, std = features.mean(0), features.std(0).clamp_min(1e-12)
    design = torch.cat([(features - mean) / std, torch.ones(len(feats), 1, dtype=torch.double)], 1)
    onehot = torch.nn.functional.one_hot(torch.tensor(targets), len(DEMO_CLASSES)).double() * 6.0 - 3.0
    solution = torch.linalg.lstsq(design, onehot, driver="gelsd").solution
    weight = solution[:-1].T / std
    bias = solution[-1] - weight @ mean
    head = model.get_classifier()
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-1e3)  # only the demo classes compete
        head.weight[DEMO_CLASSES] = weight.float()
        head.bias[DEMO_CLASSES] = bias.float()
        fitted = model.get_classifier()(torch.stack(feats))[:, DEMO_CLASSES].argmax(1)
    assert fitted.tolist() == targets, "the stand-in head did not fit its chosen answers"
    path = tmp_path_factory.mktemp("ckpt") / "test_resnet-demo.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return model, path


def _independent_correct(model, release_dir: Path, config: str) -> dict[str, tuple[int, bool]]:
    """key -> (label, top-1 correct), read with ``datasets`` and timm's own eval transform, outside the harness."""
    import datasets
    import torch
    from timm.data import create_transform, resolve_data_config

    transform = create_transform(**resolve_data_config({}, model=model, use_test_size=True))
    out = {}
    for row in datasets.load_dataset(str(release_dir), config, split="test"):
        with torch.no_grad():
            logits = model(transform(row["png"].convert("RGB"))[None])
        out[row["json"]["key"]] = (int(row["cls"]), int(logits.argmax(1)) == int(row["cls"]))
    return out


def _evaluate(release_dir: Path, checkpoint: Path, out: Path) -> dict:
    from evaluation.harness import EvalOptions, run_evaluation
    from evaluation.models import ModelSpec
    from evaluation.release_reader import open_release

    options = EvalOptions(device="cpu", workers=0, bootstrap=200, min_per_class=MIN_PER_CLASS, insights=False)
    (summary,) = run_evaluation(
        open_release(release_dir), [ModelSpec("test_resnet", checkpoint=checkpoint)], out, options
    )
    assert summary["status"] == "ok", summary
    return summary


@pytest.fixture(scope="module")
def evaluated(releases, model_and_checkpoint, tmp_path_factory):
    _, checkpoint = model_and_checkpoint
    out = tmp_path_factory.mktemp("eval")
    star = _evaluate(releases["star"], checkpoint, out / "star")
    demo = _evaluate(releases["demo"], checkpoint, out / "demo")
    return {"out": out, "star": star, "demo": demo}


@pytest.mark.e2e
def test_eval_reports_the_paper_metric_per_shift_against_independent_predictions(
    releases, model_and_checkpoint, evaluated
):
    from evaluation.results import validate_results

    model, _ = model_and_checkpoint
    results = evaluated["star"]["results"]
    validate_results(results)
    section = results["interfaces"]
    assert sorted(section["shifts"]) == SHIFTS and section["min_per_class"] == MIN_PER_CLASS
    # no pairing between generated images: no paired metric anywhere, base is not treated as an original
    assert results["sensitivity"]["overall"] is None and results["sensitivity_by_config"] == {}
    assert all("paired_delta_acc1" not in entry and "delta_acc1" not in entry for entry in results["metrics"].values())
    assert "insights" not in results
    predictions = __import__("pandas").read_parquet(Path(evaluated["star"]["path"]).parent / "predictions.parquet")
    base = _independent_correct(model, releases["star"], "base")

    def per_class(correct: dict[str, tuple[int, bool]]) -> dict[int, list[bool]]:
        out: dict[int, list[bool]] = {}
        for label, ok in correct.values():
            out.setdefault(label, []).append(ok)
        return out

    for shift in SHIFTS:
        shifted = _independent_correct(model, releases["star"], shift)
        harness = predictions[predictions["config"] == shift].set_index("key")["correct1"].to_dict()
        assert harness == {k: ok for k, (_, ok) in shifted.items()}
        shift_classes, base_classes = per_class(shifted), per_class(base)
        eligible = sorted(c for c, oks in shift_classes.items() if len(oks) >= MIN_PER_CLASS)
        expected_acc = float(np.mean([100.0 * np.mean(shift_classes[c]) for c in eligible]))
        expected_base = float(np.mean([100.0 * np.mean(base_classes[c]) for c in eligible]))
        entry = section["shifts"][shift]
        assert entry["classes"] == len(eligible) == 3 and entry["classes_excluded"] == []
        assert entry["accuracy"] == pytest.approx(expected_acc)
        assert entry["base_accuracy"] == pytest.approx(expected_base)
        assert entry["drop"] == pytest.approx(expected_base - expected_acc)
    # the stand-in was fitted to be right on base, half wrong in the snow, wrong on sketches: the drops show it
    assert section["shifts"]["pencil_sketch"]["drop"] > section["shifts"]["in_the_snow"]["drop"] > 0.0
    report = (Path(evaluated["star"]["path"]).parent / "report.html").read_text(encoding="utf-8")
    assert "Per shift" in report and all(shift in report for shift in SHIFTS)


@pytest.mark.e2e
def test_leaderboard_puts_lance_edit_types_and_interfaces_shifts_side_by_side(evaluated, tmp_path):
    import pandas as pd

    out = tmp_path / "board"
    proc = cli("leaderboard", str(evaluated["out"] / "demo"), str(evaluated["out"] / "star"), "--output", str(out))
    assert "leaderboard written" in proc.stdout
    combined = pd.read_csv(out / "combined.csv")
    assert len(combined) == 1 and combined["model"][0].startswith("test_resnet")
    star = evaluated["star"]["results"]["interfaces"]["shifts"]
    for shift in SHIFTS:
        assert combined[f"shift: {shift}"][0] == pytest.approx(star[shift]["drop"])
    # LANCE side, recomputed from the demo predictions: original minus counterfactual top-1 over each edit type's pairs
    predictions = pd.read_parquet(Path(evaluated["demo"]["path"]).parent / "predictions.parquet")
    originals = predictions[predictions["config"] == "original"].set_index("key")["correct1"]
    edits = predictions[predictions["config"] == "counterfactual"]
    edit_types = sorted(edits["edit_type"].unique())
    assert edit_types and [c for c in combined.columns if c.startswith("edit: ")] == [f"edit: {t}" for t in edit_types]
    for edit_type, group in edits.groupby("edit_type"):
        expected = 100.0 * (originals.loc[group["source_key"]].to_numpy(float).mean() - group["correct1"].mean())
        assert combined[f"edit: {edit_type}"][0] == pytest.approx(expected)
    if "weather" in edit_types:
        assert combined["edit: weather"][0] > 0.0  # fitted to be wrong on weather edits
    shifts = pd.read_csv(out / "shifts.csv")
    assert sorted(shifts["shift"]) == SHIFTS
    markdown = (out / "leaderboard.md").read_text(encoding="utf-8")
    assert "# Leaderboard: lance-demo 1.0.0" in markdown  # the LANCE leaderboard as before
    assert "## Per shift: lance-demo-star 1.0.0" in markdown and "## LANCE edits vs generated shifts" in markdown
    assert "do not cover the same classes" in markdown  # demo has 5 classes, demo-star 3
    assert (out / "combined.png").stat().st_size > 0
    assert "LANCE edits vs generated shifts" in (out / "leaderboard.html").read_text(encoding="utf-8")
    # an interfaces release alone: its own leaderboard
    alone = tmp_path / "alone"
    cli("leaderboard", str(evaluated["out"] / "star"), "--output", str(alone))
    assert "| test_resnet" in (alone / "leaderboard.md").read_text(encoding="utf-8")
    assert not (alone / "combined.csv").exists()


@pytest.mark.e2e
def test_card_of_a_demo_star_build_lists_shifts_thresholds_and_yields(releases, evaluated, tmp_path):
    from dataset_cards.card import render_release_card

    manifest = json.loads((releases["star"] / "manifest.json").read_text())
    text = render_release_card(releases["star"], manifest, [evaluated["star"]["results"]], output_dir=tmp_path)
    board = text[text.index("## Leaderboard\n") : text.index("## How it was built")]
    assert "| test_resnet" in board and "| in_the_snow |" in board and "drop" in board  # the per-shift table
    section = text[text.index("## Shifts (dataset interfaces)") :]
    section = section[: section.index("\n## ", 5)]
    for shift in manifest["source"]["shifts"]:
        name = shift["name"]
        released = manifest["counts"][name]["total"]
        row = next(line for line in section.splitlines() if line.startswith(f"| `{name}` |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        threshold = shift["threshold"]
        assert cells[3] == ("none (no shift criterion)" if threshold is None else f"{threshold:g}")
        assert cells[5:] == [str(released), "0", "0", "–"]  # the demo's opened shifts are not the paper's rows
    assert "one threshold for every class, -1 (set by this build's config)" in section


# ---------------------------------------------------------------------------------------------------- push tokens
LOAD_TOKEN_SCRIPT = """
import json, sys
from diffusers import StableDiffusionPipeline
sd, repo, weight, token = sys.argv[1:5]
pipe = StableDiffusionPipeline.from_pretrained(sd, safety_checker=None, requires_safety_checker=False)
pipe.load_textual_inversion(repo, weight_name=weight)
row = pipe.text_encoder.get_input_embeddings().weight[pipe.tokenizer.convert_tokens_to_ids(token)]
print("RESULT" + json.dumps(row.detach().tolist()))
"""


@pytest.mark.e2e
def test_learn_tokens_push_to_hub_holds_tokens_index_and_card_and_loads_in_diffusers(
    tiny_sd_dir, tmp_path, capsys, single_thread_torch, hub_env
):
    import subprocess
    import sys

    import torch
    from builder_helpers import make_imagefolder
    from hub_double import client_env

    from builder.cli import main
    from lance_pipeline.interfaces.textual_inversion import load_token

    photos = make_imagefolder(tmp_path / "photos", ["n01440764", "n01443537"], 2)  # tench, goldfish
    out = tmp_path / "tokens"
    bad = ["interfaces", "learn-tokens", "--source", f"imagefolder:{photos}", "--output", str(out),
           "--model", str(tiny_sd_dir), "--no-progress", "--push-to-hub", "not a repo"]  # fmt: skip
    assert main(bad) == 2 and not out.exists()  # refused before any training, naming the option
    assert "--push-to-hub 'not a repo'" in capsys.readouterr().err
    hub = hub_env
    args = ["interfaces", "learn-tokens", "--source", f"imagefolder:{photos}", "--output", str(out),
            "--model", str(tiny_sd_dir), "--steps", "2", "--resolution", "32", "--no-progress", "--device", "cpu",
            "--push-to-hub", "org/star-tokens"]  # fmt: skip
    assert main(args) == 0
    files = hub.entries("models", "org/star-tokens", hub.resolve("models", "org/star-tokens", "main"))
    assert {"0.safetensors", "1.safetensors", "tokens.json", "README.md"} <= set(files)
    assert not any(name.startswith(".hub") for name in files)
    for label in ("0", "1"):
        assert (
            hub.read_file("models", "org/star-tokens", files[f"{label}.safetensors"])
            == (out / f"{label}.safetensors").read_bytes()
        )
    index = json.loads(hub.read_file("models", "org/star-tokens", files["tokens.json"]))
    card = hub.read_file("models", "org/star-tokens", files["README.md"]).decode()
    assert {info["token"] for info in index["classes"].values()} == {"<tench-0>", "<goldfish-1>"}
    assert "<tench-0>" in card and "<goldfish-1>" in card and "library_name: diffusers" in card
    # nothing of this machine is published: the local model directory goes by its name only
    for published in (json.dumps(index), card):
        assert str(tmp_path) not in published and str(tiny_sd_dir) not in published
    assert index["options"]["model"] == Path(tiny_sd_dir).name
    assert json.loads((out / "tokens.json").read_text())["options"]["model"] == str(tiny_sd_dir)  # resume key kept
    capsys.readouterr()

    # A lost index is rebuilt from the token files: the push holds every learned token, never "pushed 0".
    (out / "tokens.json").unlink()
    assert main([*args[:-1], "org/star-tokens-2"]) == 0
    assert "pushed 2 token(s)" in capsys.readouterr().out
    pushed = hub.entries("models", "org/star-tokens-2", hub.resolve("models", "org/star-tokens-2", "main"))
    assert {"0.safetensors", "1.safetensors", "tokens.json"} <= set(pushed)
    # An index that lists fewer tokens than the folder holds is never pushed.
    from builder.interfaces.cli import push_tokens

    short = json.loads((out / "tokens.json").read_text())
    del short["classes"]["1"]
    requests = len(hub.log)
    with pytest.raises(ValueError, match=r"holds 2 learned token\(s\) but the push would publish 1 \(left out: 1"):
        push_tokens(out, "org/star-tokens-3", short)
    assert len(hub.log) == requests  # refused before any request

    env = client_env(hub.url, tmp_path / "hf_home_reader")
    script = [sys.executable, "-c", LOAD_TOKEN_SCRIPT, str(tiny_sd_dir), "org/star-tokens", "1.safetensors"]
    proc = subprocess.run([*script, "<goldfish-1>"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))[len("RESULT") :])
    assert torch.equal(torch.tensor(row, dtype=torch.float32), load_token(out / "1.safetensors")[1].float())
