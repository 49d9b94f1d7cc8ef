"""The label-kept judge against people: agreement on "Is it still a <class>?" and the judge's calibrated threshold.

The judge stage scores each edited or generated image with ``judge_class_p``, the vision-language model's P(yes) for
"Does this image show a {class}?" (VQAScore-style). A judge is worth exactly its measured agreement with people on the
release's own samples, so this module measures it from a review study that asked ``still_class``:

- the human label of an item is the strict majority of its raters' ``yes`` / ``no`` answers (``unsure`` is no label;
  a tie leaves the item unlabelled and it is counted, not guessed);
- judge-human agreement: Cohen's kappa between the judge's decision (``judge_class_p >= threshold``) and the human
  label, and the AUROC of ``judge_class_p`` for the human label (threshold-free), each with a percentile bootstrap
  interval over items;
- human-human agreement on the same release: Cohen's kappa over every pair of raters (in name order) who both answered
  ``yes`` or ``no`` for the same item, with a bootstrap interval that resamples items (a pair stays with its item);
- calibration: the threshold that maximises Cohen's kappa on the human labels, chosen on k-1 folds and applied to the
  held-out fold; the kappa reported is that of the pooled out-of-fold decisions (never the in-sample one), and the
  threshold recorded is the one chosen on every labelled item.

Every draw is seeded from location-independent keys (the study's seed and name, a statistic's name, a sample's config
and key), so the same release and judgements give the same figures anywhere. Kappa and AUROC are computed here with
numpy (Cohen 1960; AUROC as the Mann-Whitney statistic with ties counted half); the tests check them against
scikit-learn and a bootstrap written out by hand.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from builder import release_format as rf
from builder.review.index import ReleaseIndex

# the judge stage's P(yes) for "Does this image show a {class}?" (its P(yes) for the edit is not calibrated here)
JUDGE_CLASS_FIELD = rf.JUDGE_CLASS_FIELD
QUESTION = "still_class"  # the review question the judge's class score answers
UNCALIBRATED_THRESHOLD = 0.5  # the threshold of a release without a calibration: P(yes) > P(no), stated as such
DEFAULT_RESAMPLES = 1000
DEFAULT_FOLDS = 5
DEFAULT_BINS = 5  # a study stratified by judge score: equal-width bins of judge_class_p
CONFIDENCE = 0.95
HUMAN_ANSWERS = {"yes": 1, "no": 0}  # "unsure" and any other answer give no label


def seed_of(*parts: Any) -> int:
    """A 64-bit seed from location-independent keys (names, seeds, sample keys), the same on every machine."""
    digest = hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).digest()
    return int.from_bytes(digest[:8], "big")


def has_judge_scores(spec: Any, configs: list[str] | tuple[str, ...] | None = None) -> bool:
    """Whether a release declares the judge's class score on any of ``configs`` (every config when None)."""
    names = spec.names if configs is None else [c for c in configs if c in spec.names]
    return any(spec.config(c).field(JUDGE_CLASS_FIELD) is not None for c in names)


