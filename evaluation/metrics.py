"""Metrics of LANCE section 4 (Table 2, Figure 3, Appendix B), computed from per-sample predictions.

Definitions (docs/evaluation.md has the full text and sources):

* acc@k of a config: percentage of its samples whose label is among the model's top-k predictions (timm's
  ``accuracy``), with n.
* Delta acc@k of a config (LANCE eq. 3): acc@k(config) - acc@k(original), in points. ``paired_delta_acc*`` is the same
  difference restricted to pairs (each sample against its own original through ``source_key``).
* Delta p(y_GT) of a pair: p(y_GT | x) - p(y_GT | x') in percentage points, x the original and x' the counterfactual,
  with p the model's full softmax (the authors' code read p from the top-5 only and set it to 0 outside; it also kept
  only the absolute value). Positive means the edit lowered the model's confidence in the true class. We report the
  signed mean and the mean absolute value (the paper's "sensitivity").
* Flip rate: among pairs whose original is top-1 correct, the percentage whose counterfactual is top-1 wrong.
* 95% intervals: percentile bootstrap, resampling source images (an original with all its counterfactuals) with
  replacement, so that the correlation between edits of one image is kept.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from evaluation import judge_kept
from evaluation.judge_kept import SECTION as JUDGE_KEPT_SECTION
from evaluation.judge_kept import judge_view, kept_rows
from evaluation.metric_registry import (
    Metric,
    MetricContext,
    create_metric,
    default_metric_names,
    metric_applies,
    run_metrics,
    select_metrics,
)

NONE_EDIT_TYPE = "none"


def _pct(values: Any) -> float | None:
    values = np.asarray(values, dtype=np.float64)
    return float(values.mean() * 100.0) if values.size else None


def _clean(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class ClusterBootstrap:
    """Percentile bootstrap over source images (clusters), vectorised as multinomial weights over cluster sums.

    Replicate ``b`` draws ``G`` clusters with replacement: ``rng.integers(0, G, size=(n_boot, G))`` with
    ``rng = numpy.random.default_rng(seed)``, clusters being the sorted distinct ``source_key`` values. A ratio
    statistic ``sum(x) / sum(n)`` is then ``(W @ x_g) / (W @ n_g)`` with ``W[b, g]`` the times cluster ``g`` was drawn.
    """

    BLOCK = 4

    def __init__(self, clusters: list[str], n_boot: int, seed: int, level: float = 95.0, chunk: int = 200) -> None:
        self.clusters = clusters
        self.position = {c: i for i, c in enumerate(clusters)}
        self.n_boot = n_boot
        self.level = level
        draws = np.random.default_rng(seed).integers(0, len(clusters), size=(n_boot, len(clusters)))
        self._draws = draws
        self._chunk = chunk

    def sums(self, keys: Any, values: Any) -> np.ndarray:
        out = np.zeros(len(self.clusters), dtype=np.float64)
        np.add.at(out, np.array([self.position[k] for k in keys], dtype=np.int64), np.asarray(values, dtype=np.float64))
        return out

    def replicate_ratios(self, numerators: list[np.ndarray], denominators: list[np.ndarray]) -> list[np.ndarray]:
        """Bootstrap replicates of several ratio statistics at once (same draws for all).

        The weighted sums run in matrix products of exactly ``BLOCK`` columns (zero-padded): a BLAS product's
        rounding can depend on how many columns it has, and this keeps each statistic's replicates the same bits
        whichever other statistics (metrics) are computed beside it.
        """
        g = len(self.clusters)
        k = len(numerators)
        width = -(-k // self.BLOCK) * self.BLOCK
        num = np.zeros((g, width))
        den = np.zeros((g, width))
        num[:, :k] = np.stack(numerators, axis=1)
        den[:, :k] = np.stack(denominators, axis=1)
        out_num = np.empty((self.n_boot, width))
        out_den = np.empty((self.n_boot, width))
        for start in range(0, self.n_boot, self._chunk):
            draws = self._draws[start : start + self._chunk]
            # W[b, c] = times cluster c was drawn in replicate b (bincount: the same integers as np.add.at, faster)
            flat = (draws + (np.arange(draws.shape[0]) * g)[:, None]).ravel()
            weights = np.bincount(flat, minlength=draws.shape[0] * g).reshape(draws.shape[0], g).astype(np.float64)
            rows = slice(start, start + len(draws))
            for block in range(0, width, self.BLOCK):
                columns = slice(block, block + self.BLOCK)
                out_num[rows, columns] = weights @ num[:, columns]
                out_den[rows, columns] = weights @ den[:, columns]
        with np.errstate(invalid="ignore", divide="ignore"):
            ratios = np.where(out_den > 0, out_num / np.where(out_den > 0, out_den, 1.0), np.nan)
        return [ratios[:, i] for i in range(k)]

    def interval(self, replicates: np.ndarray) -> list[float] | None:
        finite = replicates[np.isfinite(replicates)]
        if finite.size == 0 or self.n_boot == 0:
            return None
        tail = (100.0 - self.level) / 2.0
        lo, hi = np.percentile(finite, [tail, 100.0 - tail])
        return [float(lo), float(hi)]


def pair_with_originals(df: Any, config: str) -> Any:
    """Rows of ``config`` joined with their original through ``source_key`` (``*_orig`` columns)."""
    originals = df[df["config"] == "original"].set_index("key")[["p_gt", "correct1", "correct5", "top5", "top5_prob"]]
    sub = df[df["config"] == config]
    # Suffix the original's columns up front: DataFrame.join's lsuffix/rsuffix keywords are deprecated in pandas.
    return sub.join(originals.add_suffix("_orig"), on="source_key", how="inner")


# -- shared intermediates (one per run, whichever metrics ask first) ---------------------------------------------------
def _bootstrap(context: MetricContext) -> ClusterBootstrap:
    df = context.predictions
    return context.cached(
        "bootstrap", lambda: ClusterBootstrap(sorted(set(df["source_key"])), context.n_boot, context.seed)
    )


def _config_rows(context: MetricContext, config: str) -> Any:
    df = context.predictions
    return context.cached(("rows", config), lambda: df[df["config"] == config])


def _accuracy_replicates(context: MetricContext, config: str) -> list[np.ndarray]:
    """Bootstrap replicates of a config's acc@1 and acc@5 (fractions), from per-source-image sums."""

    def replicates() -> list[np.ndarray]:
        boot, sub = _bootstrap(context), _config_rows(context, config)
        n = boot.sums(sub["source_key"], np.ones(len(sub)))
        c1, c5 = boot.sums(sub["source_key"], sub["correct1"]), boot.sums(sub["source_key"], sub["correct5"])
        return boot.replicate_ratios([c1, c5], [n, n])

    return context.cached(("accuracy_replicates", config), replicates)


