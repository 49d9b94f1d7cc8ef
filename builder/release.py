"""Writing the release directory from a finished ledger: shards, ``_info.json``, ``manifest.json``, card."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

from builder.config import BuildConfig
from builder.ledger import Ledger
from builder.release_format import (
    CARD_NAME,
    DATA_DIR,
    FORMAT_VERSION,
    MANIFEST_NAME,
    TIMM_INFO_NAME,
    timm_info,
)
from builder.shards import ShardSample, group_into_shards, write_shard
from builder.sources import Source

logger = logging.getLogger(__name__)

TOOL_NAME = "lance-counterfactuals"
RECORDED_PACKAGES = (
    "lance-counterfactuals",
    "torch",
    "torchvision",
    "numpy",
    "pillow",
    "transformers",
    "diffusers",
    "open_clip_torch",
    "sentence-transformers",
    "peft",
    "timm",
    "datasets",
    "webdataset",
    "huggingface_hub",
    "safetensors",
)


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in RECORDED_PACKAGES:
        try:
            versions[name] = importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            continue
    return versions


def tool_version() -> str:
    try:
        return importlib_metadata.version(TOOL_NAME)
    except importlib_metadata.PackageNotFoundError:
        return "0+unknown"


def canonical_json(data: Any) -> bytes:
    return (json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n").encode()


def manifest_digest(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(canonical_json(body)).hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _Tally:
    """Counts of one config's samples: total, by edit type (``none`` for unedited) and by class."""

    def __init__(self) -> None:
        self.total = 0
        self.by_edit_type: dict[str, int] = {}
        self.by_class: dict[str, int] = {}

    def add(self, sample: ShardSample, meta_bytes: bytes) -> ShardSample:
        meta = json.loads(meta_bytes)
        edit_type = meta["edit_type"] or "none"
        self.by_edit_type[edit_type] = self.by_edit_type.get(edit_type, 0) + 1
        self.by_class[str(meta["label"])] = self.by_class.get(str(meta["label"]), 0) + 1
        self.total += 1
        return sample

    def to_dict(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "by_edit_type": dict(sorted(self.by_edit_type.items())),
            "by_class": dict(sorted(self.by_class.items(), key=lambda kv: int(kv[0]))),
        }


def write_release(
    output: Path,
    config: BuildConfig,
    config_hash: str,
    source: Source,
    ledger: Ledger,
    stage_info: dict[str, Any],
    build_record: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``build_record``: how the build ran (engine's ``build_record``: code allowed, threads, errors, version
    changes), stored under the manifest's ``build`` key."""
    shards: list[dict[str, Any]] = []
    counts: dict[str, Any] = {}
    for config_name in config.configs:
        tally = _Tally()
        samples = (
            tally.add(ShardSample(key, config.image_format, image, json.loads(meta)["label"], meta), meta)
            for key, _source_key, meta, image in ledger.iter_outputs(config_name)
        )
        for index, group in enumerate(group_into_shards(samples, config.shard_max_samples, config.shard_max_bytes)):
            shards.append(write_shard(output, config_name, index, group))
        counts[config_name] = tally.to_dict()
    clean_stale_shards(output, {s["path"] for s in shards})
    # A config with no sample (every edit refused, say) has no shard: `datasets` and timm cannot open an empty
    # split, so it is left out of the release's configs and named in `empty_configs` instead.
    present = [c for c in config.configs if counts[c]["total"] > 0]
    empty = [c for c in config.configs if counts[c]["total"] == 0]
    for config_name in empty:
        logger.warning(
            "config %s has no samples: it is left out of the release (see manifest empty_configs)", config_name
        )

    failures = [{"source_key": k, "stage": stage, "reason": reason} for k, stage, reason in ledger.failures()]
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "name": config.name,
        "version": config.version,
        "tool": {"name": TOOL_NAME, "version": tool_version()},
        "image_format": config.image_format,
        "configs": present,
        "empty_configs": empty,
        "config": config.to_dict(),
        "config_hash": config_hash,
        "seed": config.seed,
        "source": {**source.describe(), **({"license": config.license} if config.license else {})},
        "label_space": source.label_space.to_dict(),
        "stages": stage_info,
        "packages": package_versions(),
        "counts": {c: counts[c] for c in present},
        "failures": failures,
        "shards": shards,
    }
    if build_record is not None:
        manifest["build"] = build_record
    manifest["manifest_sha256"] = manifest_digest(manifest)
    _atomic_write(output / TIMM_INFO_NAME, canonical_json(timm_info(manifest)))
    _atomic_write(output / MANIFEST_NAME, canonical_json(manifest))
    write_card(output, manifest)
    logger.info(
        "release %s %s: %s; %d failure(s)",
        config.name,
        config.version,
        ", ".join(f"{c}={counts[c]['total']}" for c in config.configs),
        len(failures),
    )
    return manifest


def write_card(output: Path, manifest: dict[str, Any]) -> None:
    """Render the dataset card (dataset_cards), or a minimal valid card if the renderer is unavailable."""
    try:
        from dataset_cards import render_release_card
    except ImportError:
        render_release_card = None
    if render_release_card is not None:
        render_release_card(output, manifest)
        return
    import yaml

    from builder.release_format import card_configs, card_dataset_info

    header = {
        "pretty_name": manifest["name"],
        "tags": ["webdataset", "counterfactual", "robustness", "lance"],
        "configs": card_configs(manifest["configs"]),
        "dataset_info": card_dataset_info(manifest),
    }
    body = f"# {manifest['name']} {manifest['version']}\n\nA LANCE counterfactual release built by lance-cf.\n"
    _atomic_write(output / CARD_NAME, f"---\n{yaml.safe_dump(header, sort_keys=False)}---\n\n{body}".encode())


def clean_stale_shards(output: Path, keep: set[str]) -> None:
    """Remove shard files (and temporaries) that the current manifest does not list."""
    data = output / DATA_DIR
    if not data.exists():
        return
    for path in sorted(data.rglob("*")):
        if path.is_file() and path.relative_to(output).as_posix() not in keep:
            path.unlink()
    for path in sorted(data.glob("*"), reverse=True):
        if path.is_dir() and not any(path.iterdir()):
            shutil.rmtree(path)
