"""Failure discovery: cluster a model's failures, describe them in words, and test the descriptions.

Wiles, Albuquerque, Gowal, "Discovering Bugs in Vision Models using Off-the-shelf Image Generation and Captioning"
(arXiv 2208.08831). Their pipeline used internal models (Imagen, Flamingo) and reported failure rates without tests;
this module is the method's statistical and textual core with open components:

1. baseline: images generated from "a realistic photograph of a {class} ({superclass})" give each class's base
   failure rate (``FailureCounts``);
2. ``cluster_failures``: the misclassified images grouped by predicted label, then by image embedding (k-means on
   L2-normalised CLIP embeddings, k chosen by the size of the group), with the method and parameters recorded;
3. ``merge_captions``: a cluster's captions merged into one short description (keyword frequency: the words shared
   by most captions, class-name and stop words removed), or by an LLM through the perturber backend (``builder``);
4. ``test_description``: images generated from base prompt + description; their failure rate against the base rate
   with a one-sided Fisher exact test (both rates are estimates) and Clopper-Pearson intervals; p-values over every
   description tested for a model are corrected with Benjamini-Hochberg (``benjamini_hochberg``);
5. ``refine_description``: words dropped one at a time while the failure rate stays significantly above base,
   keeping the shortest description; every variant tested is returned.

Everything here is deterministic given its inputs (k-means is seeded).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

BASE_TEMPLATE = "a realistic photograph of a {class_name} ({superclass})"
DESCRIPTION_TEMPLATE = "{base}, {description}"


@dataclass
class FailureCounts:
    """How often a model fails on a set of generated images of one class."""

    failures: int
    n: int

    @property
    def rate(self) -> float:
        return self.failures / self.n if self.n else float("nan")


def clopper_pearson(failures: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Exact binomial interval of a failure rate (scipy's ``binomtest(...).proportion_ci(method="exact")``)."""
    from scipy.stats import binomtest

    if n == 0:
        return (0.0, 1.0)
    ci = binomtest(failures, n).proportion_ci(confidence_level=confidence, method="exact")
    return (float(ci.low), float(ci.high))


def test_description(described: FailureCounts, base: FailureCounts) -> dict[str, Any]:
    """One-sided Fisher exact test: does the description raise the failure rate above the base rate?

    Fisher (not a binomial test against a fixed rate) because the base rate is itself estimated from ``base.n``
    images.
    """
    from scipy.stats import fisher_exact

    table = [[described.failures, described.n - described.failures], [base.failures, base.n - base.failures]]
    _, p_value = fisher_exact(table, alternative="greater")
    return {
        "failures": described.failures,
        "n": described.n,
        "rate": described.rate,
        "interval": clopper_pearson(described.failures, described.n),
        "base_failures": base.failures,
        "base_n": base.n,
        "base_rate": base.rate,
        "p_value": float(p_value),
        "test": "fisher_exact_one_sided_greater",
    }


test_description.__test__ = False  # a statistics function, not a pytest test


def benjamini_hochberg(p_values: list[float]) -> list[float]:
    """Benjamini-Hochberg adjusted p-values (q-values), in input order (scipy ``false_discovery_control``)."""
    from scipy.stats import false_discovery_control

    if not p_values:
        return []
    return [float(q) for q in false_discovery_control(p_values, method="bh")]


@dataclass
class Cluster:
    """A group of misclassified images: same predicted label, nearby image embeddings."""

    predicted_label: int
    members: list[str]  # sample keys
    centroid_index: int = 0  # the sub-cluster within the predicted label