def _paired_configs(context: MetricContext) -> list[str]:
    return [c for c in context.configs if c != "original"] if "original" in context.configs else []


def _pairs(context: MetricContext, config: str) -> Any:
    return context.cached(("pairs", config), lambda: pair_with_originals(context.predictions, config))


# -- acc@k and its drop ------------------------------------------------------------------------------------------------
class Accuracy(Metric):
    name = "accuracy"
    version = "1"
    description = (
        "acc@1 and acc@5 (%) of every config with its sample count, per class too, and 95% bootstrap intervals over "
        "source images."
    )
    needs = ("config", "source_key", "label", "correct1", "correct5")
    produces = (
        "metrics.*.n",
        "metrics.*.acc1",
        "metrics.*.acc5",
        "metrics.*.by_class",
        "metrics.*.acc1_ci",
        "metrics.*.acc5_ci",
    )

    def compute(self, context: MetricContext) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for config in context.configs:
            sub = _config_rows(context, config)
            entry: dict[str, Any] = {"n": int(len(sub)), "acc1": _pct(sub["correct1"]), "acc5": _pct(sub["correct5"])}
            entry["by_class"] = {
                str(label): {
                    "label_name": context.label_name(int(label)),
                    "n": int(len(group)),
                    "acc1": _pct(group["correct1"]),
                    "acc5": _pct(group["correct5"]),
                }
                for label, group in sub.groupby("label", sort=True)
            }
            if context.n_boot > 0:
                boot = _bootstrap(context)
                acc1, acc5 = _accuracy_replicates(context, config)
                entry["acc1_ci"] = boot.interval(acc1 * 100.0)
                entry["acc5_ci"] = boot.interval(acc5 * 100.0)
            out[config] = entry
        return {"metrics": out}


