"""The dataset-interfaces metric (Vendrow et al., arXiv 2302.07865): per-shift mean per-class accuracy and its drop.

For a shift, only classes with at least ``min_per_class`` kept images (5 in the paper) count; the shift's accuracy is
the mean over those classes of the per-class accuracy, and the drop compares it with the mean base accuracy over the
SAME classes (so a class that the filter emptied in the shift does not move the base side). The interval is a
percentile bootstrap over classes (classes drawn with replacement, ``numpy.random.default_rng(seed)``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

MIN_PER_CLASS = 5


def per_class_accuracy(labels: Any, correct: Any) -> dict[int, tuple[int, int]]:
    """label -> (correct, n)."""
    out: dict[int, list[int]] = {}
    for label, ok in zip(np.asarray(labels).tolist(), np.asarray(correct).tolist(), strict=True):
        entry = out.setdefault(int(label), [0, 0])
        entry[0] += int(bool(ok))
        entry[1] += 1
    return {k: (v[0], v[1]) for k, v in sorted(out.items())}


def shift_accuracy_drop(
    shift: dict[int, tuple[int, int]],
    base: dict[int, tuple[int, int]],
    *,
    min_per_class: int = MIN_PER_CLASS,
    n_boot: int = 1000,
    seed: int = 0,
) -> dict[str, Any]:
    """Mean per-class accuracy (%) of a shift and of base over the shift's eligible classes, and the drop."""
    eligible = [c for c, (_, n) in shift.items() if n >= min_per_class and base.get(c, (0, 0))[1] > 0]
    result: dict[str, Any] = {
        "min_per_class": min_per_class,
        "classes": len(eligible),
        "classes_excluded": sorted(c for c in shift if c not in eligible),
    }
    if not eligible:
        return {**result, "accuracy": None, "base_accuracy": None, "drop": None, "drop_ci": None}
    shift_acc = np.array([shift[c][0] / shift[c][1] for c in eligible]) * 100.0
    base_acc = np.array([base[c][0] / base[c][1] for c in eligible]) * 100.0
    drops = base_acc - shift_acc
    draws = np.random.default_rng(seed).integers(0, len(eligible), size=(n_boot, len(eligible)))
    replicates = drops[draws].mean(axis=1)
    low, high = np.percentile(replicates, [2.5, 97.5]) if n_boot else (np.nan, np.nan)
    return {
        **result,
        "accuracy": float(shift_acc.mean()),
        "base_accuracy": float(base_acc.mean()),
        "drop": float(drops.mean()),
        "drop_ci": None if not n_boot else [float(low), float(high)],
    }
