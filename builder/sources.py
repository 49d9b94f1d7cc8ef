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

A source declares its options as one typed dataclass (``options_class``, an ``lance_pipeline.option_types.Options``):
each field's annotation says its type, bounds, choices and lengths, and those are the only value checks; a relation
between options, or a look-up (an ImageNet class name), goes in the options' ``__post_init__``. Validation constructs
them once (``check_source_options``: "did you mean" for a misspelt name, one line naming the source and the option
for a bad value); ``create_source`` builds the source from them, and the config hash covers their effective,
defaulted values (``builder.config.effective_source_options``).

A source lists its samples cheaply when it is created (``samples``, sorted by key) and reads a sample's bytes on
demand (``read``); decoding is the builder's job (builder.images), so every source gets the same malformed-input
handling.
Listing never opens images: a corrupt file becomes a per-sample failure at decode time, never a crash.

What a source guarantees (docs/sources.md has the long form):

- Keys, and so seeds and bytes, do not depend on where the source sits: names are Unicode-normalised (NFC), and the
  hash that tells colliding names apart is taken over the path relative to the source root.
- One input never takes the machine down: image files and shard members are size-checked before they are read,
  labels are checked against a bounded label space (out-of-space labels are per-sample failures), compressed shards
  are decompressed once.
- Nothing is dropped silently: a folder reached twice (a symbolic link to an ancestor or a sibling), a duplicate tar
  member, an oversized member or a bad label becomes a sample with a ``problem``, recorded as a failure.
