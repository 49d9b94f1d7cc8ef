"""Where things sit in a release directory, and what a sample key may be."""

from __future__ import annotations

import hashlib
import os
import re
import stat
from pathlib import Path

SPLIT = "test"
MANIFEST_NAME = "manifest.json"
CARD_NAME = "README.md"
TIMM_INFO_NAME = "_info.json"
DATA_DIR = "data"
ASSETS_DIR = "assets"  # card gallery images: hashed in the manifest (v2), not part of the data
# A release's record of an editor comparison (``lance-cf add-comparison``) and the card's plot of it (an asset).
EDITOR_COMPARISON = "editor_comparison"
COMPARISON_PLOT = f"{ASSETS_DIR}/editors-compared.png"
WORK_DIR = ".lance-cf"  # build work directory (ledger); never hashed, never published

# The members of one WebDataset sample: KEY.<ext>. The image extension is per release (lossless by default).
IMAGE_FORMATS = ("png", "webp")
DEFAULT_IMAGE_FORMAT = "png"
LABEL_EXT = "cls"
METADATA_EXT = "json"

KEY_PATTERN = re.compile(r"^[A-Za-z0-9_-]+$")
CONFIG_NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_]*$")


SHARD_DIGEST_CHARS = 16  # of the shard's sha256 in its name: 64 bits, no collision among a release's shards


def shard_path(config: str, index: int, sha256: str) -> str:
    """Path of a shard relative to the release root, e.g. ``data/counterfactual/test-000003-0123456789abcdef.tar``.

    The name carries the start of the shard's sha256, so that a path names one content. Readers that cache by path
    then never mix two releases (or two versions of one release): mlcroissant extracts an archive into a folder
    keyed by its ``contentUrl`` alone and reuses it in every later process.
    """
    return f"{DATA_DIR}/{config}/{SPLIT}-{index:06d}-{sha256[:SHARD_DIGEST_CHARS]}.tar"


def shard_glob(config: str) -> str:
    """The ``data_files`` pattern of a config in the card's YAML (the Hub resolves it; readers use the manifest)."""
    return f"{DATA_DIR}/{config}/{SPLIT}-*.tar"


def is_valid_key(key: str) -> bool:
    return bool(KEY_PATTERN.match(key))


def is_valid_config_name(name: str) -> bool:
    """A release config name: lower-case letters, digits and ``_``, starting with a letter (it names a folder)."""
    return bool(CONFIG_NAME_PATTERN.match(name))


def sanitize_key(text: str) -> str:
    """Map any source identifier to a key made only of ``[A-Za-z0-9_-]``.

    Characters outside the set become ``_``; a short stable hash is appended whenever that changed the text, so that
    two different identifiers never collide after sanitising (``a.b`` and ``a_b`` stay distinct).
    """
    cleaned = re.sub(r"[^A-Za-z0-9_-]", "_", text)
    if cleaned != text or not cleaned:
        cleaned = f"{cleaned}-{hashlib.sha256(text.encode('utf-8')).hexdigest()[:8]}"
    return cleaned


def listed_path_problem(root: Path, rel: str) -> str | None:
    """Why the path ``rel`` a manifest lists is not a regular file inside the release ``root``, or None.

    A listed path must be plain (relative, ``/``-separated, no ``.``, ``..`` or empty parts), must exist, must not
    pass through a symbolic link (a link can point anywhere: neither ``verify`` nor ``publish`` follows one), and
    must name a regular file. ``verify`` reports the problem, ``publish`` refuses with it.
    """
    # Split by hand: PurePosixPath would drop "." parts and empty ones ("a//b") before they could be refused.
    parts = rel.split("/")
    if rel.startswith("/") or "\\" in rel or any(part in ("", ".", "..") for part in parts):
        return f"manifest lists {rel!r}, which is not a plain path inside the release"
    current = root
    mode = 0
    for depth, part in enumerate(parts, start=1):
        current = current / part
        try:
            mode = os.lstat(current).st_mode
        except FileNotFoundError:
            return f"{rel} is listed in the manifest but missing"
        if stat.S_ISLNK(mode):
            where = rel if depth == len(parts) else "/".join(parts[:depth])
            return (
                f"{where} is a symbolic link; verify and publish never follow links (replace it with the file itself)"
            )
    if not stat.S_ISREG(mode):
        return f"{rel} is not a regular file"
    return None
