"""Streaming evaluation of timm classifiers on a LANCE release.

For each model: build it (:mod:`evaluation.models`), resolve its own data config and eval transform with timm
(``resolve_data_config`` / ``create_transform``, as timm's validate.py does), stream every config's shards through a
``torch.utils.data.DataLoader`` (worker processes decode and transform, pinned memory on CUDA), and keep per sample
only what the metrics need: p(y_GT) over the full softmax, top-1/top-5 correctness and the top-5 predictions.
Metrics are then computed by the registered metrics (:mod:`evaluation.metric_registry`; ``--metrics`` selects them),
class-level insights among them (:mod:`evaluation.insights`, from edit clusters computed once per run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from builder import release_format as rf
from evaluation.insights import cluster_release_edits
from evaluation.metric_registry import METRICS, default_metric_names, metric_versions, select_metrics
from evaluation.metrics import compute_metrics
from evaluation.models import ModelSpec, create_eval_model, describe_weights, public_model_name, resolve_label_indices
from evaluation.plots import plot_strength_model
from evaluation.release_reader import Release, ReleaseIntegrityError, integrity_error
from evaluation.report import write_model_report
from evaluation.results import AMP_DTYPES, MODEL_DTYPES, RESULTS_SCHEMA, RESULTS_SCHEMA_VERSION  # noqa: F401 - re-exported
from lance_pipeline.models.hub_cache import offline_by_user
from lance_pipeline.models.worker_processes import worker_context, worker_entry
from lance_pipeline.readers import load_json, read_json
from lance_pipeline.release_kinds import metric_applies_to

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
    # timm validate.py's precision options: autocast (--amp, --amp-dtype) and the weights' own dtype (--model-dtype)
    amp: bool = False
    amp_dtype: str = "bfloat16"
    model_dtype: str = "float32"
    # torch.compile backend (validate.py --torchcompile), None for eager
    torchcompile: str | None = None
    # TF32 matmuls and cudnn.benchmark on CUDA, as validate.py sets them
    tf32: bool = True
    # grow the batch size from batch_size while memory allows (lm-eval's batch_size=auto), up to max_batch_size
    auto_batch_size: bool = False
    max_batch_size: int = 1024
    # score only the first N samples of each config (quick runs; such results are never complete)
    limit: int | None = None
    # check every shard's sha256 against the manifest as it streams
    verify: bool = True
    bootstrap: int = 1000
    seed: int = 0
    # interfaces releases: images a class needs in a shift to count in its accuracy (the paper's rule: 5)
    min_per_class: int = 5
    insights: bool = True
    insight_k: int = 5
    insight_top: int = 3
    clip_model: str = "ViT-L-14"
    clip_pretrained: str | None = "openai"
    report: bool = True
    gallery_size: int = 12
    force: bool = False
    # evaluate different models in parallel, one worker process per device (cuda:0,cuda:1 or cpu,cpu)
    devices: list[str] | None = None
    # registered metrics to compute (evaluation.metric_registry.METRICS); None: the default ones
    metrics: list[str] | None = None

    def __post_init__(self) -> None:
        if self.metrics is not None:
            # run order, required ones added; the default selection is None so that its run key stays the same
            selected = select_metrics(list(self.metrics))
            self.metrics = None if selected == default_metric_names() else selected

    def result_options(self) -> dict[str, Any]:
        """Every option that changes the numbers in a results JSON (recorded, and part of the skip-if-done key).

        Device, batch size and DataLoader workers are left out: they change floating-point rounding at most.
        """
        return (
            {
                "amp": self.amp,
                "amp_dtype": self.amp_dtype if self.amp else None,
                "model_dtype": self.model_dtype,
                "channels_last": self.channels_last,
                "torchcompile": self.torchcompile,
                "tf32": self.tf32,
                "limit": self.limit,
                "verify": self.verify,
                "bootstrap": self.bootstrap,
                "seed": self.seed,
                "insights": self.insights,
                "clip_model": public_model_name(self.clip_model) if self.insights else None,
                "clip_pretrained": self.clip_pretrained if self.insights else None,
                "clusters": self.insight_k if self.insights else None,
                "top_clusters": self.insight_top if self.insights else None,
            }
            | ({"min_per_class": self.min_per_class} if self.min_per_class != 5 else {})
            | ({"metrics": self.metrics} if self.metrics is not None else {})
        )
        # min_per_class and metrics only when they differ from the defaults, so that earlier runs keep their run key


class ShardSampleDataset(torch.utils.data.IterableDataset):
    """An iterable-style dataset over the shards of several configs, decoded and transformed in the workers.

    Work is split between DataLoader workers by shard when there are many shards (at least 8 per worker, so that the
    workers stay balanced), otherwise by sample: each worker decodes every ``num_workers``-th sample of the running
    sequence and reads past the others' bytes. Shards are read by the release format's one reader
    (``rf.iter_shard``, in its ``errors="sample"`` mode), each hashed as it streams.

    Items are ``(uint8 image, label, config, metadata JSON, problem, image sha256)``; ``problem`` is ``""`` for a
    good sample, and the image's SHA-256 (of its encoded bytes) lets the caller score identical images once. A
    sample that cannot be read or decoded comes with a zero image, label -1 and ``problem`` naming the shard, key and
    reason, so that it fails alone; a shard whose hash does not match comes as one item whose problem starts with
    ``INTEGRITY_PREFIX`` (raised in the main process, with one line).
    """

    INTEGRITY_PREFIX = "integrity: "

    def __init__(
        self,
        shards: list[dict[str, Any]],
        image_ext: str,
        transform: Any,
        image_shape: tuple[int, ...],
    ) -> None:
        self.shards = shards  # {"config", "path", "name", "sha256" | None, "max_samples" | None}
        self.image_ext = image_ext
        self.transform = transform
        self.image_shape = image_shape

    def _failed(self, config: str, shard: str, key: str, reason: str, integrity: bool = False):
        meta = json.dumps({"key": key, "shard": shard})
        problem = self.INTEGRITY_PREFIX + reason if integrity else f"{shard} {key}: {reason}"
        return torch.zeros(self.image_shape, dtype=torch.uint8), -1, config, meta, problem, ""

    def __iter__(self):
        from PIL import Image

        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        by_shard = len(self.shards) >= 8 * num_workers
        select = None if by_shard or num_workers == 1 else (lambda i: i % num_workers == worker)
        wanted = {self.image_ext, rf.LABEL_EXT, rf.METADATA_EXT}
        start = 0  # running sample index over all shards, so that striding stays balanced across shard ends
        for shard_index, shard in enumerate(self.shards):
            if by_shard and shard_index % num_workers != worker:
                continue
            config, name = shard["config"], shard["name"]
            # the release format's one reader: a sample it cannot read comes as data, the hash is checked as it streams
            samples = rf.iter_shard(
                shard["path"],
                wanted=wanted,
                select=select,
                start_index=start,
                expected_sha256=shard["sha256"],
                limit=shard["max_samples"],
                errors="sample",
                name=name,
            )
            read = 0
            try:
                for key, sample in samples:
                    read += 1
                    if sample is None:
                        continue
                    if isinstance(sample, rf.UnreadableSample):
                        yield self._failed(config, name, key, self._lost(sample.reason, shard, read))
                        continue
                    yield self._decode(sample, config, name, Image)
            except rf.ShardIntegrityError as error:  # crosses the worker boundary as data: one line, no traceback
                yield self._failed(config, name, "-", str(integrity_error(name, error)), integrity=True)
                return
            start += read

    @staticmethod
    def _lost(reason: str, shard: dict[str, Any], read: int) -> str:
        """A broken shard's reason, with how many of its later samples (per the manifest) could not be read."""
        expected = shard.get("samples")
        if shard.get("max_samples") is not None and expected is not None:
            expected = min(expected, shard["max_samples"])
        if expected is not None and expected > read:
            reason += f"; the {expected - read} sample(s) after this one could not be read"
        return reason

    def _decode(self, sample: dict[str, bytes], config: str, shard: str, image_module: Any):
        meta_bytes = sample.get(rf.METADATA_EXT)
        try:
            meta = load_json(meta_bytes, f"{shard}: metadata") if meta_bytes is not None else None
            key = meta["key"] if isinstance(meta, dict) else "?"
        except (ValueError, KeyError) as error:
            return self._failed(config, shard, "?", f"unreadable metadata ({error})")
        try:
            if self.image_ext not in sample:
                raise ValueError(f"no .{self.image_ext} member")
            if rf.LABEL_EXT not in sample:
                raise ValueError(f"no .{rf.LABEL_EXT} member")
            label = int(sample[rf.LABEL_EXT].decode("ascii").strip())
            with image_module.open(io.BytesIO(sample[self.image_ext])) as image:
                tensor = self.transform(image.convert("RGB"))
        except Exception as error:  # PIL raises many types for a broken image; any of them fails this sample only
            return self._failed(config, shard, key, f"cannot decode ({type(error).__name__}: {error})")
        digest = hashlib.sha256(sample[self.image_ext]).hexdigest()
        return tensor, label, config, meta_bytes.decode("utf-8"), "", digest


