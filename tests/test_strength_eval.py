"""Accuracy against edit strength (evaluation.strength) on hand-built predictions: the headline curve (the same
series at every level) and the pooled one, their areas, the intervals and every image's failure point equal an
independent computation written here; a planted case where the gates drop hard images at high strength keeps the
headline monotone; rank stability equals scipy's Kendall tau and a bootstrap written here; plots keep every label
inside; the leaderboard carries the area."""

from __future__ import annotations

import math

import numpy as np
import pytest

from evaluation.metrics import compute_metrics
from evaluation.results import validate_strength

LABELS = ["cat", "dog", "fox"]
# (source key, label, original correct, [(edit key, edit type, [(strength, correct), ...]), ...])
IMAGES = [
    # non-monotone: wrong at 0.3, right again at 0.4; its weather edit never fails
    ("a", 0, True, [("a_cf000", "subject", [(0.1, 1), (0.2, 1), (0.3, 0), (0.4, 1), (0.5, 0)]),
                    ("a_cf001", "weather", [(0.2, 1), (0.4, 1)])]),
    # one edit with a single surviving candidate (wrong), another that never fails
    ("b", 1, True, [("b_cf000", "subject", [(0.6, 0)]), ("b_cf001", "subject", [(0.1, 1), (0.6, 1)])]),
    ("c", 2, True, [("c_cf000", "weather", [(0.1, 0), (0.5, 0)])]),
    # its original is wrong: no failure point (it cannot leave a class it is not in)
    ("d", 0, False, [("d_cf000", "subject", [(0.1, 1), (0.2, 0)])]),
    # a single surviving candidate, right: never fails
    ("e", 1, True, [("e_cf000", "weather", [(0.3, 1)])]),
    # complete subject series (a candidate at every level 0.1-0.6): the headline of subject and of all edits
    ("g", 2, True, [("g_cf000", "subject", [(0.1, 1), (0.2, 1), (0.3, 1), (0.4, 0), (0.5, 0), (0.6, 0)]),
                    ("g_cf001", "subject", [(0.1, 1), (0.2, 1), (0.3, 1), (0.4, 1), (0.5, 1), (0.6, 0)])]),
    ("h", 0, False, [("h_cf000", "subject", [(0.1, 0), (0.2, 1), (0.3, 1), (0.4, 1), (0.5, 0), (0.6, 1)])]),
]  # fmt: skip
UNPAIRED = ("f", 2, [("f_cf000", "subject", [(0.2, 1)])])  # its original was not scored