@dataclass
class ClusteringSettings:
    """How failures are grouped (recorded in discoveries.json).

    Attributes:
        min_cluster_size: Clusters smaller than this are not described (too few images to say anything).
        images_per_cluster: Target images per k-means cluster within one predicted label (k = n // this, >= 1).
        max_clusters_per_label: Upper bound on k.
        seed: k-means seed.
    """

    method: str = "predicted_label+kmeans"
    min_cluster_size: int = 5
    images_per_cluster: int = 10
    max_clusters_per_label: int = 4
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cluster_failures(
    keys: list[str], predicted: list[int], embeddings: Any, settings: ClusteringSettings | None = None
) -> list[Cluster]:
    """Group failing samples by predicted label, then split each group by k-means on its image embeddings.

    Args:
        keys: Sample keys of the misclassified images.
        predicted: Their predicted labels.
        embeddings: Array [n, d] of image embeddings (e.g. CLIP), L2-normalised here.

    Returns:
        Clusters with at least ``min_cluster_size`` members, largest first (ties by predicted label, then keys).
    """
    import numpy as np

    settings = settings or ClusteringSettings()
    if not len(keys) == len(predicted) == len(embeddings):
        raise ValueError("keys, predicted labels and embeddings differ in length")
    emb = np.asarray(embeddings, dtype=np.float64)
    if len(emb):
        emb = emb / np.clip(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12, None)
    groups: dict[int, list[int]] = {}
    for i, label in enumerate(predicted):
        groups.setdefault(int(label), []).append(i)
    clusters: list[Cluster] = []
    for label, members in sorted(groups.items()):
        if len(members) < settings.min_cluster_size:
            continue
        k = max(1, min(settings.max_clusters_per_label, len(members) // settings.images_per_cluster))
        if k == 1:
            assignment = [0] * len(members)
        else:
            from sklearn.cluster import KMeans

            assignment = KMeans(n_clusters=k, n_init=10, random_state=settings.seed).fit_predict(emb[members]).tolist()
        for c in range(k):
            chosen = sorted(keys[members[j]] for j in range(len(members)) if assignment[j] == c)
            if len(chosen) >= settings.min_cluster_size:
                clusters.append(Cluster(label, chosen, c))
    return sorted(clusters, key=lambda c: (-len(c.members), c.predicted_label, c.members))


_STOP_WORDS: frozenset[str] | None = None


def _stop_words() -> frozenset[str]:
    global _STOP_WORDS
    if _STOP_WORDS is None:
        from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS

        _STOP_WORDS = frozenset(ENGLISH_STOP_WORDS | {"photo", "photograph", "picture", "image", "realistic"})
    return _STOP_WORDS


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def merge_captions(captions: list[str], class_name: str, superclass: str | None = None, max_words: int = 3) -> str:
    """The keyword-frequency merge: the words most captions share, without stop words or the class's own words.

    Words are ranked by how many captions contain them (ties: first appearance); at most ``max_words`` are kept,
    and only words found in at least half the captions (at least one word is always kept when any remains).
    """
    banned = set(_words(class_name)) | set(_words(superclass or "")) | _stop_words()
    document_frequency: Counter[str] = Counter()
    first_seen: dict[str, int] = {}
    for caption in captions:
        for word in dict.fromkeys(_words(caption)):
            if word in banned or len(word) < 3:
                continue
            document_frequency[word] += 1
            first_seen.setdefault(word, len(first_seen))
    ranked = sorted(document_frequency, key=lambda w: (-document_frequency[w], first_seen[w]))
    majority = [w for w in ranked if document_frequency[w] * 2 >= len(captions)]
    chosen = (majority or ranked[:1])[:max_words]
    return " ".join(chosen)


@dataclass
class RefinementStep:
    description: str
    result: dict[str, Any]
    significant: bool


@dataclass
class Refinement:
    description: str  # the shortest description still significant
    steps: list[RefinementStep] = field(default_factory=list)


def refine_description(
    description: str, evaluate: Callable[[str], dict[str, Any]], alpha: float, max_rounds: int = 8
) -> Refinement:
    """Drop words one at a time while the failure rate stays significantly above base; keep the shortest.

    ``evaluate(description)`` returns a ``test_description`` result (it generates and classifies the images). A
    variant is significant when its p-value is below ``alpha`` (the caller passes the BH-corrected level it uses for
    the original descriptions). Greedy: each round tries removing each word and keeps the first significant
    variant with the highest failure rate; stops when no single removal stays significant.
    """
    current = description
    steps: list[RefinementStep] = []
    tested: dict[str, dict[str, Any]] = {}
    for _ in range(max_rounds):
        words = current.split()
        if len(words) <= 1:
            break
        best: tuple[float, str] | None = None
        for i in range(len(words)):
            variant = " ".join(words[:i] + words[i + 1 :])
            if variant not in tested:
                tested[variant] = evaluate(variant)
                significant = tested[variant]["p_value"] < alpha
                steps.append(RefinementStep(variant, tested[variant], significant))
            result = tested[variant]
            if result["p_value"] < alpha and (best is None or result["rate"] > best[0]):
                best = (result["rate"], variant)
        if best is None:
            break
        current = best[1]
    return Refinement(current, steps)


MERGE_SYSTEM = (
    "You summarise what several image captions have in common. Answer with one short phrase of at most {max_words} "
    "words that describes the shared situation, context or appearance. Do not name the object class."
)


class LLMCaptionMerger:
    """Merge a cluster's captions with an instruction-tuned LLM (the perturber backend, ``PromptPerturber``).

    The answer's first line is reduced to at most ``max_words`` content words, without the class's own words; when
    nothing is left (an empty or off-task answer), the keyword merge is used instead and counted in ``fallbacks``.
    Seeded per cluster: the same captions give the same description.
    """

    def __init__(self, perturber: Any, max_words: int = 4) -> None:
        self.perturber = perturber
        self.max_words = max_words
        self.fallbacks = 0

    def describe(self) -> dict[str, Any]:
        return {"kind": "llm", "model": getattr(self.perturber, "model_id", None), "max_words": self.max_words,
                "fallbacks": self.fallbacks}  # fmt: skip

    def merge(self, captions: list[str], class_name: str, superclass: str | None = None) -> str:
        import hashlib

        user = f"Object class: {class_name}\nCaptions:\n" + "\n".join(f"- {c}" for c in captions)
        prompt = self.perturber.chat_prompt(MERGE_SYSTEM.format(max_words=self.max_words), user)
        seed = int.from_bytes(hashlib.sha256("\n".join(captions).encode()).digest()[:4], "big") & 0x7FFFFFFF
        text, _ = self.perturber.generate([prompt], [seed])[0]
        banned = set(_words(class_name)) | set(_words(superclass or "")) | _stop_words()
        first_line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
        words = [w for w in _words(first_line) if w not in banned and len(w) >= 3][: self.max_words]
        if not words:
            self.fallbacks += 1
            return merge_captions(captions, class_name, superclass)
        return " ".join(words)


class KeywordCaptionMerger:
    """The keyword-frequency merge (``merge_captions``) behind the same interface as ``LLMCaptionMerger``."""

    def describe(self) -> dict[str, Any]:
        return {"kind": "keyword_frequency", "max_words": 3, "min_document_fraction": 0.5}

    def merge(self, captions: list[str], class_name: str, superclass: str | None = None) -> str:
        return merge_captions(captions, class_name, superclass)
