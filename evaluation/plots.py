"""Pictures of evaluation results (matplotlib, Agg backend): for the leaderboard and each model's report.

Text from the data (model and class names) is drawn as plain text: ``text.parse_math`` is off, so a class called
``$\\frac{1}$`` is shown, not parsed as mathtext. Models are named by :func:`evaluation.results.model_label`, never by
their results folder.
"""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path
from typing import Any

from builder.release_format import EDIT_TYPES
from evaluation.results import is_complete, model_label
from evaluation.robustness import paired_accuracies, probit

logger = logging.getLogger(__name__)

MAX_LABEL_CHARS = 60


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _plain(text: Any) -> str:
    """A data string made safe for a plot label: one line, bounded length (mathtext is off globally in _figure)."""
    text = " ".join(str(text).split())
    return text if len(text) <= MAX_LABEL_CHARS else text[: MAX_LABEL_CHARS - 1] + "…"


def _figure(**kwargs: Any):
    plt = _pyplot()
    import matplotlib

    matplotlib.rcParams["text.parse_math"] = False  # data strings are never mathtext ($ is a character)
    matplotlib.rcParams["text.usetex"] = False
    return plt.subplots(**kwargs)


def _ok(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in results if r.get("status") == "ok"]


def _label(result: dict[str, Any]) -> str:
    return _plain(model_label(result))


