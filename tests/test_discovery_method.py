"""Failure discovery's method core (Wiles et al.): statistics recomputed independently, clustering, merging, refining."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lance_pipeline.discovery.clustering import ClusteringSettings, cluster_failures
from lance_pipeline.discovery.descriptions import merge_captions, sub_descriptions
from lance_pipeline.discovery.statistics import (
    EventCounts,
    benjamini_hochberg,
    bh_cutoff,
    clopper_pearson,
    rate_increase_test,
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
    result = rate_increase_test(EventCounts(k1, n1), EventCounts(k0, n0))
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
    # at 0.05: q = 0.04, 0.053, 0.053, 0.2 -> only 0.01 is rejected; the cut-off is the largest rejected raw p
    assert bh_cutoff(p, benjamini_hochberg(p), 0.05) == 0.01 and bh_cutoff(p, benjamini_hochberg(p), 0.01) == 0.0


def test_failures_cluster_by_embedding_whatever_labels_they_were_given():
    """Three groups of similar images; the third's failures all went to different labels (they scatter), and it is
    still one cluster; the number of clusters comes from the silhouette, not from the labels."""
    rng = np.random.default_rng(0)
    keys = [f"k{i:02d}" for i in range(24)]
    predicted = [3] * 10 + [7] * 8 + [11, 12, 13, 14, 15, 16]
    centres = np.eye(4)
    group = [0] * 10 + [1] * 8 + [2] * 6
    emb = np.stack([centres[g] + 0.01 * rng.standard_normal(4) for g in group])
    clusters = cluster_failures(keys, predicted, emb)  # the default settings
    assert [(c.members, c.target_label) for c in clusters] == [(keys[:10], 3), (keys[10:18], 7), (keys[18:], 11)]
    assert clusters[2].predicted == {label: 1 for label in range(11, 17)}  # scattered, none lost
    assert cluster_failures(list(reversed(keys)), predicted[::-1], emb[::-1]) == clusters  # order-independent


def test_clustering_keeps_small_groups_and_drops_only_single_images():
    emb = np.array([[1.0, 0.0]] * 3 + [[0.0, 1.0]] * 2 + [[-1.0, 0.0]])
    clusters = cluster_failures(["a", "b", "c", "d", "e", "f"], [1, 2, 3, 4, 4, 5], emb)
    assert [c.members for c in clusters] == [["a", "b", "c"], ["d", "e"]]  # "f" alone is not a pattern
    assert clusters[0].target_label == 1  # a three-way tie: the smallest label
    one = cluster_failures(["a", "b"], [1, 1], np.array([[1.0, 0.0], [1.0, 0.0]]))
    assert [c.members for c in one] == [["a", "b"]]  # identical images: one cluster
    with pytest.raises(ValueError, match="max_clusters"):
        ClusteringSettings(max_clusters=0)


def test_keyword_merge_keeps_shared_words_without_class_or_stop_words():
    captions = [
        "a red tench lying on green grass",
        "a red fish on the grass near a river",
        "the red tench in grass",
        "a tench held by a man",
    ]
    assert merge_captions(captions, "tench", "fish") == "red grass"
    assert merge_captions(["a photo of a tench"], "tench") == ""


def test_refinement_variants_are_every_shorter_description_in_order():
    assert sub_descriptions("red sandy beach") == [
        "red", "sandy", "beach", "red sandy", "red beach", "sandy beach",
    ]  # fmt: skip
    assert sub_descriptions("red") == [] and len(sub_descriptions("a b c d")) == 2**4 - 2
    assert sub_descriptions("red red") == ["red"]  # a repeated word gives one variant


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
    from lance_pipeline.discovery.descriptions import LLMCaptionMerger

    captions = ["a red tench on grass", "a red tench in a river", "red fish on green grass"]
    merger = LLMCaptionMerger(_ScriptedPerturber("The Tench is red, on the grass!\nsecond line ignored"), max_words=3)
    assert merger.merge(captions, "tench", "fish") == "red grass"
    assert "Object class: tench" in merger.perturber.prompts[0] and merger.fallbacks == 0
    empty = LLMCaptionMerger(_ScriptedPerturber("   "))
    assert empty.merge(captions, "tench", "fish") == merge_captions(captions, "tench", "fish")
    assert empty.fallbacks == 1 and empty.describe()["fallbacks"] == 1


def test_llm_merge_with_the_tiny_causal_lm_is_seeded(tmp_path):
    from lance_pipeline.discovery.descriptions import LLMCaptionMerger
    from lance_pipeline.text.perturbation import PromptPerturber
    from lance_pipeline.tiny.text_components import create_tiny_causal_lm

    model = create_tiny_causal_lm(tmp_path / "lm")
    perturber = PromptPerturber(model=str(model), revision=None, max_new_tokens=8, do_sample=True)
    perturber.load("cpu")
    captions = ["a red photo of a tench", "a red photo of a tench by the river"]
    first = LLMCaptionMerger(perturber).merge(captions, "tench", "fish")
    assert first == LLMCaptionMerger(perturber).merge(captions, "tench", "fish")
    assert len(first.split()) <= 4 and "tench" not in first.split()
