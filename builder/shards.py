"""Deterministic WebDataset shard writing.

Every tar header field that could vary between runs or machines is fixed (mtime 0, uid/gid 0, empty owner names,
mode 0644, GNU format, members in key order and, within a sample, in extension order), so the same samples always
give byte-identical shards. Shards are written to a temporary name and renamed into place, so a killed build never
leaves a half-written shard under its final name.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from builder.release_format import LABEL_EXT, METADATA_EXT, is_valid_key, shard_path


@dataclass(frozen=True)
class ShardSample:
    key: str
    image_ext: str
    image: bytes
    label: int
    metadata: bytes

    def members(self) -> list[tuple[str, bytes]]:
        members = [
            (f"{self.key}.{LABEL_EXT}", str(self.label).encode()),
            (f"{self.key}.{self.image_ext}", self.image),
            (f"{self.key}.{METADATA_EXT}", self.metadata),
        ]
        return sorted(members)

    @property
    def size(self) -> int:
        # tar: 512-byte header + data padded to 512 per member
        return sum(512 + -(-len(data) // 512) * 512 for _, data in self.members())


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


def group_into_shards(samples: Iterable[ShardSample], max_samples: int, max_bytes: int) -> Iterator[list[ShardSample]]:
    shard: list[ShardSample] = []
    size = 0
    for sample in samples:
        if shard and (len(shard) >= max_samples or size + sample.size > max_bytes):
            yield shard
            shard, size = [], 0
        shard.append(sample)
        size += sample.size
    if shard:
        yield shard


def write_shard(root: Path, config: str, index: int, samples: list[ShardSample]) -> dict:
    """Write one shard; return its manifest entry (config, path, sha256, bytes, samples)."""
    rel = shard_path(config, index)
    target = root / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "wb") as f:
        with tarfile.open(fileobj=f, mode="w", format=tarfile.GNU_FORMAT) as tar:
            for sample in samples:
                if not is_valid_key(sample.key):
                    raise ValueError(f"sample key {sample.key!r} has characters outside [A-Za-z0-9_-]")
                for name, data in sample.members():
                    tar.addfile(_tarinfo(name, len(data)), io.BytesIO(data))
        f.flush()
        os.fsync(f.fileno())
    digest, size = file_sha256(tmp)
    os.replace(tmp, target)
    return {
        "config": config,
        "path": rel,
        "sha256": digest,
        "bytes": size,
        "samples": len(samples),
    }


def file_sha256(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            size += len(block)
    return h.hexdigest(), size


def read_shard(path: Path) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Samples of a shard as (key, {ext: bytes}), in file order. Raises ValueError on a malformed shard."""
    current_key: str | None = None
    members: dict[str, bytes] = {}
    seen: set[str] = set()
    try:
        with tarfile.open(path, mode="r:") as tar:
            for info in tar:
                if not info.isfile():
                    raise ValueError(f"{path}: member {info.name!r} is not a regular file")
                key, dot, ext = info.name.partition(".")
                if not dot or "/" in info.name:
                    raise ValueError(f"{path}: member {info.name!r} is not KEY.EXT")
                if key != current_key:
                    if current_key is not None:
                        yield current_key, members
                    if key in seen:
                        raise ValueError(f"{path}: sample {key!r} is split across the shard")
                    seen.add(key)
                    current_key, members = key, {}
                f = tar.extractfile(info)
                members[ext] = f.read() if f else b""
    except tarfile.TarError as err:
        raise ValueError(f"{path}: not a valid tar archive ({err})") from err
    if current_key is not None:
        yield current_key, members