- ``public_spec`` (what the manifest and card show) holds no machine path: the folder's or dataset's own name.
"""

from __future__ import annotations

import hashlib
import io
import logging
import lzma
import math
import numbers
import os
import re
import tarfile
import tempfile
import typing
import unicodedata
import zlib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, BinaryIO, ClassVar, Literal

from builder import imagenet
from builder.registry import SOURCES
from builder.release_format import sanitize_key
from lance_pipeline.option_types import MinLen, Options, PositiveInt
from lance_pipeline.stage import check_options, option_values, options_type, stage_options

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (
    ".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm", ".pbm",
    ".pnm", ".tga", ".ico", ".jp2", ".avif", ".heic", ".heif",
)  # fmt: skip
WDS_IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")

# Limits that keep one input from taking the machine down. Each is a source option where a user may need more.
MAX_IMAGE_BYTES = (
    256 << 20
)  # one image file or shard member; a 89-megapixel 16-bit TIFF is about 512 MiB, a JPEG far less
MAX_LABEL_BYTES = 1024  # a .cls member holds one integer
MAX_CLASSES = 100_000  # a label space larger than this is refused up front (ImageNet-21k has 21,843 classes)


@dataclass(frozen=True)
class SourceSample:
    key: str  # release key, [A-Za-z0-9_-]
    label: int  # -1 when ``problem`` says why there is no usable label
    origin: str  # where it came from (local path, dataset row, shard member), for the user's own error messages
    problem: str | None = None  # known at listing time (unreadable folder, bad label, ...): recorded as a failure


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
    """Base class: subclasses fill ``samples`` (sorted by key) and implement ``read``.

    ``spec`` is what the user typed (it may hold local paths, and is used only in messages to that user);
    ``public_spec`` is what the manifest and dataset card record: the same spec with every local path reduced to the
    name of the folder, file or dataset, so that nothing about the machine is published.

    A subclass declares ``options_class`` and takes ``__init__(self, spec, path, options=None, /, **values)``,
    setting ``options`` to ``stage_options(type(self), options, values)``: the typed options validation made (checked
    once), or made from keywords by a Python caller. A source without ``options_class`` (one written before sources
    declared them) has its options derived from its constructor's annotated keywords, checked the same way.
    """

    # The source's options: a dataclass subclassing ``Options`` (see the module docstring).
    options_class: ClassVar[type | None] = None
    # The constructor's arguments that are not options (the spec as typed and its ARG), for a derived options type.
    non_option_arguments: ClassVar[tuple[str, ...]] = ("spec", "path")

    spec: str
    kind: str = ""
    label_space: LabelSpace = field(default_factory=lambda: LabelSpace("custom", []))
    samples: list[SourceSample] = field(default_factory=list)
    imagenet_derived: bool = False
    license: str = "The source data's own terms apply."
    public_spec: str = ""
    options: Any = None  # the typed options (``options_class``), as validation constructed them

    def __post_init__(self) -> None:
        if not self.public_spec:
            self.public_spec = public_spec(self.spec)

    def read(self, sample: SourceSample) -> bytes:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """What the manifest records about the source (no local paths)."""
        return {
            "spec": self.public_spec,
            "kind": self.kind,
            "num_samples": len(self.samples),
            "imagenet_derived": self.imagenet_derived,
            "license": self.license,
        }


IMAGENET_LICENSE = (
    "Derived from ImageNet (ILSVRC2012) validation images: use is limited to non-commercial research and education "
    "under the ImageNet terms of access (https://image-net.org/download.php). Redistribution should be gated."
)


# -- names and keys that do not depend on the machine ------------------------------------------------------------------
def _nfc(text: str) -> str:
    """One spelling of a name: NFC, with bytes that are not UTF-8 (kept by Python as surrogates) made visible."""
    text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return unicodedata.normalize("NFC", text)


def _shown(name: str) -> str:
    """A name as it may appear in a message or a recorded reason: control characters (a newline in a file name)
    escaped, so that one reason stays one line."""
    return "".join(c if unicodedata.category(c)[0] != "C" else ascii(c)[1:-1] for c in name)


def _path_name(path: str) -> str:
    """The last component of a local path, as a public name (``/home/me/my photos/`` -> ``my photos``)."""
    return _nfc(os.path.basename(os.path.abspath(os.path.expanduser(path))) or "root")


def public_spec(spec: str) -> str:
    """``spec`` without machine paths: a local path becomes the name of its last component.

    Remote names (a Hub dataset id) are kept: they are what a reader needs to find the data.
    """
    scheme, sep, arg = spec.partition(":")
    if not sep or not arg:
        return spec
    if scheme in ("imagefolder", "imagenet"):
        return f"{scheme}:{_path_name(arg)}"
    if scheme == "hf":
        name, sep, split = arg.partition(":")
        if os.path.isabs(os.path.expanduser(name)) or os.path.exists(name) or name.startswith("."):
            name = _path_name(name)
        return f"hf:{name}{sep}{split}"
    if scheme == "wds":
        return f"wds:{os.path.basename(arg.rstrip('/')) or arg}"
    return f"{scheme}:{_path_name(arg)}"


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


MAX_KEY_LENGTH = 96  # derived samples add suffixes (``_cf000``); file names must stay well under 255 bytes


def _proposed_key(name: str) -> str:
    """A release key for a source name: NFC, sanitised (builder.release_format), and bounded in length (a long
    name keeps its first 80 characters and a hash of the whole)."""
    key = sanitize_key(_nfc(name))
    if len(key) > MAX_KEY_LENGTH:
        key = f"{key[:80]}-{_hash(key)[:12]}"
    return key


def _unique_keys(raw: list[tuple[str, str, str]]) -> dict[str, str]:
    """Unique release keys for (identity, public identity, proposed key) triples, keyed by identity.

    The public identity is the sample's location inside the source (relative path, NFC; shard name and member), so
    it is the same wherever the source sits. Keys that collide get a short hash of it appended; two samples whose
    public identities are equal (the NFC and NFD spellings of one name side by side) are then told apart by a hash
    of their exact identity.
    """
    counts: dict[str, int] = {}
    for _, _, key in raw:
        counts[key] = counts.get(key, 0) + 1
    public_counts: dict[str, int] = {}
    for _, public, _ in raw:
        public_counts[public] = public_counts.get(public, 0) + 1
    out: dict[str, str] = {}
    for identity, public, key in raw:
        if counts[key] > 1:
            key = f"{key}-{_hash(public)[:8]}"
            if public_counts[public] > 1:
                key = f"{key}-{_hash(identity)[:8]}"
        out[identity] = key
    if len(set(out.values())) != len(out):  # a proposed key that happens to equal a suffixed one
        seen: dict[str, int] = {}
        for key in out.values():
            seen[key] = seen.get(key, 0) + 1
        out = {i: (f"{k}-{_hash(i)[:16]}" if seen[k] > 1 else k) for i, k in out.items()}
        if len(set(out.values())) != len(out):
            raise RuntimeError("could not make unique sample keys")  # needs a 64-bit hash collision
    return out


def check_label(value: Any, label_space: LabelSpace, where: str) -> tuple[int, str | None]:
    """``(label, problem)`` for a raw label value: an integer inside the label space, or -1 and the reason.

    Integral floats (``2.0``, as pandas writes an int column with gaps) are integers; ``1.5`` is not truncated.
    The returned label always fits the ledger's 64-bit column.
    """
    if value is None:
        return -1, f"no label ({where} is empty)"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return -1, f"label {str(value)[:40]!r} ({where}) is not an integer class index"
    if not isinstance(value, numbers.Integral):
        if not math.isfinite(value) or value != math.floor(value):
            return -1, f"label {value!r} ({where}) is not an integer class index"
    label = int(value)
    if not 0 <= label < label_space.num_classes:
        shown = str(label) if len(str(label)) <= 40 else f"{str(label)[:20]}…"
        return -1, f"label {shown} out of range [0, {label_space.num_classes}) of the {label_space.name} label space"
    return label, None


# -- image folders -----------------------------------------------------------------------------------------------------
def _list_class_folders(root: Path, spec: str) -> list[Path]:
    if not root.is_dir():
        raise ValueError(f"source {spec!r}: {root} is not a directory (expected ROOT/CLASS/IMAGE files)")
    try:
        folders = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    except OSError as err:
        raise ValueError(f"source {spec!r}: cannot list {root}: {err.strerror or err}") from err
    if not folders:
        raise ValueError(f"source {spec!r}: {root} has no class folders (expected ROOT/CLASS/IMAGE files)")
    by_name: dict[str, list[str]] = {}
    for folder in folders:
        by_name.setdefault(_nfc(folder.name), []).append(folder.name)
    twins = [names for names in by_name.values() if len(names) > 1]
    if twins:
        raise ValueError(
            f"source {spec!r}: class folders {[ascii(n) for n in twins[0]]} are two spellings of one name "
            "(Unicode NFC and NFD); merge or rename them"
        )
    return sorted(folders, key=lambda p: _nfc(p.name))


class _FolderWalk:
    """Lists image files under a source root; every folder is listed once, under its own place in the tree.

    A symbolic link to a folder inside the source (the root, a sibling class, an ancestor) is not followed: that
    folder's images are listed where the folder really is, and the link becomes an entry with a problem, so no image
    is released twice or under another class, whatever order the folders are walked in. A link to a folder outside
    the source is followed, once: a second link to the same outside folder is reported the same way.
    """

    def __init__(self, root: Path):
        self.root = root
        self.real_root = os.path.realpath(root)
        # Folders that physically lie in the tree (reached without following any link); hidden top-level folders
        # are not classes, so they do not count.
        self.inside: dict[str, Path] = {}
        stack = [(root, self.real_root)]  # (path, real path): without links, a child's real path is real/name
        while stack:
            directory, real = stack.pop()
            self.inside[real] = directory
            try:
                with os.scandir(directory) as entries:
                    for entry in entries:
                        hidden_class = directory == root and entry.name.startswith(".")
                        if not hidden_class and entry.is_dir(follow_symlinks=False):
                            stack.append((Path(entry.path), os.path.join(real, entry.name)))
            except OSError:
                continue  # an unreadable folder is reported when it is listed
        self.first_reached: dict[str, Path] = {}

    def relative(self, path: Path) -> str:
        """The path inside the source, '/'-separated and NFC: the same wherever the source sits."""
        return _nfc(os.path.relpath(path, self.root).replace(os.sep, "/"))

    def _where(self, real: str, first: Path) -> str:
        return "the source root" if real == self.real_root else repr(_shown(self.relative(first)))

    def images(self, folder: Path) -> list[tuple[Path, str | None]]:
        """Every path with an image extension under ``folder``, with a problem for those that cannot be used.

        An unreadable sub-folder, a link to a folder listed elsewhere, a broken symbolic link, a FIFO or a folder
        named like an image become entries with a problem (recorded as failures by the builder); a file that is not
        really an image fails at decode time. Files with other extensions are counted in the log.
        """
        found: list[tuple[Path, str | None]] = []
        skipped: dict[str, int] = {}
        # Depth-first with an explicit stack (a tree thousands of folders deep is no recursion error), carrying each
        # folder's real path: resolving every path from the root again would cost depth x depth.
        stack = [(folder, os.path.realpath(folder))]
        while stack:
            directory, real = stack.pop()
            if os.path.islink(directory) and real in self.inside:
                where = self._where(real, self.inside[real])
                found.append((directory, f"folder is a symbolic link to {where}; its images are listed there, once"))
                continue
            if real in self.first_reached:
                where = self._where(real, self.first_reached[real])
                found.append(
                    (directory, f"folder is {where} again (through a symbolic link); its images are listed once")
                )
                continue
            self.first_reached[real] = directory
            try:
                entries = sorted(os.scandir(directory), key=lambda e: e.name)
            except OSError as err:
                found.append((directory, f"unreadable folder: {err.strerror or err}"))
                continue
            subfolders: list[tuple[Path, str]] = []
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
                        linked = entry.is_symlink()
                        subfolders.append((path, os.path.realpath(path) if linked else os.path.join(real, entry.name)))
                elif not is_image_name:
                    skipped[path.suffix.lower() or "(none)"] = skipped.get(path.suffix.lower() or "(none)", 0) + 1
                elif entry.is_file():
                    found.append((path, None))
                elif entry.is_symlink():
                    found.append((path, "broken symbolic link"))
                else:
                    found.append((path, "not a regular file"))
            stack.extend(reversed(subfolders))
        if skipped:
            summary = ", ".join(f"{ext} ({n})" for ext, n in sorted(skipped.items()))
            logger.info("%s: skipped %d file(s) without an image extension: %s", folder, sum(skipped.values()), summary)
        return sorted(found, key=lambda entry: (self.relative(entry[0]), str(entry[0])))


def _read_bounded(path: Path, limit: int, where: str) -> bytes:
    """A file's bytes, refusing (before reading) one larger than ``limit``."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise ValueError(f"{where}: {size} bytes, over the {limit}-byte limit for one image (max_image_bytes)")
            data = f.read(limit + 1)
    except OSError as err:
        raise ValueError(f"{where}: cannot read the file: {err.strerror or type(err).__name__}") from err
    if len(data) > limit:  # grew since it was opened
        raise ValueError(f"{where}: over the {limit}-byte limit for one image (max_image_bytes)")
    return data


