"""Read a LANCE counterfactual release: a local directory or a Hub dataset ``ORG/NAME[@REVISION]``.

Only the release format (:mod:`builder.release_format`) is used: ``manifest.json`` for the name, version, hash, label
space and shard list, and the WebDataset shards ``data/CONFIG/test-NNNNNN.tar`` whose samples hold ``KEY.<image>``,
``KEY.cls`` and ``KEY.json``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builder import release_format as rf

logger = logging.getLogger(__name__)

_HUB_SPEC = re.compile(r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*)(?:@(?P<revision>[^@\s]+))?$")


@dataclass
class Release:
    """A release on local disk (downloaded first when it came from the Hub)."""

    root: Path
    manifest: dict[str, Any]
    spec: str
    revision: str | None = None
    shards: dict[str, list[Path]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.manifest["name"]

    @property
    def version(self) -> str:
        return self.manifest["version"]

    @property
    def manifest_sha256(self) -> str:
        return self.manifest["manifest_sha256"]

    @property
    def configs(self) -> list[str]:
        return [c for c in rf.CONFIG_NAMES if c in self.shards]

    @property
    def image_ext(self) -> str:
        return self.manifest.get("image_format", rf.DEFAULT_IMAGE_FORMAT)

    @property
    def label_names(self) -> list[str]:
        return list(self.manifest.get("label_space", {}).get("names") or [])

    @property
    def num_classes(self) -> int | None:
        space = self.manifest.get("label_space") or {}
        if space.get("num_classes") is not None:
            return int(space["num_classes"])
        return len(space["names"]) if space.get("names") else None

    def label_name(self, label: int) -> str:
        names = self.label_names
        return names[label] if 0 <= label < len(names) else str(label)

    def describe(self) -> dict[str, Any]:
        """What the results JSON records about the release."""
        space = self.manifest.get("label_space") or {}
        return {
            "name": self.name,
            "version": self.version,
            "manifest_sha256": self.manifest_sha256,
            "config_hash": self.manifest.get("config_hash"),
            "source": self.spec,
            "revision": self.revision,
            "configs": self.configs,
            "label_space": {"name": space.get("name"), "num_classes": self.num_classes},
        }


def open_release(spec: str | Path, revision: str | None = None) -> Release:
    """Open a release from a local directory or a Hub dataset.

    Args:
        spec: a local release directory, or a Hub dataset id ``ORG/NAME`` optionally followed by ``@REVISION``
            (a tag such as ``v1.0.0``, a branch or a commit).
        revision: Hub revision; overrides one given in ``spec``.

    Returns:
        The release, with its manifest read and its shards listed per config.

    Raises:
        ValueError: when ``spec`` is neither an existing release directory nor a Hub dataset id, or the release has
            no manifest or no shards.
    """
    spec_str = str(spec)
    path = Path(spec_str).expanduser()
    if path.is_dir():
        root = path
    else:
        match = _HUB_SPEC.match(spec_str)
        if match is None or spec_str.startswith((".", "/", "~")):
            raise ValueError(
                f"release {spec_str!r} is neither an existing directory nor a Hub dataset id 'ORG/NAME[@REVISION]'"
            )
        revision = revision or match.group("revision")
        root = _download(match.group("repo"), revision)
    manifest_path = root / rf.MANIFEST_NAME
    if not manifest_path.is_file():
        raise ValueError(
            f"release {spec_str!r} has no {rf.MANIFEST_NAME} at {manifest_path}; is it a lance-cf release?"
        )
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    if manifest.get("format_version") != rf.FORMAT_VERSION:
        raise ValueError(
            f"release {spec_str!r} has format_version {manifest.get('format_version')!r}; "
            f"this evaluator reads format_version {rf.FORMAT_VERSION}"
        )
    release = Release(root=root, manifest=manifest, spec=spec_str, revision=revision)
    release.shards = _list_shards(root, manifest)
    if not release.shards:
        raise ValueError(f"release {spec_str!r} lists no shards under {root / rf.DATA_DIR}")
    logger.info(
        "release %s %s: %s",
        release.name,
        release.version,
        ", ".join(f"{c} ({len(release.shards[c])} shards)" for c in release.configs),
    )
    return release


def _download(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    # HF_ENDPOINT is read now, not when huggingface_hub was imported (as `lance-cf publish` does), so a self-hosted
    # hub set later in the same process is honoured.
    endpoint = os.environ.get("HF_ENDPOINT", "").rstrip("/") or constants.ENDPOINT
    logger.info("downloading dataset %s@%s from %s", repo_id, revision or "main", endpoint)
    where = f"dataset {repo_id!r} on {endpoint}"
    try:
        local = snapshot_download(
            repo_id=repo_id,
            repo_type="dataset",
            revision=revision,
            endpoint=endpoint,
            allow_patterns=[rf.MANIFEST_NAME, rf.TIMM_INFO_NAME, rf.CARD_NAME, f"{rf.DATA_DIR}/*/{rf.SPLIT}-*.tar"],
        )
    # A wrong id or revision is a bad input: one clear line, not a traceback (GatedRepoError is a kind of
    # RepositoryNotFoundError, so it comes first).
    except GatedRepoError as error:
        raise ValueError(
            f"release {where} is gated: accept its terms on the Hub, then log in (HF_TOKEN or `hf auth login`)"
        ) from error
    except RevisionNotFoundError as error:
        raise ValueError(
            f"release {where} has no revision {revision!r} (a tag such as v1.0.0, a branch or a commit)"
        ) from error
    except RepositoryNotFoundError as error:
        raise ValueError(
            f"release {where} does not exist, or is private and needs a token (HF_TOKEN or `hf auth login`)"
        ) from error
    return Path(local)


def _list_shards(root: Path, manifest: dict[str, Any]) -> dict[str, list[Path]]:
    shards: dict[str, list[Path]] = {}
    listed = manifest.get("shards") or []
    for entry in listed:
        if entry.get("samples", 1) == 0:
            continue
        shard = root / entry["path"]
        if not shard.is_file():
            raise ValueError(f"release shard {entry['path']} listed in the manifest is missing under {root}")
        shards.setdefault(entry["config"], []).append(shard)
    if not listed:  # tolerate a manifest without a shard list: fall back to the documented layout
        for config in rf.CONFIG_NAMES:
            found = sorted(root.glob(rf.shard_glob(config)))
            if found:
                shards[config] = found
    return {c: sorted(shards[c]) for c in rf.CONFIG_NAMES if c in shards}


def iter_shard_samples(
    path: Path, image_ext: str, select: Any = None, start_index: int = 0
) -> Iterator[tuple[int, dict[str, bytes] | None]]:
    """Yield ``(index, {ext: bytes})`` for each sample of one WebDataset shard, in shard order.

    Args:
        path: the shard.
        image_ext: the release's image extension.
        select: optional predicate on the running sample index; an unselected sample is yielded as ``(index, None)``
            without reading its bytes (the tar file is seeked past them), which lets DataLoader workers stride over
            a shard.
        start_index: index given to the shard's first sample.
    """
    wanted = {image_ext, rf.LABEL_EXT, rf.METADATA_EXT}
    index = start_index - 1
    current_key: str | None = None
    sample: dict[str, bytes] = {}
    keep = False
    with tarfile.open(path, mode="r") as tar:
        for member in tar:
            if not member.isfile():
                continue
            name = member.name.rsplit("/", 1)[-1]
            key, _, ext = name.partition(".")
            if key != current_key:
                if current_key is not None:
                    yield index, (sample if keep else None)
                current_key, sample = key, {}
                index += 1
                keep = select is None or select(index)
            if keep and ext in wanted:
                handle = tar.extractfile(member)
                assert handle is not None
                sample[ext] = handle.read()
        if current_key is not None:
            yield index, (sample if keep else None)


def read_samples(release: Release, config: str, keys: set[str] | None = None) -> dict[str, dict[str, bytes]]:
    """Read whole samples of one config (optionally only ``keys``) into memory: used for report galleries.

    Member names are ``KEY.ext``, so unwanted samples are skipped from their tar headers without reading their bytes.
    """
    out: dict[str, dict[str, bytes]] = {}
    for shard in release.shards.get(config, []):
        with tarfile.open(shard, mode="r") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, _, ext = member.name.rsplit("/", 1)[-1].partition(".")
                if keys is not None and key not in keys:
                    continue
                handle = tar.extractfile(member)
                assert handle is not None
                out.setdefault(key, {})[ext] = handle.read()
    return out
