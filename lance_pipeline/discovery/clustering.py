"""Clustering a model's failures on one class by what the images look like, whatever label the model predicted.

The failures of one class are clustered together, not first split by predicted label: a situation in which the model
errs towards many different labels (its wrong labels scatter) still forms one cluster of similar-looking images, and
a group of a few failures is not dropped because its label is rare. Each cluster keeps the counts of the labels its
members were given; the most frequent is its *target label*, the wrong label whose rate the description is tested on.

k-means on L2-normalised image embeddings (CLIP in a real run), seeded; the number of clusters is the one with the
best silhouette score between 2 and ``max_clusters`` (scale-free, so the same rule serves any embedding), and one
cluster when there are too few distinct images to compare.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from lance_pipeline.option_types import Options, PositiveInt

CLUSTERING_METHOD = "kmeans_silhouette_over_all_failures"


@dataclass
class ClusteringSettings(Options):
    """How failures are grouped (recorded in discoveries.json).

    Attributes:
        min_cluster_size: Clusters smaller than this are not described (one image is not a pattern).
        max_clusters: Upper bound on k for one (model, class).
        seed: k-means seed.
    """

    method: Literal["kmeans_silhouette_over_all_failures"] = CLUSTERING_METHOD  # the one method: CLUSTERING_METHOD
    min_cluster_size: PositiveInt = 2
    max_clusters: PositiveInt = 8
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Cluster:
    """Misclassified images of one class with similar embeddings, and the labels the model gave them."""

    members: list[str]  # sample keys, sorted
    predicted: dict[int, int] = field(default_factory=dict)  # predicted label -> members given it

    @property
    def target_label(self) -> int:
        """The most frequent predicted label (ties: the smallest label)."""
        return min(self.predicted, key=lambda label: (-self.predicted[label], label))


def _choose_k(points: Any, settings: ClusteringSettings) -> tuple[int, list[int]]:
    """(k, assignment) with the best silhouette for k in 2..max_clusters; (1, zeros) when nothing can be compared."""
    import numpy as np

    n_distinct = len(np.unique(points.round(decimals=9), axis=0))
    upper = min(settings.max_clusters, n_distinct, len(points) - 1)
    if upper < 2:
        return 1, [0] * len(points)
    from sklearn.cluster import KMeans
    from sklearn.metrics import silhouette_score

    best: tuple[float, int, list[int]] | None = None
    for k in range(2, upper + 1):
        assignment = KMeans(n_clusters=k, n_init=10, random_state=settings.seed).fit_predict(points)
        if len(set(assignment.tolist())) < 2:
            continue
        score = float(silhouette_score(points, assignment))
        if best is None or score > best[0] + 1e-12:  # ties: the smaller k
            best = (score, k, assignment.tolist())
    if best is None:
        return 1, [0] * len(points)
    return best[1], best[2]


def cluster_failures(
    keys: list[str], predicted: list[int], embeddings: Any, settings: ClusteringSettings | None = None
) -> list[Cluster]:
    """Cluster the misclassified images of one class by their embeddings, all predicted labels together.

    Args:
        keys: Sample keys of the misclassified images.
        predicted: Their predicted labels.
        embeddings: Array [n, d] of image embeddings (e.g. CLIP), L2-normalised here.

    Returns:
        Clusters with at least ``min_cluster_size`` members, largest first (ties by their first key); seeded, so the
        same inputs give the same clusters.
    """
    import numpy as np

    settings = settings or ClusteringSettings()
    if not len(keys) == len(predicted) == len(embeddings):
        raise ValueError("keys, predicted labels and embeddings differ in length")
    if not keys:
        return []
    order = sorted(range(len(keys)), key=lambda i: keys[i])  # independent of the caller's order
    points = np.asarray(embeddings, dtype=np.float64)[order]
    points = points / np.clip(np.linalg.norm(points, axis=1, keepdims=True), 1e-12, None)
    _, assignment = _choose_k(points, settings)
    groups: dict[int, list[int]] = {}
    for position, cluster in enumerate(assignment):
        groups.setdefault(cluster, []).append(order[position])
    clusters = []
    for members in groups.values():
        if len(members) >= settings.min_cluster_size:
            counts = Counter(int(predicted[i]) for i in members)
            clusters.append(Cluster(sorted(keys[i] for i in members), dict(sorted(counts.items()))))
    return sorted(clusters, key=lambda c: (-len(c.members), c.members))