# -- options -----------------------------------------------------------------------------------------------------------
@dataclass
class ImageFolderOptions(Options):
    max_image_bytes: PositiveInt = MAX_IMAGE_BYTES  # one image file's size limit


@dataclass
class ImageNetOptions(Options):
    # ImageNet-1k classes by synset, index or name; left out: every class folder.
    classes: typing.Annotated[list[str | int], MinLen(1)] | None = None
    per_class: PositiveInt | None = None  # the first N images of each class, in key order
    max_image_bytes: PositiveInt = MAX_IMAGE_BYTES

    def __post_init__(self) -> None:
        super().__post_init__()
        # A look-up no annotation can say: each class is an ImageNet-1k class (the error says "did you mean").
        for name in self.classes or ():
            imagenet.resolve_class(str(name))


@dataclass
class DemoOptions(Options):
    """The bundled photos take no options."""


@dataclass
class HFDatasetOptions(Options):
    image_column: str | None = None  # left out: the one Image column, else image, img, jpg or png
    label_column: str | None = None  # left out: label, labels, cls or class
    key_column: str | None = None  # left out: SPLIT_ROW
    label_space: Literal["imagenet-1k", "custom"] | None = None
    class_names: list[str] | None = None
    num_classes: PositiveInt | None = None
    max_classes: PositiveInt = MAX_CLASSES
    revision: str | None = None  # of a Hub dataset

    def __post_init__(self) -> None:
        super().__post_init__()
        # Relations between options: a declared label space larger than the limit the same config sets.
        for what, size in (("num_classes", self.num_classes), ("class_names", len(self.class_names or ()))):
            if size is not None and size > self.max_classes:
                raise ValueError(
                    f"{what} declares {size} classes, over max_classes {self.max_classes}; raise max_classes if "
                    "that many classes are meant"
                )