def hand_rows(seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []

    def row(config, key, source, label, correct, edit_type=None, strength=None, cf_key=None):
        rows.append(
            {
                "config": config, "key": key, "source_key": source, "label": label, "edit_type": edit_type,
                "edited_caption": None if edit_type is None else f"{source} {edit_type}",
                "p_gt": float(rng.random()), "correct1": bool(correct), "correct5": True,
                "top5": [label], "top5_prob": [0.5], "strength": strength, "counterfactual_key": cf_key,
            }
        )  # fmt: skip

    for source, label, original_correct, edits in IMAGES:
        row("original", source, source, label, original_correct)
        for cf_key, edit_type, series in edits:
            row("counterfactual", cf_key, source, label, series[0][1], edit_type)
            for i, (strength, correct) in enumerate(series):
                row("strength", f"{cf_key}_st{i}", source, label, correct, edit_type, strength, cf_key)
    source, label, edits = UNPAIRED
    for cf_key, edit_type, series in edits:
        for i, (strength, correct) in enumerate(series):
            row("strength", f"{cf_key}_st{i}", source, label, correct, edit_type, strength, cf_key)
    return rows


# -- the independent computation ---------------------------------------------------------------------------------------
def expected_pairs(rows):
    originals = {r["source_key"]: r for r in rows if r["config"] == "original"}
    return [(r, originals[r["source_key"]]) for r in rows if r["config"] == "strength" and r["source_key"] in originals]


def trapezoid_mean(xs, ys):
    if len(xs) == 1:
        return ys[0]
    area = 0.0
    for i in range(len(xs) - 1):
        area += (xs[i + 1] - xs[i]) * (ys[i] + ys[i + 1]) / 2
    return area / (xs[-1] - xs[0])


def expected_group(pairs, edit_type=None):
    chosen = [(r, o) for r, o in pairs if edit_type is None or r["edit_type"] == edit_type]
    levels = sorted({r["strength"] for r, _ in chosen})
    curve = []
    for level in levels:
        at = [(r, o) for r, o in chosen if r["strength"] == level]
        acc = 100 * sum(r["correct1"] for r, _ in at) / len(at)
        orig = 100 * sum(o["correct1"] for _, o in at) / len(at)
        dp = sum((o["p_gt"] - r["p_gt"]) * 100 for r, o in at) / len(at)
        curve.append({"strength": level, "n": len(at), "acc1": acc, "orig_acc1": orig, "delta_p_gt_mean": dp})
    # failure points, walking each image's series by increasing strength
    images = sorted({r["source_key"] for r, _ in chosen})
    first = {}
    for image in images:
        mine = [(r, o) for r, o in chosen if r["source_key"] == image]
        if not mine[0][1]["correct1"]:
            continue
        point = None
        for series in sorted({r["counterfactual_key"] for r, _ in mine}):
            for r, _ in sorted(
                (p for p in mine if p[0]["counterfactual_key"] == series), key=lambda p: p[0]["strength"]
            ):
                if not r["correct1"]:
                    point = r["strength"] if point is None else min(point, r["strength"])
                    break
        first[image] = point
    never = [k for k, v in first.items() if v is None]
    # the headline: the series with a sample at every level, the same ones at each level
    series = {}
    for r, o in chosen:
        series.setdefault(r["counterfactual_key"], {})[r["strength"]] = (r, o)
    complete = {k: v for k, v in series.items() if set(v) == set(levels)}
    headline = []
    for level in levels:
        at = [v[level] for v in complete.values()]
        if at:
            headline.append(
                {
                    "strength": level,
                    "n": len(at),
                    "acc1": 100 * sum(r["correct1"] for r, _ in at) / len(at),
                    "orig_acc1": 100 * sum(o["correct1"] for _, o in at) / len(at),
                    "delta_p_gt_mean": sum((o["p_gt"] - r["p_gt"]) * 100 for r, o in at) / len(at),
                }
            )
    return {
        "headline": headline,
        "headline_auc": trapezoid_mean(levels, [c["acc1"] for c in headline]) if headline else None,
        "n_complete": len(complete),
        "n_series": len(series),
        "levels": levels,
        "curve": curve,
        "auc": trapezoid_mean(levels, [c["acc1"] for c in curve]),
        "first": first,
        "n_original_wrong": len(images) - len(first),
        "never_share": 100 * len(never) / len(first) if first else None,
        "by_strength": [sum(v == level for v in first.values()) for level in levels],
    }


@pytest.fixture(scope="module")
def results():
    return compute_metrics(hand_rows(), LABELS, n_boot=300, seed=7)


def test_curve_area_and_failure_points_equal_an_independent_computation(results):
    section = results["strength"]
    validate_strength(section)
    assert results["computed_metrics"]["strength_curve"] == "2"
    pairs = expected_pairs(hand_rows())
    assert section["n"] == len(pairs) and section["n_unpaired"] == 1  # image f has no scored original
    for edit_type in (None, "subject", "weather"):
        want = expected_group(pairs, edit_type)
        got = section["overall"] if edit_type is None else section["by_edit_type"][edit_type]
        assert got["levels"] == pytest.approx(want["levels"])
        pooled = got["pooled"]
        assert len(pooled["curve"]) == len(want["curve"])
        for g, w in zip(pooled["curve"], want["curve"], strict=True):
            for key in ("strength", "n", "acc1", "orig_acc1", "delta_p_gt_mean"):
                assert g[key] == pytest.approx(w[key]), (edit_type, key)
            assert g["paired_delta_acc1"] == pytest.approx(w["acc1"] - w["orig_acc1"])
        assert pooled["auc_acc1"] == pytest.approx(want["auc"])
        # the headline: the same series at every level
        assert got["headline"]["n_series"] == want["n_complete"]
        assert got["headline"]["n_series_all"] == want["n_series"]
        assert len(got["curve"]) == len(want["headline"])
        for g, w in zip(got["curve"], want["headline"], strict=True):
            for key in ("strength", "n", "acc1", "orig_acc1", "delta_p_gt_mean"):
                assert g[key] == pytest.approx(w[key]), (edit_type, key)
        assert got["auc_acc1"] == (None if want["headline_auc"] is None else pytest.approx(want["headline_auc"]))
        failure = got["failure"]
        assert failure["n_images"] == len(want["first"])
        assert failure["n_original_wrong"] == want["n_original_wrong"]
        assert failure["never_share"] == pytest.approx(want["never_share"])
        assert [b["n"] for b in failure["by_strength"]] == want["by_strength"]
        where = section["images"]
        for image, point in want["first"].items():
            have = where[image]["failure_point"] if edit_type is None else where[image]["by_edit_type"][edit_type]
            assert have == (None if point is None else pytest.approx(point)), (image, edit_type)
    # the cases, spelled out: non-monotone a fails at 0.3; b's single wrong candidate at 0.6; e never fails; d's
    # original is wrong, so it has no failure point at all
    images = section["images"]
    assert images["a"]["failure_point"] == pytest.approx(0.3) and images["a"]["by_edit_type"]["weather"] is None
    assert images["b"]["failure_point"] == pytest.approx(0.6)
    assert images["e"]["failure_point"] is None and images["e"]["original_correct"] is True
    assert images["d"] == {
        "label": 0,
        "original_correct": False,
        "failure_point": None,
        "by_edit_type": {"subject": None},
    }
    assert section["overall"]["failure"]["never_share"] == pytest.approx(100 / 5)  # e, of a, b, c, e, g
    assert section["by_edit_type"]["weather"]["levels"] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    # no weather edit has a candidate at every level: an empty headline that says why, the pooled view still there
    weather = section["by_edit_type"]["weather"]
    assert weather["curve"] == [] and weather["auc_acc1"] is None and weather["headline"]["reason"]
    assert section["overall"]["headline"]["n_series"] == 3  # g's two, h's one


def test_bootstrap_intervals_resample_source_images_as_written_here(results):
    """The acc@1 interval at one strength and the area's interval, recomputed replicate by replicate in loops."""
    rows = hand_rows()
    pairs = expected_pairs(rows)
    clusters = sorted({r["source_key"] for r in rows})
    draws = np.random.default_rng(7).integers(0, len(clusters), size=(300, len(clusters)))
    levels = expected_group(pairs)["levels"]

    def accuracy(draw, level):
        correct = n = 0
        for c in draw:
            for r, _ in pairs:
                if r["source_key"] == clusters[c] and r["strength"] == level:
                    correct += r["correct1"]
                    n += 1
        return 100 * correct / n if n else math.nan

    per_level = np.array([[accuracy(draw, level) for level in levels] for draw in draws])
    curve = results["strength"]["overall"]["pooled"]["curve"]
    k = levels.index(0.2)
    finite = per_level[:, k][np.isfinite(per_level[:, k])]
    assert curve[k]["acc1_ci"] == pytest.approx(list(np.percentile(finite, [2.5, 97.5])))
    areas = np.array([trapezoid_mean(levels, list(row)) for row in per_level])
    finite = areas[np.isfinite(areas)]
    assert 0 < len(finite) < len(areas)  # some replicates draw no image at some strength: they are left out
    pooled = results["strength"]["overall"]["pooled"]
    assert pooled["auc_acc1_ci"] == pytest.approx(list(np.percentile(finite, [2.5, 97.5])))
    # the headline's interval: the complete series (g's two, h's one) of the drawn images
    complete = {"g_cf000", "g_cf001", "h_cf000"}

    def headline(draw, level):
        chosen = [r for c in draw for r, _ in pairs if r["source_key"] == clusters[c]]
        at = [r["correct1"] for r in chosen if r["counterfactual_key"] in complete and r["strength"] == level]
        return 100 * sum(at) / len(at) if at else math.nan

    per_level = np.array([[headline(draw, level) for level in levels] for draw in draws])
    areas = np.array([trapezoid_mean(levels, list(row)) for row in per_level])
    finite = areas[np.isfinite(areas)]
    assert 0 < len(finite) < len(areas)
    assert results["strength"]["overall"]["auc_acc1_ci"] == pytest.approx(list(np.percentile(finite, [2.5, 97.5])))
    k = levels.index(0.4)
    finite = per_level[:, k][np.isfinite(per_level[:, k])]
    assert results["strength"]["overall"]["curve"][k]["acc1_ci"] == pytest.approx(
        list(np.percentile(finite, [2.5, 97.5]))
    )


def test_no_strength_config_no_section_and_rows_without_its_columns_still_score():
    rows = [
        {k: v for k, v in r.items() if k not in ("strength", "counterfactual_key")}
        for r in hand_rows()
        if r["config"] != "strength"
    ]
    out = compute_metrics(rows, LABELS, n_boot=0)
    assert "strength" not in out and "strength_curve" not in out["computed_metrics"]
    with pytest.raises(ValueError, match=r"strength.overall.curve"):
        validate_strength({"overall": {"curve": []}, "by_edit_type": {}, "images": {}})


def _outside(fig) -> list[str]:
    """What a drawn figure puts outside itself: its tight box (every drawn text, legend, label and title, as
    matplotlib lays them out; ticks beyond the axes' limits are not drawn) must lie within the figure."""
    fig.canvas.draw()
    tight = fig.get_tightbbox(fig.canvas.get_renderer())  # inches
    width, height = fig.get_size_inches()
    slack = 0.5 / fig.dpi
    inside = tight.x0 >= -slack and tight.y0 >= -slack and tight.x1 <= width + slack and tight.y1 <= height + slack
    return [] if inside else [f"drawn box {tight} exceeds the figure's {width:.2f} x {height:.2f} in"]


def _as_results(strength: dict, name: str) -> dict:
    return {"status": "ok", "model": {"name": name, "weights": {"id": "pretrained"}}, "strength": strength}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["r", "vit_large_patch14_clip_336.openai_ft_in12k_in1k" * 2])
