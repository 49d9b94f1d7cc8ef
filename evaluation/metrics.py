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

import math
from typing import Any

import numpy as np

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


def _group_stats(pairs: Any) -> dict[str, Any]:
    """Sensitivity statistics of a table of pairs (columns of the counterfactual and ``*_orig`` of its original)."""
    n = len(pairs)
    delta_p = (pairs["p_gt_orig"].to_numpy() - pairs["p_gt"].to_numpy()) * 100.0
    base = pairs["correct1_orig"].to_numpy(dtype=bool)
    flips = base & ~pairs["correct1"].to_numpy(dtype=bool)
    return {
        "n": int(n),
        "acc1": _pct(pairs["correct1"]),
        "acc5": _pct(pairs["correct5"]),
        "orig_acc1": _pct(pairs["correct1_orig"]),
        "orig_acc5": _pct(pairs["correct5_orig"]),
        "paired_delta_acc1": _pct(pairs["correct1"].to_numpy(float) - pairs["correct1_orig"].to_numpy(float)),
        "paired_delta_acc5": _pct(pairs["correct5"].to_numpy(float) - pairs["correct5_orig"].to_numpy(float)),
        "delta_p_gt_mean": float(delta_p.mean()) if n else None,
        "delta_p_gt_abs_mean": float(np.abs(delta_p).mean()) if n else None,
        "flip_rate": float(flips.sum() / base.sum() * 100.0) if base.sum() else None,
        "flips": int(flips.sum()),
        "n_flip_base": int(base.sum()),
    }


class ClusterBootstrap:
    """Percentile bootstrap over source images (clusters), vectorised as multinomial weights over cluster sums.

    Replicate ``b`` draws ``G`` clusters with replacement: ``rng.integers(0, G, size=(n_boot, G))`` with
    ``rng = numpy.random.default_rng(seed)``, clusters being the sorted distinct ``source_key`` values. A ratio
    statistic ``sum(x) / sum(n)`` is then ``(W @ x_g) / (W @ n_g)`` with ``W[b, g]`` the times cluster ``g`` was drawn.
    """

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
        """Bootstrap replicates of several ratio statistics at once (same draws for all)."""
        g = len(self.clusters)
        num = np.stack(numerators, axis=1)
        den = np.stack(denominators, axis=1)
        out_num = np.empty((self.n_boot, num.shape[1]))
        out_den = np.empty((self.n_boot, num.shape[1]))
        for start in range(0, self.n_boot, self._chunk):
            draws = self._draws[start : start + self._chunk]
            weights = np.zeros((draws.shape[0], g))
            np.add.at(weights, (np.repeat(np.arange(draws.shape[0]), g), draws.ravel()), 1.0)
            out_num[start : start + len(draws)] = weights @ num
            out_den[start : start + len(draws)] = weights @ den
        with np.errstate(invalid="ignore", divide="ignore"):
            ratios = np.where(out_den > 0, out_num / np.where(out_den > 0, out_den, 1.0), np.nan)
        return [ratios[:, i] for i in range(ratios.shape[1])]

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


