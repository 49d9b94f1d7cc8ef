"""Writing the release directory from a finished ledger: shards, ``_info.json``, ``manifest.json``, card, and
``croissant.json`` with the metadata indexes it reads."""

from __future__ import annotations

import logging
import os
import platform
import shutil
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

from builder import release_format as rf
from builder.config import BuildConfig
from builder.croissant import write_release_croissant
from builder.ledger import Ledger
from builder.release_format import ShardSample, Tally, group_into_shards, write_shard
from builder.sources import Source
from dataset_cards import render_release_card, write_comparison_plot, write_gallery
from lance_pipeline.edit_types import release_edit_types
from lance_pipeline.release_kinds import kind_of_manifest
from lance_pipeline.stage import SCORE_NAMES

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
    "huggingface_hub",
    "safetensors",
    "pyarrow",  # writes the metadata indexes (index/<config>.parquet)
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


# The manifest's encoding and digest are the release format's; these names are kept for the builder's callers.
canonical_json = rf.canonical_json
manifest_digest = rf.manifest_digest


def _atomic_write(path: Path, data: bytes) -> None:
    """Write through a temporary file named by this process (never another writer's), removed by it on failure."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_release(
    output: Path,
    config: BuildConfig,
    config_hash: str,
    source: Source,
    ledger: Ledger,
    stage_info: dict[str, Any],
    build_record: dict[str, Any] | None = None,
    *,
    release_spec: rf.ReleaseSpec | None = None,
    screens: dict[str, tuple[type, tuple[Any, ...]]] | None = None,
) -> dict[str, Any]:
    """Write shards, gallery, ``_info.json``, ``manifest.json``, the card and ``croissant.json`` (with its metadata
    indexes) from a finished ledger.

    Args:
        build_record: how the build ran (engine's ``build_record``: code allowed, threads, errors, version changes),
            stored under the manifest's ``build`` key.
        release_spec: what the release declares (configs, extra metadata fields, vocabulary); by default the LANCE
            configs of ``config.configs`` with the method's edit types and score names.
        screens: the screening stages of the build (stage name -> (stage class, its ``OutputScreen``s)): the samples
            each removed become failures with their reasons, and what each decided goes under ``screening``.

    Returns:
        The manifest (as JSON data).
    """
    if release_spec is None:
        # The LANCE configs are described by the format; a config a stage declared without a ConfigSpec gets a
        # plain description and no extra metadata fields.
        declared = tuple(
            rf.ConfigSpec(c, f"samples of the {c} config (declared by a build stage's outputs)")
            for c in config.configs
            if c not in rf.CONFIG_NAMES
        )
        release_spec = rf.lance_release_spec(config.configs, release_edit_types(), SCORE_NAMES, extra=declared)
    spec = release_spec
    shards: list[rf.ShardRecord] = []
    counts: dict[str, Any] = {}
    invariants = rf.InvariantCheck(spec, config.configs)
    for config_name in config.configs:
        tally = Tally()

        def samples(config_name: str = config_name, tally: Tally = tally):
            for key, _source_key, meta_bytes, image in ledger.iter_outputs(config_name):
                meta = rf.decode_metadata(meta_bytes, spec, config_name)
                invariants.add(config_name, meta)
                tally.add(meta.label, meta.edit_type)
                yield ShardSample(key, config.image_format, image, meta.label, meta_bytes)

        groups = group_into_shards(samples(), config.shard_max_samples, config.shard_max_bytes)
        for index, group in enumerate(groups):
            shards.append(write_shard(output, config_name, index, group))
        counts[config_name] = tally.to_dict()
    clean_stale_shards(output, {s.path for s in shards})
    # A config with no sample (every edit refused, say) has no shard: `datasets` and timm cannot open an empty
    # split, so it is left out of the release's configs and named in `empty_configs` instead.
    present = [c for c in config.configs if counts[c]["total"] > 0]
    empty = [c for c in config.configs if counts[c]["total"] == 0]
    for config_name in empty:
        logger.warning(
            "config %s has no samples: it is left out of the release (see manifest empty_configs)", config_name
        )
    shard_dicts = [s.to_dict() for s in shards]
    failures = [{"source_key": k, "stage": stage, "reason": reason} for k, stage, reason in ledger.failures()]
    screening: dict[str, Any] = {}
    for stage_name, (cls, stage_screens) in (screens or {}).items():
        removed, summary = _screen_outcomes(ledger, stage_name, cls, stage_screens)
        failures += removed
        screening[stage_name] = summary
    # Stable: the ledger's failures keep their order; a screen's removals follow its other failures of a sample.
    failures.sort(key=lambda f: (f["source_key"], f["stage"]))
    manifest: dict[str, Any] = {
        "format_version": rf.FORMAT_VERSION,
        "name": config.name,
        "version": config.version,
        "tool": {"name": TOOL_NAME, "version": tool_version()},
        "image_format": config.image_format,
        "configs": present,
        "empty_configs": empty,
        "release_spec": spec.to_dict(),
        "config": config.public_dict(),
        "config_hash": config_hash,
        "seed": config.seed,
        # Config and source record the public spec (builder.sources.public_spec): no machine paths.
        "source": {**source.describe(), **({"license": config.license} if config.license else {})},
        "label_space": source.label_space.to_dict(),
        "stages": stage_info,
        "packages": package_versions(),
        "counts": {c: counts[c] for c in present},
        "failures": failures,
        "shards": shard_dicts,
    }
    if screening:
        manifest["screening"] = screening
    if build_record is not None:
        manifest["build"] = build_record
    # What the release is, recorded so that cards, eval and the leaderboard never have to guess it
    manifest["kind"] = kind_of_manifest(manifest).name
    seal_release(output, manifest, invariants)
    logger.info(
        "release %s %s: %s; %d failure(s)",
        config.name,
        config.version,
        ", ".join(f"{c}={counts[c]['total']}" for c in config.configs),
        len(failures),
    )
    return manifest


def seal_release(
    output: Path,
    manifest: dict[str, Any],
    invariants: rf.InvariantCheck,
    previous_manifest: dict[str, Any] | None = None,
) -> None:
    """Finish a release whose shards are written: the card's gallery and the editor comparison's plot where the
    manifest records one (hashed into ``assets``), the sealed manifest,
    ``_info.json`` and the card. ``manifest`` holds every other field; it is completed in place.

    Args:
        invariants: the check every written sample went through (``rf.InvariantCheck.add``): a release that breaks
            its declared invariants, or whose samples did not all go through it, is refused before its manifest is
            written (so no writer can publish what ``verify`` would refuse).
        previous_manifest: the release this one follows (``lance-cf review apply``), for the card's changelog.
    """
    invariants.check_complete({c: manifest["counts"][c]["total"] for c in manifest["configs"]})
    # The gallery in the order of the release's own edit types, as the card draws it: the card reuses these files
    # (and the plot) rather than drawing them again, so what the manifest hashes is what the card shows.
    edit_types = rf.release_spec_of(manifest).edit_types
    gallery = write_gallery(output, manifest["configs"], manifest["shards"], edit_types=edit_types)
    plot = write_comparison_plot(output, manifest)
    manifest["assets"] = []
    for entry in [*gallery, *plot]:
        digest, size = rf.file_sha256(output / entry["path"])
        manifest["assets"].append({"path": entry["path"], "sha256": digest, "bytes": size})
    manifest.pop("manifest_sha256", None)
    rf.seal_manifest(manifest)
    typed = rf.Manifest.from_dict(manifest)  # the writer checks its own output against the format
    _atomic_write(output / rf.TIMM_INFO_NAME, rf.canonical_json(rf.timm_info(typed)))
    _atomic_write(output / rf.MANIFEST_NAME, rf.canonical_json(manifest))
    render_release_card(output, manifest, previous_manifest=previous_manifest, written_assets=(gallery, plot))
    write_release_croissant(output, typed)


def _screen_outcomes(
    ledger: Ledger, stage: str, cls: type, screens: tuple[Any, ...]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(failures, summary) of a screening stage from its stored outputs: one failure per sample it removed, with its
    reason, and the stage's own count of what it decided (``cls.summarize``) plus the removals per field."""
    failures: list[dict[str, Any]] = []
    removed_counts: dict[str, int] = {}
    updates = []
    for key, update in ledger.iter_stage_structures(stage):
        updates.append(update)
        for screen in screens:
            if screen.removed is None:
                continue
            entries = update.get(screen.removed) or []
            removed_counts[screen.field] = removed_counts.get(screen.field, 0) + len(entries)
            failures += [{"source_key": key, "stage": stage, "reason": str(e["reason"])} for e in entries]
    summary: dict[str, Any] = {"fields": [s.field for s in screens], "removed": removed_counts}
    if hasattr(cls, "summarize"):
        summary.update(cls.summarize(updates))
    return failures, summary


def clean_stale_shards(output: Path, keep: set[str]) -> None:
    """Remove shard files (and temporaries) that the current manifest does not list."""
    data = output / rf.DATA_DIR
    if not data.exists():
        return
    for path in sorted(data.rglob("*")):
        if path.is_file() and path.relative_to(output).as_posix() not in keep:
            path.unlink()
    for path in sorted(data.glob("*"), reverse=True):
        if path.is_dir() and not any(path.iterdir()):
            shutil.rmtree(path)
