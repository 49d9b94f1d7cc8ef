"""``manifest.json``: the typed record of a release, its canonical encoding and its digest.

The manifest is canonical JSON (sorted keys, 2-space indent, UTF-8, trailing newline) sealed by ``manifest_sha256``,
the sha256 of the canonical JSON without that field. ``Manifest`` is its typed view: loading a manifest that lacks a
required field fails naming the field; top-level keys this code does not know are kept in ``extra`` and written back
unchanged, so the digest of a newer manifest still verifies.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from builder.release_format.layout import DEFAULT_IMAGE_FORMAT, MANIFEST_NAME
from builder.release_format.spec import V1_SPEC, ReleaseSpec
from lance_pipeline.readers import InputError, read_json

FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)


class ManifestError(ValueError):
    """A manifest that is not a readable lance-cf manifest (missing or mistyped field, unknown version)."""


def canonical_json(data: Any) -> bytes:
    """The one JSON encoding of manifests and ``_info.json``."""
    return (json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n").encode()


def first_difference(got: Any, expected: Any, where: str) -> str:
    """Where a value read from a release file (the card's YAML, ``croissant.json``) first differs from what the manifest
    implies, e.g. ``dataset_info[1].splits[0].num_examples is 5, the manifest implies 6``."""
    if isinstance(got, dict) and isinstance(expected, dict):
        for key in [*expected, *[k for k in got if k not in expected]]:
            if got.get(key) != expected.get(key):
                return first_difference(got.get(key), expected.get(key), f"{where}.{key}")
    if isinstance(got, list) and isinstance(expected, list) and len(got) == len(expected):
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            if a != b:
                return first_difference(a, b, f"{where}[{i}]")
    shown = json.dumps(got, ensure_ascii=False)
    shown = shown if len(shown) < 80 else shown[:77] + "..."
    return f"does not match the manifest: {where} is {shown}, the manifest implies {json.dumps(expected)[:80]}"


def manifest_digest(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(canonical_json(body)).hexdigest()


def seal_manifest(manifest: dict[str, Any]) -> dict[str, Any]:
    """Set ``manifest_sha256`` (in place) and return the manifest."""
    manifest["manifest_sha256"] = manifest_digest(manifest)
    return manifest


@dataclass(frozen=True)
class ShardRecord:
    """One shard as the manifest lists it."""

    config: str
    path: str
    sha256: str
    bytes: int
    samples: int

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class AssetRecord:
    """A card asset (gallery image) with its hash (format v2)."""

    path: str
    sha256: str
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Tally:
    """Counts of one config's samples: total, by edit type (``none`` for unedited) and by class (label as string).

    The only counting of a release: the writer fills it as it writes shards, ``verify`` as it reads them back.
    """

    def __init__(self) -> None:
        self.total = 0
        self.by_edit_type: dict[str, int] = {}
        self.by_class: dict[str, int] = {}

    def add(self, label: int, edit_type: str | None) -> None:
        edit = edit_type or "none"
        self.by_edit_type[edit] = self.by_edit_type.get(edit, 0) + 1
        self.by_class[str(label)] = self.by_class.get(str(label), 0) + 1
        self.total += 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "by_edit_type": dict(sorted(self.by_edit_type.items())),
            "by_class": dict(sorted(self.by_class.items(), key=lambda kv: int(kv[0]))),
        }


@dataclass
class Manifest:
    """Typed view of ``manifest.json``. Required fields are those every v1 manifest has; v2 adds the declaration."""

    format_version: int
    name: str
    version: str
    tool: dict[str, Any]
    image_format: str
    configs: list[str]
    config: dict[str, Any]
    config_hash: str
    seed: int
    source: dict[str, Any]
    label_space: dict[str, Any]
    stages: dict[str, Any]
    packages: dict[str, Any]
    counts: dict[str, dict[str, Any]]
    failures: list[dict[str, Any]]
    shards: list[ShardRecord]
    manifest_sha256: str
    empty_configs: list[str] = field(default_factory=list)
    release_spec: ReleaseSpec = V1_SPEC
    assets: list[AssetRecord] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] | None = field(default=None, repr=False, compare=False)  # the dict it was read from

    # ------------------------------------------------------------------------------------------------------ reading
    @classmethod
    def from_dict(cls, data: Any, where: str = MANIFEST_NAME) -> Manifest:
        """Validate a manifest dict. Raises ``ManifestError`` naming the first missing or mistyped field."""
        if not isinstance(data, dict):
            raise ManifestError(f"{where}: not a JSON object")
        version = data.get("format_version")
        if version not in READABLE_FORMAT_VERSIONS:
            raise ManifestError(
                f"{where}: format_version {version!r} is not one this tool reads ({list(READABLE_FORMAT_VERSIONS)})"
                + ("; upgrade lance-counterfactuals" if isinstance(version, int) and version > FORMAT_VERSION else "")
            )
        known = {f.name for f in fields(cls)} - {"extra", "raw"}
        optional = {"empty_configs", "release_spec", "assets"}
        required_v2 = {"release_spec", "assets"} if version >= 2 else set()
        types = {
            "name": str, "version": str, "tool": dict, "image_format": str, "configs": list, "config": dict,
            "config_hash": str, "seed": int, "source": dict, "label_space": dict, "stages": dict, "packages": dict,
            "counts": dict, "failures": list, "shards": list, "manifest_sha256": str, "empty_configs": list,
            "release_spec": dict, "assets": list,
        }  # fmt: skip
        for name in sorted(known - {"format_version"}):
            if name not in data:
                if name in optional and name not in required_v2:
                    continue
                raise ManifestError(f"{where}: required field {name!r} is missing")
            if not isinstance(data[name], types[name]) or isinstance(data[name], bool):
                raise ManifestError(
                    f"{where}: field {name!r} is {type(data[name]).__name__}, expected {types[name].__name__}"
                )
        for name in ("spec", "kind", "num_samples"):
            if name not in data["source"]:
                raise ManifestError(f"{where}: required field 'source.{name}' is missing")
        if not isinstance(data["label_space"].get("names"), list):
            raise ManifestError(f"{where}: required field 'label_space.names' is missing")
        if "name" not in data["label_space"]:
            raise ManifestError(f"{where}: required field 'label_space.name' is missing")
        try:
            spec = release_spec_of(data)
            shards = [ShardRecord(**s) for s in data["shards"]]
            assets = [AssetRecord(**a) for a in data.get("assets", [])]
        except (TypeError, KeyError, ValueError) as err:
            raise ManifestError(f"{where}: malformed release_spec, shards or assets ({err})") from err
        for config in data["configs"]:
            if config not in spec.names:
                raise ManifestError(f"{where}: config {config!r} is not declared (declared: {', '.join(spec.names)})")
            if config not in data["counts"]:
                raise ManifestError(f"{where}: required field 'counts.{config}' is missing")
        values = {name: data[name] for name in known if name in data and name not in ("shards", "assets")}
        values.update(release_spec=spec, shards=shards, assets=assets)
        values["extra"] = {k: v for k, v in data.items() if k not in known}
        return cls(**values, raw=data)

    def to_dict(self) -> dict[str, Any]:
        """The manifest as JSON data (what ``manifest.json`` holds)."""
        out: dict[str, Any] = dict(self.extra)
        for f in fields(self):
            if f.name in ("extra", "raw"):
                continue
            value = getattr(self, f.name)
            if f.name == "shards" or f.name == "assets":
                if f.name == "assets" and self.format_version < 2:
                    continue
                value = [item.to_dict() for item in value]
            elif f.name == "release_spec":
                if self.format_version < 2:
                    continue
                value = value.to_dict()
            out[f.name] = value
        return out

    # ------------------------------------------------------------------------------------------------------ helpers
    @property
    def label_names(self) -> list[str]:
        return list(self.label_space["names"])

    @property
    def num_classes(self) -> int:
        return int(self.label_space.get("num_classes", len(self.label_names)))

    def shards_of(self, config: str) -> list[ShardRecord]:
        return [s for s in self.shards if s.config == config]

    @property
    def image_ext(self) -> str:
        return self.image_format or DEFAULT_IMAGE_FORMAT


def release_spec_of(data: dict[str, Any]) -> ReleaseSpec:
    """The release declaration a manifest (as JSON data) records, or v1's for a manifest from before declarations."""
    return ReleaseSpec.from_dict(data["release_spec"]) if "release_spec" in data else V1_SPEC


def read_manifest_dict(path: Path | str) -> dict[str, Any]:
    """``manifest.json`` (of a release directory or the file itself) as a validated dict, exactly as stored."""
    return load_manifest(path).raw or {}


def load_manifest(path: Path | str) -> Manifest:
    """``manifest.json`` (of a release directory or the file itself) as a validated ``Manifest``.

    Raises:
        ManifestError: the file is missing, not JSON, or lacks a required field (named in the message).
    """
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(f"{path}: missing; is this a lance-cf release directory?")
    try:
        data = read_json(path)
    except InputError as err:
        raise ManifestError(str(err)) from None
    return Manifest.from_dict(data, where=str(path))