class AccuracyDrop(Metric):
    name = "accuracy_drop"
    version = "1"
    description = (
        "Delta acc@1 and acc@5 of every config against original (LANCE eq. 3), in points, per class too, with 95% "
        "bootstrap intervals: a set-level difference (paired_accuracy_drop pairs each sample with its own original)."
    )
    needs = ("config", "source_key", "label", "correct1", "correct5")
    produces = (
        "metrics.*.delta_acc1",
        "metrics.*.delta_acc5",
        "metrics.*.delta_acc1_ci",
        "metrics.*.delta_acc5_ci",
        "metrics.*.by_class.*.delta_acc1",
        "metrics.*.by_class.*.delta_acc5",
    )

    def applies(self, context: MetricContext) -> bool:
        return bool(_paired_configs(context))

    def compute(self, context: MetricContext) -> dict[str, Any]:
        original = _config_rows(context, "original")
        base = (_pct(original["correct1"]), _pct(original["correct5"]))
        base_by_class = {
            str(label): (_pct(g["correct1"]), _pct(g["correct5"])) for label, g in original.groupby("label", sort=True)
        }
        out: dict[str, Any] = {}
        for config in _paired_configs(context):
            sub = _config_rows(context, config)
            entry: dict[str, Any] = {
                "delta_acc1": _pct(sub["correct1"]) - base[0],
                "delta_acc5": _pct(sub["correct5"]) - base[1],
            }
            if context.n_boot > 0:
                boot = _bootstrap(context)
                here, there = _accuracy_replicates(context, config), _accuracy_replicates(context, "original")
                entry["delta_acc1_ci"] = boot.interval((here[0] - there[0]) * 100.0)
                entry["delta_acc5_ci"] = boot.interval((here[1] - there[1]) * 100.0)
            by_class = {}
            for label, group in sub.groupby("label", sort=True):
                orig = base_by_class.get(str(label))
                by_class[str(label)] = {
                    "delta_acc1": _pct(group["correct1"]) - orig[0] if orig else None,
                    "delta_acc5": _pct(group["correct5"]) - orig[1] if orig else None,
                }
            entry["by_class"] = by_class
            out[config] = entry
        return {"metrics": out}


# -- paired metrics: each sample against its own original ------------------------------------------------------------
_PAIRED_GROUPS = ("overall", "by_edit_type.*", "by_class.*")


def paired_declarations(
    stats: tuple[str, ...], intervals: tuple[str, ...] = (), config_keys: tuple[str, ...] = ()
) -> tuple[tuple[str, ...], str]:
    """``produces`` and its docs summary for a :class:`PairedMetric`: its statistics in every pair group of every
    paired config (the counterfactual config under ``sensitivity``, the others under ``sensitivity_by_config.<c>``)."""
    produces = [f"metrics.*.{key}" for key in config_keys]
    for section in ("sensitivity", "sensitivity_by_config.*"):
        produces += [f"{section}.config", f"{section}.overall.n_unpaired", f"{section}.by_class.*.label_name"]
        produces += [f"{section}.{group}.{stat}" for group in _PAIRED_GROUPS for stat in ("n", *stats)]
        produces += [f"{section}.overall.{name}_ci" for name in intervals]
    summary = f"`metrics.*.{{{', '.join(config_keys)}}}`; " if config_keys else ""
    summary += (
        f"`{{sensitivity, sensitivity_by_config.*}}.{{overall, by_edit_type.*, by_class.*}}.{{{', '.join(stats)}}}`"
    )
    if intervals:
        summary += f", `overall.{{{', '.join(f'{name}_ci' for name in intervals)}}}`"
    return tuple(produces), summary