def test_no_strength_plot_label_is_clipped_however_long_the_names(results, name, tmp_path):
    import matplotlib.pyplot as plt
    from PIL import Image

    from evaluation.plots import (
        PANEL_WIDTH_IN,
        plot_strength_models,
        strength_model_figure,
        strength_models_figure,
    )

    section = results["strength"]
    long_types = dict(section, by_edit_type={f"{t} {'x' * 40}": g for t, g in section["by_edit_type"].items()})
    models = [_as_results(section, name), _as_results(long_types, name + " second"), _as_results(section, "r2")]
    for fig in (strength_model_figure(models[1]), strength_models_figure(models)):
        try:
            assert _outside(fig) == []
            assert fig.legends and all(t.get_text() for t in fig.legends[0].get_texts())
            # ... and the legend did not get its room by squeezing the panels (constrained layout would)
            widths = [ax.get_position().width * fig.get_size_inches()[0] for ax in fig.axes]
            assert min(widths) > 0.75 * PANEL_WIDTH_IN, widths
            expected = fig.get_size_inches() * fig.dpi  # the last one checked: strength_models_figure(models)
        finally:
            plt.close(fig)
    path = plot_strength_models(models, tmp_path / "strength.png")
    # saved at the figure's own size: the picture is the figure that was checked
    assert all(abs(a - b) <= 1 for a, b in zip(Image.open(path).size, expected, strict=True))


