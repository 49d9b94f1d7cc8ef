"""Accuracy against edit strength, and where each image first fails (the ``strength`` config of a LANCE release).

A release built with ``keep_candidates`` (docs/method.md, "Edit strength") holds, besides each edit's selected
counterfactual, every gate-passing candidate of its self-attention sweep as a sample of the ``strength`` config, with
``strength = 1 - self_replace`` (``lance_pipeline.edit_strength``; larger is a stronger edit). Robustness measured
along such a continuous shift, with the point where each image first fails, separates models that a single drop
figure ranks the same (CNS-Bench, ICCV 2025). Definitions, per model and per edit type (and overall):

* **Pairs.** Every strength sample is compared with its own original (``source_key``), as every paired metric is;
  samples whose original was not scored are counted as ``n_unpaired`` and left out.
* **Curve (the headline: the same series at every level).** A *series* is one edit of one image (its candidates,
  linked by ``counterfactual_key``). The headline curve is computed over the series that have a candidate at every
  strength level of the group (``levels``): at each level, over those series, acc@1 (%), the acc@1 of their own
  originals (``orig_acc1``), the paired difference, and the mean Delta p(y_GT) = 100 (p(y|x) - p(y|x')), with 95%
  bootstrap intervals over source images. The same series enter every level, so a change along the curve is a change
  of those images under a stronger edit, never a change of which images are counted: the gates drop hard images at
  some strengths, and a curve that pools whatever survived at each level mixes different images (a release in which
  every image's series is monotone can then show 100% -> 50% -> 100%). No value is imputed: a series missing a level
  is left out of the headline, and ``headline`` counts how many series it rests on (``n_series`` of
  ``n_series_all``); with none, the curve is empty and its area null (``headline.reason``).
* **Pooled curve (a second view, ``pooled``).** At each level every sample present, whichever series it belongs to:
  ``n`` samples, ``n_images``, the same statistics. It answers "how accurate are the candidates kept at this
  strength", not "what happens to one image as the edit grows".
* **Area.** ``auc_acc1`` is the trapezoidal area under the headline's acc@1 against strength divided by the span of
  the levels: the curve's mean acc@1 in %, comparable between sweeps of different ranges (a single level: its acc@1).
  Its interval comes from the same bootstrap replicates (a replicate that draws no series is left out);
  ``pooled.auc_acc1`` is the pooled curve's (a replicate that draws no image at some level is left out).
* **Rank stability.** Over the models of one leaderboard, per edit type (and over all edits), Kendall's tau-b between
  the models' headline acc@1 at each pair of adjacent levels (:func:`rank_stability`), with a 95% bootstrap interval
  over source images: replicate ``b`` draws the images of the same-series panel with
  ``numpy.random.default_rng(seed).integers(0, G, size=(n_boot, G))`` (images sorted by key), recomputes every
  model's acc@1 at both levels on the drawn images and the tau of the replicate; replicates where one side is constant
  (tau undefined) are left out. Each results JSON carries its panel (``panel``: per image, its number of headline
  series and how many are top-1 correct at each level) so that the leaderboard can resample images across models.
* **Failure point.** A series' failure point is the weakest strength at which the model's top-1 prediction is not
  the true class, or none when it never is. An image's failure point (per edit type, and overall) is the weakest over its series. It is defined
  for images whose original is top-1 correct (the prediction can only *leave* the true class from there); the others
  are counted as ``n_original_wrong``. ``never_share`` is the share (%) of defined images that never fail (with a
  bootstrap interval), ``by_strength`` how many first fail at each level. A series is observed only at the strengths
  that passed the gates, so "never" means never at those.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from evaluation.metric_registry import Metric, MetricContext
from evaluation.metrics import ClusterBootstrap, _bootstrap, pair_with_originals
from evaluation.results import is_complete, model_label
from lance_pipeline.edit_strength import STRENGTH_CONFIG, STRENGTH_DEFINITION

LEVEL_DECIMALS = 6  # strengths are stored rounded to 10 decimals; levels compare at 6


def strength_pairs(predictions: Any) -> Any:
    """The ``strength`` rows joined with their originals (``*_orig`` columns), with ``level`` and ``series``."""
    pairs = pair_with_originals(predictions, STRENGTH_CONFIG)
    pairs = pairs[pairs["strength"].notna()].copy()
    pairs["level"] = pairs["strength"].astype(float).round(LEVEL_DECIMALS)
    # one series per edit of one image: its selected counterfactual's key (the edited caption, were it absent)
    series = pairs["counterfactual_key"].where(pairs["counterfactual_key"].notna(), pairs["edited_caption"])
    pairs["series"] = pairs["source_key"].astype(str) + "\x00" + series.astype(str)
    pairs["delta_p"] = (pairs["p_gt_orig"].astype(float) - pairs["p_gt"].astype(float)) * 100.0
    return pairs


def normalised_area(levels: list[float], values: Any) -> Any:
    """Trapezoidal area under ``values`` (last axis, one per level) over ``levels``, divided by the levels' span: the
    curve's mean. One level: its value. Works on a vector or on a matrix of bootstrap replicates (NaN propagates)."""
    values = np.asarray(values, dtype=np.float64)
    if len(levels) == 1:
        return values[..., 0]
    x = np.asarray(levels, dtype=np.float64)
    segments = (x[1:] - x[:-1]) * (values[..., 1:] + values[..., :-1]) / 2.0
    return segments.sum(axis=-1) / (x[-1] - x[0])