# -- statistics -------------------------------------------------------------------------------------------------------
def cohen_kappa(a: np.ndarray, b: np.ndarray) -> float | None:
    """Cohen's kappa of two 0/1 label arrays; None when undefined (both raters gave one and the same label)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.size == 0:
        return None
    observed = float(np.mean(a == b))
    pa, pb = float(a.mean()), float(b.mean())
    expected = pa * pb + (1 - pa) * (1 - pb)
    if expected >= 1.0:
        return None
    return (observed - expected) / (1 - expected)


def auroc(labels: np.ndarray, scores: np.ndarray) -> float | None:
    """The area under the ROC curve of ``scores`` for 0/1 ``labels``: the Mann-Whitney U statistic over the
    positive-negative pairs, a tie counting half; None without both labels."""
    labels, scores = np.asarray(labels), np.asarray(scores, dtype=float)
    positives, negatives = scores[labels == 1], scores[labels == 0]
    if positives.size == 0 or negatives.size == 0:
        return None
    order = np.sort(negatives)
    below = np.searchsorted(order, positives, side="left")
    ties = np.searchsorted(order, positives, side="right") - below
    return float((below.sum() + 0.5 * ties.sum()) / (positives.size * negatives.size))


def bootstrap_interval(statistic, n: int, resamples: int, seed: int) -> dict[str, Any]:
    """A percentile bootstrap interval (``CONFIDENCE``) of ``statistic(indices)`` over ``n`` items: ``resamples`` draws
    of n indices with replacement from ``numpy.random.default_rng(seed)``; draws where the statistic is undefined are
    left out and counted."""
    rng = np.random.default_rng(seed)
    values = []
    undefined = 0
    for _ in range(resamples):
        value = statistic(rng.integers(0, n, size=n))
        if value is None:
            undefined += 1
        else:
            values.append(value)
    tail = (1 - CONFIDENCE) / 2 * 100
    interval = [float(v) for v in np.percentile(values, [tail, 100 - tail])] if values else None
    return {"interval": interval, "resamples": resamples, "undefined_resamples": undefined}


def wilson_interval(kept: int, total: int) -> list[float] | None:
    """The Wilson score interval (``CONFIDENCE``) of a proportion ``kept / total``; None for no samples."""
    if total == 0:
        return None
    z = _normal_quantile(0.5 + CONFIDENCE / 2)
    p = kept / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return [max(0.0, centre - half), min(1.0, centre + half)]


def _normal_quantile(q: float) -> float:
    from statistics import NormalDist

    return NormalDist().inv_cdf(q)


def _round(value: float | None) -> float | None:
    return None if value is None else round(float(value), 6)


def _rounded(interval: list[float] | None) -> list[float] | None:
    return None if interval is None else [round(v, 6) for v in interval]


# -- the labelled items -----------------------------------------------------------------------------------------------
@dataclass
class LabelledItems:
    """The study's items that both the judge and people labelled, in (config, key) order.

    Attributes:
        items: (config, key) of each labelled item.
        human: the human label of each (1: still the class), the strict majority of its raters' yes / no.
        judge: its ``judge_class_p``.
        pairs: (item position, label of the first rater, label of the second) for every pair of raters, in name
            order, who both answered yes / no for the same item (of every reviewed item, judged or not).
        pair_items: how many items have at least one such pair.
        pair_labels: per item with a pair (by its position there), its raters' labels (in name order) and its judge
            score (None where the judge did not score it): the judge against each single rater, like for like.
        raters: how many raters answered the question.
        left_out: items of the study left out, by reason.
    """

    items: list[tuple[str, str]]
    human: np.ndarray
    judge: np.ndarray
    pairs: list[tuple[int, int, int]]
    pair_items: int
    raters: int
    left_out: dict[str, int] = field(default_factory=dict)
    pair_labels: list[tuple[list[int], float | None]] = field(default_factory=list)


def labelled_items(index: ReleaseIndex, latest: dict, items: list[tuple[str, str]]) -> LabelledItems:
    """The human and judge labels of the study's ``items`` (``latest``: ``JudgementStore.latest`` of the study)."""
    answers: dict[tuple[str, str], dict[str, int]] = {}
    raters: set[str] = set()
    wanted = set(items)
    for (reviewer, config, key, question), judgement in latest.items():
        if question != QUESTION or (config, key) not in wanted:
            continue
        raters.add(reviewer)
        if judgement.answer in HUMAN_ANSWERS:
            answers.setdefault((config, key), {})[reviewer] = HUMAN_ANSWERS[judgement.answer]
    kept: list[tuple[str, str]] = []
    human: list[int] = []
    judge: list[float] = []
    pair_rows: list[tuple[tuple[str, str], int, int]] = []
    left_out = {"no human answer (none, or unsure)": 0, "raters tied": 0, "no judge score": 0}
    for item in sorted(items):
        by = answers.get(item, {})
        names = sorted(by)
        pair_rows += [(item, by[a], by[b]) for i, a in enumerate(names) for b in names[i + 1 :]]
        if not by:
            left_out["no human answer (none, or unsure)"] += 1
            continue
        yes = sum(by.values())
        if yes * 2 == len(by):
            left_out["raters tied"] += 1
            continue
        score = index.get(*item).meta.get(JUDGE_CLASS_FIELD)
        if score is None:
            left_out["no judge score"] += 1
            continue
        kept.append(item)
        human.append(int(yes * 2 > len(by)))
        judge.append(float(score))
    # the pairs are indexed by the items that have one (the bootstrap of human-human kappa resamples those items)
    paired = sorted({item for item, _, _ in pair_rows})
    position = {item: i for i, item in enumerate(paired)}
    pairs = [(position[item], a, b) for item, a, b in pair_rows]
    pair_labels = []
    for item in paired:
        score = index.get(*item).meta.get(JUDGE_CLASS_FIELD)
        pair_labels.append(([answers[item][r] for r in sorted(answers[item])], None if score is None else float(score)))
    return LabelledItems(
        kept, np.array(human, dtype=int), np.array(judge, dtype=float), pairs, len(paired), len(raters),
        {k: v for k, v in left_out.items() if v}, pair_labels,
    )  # fmt: skip


# -- agreement --------------------------------------------------------------------------------------------------------
def _pairs_by_item(labelled: LabelledItems) -> list[list[tuple[int, int]]]:
    by_item: list[list[tuple[int, int]]] = [[] for _ in range(labelled.pair_items)]
    for i, a, b in labelled.pairs:
        by_item[i].append((a, b))
    return by_item


