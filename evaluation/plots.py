"""Pictures of evaluation results (matplotlib, Agg backend): for the leaderboard and each model's report."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _ok(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in results if r.get("status") == "ok"]


def _label(result: dict[str, Any]) -> str:
    return result["model"].get("slug") or result["model"]["name"]


def plot_edit_type_sensitivity(results: list[dict[str, Any]], path: Path) -> Path:
    """Grouped bars: mean Delta p(y_GT) (points) per edit type, one bar per model, with the flip rate annotated."""
    import numpy as np

    from builder.release_format import EDIT_TYPES

    plt = _pyplot()
    results = _ok(results)
    present = sorted({t for r in results for t in r["sensitivity"]["by_edit_type"]}, key=_edit_type_order(EDIT_TYPES))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(present) + 2), 4), dpi=100)
    width = 0.8 / max(1, len(results))
    x = np.arange(len(present))
    for i, r in enumerate(results):
        values = [(r["sensitivity"]["by_edit_type"].get(t) or {}).get("delta_p_gt_mean") or 0.0 for t in present]
        ax.bar(x + i * width - 0.4 + width / 2, values, width, label=_label(r))
    ax.axhline(0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(x, present)
    ax.set_ylabel("mean Δ p(y_GT) (points, + = hurt)")
    ax.set_title("Sensitivity by edit type")
    if results:
        ax.legend(fontsize=7, loc="best")
    return _save(fig, path)


def _edit_type_order(edit_types: tuple[str, ...]):
    order = {t: i for i, t in enumerate(edit_types)}
    return lambda t: (order.get(t, len(order)), t)


def plot_class_delta_acc(results: list[dict[str, Any]], path: Path, max_classes: int = 30) -> Path:
    """Grouped horizontal bars: Delta acc@1 (counterfactual - original, points) per class, one bar per model."""
    import numpy as np

    plt = _pyplot()
    results = _ok(results)
    by_class: dict[str, list[float]] = {}
    names: dict[str, str] = {}
    for r in results:
        for label, cls in ((r["metrics"].get("counterfactual") or {}).get("by_class") or {}).items():
            if cls.get("delta_acc1") is not None:
                by_class.setdefault(label, []).append(abs(cls["delta_acc1"]))
                names[label] = (cls.get("label_name") or label).split(",")[0]
    labels = sorted(by_class, key=lambda lab: -float(np.mean(by_class[lab])))[:max_classes]
    fig, ax = plt.subplots(figsize=(7, max(3, 0.35 * len(labels) * max(1, len(results)) ** 0.5 + 1.5)), dpi=100)
    height = 0.8 / max(1, len(results))
    y = np.arange(len(labels))
    for i, r in enumerate(results):
        classes = (r["metrics"].get("counterfactual") or {}).get("by_class") or {}
        values = [(classes.get(lab) or {}).get("delta_acc1") or 0.0 for lab in labels]
        ax.barh(y + i * height - 0.4 + height / 2, values, height, label=_label(r))
    ax.axvline(0, color="black", linewidth=0.8, linestyle="--")
    ax.set_yticks(y, [f"{names[lab]} ({lab})" for lab in labels], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("Δ acc@1 counterfactual − original (points)")
    ax.set_title("Per-class Δ acc@1")
    if results:
        ax.legend(fontsize=7, loc="best")
    return _save(fig, path)


def plot_acc_scatter(results: list[dict[str, Any]], path: Path) -> Path:
    """Scatter of acc@1 on original (x) against acc@1 on counterfactual (y), one point per model, y = x dashed."""
    plt = _pyplot()
    results = [r for r in _ok(results) if "original" in r["metrics"] and "counterfactual" in r["metrics"]]
    fig, ax = plt.subplots(figsize=(5, 5), dpi=100)
    xs = [r["metrics"]["original"]["acc1"] for r in results]
    ys = [r["metrics"]["counterfactual"]["acc1"] for r in results]
    ax.scatter(xs, ys, s=25)
    for r, x, y in zip(results, xs, ys, strict=True):
        ax.annotate(_label(r), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    lo = min([0.0, *xs, *ys])
    hi = max([100.0, *xs, *ys])
    ax.plot([lo, hi], [lo, hi], "k--", linewidth=0.8)
    ax.set_xlabel("acc@1 original (%)")
    ax.set_ylabel("acc@1 counterfactual (%)")
    ax.set_title("Original vs counterfactual accuracy")
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    plt = _pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    logger.debug("wrote %s", path)
    return path