class PairedMetric(Metric):
    """A statistic of (original, edited) pairs, matched through ``source_key``: reported for every config paired
    with ``original``, overall (with 95% bootstrap intervals over source images), by edit type and by class.

    Subclasses define :meth:`group_stats` (point estimates of a table of pairs) and :meth:`interval_ratios`.
    """

    def applies(self, context: MetricContext) -> bool:
        return bool(_paired_configs(context))

    def group_stats(self, pairs: Any) -> dict[str, Any]:
        raise NotImplementedError

    def interval_ratios(self, pairs: Any) -> dict[str, tuple[np.ndarray, np.ndarray, float]]:
        """``{statistic: (per-pair numerator, per-pair denominator, scale)}`` of the ratio statistics that get a
        bootstrap interval (``sum(numerator) / sum(denominator) * scale``)."""
        return {}

    def config_entry(self, overall: dict[str, Any]) -> dict[str, Any]:
        """Keys this metric adds to ``metrics.<config>`` from its overall statistics."""
        return {}

    def compute(self, context: MetricContext) -> dict[str, Any]:
        sections: dict[str, Any] = {}
        config_entries: dict[str, Any] = {}
        for config in _paired_configs(context):
            pairs = _pairs(context, config)
            if pairs.empty:
                continue
            overall = {"n": int(len(pairs)), **self.group_stats(pairs)}
            overall["n_unpaired"] = int(len(_config_rows(context, config)) - len(pairs))
            ratios = self.interval_ratios(pairs) if context.n_boot > 0 else {}
            if ratios:
                boot = _bootstrap(context)
                keys = pairs["source_key"]
                replicates = boot.replicate_ratios(
                    [boot.sums(keys, numerator) for numerator, _, _ in ratios.values()],
                    [boot.sums(keys, denominator) for _, denominator, _ in ratios.values()],
                )
                for (name, (_, _, scale)), values in zip(ratios.items(), replicates, strict=True):
                    overall[f"{name}_ci"] = boot.interval(values * scale)
            sections[config] = {
                "config": config,
                "overall": overall,
                "by_edit_type": {
                    str(t): {"n": int(len(group)), **self.group_stats(group)}
                    for t, group in pairs.groupby("edit_type", sort=True)
                },
                "by_class": {
                    str(label): {
                        "label_name": context.label_name(int(label)),
                        "n": int(len(group)),
                        **self.group_stats(group),
                    }
                    for label, group in pairs.groupby("label", sort=True)
                },
            }
            entry = self.config_entry(overall)
            if entry:
                config_entries[config] = entry
        out: dict[str, Any] = {}
        if config_entries:
            out["metrics"] = config_entries
        if "counterfactual" in sections:
            out["sensitivity"] = sections.pop("counterfactual")
        if sections:
            out["sensitivity_by_config"] = sections
        return out


class PairedAccuracyDrop(PairedMetric):
    name = "paired_accuracy_drop"
    version = "1"
    description = (
        "acc@1/acc@5 (%) of the edited samples and of their own originals, and their difference (paired Delta acc, "
        "the leaderboard's ranking), overall with a 95% interval, by edit type and by class."
    )
    needs = ("config", "key", "source_key", "label", "edit_type", "correct1", "correct5")
    _stats = ("acc1", "acc5", "orig_acc1", "orig_acc5", "paired_delta_acc1", "paired_delta_acc5")
    produces, summary = paired_declarations(
        _stats, intervals=("paired_delta_acc1",), config_keys=("paired_delta_acc1", "paired_delta_acc5", "n_paired")
    )

    def group_stats(self, pairs: Any) -> dict[str, Any]:
        return {
            "acc1": _pct(pairs["correct1"]),
            "acc5": _pct(pairs["correct5"]),
            "orig_acc1": _pct(pairs["correct1_orig"]),
            "orig_acc5": _pct(pairs["correct5_orig"]),
            "paired_delta_acc1": _pct(pairs["correct1"].to_numpy(float) - pairs["correct1_orig"].to_numpy(float)),
            "paired_delta_acc5": _pct(pairs["correct5"].to_numpy(float) - pairs["correct5_orig"].to_numpy(float)),
        }

    def interval_ratios(self, pairs: Any) -> dict[str, tuple[np.ndarray, np.ndarray, float]]:
        diff1 = pairs["correct1"].to_numpy(float) - pairs["correct1_orig"].to_numpy(float)
        return {"paired_delta_acc1": (diff1, np.ones(len(pairs)), 100.0)}

    def config_entry(self, overall: dict[str, Any]) -> dict[str, Any]:
        return {
            "paired_delta_acc1": overall["paired_delta_acc1"],
            "paired_delta_acc5": overall["paired_delta_acc5"],
            "n_paired": overall["n"],
        }


