"""Publish a release directory as a versioned Hugging Face Hub dataset, and add evaluation results to it.

A release is one atomic commit on the target branch (``create_commit``: binary files go through the Hub's large-file
path, LFS or Xet, as the client and server agree) followed by a tag ``v<version>`` on that commit, so
``load_dataset("ORG/NAME", CONFIG, split="test", revision="v<version>")`` loads exactly that release forever. A newer
release replaces the files on the branch; older ones stay reachable by their tags.

What is uploaded is exactly what the manifest lists (``manifest.json``, ``_info.json``, the shards, the metadata
indexes) plus the card with its assets and ``croissant.json``, rendered for the target repo into a temporary staging
directory: the release directory is only read (it may be read-only), nothing else under it is uploaded (each other
file is named in the plan, or refused with ``strict``), and symbolic links are never followed. Everything that can be checked is checked before the first remote
change: no build holds the directory, ``verify``, the configs (none empty that the release needs), ``load_dataset``
reading every config of the staged release, no machine path and no token in published text, the tag not yet taken,
the card's metadata accepted by the Hub.

Resuming is re-running: large files already uploaded are skipped by the LFS batch answer, files identical on the
branch are dropped from the commit by the client, and a commit already made (interrupted before tagging) turns the
second commit into a no-op that returns the existing head, which is then tagged. A version whose tag exists is
refused. The token comes from huggingface_hub's standard sources (``HF_TOKEN``, ``hf auth login``); it is never logged,
printed or written here, only compared with what would be published. ``HF_ENDPOINT`` is honoured at call time, so self-hosted hubs work; credentials in it are
redacted from everything printed (:func:`redact_url`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

import dataset_cards
from builder import release_format as rf
from builder.croissant import croissant_about
from builder.release_format.lock import output_lock
from builder.release_format.yaml_text import dump_yaml
from dataset_cards.card import replace_leaderboard_section
from evaluation.leaderboard import build_leaderboard_by_config, leaderboard_markdown
from evaluation.results import is_complete, is_results, missing_default_metrics, validate_results

logger = logging.getLogger(__name__)

REPO_TYPE = "dataset"
RESULTS_DIR = "results"
LEADERBOARD_NAME = "leaderboard.md"
# The leaderboard as a table on the dataset repo: Parquet for pandas/SQL, and the same rows as one WebDataset shard
# for the `leaderboard` config, `load_dataset(REPO, "leaderboard", split="train")` (see leaderboard_tar for why).
LEADERBOARD_PARQUET = "leaderboard.parquet"
LEADERBOARD_TAR = "leaderboard.tar"
LEADERBOARD_CONFIG = "leaderboard"
LEADERBOARD_SPLIT = "train"
# Paths on the branch that a release commit never deletes: results accumulate across versions.
PROTECTED_PREFIXES = (f"{RESULTS_DIR}/", ".gitattributes")
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
# The Hub's access-request modes (``HfApi.update_repo_settings(gated=...)``).
GATED_MODES = ("auto", "manual")
# Configs a LANCE release is about: one of them requested by the build but left empty makes the release unusable.
REQUIRED_CONFIGS = ("original", "counterfactual")
RETRY_ATTEMPTS = 3
RETRY_WAIT_S = 0.5
MAX_LISTED_LEFT_OUT = 30
LOAD_CHECK_BATCH = 256  # rows per batch when publish reads a staged config (batched: ~8x faster than row by row)
T = TypeVar("T")

# ``scheme://user:password@host``: the userinfo part is replaced before any URL is printed or logged.
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]*@")
# An absolute path of this machine inside a string: ``/x/...`` at the start, after whitespace, a quote, ``=``, ``(``,
# ``,`` or a spec prefix such as ``imagefolder:`` (but not the ``//`` of a URL); ``file://`` URLs; ``~/``; ``C:\\``.
_LOCAL_PATH = re.compile(
    r"""(?:file://[^\s"'`)]+"""
    r"""|(?:(?<=^)|(?<=[\s"'=(,])|(?<=[A-Za-z0-9]:))/(?!/)[^\s"'`),]+"""
    r"""|(?:(?<=^)|(?<=[\s"'=(,:]))~/[^\s"'`),]*"""
    r"""|(?:(?<=^)|(?<=[\s"'=(,:]))[A-Za-z]:\\[^\s"'`),]*)"""
)


class PublishError(RuntimeError):
    """The publication was refused (tag exists, verification failed, stray files under --strict, ...)."""


@dataclass
class PlannedFile:
    path_in_repo: str
    local_path: Path
    size: int


@dataclass
class PublishPlan:
    """What a publish uploads. ``left_out`` names every other file under the release directory, with the reason."""

    repo_id: str
    revision: str
    tag: str
    version: str
    endpoint: str = ""
    files: list[PlannedFile] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)
    gated: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def describe(self) -> str:
        """The human-readable plan printed by ``--dry-run`` (credentials in the endpoint redacted)."""
        lines = [
            f"repo: datasets/{self.repo_id}" + (f" on {redact_url(self.endpoint)}" if self.endpoint else ""),
            f"target revision: {self.revision}",
            f"tag: {self.tag}",
            f"gating: {self.gated} (the card asks users to accept terms)" if self.gated else "gating: none",
            f"files: {len(self.files)} ({_human(self.total_bytes)})",
        ]
        lines += [f"  {f.path_in_repo}  {_human(f.size)}" for f in self.files]
        if self.left_out:
            lines.append(f"left out (not listed in the manifest; --strict refuses them): {len(self.left_out)}")
            lines += [f"  {item}" for item in self.left_out[:MAX_LISTED_LEFT_OUT]]
            if len(self.left_out) > MAX_LISTED_LEFT_OUT:
                lines.append(f"  ... and {len(self.left_out) - MAX_LISTED_LEFT_OUT} more")
        lines += [f"note: {note}" for note in self.notes]
        return redact_url("\n".join(lines))


@dataclass
class PublishResult:
    repo_id: str
    tag: str
    commit: str
    url: str
    files: int
    gated: str | None = None


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


def redact_url(text: str) -> str:
    """``text`` with the ``user:password@`` part of every URL in it replaced by ``***@``."""
    return _URL_USERINFO.sub(r"\1***@", text)


def check_repo_id(repo_id: str) -> str:
    if not REPO_ID.match(repo_id or ""):
        raise ValueError(f"--repo-id {repo_id!r} is not a Hub repo id; expected ORG/NAME")
    return repo_id


