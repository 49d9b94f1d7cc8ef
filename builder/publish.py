"""Publish a release directory as a versioned Hugging Face Hub dataset, and add evaluation results to it.

A release is one atomic commit on the target branch (``create_commit``: binary files go through the Hub's large-file
path, LFS or Xet, as the client and server agree) followed by a tag ``v<version>`` on that commit, so
``load_dataset("ORG/NAME", CONFIG, split="test", revision="v<version>")`` loads exactly that release forever. A newer
release replaces the files on the branch; older ones stay reachable by their tags.

Resuming is re-running: large files already uploaded are skipped by the LFS batch answer, files identical on the
branch are dropped from the commit by the client, and a commit already made (interrupted before tagging) turns the
second commit into a no-op that returns the existing head, which is then tagged. A version whose tag exists is
refused. The token comes from huggingface_hub's standard sources (``HF_TOKEN``, ``hf auth login``) and is never read,
logged or written here. ``HF_ENDPOINT`` is honoured at call time, so self-hosted hubs work.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from builder import release_format as rf

logger = logging.getLogger(__name__)

REPO_TYPE = "dataset"
RESULTS_DIR = "results"
LEADERBOARD_NAME = "leaderboard.md"
# Paths on the branch that a release commit never deletes: results accumulate across versions.
PROTECTED_PREFIXES = (f"{RESULTS_DIR}/", ".gitattributes")
SEMVER = re.compile(r"^\d+\.\d+\.\d+(?:[-+][0-9A-Za-z.-]+)?$")
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
RETRY_ATTEMPTS = 3
RETRY_WAIT_S = 0.5
T = TypeVar("T")


class PublishError(RuntimeError):
    """The Hub refused the publication (tag exists, verification failed, ...)."""


@dataclass
class PlannedFile:
    path_in_repo: str
    local_path: Path
    size: int


@dataclass
class PublishPlan:
    repo_id: str
    revision: str
    tag: str
    version: str
    files: list[PlannedFile] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def describe(self) -> str:
        """The human-readable plan printed by ``--dry-run``."""
        lines = [
            f"repo: datasets/{self.repo_id}",
            f"target revision: {self.revision}",
            f"tag: {self.tag}",
            f"files: {len(self.files)} ({_human(self.total_bytes)})",
        ]
        lines += [f"  {f.path_in_repo}  {_human(f.size)}" for f in self.files]
        return "\n".join(lines)


@dataclass
class PublishResult:
    repo_id: str
    tag: str
    commit: str
    url: str
    files: int


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


def check_repo_id(repo_id: str) -> str:
    if not REPO_ID.match(repo_id or ""):
        raise ValueError(f"--repo-id {repo_id!r} is not a Hub repo id; expected ORG/NAME")
    return repo_id


def load_manifest(release_dir: Path) -> dict[str, Any]:
    path = Path(release_dir) / rf.MANIFEST_NAME
    if not path.is_file():
        raise ValueError(f"{release_dir} is not a release directory: {rf.MANIFEST_NAME} is missing")
    manifest = json.loads(path.read_text(encoding="utf-8"))
    if not SEMVER.match(str(manifest.get("version", ""))):
        raise ValueError(f"{path}: version {manifest.get('version')!r} is not semver (expected e.g. 1.0.0)")
    return manifest


def plan_release(release_dir: Path, repo_id: str, revision: str = "main") -> PublishPlan:
    """Everything that would be uploaded, without touching the network. The work directory is never included."""
    release_dir = Path(release_dir)
    check_repo_id(repo_id)
    manifest = load_manifest(release_dir)
    files = []
    for path in sorted(release_dir.rglob("*")):
        rel = path.relative_to(release_dir).as_posix()
        if not path.is_file() or rel == rf.WORK_DIR or rel.startswith(rf.WORK_DIR + "/"):
            continue
        files.append(PlannedFile(rel, path, path.stat().st_size))
    if not any(f.path_in_repo == rf.CARD_NAME for f in files):
        raise ValueError(f"{release_dir} has no {rf.CARD_NAME}: render the dataset card before publishing")
    return PublishPlan(repo_id, revision, f"v{manifest['version']}", manifest["version"], files)


def verify_before_publish(release_dir: Path) -> None:
    """Run ``lance-cf verify``'s checks; a release with any problem is not published."""
    from builder.verify import verify_release

    problems = verify_release(Path(release_dir))
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise PublishError(f"{release_dir} failed verification; not publishing:\n{listed}{more}")