def plot_edit_type_sensitivity(results: list[dict[str, Any]], path: Path) -> Path:
    """Grouped bars: mean Delta p(y_GT) (points) per edit type, one bar per model."""
    import numpy as np

    results = [r for r in _ok(results) if (r.get("sensitivity") or {}).get("by_edit_type")]
    present = sorted({t for r in results for t in r["sensitivity"]["by_edit_type"]}, key=_edit_type_order(EDIT_TYPES))
    fig, ax = _figure(figsize=(max(6, 1.2 * len(present) + 2), 4), dpi=100)
    width = 0.8 / max(1, len(results))
    x = np.arange(len(present))
    for i, r in enumerate(results):
        values = [(r["sensitivity"]["by_edit_type"].get(t) or {}).get("delta_p_gt_mean") or 0.0 for t in present]
        ax.bar(x + i * width - 0.4 + width / 2, values, width, label=_label(r))
    ax.axhline(0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(x, [_plain(t) for t in present])
    ax.set_ylabel("mean Δ p(y_GT) (points, + = hurt)")
    ax.set_title("Sensitivity by edit type (paired)")
    if results:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes, never over the bars
    return _save(fig, path)


def _edit_type_order(edit_types: tuple[str, ...]):
    order = {t: i for i, t in enumerate(edit_types)}
    return lambda t: (order.get(t, len(order)), t)


MIN_CLASS_PAIRS = 5
"""A class needs at least this many counterfactual/original pairs (for every model shown) before the per-class plot
ranks it by its Delta: with one or two pairs a class's Delta is 0 or +-50..100 points by chance."""


def class_plot_order(results: list[dict[str, Any]], max_classes: int = 30, min_pairs: int = MIN_CLASS_PAIRS):
    """The classes the per-class plot shows, in order: classes with at least ``min_pairs`` pairs first, by mean
    absolute paired Delta acc@1 over the models (largest first), then the classes with fewer pairs (same order);
    ties by label. Returns ``[(label, name, min pairs over models)]``, at most ``max_classes``."""
    deltas: dict[str, list[float]] = {}
    pairs: dict[str, int] = {}
    names: dict[str, str] = {}
    for r in _ok(results):
        for label, cls in ((r.get("sensitivity") or {}).get("by_class") or {}).items():
            if cls.get("paired_delta_acc1") is None:
                continue
            deltas.setdefault(label, []).append(abs(cls["paired_delta_acc1"]))
            pairs[label] = min(pairs.get(label, cls.get("n") or 0), cls.get("n") or 0)
            names[label] = (cls.get("label_name") or label).split(",")[0]
    order = sorted(deltas, key=lambda lab: (pairs[lab] < min_pairs, -sum(deltas[lab]) / len(deltas[lab]), lab))
    return [(lab, names[lab], pairs[lab]) for lab in order[:max_classes]]


def plot_class_delta_acc(
    results: list[dict[str, Any]], path: Path, max_classes: int = 30, min_pairs: int = MIN_CLASS_PAIRS
) -> Path:
    """Per class, paired Delta acc@1 (counterfactual against its own original, points): a marker per model on a bar.

    Classes are ordered by :func:`class_plot_order`; a class with fewer than ``min_pairs`` pairs is labelled with its
    count. Markers are drawn as well as bars, so a class whose Delta is 0 for every model is still visible (a
    zero-length bar alone would leave the plot blank).
    """
    import numpy as np

    results = _ok(results)
    shown = class_plot_order(results, max_classes, min_pairs)
    labels = [lab for lab, _, _ in shown]
    fig, ax = _figure(figsize=(9.5, max(3, 0.35 * len(labels) * max(1, len(results)) ** 0.5 + 1.5)), dpi=100)
    height = 0.8 / max(1, len(results))
    y = np.arange(len(labels))
    all_values = []
    for i, r in enumerate(results):
        classes = (r.get("sensitivity") or {}).get("by_class") or {}
        values = [(classes.get(lab) or {}).get("paired_delta_acc1") or 0.0 for lab in labels]
        all_values += values
        offsets = y + i * height - 0.4 + height / 2
        bars = ax.barh(offsets, values, height, label=_label(r))
        ax.plot(values, offsets, "o", color=bars.patches[0].get_facecolor() if bars.patches else None, markersize=4)
    ax.axvline(0, color="black", linewidth=0.8, linestyle="--")
    ticks = [_plain(name) + f" ({lab})" + (f" n={n}" if n < min_pairs else "") for lab, name, n in shown]
    ax.set_yticks(y, ticks, fontsize=7)
    ax.invert_yaxis()
    if all_values and all(v == 0 for v in all_values):
        ax.set_xlim(-1, 1)
        ax.set_title("Per-class paired Δ acc@1: 0 for every class (no edit changed a top-1 prediction)", fontsize=9)
    else:
        ax.set_title(f"Per-class paired Δ acc@1 (classes with < {min_pairs} pairs last, with n)", fontsize=9)
    if not labels:
        ax.text(0.5, 0.5, "no paired counterfactuals", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("paired Δ acc@1, counterfactual − its original (points)")
    if results:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes, never over the bars
    return _save(fig, path)


def plot_acc_scatter(results: list[dict[str, Any]], path: Path) -> Path:
    """Scatter of paired acc@1 on originals (x) against their counterfactuals (y), one point per model, y = x dashed."""
    points = [(r, paired_accuracies(r)) for r in _ok(results)]
    points = [(r, acc) for r, acc in points if acc is not None]
    fig, ax = _figure(figsize=(5, 5), dpi=100)
    xs = [acc[0] for _, acc in points]
    ys = [acc[1] for _, acc in points]
    ax.scatter(xs, ys, s=25)
    for (r, _), x, y in zip(points, xs, ys, strict=True):
        ax.annotate(_label(r), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    lo = min([0.0, *xs, *ys])
    hi = max([100.0, *xs, *ys])
    ax.plot([lo, hi], [lo, hi], "k--", linewidth=0.8)
    ax.set_xlabel("acc@1 on the originals (%, paired)")
    ax.set_ylabel("acc@1 on their counterfactuals (%)")
    ax.set_title("Original vs counterfactual accuracy")
    return _save(fig, path)


def plot_effective_robustness(results: list[dict[str, Any]], fit: dict[str, Any], path: Path) -> Path:
    """Probit-scaled scatter of counterfactual against original accuracy, the linear fit and y = x (Taori et al.)."""
    import numpy as np
    from scipy.stats import norm

    points = [(r, paired_accuracies(r)) for r in _ok(results) if is_complete(r)]
    points = [(r, acc) for r, acc in points if acc is not None]
    fig, ax = _figure(figsize=(5.5, 5), dpi=100)
    if points:
        x = probit([a[0] for _, a in points], [a[2] for _, a in points])
        y = probit([a[1] for _, a in points], [a[2] for _, a in points])
        ax.scatter(x, y, s=25)
        for (r, _), xi, yi in zip(points, x, y, strict=True):
            ax.annotate(_label(r), (xi, yi), fontsize=7, xytext=(3, 3), textcoords="offset points")
        lo, hi = float(min(x.min(), y.min())) - 0.3, float(max(x.max(), y.max())) + 0.3
        grid = np.linspace(lo, hi, 50)
        ax.plot(grid, grid, "k--", linewidth=0.8, label="y = x")
        if fit.get("slope") is not None:
            ax.plot(grid, fit["slope"] * grid + fit["intercept"], "r-", linewidth=1, label="linear fit (probit)")
        ticks = [t for t in (1, 5, 10, 25, 50, 75, 90, 95, 99) if lo <= norm.ppf(t / 100) <= hi]
        ax.set_xticks([norm.ppf(t / 100) for t in ticks], [str(t) for t in ticks])
        ax.set_yticks([norm.ppf(t / 100) for t in ticks], [str(t) for t in ticks])
        ax.legend(fontsize=7, loc="best")
    else:
        ax.text(0.5, 0.5, "no complete results", ha="center", va="center", transform=ax.transAxes)
    note = "" if fit.get("slope") is not None else f" ({fit.get('reason')})"
    ax.set_title(_plain("Effective robustness" + note) if len(note) < 40 else "Effective robustness (no fit)")
    ax.set_xlabel("acc@1 on the originals (%, probit scale)")
    ax.set_ylabel("acc@1 on the counterfactuals (%, probit scale)")
    return _save(fig, path)


def plot_shift_correlation(correlations: dict[str, Any], path: Path) -> Path:
    """One panel per real shift: paired Delta acc@1 here (x) against the published top-1 drop on the shift (y)."""
    shifts = list(correlations["by_shift"].items())
    fig, axes = _figure(nrows=1, ncols=max(1, len(shifts)), figsize=(3.2 * max(1, len(shifts)), 3.4), dpi=100)
    axes = list(axes) if hasattr(axes, "__len__") else [axes]
    models = correlations["models"]
    for ax, (shift, entry) in zip(axes, shifts, strict=False):
        xs = [m["delta_here"] for m in models]
        ys = [m["drops"][shift] for m in models]
        ax.scatter(xs, ys, s=16)
        rho = entry["spearman"]
        ax.set_title(f"{entry['name']}: ρ = {rho:.2f}" if rho is not None else f"{entry['name']}: ρ n/a", fontsize=9)
        ax.set_xlabel("paired Δ acc@1 here", fontsize=8)
        ax.set_ylabel("shift top-1 − ImageNet top-1 (timm)", fontsize=8)
    if not models:
        axes[0].text(
            0.5, 0.5, "no models with published figures", ha="center", va="center", transform=axes[0].transAxes
        )
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


# -- edit strength (evaluation.strength) -------------------------------------------------------------------------------
PANEL_WIDTH_IN = 3.6


def _fit_legend(fig: Any, panels: int, height: float) -> None:
    """Widen a constrained-layout figure so that its outside legend and every label fit beside ``panels`` panels of
    ``PANEL_WIDTH_IN`` inches: the width grows with the longest legend entry, so no label is cut off."""
    fig.set_size_inches(panels * PANEL_WIDTH_IN + 1.0, height)
    # The layout alone places the legend (no pixels drawn); saving the figure draws it at its final size.
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    legend_width = max((legend.get_window_extent(renderer).width / fig.dpi for legend in fig.legends), default=0.0)
    fig.set_size_inches(panels * PANEL_WIDTH_IN + legend_width + 1.0, height)


def _curve_xy(group: dict[str, Any], key: str) -> tuple[list[float], list[float]]:
    points = [p for p in group.get("curve") or [] if p.get(key) is not None]
    return [p["strength"] for p in points], [p[key] for p in points]


def _band(ax: Any, group: dict[str, Any], key: str, colour: Any, scale: float = 1.0) -> None:
    points = [p for p in group.get("curve") or [] if p.get(f"{key}_ci")]
    if len(points) > 1:
        ax.fill_between(
            [p["strength"] for p in points],
            [p[f"{key}_ci"][0] * scale for p in points],
            [p[f"{key}_ci"][1] * scale for p in points],
            color=colour,
            alpha=0.15,
            linewidth=0,
        )


def strength_model_figure(result: dict[str, Any]):
    """One model: acc@1 and Delta p(y_GT) against edit strength (overall with its 95% band, and per edit type), and
    where images first fail (share of the images whose original is right, per strength, and never).

    The solid curves are the headline (the edits seen at every strength: the same images at each); the dotted grey
    one pools every sample kept at each strength, a second view that mixes images (``evaluation.strength``)."""
    section = result["strength"]
    fig, axes = _figure(ncols=3, figsize=(3 * PANEL_WIDTH_IN + 1.0, 3.6), dpi=100, layout="constrained")
    overall = section["overall"]
    types = sorted(section.get("by_edit_type") or {}, key=_edit_type_order(EDIT_TYPES))
    groups = [("all edits", overall, 2.2)] + [(_plain(t), section["by_edit_type"][t], 1.0) for t in types]
    for name, group, width in groups:
        x, y = _curve_xy(group, "acc1")
        (line,) = axes[0].plot(x, y, marker="o", markersize=3, linewidth=width, label=name)
        x, y = _curve_xy(group, "delta_p_gt_mean")
        axes[1].plot(x, y, marker="o", markersize=3, linewidth=width, color=line.get_color())
        if group is overall:
            _band(axes[0], group, "acc1", line.get_color())
            _band(axes[1], group, "delta_p_gt_mean", line.get_color())
    pooled = overall.get("pooled")
    if pooled:  # results of metric version 2 on: the pooled view beside the headline
        x, y = _curve_xy(pooled, "acc1")
        axes[0].plot(x, y, ":", color="grey", marker=".", linewidth=1.2, label="all edits, pooled (mixes images)")
        x, y = _curve_xy(pooled, "delta_p_gt_mean")
        axes[1].plot(x, y, ":", color="grey", marker=".", linewidth=1.2)
    x, y = _curve_xy(overall, "orig_acc1")
    axes[0].plot(x, y, "k--", linewidth=0.8, label="their originals")
    axes[0].set_ylim(-2, 102)
    axes[0].set_ylabel("acc@1 (%)")
    axes[0].set_title(f"acc@1 (area {fmt_auc(overall.get('auc_acc1'))})", fontsize=9)
    axes[1].axhline(0, color="black", linewidth=0.8, linestyle="--")
    axes[1].set_ylabel("mean Δ p(y_GT) (points, + = hurt)")
    axes[1].set_title("true-class confidence drop", fontsize=9)
    failure = overall["failure"]
    levels = [b["strength"] for b in failure["by_strength"]]
    if failure["n_images"]:
        shares = [b["n"] / failure["n_images"] * 100.0 for b in failure["by_strength"]]
        labels = [f"{s:g}" for s in levels] + ["never"]
        axes[2].bar(range(len(labels)), shares + [failure["never_share"]], color="tab:red", alpha=0.7)
        axes[2].set_xticks(range(len(labels)), labels, fontsize=7)
    else:
        axes[2].text(0.5, 0.5, "no original is top-1 correct", ha="center", va="center", transform=axes[2].transAxes)
    axes[2].set_ylabel("% of images (original correct)")
    axes[2].set_title(f"first failure (n = {failure['n_images']} images)", fontsize=9)
    for ax in axes[:2]:
        ax.set_xlabel("edit strength (1 − self_replace)")
    axes[2].set_xlabel("edit strength of the first wrong top-1")
    fig.suptitle(_plain(f"{_label(result)}: accuracy against edit strength"), fontsize=10)
    note = flat_note([result])
    if note:
        fig.supxlabel(textwrap.fill(note, 110), fontsize=8, color="tab:red")
    fig.legend(loc="outside right upper", fontsize=7)
    _fit_legend(fig, 3, 3.6)
    return fig


FLAT_POINTS = 1.0  # a curve whose acc@1 and mean Δ p(y_GT) each vary by at most this many points is flat


def is_flat(overall: dict[str, Any]) -> bool:
    """Whether a strength curve is flat: acc@1 and the confidence drop barely move with strength."""
    for key in ("acc1", "delta_p_gt_mean"):
        _, values = _curve_xy(overall, key)
        if len(values) > 1 and max(values) - min(values) > FLAT_POINTS:
            return False
    return True


def flat_note(results: list[dict[str, Any]]) -> str | None:
    """The line under a strength plot whose every curve is flat, saying why when the release says it (its models were
    the demo's random-weight stand-ins, so its images barely change with strength): a flat curve is not a finding."""
    sections = [r["strength"]["overall"] for r in results if r.get("strength")]
    if not sections or not all(is_flat(s) for s in sections):
        return None
    if any((r.get("release") or {}).get("demo_models") for r in results):
        return (
            "Flat, as expected: this release was built with the demo's random-weight models, so its images barely "
            "change with edit strength. A real release's curves fall."
        )
    return f"Flat: acc@1 and the confidence drop vary by at most {FLAT_POINTS:g} point with edit strength."


def fmt_auc(value: Any) -> str:
    return "—" if value is None else f"{value:.1f}"


def strength_models_figure(results: list[dict[str, Any]]):
    """Every model: overall acc@1 and Delta p(y_GT) against edit strength, with 95% bands; the legend names each
    model with its area under the acc@1 curve. Solid: the headline (the edits seen at every strength); dotted, in the
    model's colour: every sample pooled per strength (a second view that mixes images)."""
    results = [r for r in _ok(results) if r.get("strength")]
    fig, axes = _figure(ncols=2, figsize=(2 * PANEL_WIDTH_IN + 1.0, 3.6), dpi=100, layout="constrained")
    for r in results:
        overall = r["strength"]["overall"]
        x, y = _curve_xy(overall, "acc1")
        (line,) = axes[0].plot(
            x, y, marker="o", markersize=3, label=f"{_label(r)} (area {fmt_auc(overall.get('auc_acc1'))})"
        )
        _band(axes[0], overall, "acc1", line.get_color())
        x, y = _curve_xy(overall, "delta_p_gt_mean")
        axes[1].plot(x, y, marker="o", markersize=3, color=line.get_color())
        _band(axes[1], overall, "delta_p_gt_mean", line.get_color())
        for ax, key in zip(axes, ("acc1", "delta_p_gt_mean"), strict=True):
            x, y = _curve_xy(overall.get("pooled") or {}, key)
            ax.plot(x, y, ":", linewidth=1.0, color=line.get_color())
    if not results:
        axes[0].text(
            0.5, 0.5, "no results with a strength config", ha="center", va="center", transform=axes[0].transAxes
        )
    axes[0].set_ylim(-2, 102)
    axes[0].set_ylabel("acc@1 (%)")
    axes[0].set_title("acc@1 (dotted: all samples pooled)", fontsize=9)
    axes[1].axhline(0, color="black", linewidth=0.8, linestyle="--")
    axes[1].set_ylabel("mean Δ p(y_GT) (points, + = hurt)")
    axes[1].set_title("true-class confidence drop", fontsize=9)
    for ax in axes:
        ax.set_xlabel("edit strength (1 − self_replace)")
    note = flat_note(results)
    if note:
        fig.supxlabel(textwrap.fill(note, 110), fontsize=8, color="tab:red")
    if results:
        fig.legend(loc="outside right upper", fontsize=7)
    _fit_legend(fig, 2, 3.6)
    return fig


def plot_strength_model(result: dict[str, Any], path: Path) -> Path:
    """Save :func:`strength_model_figure` as a PNG (at the figure's own size: nothing cropped or added)."""
    return _save_as_is(strength_model_figure(result), path)


def plot_strength_models(results: list[dict[str, Any]], path: Path) -> Path:
    """Save :func:`strength_models_figure` as a PNG (at the figure's own size)."""
    return _save_as_is(strength_models_figure(results), path)


def _save_as_is(fig: Any, path: Path) -> Path:
    plt = _pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)
    logger.debug("wrote %s", path)
    return path