def is_oom_error(error: BaseException) -> bool:
    """True for an out-of-memory error: CUDA's ``torch.OutOfMemoryError``, or the allocator's RuntimeError on other
    devices (``DefaultCPUAllocator: can't allocate memory``, MPS ``out of memory``)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def _release_cached_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class OOMRetryForward:
    """Run a model on a batch, splitting the batch (and lowering the batch size for what follows) on out-of-memory.

    Only out-of-memory errors are caught; anything else propagates unchanged.
    """

    def __init__(self, model: Any, batch_size: int, min_batch_size: int = 1) -> None:
        self.model = model
        self.batch_size = batch_size
        self.min_batch_size = max(1, min_batch_size)
        self.retries = 0

    def __call__(self, images: Any) -> Any:
        outputs = []
        start = 0
        while start < images.shape[0]:
            # the batch size may drop inside _forward; later slices of this batch then use the smaller size
            part = images[start : start + self.batch_size]
            outputs.append(self._forward(part))
            start += part.shape[0]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _forward(self, chunk: Any) -> Any:
        try:
            return self.model(chunk)
        except (torch.OutOfMemoryError, RuntimeError) as error:
            if not is_oom_error(error) or chunk.shape[0] <= self.min_batch_size:
                raise
        _release_cached_memory()
        self.batch_size = max(self.min_batch_size, min(self.batch_size, chunk.shape[0] // 2))
        self.retries += 1
        logger.warning("out of memory on a batch of %d; retrying with batch size %d", chunk.shape[0], self.batch_size)
        return self(chunk)


def find_batch_size(forward: Any, make_batch: Any, start: int, maximum: int) -> int:
    """The largest batch size from ``start`` upwards (doubling, at most ``maximum``) that runs without running out
    of memory, as lm-evaluation-harness's ``batch_size=auto``; below ``start`` (halving) when ``start`` itself does
    not fit. Only out-of-memory errors are caught.

    Args:
        forward: runs the model on a batch.
        make_batch: ``make_batch(n)`` returns a batch of ``n`` inputs of the real shape, dtype and layout.
        start: the first size tried (``--batch-size``).
        maximum: the largest size tried (``--max-batch-size``).
    """

    def fits(size: int) -> bool:
        try:
            forward(make_batch(size))
            return True
        except (torch.OutOfMemoryError, RuntimeError) as error:
            if not is_oom_error(error):
                raise
            _release_cached_memory()
            return False

    size = start
    while not fits(size):
        if size == 1:
            raise RuntimeError("out of memory with a batch of one image: the model does not fit on this device")
        size //= 2
    if size < start:
        return size
    while size * 2 <= maximum and fits(size * 2):
        size *= 2
    return size


def _torch_dtype(name: str) -> Any:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def configure_backends(device: Any, options: EvalOptions) -> dict[str, Any]:
    """On CUDA, cudnn.benchmark and TF32 matmuls as timm's validate.py sets them; returns what was set."""
    if device.type != "cuda":
        return {}
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = options.tf32
    torch.backends.cudnn.allow_tf32 = options.tf32
    return {"cudnn_benchmark": True, "tf32": options.tf32}


