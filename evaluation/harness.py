"""Streaming evaluation of timm classifiers on a LANCE release.

For each model: build it (:mod:`evaluation.models`), resolve its own data config and eval transform with timm
(``resolve_data_config`` / ``create_transform``, as timm's validate.py does), stream every config's shards through a
``torch.utils.data.DataLoader`` (worker processes decode and transform, pinned memory on CUDA), and keep per sample
only what the metrics need: p(y_GT) over the full softmax, top-1/top-5 correctness and the top-5 predictions.
Metrics are then computed by :mod:`evaluation.metrics`, class-level insights by :mod:`evaluation.insights`.
"""

from __future__ import annotations

import io
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from builder import release_format as rf

from .models import ModelSpec, create_eval_model, describe_weights, resolve_label_indices
from .release_reader import Release, iter_shard_samples

logger = logging.getLogger(__name__)

TOPK = 5


@dataclass
class EvalOptions:
    """Options shared by every model of one ``lance-cf eval`` run."""

    device: str = "cpu"
    batch_size: int = 64
    workers: int = 2
    min_batch_size: int = 1
    channels_last: bool = True
    bootstrap: int = 1000
    seed: int = 0
    insights: bool = True
    insight_k: int = 5
    insight_top: int = 3
    clip_model: str = "ViT-L-14"
    clip_pretrained: str | None = "openai"
    report: bool = True
    gallery_size: int = 12
    force: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class ShardSampleDataset(torch.utils.data.IterableDataset):
    """An iterable-style dataset over the shards of several configs, decoded and transformed in the workers.

    Work is split between DataLoader workers by shard when there are many shards (at least 8 per worker, so that the
    workers stay balanced), otherwise by sample: each worker decodes every ``num_workers``-th sample of the running
    sequence and seeks past the others' bytes.
    """

    def __init__(self, shards: list[tuple[str, Path]], image_ext: str, transform: Any) -> None:
        self.shards = shards
        self.image_ext = image_ext
        self.transform = transform

    def __iter__(self):
        from PIL import Image

        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        by_shard = len(self.shards) >= 8 * num_workers
        select = None if by_shard or num_workers == 1 else (lambda i: i % num_workers == worker)
        start = 0  # running sample index over all shards, so that striding stays balanced across shard ends
        for shard_index, (config, path) in enumerate(self.shards):
            if by_shard and shard_index % num_workers != worker:
                continue
            for index, sample in iter_shard_samples(path, self.image_ext, select=select, start_index=start):
                start = index + 1
                if sample is None:
                    continue
                with Image.open(io.BytesIO(sample[self.image_ext])) as image:
                    tensor = self.transform(image.convert("RGB"))
                label = int(sample[rf.LABEL_EXT].decode("ascii").strip())
                yield tensor, label, config, sample[rf.METADATA_EXT].decode("utf-8")


def is_oom_error(error: BaseException) -> bool:
    import torch

    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