def test_the_leaderboard_carries_the_strength_area(results):
    from evaluation.leaderboard import STRENGTH_HEADER, compact_markdown, leaderboard_row

    full = {
        "status": "ok", "model": {"name": "m", "weights": {"id": "pretrained"}},
        "release": {"name": "r", "version": "1", "manifest_sha256": "x"}, "limit": None, **results,
    }  # fmt: skip
    row = leaderboard_row(full)
    overall = results["strength"]["overall"]
    assert row["strength_auc"] == overall["auc_acc1"]
    assert [row["strength_auc_ci_low"], row["strength_auc_ci_high"]] == overall["auc_acc1_ci"]
    assert row["strength_never_fail_share"] == overall["failure"]["never_share"]
    without = {k: v for k, v in full.items() if k != "strength"}
    assert leaderboard_row(without)["strength_auc"] is None

    import pandas as pd

    from evaluation.leaderboard import COLUMNS

    table = pd.DataFrame([dict(leaderboard_row(full), rank=1)], columns=COLUMNS)
    assert STRENGTH_HEADER in compact_markdown(table)
    table = pd.DataFrame([dict(leaderboard_row(without), rank=1)], columns=COLUMNS)
    assert STRENGTH_HEADER not in compact_markdown(table)


# -- the planted case: every image's series monotone, the gates drop hard images at high strength ---------------------
def _rows_of(images: list[tuple[str, int, bool, list]], seed: int = 0) -> list[dict]:
    """Prediction rows of ``images`` in the form of IMAGES (every image scored in its original too)."""
    rng = np.random.default_rng(seed)
    rows = []
    for source, label, original_correct, edits in images:
        base = {"source_key": source, "label": label, "correct5": True, "top5": [label], "top5_prob": [0.5]}
        rows.append(
            {
                **base,
                "config": "original",
                "key": source,
                "edit_type": None,
                "edited_caption": None,
                "p_gt": 0.9,
                "correct1": original_correct,
                "strength": None,
                "counterfactual_key": None,
            }
        )
        for cf_key, edit_type, series in edits:
            for i, (strength, correct) in enumerate(series):
                rows.append(
                    {
                        **base,
                        "config": "strength",
                        "key": f"{cf_key}_st{i}",
                        "edit_type": edit_type,
                        "edited_caption": f"{source} {edit_type}",
                        "p_gt": float(rng.random()),
                        "correct1": bool(correct),
                        "strength": strength,
                        "counterfactual_key": cf_key,
                    }
                )
    return rows  # fmt: skip