def load_manifest(release_dir: Path) -> dict[str, Any]:
    """The release's ``manifest.json`` as stored, validated by the release format (a missing field is named)."""
    path = Path(release_dir) / rf.MANIFEST_NAME
    if path.is_symlink() or not path.is_file():
        raise ValueError(f"{release_dir} is not a release directory: {rf.MANIFEST_NAME} is missing (or a link)")
    manifest = rf.read_manifest_dict(path)
    rf.parse_release_version(manifest["version"])
    return manifest


# ------------------------------------------------------------------------------------------------ what is published
def listed_files(release_dir: Path, manifest: dict[str, Any]) -> list[str]:
    """The release files the manifest accounts for (itself, ``_info.json``, every shard and, from format v2, each
    config's metadata index), checked to be regular files inside the release reached without following a link.

    Raises:
        PublishError: a listed path escapes the release, passes through a link, or is not a regular file.
    """
    paths = [rf.MANIFEST_NAME, rf.TIMM_INFO_NAME, *(str(s["path"]) for s in manifest.get("shards", []))]
    if int(manifest.get("format_version", 1)) >= 2:  # the metadata indexes croissant.json reads
        paths += [rf.index_path(str(c)) for c in manifest.get("configs") or []]
    for rel in paths:
        _check_inside(Path(release_dir), rel)
    return paths


def _check_inside(root: Path, rel: str) -> None:
    problem = rf.listed_path_problem(root, rel)
    if problem is not None:
        raise PublishError(f"{root}: {problem}")


def find_left_out(release_dir: Path, published: set[str]) -> list[str]:
    """Every entry under ``release_dir`` that is not published (the work directory aside), as ``path (reason)``.

    A directory holding nothing published is named once (``.git/ (directory, 12 files, ...)``); links are named, never
    followed.
    """
    root = Path(release_dir)
    needed_dirs = {str(parent) for p in published for parent in PurePosixPath(p).parents}
    collapsed: dict[str, int] = {}
    items: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        base = PurePosixPath(Path(dirpath).relative_to(root).as_posix())
        if base == PurePosixPath("."):
            dirnames[:] = [d for d in dirnames if d != rf.WORK_DIR]
        for name in sorted(dirnames):
            if os.path.islink(Path(dirpath) / name):
                items.append(f"{base / name} (symbolic link, not followed)")
        dirnames[:] = sorted(d for d in dirnames if not os.path.islink(Path(dirpath) / d))
        for name in sorted(filenames):
            rel = str(base / name)
            if rel in published:
                continue
            parts = PurePosixPath(rel).parts
            outer = [str(PurePosixPath(*parts[:i])) for i in range(1, len(parts))]
            top = next((d for d in outer if d not in needed_dirs), None)
            if top is not None:
                collapsed[top] = collapsed.get(top, 0) + 1
            elif os.path.islink(root / rel):
                items.append(f"{rel} (symbolic link, not followed)")
            else:
                items.append(f"{rel} (not listed in the manifest)")
    items += [
        f"{d}/ (directory, {n} file{'s' if n != 1 else ''}, not listed in the manifest)" for d, n in collapsed.items()
    ]
    return sorted(items)


def check_configs(manifest: dict[str, Any]) -> list[str]:
    """Refuse a release that ``load_dataset`` could not open because a config it needs is empty; return notes on
    optional configs that were left out empty.
    """
    name = f"release {manifest.get('name')!r} {manifest.get('version')}"
    empty = [str(c) for c in manifest.get("empty_configs") or []]
    configs = list(manifest.get("configs") or [])
    counts = manifest.get("counts") or {}
    zero = [c for c in configs if not (counts.get(c) or {}).get("total")]
    failures = len(manifest.get("failures") or [])
    hint = f" ({failures} failure(s) recorded in manifest.json)" if failures else ""
    if not configs or zero:
        raise PublishError(
            f"{name} has no samples in {'any config' if not configs else 'config(s) ' + ', '.join(zero)}{hint}: "
            "load_dataset could not open it; fix the source or the stages and rebuild"
        )
    required_empty = [c for c in empty if c in REQUIRED_CONFIGS]
    if required_empty:
        raise PublishError(
            f"{name}: required config(s) {', '.join(required_empty)} have no samples{hint}, so "
            f"load_dataset(REPO, {required_empty[0]!r}) could not open them; fix the build and rebuild"
        )
    return [f"config {c} has no samples and is not part of the release" for c in empty]


# Where a manifest or a results JSON names a class: a label name is data, whatever its shape (Open Images names its
# classes /m/01g317), never a machine path, so the path guard neither refuses nor rewrites it.
LABEL_NAMES_AT = "label_space.names"
LABEL_NAME_KEY = "label_name"


def label_names_of(manifest: dict[str, Any]) -> set[str]:
    """The class names of a manifest's label space (data the path guard leaves alone, in the card too)."""
    names = (manifest.get("label_space") or {}).get("names") or []
    return {name for name in names if isinstance(name, str)}


def _is_label(where: str, value: str, labels: set[str] | frozenset[str]) -> bool:
    key = where.rsplit(".", 1)[-1]
    return value in labels or key == LABEL_NAME_KEY or where.startswith(LABEL_NAMES_AT + "[")