def human_human(labelled: LabelledItems, resamples: int, seed: int) -> dict[str, Any]:
    """Cohen's kappa over the rater pairs of the same items, with a bootstrap interval resampling items."""
    by_item = _pairs_by_item(labelled)

    def kappa(indices) -> float | None:
        rows = [pair for i in indices for pair in by_item[i]]
        if not rows:
            return None
        a, b = np.array(rows).T
        return cohen_kappa(a, b)

    entry: dict[str, Any] = {"items": labelled.pair_items, "pairs": len(labelled.pairs), "raters": labelled.raters}
    if not labelled.pairs:
        return entry | {"kappa": None, "kappa_ci": None, "note": "needs two raters of the same items"}
    boot = bootstrap_interval(kappa, labelled.pair_items, resamples, seed)
    return entry | {
        "kappa": _round(kappa(range(labelled.pair_items))),
        "kappa_ci": _rounded(boot["interval"]),
        "resamples": resamples,
        "undefined_resamples": boot["undefined_resamples"],
    }


def judge_rater(labelled: LabelledItems, threshold: float, resamples: int, seed: int) -> dict[str, Any]:
    """Cohen's kappa of the judge's decision against each single rater's label, on the items of the human-human kappa
    that the judge scored (each rater's label one observation): like for like with the human-human kappa, one rater
    against another, where ``judge_human`` compares the judge with the raters' majority, a less noisy label. The
    interval resamples items (an item's labels stay together)."""
    rows = [
        [(int(score >= threshold), label) for label in labels]
        for labels, score in labelled.pair_labels
        if score is not None
    ]

    def kappa(indices) -> float | None:
        flat = [row for i in indices for row in rows[i]]
        if not flat:
            return None
        a, b = np.array(flat).T
        return cohen_kappa(a, b)

    entry: dict[str, Any] = {"items": len(rows), "labels": sum(len(r) for r in rows), "threshold": threshold}
    if not rows:
        return entry | {"kappa": None, "kappa_ci": None, "note": "needs items rated by two raters and judged"}
    boot = bootstrap_interval(kappa, len(rows), resamples, seed)
    return entry | {
        "kappa": _round(kappa(range(len(rows)))),
        "kappa_ci": _rounded(boot["interval"]),
        "resamples": resamples,
        "undefined_resamples": boot["undefined_resamples"],
    }


def judge_human(labelled: LabelledItems, threshold: float, resamples: int, seed: int) -> dict[str, Any]:
    """Cohen's kappa of the judge's decision at ``threshold`` against the human label, and the AUROC of its score,
    each with a bootstrap interval (items resampled; the two statistics draw with seeds of their own)."""
    human, judge = labelled.human, labelled.judge
    decision = (judge >= threshold).astype(int)
    n = len(labelled.items)
    entry: dict[str, Any] = {"items": n, "threshold": threshold, "still_class": int(human.sum())}
    if n == 0:
        return entry | {"kappa": None, "kappa_ci": None, "auroc": None, "auroc_ci": None, "note": "no labelled item"}
    kappa_boot = bootstrap_interval(lambda i: cohen_kappa(decision[i], human[i]), n, resamples, seed_of(seed, "kappa"))
    auroc_boot = bootstrap_interval(lambda i: auroc(human[i], judge[i]), n, resamples, seed_of(seed, "auroc"))
    return entry | {
        "kappa": _round(cohen_kappa(decision, human)),
        "kappa_ci": _rounded(kappa_boot["interval"]),
        "auroc": _round(auroc(human, judge)),
        "auroc_ci": _rounded(auroc_boot["interval"]),
        "resamples": resamples,
        "undefined_resamples": {"kappa": kappa_boot["undefined_resamples"], "auroc": auroc_boot["undefined_resamples"]},
    }


def judge_agreement(
    labelled: LabelledItems, threshold: float, *, calibrated: bool, resamples: int, seed: int
) -> dict[str, Any]:
    """What ``lance-cf review agreement`` reports for the judge: judge-human beside human-human, on one study."""
    return {
        "question": QUESTION,
        "field": JUDGE_CLASS_FIELD,
        "threshold": threshold,
        "threshold_calibrated": calibrated,
        "judge_human": judge_human(labelled, threshold, resamples, seed_of(seed, "judge_human")),
        "human_human": human_human(labelled, resamples, seed_of(seed, "human_human")),
        "judge_rater": judge_rater(labelled, threshold, resamples, seed_of(seed, "judge_rater")),
        "left_out": labelled.left_out,
        "confidence": CONFIDENCE,
    }