class TrueClassConfidenceDrop(PairedMetric):
    name = "true_class_confidence_drop"
    version = "1"
    description = (
        "Delta p(y_GT): the model's true-class probability (full softmax) on the original minus on the edited sample, "
        "in points; signed mean and mean absolute value (the paper's sensitivity), overall with 95% intervals, by "
        "edit type and by class."
    )
    needs = ("config", "key", "source_key", "label", "edit_type", "p_gt")
    produces, summary = paired_declarations(
        ("delta_p_gt_mean", "delta_p_gt_abs_mean"), intervals=("delta_p_gt_mean", "delta_p_gt_abs_mean")
    )

    @staticmethod
    def _delta_p(pairs: Any) -> np.ndarray:
        return (pairs["p_gt_orig"].to_numpy() - pairs["p_gt"].to_numpy()) * 100.0

    def group_stats(self, pairs: Any) -> dict[str, Any]:
        delta_p = self._delta_p(pairs)
        return {
            "delta_p_gt_mean": float(delta_p.mean()) if len(pairs) else None,
            "delta_p_gt_abs_mean": float(np.abs(delta_p).mean()) if len(pairs) else None,
        }

    def interval_ratios(self, pairs: Any) -> dict[str, tuple[np.ndarray, np.ndarray, float]]:
        delta_p, ones = self._delta_p(pairs), np.ones(len(pairs))
        return {"delta_p_gt_mean": (delta_p, ones, 1.0), "delta_p_gt_abs_mean": (np.abs(delta_p), ones, 1.0)}


class FlipRate(PairedMetric):
    name = "flip_rate"
    version = "1"
    description = (
        "Among pairs whose original is top-1 correct, the percentage whose edited sample is top-1 wrong (with the "
        "counts), overall with a 95% interval, by edit type and by class."
    )
    needs = ("config", "key", "source_key", "label", "edit_type", "correct1")
    produces, summary = paired_declarations(("flip_rate", "flips", "n_flip_base"), intervals=("flip_rate",))

    @staticmethod
    def _flips(pairs: Any) -> tuple[np.ndarray, np.ndarray]:
        base = pairs["correct1_orig"].to_numpy(dtype=bool)
        return base, base & ~pairs["correct1"].to_numpy(dtype=bool)

    def group_stats(self, pairs: Any) -> dict[str, Any]:
        base, flips = self._flips(pairs)
        return {
            "flip_rate": float(flips.sum() / base.sum() * 100.0) if base.sum() else None,
            "flips": int(flips.sum()),
            "n_flip_base": int(base.sum()),
        }

    def interval_ratios(self, pairs: Any) -> dict[str, tuple[np.ndarray, np.ndarray, float]]:
        base, flips = self._flips(pairs)
        return {"flip_rate": (flips, base, 100.0)}


def _empty_sensitivity() -> dict[str, Any]:
    return {"config": "counterfactual", "overall": None, "by_edit_type": {}, "by_class": {}}


