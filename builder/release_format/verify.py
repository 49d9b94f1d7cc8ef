"""``lance-cf verify``: recompute every hash and count of a release and validate every sample's metadata.

Checks, in order: the manifest is canonical JSON whose ``manifest_sha256`` matches its content (so a flipped byte
anywhere in it is caught) and has every required field; every listed shard exists with the recorded size and sha256,
and no unlisted file sits under ``data/``; every sample has exactly its image, label and metadata members, a valid
key, metadata that passes its config's JSON Schema and agrees with its label file, an image that decodes; per-shard and
per-config counts (total, by edit type, by class) match the manifest; derived samples point at an existing original;
``_info.json`` equals what the manifest implies; the card's YAML (configs, features, splits, counts, licence, the Hub's
metadata keys) equals what the manifest implies; and (format v2) every card asset the manifest records matches its hash
(other files under ``assets/`` are not part of the release: publish leaves them out and names them), every config's
metadata index holds exactly its shards' metadata, and ``croissant.json`` equals what the manifest implies.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

from builder.release_format.croissant import (
    CROISSANT_NAME,
    INDEX_DIR,
    check_croissant,
    index_path,
    index_schema,
    read_index_rows,
)
from builder.release_format.hub import card_yaml_expected, timm_info
from builder.release_format.layout import (
    CARD_NAME,
    DATA_DIR,
    LABEL_EXT,
    MANIFEST_NAME,
    METADATA_EXT,
    TIMM_INFO_NAME,
    is_valid_key,
    listed_path_problem,
)
from builder.release_format.manifest import (
    Manifest,
    ManifestError,
    Tally,
    canonical_json,
    first_difference,
    manifest_digest,
)
from builder.release_format.metadata import InvariantCheck, metadata_json_schema
from builder.release_format.shards import file_sha256, iter_shard
from builder.release_format.yaml_text import load_yaml
from lance_pipeline.readers import load_json, read_json

MAX_PROBLEMS = 50


class _Problems(list):
    def add(self, message: str) -> None:
        if len(self) < MAX_PROBLEMS:
            self.append(message)


def verify_release(release_dir: Path | str, *, check_images: bool = True) -> list[str]:
    """Return the release's problems, first found first; an empty list means the release is valid."""
    root = Path(release_dir)
    problems = _Problems()
    manifest_path = root / MANIFEST_NAME
    if not manifest_path.is_file():
        return [f"{manifest_path}: missing"]
    raw = manifest_path.read_bytes()
    try:
        data = load_json(raw, MANIFEST_NAME)
    except ValueError as err:
        return [str(err)]
    if not isinstance(data, dict) or "shards" not in data or "configs" not in data:
        return [f"{MANIFEST_NAME}: not a lance-cf manifest (no shards/configs)"]
    if data.get("manifest_sha256") != manifest_digest(data):
        problems.add(f"{MANIFEST_NAME}: content does not match its manifest_sha256 (modified or corrupted)")
    if raw != canonical_json(data):
        problems.add(f"{MANIFEST_NAME}: bytes differ from the canonical encoding of its content (modified)")
    if problems:
        return list(problems)
    try:
        manifest = Manifest.from_dict(data, where=MANIFEST_NAME)
    except ManifestError as err:
        return [str(err)]

    rows = _check_shards(root, manifest, problems, check_images)
    try:
        if read_json(root / TIMM_INFO_NAME, what=TIMM_INFO_NAME) != timm_info(manifest):
            problems.add(f"{TIMM_INFO_NAME}: does not match the manifest's shards")
    except (OSError, ValueError) as err:
        problems.add(f"{TIMM_INFO_NAME}: unreadable ({err})")
    for problem in _check_card(root / CARD_NAME, manifest) + _check_assets(root, manifest):
        problems.add(problem)
    for problem in _check_croissant(root, manifest, rows):
        problems.add(problem)
    return list(problems)


