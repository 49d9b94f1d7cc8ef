"""Read a LANCE counterfactual release: a local directory or a Hub dataset ``ORG/NAME[@REVISION]``.

Only the release format (:mod:`builder.release_format`) is used: ``manifest.json`` for the name, version, hash, label
space and shard list, and the WebDataset shards ``data/CONFIG/test-NNNNNN.tar`` whose samples hold ``KEY.<image>``,
``KEY.cls`` and ``KEY.json``, read by the format's one shard reader (``rf.iter_shard``, ``rf.read_samples``).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builder import release_format as rf
from lance_pipeline.models.hub_cache import offline_by_user
from lance_pipeline.release_kinds import ReleaseKind, kind_of_manifest

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
    # the manifest's entry (path, sha256, samples) of every listed shard, by its local path
    shard_entries: dict[Path, dict[str, Any]] = field(default_factory=dict)

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
        return [c for c in self.manifest["configs"] if c in self.shards]

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

    @property
    def kind(self) -> ReleaseKind:
        """What the release is (``lance_pipeline.release_kinds``): recorded in its manifest, or recognised."""
        return kind_of_manifest(self.manifest)

    def label_name(self, label: int) -> str:
        names = self.label_names
        return names[label] if 0 <= label < len(names) else str(label)

    @property
    def source_name(self) -> str:
        """Where the release came from without the machine's paths: the Hub id, or the local directory's name."""
        if self.revision is not None or not Path(self.spec).expanduser().is_dir():
            return _HUB_SPEC.sub(lambda m: m.group("repo"), self.spec)
        return Path(self.spec).expanduser().resolve().name

    def describe(self) -> dict[str, Any]:
        """What the results JSON records about the release (no absolute paths: results are published)."""
        space = self.manifest.get("label_space") or {}
        tool = self.manifest.get("tool") or {}
        return {
            "name": self.name,
            "version": self.version,
            "kind": self.kind.name,
            "manifest_sha256": self.manifest_sha256,
            "config_hash": self.manifest.get("config_hash"),
            "built_with": {"name": tool.get("name"), "version": tool.get("version")},
            "source": self.source_name,
            "revision": self.revision,
            "configs": self.configs,
            "label_space": {"name": space.get("name"), "num_classes": self.num_classes},
            # built with the demo's tiny random-weight models (demo:NAME): its edits are noise (plots say so)
            "demo_models": self.demo_models,
        }

    @property
    def demo_models(self) -> bool:
        stages = (self.manifest.get("config") or {}).get("stages") or []
        return any(str((s.get("options") or {}).get("model") or "").startswith("demo:") for s in stages)


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
    # The release format validates the manifest: any readable format version (v1 and v2), a missing field named.
    manifest = rf.read_manifest_dict(manifest_path)
    release = Release(root=root, manifest=manifest, spec=spec_str, revision=revision)
    try:
        release.kind  # noqa: B018 - a kind this installation does not know is one line now, not during a model's run
    except ValueError as error:
        raise ValueError(f"release {spec_str!r}: {error}") from None
    release.shard_entries = _list_shards(root, manifest, spec_str)
    release.shards = {}
    for path, entry in release.shard_entries.items():
        release.shards.setdefault(entry["config"], []).append(path)
    release.shards = {c: release.shards[c] for c in manifest["configs"] if c in release.shards}
    if not release.shards:
        raise ValueError(f"release {spec_str!r} lists no shards with samples in its {rf.MANIFEST_NAME}")
    logger.debug(
        "release %s %s: %s",
        release.name,
        release.version,
        ", ".join(f"{c} ({len(release.shards[c])} shards)" for c in release.configs),
    )
    return release


def _download(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    # HF_ENDPOINT is read now, not when huggingface_hub was imported (as `lance-cf publish` does), so a self-hosted
    # hub set later in the same process is honoured.
    endpoint = os.environ.get("HF_ENDPOINT", "").rstrip("/") or constants.ENDPOINT
    logger.debug("downloading dataset %s@%s from %s", repo_id, revision or "main", endpoint)
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
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as error:
        # offline mode (HF_HUB_OFFLINE) with nothing cached, or the Hub unreachable and nothing cached
        offline = offline_by_user()  # the user's HF_HUB_OFFLINE, not one this tool set while models load
        fix = "unset HF_HUB_OFFLINE to download it" if offline else "check the network or HF_ENDPOINT"
        why = "offline mode (HF_HUB_OFFLINE is set)" if offline else "the Hub is unreachable"
        raise ValueError(
            f"release {where} is not in the local cache and cannot be downloaded ({why}): {fix}, or pass a local "
            "release directory to --release"
        ) from error
    except (
        HfHubHTTPError,
        OSError,
        *_http_client_errors(),
    ) as error:  # connection refused, DNS, timeouts, server errors
        first = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"release {where} could not be downloaded ({type(error).__name__}: {first}); check the network or "
            "HF_ENDPOINT, or pass a local release directory to --release"
        ) from error
    return Path(local)


def _http_client_errors() -> tuple[type[BaseException], ...]:
    """The base error of whichever HTTP client huggingface_hub uses (httpx2, httpx or requests)."""
    import importlib

    for module, name in (("httpx2", "HTTPError"), ("httpx", "HTTPError"), ("requests", "RequestException")):
        try:
            return (getattr(importlib.import_module(module), name),)
        except (ImportError, AttributeError):
            continue
    return ()


def _list_shards(root: Path, manifest: dict[str, Any], spec: str) -> dict[Path, dict[str, Any]]:
    """The manifest's shard entries by local path, in config and shard order (empty shards left out).

    The manifest's list is the only source: its sha256 per shard is what evaluation checks the bytes against.
    """
    listed = manifest.get("shards")
    if not isinstance(listed, list) or not listed:
        raise ValueError(f"release {spec!r}: its {rf.MANIFEST_NAME} lists no shards; rebuild or re-download it")
    entries: dict[Path, dict[str, Any]] = {}
    for entry in sorted(
        listed,
        key=lambda e: (
            manifest["configs"].index(e["config"]) if e.get("config") in manifest["configs"] else len(listed),
            e.get("path", ""),
        ),
    ):
        if entry.get("config") not in manifest["configs"] or entry.get("samples", 1) == 0:
            continue
        shard = root / entry["path"]
        if not shard.is_file():
            raise ValueError(f"release shard {entry['path']} listed in the manifest is missing under {spec}")
        entries[shard] = entry
    return entries


class ReleaseIntegrityError(ValueError):
    """A shard's bytes are not the ones the manifest sealed: the release was modified after it was built (the release
    format's ``ShardIntegrityError``, raised again with what evaluation can do about it)."""


def integrity_error(shard: str, error: rf.ShardIntegrityError) -> ReleaseIntegrityError:
    """The one-line error of a shard that does not match the manifest, with the ways out."""
    detail = str(error).split(": ", 1)[-1]
    return ReleaseIntegrityError(
        f"shard {shard} does not match the manifest ({detail}); run `lance-cf verify` on it, rebuild or re-download "
        "it, or pass --no-verify to score it anyway (recorded in the results)"
    )
