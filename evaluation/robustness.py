"""Is the stress test telling the truth? Effective robustness across models, and agreement with real shifts.

* Effective robustness (Taori et al., NeurIPS 2020, "Measuring robustness to natural distribution shifts in image
  classification"; Miller et al., ICML 2021, "Accuracy on the line"): across the models of a leaderboard, accuracy on
  the counterfactuals against accuracy on their originals, both probit-transformed, with a least-squares line
  ``probit(acc_cf) = a * probit(acc_orig) + b``. A model's effective robustness is how far it sits above that line:
  in accuracy points, ``acc_cf - 100 * Phi(a * probit(acc_orig) + b)`` (Taori's definition), and in probit units,
  the residual ``probit(acc_cf) - (a * probit(acc_orig) + b)``. The accuracies are the paired ones (each
  counterfactual and its own original, ``sensitivity.overall.acc1`` / ``orig_acc1``), so that how many edits each
  class kept does not move the x axis. An accuracy of 0 or 100% is clipped to ``[0.5/n, 1 - 0.5/n]`` (n the number
  of pairs) before the probit.
* Correlation with real shifts: for every model whose timm-published top-1 on ImageNet, ImageNet-V2, -R, -Sketch and
  -A is known (:mod:`evaluation.timm_results`), the Spearman rank correlation between its paired Delta acc@1 on this
  release and its drop on each real shift (shift top-1 minus ImageNet top-1), with a percentile bootstrap interval
  over models.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from evaluation.results import is_complete
from evaluation.timm_results import SHIFTS, SOURCE_NOTE, load_shift_table

logger = logging.getLogger(__name__)

MIN_MODELS = 3


def probit(accuracy_pct: Any, n: Any) -> np.ndarray:
    """Probit (inverse standard normal CDF) of accuracies in percent, clipped to ``[0.5/n, 1 - 0.5/n]``."""
    from scipy.stats import norm

    p = np.asarray(accuracy_pct, dtype=np.float64) / 100.0
    eps = 0.5 / np.maximum(np.asarray(n, dtype=np.float64), 1.0)
    return norm.ppf(np.clip(p, eps, 1.0 - eps))


def paired_accuracies(results: dict[str, Any]) -> tuple[float, float, int] | None:
    """(original acc@1, counterfactual acc@1, pairs) over the counterfactual/original pairs of one results JSON."""
    overall = (results.get("sensitivity") or {}).get("overall") or {}
    if overall.get("acc1") is None or overall.get("orig_acc1") is None or not overall.get("n"):
        return None
    return float(overall["orig_acc1"]), float(overall["acc1"]), int(overall["n"])


def effective_robustness(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The probit-space fit over the complete, successful results and each model's effective robustness.

    Returns:
        ``{"slope", "intercept", "n_models", "by_model": {index in results: {"effective_robustness",
        "effective_robustness_probit"}}, "reason"}``; slope/intercept are None (with ``reason``) when fewer than
        three models with distinct original accuracies are available.
    """
    points = []
    for i, r in enumerate(results):
        acc = paired_accuracies(r) if is_complete(r) else None
        if acc is not None:
            points.append((i, *acc))
    out: dict[str, Any] = {"slope": None, "intercept": None, "n_models": len(points), "by_model": {}, "reason": None}
    if len(points) < MIN_MODELS or len({p[1] for p in points}) < 2:
        out["reason"] = f"needs at least {MIN_MODELS} complete models with different original accuracies"
        return out
    from scipy.stats import norm

    idx = [p[0] for p in points]
    x_acc = np.array([p[1] for p in points])
    y_acc = np.array([p[2] for p in points])
    n = np.array([p[3] for p in points])
    x, y = probit(x_acc, n), probit(y_acc, n)
    slope, intercept = np.polyfit(x, y, 1)
    fitted = slope * x + intercept
    for i, model_index in enumerate(idx):
        out["by_model"][model_index] = {
            "effective_robustness": float(y_acc[i] - 100.0 * norm.cdf(fitted[i])),
            "effective_robustness_probit": float(y[i] - fitted[i]),
        }
    out["slope"], out["intercept"] = float(slope), float(intercept)
    return out


def timm_model_name(results: dict[str, Any]) -> str | None:
    """The name of the published timm weights a results JSON scored (``arch.tag``), None for other weights."""
    model = results.get("model") or {}
    weights = model.get("weights") or {}
    if weights.get("id") != "pretrained":
        return None
    name = str(model.get("name") or "")
    if name.startswith("hf-hub:timm/"):
        name = name[len("hf-hub:timm/") :]
    elif name.startswith("hf-hub:"):
        return None
    if "." not in name and weights.get("pretrained_tag"):
        name = f"{name}.{weights['pretrained_tag']}"
    return name


def spearman(x: Any, y: Any) -> float | None:
    """Spearman's rank correlation with average ranks for ties (scipy); None when either side is constant."""
    from scipy.stats import spearmanr

    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) < 2 or np.all(x == x[0]) or np.all(y == y[0]):
        return None
    return float(spearmanr(x, y).statistic)


def shift_correlations(
    results: list[dict[str, Any]], n_boot: int = 1000, seed: int = 0, table: dict[str, dict[str, float]] | None = None
) -> dict[str, Any]:
    """Spearman correlation between each model's paired Delta acc@1 here and its drop on each real shift.

    Args:
        results: results JSONs (one release); only complete, successful runs of published timm weights count.
        n_boot: bootstrap resamples of the models (``numpy.random.default_rng(seed).integers(0, M, (n_boot, M))``);
            replicates where either side is constant are dropped; 95% percentile interval.
        table: published accuracies (default: the shipped timm table).

    Returns:
        ``{"source", "models": [{"model", "delta_here", "drops": {shift: drop}}], "by_shift": {shift: {"name",
        "spearman", "ci", "n_models"}}, "reason"}``.
    """
    table = load_shift_table() if table is None else table
    models = []
    for r in results:
        if not is_complete(r):
            continue
        name = timm_model_name(r)
        paired = ((r.get("metrics") or {}).get("counterfactual") or {}).get("paired_delta_acc1")
        if name is None or name not in table or paired is None:
            continue
        published = table[name]
        drops = {s: published[s] - published["imagenet"] for s in SHIFTS}
        models.append({"model": name, "delta_here": float(paired), "drops": drops})
    out: dict[str, Any] = {"source": SOURCE_NOTE, "models": models, "by_shift": {}, "reason": None}
    if len(models) < MIN_MODELS:
        out["reason"] = (
            f"needs at least {MIN_MODELS} complete results of published timm weights; {len(models)} found "
            "(random weights and checkpoints have no published figures)"
        )
    here = np.array([m["delta_here"] for m in models])
    draws = np.random.default_rng(seed).integers(0, len(models), size=(n_boot, len(models))) if models else None
    for shift, label in SHIFTS.items():
        there = np.array([m["drops"][shift] for m in models])
        entry: dict[str, Any] = {"name": label, "n_models": len(models), "spearman": None, "ci": None}
        if len(models) >= MIN_MODELS:
            entry["spearman"] = spearman(here, there)
            if n_boot > 0 and draws is not None:
                reps = [spearman(here[d], there[d]) for d in draws]
                reps = np.array([v for v in reps if v is not None])
                if reps.size:
                    lo, hi = np.percentile(reps, [2.5, 97.5])
                    entry["ci"] = [float(lo), float(hi)]
        out["by_shift"][shift] = entry
    return out
