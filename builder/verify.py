"""``lance-cf verify``: recompute every hash and count of a release and validate every sample's metadata.

Checks, in order: the manifest is canonical JSON whose ``manifest_sha256`` matches its content (so a flipped byte
anywhere in it is caught); every listed shard exists with the recorded size and sha256, and no unlisted shard sits
under ``data/``; every sample has exactly its image, label and metadata members, a valid key, metadata that passes the
JSON Schema and agrees with its label file, an image that decodes; per-shard and per-config counts (total, by edit
type, by class) match the manifest; derived samples point at an existing original; ``_info.json`` and the card's YAML
agree with the manifest.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from builder.release_format import (
    CARD_NAME,
    CONFIG_NAMES,
    DATA_DIR,
    LABEL_EXT,
    MANIFEST_NAME,
    METADATA_EXT,
    TIMM_INFO_NAME,
    card_configs,
    is_valid_key,
    metadata_json_schema,
    timm_info,
)

MAX_PROBLEMS = 50


class _Problems(list):
    def add(self, message: str) -> None:
        if len(self) < MAX_PROBLEMS:
            self.append(message)


def verify_release(release_dir: Path | str, *, check_images: bool = True) -> list[str]:
    """Return the release's problems, first found first; an empty list means the release is valid."""
    from builder.release import canonical_json, manifest_digest
    from builder.shards import file_sha256, read_shard

    root = Path(release_dir)
    problems = _Problems()
    manifest_path = root / MANIFEST_NAME
    if not manifest_path.is_file():
        return [f"{manifest_path}: missing"]
    raw = manifest_path.read_bytes()
    try:
        manifest = json.loads(raw)
    except ValueError as err:
        return [f"{MANIFEST_NAME}: not valid JSON ({err})"]
    if not isinstance(manifest, dict) or "shards" not in manifest or "configs" not in manifest:
        return [f"{MANIFEST_NAME}: not a lance-cf manifest (no shards/configs)"]
    if manifest.get("manifest_sha256") != manifest_digest(manifest):
        problems.add(f"{MANIFEST_NAME}: content does not match its manifest_sha256 (modified or corrupted)")
    if raw != canonical_json(manifest):
        problems.add(f"{MANIFEST_NAME}: bytes differ from the canonical encoding of its content (modified)")
    if problems:
        return list(problems)

    import jsonschema

    validator = jsonschema.Draft202012Validator(metadata_json_schema())
    image_ext = manifest.get("image_format", "png")
    expected_members = {image_ext, LABEL_EXT, METADATA_EXT}
    num_classes = manifest.get("label_space", {}).get("num_classes")

    listed = {s["path"] for s in manifest["shards"]}
    data_dir = root / DATA_DIR
    if data_dir.exists():
        for path in sorted(data_dir.rglob("*")):
            if path.is_file() and path.relative_to(root).as_posix() not in listed:
                problems.add(f"{path.relative_to(root).as_posix()}: file not listed in the manifest")

    seen_counts: dict[str, dict[str, Any]] = {}
    keys_by_config: dict[str, set[str]] = {c: set() for c in manifest["configs"]}
    derived_sources: list[tuple[str, str, str]] = []
    for shard in manifest["shards"]:
        config, rel = shard["config"], shard["path"]
        path = root / rel
        if config not in manifest["configs"]:
            problems.add(f"{rel}: config {config!r} is not among the manifest's configs")
            continue
        if not path.is_file():
            problems.add(f"{rel}: missing")
            continue
        digest, size = file_sha256(path)
        if size != shard["bytes"]:
            problems.add(f"{rel}: {size} bytes, manifest says {shard['bytes']}")
        if digest != shard["sha256"]:
            problems.add(f"{rel}: sha256 {digest[:16]}… does not match the manifest's {shard['sha256'][:16]}…")
            continue
        counts = seen_counts.setdefault(config, {"total": 0, "by_edit_type": {}, "by_class": {}})
        n = 0
        try:
            for key, members in read_shard(path):
                n += 1
                where = f"{rel}:{key}"
                if not is_valid_key(key):
                    problems.add(f"{where}: key has characters outside [A-Za-z0-9_-]")
                if set(members) != expected_members:
                    problems.add(f"{where}: members {sorted(members)}, expected {sorted(expected_members)}")
                    continue
                if key in keys_by_config[config]:
                    problems.add(f"{where}: duplicate key in config {config}")
                keys_by_config[config].add(key)
                try:
                    meta = json.loads(members[METADATA_EXT])
                except ValueError as err:
                    problems.add(f"{where}.json: not valid JSON ({err})")
                    continue
                error = next(iter(validator.iter_errors(meta)), None)
                if error is not None:
                    problems.add(f"{where}.json: {'/'.join(map(str, error.path)) or 'root'}: {error.message}")
                    continue
                if meta["key"] != key:
                    problems.add(f"{where}.json: key field {meta['key']!r} differs from the member name")
                try:
                    label = int(members[LABEL_EXT].decode())
                except ValueError:
                    problems.add(f"{where}.cls: not an integer")
                    continue
                if label != meta["label"]:
                    problems.add(f"{where}: .cls {label} differs from metadata label {meta['label']}")
                if num_classes is not None and not 0 <= label < num_classes:
                    problems.add(f"{where}: label {label} outside the label space [0, {num_classes})")
                if config == "original" and meta["source_key"] != key:
                    problems.add(f"{where}: an original's source_key must equal its key")
                if config != "original":
                    derived_sources.append((config, key, meta["source_key"]))
                if check_images:
                    problem = _check_image(members[image_ext])
                    if problem:
                        problems.add(f"{where}.{image_ext}: {problem}")
                edit_type = meta["edit_type"] or "none"
                counts["total"] += 1
                counts["by_edit_type"][edit_type] = counts["by_edit_type"].get(edit_type, 0) + 1
                counts["by_class"][str(label)] = counts["by_class"].get(str(label), 0) + 1
        except ValueError as err:
            problems.add(str(err))
            continue
        if n != shard["samples"]:
            problems.add(f"{rel}: {n} samples, manifest says {shard['samples']}")

    for config in manifest["configs"]:
        if config not in CONFIG_NAMES:
            problems.add(f"{MANIFEST_NAME}: unknown config {config!r}")
            continue
        expected = manifest.get("counts", {}).get(config)
        got = seen_counts.get(config, {"total": 0, "by_edit_type": {}, "by_class": {}})
        if expected is None:
            problems.add(f"{MANIFEST_NAME}: no counts for config {config}")
            continue
        for part in ("total", "by_edit_type", "by_class"):
            if expected.get(part) != got[part]:
                problems.add(f"{config}: {part} counted {got[part]}, manifest says {expected.get(part)}")
    if "original" in manifest["configs"]:
        originals = keys_by_config["original"]
        for config, key, source_key in derived_sources:
            if source_key not in originals:
                problems.add(f"{config}:{key}: source_key {source_key!r} has no original sample")

    info_path = root / TIMM_INFO_NAME
    try:
        if json.loads(info_path.read_bytes()) != timm_info(manifest):
            problems.add(f"{TIMM_INFO_NAME}: does not match the manifest's shards")
    except (OSError, ValueError) as err:
        problems.add(f"{TIMM_INFO_NAME}: unreadable ({err})")
    problems.extend(_check_card(root / CARD_NAME, manifest)[: MAX_PROBLEMS - len(problems)])
    return list(problems)


def _check_image(data: bytes) -> str | None:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
    except Exception as err:  # any decoder error means a broken image
        return f"does not decode ({err})"
    return None


def _check_card(path: Path, manifest: dict[str, Any]) -> list[str]:
    import yaml

    if not path.is_file():
        return [f"{CARD_NAME}: missing"]
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.startswith("---\n") or "\n---" not in text[4:]:
        return [f"{CARD_NAME}: no YAML front matter"]
    try:
        header = yaml.safe_load(text[4 : text.index("\n---", 4)])
    except yaml.YAMLError as err:
        return [f"{CARD_NAME}: YAML front matter does not parse ({err})"]
    configs = header.get("configs") if isinstance(header, dict) else None
    if configs != card_configs(manifest["configs"]):
        return [f"{CARD_NAME}: YAML configs do not match the manifest's configs"]
    return []