def failure_points(pairs: Any) -> dict[str, dict[str, Any]]:
    """Per source image: its label, whether its original is top-1 correct, its failure point overall and per edit
    type (None: never fails, or undefined when the original is wrong)."""
    # One groupby each for the images' first rows, their edit types and their weakest failing levels, instead of a
    # groupby per image: the same values, and eval of a release with many images no longer loops in pandas.
    firsts = pairs.groupby("source_key", sort=True).head(1)
    first_of = {
        key: (bool(correct), int(label))
        for key, correct, label in zip(firsts["source_key"], firsts["correct1_orig"], firsts["label"], strict=True)
    }
    types = pairs.groupby(["source_key", "edit_type"], sort=True).size().index
    failing = pairs.loc[~pairs["correct1"].astype(bool)].groupby(["source_key", "edit_type"])["level"].min()
    weakest = {key: float(level) for key, level in failing.items()}
    by_image: dict[Any, dict[str, float | None]] = {key: {} for key in sorted(first_of)}
    for source_key, edit_type in types:
        level = weakest.get((source_key, edit_type))
        by_image[source_key][str(edit_type)] = level if first_of[source_key][0] else None
    out: dict[str, dict[str, Any]] = {}
    for source_key, by_type in by_image.items():
        original_correct, label = first_of[source_key]
        failures = [v for v in by_type.values() if v is not None]
        out[str(source_key)] = {
            "label": label,
            "original_correct": original_correct,
            "failure_point": min(failures) if failures else None,
            "by_edit_type": by_type,
        }
    return out


def _pooled(pairs: Any, levels: list[float], boot: ClusterBootstrap | None) -> dict[str, Any]:
    """The pooled view: at each level, every sample present there (whichever series it belongs to)."""
    keys = pairs["source_key"]
    correct = pairs["correct1"].to_numpy(dtype=np.float64)
    delta_p = pairs["delta_p"].to_numpy(dtype=np.float64)
    original = pairs["correct1_orig"].to_numpy(dtype=np.float64)
    at = [pairs["level"].to_numpy() == level for level in levels]
    curve = []
    for level, mask in zip(levels, at, strict=True):
        acc1 = float(correct[mask].mean() * 100.0)
        orig = float(original[mask].mean() * 100.0)
        curve.append(
            {
                "strength": float(level),
                "n": int(mask.sum()),
                "n_images": int(keys[mask].nunique()),
                "acc1": acc1,
                "orig_acc1": orig,
                "paired_delta_acc1": acc1 - orig,
                "delta_p_gt_mean": float(delta_p[mask].mean()),
            }
        )
    pooled = {"curve": curve, "auc_acc1": float(normalised_area(levels, [c["acc1"] for c in curve]))}
    if boot is not None:
        ones = np.ones(len(pairs))
        numerators = [boot.sums(keys[m], correct[m]) for m in at] + [boot.sums(keys[m], delta_p[m]) for m in at]
        denominators = [boot.sums(keys[m], ones[m]) for m in at] * 2
        replicates = boot.replicate_ratios(numerators, denominators)
        accuracy = np.stack(replicates[: len(levels)], axis=1) * 100.0
        for k, entry in enumerate(curve):
            entry["acc1_ci"] = boot.interval(accuracy[:, k])
            entry["delta_p_gt_mean_ci"] = boot.interval(replicates[len(levels) + k])
        pooled["auc_acc1_ci"] = boot.interval(normalised_area(levels, accuracy))
    return pooled


