"""Publish a release directory as a versioned Hugging Face Hub dataset (evaluation results are published by
:mod:`evaluation.publish_results`).

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
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import dataset_cards
from builder import release_format as rf
from builder.croissant import croissant_about
from builder.release_format.hub_client import (
    REPO_TYPE,
    RESULTS_DIR,
    URL_USERINFO,
    PublishError,
    branch_head,
    check_repo_id,
    create_api,
    hub_endpoint,
    label_names_of,
    local_paths,
    local_paths_in_text,
    redact_url,
    refuse_local_paths,
    refuse_token,
    retry,
    version_key,
)
from builder.release_format.lock import output_lock
from lance_pipeline.readers import read_json

logger = logging.getLogger(__name__)

# Paths on the branch that a release commit never deletes: results accumulate across versions.
PROTECTED_PREFIXES = (f"{RESULTS_DIR}/", ".gitattributes")
# The Hub's access-request modes (``HfApi.update_repo_settings(gated=...)``).
GATED_MODES = ("auto", "manual")
# Configs a LANCE release is about: one of them requested by the build but left empty makes the release unusable.
REQUIRED_CONFIGS = ("original", "counterfactual")
MAX_LISTED_LEFT_OUT = 30
LOAD_CHECK_BATCH = 256  # rows per batch when publish reads a staged config (batched: ~8x faster than row by row)


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
    endpoint = URL_USERINFO.sub(r"\1", hub_endpoint()).rstrip("/")
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
    for position, config in enumerate(manifest["configs"], 1):
        expected = manifest["counts"][config]["total"]
        logger.info(
            "publish check %d/%d: load_dataset reads config %s (%d rows)",
            position, len(manifest["configs"]), config, expected,
        )  # fmt: skip
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
        refuse_local_paths(f"{release_dir}/{rf.MANIFEST_NAME}", local_paths(manifest, labels=label_names_of(manifest)))
    if verify:
        logger.info("publish check: verifying %s (every hash, count and image, as lance-cf verify)", release_dir)
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
    logger.info("publish check: staging the files, the card and croissant.json (checked with mlcroissant)")
    files, card_files = stage_release(release_dir, staging, manifest, repo_id, previous_manifest)
    card_text = (staging / rf.CARD_NAME).read_text(encoding="utf-8")
    texts = (rf.MANIFEST_NAME, rf.TIMM_INFO_NAME, rf.CARD_NAME, rf.CROISSANT_NAME)
    refuse_token({name: (staging / name).read_bytes() for name in texts if (staging / name).is_file()})
    if not allow_local_paths:
        in_card = [(rf.CARD_NAME, path) for path in local_paths_in_text(card_text, label_names_of(manifest))]
        refuse_local_paths(f"the card rendered for {release_dir}", in_card)
    left_out = find_left_out(release_dir, {f.path_in_repo for f in files} | set(card_files))
    if strict and left_out:
        raise PublishError(
            f"{release_dir} holds {len(left_out)} entries the manifest does not list (--strict): "
            f"{'; '.join(left_out[:MAX_LISTED_LEFT_OUT])}; move them out of the release or drop --strict"
        )
    check_loadable(staging, manifest, release_dir)
    mode = gated or ("auto" if card_gating(card_text) else None)
    return PublishPlan(
        repo_id, revision, f"v{manifest['version']}", manifest["version"], hub_endpoint(), files, left_out, mode, notes
    )


def verify_before_publish(release_dir: Path) -> None:
    """Run ``lance-cf verify``'s checks; a release with any problem is not published."""
    problems = rf.verify_release(Path(release_dir))
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise PublishError(f"{release_dir} failed verification; not publishing:\n{listed}{more}")


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
            newer = [t for t in tags if version_key(t) is not None and version_key(t) > version_key(tag)]
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
            repo_url = retry(
                "create_repo",
                lambda: api.create_repo(repo_id, repo_type=REPO_TYPE, private=True if private else None, exist_ok=True),
            )
            plan.gated = _set_gating(api, repo_id, plan.gated, explicit=gated is not None)
            head, _ = retry("list_repo_refs", lambda: branch_head(api, repo_id, revision))
            info = _commit_release(api, plan, manifest, head)
            retry(
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

    response = retry(
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
        return retry("list_repo_refs", lambda: branch_head(api, repo_id, revision))
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
        current_head, _ = branch_head(api, plan.repo_id, plan.revision)
        return api.create_commit(
            plan.repo_id,
            ops,
            commit_message=f"Release {manifest['name']} v{plan.version}",
            commit_description=f"manifest_sha256: {manifest.get('manifest_sha256', 'n/a')}",
            repo_type=REPO_TYPE,
            revision=plan.revision,
            parent_commit=current_head,
        )

    return retry("create_commit", commit)


def _set_gating(api: Any, repo_id: str, mode: str | None, *, explicit: bool) -> str | None:
    """Make the Hub gate the repo when the card says so, and read the setting back.

    Without an explicit mode a repo that is already gated keeps its mode (a ``manual`` gate is never loosened to
    ``auto``). A repo that is gated while this card is not is left gated.
    """
    current = retry("repo info", lambda: api.dataset_info(repo_id)).gated
    if mode is None:
        if current:
            logger.warning("%s is gated (%s) although this card does not ask for it; left gated", repo_id, current)
        return current or None
    wanted = current if (not explicit and current in GATED_MODES) else mode
    if current != wanted:
        retry(
            "update_repo_settings",
            lambda: api.update_repo_settings(repo_id, gated=wanted, repo_type=REPO_TYPE),
        )
    readback = retry("repo info", lambda: api.dataset_info(repo_id)).gated
    if readback != wanted:
        raise PublishError(
            f"{repo_id}: gating was set to {wanted!r} but the Hub reports {readback!r}; nothing was uploaded. Set it "
            "in the repo's settings (Access requests) and publish again"
        )
    logger.info("%s is gated (%s)", repo_id, wanted)
    return wanted


def _previous_version(tags: dict[str, str], tag: str) -> str | None:
    """The highest version tag below ``tag``, or None."""
    current = version_key(tag)
    older = [t for t in tags if version_key(t) is not None and current is not None and version_key(t) < current]
    return max(older, key=version_key) if older else None


def _previous_manifest(api: Any, repo_id: str, previous: str, tmp: Path) -> dict[str, Any]:
    path = retry(
        "download previous manifest",
        lambda: api.hf_hub_download(
            repo_id, rf.MANIFEST_NAME, repo_type=REPO_TYPE, revision=previous, local_dir=tmp / "previous"
        ),
    )
    logger.info("card changelog against %s", previous)
    return read_json(path, what="the previous version's manifest.json")
