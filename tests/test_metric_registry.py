"""Evaluation metrics behind the registry, and the recipe "A metric" of docs/architecture.md.

A metric registered from this test file is computed by ``lance-cf eval`` on a tiny release and lands in results.json
with its version; selection, unknown names, the declared contract and the docs table are checked without a model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from release_fixture import write_release

from evaluation.leaderboard import leaderboard_markdown
from evaluation.metric_registry import (
    METRICS,
    Metric,
    MetricContractError,
    default_metric_names,
    metrics_markdown,
    parse_metric_names,
    select_metrics,
    undeclared_keys,
)
from evaluation.metrics import compute_metrics
from evaluation.results import is_complete, missing_default_metrics, validate_results

REPO = Path(__file__).resolve().parents[1]


class WorstClassAccuracy(Metric):
    """The recipe's worked example (docs/architecture.md): the lowest per-class acc@1 of each config."""

    name = "worst_class_accuracy"
    version = "2"
    description = "The lowest per-class acc@1 (%) of each config and the class it belongs to."
    needs = ("config", "label", "correct1")
    produces = ("metrics.*.worst_class_acc1", "metrics.*.worst_class")
    default = False
    leaderboard = {"worst_class_acc1": "metrics.{config}.worst_class_acc1"}  # a column of the leaderboard and card

    def compute(self, context):
        out = {}
        for config in context.configs:
            rows = context.predictions[context.predictions["config"] == config]
            by_class = rows.groupby("label")["correct1"].mean() * 100.0
            label = int(by_class.idxmin())
            out[config] = {"worst_class_acc1": float(by_class.min()), "worst_class": context.label_name(label)}
        return {"metrics": out}


class SloppyMetric(WorstClassAccuracy):
    name = "sloppy"
    produces = ("metrics.*.worst_class_acc1",)  # forgets worst_class


class ConflictingMetric(WorstClassAccuracy):
    name = "conflicting"

    def compute(self, context):
        return {"metrics": {"original": {"worst_class_acc1": -1.0}}}


@pytest.fixture
def registered():
    METRICS.register("worst_class_accuracy", f"{__name__}:WorstClassAccuracy")
    METRICS.register("sloppy", f"{__name__}:SloppyMetric")
    yield
    METRICS.unregister("worst_class_accuracy")
    METRICS.unregister("sloppy")


def fake_rows(seed: int = 0, sources: int = 12) -> list[dict]:
    """Prediction rows as the harness writes them: originals, reconstructions and 0-3 counterfactuals per source."""
    rng = np.random.default_rng(seed)
    rows = []
    for s in range(sources):
        label = int(rng.integers(0, 3))
        samples = [("original", f"s{s}", None), ("reconstructed", f"s{s}_rec", None)]
        samples += [("counterfactual", f"s{s}_cf{e}", ("add", "color")[e % 2]) for e in range(s % 4)]
        for config, key, edit_type in samples:
            p_gt, correct1 = float(rng.random()), bool(rng.random() < 0.6)
            rows.append(
                {
                    **{"config": config, "key": key, "source_key": f"s{s}", "label": label, "edit_type": edit_type},
                    **{"p_gt": p_gt, "correct1": correct1, "correct5": correct1 or bool(rng.random() < 0.5)},
                    **{"top5": [label], "top5_prob": [p_gt]},
                }
            )
    return rows


def test_a_metric_registered_from_a_test_is_computed_by_eval_and_recorded(registered, tmp_path, cli):
    from evaluation.harness import EvalOptions, is_done, results_path
    from evaluation.models import ModelSpec
    from evaluation.release_reader import open_release

    root = write_release(tmp_path / "release", originals_per_class=2, edits_per_original=2)
    release = open_release(str(root))
    out = tmp_path / "eval"
    argv = ["eval", "--release", str(root), "--model", "test_vit", "--no-pretrained", "--output", str(out)]
    argv += ["--workers", "0", "--bootstrap", "0", "--no-report"]
    # insights are a metric too: not selected, so their CLIP model (here one that does not exist) is never loaded
    argv += ["--clip-model", str(tmp_path / "no-such-clip")]
    args = cli.parse([*argv, "--metrics", "worst_class_accuracy,flip_rate"])
    assert args.func(args) == 0
    path = results_path(out / release.name, ModelSpec("test_vit", pretrained=False))
    results = json.loads(path.read_text())
    validate_results(results)
    # the selection, in run order, accuracy always included; every computed metric recorded with its version
    assert results["computed_metrics"] == {"accuracy": "1", "flip_rate": "1", "worst_class_accuracy": "2"}
    assert results["options"]["metrics"] == ["accuracy", "flip_rate", "worst_class_accuracy"]
    predictions = pd.read_parquet(path.parent / "predictions.parquet")
    for config, rows in predictions.groupby("config"):
        per_class = {label: 100.0 * g["correct1"].sum() / len(g) for label, g in rows.groupby("label")}
        worst = min(per_class, key=lambda k: (per_class[k], k))
        assert results["metrics"][config]["worst_class_acc1"] == pytest.approx(per_class[worst])
        assert results["metrics"][config]["worst_class"] == release.label_names[worst]
    overall = results["sensitivity"]["overall"]
    assert (
        "flip_rate" in overall
        and "delta_p_gt_mean" not in overall
        and "delta_acc1" not in results["metrics"]["lance_r"]
    )
    # a run without every default metric is shown, never ranked or published (like a --limit run)
    board = leaderboard_markdown([results])
    assert not is_complete(results) and "--metrics left some out" in board
    assert "`accuracy` 1, `flip_rate` 1, `worst_class_accuracy` 2." in board  # what the card shows under the table
    # shift_accuracy_drop is a default metric too, but it does not apply to a LANCE release
    assert missing_default_metrics(results) == ["accuracy_drop", "paired_accuracy_drop", "true_class_confidence_drop"]
    # a changed metric version makes the same run stale; the same version does not
    common = {"bootstrap": 0, "report": False, "clip_model": str(tmp_path / "no-such-clip")}
    options = EvalOptions(**common, metrics=["worst_class_accuracy", "flip_rate"])
    spec = ModelSpec("test_vit", pretrained=False)
    assert is_done(path, release, spec, options)
    assert not is_done(path, release, spec, EvalOptions(**common))
    path.write_text(json.dumps({**results, "computed_metrics": {**results["computed_metrics"], "flip_rate": "0"}}))
    assert not is_done(path, release, spec, options)