@dataclass
class WebDatasetOptions(Options):
    label_space: Literal["imagenet-1k", "custom"] | None = None  # left out: custom with class_names, else imagenet-1k
    class_names: list[str] | None = None
    max_image_bytes: PositiveInt = MAX_IMAGE_BYTES  # one shard member's size limit

    def __post_init__(self) -> None:
        super().__post_init__()
        # Relations between the two options that say the label space.
        if self.label_space == "custom" and self.class_names is None:
            raise ValueError("a custom label space needs class_names")
        if self.label_space == "imagenet-1k" and self.class_names is not None:
            raise ValueError("class_names and label_space imagenet-1k contradict; give one of them")


class _FileSource(Source):
    paths: dict[str, Path]
    relative: dict[str, str]
    max_image_bytes: int = MAX_IMAGE_BYTES

    def _fill(self, walk: _FolderWalk, entries: list[tuple[tuple[Path, str | None], int, str]]) -> None:
        """entries: ((path, problem), label, class folder name)."""
        raw = [
            (str(path), walk.relative(path), _proposed_key(f"{folder}_{path.stem}")) for (path, _), _, folder in entries
        ]
        keys = _unique_keys(raw)
        self.paths, self.relative = {}, {}
        samples = []
        for (path, problem), label, _ in entries:
            key = keys[str(path)]
            self.paths[key] = path
            self.relative[key] = walk.relative(path)
            samples.append(SourceSample(key, -1 if problem else label, str(path), problem))
        self.samples = sorted(samples, key=lambda s: s.key)

    def read(self, sample: SourceSample) -> bytes:
        return _read_bounded(self.paths[sample.key], self.max_image_bytes, _shown(self.relative[sample.key]))


class ImageFolderSource(_FileSource):
    options_class = ImageFolderOptions

    def __init__(self, spec: str, path: str, options: ImageFolderOptions | None = None, /, **values: Any):
        super().__init__(spec=spec, kind="imagefolder", options=stage_options(type(self), options, values))
        self.max_image_bytes = self.options.max_image_bytes
        root = Path(path).expanduser()
        folders = _list_class_folders(root, spec)
        synset = [imagenet.is_synset(f.name) for f in folders]
        if any(synset) and not all(synset):
            bad = [f.name for f, s in zip(folders, synset, strict=True) if not s][:3]
            raise ValueError(
                f"source {spec!r}: some class folders are ImageNet synsets and some are not ({bad}); "
                "use one naming scheme"
            )
        walk = _FolderWalk(root)
        entries = []
        if all(synset):
            self.label_space = imagenet_label_space()
            self.imagenet_derived = False  # synset folders do not prove the pixels come from ImageNet
            for folder in folders:
                label = imagenet.synset_to_index()[folder.name]
                entries += [(p, label, folder.name) for p in walk.images(folder)]
        else:
            # A class folder that is only a link to a folder listed elsewhere (the root, another class, an outside
            # folder already linked) holds no image of its own: it is not a class. Its entry stays, as a failure.
            listed = [(folder, walk.images(folder)) for folder in folders]
            classes = [folder for folder, items in listed if not _only_a_link(folder, items)]
            self.label_space = LabelSpace("custom", [_nfc(f.name) for f in classes])
            label_of = {folder: label for label, folder in enumerate(classes)}
            for folder, items in listed:
                entries += [(p, label_of.get(folder, -1), folder.name) for p in items]
        self._fill(walk, entries)


def _only_a_link(folder: Path, items: list[tuple[Path, str | None]]) -> bool:
    """Whether a class folder is a symbolic link the walk did not follow (its images are listed elsewhere)."""
    return len(items) == 1 and items[0][0] == folder and items[0][1] is not None and folder.is_symlink()


