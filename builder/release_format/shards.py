"""The one shard writer and the one shard reader of the release format.

Shards are POSIX tar files (GNU format) with every header field that could vary between runs or machines fixed
(mtime 0, uid/gid 0, empty owner names, mode 0644), members in key order and, within a sample, in extension order,
so the same samples always give byte-identical shards. They are written to a temporary name and renamed into place,
so a killed build never leaves a half-written shard under its final name.

Why not webdataset's ``TarWriter`` / tar iterators: webdataset 1.0.2's ``TarWriter`` accepts a ``format`` argument but
does not pass it to ``tarfile.open``, so it writes PAX headers where releases have GNU ones (the bytes of every v1
shard would change), and ``import webdataset`` costs about 2 s (it imports torch), which the format unit must not. The
tar layout it reads (``KEY.EXT`` members, a sample's members adjacent) is exactly the one written here, and a test
reads a release back with webdataset (through timm) to prove it.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder.release_format.layout import DATA_DIR, LABEL_EXT, METADATA_EXT, SPLIT, is_valid_key, shard_path
from builder.release_format.manifest import ShardRecord


@dataclass(frozen=True)
class ShardSample:
    """One sample's members: the image (encoded), the label and the canonical metadata bytes."""

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


def write_shard(root: Path, config: str, index: int, samples: list[ShardSample]) -> ShardRecord:
    """Write one shard under ``root``; return its manifest record."""
    folder = Path(root) / DATA_DIR / config
    folder.mkdir(parents=True, exist_ok=True)
    # unique per writer: never another build's; named once its bytes (and so its digest) are known
    tmp = folder / f"{SPLIT}-{index:06d}.{os.getpid()}.tar.tmp"
    try:
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
        rel = shard_path(config, index, digest)
        os.replace(tmp, Path(root) / rel)
    finally:
        if tmp.exists():
            tmp.unlink()
    return ShardRecord(config=config, path=rel, sha256=digest, bytes=size, samples=len(samples))


