"""The statistics of failure discovery: exact rate tests, Clopper-Pearson intervals and Benjamini-Hochberg.

Every rate here is a count of events of one kind among ``n`` generated images of one class: "the model predicted a
wrong label" (the total failure rate) or "the model predicted label ŷ" (the rate of one (true label, predicted label)
pair, the quantity Wiles et al. reason about in their Figures 3 and 5). A description raises a rate when the images
made from it show the event more often than the class's base images; both rates are estimates, so the test is
Fisher's exact test on the 2x2 table, one-sided.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FISHER_TEST = "fisher_exact_one_sided_greater"
FISHER_LOWER_TEST = "fisher_exact_one_sided_less"


@dataclass(frozen=True)
class EventCounts:
    """How often one kind of event happened among ``n`` images."""

    count: int
    n: int

    @property
    def rate(self) -> float:
        return self.count / self.n if self.n else float("nan")


def clopper_pearson(count: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Exact binomial interval of a rate (scipy's ``binomtest(...).proportion_ci(method="exact")``)."""
    from scipy.stats import binomtest

    if n == 0:
        return (0.0, 1.0)
    ci = binomtest(count, n).proportion_ci(confidence_level=confidence, method="exact")
    return (float(ci.low), float(ci.high))


def rate_increase_test(described: EventCounts, base: EventCounts) -> dict[str, Any]:
    """One-sided Fisher exact test: is the event more frequent under the description than at base?

    Fisher (not a binomial test against a fixed rate) because the base rate is itself estimated from ``base.n``
    images. Returns the counts, both rates, the description's Clopper-Pearson interval and the raw p-value.
    """
    from scipy.stats import fisher_exact

    table = [[described.count, described.n - described.count], [base.count, base.n - base.count]]
    _, p_value = fisher_exact(table, alternative="greater")
    return {
        "count": described.count,
        "n": described.n,
        "rate": described.rate,
        "interval": clopper_pearson(described.count, described.n),
        "base_count": base.count,
        "base_n": base.n,
        "base_rate": base.rate,
        "p_value": float(p_value),
        "test": FISHER_TEST,
    }


def rate_decrease_test(variant: EventCounts, full: EventCounts) -> dict[str, Any]:
    """One-sided Fisher exact test: is the event *less* frequent under a shorter description than under the full one?

    Refinement's second question (after "is the variant's rate above base?"): a word may be dropped only when the
    rate does not fall significantly without it. Both rates are estimates from their own images, hence Fisher's
    test on the 2x2 table of (variant, full) x (event, no event). Returns the counts, both rates and the raw p-value.
    """
    from scipy.stats import fisher_exact

    table = [[variant.count, variant.n - variant.count], [full.count, full.n - full.count]]
    _, p_value = fisher_exact(table, alternative="less")
    return {
        "count": variant.count,
        "n": variant.n,
        "rate": variant.rate,
        "full_count": full.count,
        "full_n": full.n,
        "full_rate": full.rate,
        "p_value": float(p_value),
        "test": FISHER_LOWER_TEST,
    }


def benjamini_hochberg(p_values: list[float]) -> list[float]:
    """Benjamini-Hochberg adjusted p-values (q-values), in input order (scipy ``false_discovery_control``)."""
    from scipy.stats import false_discovery_control

    if not p_values:
        return []
    return [float(q) for q in false_discovery_control(p_values, method="bh")]


def bh_cutoff(p_values: list[float], q_values: list[float], alpha: float) -> float:
    """The largest raw p-value that Benjamini-Hochberg rejects at ``alpha`` (0 when it rejects nothing)."""
    return max((p for p, q in zip(p_values, q_values, strict=True) if q < alpha), default=0.0)