class ImageNetSource(_FileSource):
    options_class = ImageNetOptions

    def __init__(self, spec: str, path: str, options: ImageNetOptions | None = None, /, **values: Any):
        options = stage_options(type(self), options, values)
        super().__init__(spec=spec, kind="imagenet", imagenet_derived=True, license=IMAGENET_LICENSE, options=options)
        self.max_image_bytes = options.max_image_bytes
        classes, per_class = options.classes, options.per_class
        root = Path(path).expanduser()
        folders = _list_class_folders(root, spec)
        not_synsets = [f.name for f in folders if not imagenet.is_synset(f.name)]
        if not_synsets:
            raise ValueError(
                f"source {spec!r}: expected ImageNet synset folders (n01440764/...), found {not_synsets[:3]}; "
                "for other class folders use imagefolder:PATH"
            )
        by_index = {imagenet.synset_to_index()[f.name]: f for f in folders}
        wanted = sorted({imagenet.resolve_class(str(c)) for c in classes}) if classes else sorted(by_index)
        missing = [imagenet.synsets()[i] for i in wanted if i not in by_index]
        if missing:
            raise ValueError(f"source {spec!r}: class folder(s) {missing} not found under {root}")
        self.label_space = imagenet_label_space()
        walk = _FolderWalk(root)
        entries = []
        for index in wanted:
            files = walk.images(by_index[index])
            if per_class is not None:
                files = files[:per_class]
            entries += [(p, index, by_index[index].name) for p in files]
        self._fill(walk, entries)


class DemoSource(_FileSource):
    """A few real photos that ship inside Python packages, with honest ImageNet labels (see demo_images/SOURCES)."""

    options_class = DemoOptions

    def __init__(self, spec: str = "demo", path: str = "", options: DemoOptions | None = None, /, **values: Any):
        super().__init__(spec=spec, kind="demo", public_spec="demo", options=stage_options(type(self), options, values))
        root = Path(str(resources.files("builder") / "demo_images"))
        self.label_space = imagenet_label_space()
        walk = _FolderWalk(root)
        entries = []
        for folder in _list_class_folders(root, spec):
            label = imagenet.synset_to_index()[folder.name]
            entries += [(p, label, folder.name) for p in walk.images(folder)]
        self._fill(walk, entries)
        self.license = "Photos from public-domain or permissively licensed package sample data; see SOURCES.md."


