"""Sources: where the images to stress-test come from.

``--source`` takes ``SCHEME:ARG``:

- ``imagefolder:PATH``: one folder per class. Folders named by ImageNet synsets (``n01440764``) map to ImageNet-1k
  indices; otherwise folders map to their sorted index and the folder name is the class name.
- ``imagenet:PATH``: ImageNet validation in the synset-folder layout; ``classes`` (synsets, indices or names)
  selects a subset.
- ``hf:NAME_OR_PATH[:SPLIT]``: a ``datasets`` dataset (Hub id, local script/data directory, or a directory written by
  ``save_to_disk``) with an image column and an integer/ClassLabel label column.
- ``wds:PATTERN``: local WebDataset shards (brace patterns allowed), image in ``jpg|jpeg|png|webp``, label in ``cls``.
- ``demo``: the photos bundled with this package, offline.

A source lists its samples cheaply (``list_samples``), sorted by key, and reads a sample's bytes on demand
(``read``); decoding is the builder's job (builder.images), so every source gets the same malformed-input handling.
Listing never opens images: a corrupt file becomes a per-sample failure at decode time, never a crash.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from builder import imagenet
from builder.release_format import sanitize_key

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (
    ".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm", ".pbm",
    ".pnm", ".tga", ".ico", ".jp2", ".avif", ".heic", ".heif",
)  # fmt: skip
WDS_IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")


@dataclass(frozen=True)
class SourceSample:
    key: str  # release key, [A-Za-z0-9_-]
    label: int  # may be out of range: that is reported as a per-sample failure, not here
    origin: str  # where it came from (path, dataset row, shard member) for error messages
    problem: str | None = None  # known at listing time (unreadable folder, bad label file): recorded as a failure


@dataclass
class LabelSpace:
    name: str  # "imagenet-1k" or "custom"
    names: list[str]

    @property
    def num_classes(self) -> int:
        return len(self.names)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "num_classes": self.num_classes, "names": list(self.names)}


def imagenet_label_space() -> LabelSpace:
    return LabelSpace("imagenet-1k", list(imagenet.class_names()))


@dataclass
class Source:
    """Base class: subclasses fill ``samples`` (sorted by key) and implement ``read``."""

    spec: str
    kind: str = ""
    label_space: LabelSpace = field(default_factory=lambda: LabelSpace("custom", []))
    samples: list[SourceSample] = field(default_factory=list)
    imagenet_derived: bool = False
    license: str = "The source data's own terms apply."

    def read(self, sample: SourceSample) -> bytes:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "kind": self.kind,
            "num_samples": len(self.samples),
            "imagenet_derived": self.imagenet_derived,
            "license": self.license,
        }


IMAGENET_LICENSE = (
    "Derived from ImageNet (ILSVRC2012) validation images: use is limited to non-commercial research and education "
    "under the ImageNet terms of access (https://image-net.org/download.php). Redistribution should be gated."
)


def _unique_keys(raw: list[tuple[str, str]]) -> dict[str, str]:
    """Map (identity, proposed key) pairs to unique keys: colliding keys get a hash of their identity appended."""
    counts: dict[str, int] = {}
    for _, key in raw:
        counts[key] = counts.get(key, 0) + 1
    out = {}
    for identity, key in raw:
        if counts[key] > 1:
            key = f"{key}-{hashlib.sha256(identity.encode()).hexdigest()[:8]}"
        out[identity] = key
    return out


def _list_class_folders(root: Path, spec: str) -> list[Path]:
    if not root.is_dir():
        raise ValueError(f"source {spec!r}: {root} is not a directory")
    try:
        folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError as err:
        raise ValueError(f"source {spec!r}: cannot list {root}: {err.strerror or err}") from err
    if not folders:
        raise ValueError(f"source {spec!r}: {root} has no class folders (expected ROOT/CLASS/IMAGE files)")
    return folders


def _list_images(folder: Path) -> list[tuple[Path, str | None]]:
    """Every path with an image extension under ``folder``, with a problem for those that cannot be read.

    Nothing is dropped silently: an unreadable sub-folder, a broken symbolic link, a FIFO or a folder named like an
    image become entries with a problem (recorded as failures by the builder); a file that is not really an image
    fails at decode time. Symbolic links to folders are followed (once: cycles are cut). Files with other
    extensions are counted in the log.
    """
    found: list[tuple[Path, str | None]] = []
    skipped: dict[str, int] = {}
    visited: set[str] = set()

    def walk(directory: Path) -> None:
        real = os.path.realpath(directory)
        if real in visited:
            return
        visited.add(real)
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError as err:
            found.append((directory, f"unreadable folder: {err.strerror or err}"))
            return
        for entry in entries:
            path = Path(entry.path)
            is_image_name = path.suffix.lower() in IMAGE_EXTENSIONS
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False
            if is_dir:
                if is_image_name:
                    found.append((path, "a folder named like an image, not an image file"))
                else:
                    walk(path)
            elif not is_image_name:
                skipped[path.suffix.lower() or "(none)"] = skipped.get(path.suffix.lower() or "(none)", 0) + 1
            elif entry.is_file():
                found.append((path, None))
            elif entry.is_symlink():
                found.append((path, "broken symbolic link"))
            else:
                found.append((path, "not a regular file"))

    walk(folder)
    if skipped:
        summary = ", ".join(f"{ext} ({n})" for ext, n in sorted(skipped.items()))
        logger.info("%s: skipped %d file(s) without an image extension: %s", folder, sum(skipped.values()), summary)
    return sorted(found)


class _FileSource(Source):
    paths: dict[str, Path]

    def _fill(self, entries: list[tuple[tuple[Path, str | None], int, str]]) -> None:
        """entries: ((path, problem), label, class folder name)."""
        raw = [(str(path), sanitize_key(f"{folder}_{path.stem}")) for (path, _), _, folder in entries]
        keys = _unique_keys(raw)
        self.paths = {}
        samples = []
        for (path, problem), label, _ in entries:
            key = keys[str(path)]
            self.paths[key] = path
            samples.append(SourceSample(key, label, str(path), problem))
        self.samples = sorted(samples, key=lambda s: s.key)

    def read(self, sample: SourceSample) -> bytes:
        return self.paths[sample.key].read_bytes()


class ImageFolderSource(_FileSource):
    def __init__(self, spec: str, path: str):
        super().__init__(spec=spec, kind="imagefolder")
        root = Path(path).expanduser()
        folders = _list_class_folders(root, spec)
        synset = [imagenet.is_synset(f.name) for f in folders]
        if any(synset) and not all(synset):
            bad = [f.name for f, s in zip(folders, synset, strict=True) if not s][:3]
            raise ValueError(
                f"source {spec!r}: some class folders are ImageNet synsets and some are not ({bad}); "
                "use one naming scheme"
            )
        entries = []
        if all(synset):
            self.label_space = imagenet_label_space()
            self.imagenet_derived = False  # synset folders do not prove the pixels come from ImageNet
            for folder in folders:
                label = imagenet.synset_to_index()[folder.name]
                entries += [(p, label, folder.name) for p in _list_images(folder)]
        else:
            self.label_space = LabelSpace("custom", [f.name for f in folders])
            for label, folder in enumerate(folders):
                entries += [(p, label, folder.name) for p in _list_images(folder)]
        self._fill(entries)


class ImageNetSource(_FileSource):
    def __init__(self, spec: str, path: str, classes: list[Any] | None = None, per_class: int | None = None):
        super().__init__(spec=spec, kind="imagenet", imagenet_derived=True, license=IMAGENET_LICENSE)
        root = Path(path).expanduser()
        folders = _list_class_folders(root, spec)
        not_synsets = [f.name for f in folders if not imagenet.is_synset(f.name)]
        if not_synsets:
            raise ValueError(
                f"source {spec!r}: expected ImageNet synset folders (n01440764/...), found {not_synsets[:3]}"
            )
        by_index = {imagenet.synset_to_index()[f.name]: f for f in folders}
        wanted = sorted({imagenet.resolve_class(str(c)) for c in classes}) if classes else sorted(by_index)
        missing = [imagenet.synsets()[i] for i in wanted if i not in by_index]
        if missing:
            raise ValueError(f"source {spec!r}: class folder(s) {missing} not found under {root}")
        self.label_space = imagenet_label_space()
        entries = []
        for index in wanted:
            files = _list_images(by_index[index])
            if per_class is not None:
                files = files[:per_class]
            entries += [(p, index, by_index[index].name) for p in files]
        self._fill(entries)


class DemoSource(_FileSource):
    """A few real photos that ship inside Python packages, with honest ImageNet labels (see demo_images/SOURCES)."""

    def __init__(self, spec: str = "demo", path: str = ""):
        super().__init__(spec=spec, kind="demo")
        root = Path(str(resources.files("builder") / "demo_images"))
        self.label_space = imagenet_label_space()
        entries = []
        for folder in _list_class_folders(root, spec):
            label = imagenet.synset_to_index()[folder.name]
            entries += [(p, label, folder.name) for p in _list_images(folder)]
        self._fill(entries)
        self.license = "Photos from public-domain or permissively licensed package sample data; see SOURCES.md."


class HFDatasetSource(Source):
    """Any ``datasets`` dataset with an image column and an integer/ClassLabel label column."""

    def __init__(
        self,
        spec: str,
        path: str,
        image_column: str | None = None,
        label_column: str | None = None,
        key_column: str | None = None,
        label_space: str | None = None,
        revision: str | None = None,
    ):
        super().__init__(spec=spec, kind="hf")
        import datasets

        name, _, split = path.partition(":")
        split = split or "test"
        local = Path(name).expanduser()
        if (local / "dataset_info.json").exists() or (local / "state.json").exists():
            loaded = datasets.load_from_disk(str(local))
            ds = loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
        else:
            try:
                ds = datasets.load_dataset(name, split=split, revision=revision)
            except Exception as err:  # datasets raises many types; the message names the dataset
                raise ValueError(f"source {spec!r}: cannot load dataset {name!r} split {split!r}: {err}") from err
        image_column = image_column or _pick_column(ds, ("image", "img", "jpg", "png"), datasets.Image, spec, "image")
        label_column = label_column or _pick_column(ds, ("label", "labels", "cls", "class"), None, spec, "label")
        for column in (image_column, label_column, key_column):
            if column is not None and column not in ds.column_names:
                raise ValueError(f"source {spec!r}: no column {column!r} (columns: {ds.column_names})")
        # Read raw bytes: decoding (and its failures) is ours, per sample.
        if isinstance(ds.features[image_column], datasets.Image):
            ds = ds.cast_column(image_column, datasets.Image(decode=False))
        feature = ds.features[label_column]
        if label_space == "imagenet-1k" or (label_space is None and _looks_like_imagenet(feature)):
            self.label_space = imagenet_label_space()
        elif isinstance(feature, datasets.ClassLabel):
            self.label_space = LabelSpace("custom", list(feature.names))
        else:
            labels = sorted({int(v) for v in ds[label_column] if v is not None and int(v) >= 0})
            self.label_space = LabelSpace("custom", [str(i) for i in range(max(labels, default=-1) + 1)])
        self._ds = ds
        self._image_column = image_column
        keys = ds[key_column] if key_column else [f"{split}_{i:08d}" for i in range(len(ds))]
        raw = [(str(i), sanitize_key(str(k))) for i, k in enumerate(keys)]
        unique = _unique_keys(raw)
        labels = ds[label_column]
        samples = [
            SourceSample(unique[str(i)], -1 if labels[i] is None else int(labels[i]), f"{name}[{split}][{i}]")
            for i in range(len(ds))
        ]
        self._row = {s.key: i for i, s in enumerate(samples)}
        self.samples = sorted(samples, key=lambda s: s.key)

    def read(self, sample: SourceSample) -> bytes:
        value = self._ds[self._row[sample.key]][self._image_column]
        if isinstance(value, dict):
            if value.get("bytes") is not None:
                return value["bytes"]
            if value.get("path"):
                return Path(value["path"]).read_bytes()
            raise ValueError(f"{sample.origin}: image cell holds neither bytes nor a path")
        if isinstance(value, bytes | bytearray):
            return bytes(value)
        if hasattr(value, "save"):  # an already decoded PIL image
            buf = io.BytesIO()
            value.save(buf, format="PNG")
            return buf.getvalue()
        raise ValueError(f"{sample.origin}: unsupported image cell of type {type(value).__name__}")


def _looks_like_imagenet(feature: Any) -> bool:
    names = getattr(feature, "names", None)
    return bool(names) and len(names) == imagenet.NUM_CLASSES and names[0].lower().startswith("tench")


def _pick_column(ds: Any, candidates: tuple[str, ...], feature_type: Any, spec: str, what: str) -> str:
    if feature_type is not None:
        typed = [c for c, f in ds.features.items() if isinstance(f, feature_type)]
        if len(typed) == 1:
            return typed[0]
    for c in candidates:
        if c in ds.column_names:
            return c
    raise ValueError(
        f"source {spec!r}: cannot tell which column holds the {what} (columns: {ds.column_names}); "
        f"set source_options.{what}_column"
    )


class WebDatasetSource(Source):
    """Local WebDataset shards. Members are grouped by key as in webdataset (key = path up to the first dot)."""

    def __init__(self, spec: str, path: str, label_space: str = "imagenet-1k", class_names: list[str] | None = None):
        super().__init__(spec=spec, kind="wds")
        import braceexpand

        shards = [Path(p).expanduser() for pattern in [path] for p in braceexpand.braceexpand(pattern)]
        missing = [str(p) for p in shards if not p.is_file()]
        if missing:
            raise ValueError(f"source {spec!r}: shard(s) not found: {missing[:3]}")
        if label_space == "imagenet-1k":
            self.label_space = imagenet_label_space()
        elif class_names:
            self.label_space = LabelSpace("custom", list(class_names))
        else:
            raise ValueError(f"source {spec!r}: a custom label space needs source_options.class_names")
        self._members: dict[str, tuple[Path, tuple[int, int] | str | None]] = {}
        raw: list[tuple[str, str]] = []
        labels: dict[str, int] = {}
        origins: dict[str, str] = {}
        problems: dict[str, str | None] = {}
        for shard in shards:
            for base, members in _group_tar(shard, spec).items():
                identity = f"{shard}::{base}"
                image_member = next((members[e] for e in WDS_IMAGE_EXTS if e in members), None)
                label, problem = -1, None
                if image_member is None:
                    problem = f"no image member (expected {base}.jpg|jpeg|png|webp; found {sorted(members)})"
                elif "cls" not in members:
                    problem = f"no label member {base}.cls (found {sorted(members)})"
                else:
                    text = _read_span(shard, members["cls"]).decode("utf-8", errors="replace").strip()
                    try:
                        label = int(text)
                    except ValueError:
                        problem = f"label member {base}.cls holds {text[:20]!r}, not an integer"
                raw.append((identity, sanitize_key(base.rsplit("/", 1)[-1])))
                self._members[identity] = (shard, image_member)
                labels[identity] = label
                problems[identity] = problem
                origins[identity] = identity
        unique = _unique_keys(raw)
        self._by_key = {unique[i]: self._members[i] for i, _ in raw}
        self.samples = sorted(
            (SourceSample(unique[i], labels[i], origins[i], problems[i]) for i, _ in raw), key=lambda s: s.key
        )

    def read(self, sample: SourceSample) -> bytes:
        shard, member = self._by_key[sample.key]
        if member is None:
            raise ValueError(f"{sample.origin}: no image member (expected one of {', '.join(WDS_IMAGE_EXTS)})")
        return _read_span(shard, member)


COMPRESSED_MAGIC = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00")


def _group_tar(shard: Path, spec: str) -> dict[str, dict[str, tuple[int, int] | str]]:
    """Members of a shard grouped by sample key: {key: {ext: location}}.

    For a plain tar the location is (data offset, size), so reads seek straight to the bytes; for a compressed
    shard (gzip, bz2, xz) it is the member name, read through tarfile.
    """
    with open(shard, "rb") as f:
        compressed = f.read(6).startswith(COMPRESSED_MAGIC)
    groups: dict[str, dict[str, tuple[int, int] | str]] = {}
    try:
        with tarfile.open(shard) as tar:
            for info in tar:
                if not info.isfile():
                    continue
                name = info.name
                slash = name.rfind("/")
                dot = name.find(".", slash + 1)
                if dot < 0:
                    continue
                location = name if compressed else (info.offset_data, info.size)
                groups.setdefault(name[:dot], {})[name[dot + 1 :].lower()] = location
    except (tarfile.TarError, EOFError, OSError) as err:
        raise ValueError(f"source {spec!r}: {shard} is not a readable tar archive ({err})") from err
    return groups


def _read_span(shard: Path, location: tuple[int, int] | str) -> bytes:
    if isinstance(location, str):
        with tarfile.open(shard) as tar:
            member = tar.extractfile(location)
            if member is None:
                raise ValueError(f"{shard}::{location} is not a regular file")
            return member.read()
    offset, size = location
    with open(shard, "rb") as f:
        f.seek(offset)
        return f.read(size)


def create_source(spec: str, options: dict[str, Any] | None = None) -> Source:
    """Build a source from ``SCHEME:ARG`` and its options."""
    from builder.registry import SOURCES

    scheme, sep, arg = spec.partition(":")
    if scheme == "demo":
        arg = ""
    elif not sep or not arg:
        raise ValueError(
            f"source {spec!r}: expected SCHEME:ARG with SCHEME one of {', '.join(SOURCES.names())} "
            "(e.g. imagefolder:/data/images, hf:user/dataset:test)"
        )
    cls: Callable[..., Source] = SOURCES.resolve(scheme)
    import inspect

    accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "spec", "path")]
    unknown = sorted(set(options or {}) - set(accepted))
    if unknown:
        takes = f"it takes {', '.join(accepted)}" if accepted else "it takes none"
        raise ValueError(f"source {spec!r} does not take option(s) {', '.join(unknown)} ({scheme} sources: {takes})")
    return cls(spec, arg, **(options or {}))