def same_series(pairs: Any, levels: list[float]) -> dict[str, Any]:
    """The series observed at every one of ``levels``, as matrices (series x level) of top-1 correctness and Delta p
    (a series with two samples at one level counts their mean there), with each series' source image and original.
    """
    cells = (
        pairs.groupby(["series", "level"], sort=True)
        .agg(correct=("correct1", "mean"), delta_p=("delta_p", "mean"))
        .unstack("level")
    )
    series = pairs.groupby("series", sort=True).agg(source=("source_key", "first"), orig=("correct1_orig", "first"))
    correct = cells["correct"].reindex(columns=levels)
    complete = correct.notna().all(axis=1)
    kept = correct.index[complete]
    return {
        "n_series_all": int(len(correct)),
        "source": series.loc[kept, "source"].astype(str).tolist(),
        "orig": series.loc[kept, "orig"].to_numpy(dtype=np.float64),
        "correct": correct.loc[kept].to_numpy(dtype=np.float64),
        "delta_p": cells["delta_p"].reindex(columns=levels).loc[kept].to_numpy(dtype=np.float64),
    }


def _headline(pairs: Any, levels: list[float], boot: ClusterBootstrap | None) -> dict[str, Any]:
    """The headline: curve, area and rank panel over the series observed at every level."""
    panel = same_series(pairs, levels)
    source, correct, delta_p, orig = panel["source"], panel["correct"], panel["delta_p"], panel["orig"]
    headline: dict[str, Any] = {
        "basis": "the series (edits of one image) observed at every level; none imputed",
        "n_series": len(source),
        "n_series_all": panel["n_series_all"],
        "n_images": len(set(source)),
        "reason": None,
    }
    out: dict[str, Any] = {"headline": headline, "curve": [], "auc_acc1": None}
    if not source:
        headline["reason"] = "no series has a candidate at every strength level (the gates dropped some)"
        out["panel"] = {"levels": [float(level) for level in levels], "images": {}}
        if boot is not None:
            out["auc_acc1_ci"] = None
        return out
    images = sorted(set(source))
    n_images = len(set(source))
    for k, level in enumerate(levels):
        acc1 = float(correct[:, k].mean() * 100.0)
        orig_acc1 = float(orig.mean() * 100.0)
        out["curve"].append(
            {
                "strength": float(level),
                "n": len(source),
                "n_images": n_images,
                "acc1": acc1,
                "orig_acc1": orig_acc1,
                "paired_delta_acc1": acc1 - orig_acc1,
                "delta_p_gt_mean": float(delta_p[:, k].mean()),
            }
        )
    out["auc_acc1"] = float(normalised_area(levels, [c["acc1"] for c in out["curve"]]))
    # per image: its number of headline series and how many are correct at each level (for rank_stability)
    position = {key: i for i, key in enumerate(images)}
    rows = np.array([position[key] for key in source], dtype=np.int64)
    counts = np.bincount(rows, minlength=len(images))
    sums = np.zeros((len(images), len(levels)))
    np.add.at(sums, rows, correct)
    out["panel"] = {
        "levels": [float(level) for level in levels],
        "images": {key: {"n_series": int(counts[i]), "correct": sums[i].tolist()} for i, key in enumerate(images)},
    }
    if boot is not None:
        ones = np.ones(len(source))
        n = boot.sums(source, ones)
        numerators = [boot.sums(source, correct[:, k]) for k in range(len(levels))]
        numerators += [boot.sums(source, delta_p[:, k]) for k in range(len(levels))]
        replicates = boot.replicate_ratios(numerators, [n] * len(numerators))
        accuracy = np.stack(replicates[: len(levels)], axis=1) * 100.0
        for k, entry in enumerate(out["curve"]):
            entry["acc1_ci"] = boot.interval(accuracy[:, k])
            entry["delta_p_gt_mean_ci"] = boot.interval(replicates[len(levels) + k])
        out["auc_acc1_ci"] = boot.interval(normalised_area(levels, accuracy))
    return out