@pytest.mark.slow
def test_a_registered_metric_reaches_results_leaderboard_card_report_and_published_rows(registered, tmp_path):
    """The recipe "a metric that reaches the leaderboard and the card": the metric declared in this file, with its
    leaderboard column, is computed by eval beside every default metric (a complete, ranked run) and shows in the
    leaderboard's tables, the card's leaderboard, the model's report and the rows publish-results uploads."""
    from builder import release_format as rf
    from builder.cli import main
    from dataset_cards import render_release_card
    from evaluation.leaderboard import leaderboard_records

    root = write_release(tmp_path / "release", originals_per_class=2, edits_per_original=2)
    out = tmp_path / "eval"
    argv = ["eval", "--release", str(root), "--model", "test_vit", "--no-pretrained", "--output", str(out)]
    argv += ["--workers", "0", "--bootstrap", "0", "--no-insights", "--gallery-size", "1"]
    assert main([*argv, "--metrics", "default,worst_class_accuracy"]) == 0
    run = out / "lance-fixture" / "test_vit__random"
    results = json.loads((run / "results.json").read_text())
    value = results["metrics"]["counterfactual"]["worst_class_acc1"]  # the headline config of a LANCE release
    assert is_complete(results) and results["computed_metrics"]["worst_class_accuracy"] == "2"
    shown = f"{value:.2f}"
    # lance-cf leaderboard: the full table (CSV, Markdown) and the ranked table
    assert main(["leaderboard", str(out), "--output", str(tmp_path / "lb")]) == 0
    table = pd.read_csv(tmp_path / "lb" / "leaderboard.csv")
    assert table.loc[0, "worst_class_acc1"] == pytest.approx(value) and table.loc[0, "rank"] == 1
    ranked = leaderboard_markdown([results])
    assert ranked.splitlines()[0].endswith("| worst\\_class\\_acc1 |") and ranked.splitlines()[2].endswith(
        f"| {shown} |"
    )
    assert "worst_class_acc1" in (tmp_path / "lb" / "leaderboard.html").read_text()
    # the card's leaderboard
    card = render_release_card(root, rf.read_manifest_dict(root), results=[results], output_dir=tmp_path / "card")
    assert "worst\\_class\\_acc1" in card and f"| {shown} |" in card
    # the model's report
    report = (run / "report.html").read_text()
    assert "<td class='text'>worst_class_acc1</td>" in report and f"<td>{shown}</td>" in report
    # the published rows: one per config, each with its own config's value
    rows = {r["config"]: r for r in leaderboard_records([results])}
    for config in ("counterfactual", "lance_r"):
        assert rows[config]["worst_class_acc1"] == results["metrics"][config]["worst_class_acc1"]


def test_unknown_metric_is_one_line_with_did_you_mean_before_anything_runs(tmp_path, cli):
    with pytest.raises(ValueError, match=r"unknown metric 'flip_rat'.*did you mean 'flip_rate'") as error:
        parse_metric_names("accuracy,flip_rat")
    assert "\n" not in str(error.value)
    argv = ["eval", "--release", str(tmp_path / "none"), "--model", "x", "--output", str(tmp_path / "o")]
    args = cli.parse([*argv, "--metrics", "acuracy"])
    with pytest.raises(ValueError, match="did you mean 'accuracy'"):
        args.func(args)
    assert not (tmp_path / "o").exists()
    with pytest.raises(ValueError, match="names no metric"):
        parse_metric_names(" , ")