def _check_shards(
    root: Path, manifest: Manifest, problems: _Problems, check_images: bool
) -> dict[str, list[dict[str, Any]]]:
    """Check every shard; return each config's metadata objects in shard order (what its index must hold)."""
    import jsonschema

    spec = manifest.release_spec
    validators = {
        c: jsonschema.Draft202012Validator(metadata_json_schema(spec, c if manifest.format_version >= 2 else None))
        for c in manifest.configs
    }
    image_ext = manifest.image_ext
    expected_members = {image_ext, LABEL_EXT, METADATA_EXT}
    num_classes = manifest.num_classes

    listed = {s.path for s in manifest.shards}
    data_dir = root / DATA_DIR
    if data_dir.exists():
        for path in sorted(data_dir.rglob("*")):
            if (path.is_file() or path.is_symlink()) and path.relative_to(root).as_posix() not in listed:
                problems.add(f"{path.relative_to(root).as_posix()}: file not listed in the manifest")

    tallies: dict[str, Tally] = {}
    rows: dict[str, list[dict[str, Any]]] = {c: [] for c in manifest.configs}
    invariants = InvariantCheck(spec, manifest.configs, declared=manifest.format_version >= 2)
    for shard in manifest.shards:
        config, rel = shard.config, shard.path
        path = root / rel
        if config not in manifest.configs:
            problems.add(f"{rel}: config {config!r} is not among the manifest's configs")
            continue
        problem = listed_path_problem(root, rel)
        if problem is not None:  # outside the release, through a link, missing or not a file: never opened
            problems.add(problem)
            continue
        digest, size = file_sha256(path)
        if size != shard.bytes:
            problems.add(f"{rel}: {size} bytes, manifest says {shard.bytes}")
        if digest != shard.sha256:
            problems.add(f"{rel}: sha256 {digest[:16]}… does not match the manifest's {shard.sha256[:16]}…")
            continue
        tally = tallies.setdefault(config, Tally())
        validator = validators[config]
        n = 0
        try:
            for key, members in iter_shard(path):
                assert members is not None
                n += 1
                where = f"{rel}:{key}"
                if not is_valid_key(key):
                    problems.add(f"{where}: key has characters outside [A-Za-z0-9_-]")
                if set(members) != expected_members:
                    problems.add(f"{where}: members {sorted(members)}, expected {sorted(expected_members)}")
                    continue
                try:
                    meta = load_json(members[METADATA_EXT], f"{where}.json")
                except ValueError as err:
                    problems.add(str(err))
                    continue
                error = next(iter(validator.iter_errors(meta)), None)
                if error is not None:
                    problems.add(f"{where}.json: {'/'.join(map(str, error.path)) or 'root'}: {error.message}")
                    if isinstance(meta, dict):  # counted, and its declared invariants named by key too
                        invariants.add(config, meta, where)
                    continue
                rows[config].append(meta)
                invariants.add(config, meta, where)
                if meta["key"] != key:
                    problems.add(f"{where}.json: key field {meta['key']!r} differs from the member name")
                try:
                    label = int(members[LABEL_EXT].decode())
                except ValueError:
                    problems.add(f"{where}.cls: not an integer")
                    continue
                if label != meta["label"]:
                    problems.add(f"{where}: .cls {label} differs from metadata label {meta['label']}")
                if not 0 <= label < num_classes:
                    problems.add(f"{where}: label {label} outside the label space [0, {num_classes})")
                if check_images:
                    problem = _check_image(members[image_ext])
                    if problem:
                        problems.add(f"{where}.{image_ext}: {problem}")
                tally.add(label, meta["edit_type"])
        except ValueError as err:
            problems.add(str(err))
            continue
        if n != shard.samples:
            problems.add(f"{rel}: {n} samples, manifest says {shard.samples}")

    if not problems and not any(tally.total for tally in tallies.values()):
        problems.add("the release holds no samples (every config is empty): nothing to evaluate or publish")
    for config in manifest.configs:
        expected = manifest.counts[config]
        got = tallies.get(config, Tally()).to_dict()
        for part in ("total", "by_edit_type", "by_class"):
            if expected.get(part) != got[part]:
                problems.add(f"{config}: {part} counted {got[part]}, manifest says {expected.get(part)}")
    for problem in invariants.problems():
        problems.add(problem)
    return rows