def create_api(endpoint: str | None = None):
    """An ``HfApi`` on ``endpoint`` or ``$HF_ENDPOINT`` (read now, not at import) with the standard token sources."""
    from huggingface_hub import HfApi, constants

    return HfApi(endpoint=endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT)


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
    api: Any = None,
) -> PublishPlan | PublishResult:
    """Upload a release and tag it ``v<version>``; return the plan when ``dry_run`` (no network at all).

    Raises:
        ValueError: a bad argument or a directory that is not a release.
        PublishError: verification failed, or the version's tag already exists on the Hub.
    """
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    release_dir = Path(release_dir)
    plan = plan_release(release_dir, repo_id, revision)
    if verify:
        verify_before_publish(release_dir)
    if dry_run:
        return plan
    manifest = load_manifest(release_dir)
    api = api or create_api()

    # 1. The repo exists (created on first publish), and this version was never tagged.
    repo_url = _retry(
        "create_repo",
        lambda: api.create_repo(repo_id, repo_type=REPO_TYPE, private=True if private else None, exist_ok=True),
    )
    head, tags = _retry("list_repo_refs", lambda: _branch_head(api, repo_id, revision))
    if plan.tag in tags:
        raise PublishError(
            f"{repo_id} already has tag {plan.tag} (commit {tags[plan.tag][:12]}): version {plan.version} is published."
            " Releases are immutable; bump `version` and rebuild to publish a new one."
        )
    newer = [t for t in tags if _version_key(t) is not None and _version_key(t) > _version_key(plan.tag)]
    if newer:
        logger.warning("publishing %s after newer tags %s: the branch will hold an older release", plan.tag, newer)
    # The card is rendered again for this repo: the build did not know the repo id, and its loading and evaluation
    # snippets must name the repo users load from; the changelog compares against the version published before this
    # one. Rendering is deterministic, so a resumed publish writes the same card and gallery.
    previous = _previous_version(tags, plan.tag)
    previous_manifest = _previous_manifest(api, repo_id, previous) if previous is not None else None
    _render_card(release_dir, manifest, repo_id, previous_manifest)
    plan = plan_release(release_dir, repo_id, revision)

    # 2. One commit: every release file, minus files of the previous release that this one no longer has.
    remote = set(api.list_repo_files(repo_id, repo_type=REPO_TYPE, revision=head)) if head else set()
    local = {f.path_in_repo for f in plan.files}
    stale = sorted(p for p in remote - local if not p.startswith(PROTECTED_PREFIXES))
    logger.info(
        "uploading %d files (%s), removing %d stale files", len(plan.files), _human(plan.total_bytes), len(stale)
    )

    def commit():
        # Rebuilt on every attempt: a CommitOperationAdd cannot be reused once committed.
        ops = [CommitOperationAdd(f.path_in_repo, str(f.local_path)) for f in plan.files]
        ops += [CommitOperationDelete(p) for p in stale]
        current_head, _ = _branch_head(api, repo_id, revision)
        return api.create_commit(
            repo_id,
            ops,
            commit_message=f"Release {manifest['name']} v{plan.version}",
            commit_description=f"manifest_sha256: {manifest.get('manifest_sha256', 'n/a')}",
            repo_type=REPO_TYPE,
            revision=revision,
            parent_commit=current_head,
        )

    info = _retry("create_commit", commit)

    # 3. The tag pins the release for `revision="v<version>"`.
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
    logger.info("published %s at %s (commit %s)", plan.tag, repo_url, info.oid)
    return PublishResult(repo_id, plan.tag, info.oid, str(repo_url), len(plan.files))


