"""The dataset-interfaces per-shift metric, recomputed by hand."""

from __future__ import annotations

import numpy as np
import pytest

from evaluation.interfaces.shift_metrics import per_class_accuracy, shift_accuracy_drop


def test_per_class_minimum_rule_and_same_classes_on_the_base_side():
    # class 0: 6 kept in the shift (eligible), class 1: 4 kept (excluded), class 2: 5 kept (eligible)
    shift = per_class_accuracy([0] * 6 + [1] * 4 + [2] * 5, [1, 1, 1, 0, 0, 0] + [0] * 4 + [1, 1, 1, 1, 1])
    base = per_class_accuracy([0] * 10 + [1] * 10 + [2] * 10, [1] * 9 + [0] + [1] * 10 + [1] * 5 + [0] * 5)
    out = shift_accuracy_drop(shift, base, n_boot=0)
    assert out["classes"] == 2 and out["classes_excluded"] == [1]
    # by hand: shift accuracies 50% and 100% -> 75; base over the SAME classes: 90% and 50% -> 70
    assert out["accuracy"] == pytest.approx(75.0)
    assert out["base_accuracy"] == pytest.approx(70.0)  # class 1's 100% base accuracy is not counted
    assert out["drop"] == pytest.approx(-5.0)


def test_bootstrap_interval_is_over_classes_and_seeded():
    rng = np.random.default_rng(3)
    shift = {c: (int(rng.integers(0, 11)), 10) for c in range(20)}
    base = {c: (int(rng.integers(5, 11)), 10) for c in range(20)}
    a = shift_accuracy_drop(shift, base, n_boot=500, seed=1)
    b = shift_accuracy_drop(shift, base, n_boot=500, seed=1)
    assert a == b and a["drop_ci"][0] <= a["drop"] <= a["drop_ci"][1]
    drops = np.array([(base[c][0] - shift[c][0]) * 10.0 for c in range(20)])
    draws = np.random.default_rng(1).integers(0, 20, size=(500, 20))
    assert a["drop_ci"] == pytest.approx(list(np.percentile(drops[draws].mean(1), [2.5, 97.5])))


def test_no_eligible_class_gives_none_not_zero():
    out = shift_accuracy_drop({0: (1, 2)}, {0: (2, 2)})
    assert out["accuracy"] is None and out["drop"] is None and out["classes"] == 0