# -- datasets ----------------------------------------------------------------------------------------------------------
class HFDatasetSource(Source):
    """Any ``datasets`` dataset with an image column and an integer/ClassLabel label column.

    The label space is, in this order: ``label_space: imagenet-1k``; ``class_names``; ``num_classes`` (names
    ``"0"`` … ``"N-1"``); the ClassLabel names of the label column; or, for a plain integer column, ``0`` … the
    largest label. Any of them larger than ``max_classes`` is refused up front; labels outside it are per-sample
    failures.
    """

    options_class = HFDatasetOptions

    def __init__(self, spec: str, path: str, options: HFDatasetOptions | None = None, /, **values: Any):
        options = stage_options(type(self), options, values)
        super().__init__(spec=spec, kind="hf", options=options)
        import datasets

        image_column, label_column, key_column = options.image_column, options.label_column, options.key_column

        name, _, split = path.partition(":")
        if not name:
            raise ValueError(f"source {spec!r}: expected hf:NAME_OR_PATH[:SPLIT] (e.g. hf:user/dataset:test)")
        split = split or "test"
        local = Path(name).expanduser()
        if (local / "dataset_info.json").exists() or (local / "state.json").exists():
            try:
                loaded = datasets.load_from_disk(str(local))
            except Exception as err:  # datasets raises many types; the message names the directory
                raise ValueError(f"source {spec!r}: cannot load {local} ({_first_line(err)})") from err
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise ValueError(
                        f"source {spec!r}: no split {split!r} (splits: {', '.join(loaded)}); use hf:{name}:SPLIT"
                    )
                ds = loaded[split]
            else:
                ds = loaded
        else:
            try:
                ds = datasets.load_dataset(name, split=split, revision=options.revision)
            except Exception as err:  # datasets raises many types; the message names the dataset
                hint = f"; choose it with hf:{name}:SPLIT" if "split" in str(err).lower() else ""
                raise ValueError(
                    f"source {spec!r}: cannot load dataset {name!r} split {split!r}: "
                    f"{_first_line(err).rstrip('.')}{hint}"
                ) from err
        public_name = public_spec(f"hf:{name}").removeprefix("hf:")
        image_column = image_column or _pick_column(ds, ("image", "img", "jpg", "png"), datasets.Image, spec, "image")
        label_column = label_column or _pick_column(ds, ("label", "labels", "cls", "class"), None, spec, "label")
        for what, column in (("image", image_column), ("label", label_column), ("key", key_column)):
            if column is not None and column not in ds.column_names:
                raise ValueError(
                    f"source {spec!r}: no column {column!r} (columns: {ds.column_names}); "
                    f"set source_options.{what}_column to one of them"
                )
        image_feature = ds.features[image_column]
        if isinstance(image_feature, datasets.Value) and image_feature.dtype not in ("binary", "large_binary"):
            raise ValueError(
                f"source {spec!r}: image column {image_column!r} holds {image_feature.dtype} values, not images; "
                f"cast it first (ds.cast_column({image_column!r}, datasets.Image()) reads file paths) or choose "
                "another column with source_options.image_column"
            )
        # Read raw bytes: decoding (and its failures) is ours, per sample.
        if isinstance(ds.features[image_column], datasets.Image):
            ds = ds.cast_column(image_column, datasets.Image(decode=False))
        feature = ds.features[label_column]
        _check_label_feature(feature, label_column, spec)
        labels = ds[label_column]
        self.label_space = self._label_space(feature, labels, label_column, spec, options)
        self._ds = ds
        self._image_column = image_column
        keys = ds[key_column] if key_column else [f"{split}_{i:08d}" for i in range(len(ds))]
        raw = [(str(i), str(i), _proposed_key(str(k))) for i, k in enumerate(keys)]
        unique = _unique_keys(raw)
        samples = []
        where = f"label column {label_column!r}"
        for i in range(len(ds)):
            label, problem = check_label(labels[i], self.label_space, where)
            samples.append(SourceSample(unique[str(i)], label, f"{public_name}[{split}][{i}]", problem))
        self._row = {s.key: i for i, s in enumerate(samples)}
        self.samples = sorted(samples, key=lambda s: s.key)

    @staticmethod
    def _label_space(feature: Any, labels: list[Any], column: str, spec: str, options: HFDatasetOptions) -> LabelSpace:
        label_space, class_names, num_classes = options.label_space, options.class_names, options.num_classes
        max_classes = options.max_classes
        if label_space == "imagenet-1k" or (
            label_space is None and class_names is None and num_classes is None and _looks_like_imagenet(feature)
        ):
            return imagenet_label_space()
        # A declared label space (class_names, num_classes) is within max_classes: HFDatasetOptions checks that.
        if class_names is not None:
            return LabelSpace("custom", [_nfc(n) for n in class_names])
        if num_classes is not None:
            return LabelSpace("custom", [str(i) for i in range(num_classes)])
        if getattr(feature, "names", None):
            space = LabelSpace("custom", [_nfc(str(n)) for n in feature.names])
        else:
            # A plain integer column: 0 .. the largest label, if that is a sensible size. The bound is checked
            # before any name is made, so a stray 2**62 costs nothing.
            largest, row = -1, -1
            for i, v in enumerate(labels):
                if isinstance(v, numbers.Real) and not isinstance(v, bool) and _is_integral(v) and int(v) > largest:
                    largest, row = int(v), i
            if largest + 1 > max_classes:
                raise ValueError(
                    f"source {spec!r}: label column {column!r} holds label {largest} (row {row}), which would make a "
                    f"label space of {largest + 1} classes, over the limit of {max_classes}; declare the label space "
                    "with source_options.num_classes or class_names (labels outside it become per-sample failures), "
                    "or raise source_options.max_classes"
                )
            return LabelSpace("custom", [str(i) for i in range(largest + 1)])
        if space.num_classes > max_classes:
            raise ValueError(
                f"source {spec!r}: the label space of label column {column!r} has {space.num_classes} classes, over "
                f"the limit of {max_classes}; raise source_options.max_classes if that many classes are meant"
            )
        return space

    def read(self, sample: SourceSample) -> bytes:
        value = self._ds[self._row[sample.key]][self._image_column]
        if isinstance(value, dict):
            if value.get("bytes") is not None:
                return value["bytes"]
            if value.get("path"):
                return _read_bounded(
                    Path(value["path"]), MAX_IMAGE_BYTES, f"{sample.origin} ({Path(value['path']).name})"
                )
            raise ValueError(f"{sample.origin}: image cell holds neither bytes nor a path")
        if isinstance(value, bytes | bytearray):
            return bytes(value)
        if hasattr(value, "save"):  # an already decoded PIL image
            buf = io.BytesIO()
            value.save(buf, format="PNG")
            return buf.getvalue()
        raise ValueError(f"{sample.origin}: unsupported image cell of type {type(value).__name__}")


def _is_integral(value: Any) -> bool:
    return isinstance(value, numbers.Integral) or (math.isfinite(value) and value == math.floor(value))


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]


def _check_label_feature(feature: Any, column: str, spec: str) -> None:
    """Refuse, up front and naming the column, a label column that cannot hold one class index per image."""
    import datasets

    if isinstance(feature, datasets.ClassLabel):
        return
    dtype = getattr(feature, "dtype", None) if isinstance(feature, datasets.Value) else None
    if dtype is not None and dtype.startswith(("int", "uint", "float")):
        return
    shown = f"{dtype} values" if dtype else f"{type(feature).__name__} values"
    raise ValueError(
        f"source {spec!r}: label column {column!r} holds {shown}, not integer class indices; "
        f"encode it first (ds.class_encode_column({column!r}) turns strings into a ClassLabel) "
        "or choose another column with source_options.label_column"
    )


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


# -- WebDataset shards -------------------------------------------------------------------------------------------------
COMPRESSED_MAGIC = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00")


class _SpoolError(Exception):
    """The temporary copy of a compressed shard's images could not be written (disk full, TMPDIR not writable)."""


@dataclass
class _WdsSample:
    """One sample's members in a shard, as found by the single pass over it."""

    images: dict[str, tuple[str, int, int]] = field(default_factory=dict)  # ext -> ("shard" | "spool", offset, size)
    label_text: str | None = None
    members: set[str] = field(default_factory=set)  # extensions seen, for messages
    problems: list[str] = field(default_factory=list)