def _previous_version(tags: dict[str, str], tag: str) -> str | None:
    """The highest version tag below ``tag``, or None."""
    current = _version_key(tag)
    older = [t for t in tags if _version_key(t) is not None and current is not None and _version_key(t) < current]
    return max(older, key=_version_key) if older else None


def _previous_manifest(api: Any, repo_id: str, previous: str) -> dict[str, Any]:
    path = _retry(
        "download previous manifest",
        lambda: api.hf_hub_download(repo_id, rf.MANIFEST_NAME, repo_type=REPO_TYPE, revision=previous),
    )
    logger.info("card changelog against %s", previous)
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _render_card(
    release_dir: Path, manifest: dict[str, Any], repo_id: str, previous_manifest: dict[str, Any] | None
) -> None:
    from dataset_cards import render_release_card

    render_release_card(release_dir, manifest, previous_manifest=previous_manifest, repo_id=repo_id)


def _version_key(tag: str) -> tuple[int, int, int] | None:
    match = re.match(r"^v(\d+)\.(\d+)\.(\d+)", tag)
    return tuple(int(x) for x in match.groups()) if match else None  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------------------- results
def _is_results(obj: Any) -> bool:
    release = obj.get("release") if isinstance(obj, dict) else None
    model = obj.get("model") if isinstance(obj, dict) else None
    return (
        isinstance(release, dict)
        and bool(release.get("version"))
        and (isinstance(model, str) or (isinstance(model, dict) and bool(model.get("name") or model.get("slug"))))
        and (isinstance(obj.get("metrics"), dict) or obj.get("status") == "error")
    )


def load_results(results_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The evaluation results JSONs under a directory (``lance-cf eval`` writes ``OUT/<model>/results.json``) or one
    file. Other JSON files in the directory are ignored; a results file without the fields the leaderboard needs is an
    error."""
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
        if _is_results(result):
            loaded.append((path, result))
        elif path.name == "results.json" or results_dir.is_file():
            raise ValueError(f"{path}: not an evaluation results JSON (needs model, release.version and metrics)")
        else:
            logger.debug("skipping %s: not a results JSON", path)
    if not loaded:
        raise ValueError(f"{results_dir}: no results JSON files found (expected the output of `lance-cf eval`)")
    return loaded


def results_path_in_repo(result: dict[str, Any]) -> str:
    model = result["model"]
    name = (model.get("slug") or model.get("name")) if isinstance(model, dict) else model
    return f"{RESULTS_DIR}/v{result['release']['version']}/{re.sub(r'[^A-Za-z0-9._-]', '_', str(name))}.json"


def publish_results(
    results_dir: Path,
    repo_id: str,
    *,
    revision: str = "main",
    dry_run: bool = False,
    api: Any = None,
) -> dict[str, Any]:
    """Add results JSONs under ``results/``, the leaderboard table and a refreshed card leaderboard in one commit.

    Existing version tags are never moved: this is a new commit on ``revision`` only.
    """
    from huggingface_hub import CommitOperationAdd

    from dataset_cards.card import leaderboard_markdown, replace_leaderboard_section

    check_repo_id(repo_id)
    new = load_results(Path(results_dir))
    new_paths = {results_path_in_repo(r): r for _, r in new}
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
    ordered = [results[p] for p in sorted(results)]
    card = replace_leaderboard_section(readme, ordered)
    table = "# Leaderboard\n\n" + leaderboard_markdown(ordered)
    operations = [CommitOperationAdd(path, _json_bytes(result)) for path, result in sorted(new_paths.items())]
    operations.append(CommitOperationAdd(f"{RESULTS_DIR}/{LEADERBOARD_NAME}", table.encode()))
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
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()