class OOMRetryForward:
    """Run a model on a batch, splitting the batch (and lowering the batch size for what follows) on out-of-memory."""

    def __init__(self, model: Any, batch_size: int, min_batch_size: int = 1) -> None:
        self.model = model
        self.batch_size = batch_size
        self.min_batch_size = max(1, min_batch_size)
        self.retries = 0

    def __call__(self, images: Any) -> Any:
        import torch

        outputs = []
        start = 0
        while start < images.shape[0]:
            # the batch size may drop inside _forward; later slices of this batch then use the smaller size
            part = images[start : start + self.batch_size]
            outputs.append(self._forward(part))
            start += part.shape[0]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _forward(self, chunk: Any) -> Any:
        import torch

        try:
            return self.model(chunk)
        except Exception as error:
            if not is_oom_error(error) or chunk.shape[0] <= self.min_batch_size:
                raise
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.batch_size = max(self.min_batch_size, min(self.batch_size, chunk.shape[0] // 2))
            self.retries += 1
            logger.warning(
                "out of memory on a batch of %d; retrying with batch size %d", chunk.shape[0], self.batch_size
            )
            return self(chunk)


def predict_release(
    model: Any,
    release: Release,
    data_config: dict[str, Any],
    options: EvalOptions,
    label_indices: list[int] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run ``model`` over every config of ``release``.

    Returns:
        One row per sample (metadata, ``p_gt``, ``correct1``, ``correct5``, ``top5`` and ``top5_prob``) and timing
        figures (``images``, ``seconds``, ``images_per_second``, ``batch_size`` after any out-of-memory retries).
    """
    import torch
    from timm.data import create_transform
    from tqdm.auto import tqdm

    device = torch.device(options.device)
    # As timm's loader with its prefetcher: workers resize/crop to uint8 tensors (4x less to move between processes
    # and to the device), and the batch is normalised on the device in one op.
    transform = create_transform(**data_config, use_prefetcher=True)
    mean = torch.tensor([255.0 * m for m in data_config["mean"]], device=device).view(1, -1, 1, 1)
    std = torch.tensor([255.0 * s for s in data_config["std"]], device=device).view(1, -1, 1, 1)
    shards = [(config, path) for config in release.configs for path in release.shards[config]]
    dataset = ShardSampleDataset(shards, release.image_ext, transform)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=options.batch_size,
        num_workers=options.workers,
        pin_memory=device.type == "cuda",
        persistent_workers=False,
    )
    memory_format = torch.channels_last if options.channels_last else torch.contiguous_format
    # channels_last is what timm's validate.py --channels-last does: faster convolutions on CPU (oneDNN) and GPU
    model = model.to(device, memory_format=memory_format)
    forward = OOMRetryForward(model, options.batch_size, options.min_batch_size)
    index = torch.tensor(label_indices, device=device) if label_indices is not None else None
    rows: list[dict[str, Any]] = []
    total = sum(e.get("samples", 0) for e in release.manifest.get("shards") or [] if e["config"] in release.shards)
    progress = tqdm(total=total or None, unit="img", desc="evaluating", disable=None, leave=False)
    start = time.perf_counter()
    with torch.inference_mode(), progress:
        for images, labels, configs, metas in loader:
            progress.update(len(labels))
            images = images.to(device, non_blocking=True).float().sub_(mean).div_(std)
            images = images.contiguous(memory_format=memory_format)
            logits = forward(images)
            if index is not None:
                logits = logits.index_select(1, index)
            probs = logits.float().softmax(dim=1).cpu()
            top_prob, top_idx = probs.topk(min(TOPK, probs.shape[1]), dim=1)
            p_gt = probs.gather(1, labels.view(-1, 1)).squeeze(1)
            for i in range(len(labels)):
                meta = json.loads(metas[i])
                label = int(labels[i])
                top = top_idx[i].tolist()
                rows.append(
                    {
                        "config": configs[i],
                        "key": meta["key"],
                        "source_key": meta["source_key"],
                        "label": label,
                        "label_name": meta.get("label_name"),
                        "edit_type": meta.get("edit_type"),
                        "caption": meta.get("caption"),
                        "edited_caption": meta.get("edited_caption"),
                        "original_span": meta.get("original_span"),
                        "edited_span": meta.get("edited_span"),
                        "p_gt": float(p_gt[i]),
                        "correct1": top[0] == label,
                        "correct5": label in top,
                        "top5": top,
                        "top5_prob": [float(p) for p in top_prob[i]],
                    }
                )
    seconds = time.perf_counter() - start
    timing = {
        "images": len(rows),
        "seconds": round(seconds, 4),
        "images_per_second": round(len(rows) / seconds, 3) if seconds > 0 else None,
        "batch_size": forward.batch_size,
        "oom_retries": forward.retries,
    }
    return rows, timing


def package_versions() -> dict[str, str]:
    import platform
    from importlib import metadata

    versions = {"python": platform.python_version()}
    for name in ("torch", "torchvision", "timm", "numpy", "open_clip_torch", "scikit-learn", "lance-counterfactuals"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def evaluate_model(
    release: Release,
    spec: ModelSpec,
    options: EvalOptions,
    edit_clusters: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Evaluate one model: the results dict (schema in docs/evaluation.md) and the per-sample prediction rows."""
    import timm
    from timm.data import resolve_data_config

    from . import RESULTS_SCHEMA, RESULTS_SCHEMA_VERSION
    from .insights import summarize_clusters
    from .metrics import compute_metrics

    model = create_eval_model(spec)
    label_indices = resolve_label_indices(spec, model.num_classes, release.num_classes)
    data_config = resolve_data_config({}, model=model, use_test_size=True)
    logger.info("%s: data config %s", spec.name, data_config)
    rows, timing = predict_release(model, release, data_config, options, label_indices)
    computed = compute_metrics(rows, release.label_names, n_boot=options.bootstrap, seed=options.seed)
    results: dict[str, Any] = {
        "schema": RESULTS_SCHEMA,
        "schema_version": RESULTS_SCHEMA_VERSION,
        "status": "ok",
        "error": None,
        "model": {
            "name": spec.name,
            "slug": spec.slug,
            "weights": describe_weights(spec, model),
            "param_count": round(sum(p.numel() for p in model.parameters()) / 1e6, 3),
            "num_classes": model.num_classes,
            "class_map": str(spec.class_map) if spec.class_map is not None else None,
            "class_map_sha256": spec.class_map_sha256,
            "data_config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in data_config.items()},
        },
        "release": release.describe(),
        "packages": package_versions() | {"timm": timm.__version__},
        "run": {
            "device": options.device,
            "batch_size": options.batch_size,
            "workers": options.workers,
            "channels_last": options.channels_last,
            "bootstrap": options.bootstrap,
            "seed": options.seed,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "timing": timing,
        },
        **computed,
    }
    if edit_clusters is not None and "error" in edit_clusters:
        results["insights"] = {"error": edit_clusters["error"]}
    elif edit_clusters is not None:
        results["insights"] = summarize_clusters(edit_clusters, rows, top=options.insight_top)
    return results, rows


def error_results(release: Release, spec: ModelSpec, error: BaseException) -> dict[str, Any]:
    """The results dict of a model that failed to build or run: an error row for the leaderboard."""
    from . import RESULTS_SCHEMA, RESULTS_SCHEMA_VERSION

    return {
        "schema": RESULTS_SCHEMA,
        "schema_version": RESULTS_SCHEMA_VERSION,
        "status": "error",
        "error": f"{type(error).__name__}: {error}",
        "model": {"name": spec.name, "slug": spec.slug, "weights": {"id": spec.weights_id}},
        "release": release.describe(),
        "packages": package_versions(),
    }


def results_path(output_dir: Path, spec: ModelSpec) -> Path:
    return Path(output_dir) / spec.slug / "results.json"


def is_done(path: Path, release: Release, spec: ModelSpec) -> bool:
    """True when ``path`` holds successful results for the same release (manifest hash), the same weights and the
    same class map (which changes the scores as much as the weights do)."""
    if not path.is_file():
        return False
    try:
        previous = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return (
        previous.get("status") == "ok"
        and previous.get("release", {}).get("manifest_sha256") == release.manifest_sha256
        and previous.get("model", {}).get("weights", {}).get("id") == spec.weights_id
        and previous.get("model", {}).get("class_map_sha256") == spec.class_map_sha256
    )


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False, allow_nan=False, default=_json_default) + "\n")
    tmp.replace(path)


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _cluster_or_error(release: Release, options: EvalOptions) -> dict[str, Any]:
    """The release's edit clusters, or ``{"error": ...}``: missing CLIP weights must not fail every model."""
    from .insights import cluster_release_edits

    try:
        return cluster_release_edits(release, options)
    except Exception as error:
        logger.error("class-level insights unavailable (CLIP model %r): %s", options.clip_model, error)
        return {"error": f"{type(error).__name__}: {str(error)[:500]}"}


def run_evaluation(release: Release, specs: list[ModelSpec], output_dir: Path, options: EvalOptions) -> list[dict]:
    """Evaluate every model in turn; a model that fails gets an error row and the others continue.

    Writes ``OUTPUT/<model slug>/results.json``, ``predictions.parquet`` and (unless disabled) ``report.html``.
    Models whose results already exist for the same release and weights are skipped (``options.force`` re-runs).

    Returns:
        One summary per model: ``{"model", "slug", "status", "path", "error"}``; status is ok, error or skipped.
    """
    import pandas as pd

    output_dir = Path(output_dir)
    edit_clusters = None
    summaries = []
    for spec in specs:
        path = results_path(output_dir, spec)
        if not options.force and is_done(path, release, spec):
            logger.info("%s: results for this release and weights exist at %s; skipping", spec.name, path)
            summaries.append({"model": spec.name, "slug": spec.slug, "status": "skipped", "path": str(path)})
            continue
        if options.insights and edit_clusters is None:
            edit_clusters = _cluster_or_error(release, options)
        try:
            results, rows = evaluate_model(release, spec, options, edit_clusters if options.insights else None)
        except Exception as error:  # a model that fails to build or run must not stop the others
            if isinstance(error, KeyboardInterrupt):
                raise
            logger.error("%s: evaluation failed: %s", spec.name, error, exc_info=logger.isEnabledFor(logging.DEBUG))
            write_json(path, error_results(release, spec, error))
            summaries.append(
                {"model": spec.name, "slug": spec.slug, "status": "error", "path": str(path), "error": str(error)}
            )
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_parquet(path.parent / "predictions.parquet", index=False)
        write_json(path, results)
        if options.report:
            from .report import write_model_report

            try:
                write_model_report(results, rows, release, path.parent, gallery_size=options.gallery_size)
            except Exception as error:  # a report problem must not lose the computed results
                logger.error("%s: report failed: %s", spec.name, error)
        headline = results["metrics"].get("counterfactual") or results["metrics"].get("original", {})
        logger.info("%s: acc@1 %.2f on %d images", spec.name, headline.get("acc1", math.nan), headline.get("n", 0))
        summaries.append({"model": spec.name, "slug": spec.slug, "status": "ok", "path": str(path)})
    return summaries