class WebDatasetSource(Source):
    """Local WebDataset shards. Members are grouped by key as in webdataset (key = path up to the first dot).

    Each shard is read once, at listing. Headers give every member's size before its data is read, so an oversized
    member is skipped unread (and the sample is a recorded failure). A plain ``.tar`` is then read in place, by
    offset. A compressed shard (gzip, bzip2, xz) cannot be read by offset: its image members are copied, during that
    same pass, to an anonymous temporary file (in ``$TMPDIR``, removed when the source is closed or the process
    ends), so that reading a sample never decompresses the archive again. Image bytes do not compress, so that file
    is about the size of the shards.
    """

    options_class = WebDatasetOptions

    def __init__(self, spec: str, path: str, options: WebDatasetOptions | None = None, /, **values: Any):
        options = stage_options(type(self), options, values)
        super().__init__(spec=spec, kind="wds", options=options)
        import braceexpand

        self.max_image_bytes = options.max_image_bytes
        try:
            shards = [Path(p).expanduser() for p in braceexpand.braceexpand(path)]
        except ValueError as err:  # UnbalancedBracesError
            raise ValueError(f"source {spec!r}: {err} (brace patterns look like shard-{{000000..000009}}.tar)") from err
        folders = [str(p) for p in shards if p.is_dir()]
        if folders:
            raise ValueError(
                f"source {spec!r}: {folders[0]} is a folder; name the shards in it, e.g. wds:{folders[0]}/"
                "shard-{000000..000009}.tar"
            )
        missing = [str(p) for p in shards if not p.is_file()]
        if missing:
            raise ValueError(
                f"source {spec!r}: {len(missing)} of {len(shards)} shard(s) not found ({missing[:3]}); check the path "
                "and the brace pattern"
            )
        # WebDatasetOptions refuses the contradicting combinations: class names mean a custom space.
        if options.class_names is not None:
            self.label_space = LabelSpace("custom", [_nfc(n) for n in options.class_names])
        else:
            self.label_space = imagenet_label_space()
        common = os.path.commonpath([os.path.abspath(p.parent) for p in shards])
        self._spool: BinaryIO | None = None
        self._shards: dict[str, Path] = {}
        self._images: dict[str, tuple[str, str, int, int] | None] = {}
        raw: list[tuple[str, str, str]] = []
        found: dict[str, tuple[str, _WdsSample]] = {}
        for shard in shards:
            shard_name = _nfc(os.path.relpath(os.path.abspath(shard), common).replace(os.sep, "/"))
            self._shards[shard_name] = shard
            for base, sample in self._scan(shard, shard_name).items():
                identity = f"{shard_name}::{base}"
                raw.append((identity, _nfc(identity), _proposed_key(base.rsplit("/", 1)[-1])))
                found[identity] = (shard_name, sample)
        unique = _unique_keys(raw)
        samples = []
        for identity, (shard_name, sample) in found.items():
            label, problem = -1, None
            if sample.problems:
                problem = "; ".join(sample.problems)
            elif not sample.images:
                expected = ", ".join(WDS_IMAGE_EXTS)
                problem = f"no image member (expected one of {expected}; found {sorted(sample.members)[:10]})"
            elif sample.label_text is None:
                problem = f"no label member .cls (found {sorted(sample.members)[:10]})"
            elif not re.fullmatch(r"[+-]?[0-9]+", sample.label_text):
                problem = f"label member .cls holds {sample.label_text[:20]!r}, not an integer"
            else:
                label, problem = check_label(int(sample.label_text), self.label_space, "member .cls")
            # Several image members: the first of jpg, jpeg, png, webp, as webdataset readers pick.
            ext = next((e for e in WDS_IMAGE_EXTS if e in sample.images), None)
            self._images[unique[identity]] = None if ext is None else (shard_name, *sample.images[ext])
            samples.append(SourceSample(unique[identity], label, f"{identity}.{ext or 'cls'}", problem))
        self.samples = sorted(samples, key=lambda s: s.key)

    def _scan(self, shard: Path, shard_name: str) -> dict[str, _WdsSample]:
        """One pass over a shard: its samples' members, sizes and labels, reading no member over the limits."""
        groups: dict[str, _WdsSample] = {}
        seen: dict[str, int] = {}
        try:
            with open(shard, "rb") as raw:
                compressed = raw.read(6).startswith(COMPRESSED_MAGIC)
                raw.seek(0)
                # "r|*" streams (each byte decompressed once); "r:" seeks over member data it does not read.
                with tarfile.open(fileobj=raw, mode="r|*" if compressed else "r:") as tar:
                    for info in tar:
                        self._add_member(tar, info, compressed, groups, seen, shard_name)
                        tar.members.clear()  # tarfile keeps every header it read; memory stays per sample, not member
        except _SpoolError as err:
            raise ValueError(
                f"source {self.spec!r}: cannot copy the images of compressed shard {shard} to a temporary file in "
                f"{tempfile.gettempdir()} ({err}); free space there, set TMPDIR to a larger disk, or decompress the "
                "shards to plain .tar (read in place)"
            ) from err
        except (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError) as err:
            raise ValueError(
                f"source {self.spec!r}: {shard} is not a readable tar archive ({_first_line(err)}); "
                "repair or leave out that shard"
            ) from err
        return groups

    def _add_member(
        self,
        tar: tarfile.TarFile,
        info: tarfile.TarInfo,
        compressed: bool,
        groups: dict[str, _WdsSample],
        seen: dict[str, int],
        shard_name: str,
    ) -> None:
        name = info.name
        slash = name.rfind("/")
        dot = name.find(".", slash + 1)
        if dot < 0:
            return
        base, ext = name[:dot], name[dot + 1 :].lower()
        if info.isdir() and ext not in WDS_IMAGE_EXTS and ext != "cls":
            return
        sample = groups.setdefault(base, _WdsSample())
        sample.members.add(_shown(ext))
        shown = _shown(name)
        seen[name] = seen.get(name, 0) + 1
        if seen[name] == 2:
            sample.problems.append(f"member {shown} appears more than once in {_shown(shard_name)}")
        if ext not in WDS_IMAGE_EXTS and ext != "cls":
            return  # captions, metadata: not needed, not read
        if not info.isfile() or info.issparse():  # a GNU sparse member's bytes are not where its header says
            sample.problems.append(f"member {shown} is not a regular file")
            return
        if ext == "cls":
            if info.size > MAX_LABEL_BYTES:
                sample.problems.append(f"label member {shown} is {info.size} bytes, not one integer")
                return
            data = tar.extractfile(info).read()  # type: ignore[union-attr]
            sample.label_text = data.decode("utf-8", errors="replace").strip()
            return
        if info.size > self.max_image_bytes:
            sample.problems.append(
                f"image member {shown} is {info.size} bytes, over the {self.max_image_bytes}-byte limit "
                "(source option max_image_bytes)"
            )
            return
        if compressed:
            member = tar.extractfile(info)
            try:
                spool = self._spool_file()
                offset = spool.seek(0, os.SEEK_END)
            except OSError as err:
                raise _SpoolError(err.strerror or str(err)) from err
            while chunk := member.read(1 << 20):  # type: ignore[union-attr]  (a corrupt stream raises here)
                try:
                    spool.write(chunk)
                except OSError as err:
                    raise _SpoolError(err.strerror or str(err)) from err
            sample.images[ext] = ("spool", offset, info.size)
        else:
            sample.images[ext] = ("shard", info.offset_data, info.size)

    def _spool_file(self) -> BinaryIO:
        if self._spool is None:
            self._spool = tempfile.TemporaryFile(prefix="lance-cf-wds-")  # noqa: SIM115 (lives as long as the source)
        return self._spool

    def read(self, sample: SourceSample) -> bytes:
        location = self._images[sample.key]
        if location is None:
            raise ValueError(f"{sample.origin}: no image member (expected one of {', '.join(WDS_IMAGE_EXTS)})")
        shard_name, where, offset, size = location
        if where == "spool":
            assert self._spool is not None
            self._spool.flush()
            data = os.pread(self._spool.fileno(), size, offset)
        else:
            try:
                with open(self._shards[shard_name], "rb") as f:
                    f.seek(offset)
                    data = f.read(size)
            except OSError as err:
                raise ValueError(f"{_shown(shard_name)}: cannot read: {err.strerror or type(err).__name__}") from err
        if len(data) != size:
            raise ValueError(f"{sample.origin}: {len(data)} of {size} bytes could be read (shard changed or truncated)")
        return data

    def close(self) -> None:
        if self._spool is not None:
            self._spool.close()
            self._spool = None