# -- calibration ------------------------------------------------------------------------------------------------------
def best_threshold(judge: np.ndarray, human: np.ndarray) -> float:
    """The threshold (one of the judge's scores; kept iff ``score >= threshold``) that maximises Cohen's kappa against
    ``human``; the lowest such score on a tie. Raises when no threshold gives a defined kappa."""
    best: tuple[float, float] | None = None
    for threshold in np.unique(judge):
        kappa = cohen_kappa((judge >= threshold).astype(int), human)
        if kappa is not None and (best is None or kappa > best[0]):
            best = (kappa, float(threshold))
    if best is None:
        raise ValueError("no threshold gives a defined kappa: the human labels need both answers")
    return best[1]


def fold_of(labelled: LabelledItems, folds: int, seed: int) -> np.ndarray:
    """Each item's fold: stratified by human label, items ordered within a label by a hash of (seed, config, key) and
    dealt round-robin, so a fold never depends on where the release lies or in which order it was read."""
    assignment = np.zeros(len(labelled.items), dtype=int)
    for label in (0, 1):
        members = [i for i in range(len(labelled.items)) if labelled.human[i] == label]
        members.sort(key=lambda i: seed_of(seed, "fold", *labelled.items[i]))
        for rank, i in enumerate(members):
            assignment[i] = rank % folds
    return assignment


def calibrate_threshold(labelled: LabelledItems, folds: int, resamples: int, seed: int) -> dict[str, Any]:
    """The judge's threshold chosen on the human labels, with its cross-validated agreement.

    Step 1: deal the labelled items into ``folds`` stratified folds (``fold_of``). Step 2: per fold, choose the
    threshold on the other folds (``best_threshold``) and decide the held-out items with it. Step 3: Cohen's kappa of the
    pooled out-of-fold decisions against the human labels, with a bootstrap interval over items (the thresholds are not
    re-chosen per resample). Step 4: the threshold recorded is chosen on every labelled item.
    """
    if folds < 2:
        raise ValueError(f"--folds {folds}: cross-validation needs at least 2 folds")
    human, judge = labelled.human, labelled.judge
    smallest = min(int(human.sum()), int(len(human) - human.sum()))
    if smallest < folds:
        raise ValueError(
            f"the study has {int(human.sum())} item(s) labelled still the class and {int(len(human) - human.sum())} "
            f"not (after ties and unsure answers); {folds}-fold calibration needs at least {folds} of each: review more "
            "samples (a study stratified by judge score finds both) or give fewer --folds"
        )
    assignment = fold_of(labelled, folds, seed)
    decision = np.zeros(len(human), dtype=int)
    fold_thresholds = []
    for k in range(folds):
        train, test = assignment != k, assignment == k
        threshold = best_threshold(judge[train], human[train])
        fold_thresholds.append(round(threshold, 6))
        decision[test] = (judge[test] >= threshold).astype(int)
    boot = bootstrap_interval(
        lambda i: cohen_kappa(decision[i], human[i]), len(human), resamples, seed_of(seed, "cv_kappa")
    )
    auroc_boot = bootstrap_interval(lambda i: auroc(human[i], judge[i]), len(human), resamples, seed_of(seed, "auroc"))
    return {
        "threshold": round(best_threshold(judge, human), 6),
        "folds": folds,
        "fold_thresholds": fold_thresholds,
        "cv_kappa": _round(cohen_kappa(decision, human)),
        "cv_kappa_ci": _rounded(boot["interval"]),
        "auroc": _round(auroc(human, judge)),
        "auroc_ci": _rounded(auroc_boot["interval"]),
        "items": len(human),
        "still_class": int(human.sum()),
        "resamples": resamples,
        "undefined_resamples": {"cv_kappa": boot["undefined_resamples"], "auroc": auroc_boot["undefined_resamples"]},
    }


def kept_share(index: ReleaseIndex, configs: list[str], threshold: float) -> dict[str, Any]:
    """How many of ``configs``' scored samples the judge keeps at ``threshold`` (``judge_class_p >= threshold``), read
    from the release's own samples, with a Wilson interval; samples the judge did not score are counted apart."""
    scored = kept = unscored = 0
    by_config: dict[str, dict[str, int]] = {}
    for config in configs:
        counts = by_config.setdefault(config, {"scored": 0, "kept": 0, "unscored": 0})
        for key in index.keys(config):
            score = index.get(config, key).meta.get(JUDGE_CLASS_FIELD)
            if score is None:
                counts["unscored"] += 1
                continue
            counts["scored"] += 1
            counts["kept"] += int(float(score) >= threshold)
        scored, kept, unscored = scored + counts["scored"], kept + counts["kept"], unscored + counts["unscored"]
    return {
        "configs": configs,
        "scored": scored,
        "kept": kept,
        "unscored": unscored,
        "share": _round(kept / scored) if scored else None,
        "share_ci": _rounded(wilson_interval(kept, scored)),
        "interval": "wilson",
        "by_config": by_config,
    }
