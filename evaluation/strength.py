"""Accuracy against edit strength, and where each image first fails (the ``strength`` config of a LANCE release).

A release built with ``keep_candidates`` (docs/method.md, "Edit strength") holds, besides each edit's selected
counterfactual, every gate-passing candidate of its self-attention sweep as a sample of the ``strength`` config, with
``strength = 1 - self_replace`` (``lance_pipeline.edit_strength``; larger is a stronger edit). Robustness measured
along such a continuous shift, with the point where each image first fails, separates models that a single drop
figure ranks the same (CNS-Bench, ICCV 2025). Definitions, per model and per edit type (and overall):

* **Pairs.** Every strength sample is compared with its own original (``source_key``), as every paired metric is;
  samples whose original was not scored are counted as ``n_unpaired`` and left out.
* **Curve.** For each strength level present (``levels``): ``n`` samples (and ``n_images`` source images), their
  acc@1 (%), the acc@1 of their own originals (``orig_acc1``), the paired difference, and the mean Delta p(y_GT) =
  100 (p(y|x) - p(y|x')), with 95% bootstrap intervals over source images for acc@1 and Delta p. The levels of an
  edit type are those its samples have: the gates keep an edit at some strengths only.
* **Area.** ``auc_acc1`` is the trapezoidal area under acc@1 against strength divided by the span of the levels: the
  curve's mean acc@1 in %, comparable between sweeps of different ranges (a single level: its acc@1). Its interval
  comes from the same bootstrap replicates (a replicate that draws no image at some level is left out).
* **Failure point.** A *series* is one edit of one image (its candidates, linked by ``counterfactual_key``). Its
  failure point is the weakest strength at which the model's top-1 prediction is not the true class, or none when
  it never is. An image's failure point (per edit type, and overall) is the weakest over its series. It is defined
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
    out: dict[str, dict[str, Any]] = {}
    for source_key, image in pairs.groupby("source_key", sort=True):
        original_correct = bool(image["correct1_orig"].iloc[0])
        by_type: dict[str, float | None] = {}
        for edit_type, rows in image.groupby("edit_type", sort=True):
            failing = rows.loc[~rows["correct1"].astype(bool), "level"]
            by_type[str(edit_type)] = float(failing.min()) if original_correct and len(failing) else None
        failures = [v for v in by_type.values() if v is not None]
        out[str(source_key)] = {
            "label": int(image["label"].iloc[0]),
            "original_correct": original_correct,
            "failure_point": min(failures) if failures else None,
            "by_edit_type": by_type,
        }
    return out


def _group(
    pairs: Any, points: dict[str, dict[str, Any]], edit_type: str | None, boot: ClusterBootstrap | None
) -> dict[str, Any]:
    """Curve, area and failure summary of one group of pairs (one edit type, or all of them: ``edit_type=None``)."""
    levels = sorted(pairs["level"].unique().tolist())
    keys = pairs["source_key"]
    correct = pairs["correct1"].to_numpy(dtype=np.float64)
    delta_p = (pairs["p_gt_orig"].to_numpy(dtype=np.float64) - pairs["p_gt"].to_numpy(dtype=np.float64)) * 100.0
    at = [pairs["level"].to_numpy() == level for level in levels]
    curve = []
    for level, mask in zip(levels, at, strict=True):
        acc1 = float(correct[mask].mean() * 100.0)
        orig = float(pairs["correct1_orig"].to_numpy(dtype=np.float64)[mask].mean() * 100.0)
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
    group = {
        "n": int(len(pairs)),
        "n_images": len(images),
        "n_series": int(pairs["series"].nunique()),
        "levels": [float(level) for level in levels],
        "curve": curve,
        "auc_acc1": float(normalised_area(levels, [c["acc1"] for c in curve])),
        "failure": failure,
    }
    if boot is not None:
        ones = np.ones(len(pairs))
        numerators = [boot.sums(keys[m], correct[m]) for m in at] + [boot.sums(keys[m], delta_p[m]) for m in at]
        denominators = [boot.sums(keys[m], ones[m]) for m in at] * 2
        never = [1.0 if f is None else 0.0 for f in first]
        numerators.append(boot.sums(eligible, never) if eligible else np.zeros(len(boot.clusters)))
        denominators.append(boot.sums(eligible, np.ones(len(eligible))) if eligible else np.zeros(len(boot.clusters)))
        replicates = boot.replicate_ratios(numerators, denominators)
        accuracy = np.stack(replicates[: len(levels)], axis=1) * 100.0
        for k, entry in enumerate(curve):
            entry["acc1_ci"] = boot.interval(accuracy[:, k])
            entry["delta_p_gt_mean_ci"] = boot.interval(replicates[len(levels) + k])
        group["auc_acc1_ci"] = boot.interval(normalised_area(levels, accuracy))
        failure["never_share_ci"] = boot.interval(replicates[-1] * 100.0) if eligible else None
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
    version = "1"
    description = (
        "On a release with a strength config (every gate-passing candidate of LANCE's self-attention sweep, strength "
        "= 1 - self_replace): per edit type and overall, acc@1 of the samples and of their own originals and mean "
        "Delta p(y_GT) at each strength with 95% bootstrap intervals over source images, the normalised area under "
        "acc@1 against strength (auc_acc1: the curve's mean acc@1, the leaderboard's strength_auc), and each image's "
        "failure point (the weakest strength whose top-1 is wrong, for images whose original is right) with the share "
        "that never fail."
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
    summary = "`strength.{overall, by_edit_type.*}.{curve, auc_acc1, auc_acc1_ci, failure}`, `strength.images.*`"

    def applies(self, context: MetricContext) -> bool:
        return STRENGTH_CONFIG in context.configs and "original" in context.configs

    def compute(self, context: MetricContext) -> dict[str, Any]:
        boot = _bootstrap(context) if context.n_boot > 0 else None
        section = strength_results(context.predictions, boot)
        return {"strength": section} if section is not None else {}


def validate_strength(section: Any) -> None:
    """Check a results JSON's ``strength`` section; raise ``ValueError`` naming the first bad field."""

    def fail(path: str, expected: str) -> None:
        raise ValueError(f"results JSON field 'strength.{path}' must be {expected}")

    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    if not isinstance(section, dict):
        fail("", "an object")
    groups = {"overall": section.get("overall")}
    if not isinstance(section.get("by_edit_type"), dict):
        fail("by_edit_type", "an object")
    groups.update({f"by_edit_type.{t}": g for t, g in section["by_edit_type"].items()})
    for path, group in groups.items():
        if not isinstance(group, dict) or not isinstance(group.get("curve"), list) or not group["curve"]:
            fail(f"{path}.curve", "a non-empty list")
        for i, point in enumerate(group["curve"]):
            if not isinstance(point, dict) or not number(point.get("strength")) or not number(point.get("acc1")):
                fail(f"{path}.curve[{i}]", "an object with numeric strength and acc1")
        if not number(group.get("auc_acc1")):
            fail(f"{path}.auc_acc1", "a number")
        if not isinstance(group.get("failure"), dict):
            fail(f"{path}.failure", "an object")
    if not isinstance(section.get("images"), dict):
        fail("images", "an object")