def _non_increasing(values: list[float]) -> bool:
    return all(b <= a + 1e-9 for a, b in zip(values, values[1:], strict=False))


@pytest.mark.slow
def test_the_gates_dropping_hard_images_bend_the_pooled_curve_but_not_the_headline():
    # the easy image is right at every strength; the hard one fails at 0.2 and its 0.3 candidate failed the gates
    images = [
        ("easy", 0, True, [("easy_cf", "subject", [(0.1, 1), (0.2, 1), (0.3, 1)])]),
        ("hard", 1, True, [("hard_cf", "subject", [(0.1, 1), (0.2, 0)])]),
    ]
    overall = compute_metrics(_rows_of(images), LABELS, n_boot=0)["strength"]["overall"]
    assert [c["acc1"] for c in overall["pooled"]["curve"]] == pytest.approx([100.0, 50.0, 100.0])
    assert [c["acc1"] for c in overall["curve"]] == pytest.approx([100.0, 100.0, 100.0])
    assert overall["headline"]["n_series"] == 1 and overall["headline"]["n_series_all"] == 2

    # many images, every series monotone (right, then wrong from its own breaking point on), the hardest ones
    # dropped by the gates above some strength: the pooled curve need not fall, the headline always does
    levels = [0.1, 0.2, 0.3, 0.4, 0.5]
    pooled_rises = 0
    for seed in range(20):
        rng = np.random.default_rng(seed)
        images = []
        for i in range(30):
            breaks = int(rng.integers(0, len(levels) + 1))  # first level at which it is wrong
            series = [(level, int(k < breaks)) for k, level in enumerate(levels)]
            if breaks < 3 and rng.random() < 0.7:  # a hard image: its strong candidates fail the gates
                series = series[: breaks + 1 + int(rng.integers(0, 2))]
            images.append((f"i{i:02d}", 0, True, [(f"i{i:02d}_cf", "subject", series)]))
        overall = compute_metrics(_rows_of(images, seed), LABELS, n_boot=0)["strength"]["overall"]
        assert _non_increasing([c["acc1"] for c in overall["curve"]]), seed
        pooled_rises += not _non_increasing([c["acc1"] for c in overall["pooled"]["curve"]])
    assert pooled_rises > 0  # the case is planted: the pooled view does bend