# -- creating a source -------------------------------------------------------------------------------------------------
def source_class(spec: Any) -> tuple[type, str]:
    """The registered source class ``SCHEME:ARG`` names, and its ARG; a bad spec is a one-line ``ValueError``."""
    if not isinstance(spec, str):
        raise ValueError(f"source {spec!r}: expected a string SCHEME:ARG (e.g. imagefolder:/data/images)")
    scheme, sep, arg = spec.partition(":")
    if scheme == "demo":
        if arg:
            raise ValueError(f"source {spec!r}: demo takes no argument; write --source demo")
    elif not sep or not arg:
        raise ValueError(
            f"source {spec!r}: expected SCHEME:ARG with SCHEME one of {', '.join(SOURCES.names())} "
            "(e.g. imagefolder:/data/images, hf:user/dataset:test)"
        )
    return SOURCES.resolve(scheme), arg


def check_source_options(spec: Any, options: dict[str, Any] | None) -> Any:
    """The source's typed options (its ``options_class``) from a config's ``source_options``, defaults filled in:
    constructed, and so checked, by the stages' checker (``check_options``: an unknown name with "did you mean", each
    value against its annotation, then the relations between options). Nothing is read from disk.

    Raises ``ValueError`` in one line naming the source and the option."""
    cls, _ = source_class(spec)
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"source_options {options!r}: expected a mapping of option names to values")
    return check_options(cls, options or {}, f"source {spec!r}")


def create_source(spec: str, options: Any = None) -> Source:
    """Build a source from ``SCHEME:ARG`` and its options: the typed options validation made
    (``check_source_options``), not constructed again, or a mapping (checked here); a bad spec or option is a
    one-line ``ValueError``."""
    cls, arg = source_class(spec)
    if not isinstance(options, options_type(cls)):
        options = check_source_options(spec, options)
    if getattr(cls, "options_class", None) is None:  # options derived from the constructor: passed as keywords
        return cls(spec, arg, **option_values(options))
    return cls(spec, arg, options)