def test_selection_order_defaults_and_numbers_independent_of_what_else_is_selected():
    assert default_metric_names() == METRICS.in_order()  # every built-in metric is a default one
    assert select_metrics(["flip_rate", "accuracy_drop"]) == ["accuracy", "accuracy_drop", "flip_rate"]
    assert select_metrics(["flip_rate", "default"]) == select_metrics(None) == default_metric_names()
    rows = fake_rows()
    full = compute_metrics(rows, ["a", "b", "c"], n_boot=64, seed=3)
    alone = compute_metrics(rows, ["a", "b", "c"], n_boot=64, seed=3, metrics=["true_class_confidence_drop"])
    assert alone["computed_metrics"] == {"accuracy": "1", "true_class_confidence_drop": "1"}
    for key in ("delta_p_gt_mean", "delta_p_gt_abs_mean", "delta_p_gt_mean_ci", "delta_p_gt_abs_mean_ci", "n"):
        assert alone["sensitivity"]["overall"][key] == full["sensitivity"]["overall"][key]  # bit for bit
    assert "flip_rate" not in alone["sensitivity"]["overall"]
    assert "metrics_left_out" not in full and alone["metrics_left_out"] == [
        "accuracy_drop",
        "paired_accuracy_drop",
        "flip_rate",
    ]
    every_lance_metric = [n for n in default_metric_names() if n != "shift_accuracy_drop"]
    assert "metrics_left_out" not in compute_metrics(rows, ["a", "b", "c"], n_boot=0, metrics=every_lance_metric)
    for config, entry in full["metrics"].items():
        assert {k: entry[k] for k in ("n", "acc1", "acc5", "acc1_ci", "acc5_ci")}.items() <= alone["metrics"][
            config
        ].items()
        for label, cls in entry["by_class"].items():
            assert alone["metrics"][config]["by_class"][label] == {
                k: cls[k] for k in ("label_name", "n", "acc1", "acc5")
            }
        assert "delta_acc1" not in alone["metrics"][config]
    # independent check of one paired number: Delta p(y_GT) of the counterfactuals, by hand
    originals = {r["source_key"]: r["p_gt"] for r in rows if r["config"] == "original"}
    deltas = [(originals[r["source_key"]] - r["p_gt"]) * 100 for r in rows if r["config"] == "counterfactual"]
    assert full["sensitivity"]["overall"]["delta_p_gt_mean"] == pytest.approx(np.mean(deltas))
    # not an interfaces release, no strength config, and no edit clusters (insights) were given
    assert set(full["computed_metrics"]) == set(default_metric_names()) - {
        "shift_accuracy_drop",
        "strength_curve",
        "insights",
    }


def test_undeclared_results_key_or_a_conflicting_value_is_a_contract_error(registered):
    fragment = {"metrics": {"cf": {"n": 1, "by_class": {"7": {"acc1": 2.0}}, "typo": 3}}, "other": {}}
    assert undeclared_keys(fragment, ("metrics.*.n", "metrics.*.by_class")) == ["metrics.cf.typo", "other"]
    with pytest.raises(MetricContractError, match=r"'sloppy' wrote undeclared results key.*worst_class"):
        compute_metrics(fake_rows(), ["a", "b", "c"], n_boot=0, metrics=["sloppy"])
    METRICS.register("conflicting", f"{__name__}:ConflictingMetric")
    try:
        with pytest.raises(MetricContractError, match="'conflicting' writes 'metrics.original.worst_class_acc1'"):
            compute_metrics(fake_rows(), ["a", "b", "c"], n_boot=0, metrics=["worst_class_accuracy", "conflicting"])
    finally:
        METRICS.unregister("conflicting")


def test_results_schema_3_requires_computed_metrics_and_older_files_still_read():
    from evaluation.results import RESULTS_SCHEMA

    base = {
        "schema": RESULTS_SCHEMA,
        "status": "ok",
        "model": {"name": "m"},
        "release": {"name": "r", "version": "1.0.0", "manifest_sha256": "x"},
        "metrics": {"original": {"n": 1, "acc1": 100.0}},
        "tool": {"version": "0"},
        "options": {},
        "limit": None,
    }
    validate_results({**base, "schema_version": 2})
    with pytest.raises(ValueError, match="no 'computed_metrics'"):
        validate_results({**base, "schema_version": 3})
    validate_results({**base, "schema_version": 3, "computed_metrics": {"accuracy": "1"}})


def test_docs_list_every_registered_metric():
    """docs/evaluation.md holds the table generated from the registry's declarations (descriptions, keys)."""
    text = (REPO / "docs" / "evaluation.md").read_text(encoding="utf-8")
    assert metrics_markdown() in text, (
        "docs/evaluation.md's metrics table is stale; paste the output of "
        "`python -c 'from evaluation.metric_registry import metrics_markdown; print(metrics_markdown())'`"
    )


def test_registry_class_is_shared_and_the_metrics_registry_imports_no_numeric_library():
    # Which layers evaluation may import is checked for every package by tests/test_layers.py.
    from builder import registry
    from lance_pipeline.registry import Registry

    assert registry.Registry is Registry and registry.STAGES.kind == "stage type"
    code = (
        "import sys, evaluation.metric_registry; print(sorted(m for m in ('torch', 'numpy', 'pandas') if m in "
        "sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"