# -- rank stability -------------------------------------------------------------------------------------------------
def _model_results(seed: int, skill: float) -> dict:
    """A model's results on one fixed set of series (the release), with its own correctness."""
    rng = np.random.default_rng(seed)
    layout = np.random.default_rng(1234)  # the release: which images, edits and levels (the same for every model)
    images = []
    for i in range(16):
        edits = []
        for j, edit_type in enumerate(("subject", "weather")):
            levels = [0.1, 0.2, 0.3, 0.4] if layout.random() < 0.8 else [0.1, 0.3]
            edits.append((f"m{i}_cf{j}", edit_type, [(lv, int(rng.random() < skill - lv)) for lv in levels]))
        images.append((f"m{i:02d}", 0, True, edits))
    out = compute_metrics(_rows_of(images), LABELS, n_boot=0)
    from evaluation.results import RESULTS_SCHEMA, RESULTS_SCHEMA_VERSION

    head = {"schema": RESULTS_SCHEMA, "schema_version": RESULTS_SCHEMA_VERSION, "status": "ok", "error": None}
    head |= {"tool": {"name": "lance-counterfactuals", "version": "0"}, "options": {}, "limit": None, "failures": []}
    head["model"] = {"name": f"model{seed}", "weights": {"id": "pretrained"}, "data_config": {}}
    head["release"] = {"name": "r", "version": "1", "manifest_sha256": "a" * 64}
    return {**head, **out}, images


@pytest.mark.slow
def test_rank_stability_equals_scipy_kendall_tau_and_a_bootstrap_written_here():
    from scipy.stats import kendalltau

    from evaluation.strength import rank_stability

    built = [_model_results(seed, skill) for seed, skill in enumerate((0.95, 0.85, 0.75, 0.7, 0.6))]
    models, layouts = [m for m, _ in built], [layout for _, layout in built]
    n_boot, seed = 100, 3
    stability = rank_stability(models, n_boot=n_boot, seed=seed)
    assert stability["reason"] is None and stability["n_models"] == 5
    assert set(stability["groups"]) == {"overall", "subject", "weather"}
    for group in ("subject", "weather"):
        entry = stability["groups"][group]
        curves = [m["strength"]["by_edit_type"][group]["curve"] for m in models]
        assert entry["levels"] == pytest.approx([0.1, 0.2, 0.3, 0.4])
        # per model: each image's series of this type with a candidate at all four levels, from what was planted
        series = [
            {key: [s for _, t, s in edits if t == group and len(s) == 4] for key, _, _, edits in layout}
            for layout in layouts
        ]
        images = sorted(key for key, found in series[0].items() if found)
        for k, pair in enumerate(entry["pairs"]):
            x = [c[k]["acc1"] for c in curves]
            y = [c[k + 1]["acc1"] for c in curves]
            want = kendalltau(x, y).statistic
            assert pair["tau"] == (None if math.isnan(want) else pytest.approx(want, abs=1e-12))
            # the bootstrap, replicate by replicate: draw images, recount each model's acc@1 at both levels
            draws = np.random.default_rng(seed).integers(0, len(images), size=(n_boot, len(images)))
            taus = []
            for draw in draws:
                acc = []
                for mine in series:
                    drawn = [s for g in draw for s in mine[images[g]]]
                    acc.append([sum(s[lv][1] for s in drawn) / len(drawn) for lv in (k, k + 1)])
                tau = kendalltau([a[0] for a in acc], [a[1] for a in acc]).statistic
                if not math.isnan(tau):
                    taus.append(tau)
            assert pair["n_replicates"] == len(taus)
            assert pair["ci"] == pytest.approx(list(np.percentile(taus, [2.5, 97.5])), abs=1e-12)
    # fewer than three models: no tau, and a reason
    assert rank_stability(models[:2])["reason"].startswith("needs at least 3")


