"""Class-level insights (LANCE section 4.3, Figure 6): which kinds of edit hurt a model most on each class.

As in the paper's analysis, for each class the counterfactual edits are clustered by the direction of the edit in
CLIP text space (Radford et al., ICML 2021, here through open_clip: Cherti et al., CVPR 2023): the normalised text
embedding of the edited caption minus that of the original caption, grouped with K-Means (k configurable, default
5; the authors used k=10 and failed on classes with fewer edits, we use ``min(k, distinct edits)``). Each cluster is
named by the edit of its member closest to the centroid, scored for a model by its members' mean Delta p(y_GT)
(:mod:`evaluation.metrics`), and the highest-scoring clusters are reported with example edits.

Clustering depends on the release only, so it is computed once per ``lance-cf eval`` run and scored per model.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from builder import release_format as rf
from evaluation.metric_registry import Metric, MetricContext
from evaluation.models import public_model_name
from evaluation.release_reader import Release
from lance_pipeline.clip.loader import load_clip
from lance_pipeline.readers import load_json

logger = logging.getLogger(__name__)


def resolve_clip_name(model: str) -> str:
    """An open_clip model reference: a local directory becomes ``local-dir:PATH``; names and schemas pass through."""
    if not model.startswith(("hf-hub:", "local-dir:")) and Path(model).expanduser().is_dir():
        return "local-dir:" + str(Path(model).expanduser())
    return model


def load_clip_text_encoder(model: str, pretrained: str | None, device: str = "cpu") -> tuple[Any, Any]:
    """Load an open_clip model and its tokenizer (``ViT-L-14``+``openai``, ``hf-hub:ORG/NAME``, a local dir).

    Through the project's one CLIP loader (``lance_pipeline.clip.loader``), which applies the QuickGELU rule.
    """
    name = resolve_clip_name(model)
    has_schema = name.startswith(("hf-hub:", "local-dir:"))
    loaded = load_clip(name, None if has_schema else pretrained, device)
    return loaded.model, loaded.tokenizer


def edit_name(edit: dict[str, Any]) -> str:
    return f"{edit.get('original_span') or ''} → {edit.get('edited_span') or ''}".strip()


def read_edits(release: Release, config: str = "counterfactual") -> list[dict[str, Any]]:
    """Metadata of every readable sample of ``config`` (images are not decoded). Unreadable samples are left out here:
    the model runs record them as failures, naming shard and key."""
    edits = []
    for shard in release.shards.get(config, []):
        for _, sample in rf.iter_shard(shard, wanted={rf.METADATA_EXT}, errors="sample"):
            if not isinstance(sample, dict) or rf.METADATA_EXT not in sample:
                continue
            try:
                edits.append(load_json(sample[rf.METADATA_EXT], "a sample's metadata"))
            except ValueError:
                continue
    return edits


def embed_edit_directions(edits: list[dict[str, Any]], clip: Any, tokenizer: Any, batch_size: int = 256) -> Any:
    """Normalised CLIP text embedding of each edited caption minus that of its original caption (numpy array)."""
    import torch

    def encode(texts: list[str]) -> Any:
        chunks = []
        device = next(clip.parameters()).device
        with torch.inference_mode():
            for start in range(0, len(texts), batch_size):
                tokens = tokenizer(texts[start : start + batch_size]).to(device)
                features = clip.encode_text(tokens).float()
                chunks.append(torch.nn.functional.normalize(features, dim=-1).cpu())
        return torch.cat(chunks).numpy()

    edited = encode([e["edited_caption"] or "" for e in edits])
    original = encode([e["caption"] or "" for e in edits])
    return edited - original


def cluster_edits(directions: Any, k: int, seed: int = 0) -> tuple[Any, Any]:
    """K-Means labels and centroids of edit directions, with ``min(k, distinct directions)`` clusters."""
    import numpy as np
    from sklearn.cluster import KMeans

    distinct = len(np.unique(np.round(directions, 6), axis=0))
    n_clusters = max(1, min(k, distinct))
    if n_clusters == 1:
        return np.zeros(len(directions), dtype=int), directions.mean(axis=0, keepdims=True)
    kmeans = KMeans(n_clusters=n_clusters, random_state=seed, n_init=10).fit(directions)
    return kmeans.labels_, kmeans.cluster_centers_


def cluster_release_edits(release: Release, options: Any) -> dict[str, Any]:
    """Cluster each class's counterfactual edits; the model-independent half of the insights."""
    import numpy as np

    edits = [e for e in read_edits(release) if e.get("caption") and e.get("edited_caption")]
    clip_name = resolve_clip_name(options.clip_model)
    result: dict[str, Any] = {
        "clip_model": public_model_name(clip_name),  # a local directory by its folder name, never its path
        "clip_pretrained": None if clip_name.startswith(("hf-hub:", "local-dir:")) else options.clip_pretrained,
        "k": options.insight_k,
        "classes": {},
    }
    if not edits:
        return result
    clip, tokenizer = load_clip_text_encoder(options.clip_model, options.clip_pretrained, options.device)
    directions = embed_edit_directions(edits, clip, tokenizer)
    del clip
    by_class: dict[int, list[int]] = {}
    for i, edit in enumerate(edits):
        by_class.setdefault(int(edit["label"]), []).append(i)
    for label in sorted(by_class):
        members = by_class[label]
        vectors = directions[members]
        labels, centroids = cluster_edits(vectors, options.insight_k, options.seed)
        clusters = []
        for c in range(len(centroids)):
            idx = np.flatnonzero(labels == c)
            if idx.size == 0:
                continue
            nearest = idx[np.argmin(np.linalg.norm(vectors[idx] - centroids[c], axis=1))]
            clusters.append(
                {
                    "id": int(c),
                    "name": edit_name(edits[members[nearest]]),
                    "members": [
                        {
                            "key": edits[members[i]]["key"],
                            "edit_type": edits[members[i]]["edit_type"],
                            "edit": edit_name(edits[members[i]]),
                            "caption": edits[members[i]]["caption"],
                            "edited_caption": edits[members[i]]["edited_caption"],
                        }
                        for i in idx
                    ],
                }
            )
        result["classes"][str(label)] = {"label_name": edits[members[0]]["label_name"], "clusters": clusters}
    logger.info("clustered %d edits of %d classes", len(edits), len(by_class))
    return result