def release_shard_plan(release: Release, limit: int | None) -> list[dict[str, Any]]:
    """The shards to stream, in config order, each with its manifest hash and (under ``--limit``) how many of its
    first samples to score, so that each config contributes its first ``limit`` samples in shard order."""
    plan = []
    for config in release.configs:
        remaining = limit
        for path in release.shards[config]:
            entry = release.shard_entries.get(path, {})
            if remaining is not None and remaining <= 0:
                break
            samples = entry.get("samples")
            plan.append(
                {
                    "config": config,
                    "path": path,
                    "name": entry.get("path", path.name),
                    "sha256": entry.get("sha256"),
                    "samples": samples if isinstance(samples, int) else None,
                    "max_samples": remaining,
                }
            )
            if remaining is not None:
                remaining -= samples if isinstance(samples, int) else remaining
    return plan


def predict_release(
    model: Any,
    release: Release,
    data_config: dict[str, Any],
    options: EvalOptions,
    label_indices: list[int] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run ``model`` over every config of ``release``.

    Returns:
        One row per scored sample (metadata, ``p_gt``, ``correct1``, ``correct5``, ``top5`` and ``top5_prob``) and
        run figures: ``images`` (samples scored), ``forwarded`` (images run through the model: a byte-identical
        image with the same label is scored once), ``seconds``, ``images_per_second``, ``batch_size`` (after any search or
        out-of-memory retries), ``oom_retries``, ``backend`` (CUDA settings) and ``failures`` (samples that could not
        be read, each ``{"config", "shard", "key", "reason"}``).

    Raises:
        ReleaseIntegrityError: when a shard's bytes do not match the manifest (unless ``options.verify`` is off).
    """
    from timm.data import create_transform
    from tqdm.auto import tqdm

    device = torch.device(options.device)
    backend = configure_backends(device, options)
    # As timm's loader with its prefetcher: workers resize/crop to uint8 tensors (4x less to move between processes
    # and to the device), and the batch is normalised on the device in one op.
    transform = create_transform(**data_config, use_prefetcher=True)
    model_dtype = _torch_dtype(options.model_dtype)
    mean = torch.tensor([255.0 * m for m in data_config["mean"]], device=device).view(1, -1, 1, 1)
    std = torch.tensor([255.0 * s for s in data_config["std"]], device=device).view(1, -1, 1, 1)
    memory_format = torch.channels_last if options.channels_last else torch.contiguous_format
    # channels_last is what timm's validate.py --channels-last does: faster convolutions on CPU (oneDNN) and GPU
    model = model.to(device=device, dtype=model_dtype, memory_format=memory_format)
    if options.torchcompile:
        model = torch.compile(model, backend=options.torchcompile)
    autocast = (
        torch.autocast(device_type=device.type, dtype=_torch_dtype(options.amp_dtype))
        if options.amp
        else contextlib.nullcontext()
    )

    def run_model(images: Any) -> Any:
        with autocast:
            return model(images)

    batch_size = options.batch_size
    if options.auto_batch_size:
        shape = tuple(data_config["input_size"])

        def make_batch(n: int) -> Any:
            return torch.zeros((n, *shape), device=device, dtype=model_dtype).contiguous(memory_format=memory_format)

        with torch.inference_mode():
            batch_size = find_batch_size(run_model, make_batch, options.batch_size, options.max_batch_size)
        logger.info(
            "batch size search: %d (from %d, at most %d)", batch_size, options.batch_size, options.max_batch_size
        )

    plan = release_shard_plan(release, options.limit)
    dataset = ShardSampleDataset(
        [dict(p, sha256=p["sha256"] if options.verify else None) for p in plan],
        release.image_ext,
        transform,
        (int(data_config["input_size"][0]), *(int(v) for v in data_config["input_size"][1:])),
    )
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=options.workers,
        pin_memory=device.type == "cuda",
        persistent_workers=False,
    )
    forward = OOMRetryForward(run_model, batch_size, options.min_batch_size)
    index = torch.tensor(label_indices, device=device) if label_indices is not None else None
    rows: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    # An image scored once is not run again: a release holds byte-identical images under several configs (each chosen
    # counterfactual is also a row of its edit's strength sweep). Keyed by the encoded bytes and the label, a reused
    # score is the one the model gave those bytes; only its float rounding could differ in another batch.
    scored: dict[tuple[str, int], tuple[float, list[int], list[float]]] = {}
    forwarded = 0
    total = _planned_samples(plan, release)
    progress = tqdm(total=total or None, unit="img", desc="evaluating", disable=None, leave=False)
    start = time.perf_counter()
    with torch.inference_mode(), progress:
        for images, labels, configs, metas, problems, digests in loader:
            progress.update(len(labels))
            for i, problem in enumerate(problems):
                if problem.startswith(ShardSampleDataset.INTEGRITY_PREFIX):
                    raise ReleaseIntegrityError(problem.split(ShardSampleDataset.INTEGRITY_PREFIX, 1)[1])
                if problem:
                    meta = load_json(metas[i], "a sample's metadata")
                    logger.warning("sample failed: %s", problem)
                    failures.append(
                        {"config": configs[i], "shard": meta["shard"], "key": meta["key"], "reason": problem}
                    )
            good = [i for i, problem in enumerate(problems) if not problem]
            keys = {i: (digests[i], int(labels[i])) for i in good}
            new: dict[tuple[str, int], int] = {}  # first position in this batch of each image not scored before
            for i in good:
                if keys[i] not in scored:
                    new.setdefault(keys[i], i)
            if new:
                run = torch.tensor(list(new.values()))
                # the whole (pinned) batch goes to the device asynchronously; only then are the new images picked
                batch = images.to(device, non_blocking=True)
                if len(run) < len(labels):
                    batch = batch[run.to(device)]
                batch = batch.float().sub_(mean).div_(std)
                logits = forward(batch.to(model_dtype).contiguous(memory_format=memory_format))
                forwarded += len(run)
                if index is not None:
                    logits = logits.index_select(1, index)
                probs = logits.float().softmax(dim=1).cpu()
                top_prob, top_idx = probs.topk(min(TOPK, probs.shape[1]), dim=1)
                p_gt = probs.gather(1, labels[run].view(-1, 1)).squeeze(1)
                for j, key in enumerate(new):
                    scored[key] = (float(p_gt[j]), top_idx[j].tolist(), [float(p) for p in top_prob[j]])
            for i in good:
                meta = load_json(metas[i], "a sample's metadata")
                label = int(labels[i])
                p, top, top5_prob = scored[keys[i]]
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
                        "p_gt": p,
                        "correct1": top[0] == label,
                        "correct5": label in top,
                        "top5": top,
                        "top5_prob": top5_prob,
                        "strength": meta.get("strength"),
                        "counterfactual_key": meta.get("counterfactual_key"),
                        rf.JUDGE_CLASS_FIELD: meta.get(rf.JUDGE_CLASS_FIELD),
                    }
                )
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    timing = {
        "images": len(rows),
        "forwarded": forwarded,
        "seconds": round(seconds, 4),
        "images_per_second": round(len(rows) / seconds, 3) if seconds > 0 else None,
        "batch_size": forward.batch_size,
        "oom_retries": forward.retries,
        "backend": backend,
        "failures": failures,
    }
    return rows, timing


def _planned_samples(plan: list[dict[str, Any]], release: Release) -> int:
    total = 0
    for shard in plan:
        samples = release.shard_entries.get(shard["path"], {}).get("samples") or 0
        total += min(samples, shard["max_samples"]) if shard["max_samples"] is not None else samples
    return total


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


def tool_description() -> dict[str, str]:
    from importlib import metadata

    try:
        version = metadata.version("lance-counterfactuals")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {"name": "lance-counterfactuals", "version": version}


def run_key(release: Release, spec: ModelSpec, options: EvalOptions) -> str:
    """What decides whether existing results can be reused: model, release, weights, class map and every result
    option."""
    identity = {
        "model": spec.name,
        "release": release.manifest_sha256,
        "weights": spec.weights_id,
        "class_map_sha256": spec.class_map_sha256,
        "options": options.result_options(),
    }
    if spec.templates is not None:  # zero-shot: the prompts are part of the model
        identity["templates"] = spec.templates.digest
    return "sha256:" + hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def evaluate_model(
    release: Release,
    spec: ModelSpec,
    options: EvalOptions,
    edit_clusters: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Evaluate one model: the results dict (schema in docs/evaluation.md) and the per-sample prediction rows."""
    import timm
    from timm.data import resolve_data_config

    model = create_eval_model(spec, release)
    label_indices = resolve_label_indices(spec, model.num_classes, release.num_classes)
    data_config = resolve_data_config({}, model=model, use_test_size=True)
    logger.debug("%s: data config %s", spec.name, data_config)
    rows, timing = predict_release(model, release, data_config, options, label_indices)
    failures = timing.pop("failures")
    if not rows:
        raise ValueError(f"no sample of the release could be scored ({len(failures)} failed; first: {failures[0]})")
    # the selected registered metrics (evaluation.metric_registry), in registration order
    computed = compute_metrics(
        rows,
        release.label_names,
        n_boot=options.bootstrap,
        seed=options.seed,
        metrics=options.metrics,
        min_per_class=options.min_per_class,
        release_configs=list(release.configs),
        edit_clusters=edit_clusters,
        insight_top=options.insight_top,
        manifest=release.manifest,
        release_kind=release.kind.name,
    )
    results: dict[str, Any] = {
        "schema": RESULTS_SCHEMA,
        "schema_version": RESULTS_SCHEMA_VERSION,
        "status": "ok",
        "error": None,
        "tool": tool_description(),
        "model": {
            "name": spec.result_name,
            "slug": spec.slug,
            "weights": describe_weights(spec, model),
            "zero_shot": getattr(model, "zero_shot_info", None),
            "param_count": round(sum(p.numel() for p in model.parameters()) / 1e6, 3),
            "num_classes": model.num_classes,
            "class_map": spec.class_map.name if spec.class_map is not None else None,
            "class_map_sha256": spec.class_map_sha256,
            "data_config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in data_config.items()},
        },
        "release": release.describe(),
        "packages": package_versions()
        | {"timm": timm.__version__}
        | ({"open_clip": model.zero_shot_info["clip"]["open_clip"]} if spec.zero_shot else {}),
        "options": options.result_options(),
        "limit": options.limit,
        "run": {
            "key": run_key(release, spec, options),
            "device": options.device,
            "batch_size": options.batch_size,
            "auto_batch_size": options.auto_batch_size,
            "workers": options.workers,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "timing": timing,
        },
        "failures": failures,
        **computed,
    }
    return results, rows


def error_results(release: Release, spec: ModelSpec, options: EvalOptions, error: BaseException) -> dict[str, Any]:
    """The results dict of a model that failed to build or run: an error row for the leaderboard."""
    return {
        "schema": RESULTS_SCHEMA,
        "schema_version": RESULTS_SCHEMA_VERSION,
        "status": "error",
        "error": f"{type(error).__name__}: {error}",
        "tool": tool_description(),
        "model": {"name": spec.result_name, "slug": spec.slug, "weights": {"id": spec.weights_id}},
        "release": release.describe(),
        "packages": package_versions(),
        "options": options.result_options(),
        "limit": options.limit,
        "run": {"key": run_key(release, spec, options), "device": options.device},
    }


RELEASE_MARKER = "release.json"
RESULTS_NAME = "results.json"


def claim_release_folder(output_dir: Path, release: Release, force: bool = False) -> None:
    """Make ``output_dir`` (``OUTPUT/<release>/``) the results folder of ``release``, before any model runs.

    The folder records which release it holds (``release.json``: name, version, kind, manifest hash). Results of
    another release there (the same name rebuilt, or another release given the same label) are never replaced
    silently: without ``force`` that is a one-line ``ValueError``; with it the folder is emptied first, so that the
    two releases' results never mix. The caller holds the ``--output`` lock.
    """
    import shutil

    output_dir = Path(output_dir)
    marker = output_dir / RELEASE_MARKER
    mine = {k: v for k, v in release.describe().items() if k in ("name", "version", "kind", "manifest_sha256")}
    held = _read_json(marker) if marker.is_file() else None
    if held is None and output_dir.is_dir():  # written before folders recorded their release: ask its results
        found = [_read_json(p) for p in sorted(output_dir.glob(f"*/{RESULTS_NAME}"))]
        releases = {str((r.get("release") or {}).get("manifest_sha256")): r.get("release") or {} for r in found}
        held = next(iter(releases.values())) if len(releases) == 1 else ({"name": "(several)"} if releases else None)
    if held is not None:
        if held.get("manifest_sha256") != mine["manifest_sha256"]:
            if not force:
                raise ValueError(
                    f"{output_dir} holds the results of release {held.get('name')} {held.get('version')} "
                    f"({str(held.get('manifest_sha256'))[:12]}), not of {release.name} {release.version} "
                    f"({release.manifest_sha256[:12]}); evaluating here would replace them: give another --output, "
                    "or --force to replace them"
                )
            logger.warning(
                "--force: removing the results of release %s %s in %s",
                held.get("name"),
                held.get("version"),
                output_dir,
            )
            shutil.rmtree(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tmp = marker.with_name(f".{RELEASE_MARKER}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(mine, indent=2) + "\n", encoding="utf-8")
    tmp.replace(marker)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = read_json(path)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def results_path(output_dir: Path, spec: ModelSpec) -> Path:
    return Path(output_dir) / spec.slug / RESULTS_NAME


def is_done(path: Path, release: Release, spec: ModelSpec, options: EvalOptions) -> bool:
    """True when ``path`` holds successful results with the same run key: the same release (manifest hash), weights,
    class map and every option that changes results (:meth:`EvalOptions.result_options`)."""
    if not path.is_file():
        return False
    try:
        previous = read_json(path)
    except ValueError:
        return False
    if previous.get("status") != "ok" or (previous.get("run") or {}).get("key") != run_key(release, spec, options):
        return False
    # a metric whose version changed since (its numbers would differ) is computed again

    computed = previous.get("computed_metrics") or {}  # absent before results schema 3
    current = metric_versions([name for name in computed if name in METRICS])
    return all(current.get(name) == version for name, version in computed.items())


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False, allow_nan=False, default=_json_default) + "\n")
    tmp.replace(path)


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


@contextlib.contextmanager
def _quiet_root_logger():
    """Drop records logged on the root logger itself (third-party libraries that call ``logging.error``) for a while."""

    def drop_root(record: logging.LogRecord) -> bool:
        return record.name != "root"

    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(drop_root)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(drop_root)


def prepare_insights(release: Release, options: EvalOptions) -> dict[str, Any] | None:
    """The release's edit clusters, computed before any model runs, or ``None`` when the CLIP model cannot be loaded.

    Ranking does not need the insights: without their model the run goes on (recorded as a run without insights) and
    one warning line says what was skipped and how to get them.
    """
    try:
        with _quiet_root_logger():  # open_clip logs download failures on the root logger; our one line says it all
            return cluster_release_edits(release, options)
    except (OSError, RuntimeError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
        warn_insights_skipped(options, f"could not be loaded ({type(error).__name__}: {first_line})")
        return None


def warn_insights_skipped(options: EvalOptions, why: str) -> None:
    """The one line that says a run goes on without the insights (ranking does not need them), and how to get them."""
    if offline_by_user():  # the user switched the Hub off
        hint = "download it once with the Hub on (HF_HUB_OFFLINE unset)"
    else:
        hint = "download it once where the Hub answers (lance-cf models download eval ... lists the command)"
    logger.warning(
        "insights skipped: CLIP model %r (%s) %s; the models are scored and ranked without them. To compute them, %s "
        "or pass a local open_clip directory with --clip-model DIR; --no-insights skips them without this warning",
        options.clip_model,
        options.clip_pretrained or "no tag",
        why,
        hint,
    )


def _evaluate_and_write(
    release: Release, spec: ModelSpec, output_dir: Path, options: EvalOptions, edit_clusters: dict[str, Any] | None
) -> dict[str, Any]:
    """Evaluate one model and write its files; a model that fails gets an error results file. Returns its summary."""
    import pandas as pd

    path = results_path(output_dir, spec)
    try:
        results, rows = evaluate_model(release, spec, options, edit_clusters)
    except ReleaseIntegrityError:
        raise
    except Exception as error:  # a model that fails to build or run must not stop the others
        logger.error("%s: evaluation failed: %s", spec.name, error, exc_info=logger.isEnabledFor(logging.DEBUG))
        write_json(path, error_results(release, spec, options, error))
        return {"model": spec.name, "slug": spec.slug, "status": "error", "path": str(path), "error": str(error)}
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path.parent / "predictions.parquet", index=False)
    write_json(path, results)
    if results.get("strength"):
        try:
            plot_strength_model(results, path.parent / "strength.png")
        except Exception as error:  # a plot problem must not lose the computed results
            logger.error("%s: strength plot failed: %s", spec.name, error)
    if options.report:
        try:
            write_model_report(results, rows, release, path.parent, gallery_size=options.gallery_size)
        except Exception as error:  # a report problem must not lose the computed results
            logger.error("%s: report failed: %s", spec.name, error)
    return {"model": spec.name, "slug": spec.slug, "status": "ok", "path": str(path), "results": results}


def _device_worker(device: str, threads: int, tasks: Any, done: Any, release, output_dir, options, clusters) -> None:
    """One ``--devices`` worker process: evaluates the models it takes from ``tasks`` on its device."""

    torch.set_num_threads(threads)
    options = dataclasses.replace(options, device=device, devices=None)
    while True:
        spec = tasks.get()
        if spec is None:
            return
        try:
            done.put(_evaluate_and_write(release, spec, output_dir, options, clusters))
        except ReleaseIntegrityError as error:
            done.put({"model": spec.name, "slug": spec.slug, "status": "integrity", "error": str(error)})
        except BaseException as error:  # noqa: BLE001 - the parent must hear of it, not wait forever
            done.put(
                {"model": spec.name, "slug": spec.slug, "status": "error", "error": f"{type(error).__name__}: {error}"}
            )
            raise


def _run_parallel(release, specs, output_dir, options, clusters, on_result) -> list[dict[str, Any]]:
    """Evaluate ``specs`` on several devices at once: one worker process per device (``worker_context``: forked from
    a fork server that imported torch once, or spawned), models shared out first come first served. Each model's
    numbers are those of a single-device run (same code, same thread count)."""
    context = worker_context()
    tasks, done = context.Queue(), context.Queue()
    for spec in specs:
        tasks.put(spec)
    workers = []
    for device in options.devices[: len(specs)]:
        tasks.put(None)
        target, args = worker_entry(
            _device_worker, device, torch.get_num_threads(), tasks, done, release, output_dir, options, clusters
        )
        process = context.Process(
            target=target,
            args=args,
            daemon=False,  # a worker runs its own DataLoader worker processes
        )
        process.start()
        workers.append(process)
    summaries = []
    try:
        while len(summaries) < len(specs):
            try:
                summary = done.get(timeout=5)
            except Exception:  # queue.Empty: check that the workers are alive
                if not any(p.is_alive() for p in workers) and done.empty():
                    raise RuntimeError("evaluation worker processes exited without reporting every model") from None
                continue
            if summary["status"] == "integrity":
                raise ReleaseIntegrityError(summary["error"])
            summaries.append(summary)
            if on_result is not None:
                on_result(summary)
    finally:
        for process in workers:
            if len(summaries) < len(specs) and process.is_alive():  # stopped early (error or Ctrl-C)
                process.terminate()
            process.join()
    order = {spec.slug: i for i, spec in enumerate(specs)}
    return sorted(summaries, key=lambda s: order.get(s["slug"], len(order)))


def run_evaluation(
    release: Release,
    specs: list[ModelSpec],
    output_dir: Path,
    options: EvalOptions,
    on_result: Any = None,
) -> list[dict]:
    """Evaluate every model; a model that fails gets an error row and the others continue.

    Writes ``output_dir/<model slug>/results.json``, ``predictions.parquet`` and (unless disabled) ``report.html``, and
    ``output_dir/release.json`` naming the release (:func:`claim_release_folder`).
    Models whose results already exist with the same run key (:func:`run_key`) are skipped (``options.force`` re-runs).
    With ``options.devices`` naming several devices, models run in parallel, one worker process per device.

    Args:
        on_result: called with each model's summary as soon as it is done (in the calling process).

    Returns:
        One summary per model: ``{"model", "slug", "status", "path", "error", "results"}``; status is ok, error or
        skipped (``results`` for ok and skipped).

    Raises:
        ReleaseIntegrityError: a shard does not match the manifest (nothing is written for that model), or the
            release breaks its declared invariants (``rf.invariant_problems``; nothing is written).
        ValueError: ``output_dir`` holds another release's results (without ``options.force``).

    A CLIP model for the insights that cannot be loaded is one warning; the models are scored without insights.
    """
    output_dir = Path(output_dir)
    if options.verify:  # the release's declared invariants, before anything is written or loaded
        problems = rf.invariant_problems(release.root, links=True)  # a Hub release is read from the HF cache
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise ReleaseIntegrityError(
                f"release {release.spec} breaks its declared invariants: {problems[0]}{more}; run `lance-cf verify` "
                "on it and rebuild it, or pass --no-verify to score it anyway (recorded in the results)"
            )
    claim_release_folder(output_dir, release, options.force)
    summaries: list[dict[str, Any]] = []
    todo = []
    for spec in specs:
        path = results_path(output_dir, spec)
        if not options.force and is_done(path, release, spec, options):
            logger.info("%s: results with the same release, weights and options exist at %s; skipping", spec.name, path)
            summary = {"model": spec.name, "slug": spec.slug, "status": "skipped", "path": str(path)}
            summary["results"] = read_json(path)
            summaries.append(summary)
            if on_result is not None:
                on_result(summary)
        else:
            todo.append(spec)
    if not todo:
        return summaries

    # insights cluster the edits of a release whose kind lists them (LANCE, ControlNet); generated releases have none
    insights = (
        options.insights
        and metric_applies_to("insights", release.kind.name)
        and "insights" in select_metrics(options.metrics)
    )
    edit_clusters = prepare_insights(release, options) if insights else None
    if insights and edit_clusters is None:  # recorded (options, run key) as a run without insights
        options = dataclasses.replace(options, insights=False)
    if options.devices and len(options.devices) > 1 and len(todo) > 1:
        summaries += _run_parallel(release, todo, output_dir, options, edit_clusters, on_result)
    else:
        for spec in todo:
            summary = _evaluate_and_write(release, spec, output_dir, options, edit_clusters)
            summaries.append(summary)
            if on_result is not None:
                on_result(summary)
    order = {spec.slug: i for i, spec in enumerate(specs)}
    return sorted(summaries, key=lambda s: order.get(s["slug"], len(order)))