def local_paths(obj: Any, where: str = "", labels: set[str] | frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """Every (key path, string) in a JSON-like object whose string holds an absolute path of this machine; class names
    (``labels``, the label space, ``label_name`` fields) are data, not paths."""
    found: list[tuple[str, str]] = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            found += local_paths(value, f"{where}.{key}" if where else str(key), labels)
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            found += local_paths(value, f"{where}[{i}]", labels)
    elif isinstance(obj, str) and _LOCAL_PATH.search(obj) and not _is_label(where, obj, labels):
        found.append((where or "(root)", obj))
    return found


def local_paths_in_text(text: str, labels: set[str] | frozenset[str]) -> list[str]:
    """The machine paths in a rendered text (the card), once the class names it quotes are set aside."""
    for name in sorted(labels, key=len, reverse=True):  # longest first: a name inside another is not cut in two
        if _LOCAL_PATH.search(name):
            text = text.replace(name, " ")
    return [m.group(0) for m in _LOCAL_PATH.finditer(text)]


def scrub_local_paths(obj: Any) -> tuple[Any, list[str]]:
    """A copy of ``obj`` where every absolute machine path inside a string is replaced by its last component, and the
    key paths that changed; class names (``label_name`` fields, a label space's names) are data and stay as they are."""
    changed: list[str] = []

    def scrub(value: Any, where: str) -> Any:
        if isinstance(value, dict):
            return {k: scrub(v, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
        if isinstance(value, list):
            return [scrub(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, str) and _LOCAL_PATH.search(value) and not _is_label(where, value, frozenset()):
            changed.append(where or "(root)")
            return _LOCAL_PATH.sub(lambda m: _last_component(m.group(0)), value)
        return value

    return scrub(obj, ""), changed


def _last_component(path: str) -> str:
    parts = [p for p in re.split(r"[/\\]", path.removeprefix("file://")) if p and p != "~"]
    return parts[-1] if parts else "<local path>"


def _refuse_local_paths(what: str, found: list[tuple[str, str]]) -> None:
    if found:
        listed = "; ".join(f"{key} = {value[:80]!r}" for key, value in found[:5])
        more = f" (and {len(found) - 5} more)" if len(found) > 5 else ""
        raise PublishError(
            f"{what} holds local machine paths: {listed}{more}. Published files carry no machine paths: rebuild with "
            "the current lance-cf (it records sources and models without them), or pass --allow-local-paths to "
            "publish them as they are"
        )


def refuse_token(contents: dict[str, bytes]) -> None:
    """Refuse to publish text that holds the Hugging Face token this process would upload with.

    The token is looked up (``huggingface_hub.get_token``: ``HF_TOKEN``, then the saved login) only to compare; it is
    never printed. The shards are not scanned (the manifest, the card and results JSONs are the text a stray token
    could reach).

    Raises:
        PublishError: naming the file.
    """
    from huggingface_hub import get_token

    token = get_token()
    if not token or len(token) < 8:
        return
    for name, data in contents.items():
        if token.encode() in data:
            raise PublishError(
                f"{name} holds the Hugging Face token this command would publish with; remove it and re-run "
                "(and revoke the token if it was shared)"
            )


def card_gating(card_text: str) -> bool:
    """Whether the card's YAML asks users to accept terms (``extra_gated_*`` or ``gated``)."""
    try:
        meta, _ = rf.split_card(card_text, "the card")
    except ValueError:  # no front matter, or not a mapping: nothing asks for terms
        return False
    return bool(meta.get("gated") or any(k.startswith("extra_gated_") for k in meta))


def stage_release(
    release_dir: Path,
    staging: Path,
    manifest: dict[str, Any],
    repo_id: str,
    previous_manifest: dict[str, Any] | None = None,
) -> tuple[list[PlannedFile], list[str]]:
    """Lay out exactly what is uploaded under ``staging``: links to the listed release files and the card (with its
    assets) rendered there for ``repo_id``. Returns the planned files and the names of the rendered card files.

    The card is rendered again because the build did not know the repo id (its loading and evaluation snippets name
    the repo users load from) and the changelog compares against the version published before this one. Rendering is
    deterministic, so a resumed publish uploads the same bytes.
    """
    release_dir = Path(release_dir).resolve()
    listed = listed_files(release_dir, manifest)
    for rel in listed:
        target = staging / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(release_dir / rel, target)
    # Through the package, so that a test (or a caller) replacing dataset_cards.render_release_card is heard.
    dataset_cards.render_release_card(staging, manifest, previous_manifest=previous_manifest, repo_id=repo_id)
    if int(manifest.get("format_version", 1)) >= 2:
        stage_croissant(staging, manifest, repo_id)
    card_files = sorted(
        p.relative_to(staging).as_posix()
        for p in staging.rglob("*")
        if p.is_file() and not p.is_symlink() and p.relative_to(staging).as_posix() not in listed
    )
    _check_recorded_assets(
        staging, manifest, [rel for rel in card_files if rel not in (rf.CARD_NAME, rf.CROISSANT_NAME)]
    )
    files = [PlannedFile(rel, staging / rel, (staging / rel).stat().st_size) for rel in sorted({*listed, *card_files})]
    return files, card_files


def stage_croissant(staging: Path, manifest: dict[str, Any], repo_id: str) -> dict[str, Any]:
    """Write ``croissant.json`` for the repo into ``staging``: the release's document plus what describes the
    publication, the repo's page (``url``) and its date (``datePublished``), then check it with mlcroissant.

    The date is the config's ``release_date`` when the release has one (then the release's own ``croissant.json``
    already says it); otherwise today's, the one fact of a publication that such a release cannot know (its own
    ``croissant.json`` has none, and mlcroissant notes that a recommended property is missing).

    Raises:
        PublishError: mlcroissant finds an error or a warning in the document.
    """
    import datetime

    typed = rf.Manifest.from_dict(manifest)
    indexes = {c: rf.file_sha256(staging / rf.index_path(c)) for c in typed.configs}
    endpoint = _URL_USERINFO.sub(r"\1", _endpoint()).rstrip("/")
    publication = {
        "url": f"{endpoint}/datasets/{repo_id}",
        "datePublished": typed.config.get("release_date")
        or datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
    }
    document = rf.croissant_document(typed, indexes, croissant_about(typed, publication=publication))
    (staging / rf.CROISSANT_NAME).write_bytes(rf.canonical_json(document))
    issues = croissant_issues(staging / rf.CROISSANT_NAME)
    if issues:
        raise PublishError(f"mlcroissant does not accept the release's croissant.json: {'; '.join(issues[:5])}")
    return document


def croissant_issues(path: Path) -> list[str]:
    """mlcroissant's errors and warnings about a ``croissant.json`` (its structure and references; no file is
    downloaded or read), each as one line; empty when it accepts the document as it is."""
    import logging as std_logging

    import mlcroissant as mlc

    caught: list[str] = []

    class _Collect(std_logging.Handler):
        def emit(self, record: std_logging.LogRecord) -> None:
            caught.append(" ".join(record.getMessage().split()))

    handler = _Collect(level=std_logging.WARNING)
    root = std_logging.getLogger()
    root.addHandler(handler)
    try:
        dataset = mlc.Dataset(str(path))
    except mlc.ValidationError as err:
        return [" ".join(str(err).split())]
    finally:
        root.removeHandler(handler)
    issues = dataset.metadata.ctx.issues
    return sorted({*issues.errors, *issues.warnings}) or caught


def _check_recorded_assets(staging: Path, manifest: dict[str, Any], rendered: list[str]) -> None:
    """A manifest that records the card's assets (format v2) must get exactly those bytes from the card rendered for
    the repo: the gallery does not depend on the repo, so a difference means the renderer changed since the build, and
    the published release would fail ``verify``."""
    recorded = {str(a["path"]): a for a in manifest.get("assets") or []}
    if not recorded and int(manifest.get("format_version", 1)) < 2:
        return
    import hashlib

    differ = sorted(set(recorded) ^ set(rendered))
    for rel in sorted(set(recorded) & set(rendered)):
        if hashlib.sha256((staging / rel).read_bytes()).hexdigest() != recorded[rel].get("sha256"):
            differ.append(rel)
    if differ:
        raise PublishError(
            f"the card assets rendered for the repo differ from those manifest.json records ({', '.join(differ[:5])}); "
            "rebuild the release with this version of lance-cf"
        )


def check_loadable(staging: Path, manifest: dict[str, Any], release_dir: Path) -> None:
    """Open every config of the staged release with ``datasets`` as a user would (the card's YAML decides which files
    and features), and read every row of it (streaming, in batches, images not decoded); the Hub serves the same
    files, so a config that fails here would fail for everyone.

    Checked per config: the data files the card resolves to are exactly the manifest's shards of that config, every
    row casts to the declared features, and the row count is the manifest's.

    Raises:
        PublishError: naming the config and the reason.
    """
    import datasets

    cache = staging.parent / "datasets-cache"
    for config in manifest["configs"]:
        expected = manifest["counts"][config]["total"]
        shards = {str(s["path"]) for s in manifest["shards"] if s["config"] == config}
        try:
            builder = datasets.load_dataset_builder(str(staging), config, cache_dir=str(cache))
            resolved = {_relative_to(str(f), staging) for f in (builder.config.data_files or {}).get(rf.SPLIT, [])}
            rows = 0
            if resolved == shards:
                stream = builder.as_streaming_dataset(split=rf.SPLIT).decode(False)
                rows = sum(len(batch["__key__"]) for batch in stream.iter(batch_size=LOAD_CHECK_BATCH))
        except Exception as exc:  # noqa: BLE001 - any failure to load is the finding, reported in one line
            reason = " ".join(str(exc).split())[:300]
            raise PublishError(
                f"{release_dir}: load_dataset cannot open config {config!r} ({type(exc).__name__}: {reason}); "
                "the release would not load from the Hub, so it is not published"
            ) from exc
        if resolved != shards:
            missing, extra = sorted(shards - resolved), sorted(resolved - shards)
            raise PublishError(
                f"{release_dir}: the card's config {config!r} resolves to {len(resolved)} data file(s), the manifest "
                f"lists {len(shards)} (missing: {', '.join(missing[:3]) or 'none'}; extra: {', '.join(extra[:3]) or 'none'}); "
                "the release would not load as built, so it is not published"
            )
        if rows != expected:
            raise PublishError(
                f"{release_dir}: load_dataset reads {rows} rows of config {config!r}, the manifest says {expected}; "
                "the release would not load as built, so it is not published"
            )


def _relative_to(path: str, root: Path) -> str:
    for base in (root, root.resolve()):
        try:
            return Path(path).relative_to(base).as_posix()
        except ValueError:
            continue
    return path


def plan_release(
    release_dir: Path,
    repo_id: str,
    revision: str = "main",
    *,
    strict: bool = False,
    gated: str | None = None,
    allow_local_paths: bool = False,
    verify: bool = True,
) -> PublishPlan:
    """The plan of a publish, from local checks only (no network): what ``--dry-run`` prints.

    The card files in the plan are rendered into a temporary directory that is removed on return (their sizes are
    kept); a real publish renders them again with the changelog against the previous version on the Hub.

    Raises:
        ValueError: a bad argument or a directory that is not a release.
        PublishError: a check failed (see :func:`publish_release`).
    """
    release_dir = Path(release_dir)
    with release_lock(release_dir), tempfile.TemporaryDirectory(prefix="lance-cf-publish-") as tmp:
        manifest, notes = _local_checks(release_dir, repo_id, gated, allow_local_paths, verify)
        return _stage(
            release_dir, repo_id, revision, Path(tmp), manifest, notes, None, strict, gated, allow_local_paths
        )


@contextlib.contextmanager
def release_lock(release_dir: Path) -> Iterator[None]:
    """Hold the release directory for reading while publishing: a build (which holds it exclusively for its whole
    life) refuses to start, and a publish refuses a directory a build holds, naming its pid (``builder.release_format.lock``).

    Shared, not exclusive: publish only reads the directory (it may be read-only) and writes nothing into it, not
    even the lock's holder file; several verifies or publishes of one finished release may run together.

    Raises:
        ValueError: ``release_dir`` is not a directory, or ``builder.release_format.lock.OutputLocked`` naming the holder.
    """
    if not Path(release_dir).is_dir():
        raise ValueError(f"{release_dir}: no such directory (expected a release directory made by `lance-cf build`)")
    with output_lock(release_dir, "publish", shared=True):
        yield


def _local_checks(
    release_dir: Path, repo_id: str, gated: str | None, allow_local_paths: bool, verify: bool
) -> tuple[dict[str, Any], list[str]]:
    """The checks that need neither the Hub nor the rendered card, in the order a user would fix them."""
    check_repo_id(repo_id)
    if gated is not None and gated not in GATED_MODES:
        raise ValueError(f"--gated {gated!r}: expected one of {', '.join(GATED_MODES)}")
    manifest = load_manifest(release_dir)
    notes = check_configs(manifest)
    notes.append(rf.viewer_statement(manifest))
    listed_files(release_dir, manifest)
    if not allow_local_paths:
        _refuse_local_paths(f"{release_dir}/{rf.MANIFEST_NAME}", local_paths(manifest, labels=label_names_of(manifest)))
    if verify:
        verify_before_publish(release_dir)
    return manifest, notes


def _stage(
    release_dir: Path,
    repo_id: str,
    revision: str,
    tmp: Path,
    manifest: dict[str, Any],
    notes: list[str],
    previous_manifest: dict[str, Any] | None,
    strict: bool,
    gated: str | None,
    allow_local_paths: bool,
) -> PublishPlan:
    """Stage the upload, then check what only the staged files tell: the card, strays, ``load_dataset``."""
    staging = tmp / "release"
    staging.mkdir()
    files, card_files = stage_release(release_dir, staging, manifest, repo_id, previous_manifest)
    card_text = (staging / rf.CARD_NAME).read_text(encoding="utf-8")
    texts = (rf.MANIFEST_NAME, rf.TIMM_INFO_NAME, rf.CARD_NAME, rf.CROISSANT_NAME)
    refuse_token({name: (staging / name).read_bytes() for name in texts if (staging / name).is_file()})
    if not allow_local_paths:
        in_card = [(rf.CARD_NAME, path) for path in local_paths_in_text(card_text, label_names_of(manifest))]
        _refuse_local_paths(f"the card rendered for {release_dir}", in_card)
    left_out = find_left_out(release_dir, {f.path_in_repo for f in files} | set(card_files))
    if strict and left_out:
        raise PublishError(
            f"{release_dir} holds {len(left_out)} entries the manifest does not list (--strict): "
            f"{'; '.join(left_out[:MAX_LISTED_LEFT_OUT])}; move them out of the release or drop --strict"
        )
    check_loadable(staging, manifest, release_dir)
    mode = gated or ("auto" if card_gating(card_text) else None)
    return PublishPlan(
        repo_id, revision, f"v{manifest['version']}", manifest["version"], _endpoint(), files, left_out, mode, notes
    )


def verify_before_publish(release_dir: Path) -> None:
    """Run ``lance-cf verify``'s checks; a release with any problem is not published."""
    problems = rf.verify_release(Path(release_dir))
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise PublishError(f"{release_dir} failed verification; not publishing:\n{listed}{more}")


def _endpoint() -> str:
    """``$HF_ENDPOINT`` read now (huggingface_hub fixed its default at import), or huggingface_hub's default."""
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


def create_api(endpoint: str | None = None):
    """An ``HfApi`` on ``endpoint`` or ``$HF_ENDPOINT`` (read now, not at import) with the standard token sources."""
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint or _endpoint())


def _is_transient(exc: Exception) -> bool:
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        return exc.response.status_code in (408, 429, 500, 502, 503, 504)
    try:
        import httpx2

        return isinstance(exc, httpx2.TransportError)
    except ImportError:  # pragma: no cover - httpx2 is a huggingface_hub dependency
        return False


def _retry(what: str, fn: Callable[[], T]) -> T:
    """Retry an idempotent Hub call on transient errors (each step of a publish is safe to repeat)."""
    for attempt in range(1, RETRY_ATTEMPTS + 1):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - filtered by _is_transient, re-raised otherwise
            if attempt == RETRY_ATTEMPTS or not _is_transient(exc):
                raise
            logger.warning("%s failed (%s); retrying (%d/%d)", what, type(exc).__name__, attempt, RETRY_ATTEMPTS - 1)
            time.sleep(RETRY_WAIT_S * attempt)
    raise AssertionError("unreachable")


def _branch_head(api: Any, repo_id: str, revision: str) -> tuple[str | None, dict[str, str]]:
    refs = api.list_repo_refs(repo_id, repo_type=REPO_TYPE)
    head = next((b.target_commit for b in refs.branches if b.name == revision), None)
    return head, {t.name: t.target_commit for t in refs.tags}


def publish_release(
    release_dir: Path,
    repo_id: str,
    *,
    private: bool = False,
    dry_run: bool = False,
    revision: str = "main",
    verify: bool = True,
    strict: bool = False,
    gated: str | None = None,
    allow_local_paths: bool = False,
    api: Any = None,
) -> PublishPlan | PublishResult:
    """Upload a release and tag it ``v<version>``; return the plan when ``dry_run`` (no network at all).

    Args:
        strict: refuse a release directory holding files the manifest does not list (else they are left out).
        gated: the Hub's access-request mode, ``auto`` or ``manual``, set when the card says gated (or when given).
            ``None``: ``auto``, or the mode the repo already has.
        allow_local_paths: publish a manifest or card that holds machine paths.

    Raises:
        ValueError: a bad argument or a directory that is not a release.
        PublishError: a local check failed (verification, empty config, load_dataset, stray files under ``strict``,
            machine paths), the version's tag already exists on the Hub, or gating could not be set.
    """
    release_dir = Path(release_dir)
    with release_lock(release_dir):
        manifest, notes = _local_checks(release_dir, repo_id, gated, allow_local_paths, verify)
        with tempfile.TemporaryDirectory(prefix="lance-cf-publish-") as tmp:
            args = (strict, gated, allow_local_paths)
            if dry_run:
                return _stage(release_dir, repo_id, revision, Path(tmp), manifest, notes, None, *args)
            api = api or create_api()
            # 1. Read what the Hub has (no change yet): this version must not be tagged; the card's changelog compares
            # against the highest version below it.
            head, tags = _remote_refs(api, repo_id, revision)
            tag = f"v{manifest['version']}"
            if tag in tags:
                raise PublishError(
                    f"{repo_id} already has tag {tag} (commit {tags[tag][:12]}): version {manifest['version']} is "
                    "published. Releases are immutable; bump `version` and rebuild to publish a new one."
                )
            newer = [t for t in tags if _version_key(t) is not None and _version_key(t) > _version_key(tag)]
            if newer:
                logger.warning("publishing %s after newer tags %s: the branch will hold an older release", tag, newer)
            previous = _previous_version(tags, tag)
            previous_manifest = _previous_manifest(api, repo_id, previous, Path(tmp)) if previous is not None else None
            # 2. Every local check, on exactly the files that will be uploaded.
            plan = _stage(release_dir, repo_id, revision, Path(tmp), manifest, notes, previous_manifest, *args)
            logger.info("%s", rf.viewer_statement(manifest))  # said before anything is uploaded
            for item in plan.left_out:
                logger.warning("left out of the upload: %s", item)
            _check_card_metadata(api, (Path(tmp) / "release" / rf.CARD_NAME).read_text(encoding="utf-8"))
            # 3. Remote changes: the repo, its gating (before any data lands in it), one commit, the tag.
            repo_url = _retry(
                "create_repo",
                lambda: api.create_repo(repo_id, repo_type=REPO_TYPE, private=True if private else None, exist_ok=True),
            )
            plan.gated = _set_gating(api, repo_id, plan.gated, explicit=gated is not None)
            head, _ = _retry("list_repo_refs", lambda: _branch_head(api, repo_id, revision))
            info = _commit_release(api, plan, manifest, head)
            _retry(
                "create_tag",
                lambda: api.create_tag(
                    repo_id,
                    tag=plan.tag,
                    revision=info.oid,
                    tag_message=f"{manifest['name']} {plan.tag}",
                    repo_type=REPO_TYPE,
                    exist_ok=False,
                ),
            )
    logger.info("published %s at %s (commit %s)", plan.tag, redact_url(str(repo_url)), info.oid)
    return PublishResult(repo_id, plan.tag, info.oid, redact_url(str(repo_url)), len(plan.files), plan.gated)


def _check_card_metadata(api: Any, card_text: str) -> None:
    """Ask the Hub to validate the card's YAML (``/api/validate-yaml``, what ``create_commit`` asks later), so that a
    card the Hub refuses stops the publish before the repo is created.

    Raises:
        PublishError: with the Hub's messages.
    """
    from huggingface_hub import get_session
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

    response = _retry(
        "validate card metadata",
        lambda: get_session().post(
            f"{api.endpoint}/api/validate-yaml",
            json={"content": card_text, "repoType": REPO_TYPE},
            headers=build_hf_headers(token=api.token),
        ),
    )
    if response.status_code == 400:
        try:
            errors = [str(e.get("message")) for e in response.json().get("errors", [])]
        except ValueError:
            errors = [response.text[:200]]
        raise PublishError(f"the Hub refuses the card's metadata: {'; '.join(errors) or 'no reason given'}")
    hf_raise_for_status(response)


def _remote_refs(api: Any, repo_id: str, revision: str) -> tuple[str | None, dict[str, str]]:
    """The branch head and the tags, or ``(None, {})`` when the repo does not exist yet."""
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        return _retry("list_repo_refs", lambda: _branch_head(api, repo_id, revision))
    except RepositoryNotFoundError:
        return None, {}


def _commit_release(api: Any, plan: PublishPlan, manifest: dict[str, Any], head: str | None) -> Any:
    """One commit: every planned file, minus files of the previous release that this one no longer has."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    remote = set(api.list_repo_files(plan.repo_id, repo_type=REPO_TYPE, revision=head)) if head else set()
    local = {f.path_in_repo for f in plan.files}
    stale = sorted(p for p in remote - local if not p.startswith(PROTECTED_PREFIXES))
    logger.info(
        "uploading %d files (%s), removing %d stale files", len(plan.files), _human(plan.total_bytes), len(stale)
    )

    def commit():
        # Rebuilt on every attempt: a CommitOperationAdd cannot be reused once committed.
        ops = [CommitOperationAdd(f.path_in_repo, str(f.local_path)) for f in plan.files]
        ops += [CommitOperationDelete(p) for p in stale]
        current_head, _ = _branch_head(api, plan.repo_id, plan.revision)
        return api.create_commit(
            plan.repo_id,
            ops,
            commit_message=f"Release {manifest['name']} v{plan.version}",
            commit_description=f"manifest_sha256: {manifest.get('manifest_sha256', 'n/a')}",
            repo_type=REPO_TYPE,
            revision=plan.revision,
            parent_commit=current_head,
        )

    return _retry("create_commit", commit)


def _set_gating(api: Any, repo_id: str, mode: str | None, *, explicit: bool) -> str | None:
    """Make the Hub gate the repo when the card says so, and read the setting back.

    Without an explicit mode a repo that is already gated keeps its mode (a ``manual`` gate is never loosened to
    ``auto``). A repo that is gated while this card is not is left gated.
    """
    current = _retry("repo info", lambda: api.dataset_info(repo_id)).gated
    if mode is None:
        if current:
            logger.warning("%s is gated (%s) although this card does not ask for it; left gated", repo_id, current)
        return current or None
    wanted = current if (not explicit and current in GATED_MODES) else mode
    if current != wanted:
        _retry(
            "update_repo_settings",
            lambda: api.update_repo_settings(repo_id, gated=wanted, repo_type=REPO_TYPE),
        )
    readback = _retry("repo info", lambda: api.dataset_info(repo_id)).gated
    if readback != wanted:
        raise PublishError(
            f"{repo_id}: gating was set to {wanted!r} but the Hub reports {readback!r}; nothing was uploaded. Set it "
            "in the repo's settings (Access requests) and publish again"
        )
    logger.info("%s is gated (%s)", repo_id, wanted)
    return wanted


def _previous_version(tags: dict[str, str], tag: str) -> str | None:
    """The highest version tag below ``tag``, or None."""
    current = _version_key(tag)
    older = [t for t in tags if _version_key(t) is not None and current is not None and _version_key(t) < current]
    return max(older, key=_version_key) if older else None


def _previous_manifest(api: Any, repo_id: str, previous: str, tmp: Path) -> dict[str, Any]:
    path = _retry(
        "download previous manifest",
        lambda: api.hf_hub_download(
            repo_id, rf.MANIFEST_NAME, repo_type=REPO_TYPE, revision=previous, local_dir=tmp / "previous"
        ),
    )
    logger.info("card changelog against %s", previous)
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _version_key(tag: str) -> Any:
    """The release version a tag ``v<version>`` names (ordered as ``packaging`` orders versions), or None."""
    version = tag[1:] if tag.startswith("v") else None
    return rf.parse_release_version(version) if rf.is_release_version(version) else None


# ---------------------------------------------------------------------------------------------------------- results
def load_results(results_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The evaluation results JSONs under a directory (``lance-cf eval`` writes ``OUT/<release>/<model>/results.json``) or one
    file, each validated by evaluation's own validator (:func:`evaluation.results.validate_results`).

    Other JSON files in the directory are ignored; a file that claims to be results (or is named ``results.json``) and
    does not validate is an error naming the file and the field.
    """
    results_dir = Path(results_dir)
    if not results_dir.exists():
        raise ValueError(f"{results_dir}: no such file or directory (expected the output of `lance-cf eval`)")
    paths = [results_dir] if results_dir.is_file() else sorted(results_dir.rglob("*.json"))
    loaded = []
    for path in paths:
        try:
            result = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from exc
        if is_results(result) or path.name == "results.json" or results_dir.is_file():
            try:
                validate_results(result)
            except ValueError as exc:
                raise ValueError(f"{path}: {exc}") from None
            loaded.append((path, result))
        else:
            logger.debug("skipping %s: not a results JSON", path)
    if not loaded:
        raise ValueError(f"{results_dir}: no results JSON files found (expected the output of `lance-cf eval`)")
    return loaded


def publishable_results(loaded: list[tuple[Path, dict[str, Any]]]) -> list[tuple[Path, dict[str, Any]]]:
    """The results that may enter the leaderboard, scrubbed of machine paths.

    Refused: a ``--limit`` run or a run where samples could not be read (not complete; ranking it as complete would
    be wrong). Left out with a warning: a model whose evaluation failed (nothing to rank). Any absolute path of this
    machine left in a string (a local release's directory, a class map, a checkpoint) is reduced to its last
    component, as a second line of defence behind the evaluation writing none.

    Raises:
        PublishError: a result is not complete, or no result is left.
    """
    kept = []
    for path, result in loaded:
        if result.get("status") != "ok":
            logger.warning("%s: not published: the evaluation of this model failed (%s)", path, result.get("error"))
            continue
        if result.get("limit") is not None:
            raise PublishError(
                f"{path}: results of a --limit {result['limit']} run score part of the release and never enter a "
                "leaderboard; re-run `lance-cf eval` without --limit"
            )
        missing = missing_default_metrics(result)
        if missing:
            raise PublishError(
                f"{path}: computed without the metrics {', '.join(missing)} (--metrics), so these results are not "
                "complete; re-run `lance-cf eval` without --metrics"
            )
        if not is_complete(result):
            failed = len(result.get("failures") or [])
            raise PublishError(
                f"{path}: {failed} sample(s) could not be scored (see 'failures'), so these results are not complete; "
                "fix or re-download the release and re-run `lance-cf eval`"
            )
        clean, changed = scrub_local_paths(result)
        if changed:
            logger.warning("%s: machine paths removed before publishing from %s", path, ", ".join(changed))
        kept.append((path, clean))
    if not kept:
        raise PublishError(f"no publishable results among {len(loaded)} file(s): every evaluation failed")
    return kept


def results_path_in_repo(result: dict[str, Any]) -> str:
    model = result["model"]
    name = (model.get("slug") or model.get("name")) if isinstance(model, dict) else model
    return f"{RESULTS_DIR}/v{result['release']['version']}/{re.sub(r'[^A-Za-z0-9._-]', '_', str(name))}.json"


def by_release(results: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Results grouped by the release they were computed on (name, version, manifest hash), oldest version first.

    Models are only compared within a group: numbers on different releases are not comparable.
    """
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for result in results:
        release = result.get("release") or {}
        key = (str(release.get("name")), str(release.get("version")), str(release.get("manifest_sha256")))
        groups.setdefault(key, []).append(result)
    lowest = rf.parse_release_version("0.0.0")

    def order(item: tuple[tuple[str, str, str], Any]) -> tuple:
        version = _version_key(f"v{item[0][1]}")
        return (version is None, lowest if version is None else version, item[0])

    ordered = sorted(groups.items(), key=order)
    return [({"name": n, "version": v, "manifest_sha256": h}, group) for (n, v, h), group in ordered]


def leaderboard_table(results: list[dict[str, Any]], repo_id: str | None = None) -> Any:
    """The published leaderboard: one row per model and release config, over every release version of the repo.

    Rows come from evaluation's :func:`evaluation.leaderboard.build_leaderboard_by_config`, computed per release (ranks
    and effective robustness compare models on the same data only) and concatenated; ``release_version`` tells them
    apart; with ``repo_id``, ``release_id`` names the release's repository (its provenance: id, version, manifest
    digest, and the ``metric_versions`` of each row).
    """
    import pandas as pd

    frames = [build_leaderboard_by_config(group) for _, group in by_release(results)]
    frames = [f for f in frames if len(f)]
    table = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    if repo_id is not None and len(table):  # provenance: the release's id beside its version and manifest digest
        table.insert(table.columns.get_loc("release"), "release_id", repo_id)
    return table


def leaderboard_document(results: list[dict[str, Any]], repo_id: str | None = None) -> str:
    """``results/leaderboard.md``: evaluation's ranked table, one section per release, newest first, each saying
    which release it is (repository, version, manifest digest); the table's note names the metrics and versions."""
    sections = ["# Leaderboard", ""]
    for release, group in reversed(by_release(results)):
        where = f"`{repo_id}` " if repo_id else ""
        sections += [
            f"## {release['name']} v{release['version']}",
            "",
            f"Release {where}v{release['version']}, manifest sha256 `{release['manifest_sha256']}`; "
            f"{len(group)} model(s).",
            "",
            leaderboard_markdown(group) or "No model was evaluated successfully.",
            "",
        ]
    return "\n".join(sections).rstrip("\n") + "\n"


def leaderboard_parquet(table: Any) -> bytes:
    """The table as Parquet bytes (deterministic: the same rows give the same bytes, so re-running commits nothing)."""
    import io

    buffer = io.BytesIO()
    table.to_parquet(buffer, index=False)
    return buffer.getvalue()


def leaderboard_rows(table: Any) -> list[dict[str, Any]]:
    """The table's rows as JSON-ready dicts (missing values as None)."""
    import pandas as pd

    return [
        {k: (None if not isinstance(v, (list, dict)) and pd.isna(v) else _plain(v)) for k, v in row.items()}
        for row in table.astype(object).to_dict("records")
    ]


def _plain(value: Any) -> Any:
    """numpy scalars as Python values, for JSON."""
    return value.item() if hasattr(value, "item") else value


def leaderboard_tar(table: Any) -> bytes:
    """The table as one WebDataset shard, a sample per row (``row-NNNNNN.json``), for the ``leaderboard`` config.

    Why not the Parquet file itself: ``datasets`` picks ONE builder per repo, from the first config's data files
    (``load.py``, ``infer_module_for_data_files``), here the WebDataset builder of the release configs, so a Parquet
    config on this repo would fail to load. The same rows are published as Parquet beside it for pandas and SQL.
    """
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for index, row in enumerate(leaderboard_rows(table)):
            data = json.dumps(row, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
            info = tarfile.TarInfo(f"row-{index:06d}.json")
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def leaderboard_features(table: Any) -> list[dict[str, Any]]:
    """The ``dataset_info.features`` of the ``leaderboard`` config, from the table's Arrow schema (declared, so a column
    that is null in the first rows still loads with its type)."""
    import pyarrow as pa

    schema = pa.Schema.from_pandas(table, preserve_index=False)
    fields = []
    for column in schema:
        kind = column.type
        if pa.types.is_boolean(kind):
            dtype = "bool"
        elif pa.types.is_integer(kind):
            dtype = "int64"
        elif pa.types.is_floating(kind):
            dtype = "float64"
        elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
            dtype = "string"
        elif pa.types.is_null(kind):
            dtype = "null"
        else:
            raise ValueError(f"leaderboard column {column.name!r} has type {kind}, which the card cannot declare")
        fields.append({"name": column.name, "dtype": dtype})
    return [
        {"name": "__key__", "dtype": "string"},
        {"name": "__url__", "dtype": "string"},
        {"name": "json", "struct": fields},
    ]


def with_leaderboard_config(card_text: str, table: Any) -> str:
    """The card with a ``leaderboard`` config (and its declared features) in its YAML, so that
    ``load_dataset(REPO, "leaderboard", split="train")`` reads the table and the Hub viewer shows it. Nothing else
    in the card changes."""
    if card_text.startswith("---"):
        meta, body = rf.split_card(card_text, "the card on the Hub")
    else:  # a hand-written README without YAML: the block is added (as huggingface_hub's card class does)
        meta, body = {}, card_text
    configs = [c for c in (meta.get("configs") or []) if c.get("config_name") != LEADERBOARD_CONFIG]
    configs.append(
        {
            "config_name": LEADERBOARD_CONFIG,
            "data_files": [{"split": LEADERBOARD_SPLIT, "path": f"{RESULTS_DIR}/{LEADERBOARD_TAR}"}],
        }
    )
    infos = meta.get("dataset_info") or []
    infos = [infos] if isinstance(infos, dict) else list(infos)
    infos = [i for i in infos if i.get("config_name") != LEADERBOARD_CONFIG]
    infos.append(
        {
            "config_name": LEADERBOARD_CONFIG,
            "features": leaderboard_features(table),
            "splits": [{"name": LEADERBOARD_SPLIT, "num_examples": len(table)}],
        }
    )
    meta["configs"] = configs
    meta["dataset_info"] = infos
    text = f"---\n{dump_yaml(meta)}\n---\n{body}"
    return text if text.endswith("\n") else text + "\n"


def publish_results(
    results_dir: Path,
    repo_id: str,
    *,
    revision: str = "main",
    dry_run: bool = False,
    api: Any = None,
) -> dict[str, Any]:
    """Add results JSONs under ``results/``, the leaderboard (Markdown and the Parquet table of the ``leaderboard``
    config) and a refreshed card leaderboard in one commit.

    Existing version tags are never moved: this is a new commit on ``revision`` only.
    """
    from huggingface_hub import CommitOperationAdd

    check_repo_id(repo_id)
    new = publishable_results(load_results(Path(results_dir)))
    new_paths = {results_path_in_repo(r): r for _, r in new}
    refuse_token({str(path): _json_bytes(result) for path, result in new})
    if dry_run:
        return {"repo_id": repo_id, "revision": revision, "files": sorted(new_paths), "commit": None}
    api = api or create_api()
    head, tags = _retry("list_repo_refs", lambda: _branch_head(api, repo_id, revision))
    if head is None:
        raise PublishError(f"{repo_id} has no branch {revision!r}: publish a release before its results")
    _check_results_match_releases(api, repo_id, new, tags)
    remote = api.list_repo_files(repo_id, repo_type=REPO_TYPE, revision=head)
    if rf.CARD_NAME not in remote:
        raise PublishError(f"{repo_id}@{revision} has no {rf.CARD_NAME}: publish a release before its results")
    with tempfile.TemporaryDirectory() as tmp:
        results: dict[str, dict[str, Any]] = {}
        for path in remote:
            if path.startswith(f"{RESULTS_DIR}/") and path.endswith(".json") and path not in new_paths:
                local = api.hf_hub_download(repo_id, path, repo_type=REPO_TYPE, revision=head, local_dir=tmp)
                results[path] = json.loads(Path(local).read_text(encoding="utf-8"))
        results.update(new_paths)
        readme_path = api.hf_hub_download(repo_id, rf.CARD_NAME, repo_type=REPO_TYPE, revision=head, local_dir=tmp)
        readme = Path(readme_path).read_text(encoding="utf-8")
        manifest_path = api.hf_hub_download(
            repo_id, rf.MANIFEST_NAME, repo_type=REPO_TYPE, revision=head, local_dir=tmp
        )
        branch_release = json.loads(Path(manifest_path).read_text(encoding="utf-8")).get("manifest_sha256")
    ordered = [results[p] for p in sorted(results)]
    table = leaderboard_table(ordered, repo_id)
    # The card on the branch describes one release: its leaderboard lists the results on that release only.
    on_branch = [r for r in ordered if (r.get("release") or {}).get("manifest_sha256") == branch_release]
    card = with_leaderboard_config(replace_leaderboard_section(readme, on_branch), table)
    markdown = leaderboard_document(ordered, repo_id)
    operations = [CommitOperationAdd(path, _json_bytes(result)) for path, result in sorted(new_paths.items())]
    operations.append(CommitOperationAdd(f"{RESULTS_DIR}/{LEADERBOARD_NAME}", markdown.encode()))
    operations.append(CommitOperationAdd(f"{RESULTS_DIR}/{LEADERBOARD_PARQUET}", leaderboard_parquet(table)))
    operations.append(CommitOperationAdd(f"{RESULTS_DIR}/{LEADERBOARD_TAR}", leaderboard_tar(table)))
    operations.append(CommitOperationAdd(rf.CARD_NAME, card.encode()))
    info = _retry(
        "create_commit",
        lambda: api.create_commit(
            repo_id,
            operations,
            commit_message=f"Add evaluation results ({len(new_paths)} files)",
            repo_type=REPO_TYPE,
            revision=revision,
        ),
    )
    logger.info("published %d results to %s (commit %s)", len(new_paths), repo_id, info.oid)
    return {"repo_id": repo_id, "revision": revision, "files": sorted(new_paths), "commit": info.oid}


def _check_results_match_releases(
    api: Any, repo_id: str, results: list[tuple[Path, dict[str, Any]]], tags: dict[str, str]
) -> None:
    """Refuse results that were not computed on a release published in this repo.

    A result names its release by version and manifest hash; the hash must be that of ``manifest.json`` at the tag
    ``v<version>``, otherwise the card's leaderboard would list scores of other data under this release.
    """
    by_version: dict[str, list[tuple[Path, dict[str, Any]]]] = {}
    for path, result in results:
        by_version.setdefault(str(result["release"]["version"]), []).append((path, result))
    for version, items in sorted(by_version.items()):
        tag = f"v{version}"
        if tag not in tags:
            raise PublishError(
                f"{items[0][0]}: results of release version {version}, but {repo_id} has no tag {tag}"
                f" (published: {', '.join(sorted(tags)) or 'none'}); publish that release first"
            )
        path = _retry(
            f"download manifest of {tag}",
            lambda tag=tag: api.hf_hub_download(repo_id, rf.MANIFEST_NAME, repo_type=REPO_TYPE, revision=tag),
        )
        published = json.loads(Path(path).read_text(encoding="utf-8"))
        for result_path, result in items:
            release = result["release"]
            if release.get("manifest_sha256") != published.get("manifest_sha256") or (
                release.get("name") not in (None, published.get("name"))
            ):
                raise PublishError(
                    f"{result_path}: computed on release {release.get('name')!r} {version} with manifest sha256 "
                    f"{release.get('manifest_sha256')!r}, but {repo_id}@{tag} holds {published.get('name')!r} with "
                    f"manifest sha256 {published.get('manifest_sha256')!r}; evaluate the published release"
                )


def _json_bytes(obj: Any) -> bytes:
    """Strict JSON: a NaN or an infinity is refused (``allow_nan=False``), never published as a bare ``NaN`` token."""
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n").encode()