def invariant_problems(release_dir: Path | str, *, links: bool = False) -> list[str]:
    """The breaches of the release's declared invariants (``InvariantCheck``), read from every listed shard's metadata
    only: what ``lance-cf eval`` checks before it scores a release (``verify`` checks them among everything else).
    Shards that cannot be read are named too. ``links``: shards may be links (a release in the Hugging Face cache,
    whose snapshot links every file to its blob), as long as their listed paths stay inside the release."""
    root = Path(release_dir)
    try:
        manifest = Manifest.from_dict(read_json(root / MANIFEST_NAME, what=MANIFEST_NAME), where=MANIFEST_NAME)
    except (OSError, ValueError) as err:
        return [f"{MANIFEST_NAME}: unreadable ({err})"]
    problems = _Problems()
    invariants = InvariantCheck(manifest.release_spec, manifest.configs, declared=manifest.format_version >= 2)
    for shard in manifest.shards:
        parts = Path(shard.path).parts
        problem = listed_path_problem(root, shard.path) if not links else None
        if links and (Path(shard.path).is_absolute() or ".." in parts or not (root / shard.path).is_file()):
            problem = f"{shard.path}: not a file inside the release"
        if problem is not None:
            problems.add(problem)
            continue
        try:
            for key, members in iter_shard(root / shard.path, wanted={METADATA_EXT}):
                where = f"{shard.path}:{key}"
                if not members or METADATA_EXT not in members:
                    problems.add(f"{where}: no metadata member")
                    continue
                try:
                    meta = load_json(members[METADATA_EXT], f"{where}.json")
                except ValueError as err:  # the one reader: a NaN or an infinity is refused here, naming the sample
                    problems.add(str(err))
                    continue
                if not isinstance(meta, dict):
                    problems.add(f"{where}.json: not a JSON object")
                    continue
                invariants.add(shard.config, meta, where)
        except ValueError as err:
            problems.add(str(err))
    for problem in invariants.problems():
        problems.add(problem)
    return list(problems)


def _check_image(data: bytes) -> str | None:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
    except Exception as err:  # any decoder error means a broken image
        return f"does not decode ({err})"
    return None


# A card's front matter: the YAML between a first line ``---`` and the next line ``---``.
_FRONT_MATTER = re.compile(r"---[ \t]*\n(.*?)\n---[ \t]*(?:\n|$)", re.DOTALL)


def split_card(text: str, origin: str = CARD_NAME) -> tuple[dict[str, Any], str]:
    """A card's YAML front matter (a mapping) and the Markdown after it (raises ValueError naming ``origin`` and what
    is wrong). ``f"---\\n{dump_yaml(front)}\\n---\\n{body}"`` writes it back."""
    match = _FRONT_MATTER.match(text)
    if match is None:
        raise ValueError(f"{origin}: no YAML front matter")
    header = load_yaml(match.group(1), f"{origin}: YAML front matter")
    if not isinstance(header, dict):
        raise ValueError(f"{origin}: YAML front matter is not a mapping")
    return header, text[match.end() :]


def read_card_yaml(path: Path) -> dict[str, Any]:
    """The YAML front matter of a card (raises ValueError naming what is wrong)."""
    if not path.is_file():
        raise ValueError(f"{CARD_NAME}: missing")
    return split_card(path.read_text(encoding="utf-8", errors="replace"))[0]