def file_sha256(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            size += len(block)
    return h.hexdigest(), size


class ShardIntegrityError(ValueError):
    """A shard's bytes are not the ones the manifest sealed (checked while streaming, at no extra pass)."""


class HashingReader:
    """A read-only file wrapper that hashes every byte read through it (tar stream mode reads sequentially).

    The one streaming hash of a release's shards, used by :func:`iter_shard` (which evaluation reads through).
    """

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.digest = hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.digest.update(data)
        return data

    def drain(self) -> str:
        """Read (and hash) what is left; return the hex digest of the whole file."""
        while self.read(1 << 20):
            pass
        return self.digest.hexdigest()


@dataclass(frozen=True)
class UnreadableSample:
    """What :func:`iter_shard` yields, with ``errors="sample"``, for a sample it could not read (a truncated or
    corrupt shard, a malformed member): the reason, naming the shard. The shard ends there."""

    reason: str


class _MalformedShard(ValueError):
    """A member that a release's shard never holds (not a regular file, not ``KEY.EXT``, split or repeated)."""


def iter_shard(
    path: Path,
    *,
    wanted: set[str] | None = None,
    select: Callable[[int], bool] | None = None,
    start_index: int = 0,
    keys: set[str] | None = None,
    expected_sha256: str | None = None,
    limit: int | None = None,
    errors: str = "raise",
    name: str | None = None,
) -> Iterator[tuple[str, dict[str, bytes] | UnreadableSample | None]]:
    """Samples of a shard as ``(key, {ext: bytes})``, in file order, reading the file once.

    Args:
        path: the shard.
        wanted: extensions to read (all when ``None``); other members are skipped without reading their bytes.
        select: predicate on the running sample index (``start_index`` for the first); an unselected sample is
            yielded as ``(key, None)`` without reading its bytes, so DataLoader workers can stride over a shard.
        start_index: index of the shard's first sample.
        keys: when given, samples with other keys are yielded as ``(key, None)`` without reading their bytes.
        expected_sha256: the manifest's hash of the shard: the file is then streamed once, every byte hashed as it
            is read, and after the last sample a mismatch raises ``ShardIntegrityError`` (a modified release).
        limit: yield only the shard's first ``limit`` samples (evaluation's ``--limit``); with ``expected_sha256``
            the rest of the file is still read and hashed, without it reading stops there.
        errors: ``"raise"`` (verify, the builder): a problem is a ``ValueError``. ``"sample"`` (evaluation): the
            sample being read when the problem arose is yielded as ``(key, UnreadableSample(reason))`` (``(key,
            None)`` when it is not selected; key ``"?"`` before the first sample) and the shard ends there, so that
            those samples fail and the rest of the release is still scored; the hash is still checked.
        name: how messages name the shard (its path in the release); ``path`` by default.

    Raises:
        ValueError: (``errors="raise"``) naming the shard and member, for a member that is not a regular file or not
            ``KEY.EXT``, a sample split across the shard, a member given twice, or a file that is not a tar archive.
        ShardIntegrityError: the bytes do not have ``expected_sha256``.
    """
    if errors not in ("raise", "sample"):
        raise ValueError(f"errors must be 'raise' or 'sample', got {errors!r}")
    label = name or str(path)
    current_key: str | None = None
    members: dict[str, bytes] = {}
    seen: set[str] = set()
    got: set[str] = set()
    keep = True
    index = start_index - 1
    taken = 0
    with open(path, "rb") as raw:
        hashing = HashingReader(raw) if expected_sha256 is not None else None
        try:
            # "r|" streams the file once (every byte hashed); "r:" seeks past the bytes of members it skips.
            tar = tarfile.open(fileobj=hashing, mode="r|") if hashing else tarfile.open(fileobj=raw, mode="r:")
            with tar:
                for info in tar:
                    if not info.isfile():
                        raise _MalformedShard(f"member {info.name!r} is not a regular file")
                    key, dot, ext = info.name.partition(".")
                    if not dot or "/" in info.name:
                        raise _MalformedShard(f"member {info.name!r} is not KEY.EXT")
                    if key != current_key:
                        if current_key is not None:
                            yield current_key, (members if keep else None)
                            current_key = None
                        if limit is not None and taken >= limit:
                            break
                        if key in seen:
                            raise _MalformedShard(f"sample {key!r} is split across the shard")
                        seen.add(key)
                        current_key, members, got = key, {}, set()
                        index += 1
                        taken += 1
                        keep = (select is None or select(index)) and (keys is None or key in keys)
                    if ext in got:
                        raise _MalformedShard(f"member {info.name!r} appears twice")
                    got.add(ext)
                    if keep and (wanted is None or ext in wanted):
                        handle = tar.extractfile(info)
                        members[ext] = handle.read() if handle else b""
            if current_key is not None:
                yield current_key, (members if keep else None)
        except (tarfile.TarError, EOFError, OSError, _MalformedShard) as err:
            if isinstance(err, _MalformedShard):
                reason = f"shard {label}: {err}"
            else:
                reason = f"shard {label} is truncated or corrupt ({type(err).__name__}: {err or 'truncated'})"
            if errors == "raise":
                if isinstance(err, OSError) and not isinstance(err, tarfile.TarError):
                    raise
                raise ValueError(
                    f"{label}: {err}"
                    if isinstance(err, _MalformedShard)
                    else f"{label}: not a valid tar archive ({err or 'truncated'})"
                ) from err
            if current_key is not None:  # the sample being read fails (it belongs to whoever selected it)
                yield current_key, (UnreadableSample(reason) if keep else None)
            elif limit is None or taken < limit:
                following = (select is None or select(index + 1)) and keys is None
                yield "?", (UnreadableSample(reason) if following else None)
        if hashing is not None:
            digest = hashing.drain()
            if digest != expected_sha256:
                raise ShardIntegrityError(
                    f"{label}: sha256 {digest[:16]}… is not the manifest's {expected_sha256[:16]}…: the release was "
                    "modified after it was built"
                )


@dataclass(frozen=True)
class IndexedSample:
    """One sample of a shard as ``index_shard`` finds it: the members it read, and where every member's bytes lie."""

    key: str
    members: dict[str, bytes]  # the extensions asked for, read
    spans: dict[str, tuple[int, int]]  # every extension: (offset of its data in the shard file, size)


def index_shard(path: Path, *, read: set[str], expected_sha256: str | None = None) -> list[IndexedSample]:
    """Every sample of a shard with the members ``read`` (e.g. metadata and label) and the byte span of each member,
    so that a reader can later fetch one image by seeking (``read_member``) instead of re-reading the shard.

    The shard is streamed once, strictly as ``iter_shard`` reads it (same errors); with ``expected_sha256`` every byte
    is hashed as it streams and a mismatch raises ``ShardIntegrityError``.
    """
    samples: list[IndexedSample] = []
    current: IndexedSample | None = None
    seen: set[str] = set()
    with open(path, "rb") as raw:
        hashing = HashingReader(raw)
        try:
            with tarfile.open(fileobj=hashing, mode="r|") as tar:
                for info in tar:
                    if not info.isfile():
                        raise ValueError(f"{path}: member {info.name!r} is not a regular file")
                    key, dot, ext = info.name.partition(".")
                    if not dot or "/" in info.name:
                        raise ValueError(f"{path}: member {info.name!r} is not KEY.EXT")
                    if current is None or key != current.key:
                        if key in seen:
                            raise ValueError(f"{path}: sample {key!r} is split across the shard")
                        seen.add(key)
                        current = IndexedSample(key, {}, {})
                        samples.append(current)
                    if ext in current.spans:
                        raise ValueError(f"{path}: member {info.name!r} appears twice")
                    current.spans[ext] = (info.offset_data, info.size)
                    if ext in read:
                        handle = tar.extractfile(info)
                        current.members[ext] = handle.read() if handle else b""
        except (tarfile.TarError, EOFError) as err:
            raise ValueError(f"{path}: not a valid tar archive ({err or 'truncated'})") from err
        digest = hashing.drain()
    if expected_sha256 is not None and digest != expected_sha256:
        raise ShardIntegrityError(
            f"{path}: sha256 {digest[:16]}… is not the manifest's {expected_sha256[:16]}…: the release was modified "
            "after it was built"
        )
    return samples


def read_member(path: Path, span: tuple[int, int]) -> bytes:
    """The bytes of one member at ``span`` (from ``index_shard``)."""
    offset, size = span
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(size)
    if len(data) != size:
        raise ValueError(f"{path}: member at offset {offset} is truncated ({len(data)} of {size} bytes)")
    return data


def read_shard(path: Path) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Every sample of a shard with all its members (see ``iter_shard``)."""
    for key, members in iter_shard(path):
        assert members is not None  # no select: every sample is read
        yield key, members


def read_samples(paths: Iterable[Path], keys: set[str] | None = None) -> dict[str, dict[str, bytes]]:
    """Whole samples of several shards (only ``keys`` when given): key -> {ext: bytes}."""
    out: dict[str, dict[str, bytes]] = {}
    for path in paths:
        for key, members in iter_shard(path, keys=keys):
            if members is not None:
                out[key] = members
    return out