def _group(
    pairs: Any, points: dict[str, dict[str, Any]], edit_type: str | None, boot: ClusterBootstrap | None
) -> dict[str, Any]:
    """Curves, areas and failure summary of one group of pairs (one edit type, or all of them: ``edit_type=None``)."""
    levels = sorted(pairs["level"].unique().tolist())
    keys = pairs["source_key"]
    # failure points of this group's images: per edit type, or the image's overall one
    images = sorted(set(keys))
    eligible = [k for k in images if points[k]["original_correct"]]
    first = [
        points[k]["failure_point"] if edit_type is None else points[k]["by_edit_type"][edit_type] for k in eligible
    ]
    failing = [f for f in first if f is not None]
    failure = {
        "n_images": len(eligible),
        "n_original_wrong": len(images) - len(eligible),
        "n_never": len(first) - len(failing),
        "never_share": (len(first) - len(failing)) / len(first) * 100.0 if first else None,
        "by_strength": [{"strength": float(level), "n": sum(f == level for f in failing)} for level in levels],
        "median_failure_point": float(np.median(failing)) if failing else None,
    }
    headline = _headline(pairs, levels, boot)
    group = {
        "n": int(len(pairs)),
        "n_images": len(images),
        "n_series": int(pairs["series"].nunique()),
        "levels": [float(level) for level in levels],
        "headline": headline["headline"],
        "curve": headline["curve"],
        "auc_acc1": headline["auc_acc1"],
        **({"auc_acc1_ci": headline["auc_acc1_ci"]} if boot is not None else {}),
        "pooled": _pooled(pairs, levels, boot),
        "failure": failure,
        "panel": headline["panel"],
    }
    if boot is not None:
        never = [1.0 if f is None else 0.0 for f in first]
        if eligible:
            (share,) = boot.replicate_ratios([boot.sums(eligible, never)], [boot.sums(eligible, np.ones(len(never)))])
            failure["never_share_ci"] = boot.interval(share * 100.0)
        else:
            failure["never_share_ci"] = None
    return group


def strength_results(predictions: Any, boot: ClusterBootstrap | None) -> dict[str, Any] | None:
    """The ``strength`` section of a results JSON from one model's predictions (None without paired strength rows)."""
    rows = predictions[predictions["config"] == STRENGTH_CONFIG]
    pairs = strength_pairs(predictions)
    if pairs.empty:
        return None
    points = failure_points(pairs)
    return {
        "config": STRENGTH_CONFIG,
        "definition": STRENGTH_DEFINITION,
        "n": int(len(pairs)),
        "n_unpaired": int(len(rows) - len(pairs)),
        "overall": _group(pairs, points, None, boot),
        "by_edit_type": {
            str(t): _group(group, points, str(t), boot) for t, group in pairs.groupby("edit_type", sort=True)
        },
        "images": points,
    }


class StrengthCurve(Metric):
    name = "strength_curve"
    version = "2"
    description = (
        "On a release with a strength config (every gate-passing candidate of LANCE's self-attention sweep, strength "
        "= 1 - self_replace): per edit type and overall, over the series (edits of one image) observed at every "
        "strength, acc@1 and their originals' acc@1 and mean Delta p(y_GT) at each strength with 95% bootstrap "
        "intervals over source images, and the normalised area under acc@1 against strength (auc_acc1: the curve's "
        "mean acc@1, the leaderboard's strength_auc); the same for every sample pooled per strength (pooled, a second "
        "view that mixes images); each image's failure point (the weakest strength whose top-1 is wrong, for images "
        "whose original is right) with the share that never fail; and the per-image panel the leaderboard's rank "
        "stability resamples."
    )
    needs = (
        "config",
        "source_key",
        "label",
        "edit_type",
        "edited_caption",
        "p_gt",
        "correct1",
        "strength",
        "counterfactual_key",
    )
    produces = ("strength",)
    summary = (
        "`strength.{overall, by_edit_type.*}.{headline, curve, auc_acc1, auc_acc1_ci, pooled, failure, panel}`, "
        "`strength.images.*`"
    )

    def applies(self, context: MetricContext) -> bool:
        return STRENGTH_CONFIG in context.configs and "original" in context.configs

    def compute(self, context: MetricContext) -> dict[str, Any]:
        boot = _bootstrap(context) if context.n_boot > 0 else None
        section = strength_results(context.predictions, boot)
        return {"strength": section} if section is not None else {}


# -- rank stability across strength levels (over the models of one leaderboard) ------------------------------------
MIN_MODELS = 3  # as the shift correlations: two models always have tau = +-1


