"""Effective robustness, agreement with real shifts, the results validation and the leaderboard's rules, against
values computed independently in the test (stdlib NormalDist for the probit, a hand-written least-squares line,
average ranks and Pearson for Spearman, a plain loop for the bootstrap)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest

from evaluation import leaderboard as lb
from evaluation.results import RESULTS_SCHEMA, is_complete, validate_results
from evaluation.robustness import effective_robustness, shift_correlations, spearman, timm_model_name
from evaluation.timm_results import SHIFTS, TIMM_FILES, load_shift_table, refresh

RELEASE = {"name": "rel", "version": "1.0.0", "manifest_sha256": "a" * 64, "label_space": {"num_classes": 1000}}


def fake_results(name, orig, cf, n=200, delta=None, weights="pretrained", tag=None, release=RELEASE, limit=None):
    """A minimal valid results JSON whose paired accuracies are ``orig`` and ``cf`` over ``n`` pairs."""
    delta = cf - orig if delta is None else delta
    overall = {"n": n, "acc1": cf, "orig_acc1": orig, "paired_delta_acc1": delta, "delta_p_gt_mean": 1.5}
    overall |= {"flip_rate": 10.0, "paired_delta_acc1_ci": [delta - 1, delta + 1]}
    return {
        "schema": RESULTS_SCHEMA,
        "schema_version": 2,
        "status": "ok",
        "error": None,
        "tool": {"name": "lance-counterfactuals", "version": "0.1.0"},
        "model": {"name": name, "weights": {"id": weights, "pretrained_tag": tag}, "data_config": {}},
        "release": dict(release),
        "options": {},
        "limit": limit,
        "metrics": {
            "original": {"n": n, "acc1": orig, "acc5": 99.0},
            "counterfactual": {"n": n, "acc1": cf, "acc5": 98.0, "paired_delta_acc1": delta, "delta_acc1": cf - orig},
        },
        "sensitivity": {"config": "counterfactual", "overall": overall, "by_edit_type": {}, "by_class": {}},
        "sensitivity_by_config": {},
        "failures": [],
    }


def nd_probit(p_pct, n):
    eps = 0.5 / n
    return statistics.NormalDist().inv_cdf(min(max(p_pct / 100, eps), 1 - eps))


def test_effective_robustness_matches_a_hand_fit_in_probit_space():
    accs = [(80.0, 60.0), (70.0, 45.0), (90.0, 78.0), (60.0, 41.0), (85.0, 62.0), (100.0, 90.0)]
    results = [fake_results(f"m{i}", o, c) for i, (o, c) in enumerate(accs)]
    results.append(fake_results("limited", 75.0, 70.0, limit=10))  # never part of the fit
    fit = effective_robustness(results)
    x = [nd_probit(o, 200) for o, _ in accs]  # 100% is clipped to 1 - 0.5/n
    y = [nd_probit(c, 200) for _, c in accs]
    mx, my = sum(x) / len(x), sum(y) / len(y)
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / sum((a - mx) ** 2 for a in x)
    intercept = my - slope * mx
    assert fit["slope"] == pytest.approx(slope, rel=1e-9) and fit["intercept"] == pytest.approx(intercept, rel=1e-9)
    assert fit["n_models"] == len(accs) and 6 not in fit["by_model"]
    for i, (_, c) in enumerate(accs):
        line = slope * x[i] + intercept
        assert fit["by_model"][i]["effective_robustness_probit"] == pytest.approx(y[i] - line, abs=1e-9)
        assert fit["by_model"][i]["effective_robustness"] == pytest.approx(
            c - 100 * statistics.NormalDist().cdf(line), abs=1e-7
        )
    # residuals of a least-squares line sum to zero
    assert sum(v["effective_robustness_probit"] for v in fit["by_model"].values()) == pytest.approx(0, abs=1e-9)
    # two models are not enough for a fit
    few = effective_robustness(results[:2])
    assert few["slope"] is None and "at least 3" in few["reason"] and few["by_model"] == {}


def average_ranks(values):
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def pearson(a, b):
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b, strict=True))
    return cov / math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))


def test_spearman_with_ties_matches_average_rank_pearson():
    x = [1.0, 2.0, 2.0, 3.0, 5.0, 5.0, 5.0, -1.0]
    y = [0.5, 0.1, 0.9, 0.9, 2.0, 1.0, 3.0, 0.0]
    assert spearman(x, y) == pytest.approx(pearson(average_ranks(x), average_ranks(y)), abs=1e-12)
    assert spearman([1, 1, 1], [1, 2, 3]) is None


def test_shift_correlations_against_published_figures_with_a_loop_bootstrap():
    table = {
        f"arch{i}.tag": {
            "imagenet": 80.0 + i,
            "imagenetv2": 70.0 + 0.5 * i + (i % 3),
            "imagenet_r": 40.0 + 2 * i,
            "sketch": 30.0 + (i % 2),
            "imagenet_a": 20.0 - i,
        }
        for i in range(7)
    }
    deltas = [-5.0, -3.0, -3.0, -8.0, -1.0, -2.5, -6.0]  # a tie on purpose
    results = [fake_results(f"arch{i}", 80, 80 + d, delta=d, tag="tag") for i, d in enumerate(deltas)]
    results.append(fake_results("arch1.tag", 80, 70, weights="random:seed=0"))  # random weights: no published figures
    results.append(fake_results("unknown_arch.x", 80, 70))  # not in the table
    out = shift_correlations(results, n_boot=300, seed=3, table=table)
    assert [m["model"] for m in out["models"]] == [f"arch{i}.tag" for i in range(7)]
    draws = np.random.default_rng(3).integers(0, 7, size=(300, 7))
    for shift in SHIFTS:
        drops = [table[f"arch{i}.tag"][shift] - table[f"arch{i}.tag"]["imagenet"] for i in range(7)]
        entry = out["by_shift"][shift]
        assert entry["n_models"] == 7
        assert entry["spearman"] == pytest.approx(pearson(average_ranks(deltas), average_ranks(drops)), abs=1e-12)
        reps = []
        for d in draws:
            a, b = [deltas[i] for i in d], [drops[i] for i in d]
            if len(set(a)) > 1 and len(set(b)) > 1:
                reps.append(pearson(average_ranks(a), average_ranks(b)))
        assert entry["ci"] == pytest.approx(list(np.percentile(reps, [2.5, 97.5])), abs=1e-9)
    assert "timm" in out["source"] and out["reason"] is None
    few = shift_correlations(results[:2], n_boot=10, table=table)
    assert few["reason"] and all(e["spearman"] is None for e in few["by_shift"].values())


def test_timm_names_and_the_shipped_table(tmp_path):
    assert timm_model_name(fake_results("resnet50", 1, 1, tag="a1_in1k")) == "resnet50.a1_in1k"
    assert timm_model_name(fake_results("hf-hub:timm/resnet50.a1_in1k", 1, 1)) == "resnet50.a1_in1k"
    assert timm_model_name(fake_results("resnet50", 1, 1, weights="checkpoint:sha256:ab")) is None
    table = load_shift_table()
    assert len(table) > 1000 and set(table["resnet50.a1_in1k"]) == set(TIMM_FILES)
    # the refresh command rebuilds the shipped table byte for byte from timm's results/ folder
    source = Path("/work/shared/data/timm-results")
    if not source.is_dir():
        pytest.skip("timm results tables not available on this machine")
    out = tmp_path / "table.csv"
    refresh(source, out)
    from evaluation.timm_results import TABLE_PATH

    assert out.read_bytes() == TABLE_PATH.read_bytes()


def test_validate_results_names_the_bad_field():
    good = fake_results("m", 80, 70)
    validate_results(good)
    cases = [
        ({"schema": "other"}, "schema"),
        ({"status": "weird"}, "status"),
        ({"model": {}}, "model.name"),
        ({"release": {"name": "x", "version": "1"}}, "release.manifest_sha256"),
        ({"metrics": {}}, "metrics"),
        ({"metrics": {"original": {"acc1": 1.0}}}, "metrics.original.n"),
        ({"metrics": {"original": {"n": True, "acc1": 1.0}}}, "metrics.original.n"),
        ({"limit": 0}, "limit"),
        ({"tool": {}}, "tool.version"),
        ({"schema_version": 7}, "schema_version"),
    ]
    for change, field in cases:
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            validate_results(good | change)
    bad = dict(good)
    del bad["limit"]
    with pytest.raises(ValueError, match="limit"):
        validate_results(bad)
    validate_results({k: v for k, v in good.items() if k not in ("metrics",)} | {"status": "error", "error": "boom"})
    assert is_complete(good) and not is_complete(good | {"limit": 5})
    assert not is_complete(good | {"failures": [{"key": "k"}]})


@pytest.mark.slow
def test_leaderboard_rules(tmp_path):
    results = [fake_results("a", 80.0, 70.0), fake_results("b", 90.0, 75.0), fake_results("c", 70.0, 69.0)]
    results.append(fake_results("d", 85.0, 84.0, limit=5))  # best paired Delta, but a limited run: not ranked
    df = lb.build_leaderboard(results)
    assert list(df["model"]) == ["c", "a", "b", "d"]
    assert list(df["rank"][:3]) == [1, 2, 3] and df["rank"].isna().iloc[3]
    assert str(df["rank"].dtype) == "Int64" and not df["complete"].iloc[3]
    md = lb.leaderboard_markdown(results)
    assert "| 1 | c |" in md and "d (incomplete: --limit 5)" in md and "| — | d" in md
    # no -0.00
    assert lb.fmt_number(-0.001) == "0.00" and lb.fmt_number(-0.004, 2) == "0.00" and lb.fmt_number(3) == "3"
    assert lb.fmt_number(float("nan")) == "—" and lb.fmt_number(None) == "—"
    # a release with fewer than 6 classes: acc@5 is not meaningful
    small = dict(RELEASE, label_space={"num_classes": 3})
    few = [fake_results(m, 80.0, 70.0 + i, release=small) for i, m in enumerate("xyz")]
    df_few = lb.build_leaderboard(few)
    assert df_few["top5"].isna().all() and df_few["original_top5"].isna().all()
    assert "n/a (<6 classes)" in lb.to_markdown(df_few)
    assert all(r["acc5"] is None for r in lb.leaderboard_records(few))
    # a leaderboard over different releases is refused, naming them
    other = fake_results("e", 80.0, 70.0, release=dict(RELEASE, version="2.0.0", manifest_sha256="b" * 64))
    with pytest.raises(ValueError, match=r"2 different releases.*rel 1\.0\.0.*rel 2\.0\.0"):
        lb.build_leaderboard([*results, other])
    for i, r in enumerate([*results, other]):
        (tmp_path / f"r{i}.json").write_text(json.dumps(r))
    with pytest.raises(ValueError, match="different releases"):
        lb.write_leaderboard([tmp_path], tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # or split: one leaderboard per release
    lb.write_leaderboard([tmp_path], tmp_path / "split", n_boot=10, split_releases=True)
    folders = sorted(p.name for p in (tmp_path / "split").iterdir() if p.is_dir())
    assert folders == [f"rel-v1.0.0-{'a' * 12}", f"rel-v2.0.0-{'b' * 12}"]
    second = (tmp_path / "split" / folders[1] / "leaderboard.md").read_text()
    assert "| 1 | e |" in second and "| c |" not in second
    assert folders[0] in (tmp_path / "split" / "index.md").read_text()


def test_published_rows_one_per_model_and_config():
    results = [fake_results(m, 80.0 - i, 70.0 + i) for i, m in enumerate("abc")]
    results[0]["sensitivity_by_config"] = {
        "lance_r": {"overall": {"n": 10, "acc1": 50.0, "orig_acc1": 80.0, "paired_delta_acc1": -30.0}}
    }
    df = lb.build_leaderboard_by_config(results)
    assert sorted(zip(df["model"], df["config"], strict=True)) == [
        ("a", "counterfactual"),
        ("a", "lance_r"),
        ("b", "counterfactual"),
        ("c", "counterfactual"),
    ]
    cf = df[df["config"] == "counterfactual"].set_index("model")
    assert list(cf.loc[["c", "b", "a"], "rank"]) == [1, 2, 3]
    assert cf["effective_robustness"].notna().all()
    assert df[df["config"] == "lance_r"]["effective_robustness"].isna().all()
    assert set(df["complete"]) == {True} and set(df["tool_version"]) == {"0.1.0"}
    # published timm weights carry their published drops (what the shift correlation is computed from)
    timm = fake_results("resnet50", 80.0, 70.0, tag="a1_in1k")
    row = next(r for r in lb.leaderboard_records([*results, timm]) if r["model"] == "resnet50")
    published = load_shift_table()["resnet50.a1_in1k"]
    assert row["timm_results_name"] == "resnet50.a1_in1k"
    assert row["sketch_drop"] == pytest.approx(published["sketch"] - published["imagenet"])
    assert row["imagenet_a_drop"] == pytest.approx(published["imagenet_a"] - published["imagenet"])
    assert all(r["imagenetv2_drop"] is None for r in lb.leaderboard_records(results))
    assert "## Effective robustness" in lb.robustness_markdown(results)


def test_a_malformed_results_file_is_an_error_naming_it(tmp_path):
    good = fake_results("a", 80.0, 70.0)
    (tmp_path / "ok.json").write_text(json.dumps(good))
    (tmp_path / "other.json").write_text(json.dumps({"not": "results"}))  # skipped: not results
    found = lb.find_results([tmp_path])
    assert [r["model"]["name"] for r in found] == ["a"]
    bad = dict(good)
    del bad["metrics"]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"bad\.json.*metrics"):
        lb.find_results([tmp_path])


def test_per_class_plot_order_ranks_only_classes_with_enough_pairs_first():
    from evaluation.plots import class_plot_order

    def with_classes(name, classes):
        r = fake_results(name, 80.0, 70.0)
        r["sensitivity"]["by_class"] = {
            lab: {"label_name": f"class {lab}, extra", "n": n, "paired_delta_acc1": d}
            for lab, (n, d) in classes.items()
        }
        return r

    a = with_classes("a", {"0": (10, -5.0), "1": (2, -100.0), "2": (6, -20.0), "3": (5, 0.0), "4": (8, 10.0)})
    b = with_classes("b", {"0": (10, -15.0), "1": (2, -50.0), "2": (4, -20.0), "3": (5, 0.0), "4": (8, -10.0)})
    # mean |Delta| over models: 0 -> 10, 2 -> 20 (but only 4 pairs in b), 4 -> 10, 3 -> 0, 1 -> 75 (2 pairs)
    order = class_plot_order([a, b], min_pairs=5)
    assert [(lab, n) for lab, _, n in order] == [("0", 10), ("4", 8), ("3", 5), ("1", 2), ("2", 4)]
    assert order[0][1] == "class 0"
    assert [lab for lab, _, _ in class_plot_order([a, b], max_classes=2, min_pairs=1)] == ["1", "2"]