@pytest.mark.slow
def test_the_card_and_the_leaderboard_carry_the_rank_stability(tmp_path):
    import json

    import pandas as pd

    from evaluation.leaderboard import leaderboard_markdown, write_leaderboard
    from evaluation.strength import rank_stability

    models = [_model_results(seed, skill)[0] for seed, skill in enumerate((0.95, 0.8, 0.6))]
    stability = rank_stability(models)  # the defaults the card uses
    card = leaderboard_markdown(models)
    assert "Rank stability across edit strength" in card
    pair = stability["groups"]["subject"]["pairs"][0]
    assert f"| subject | 0.10 → 0.20 | {pair['tau']:.2f} [{pair['ci'][0]:.2f}, {pair['ci'][1]:.2f}]" in card
    for i, m in enumerate(models):
        folder = tmp_path / "results" / f"m{i}"
        folder.mkdir(parents=True)
        (folder / "results.json").write_text(json.dumps(m), encoding="utf-8")
    written = write_leaderboard([tmp_path / "results"], tmp_path / "board", n_boot=50, seed=1)
    table = pd.read_csv(written["strength_rank_stability"])
    want = rank_stability(models, n_boot=50, seed=1)["groups"]["weather"]["pairs"]
    got = table[table["edit_type"] == "weather"]
    assert got["kendall_tau"].tolist() == pytest.approx([p["tau"] for p in want])
    assert got["ci_low"].tolist() == pytest.approx([p["ci"][0] for p in want])
    assert "## Rank stability across edit strength" in written["markdown"].read_text(encoding="utf-8")
    page = written["html"].read_text(encoding="utf-8")
    tau = want[0]["tau"]
    assert "Rank stability across edit strength" in page and f"<td>{tau:.2f} [" in page


@pytest.mark.parametrize(
    ("tamper", "field"),
    [
        (lambda p: p["images"]["m00"].pop("correct"), "images.m00.correct"),
        (lambda p: p["images"]["m00"].update(correct=[9.0] * len(p["levels"])), "images.m00.correct"),
        (lambda p: p["images"]["m00"].update(n_series=0), "images.m00.n_series"),
        (lambda p: p.update(levels="0.1"), "levels"),
    ],
)
def test_a_results_json_whose_rank_panel_is_broken_is_refused_naming_the_field(tamper, field):
    """The leaderboard's reader checks the strength section (the panel rank stability resamples included), so a
    tampered results JSON is one line naming the field, never a KeyError inside rank_stability."""
    from evaluation.results import validate_results

    results, _ = _model_results(0, 0.9)
    validate_results(results)  # as eval writes it
    tamper(results["strength"]["overall"]["panel"])
    with pytest.raises(ValueError, match=f"results JSON field 'strength.overall.panel.{field}' must be"):
        validate_results(results)