def kendall_tau_b(x: Any, y: Any) -> np.ndarray:
    """Kendall's tau-b between the last axes of ``x`` and ``y`` (models), over any leading axes (replicates):
    sum over model pairs of sign(dx) sign(dy), divided by the square root of the untied pairs of each side; NaN where
    one side is constant."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    i, j = np.triu_indices(x.shape[-1], k=1)
    sx, sy = np.sign(x[..., i] - x[..., j]), np.sign(y[..., i] - y[..., j])
    denominator = np.sqrt((sx * sx).sum(axis=-1) * (sy * sy).sum(axis=-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denominator > 0, (sx * sy).sum(axis=-1) / np.where(denominator > 0, denominator, 1.0), np.nan)


def _panels(results: list[dict[str, Any]], group: str) -> tuple[list[dict[str, Any]], str | None]:
    """Each model's same-series panel of one group (``overall`` or an edit type), or why they cannot be compared."""
    panels = []
    for r in results:
        section = r.get("strength") or {}
        entry = section.get("overall") if group == "overall" else (section.get("by_edit_type") or {}).get(group)
        panel = (entry or {}).get("panel")
        if panel is None:
            return [], "a result has no same-series panel (metric strength_curve before version 2, or no such edits)"
        panels.append(panel)
    first = panels[0]
    same = all(
        p["levels"] == first["levels"]
        and p["images"].keys() == first["images"].keys()
        and all(p["images"][k]["n_series"] == first["images"][k]["n_series"] for k in first["images"])
        for p in panels
    )
    if not same:
        return [], "the models' same-series panels differ (results of different samples)"
    if not first["images"]:
        return [], "no series has a candidate at every strength level"
    if len(first["levels"]) < 2:
        return [], "a single strength level"
    return panels, None


def rank_stability(
    results: list[dict[str, Any]], n_boot: int = 1000, seed: int = 0, level: float = 95.0
) -> dict[str, Any]:
    """Per edit type (and ``overall``), Kendall's tau-b between the models' headline acc@1 at adjacent strength levels,
    with a percentile bootstrap interval over source images (module docstring, "Rank stability").

    Args:
        results: results JSONs of one release; the complete, successful ones with a strength section count.
        n_boot: replicates; 0 turns intervals off.
        seed: ``numpy.random.default_rng(seed).integers(0, G, size=(n_boot, G))`` draws the panel's G images
            (sorted by key), the same draws for every group.

    Returns:
        ``{"n_models", "models", "reason", "groups": {group: {"levels", "n_images", "n_series", "reason",
        "pairs": [{"from", "to", "tau", "ci", "n_replicates"}]}}}``, groups ``overall`` then the edit types.
    """
    kept = [r for r in results if r.get("status") == "ok" and is_complete(r) and r.get("strength")]
    out: dict[str, Any] = {"n_models": len(kept), "models": [model_label(r) for r in kept], "reason": None}
    out["groups"] = {}
    if len(kept) < MIN_MODELS:
        out["reason"] = f"needs at least {MIN_MODELS} complete results with a strength config; {len(kept)} found"
        return out
    types = sorted({t for r in kept for t in (r["strength"].get("by_edit_type") or {})})
    for group in ["overall", *types]:
        panels, reason = _panels(kept, group)
        entry: dict[str, Any] = {"levels": [], "n_images": 0, "n_series": 0, "reason": reason, "pairs": []}
        out["groups"][group] = entry
        if reason:
            continue
        levels = panels[0]["levels"]
        images = sorted(panels[0]["images"])
        n = np.array([panels[0]["images"][k]["n_series"] for k in images], dtype=np.float64)
        # correct[m, g, l]: how many of image g's headline series model m has right at level l
        correct = np.array([[p["images"][k]["correct"] for k in images] for p in panels], dtype=np.float64)
        accuracy = correct.sum(axis=1) / n.sum()  # [m, l]
        entry.update(levels=levels, n_images=len(images), n_series=int(n.sum()))
        replicates = None
        if n_boot > 0:
            draws = np.random.default_rng(seed).integers(0, len(images), size=(n_boot, len(images)))
            flat = (draws + (np.arange(n_boot) * len(images))[:, None]).ravel()
            weights = np.bincount(flat, minlength=n_boot * len(images)).reshape(n_boot, len(images))
            weights = weights.astype(np.float64)
            # [b, m, l]: every model's acc@1 on the drawn images
            replicates = np.einsum("bg,mgl->bml", weights, correct) / (weights @ n)[:, None, None]
        for k in range(len(levels) - 1):
            tau = float(kendall_tau_b(accuracy[:, k], accuracy[:, k + 1]))
            pair: dict[str, Any] = {"from": levels[k], "to": levels[k + 1], "tau": None if math.isnan(tau) else tau}
            pair["ci"], pair["n_replicates"] = None, 0
            if replicates is not None:
                taus = kendall_tau_b(replicates[:, :, k], replicates[:, :, k + 1])
                finite = taus[np.isfinite(taus)]
                pair["n_replicates"] = int(finite.size)
                if finite.size:
                    tail = (100.0 - level) / 2.0
                    pair["ci"] = [float(v) for v in np.percentile(finite, [tail, 100.0 - tail])]
            entry["pairs"].append(pair)
    return out
