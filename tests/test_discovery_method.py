"""Failure discovery's method core (Wiles et al.): statistics recomputed independently, clustering, merging, refining."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lance_pipeline.discovery.method import (
    ClusteringSettings,
    FailureCounts,
    benjamini_hochberg,
    clopper_pearson,
    cluster_failures,
    merge_captions,
    refine_description,
    test_description,
)


def _hypergeom_upper_tail(a: int, row1: int, col1: int, total: int) -> float:
    """P(X >= a) for X ~ Hypergeometric: the one-sided Fisher p-value, from binomial coefficients."""
    denominator = math.comb(total, col1)
    upper = min(row1, col1)
    return sum(math.comb(row1, x) * math.comb(total - row1, col1 - x) for x in range(a, upper + 1)) / denominator


@pytest.mark.parametrize(
    ("k1", "n1", "k0", "n0"), [(30, 100, 10, 100), (5, 20, 5, 100), (0, 10, 3, 50), (12, 12, 0, 40)]
)
def test_fisher_p_value_equals_hypergeometric_tail(k1, n1, k0, n0):
    result = test_description(FailureCounts(k1, n1), FailureCounts(k0, n0))
    expected = _hypergeom_upper_tail(k1, n1, k1 + k0, n1 + n0)
    assert result["p_value"] == pytest.approx(expected, rel=1e-9)
    assert result["rate"] == k1 / n1 and result["base_rate"] == k0 / n0


def test_clopper_pearson_matches_beta_quantiles():
    from scipy.stats import beta

    low, high = clopper_pearson(7, 40)
    assert low == pytest.approx(beta.ppf(0.025, 7, 34), rel=1e-7)
    assert high == pytest.approx(beta.ppf(0.975, 8, 33), rel=1e-7)
    assert clopper_pearson(0, 10)[0] == 0.0 and clopper_pearson(10, 10)[1] == 1.0


def test_benjamini_hochberg_by_hand():
    p = [0.01, 0.04, 0.03, 0.20]
    # sorted: 0.01 (rank 1), 0.03 (2), 0.04 (3), 0.20 (4); q_i = min_{j >= i} p_j * m / j
    m = 4
    raw = {0.01: 0.01 * m / 1, 0.03: 0.03 * m / 2, 0.04: 0.04 * m / 3, 0.20: 0.20 * m / 4}
    expected_sorted = [min(raw[v] for v in sorted(p)[i:]) for i in range(m)]
    expected = [expected_sorted[sorted(p).index(v)] for v in p]
    assert benjamini_hochberg(p) == pytest.approx(expected)
    assert benjamini_hochberg([]) == []


def test_clusters_split_by_predicted_label_then_embedding():
    rng = np.random.default_rng(0)
    keys = [f"k{i:02d}" for i in range(30)]
    predicted = [3] * 20 + [7] * 6 + [9] * 4  # label 9 is too small to describe
    centres = np.eye(4)
    emb = np.stack([centres[0 if i < 10 else 1 if i < 20 else 2] + 0.01 * rng.standard_normal(4) for i in range(30)])
    settings = ClusteringSettings(min_cluster_size=5, images_per_cluster=10, max_clusters_per_label=4)
    clusters = cluster_failures(keys, predicted, emb, settings)
    assert [(c.predicted_label, len(c.members)) for c in clusters] == [(3, 10), (3, 10), (7, 6)]
    assert {tuple(c.members) for c in clusters[:2]} == {tuple(keys[:10]), tuple(keys[10:20])}
    assert cluster_failures(keys, predicted, emb, settings) == clusters  # seeded


def test_keyword_merge_keeps_shared_words_without_class_or_stop_words():
    captions = [
        "a red tench lying on green grass",
        "a red fish on the grass near a river",
        "the red tench in grass",
        "a tench held by a man",
    ]
    assert merge_captions(captions, "tench", "fish") == "red grass"
    assert merge_captions(["a photo of a tench"], "tench") == ""


def test_refinement_drops_words_while_significant():
    # a stand-in evaluate(): only descriptions containing "red" raise the failure rate
    def evaluate(description):
        failures = 60 if "red" in description.split() else 10
        return test_description(FailureCounts(failures, 100), FailureCounts(10, 100))

    refined = refine_description("red sandy beach", evaluate, alpha=0.01)
    assert refined.description == "red"
    tested = {s.description: s.significant for s in refined.steps}
    assert tested["sandy beach"] is False and tested["red beach"] is True


class _ScriptedPerturber:
    """Stand-in for PromptPerturber's chat interface: returns a fixed answer, records the prompts."""

    model_id = "scripted"

    def __init__(self, answer: str) -> None:
        self.answer = answer
        self.prompts: list[str] = []

    def chat_prompt(self, system: str, user: str) -> str:
        return f"{system}\n{user}"

    def generate(self, prompts, seeds):
        self.prompts += prompts
        return [(self.answer, False) for _ in prompts]


def test_llm_merge_keeps_content_words_without_the_class_and_falls_back_to_keywords():
    from lance_pipeline.discovery.method import LLMCaptionMerger

    captions = ["a red tench on grass", "a red tench in a river", "red fish on green grass"]
    merger = LLMCaptionMerger(_ScriptedPerturber("The Tench is red, on the grass!\nsecond line ignored"), max_words=3)
    assert merger.merge(captions, "tench", "fish") == "red grass"
    assert "Object class: tench" in merger.perturber.prompts[0] and merger.fallbacks == 0
    empty = LLMCaptionMerger(_ScriptedPerturber("   "))
    assert empty.merge(captions, "tench", "fish") == merge_captions(captions, "tench", "fish")
    assert empty.fallbacks == 1 and empty.describe()["fallbacks"] == 1


def test_llm_merge_with_the_tiny_causal_lm_is_seeded(tmp_path):
    from lance_pipeline.discovery.method import LLMCaptionMerger
    from lance_pipeline.text.perturbation import PromptPerturber
    from lance_pipeline.tiny.text_components import create_tiny_causal_lm

    model = create_tiny_causal_lm(tmp_path / "lm")
    perturber = PromptPerturber(model=str(model), revision=None, max_new_tokens=8, do_sample=True)
    perturber.load("cpu")
    captions = ["a red photo of a tench", "a red photo of a tench by the river"]
    first = LLMCaptionMerger(perturber).merge(captions, "tench", "fish")
    assert first == LLMCaptionMerger(perturber).merge(captions, "tench", "fish")
    assert len(first.split()) <= 4 and "tench" not in first.split()