def summarize_clusters(clustering: dict[str, Any], rows: list[dict[str, Any]], top: int = 3, examples: int = 3):
    """Score the clusters for one model and keep, per class, the ``top`` clusters by mean Delta p(y_GT).

    Args:
        clustering: output of :func:`cluster_release_edits`.
        rows: the model's per-sample prediction rows (harness output).
        top: clusters reported per class.
        examples: example edits per cluster (the most damaging first).
    """
    p_orig = {r["key"]: r["p_gt"] for r in rows if r["config"] == "original"}
    delta = {
        r["key"]: (p_orig[r["source_key"]] - r["p_gt"]) * 100.0
        for r in rows
        if r["config"] == "counterfactual" and r["source_key"] in p_orig
    }
    out: dict[str, Any] = {
        "clip_model": clustering["clip_model"],
        "clip_pretrained": clustering["clip_pretrained"],
        "k": clustering["k"],
        "by_class": {},
    }
    for label, entry in clustering["classes"].items():
        scored = []
        for cluster in entry["clusters"]:
            members = [dict(m, delta_p_gt=delta[m["key"]]) for m in cluster["members"] if m["key"] in delta]
            if not members:
                continue
            members.sort(key=lambda m: m["delta_p_gt"], reverse=True)
            scored.append(
                {
                    "name": cluster["name"],
                    "size": len(members),
                    "delta_p_gt_mean": sum(m["delta_p_gt"] for m in members) / len(members),
                    "examples": members[:examples],
                }
            )
        scored.sort(key=lambda c: c["delta_p_gt_mean"], reverse=True)
        out["by_class"][label] = {
            "label_name": entry["label_name"],
            "n_clusters": len(scored),
            "top_clusters": scored[:top],
        }
    return out


class EditClusterInsights(Metric):
    """The registered metric (``METRICS["insights"]``): :func:`summarize_clusters` of the run's edit clusters."""

    name = "insights"
    version = "1"
    description = (
        "Per class, the clusters of counterfactual edits (K-Means over CLIP text edit directions, once per run) that "
        "lower the model's true-class probability most, with example edits (LANCE section 4.3). Needs the CLIP model; "
        "off with --no-insights."
    )
    needs = ("config", "key", "source_key", "p_gt")
    produces = ("insights",)

    def applies(self, context: MetricContext) -> bool:
        return context.edit_clusters is not None

    def compute(self, context: MetricContext) -> dict[str, Any]:
        return {"insights": summarize_clusters(context.edit_clusters, context.rows, top=context.insight_top)}