def compute_metrics(
    rows: list[dict[str, Any]], label_names: list[str], n_boot: int = 1000, seed: int = 0
) -> dict[str, Any]:
    """All metrics of one model from its per-sample prediction rows.

    Returns:
        ``{"metrics": {config: ...}, "sensitivity": {...counterfactual...}, "sensitivity_by_config": {config: ...}}``;
        the layout is documented in docs/evaluation.md.
    """
    import pandas as pd

    df = pd.DataFrame(rows)
    if df.empty:
        raise ValueError("no predictions: the release has no samples")
    df["edit_type"] = df["edit_type"].fillna(NONE_EDIT_TYPE)
    # original first, then every other config in the order the release lists them (declared configs included)
    present = list(dict.fromkeys(df["config"]))
    configs = [c for c in ("original", *present) if c in present]
    configs = list(dict.fromkeys(configs))
    has_original = "original" in configs

    def name_of(label: int) -> str:
        return label_names[label] if 0 <= label < len(label_names) else str(label)

    boot = ClusterBootstrap(sorted(set(df["source_key"])), n_boot, seed)

    # 1. acc@k per config, with per-class breakdown, and the bootstrap sums per source image
    metrics: dict[str, Any] = {}
    acc_sums: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for config in configs:
        sub = df[df["config"] == config]
        entry: dict[str, Any] = {"n": int(len(sub)), "acc1": _pct(sub["correct1"]), "acc5": _pct(sub["correct5"])}
        acc_sums[config] = (
            boot.sums(sub["source_key"], sub["correct1"]),
            boot.sums(sub["source_key"], sub["correct5"]),
            boot.sums(sub["source_key"], np.ones(len(sub))),
        )
        by_class = {}
        for label, group in sub.groupby("label", sort=True):
            by_class[str(label)] = {
                "label_name": name_of(int(label)),
                "n": int(len(group)),
                "acc1": _pct(group["correct1"]),
                "acc5": _pct(group["correct5"]),
            }
        entry["by_class"] = by_class
        metrics[config] = entry

    # 2. Delta acc@k against original (eq. 3), set-level and paired, with bootstrap intervals
    if n_boot > 0:
        reps = {}
        for config in configs:
            c1, c5, n = acc_sums[config]
            reps[config] = boot.replicate_ratios([c1, c5], [n, n])
            metrics[config]["acc1_ci"] = boot.interval(reps[config][0] * 100.0)
            metrics[config]["acc5_ci"] = boot.interval(reps[config][1] * 100.0)
    if has_original:
        base = metrics["original"]
        for config in configs:
            if config == "original":
                continue
            entry = metrics[config]
            entry["delta_acc1"] = entry["acc1"] - base["acc1"]
            entry["delta_acc5"] = entry["acc5"] - base["acc5"]
            if n_boot > 0:
                entry["delta_acc1_ci"] = boot.interval((reps[config][0] - reps["original"][0]) * 100.0)
                entry["delta_acc5_ci"] = boot.interval((reps[config][1] - reps["original"][1]) * 100.0)
            for label, cls in entry["by_class"].items():
                orig_cls = base["by_class"].get(label)
                cls["delta_acc1"] = cls["acc1"] - orig_cls["acc1"] if orig_cls else None
                cls["delta_acc5"] = cls["acc5"] - orig_cls["acc5"] if orig_cls else None

    # 3. Delta p(y_GT), flip rate: per pair, then overall / by edit type / by class
    by_config: dict[str, Any] = {}
    if has_original:
        for config in configs:
            if config == "original":
                continue
            pairs = pair_with_originals(df, config)
            unpaired = int((df["config"] == config).sum() - len(pairs))
            if pairs.empty:
                continue
            overall = _group_stats(pairs)
            overall["n_unpaired"] = unpaired
            metrics[config]["paired_delta_acc1"] = overall["paired_delta_acc1"]
            metrics[config]["paired_delta_acc5"] = overall["paired_delta_acc5"]
            metrics[config]["n_paired"] = overall["n"]
            if n_boot > 0:
                keys = pairs["source_key"]
                delta_p = (pairs["p_gt_orig"].to_numpy() - pairs["p_gt"].to_numpy()) * 100.0
                base_ok = pairs["correct1_orig"].to_numpy(dtype=bool)
                flips = base_ok & ~pairs["correct1"].to_numpy(dtype=bool)
                diff1 = pairs["correct1"].to_numpy(float) - pairs["correct1_orig"].to_numpy(float)
                n = boot.sums(keys, np.ones(len(pairs)))
                dp, dp_abs, fl, d1 = boot.replicate_ratios(
                    [
                        boot.sums(keys, delta_p),
                        boot.sums(keys, np.abs(delta_p)),
                        boot.sums(keys, flips),
                        boot.sums(keys, diff1),
                    ],
                    [n, n, boot.sums(keys, base_ok), n],
                )
                overall["delta_p_gt_mean_ci"] = boot.interval(dp)
                overall["delta_p_gt_abs_mean_ci"] = boot.interval(dp_abs)
                overall["flip_rate_ci"] = boot.interval(fl * 100.0)
                overall["paired_delta_acc1_ci"] = boot.interval(d1 * 100.0)
            section: dict[str, Any] = {"config": config, "overall": overall}
            section["by_edit_type"] = {
                str(t): _group_stats(group) for t, group in pairs.groupby("edit_type", sort=True)
            }
            section["by_class"] = {
                str(label): {"label_name": name_of(int(label)), **_group_stats(group)}
                for label, group in pairs.groupby("label", sort=True)
            }
            by_config[config] = section

    out = {
        "metrics": metrics,
        "sensitivity": by_config.get("counterfactual")
        or {"config": "counterfactual", "overall": None, "by_edit_type": {}, "by_class": {}},
        "sensitivity_by_config": {c: s for c, s in by_config.items() if c != "counterfactual"},
    }
    return _deep_clean(out)


def _deep_clean(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_clean(v) for v in value]
    if isinstance(value, (np.floating, np.integer)):
        value = value.item()
    return _clean(value)