def compute_metrics(
    rows: list[dict[str, Any]],
    label_names: list[str],
    n_boot: int = 1000,
    seed: int = 0,
    *,
    metrics: list[str] | None = None,
    min_per_class: int = 5,
    release_configs: list[str] | None = None,
    edit_clusters: dict[str, Any] | None = None,
    insight_top: int = 3,
    manifest: dict[str, Any] | None = None,
    release_kind: str | None = None,
) -> dict[str, Any]:
    """The metrics ``metrics`` (default: every default registered metric) of one model from its prediction rows.

    ``manifest`` is the release's manifest, for metrics that read its declarations (which configs are shifts).
    ``release_configs`` (default: the configs of ``rows``) are all the configs the release declares, scored or not:
    which metrics apply depends on the release, not on which configs a ``--limit`` run happened to reach.
    ``edit_clusters`` (:func:`evaluation.insights.cluster_release_edits`, once per run) enables the ``insights``
    metric, which reports ``insight_top`` clusters per class. ``release_kind`` (``lance_pipeline.release_kinds``)
    decides which kind-specific metrics apply.

    Returns:
        ``{"metrics": {config: ...}, "sensitivity": {...counterfactual...}, "sensitivity_by_config": {config: ...},
        "computed_metrics": {name: version}}`` plus what other metrics write (``interfaces``) and, when a selection
        left out default metrics that apply, ``metrics_left_out``; the layout is documented in docs/evaluation.md.
    """
    import pandas as pd

    df = pd.DataFrame(rows)
    if df.empty:
        raise ValueError("no predictions: the release has no samples")
    df["edit_type"] = df["edit_type"].fillna(NONE_EDIT_TYPE)
    # original first, then every other config in the order the release lists them (declared configs included)
    present = list(dict.fromkeys(df["config"]))
    configs = list(dict.fromkeys(c for c in ("original", *present) if c in present))
    context = MetricContext(
        rows=rows,
        predictions=df,
        label_names=label_names,
        configs=configs,
        n_boot=n_boot,
        seed=seed,
        min_per_class=min_per_class,
        release_configs=release_configs,
        edit_clusters=edit_clusters,
        insight_top=insight_top,
        manifest=manifest,
        release_kind=release_kind,
    )
    selected = select_metrics(metrics)
    out, computed = run_metrics(context, selected)
    view = judge_view(manifest)
    # the second view: every selected metric again on the judge-kept samples (rows that do not carry the judge's
    # score at all, written before it was read, get none rather than a view that keeps nothing judged)
    if view is not None and any(judge_kept.FIELD in row for row in rows):
        out[JUDGE_KEPT_SECTION] = _judge_kept_section(rows, view, context, selected)
    # default metrics that would have run here but were not selected: such a run is not complete (evaluation.results)
    left_out = [n for n in default_metric_names() if n not in selected and metric_applies(create_metric(n), context)]
    # the sections the results format always has, even when no selected metric applies to them
    out = {
        "metrics": out.pop("metrics"),
        "sensitivity": out.pop("sensitivity", None) or _empty_sensitivity(),
        "sensitivity_by_config": out.pop("sensitivity_by_config", {}),
        **out,
        "computed_metrics": computed,
    } | ({"metrics_left_out": left_out} if left_out else {})
    return _deep_clean(out)


def _judge_kept_section(
    rows: list[dict[str, Any]], view: dict[str, Any], context: MetricContext, selected: list[str]
) -> dict[str, Any]:
    """``view`` (evaluation.judge_kept) with the counts it kept and every metric of ``selected`` on its rows, computed
    as the full view is (same bootstrap seed and resamples, same configs order)."""
    import pandas as pd

    kept, counts = kept_rows(rows, view)
    if not kept:  # the judge kept nothing and nothing else was scored: an empty view, said so
        return {**view, "counts": counts, "metrics": {}, "sensitivity": _empty_sensitivity(),
                "sensitivity_by_config": {}}  # fmt: skip
    df = pd.DataFrame(kept)
    df["edit_type"] = df["edit_type"].fillna(NONE_EDIT_TYPE)
    sub = dataclasses.replace(context, rows=kept, predictions=df, _cache={})
    sub.configs = [c for c in context.configs if c in set(df["config"])]
    out, _ = run_metrics(sub, selected)
    return {
        **view,
        "counts": counts,
        "metrics": out.pop("metrics"),
        "sensitivity": out.pop("sensitivity", None) or _empty_sensitivity(),
        "sensitivity_by_config": out.pop("sensitivity_by_config", {}),
        **out,
    }


def _deep_clean(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_clean(v) for v in value]
    if isinstance(value, (np.floating, np.integer)):
        value = value.item()
    return _clean(value)