def _check_card(path: Path, manifest: Manifest) -> list[str]:
    try:
        header = read_card_yaml(path)
    except ValueError as err:
        return [str(err)]
    problems = []
    # A card may declare configs that are not the release's data (publish adds the `leaderboard` config, whose files
    # sit under results/): they are left out of the comparison, unless they point into data/.
    for entry in header.get("configs") or []:
        name = entry.get("config_name") if isinstance(entry, dict) else None
        paths = [f.get("path", "") for f in entry.get("data_files", []) if isinstance(f, dict)] if name else []
        if name not in manifest.configs and any(str(p).startswith(f"{DATA_DIR}/") for p in paths):
            problems.append(f"{CARD_NAME}: YAML config {name!r} points into {DATA_DIR}/ but is not in the manifest")
    for key in ("configs", "dataset_info"):
        if isinstance(header.get(key), list):
            header[key] = [
                e for e in header[key] if not isinstance(e, dict) or e.get("config_name") in manifest.configs
            ]
    expected_yaml = card_yaml_expected(manifest)
    if manifest.format_version < 2:  # v1 verified the card's configs and features; its licence keys were not checked
        expected_yaml = {k: v for k, v in expected_yaml.items() if k in ("configs", "dataset_info")}
    for key, expected in expected_yaml.items():
        if header.get(key) != expected:
            problems.append(f"{CARD_NAME}: YAML {key!r} {first_difference(header.get(key), expected, key)}")
    return problems


def _check_croissant(root: Path, manifest: Manifest, rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Format v2: every config's metadata index holds exactly its samples' metadata objects, in shard order, typed by
    the declaration; nothing else sits under ``index/``; ``croissant.json`` equals what the manifest implies."""
    if manifest.format_version < 2:
        return []
    problems = []
    indexes: dict[str, tuple[str, int]] = {}
    for config in manifest.configs:
        rel = index_path(config)
        path = root / rel
        if not path.is_file():
            problems.append(f"{rel}: missing (the metadata index croissant.json reads; rebuild the release)")
            continue
        indexes[config] = file_sha256(path)
        try:
            schema, got = read_index_rows(path)
        except ValueError as err:
            problems.append(f"{INDEX_DIR}/{err}")
            continue
        if not schema.equals(index_schema(manifest.release_spec, config), check_metadata=False):
            problems.append(f"{rel}: columns {schema.names} are not the declared metadata fields of config {config}")
        elif got != rows[config]:
            first = next(
                (i for i, (a, b) in enumerate(zip(got, rows[config], strict=False)) if a != b),
                min(len(got), len(rows[config])),
            )
            problems.append(
                f"{rel}: row {first} does not match the shards' metadata ({len(got)} rows, the shards hold "
                f"{len(rows[config])} samples)"
            )
    listed = {index_path(c) for c in manifest.configs}
    if (root / INDEX_DIR).is_dir():
        for path in sorted((root / INDEX_DIR).rglob("*")):
            if path.is_file() and path.relative_to(root).as_posix() not in listed:
                problems.append(f"{path.relative_to(root).as_posix()}: file not listed by the release's configs")
    path = root / CROISSANT_NAME
    if not path.is_file():
        return [*problems, f"{CROISSANT_NAME}: missing (a release built before croissant.json existed: rebuild it)"]
    try:
        document = read_json(path, what=CROISSANT_NAME)
    except ValueError as err:
        return [*problems, str(err)]
    if len(indexes) == len(manifest.configs):
        problems += check_croissant(document, manifest, indexes)
    return problems


def _check_assets(root: Path, manifest: Manifest) -> list[str]:
    if manifest.format_version < 2:
        return []
    problems = []
    recorded = {a.path: a for a in manifest.assets}
    for rel, asset in recorded.items():
        path = root / rel
        if not path.is_file():
            problems.append(f"{rel}: card asset missing")
            continue
        digest, size = file_sha256(path)
        if (digest, size) != (asset.sha256, asset.bytes):
            problems.append(f"{rel}: card asset does not match the sha256 the manifest records (modified)")
    return problems
