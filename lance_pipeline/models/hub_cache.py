"""Declared models against the Hugging Face cache and the Hub: what is here, what can be fetched, fetching it.

``inspect_models`` answers, for every declared model (``lance_pipeline.models.needs``), whether all the files its
loader reads are in the cache, and for those that are not, whether the Hub will give them: one metadata request per
repository, all at once, each bounded by a timeout and all together by a deadline, never retried. A refused
connection, a network that swallows packets, ``HF_HUB_OFFLINE``, an unknown id or a gated repository without a token
all end in seconds with the reason. ``fetch_models`` downloads exactly the missing files through ``huggingface_hub``
(resumable: an interrupted file continues from its ``.incomplete`` part) under one progress bar whose total is known
up front. ``hub_offline`` runs the loading libraries offline once everything is cached and the Hub does not answer,
so they never wait on it.

The exact file list of a repository at a commit never changes; once the Hub gave it, it is kept in
``$LANCE_CF_CACHE/hub-files`` (with the sizes, the licence and the gating), so later checks are exact offline.
Endpoint, cache and token are huggingface_hub's own (``HF_ENDPOINT``, ``HF_HOME``/``HF_HUB_CACHE``, ``HF_TOKEN`` or
``hf auth login``); the token is never printed.

Everything that talks to the Hub goes through huggingface_hub's API: ``HfApi.model_info(files_metadata=True)`` for a
repository's files, ``get_hf_file_metadata`` for a gated one's access, ``get_token``, ``hf_hub_download`` and
``http_get``. Two things are this module's own: a large file is downloaded into a partial file kept across runs
(huggingface_hub 2.x writes each download to a fresh temporary file, so an interrupted one starts over), and the
cache check reads the cache's folders (``refs/``, ``snapshots/``) itself: huggingface_hub's cache functions
(``try_to_load_from_cache``, ``scan_cache_dir``) live in modules that import its HTTP client (importing
``huggingface_hub.file_download`` took 0.47 s of user CPU against 0.07 s for ``huggingface_hub.constants``, measured
with ``/usr/bin/time`` on the 2-core development machine), paid by every build before it learns its models are there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lance_pipeline.models.needs import ModelNeed, is_commit, matches, merge_needs, select_files
from lance_pipeline.readers import read_json

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT = 4.0  # seconds for one metadata request (connect, then read)
DEADLINE = 5.0  # seconds for all of them together (they run at once)


def lance_cache_dir() -> Path:
    """lance-cf's own cache (``$LANCE_CF_CACHE``, default ``~/.cache/lance-cf``), as ``builder.models`` uses it."""
    return Path(os.environ.get("LANCE_CF_CACHE", Path.home() / ".cache" / "lance-cf")).expanduser()


def hub_cache_dir(cache_dir: str | None = None) -> Path:
    from huggingface_hub import constants

    return Path(cache_dir or constants.HF_HUB_CACHE).expanduser()


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT.rstrip("/")


def is_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


# Set (and inherited by worker processes) while ``hub_offline`` has switched the Hub off itself: a message then never
# tells the user to unset an HF_HUB_OFFLINE they did not set.
OFFLINE_BY_TOOL = "LANCE_CF_HUB_OFFLINE_BY_TOOL"


def offline_by_user() -> bool:
    """Whether the user switched the Hub off (``HF_HUB_OFFLINE`` set in their environment, not by this tool)."""
    if os.environ.get(OFFLINE_BY_TOOL) == "1":
        return False
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class ModelState:
    """What is known about one (merged) model need.

    Attributes:
        need: The need (files of every user merged).
        users: Every need it covers (one per stage or option that loads it).
        commit: The revision as a commit, once known.
        files: The files the loader reads: name -> size in bytes (None: unknown). Exact when ``exact``; otherwise the
            cached files that match the need's patterns.
        exact: ``files`` is the repository's real list (from the Hub or the kept listing).
        cached: Every needed file is in the cache (or the local directory exists).
        license, gated: From the Hub (or the kept listing); None when unknown.
        problem: Why it is neither cached nor obtainable (None when it is either).
        stand_in: A packaged copy is used instead (the Hub offline, the model not cached).
    """

    need: ModelNeed
    users: list[ModelNeed]
    commit: str | None = None
    files: dict[str, int | None] = field(default_factory=dict)
    exact: bool = False
    cached: bool = False
    license: str | None = None
    gated: Any = None
    problem: str | None = None
    stand_in: str | None = None
    reachable: bool = False
    sha256: dict[str, str] = field(default_factory=dict)  # large (LFS) files: their content hash

    @property
    def size(self) -> int | None:
        if not self.exact or any(v is None for v in self.files.values()):
            return None
        return sum(v for v in self.files.values() if v is not None)

    def missing_files(self) -> list[str]:
        snapshot = snapshot_dir(self.need.repo_id, self.commit or self.need.revision, self.need.cache_dir)
        return [f for f in self.files if snapshot is None or not (snapshot / f).is_file()]

    def missing_bytes(self) -> int:
        sizes = self.files
        return sum(sizes[f] or 0 for f in self.missing_files())


# -- the cache ----------------------------------------------------------------------------------------------------------
def repo_folder(repo_id: str, cache_dir: str | None = None) -> Path:
    return hub_cache_dir(cache_dir) / ("models--" + repo_id.replace("/", "--"))


def snapshot_dir(repo_id: str | None, revision: str | None, cache_dir: str | None = None) -> Path | None:
    """The cached snapshot folder of ``repo_id`` at ``revision`` (a commit, or a branch/tag the cache has a ref
    for), or None."""
    if repo_id is None:
        return None
    folder = repo_folder(repo_id, cache_dir)
    revision = revision or "main"
    commit = revision if is_commit(revision) else None
    if commit is None:
        ref = folder / "refs" / revision
        if not ref.is_file():
            return None
        commit = ref.read_text().strip()
    snapshot = folder / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def _listing_path(repo_id: str, commit: str) -> Path:
    return lance_cache_dir() / "hub-files" / f"{repo_id.replace('/', '--')}@{commit}.json"


def read_listing(repo_id: str, commit: str | None) -> dict[str, Any] | None:
    if not is_commit(commit):
        return None
    try:
        return read_json(_listing_path(repo_id, commit))
    except (OSError, ValueError):
        return None


def write_listing(repo_id: str, commit: str, listing: dict[str, Any]) -> None:
    """Keep a repository's file list at a commit (atomically; it never changes, so a kept one is never stale)."""
    path = _listing_path(repo_id, commit)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".listing-")
        with os.fdopen(fd, "w") as handle:
            json.dump(listing, handle, sort_keys=True)
        os.replace(tmp, path)


def _check_cache(state: ModelState) -> None:
    """Fill ``state`` from the cache and the kept listing: files, sizes, licence, and whether all are cached."""
    need = state.need
    if need.repo_id is None:
        path = Path(os.path.expanduser(need.local_path or ""))
        state.cached = path.exists()
        if not state.cached:
            state.problem = f"local directory {need.local_path} does not exist"
        return
    revision = need.revision or "main"
    snapshot = snapshot_dir(need.repo_id, revision, need.cache_dir)
    state.commit = revision if is_commit(revision) else (snapshot.name if snapshot else None)
    listing = read_listing(need.repo_id, state.commit)
    if listing is not None:
        state.exact = True
        state.files = {f: listing["files"][f] for f in select_files(listing["files"], need.files)}
        state.sha256 = {f: h for f, h in listing.get("sha256", {}).items() if f in state.files}
        state.license, state.gated = listing.get("license"), listing.get("gated")
        state.cached = snapshot is not None and not state.missing_files()
        return
    if snapshot is None:
        return
    cached = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]
    present = select_files(cached, need.files)
    state.files = {f: (snapshot / f).stat().st_size for f in present}
    state.cached = all(any(matches(f, pattern) for f in present) for pattern in need.required)


# -- the Hub ------------------------------------------------------------------------------------------------------------
GATED = "gated: accept its conditions on the Hub, then log in (hf auth login, or HF_TOKEN)"


def _describe_error(err: BaseException, where: str, timeout: float) -> str:
    """One short reason for a failed Hub request (never the token)."""
    import socket

    if isinstance(err, TimeoutError | socket.timeout) or "timed out" in str(err):
        return f"no answer from {where} within {timeout:.0f} s"
    from huggingface_hub import errors

    if isinstance(err, errors.OfflineModeIsEnabled):
        return "the Hub is switched off (HF_HUB_OFFLINE is set)"
    if isinstance(err, errors.GatedRepoError):
        return GATED
    if isinstance(err, errors.RevisionNotFoundError):
        return "this revision does not exist on the Hub"
    if isinstance(err, errors.RepositoryNotFoundError):
        return f"not found on {where} (a typo, or a private repo: log in)"
    if isinstance(err, errors.HfHubHTTPError):
        status = getattr(getattr(err, "response", None), "status_code", None)
        return f"{where} answered HTTP {status}" if status else f"{where}: {str(err).splitlines()[0]}"
    try:
        import httpx2 as httpx
    except ImportError:  # huggingface_hub before 2.0
        import httpx

    if isinstance(err, httpx.TimeoutException):
        return f"no answer from {where} within {timeout:.0f} s"
    if isinstance(err, httpx.TransportError | OSError):
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return f"cannot connect to {where} ({reason})"
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}".strip()


def _probe(need: ModelNeed, token: str | bool | None, timeout: float) -> dict[str, Any]:
    """Ask the Hub for the repository's files at the revision (``HfApi.model_info(files_metadata=True)``: names,
    sizes, LFS sha256, licence, gating, commit; and for a gated repo, with a token, ``get_hf_file_metadata`` of one
    file, which a token without access is refused).

    Returns what it learnt: ``listing`` (files, licence, gating, commit) and ``problem`` (None when the files can
    be fetched).
    """
    from huggingface_hub import HfApi, get_hf_file_metadata, get_token, hf_hub_url

    where = endpoint()
    found: dict[str, Any] = {"listing": None, "problem": None}
    secret = None if token is False else token if isinstance(token, str) else get_token()
    try:
        info = HfApi(endpoint=where, library_name="lance-cf").model_info(
            need.repo_id, revision=need.revision or "main", files_metadata=True, timeout=timeout, token=secret or False
        )
        siblings = info.siblings or []
        card = info.card_data.to_dict() if info.card_data is not None else {}
        license_tag = next((t[len("license:") :] for t in info.tags or [] if t.startswith("license:")), None)
        listing = {
            "files": {s.rfilename: s.lfs.size if s.lfs else s.size for s in siblings},
            "sha256": {s.rfilename: s.lfs.sha256 for s in siblings if s.lfs},  # large files: their content's hash
            "license": card.get("license") or license_tag,
            "gated": info.gated or False,
            "commit": info.sha,
        }
        found["listing"] = listing
        if is_commit(listing["commit"]):
            write_listing(need.repo_id, listing["commit"], listing)
        files = select_files(listing["files"], need.files)
        unmatched = [p for p in need.required if not any(matches(f, p) for f in files)]
        if unmatched:
            found["problem"] = f"the repo has no {', '.join(unmatched)} at this revision (not a model of this kind?)"
        elif listing["gated"]:
            if secret is None:
                found["problem"] = GATED
            elif files:  # a token without access to the repo is refused here
                url = hf_hub_url(need.repo_id, files[0], revision=listing["commit"], endpoint=where)
                get_hf_file_metadata(url, token=secret, timeout=timeout)
    except Exception as err:  # every failure is this model's reason, reported with the others
        found["problem"] = _describe_error(err, where, timeout)
    return found


def _apply(state: ModelState, found: dict[str, Any]) -> None:
    listing = found["listing"]
    if listing is not None:
        state.commit = listing["commit"]
        state.exact = True
        state.files = {f: listing["files"][f] for f in select_files(listing["files"], state.need.files)}
        state.sha256 = {f: h for f, h in listing.get("sha256", {}).items() if f in state.files}
        state.license, state.gated = listing["license"], listing["gated"]
        snapshot = snapshot_dir(state.need.repo_id, state.commit, state.need.cache_dir)
        state.cached = snapshot is not None and not state.missing_files()
    state.problem = found["problem"]
    state.reachable = listing is not None and found["problem"] is None


def inspect_models(
    needs: list[ModelNeed],
    *,
    probe: str = "missing",
    token: str | bool | None = None,
    timeout: float | None = None,
    deadline: float | None = None,
) -> list[ModelState]:
    """The state of every declared model (merged per repository and revision), in first-use order.

    ``probe``: ``"missing"`` asks the Hub about the models that are not cached; ``"all"`` about every one (listing
    sizes and licences); ``"none"`` only looks at the cache. Requests run at once, each bounded by ``timeout``, all by
    ``deadline`` seconds; a model the Hub did not answer for in time gets that as its problem.
    """
    import time

    timeout = REQUEST_TIMEOUT if timeout is None else timeout
    deadline = DEADLINE if deadline is None else deadline
    states = [ModelState(need, users) for need, users in merge_needs(needs)]
    for state in states:
        _check_cache(state)
    if probe == "none":
        return states
    asked = [s for s in states if s.need.repo_id is not None and (probe == "all" or not s.cached)]
    if is_offline():
        for state in asked:
            if not state.cached:
                state.problem = "the Hub is switched off (HF_HUB_OFFLINE is set)"
        asked = []
    answers: list[list[dict[str, Any]]] = [[] for _ in asked]
    threads = []
    for state, answer in zip(asked, answers, strict=True):
        thread = threading.Thread(
            target=lambda need=state.need, out=answer: out.append(_probe(need, token, timeout)), daemon=True
        )
        thread.start()
        threads.append(thread)
    end = time.monotonic() + deadline
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))
    for state, answer in zip(asked, answers, strict=True):
        if answer:
            _apply(state, answer[0])
        elif not state.cached:  # still waiting: a network that swallows requests
            state.problem = f"no answer from {endpoint()} within {deadline:.0f} s"
    for state in states:
        if state.cached:
            state.problem = None
        elif state.problem is not None and state.need.packaged and _importable(state.need.packaged):
            state.stand_in = state.need.packaged  # the stage loads the packaged copy while the Hub is offline
    return states


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def hub_answers(timeout: float | None = None) -> bool:
    """Whether the Hub endpoint answers at all (one small request, no retry; any HTTP status counts)."""
    timeout = min(3.0, REQUEST_TIMEOUT) if timeout is None else timeout
    if is_offline():
        return False
    result: list[bool] = []

    def ask() -> None:
        import urllib.error
        import urllib.request

        request = urllib.request.Request(
            endpoint() + "/api/whoami-v2", headers={"User-Agent": "lance-cf"}, method="HEAD"
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout):  # noqa: S310 - the Hub endpoint
                result.append(True)
        except urllib.error.HTTPError:  # an answer, even a refusal
            result.append(True)
        except Exception:  # no answer: do not rely on it
            result.append(False)

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(timeout + 1.0)
    return bool(result and result[0])


@contextlib.contextmanager
def hub_offline(enabled: bool = True) -> Iterator[None]:
    """Run the block with huggingface_hub (and so transformers, diffusers, open_clip, timm) offline: cached files
    load without a request, nothing waits on a Hub that does not answer. Worker processes inherit it."""
    if not enabled:
        yield
        return
    from huggingface_hub import constants

    before, env_before = constants.HF_HUB_OFFLINE, os.environ.get("HF_HUB_OFFLINE")
    marker_before = os.environ.get(OFFLINE_BY_TOOL)
    if not offline_by_user():
        os.environ[OFFLINE_BY_TOOL] = "1"
    constants.HF_HUB_OFFLINE = True
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if marker_before is None:
            os.environ.pop(OFFLINE_BY_TOOL, None)
        constants.HF_HUB_OFFLINE = before
        if env_before is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = env_before


# -- downloading --------------------------------------------------------------------------------------------------------
class DownloadStopped(ValueError):
    """A download stopped (network, disk): what was fetched stays, the same command resumes it."""


def local_copy_dir(root: Path, state: ModelState) -> Path:
    """Where ``--local-dir`` puts a model: ``ROOT/ORG--NAME`` (``@REV`` added for a branch or tag, so two revisions
    of one repo never share a folder)."""
    name = state.need.repo_id.replace("/", "--")
    if state.need.revision and not is_commit(state.need.revision):
        name += "@" + state.need.revision
    return Path(root) / name


def fetch_models(
    states: list[ModelState],
    *,
    local_dir: Path | None = None,
    progress: bool = True,
    token: str | bool | None = None,
) -> int:
    """Download every file the states need that is not there yet; returns the bytes fetched.

    Into the Hugging Face cache, or with ``local_dir`` into ``local_dir/ORG--NAME/`` (plain files a stage can load as
    a local directory). The states must come from ``inspect_models`` with the Hub's answer (exact file lists). One
    progress bar counts all bytes, its total known before the first byte. A large file is written to a partial file
    kept across runs (huggingface_hub keeps none since 2.0), so an interrupted download resumes where it stopped; it
    is checked against its sha256 before it takes its place.
    """
    from tqdm.auto import tqdm

    plan: list[tuple[ModelState, str, int]] = []
    for state in states:
        if state.need.repo_id is None or state.stand_in:
            continue
        if not state.exact:
            raise ValueError(f"{state.need.label}: its file list is unknown ({state.problem or 'not asked'})")
        target = local_copy_dir(local_dir, state) if local_dir is not None else None
        missing = set(state.missing_files()) if target is None else set()
        for name, size in state.files.items():
            if target is not None:
                done = (target / name).is_file() and (size is None or (target / name).stat().st_size == size)
            else:
                done = name not in missing
            if not done:
                plan.append((state, name, size or 0))
    total = sum(size for _, _, size in plan)
    if not plan:
        return 0
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="models", disable=not progress)

    class _Into:
        """tqdm stand-in handed to huggingface_hub: every file's bytes go to the one bar (a resumed file adds the
        part it already had)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            initial = kwargs.get("initial") or 0
            if initial:
                bar.update(initial)

        def __enter__(self) -> _Into:
            return self

        def __exit__(self, *exc: Any) -> None:
            return None

        def update(self, n: float | None = 1) -> None:
            bar.update(n or 0)

        def close(self) -> None:
            return None

        def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
            return None

    where = endpoint()
    state, name = plan[0][0], plan[0][1]
    try:
        for state, name, _size in plan:
            bar.set_postfix_str(f"{state.need.repo_id}: {name}", refresh=False)
            _fetch_file(state, name, local_dir, token, where, _Into)
    except KeyboardInterrupt:
        raise
    except Exception as err:
        reason = _describe_error(err, where, REQUEST_TIMEOUT)
        raise DownloadStopped(
            f"downloading {state.need.label} ({name}) stopped: {reason}; what was fetched is kept: re-run the same "
            "command to resume"
        ) from err
    finally:
        bar.close()
    for state in states:
        if local_dir is not None and state.need.repo_id is not None and not state.stand_in:
            write_local_marker(local_copy_dir(local_dir, state), state)
    return total


PARTIAL_SUFFIX = ".lance-cf-partial"


def _fetch_file(state: ModelState, name: str, local_dir: Path | None, token: Any, where: str, tqdm_class: Any) -> None:
    """One file. A large one goes through a kept partial file (resumed with a Range request, checked against its
    sha256), then, for the cache, is linked into the snapshot by ``hf_hub_download``, which finds the blob and
    transfers nothing. A small one is fetched by ``hf_hub_download`` itself."""
    from huggingface_hub import hf_hub_download, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    need = state.need
    revision = state.commit or need.revision
    sha = state.sha256.get(name)
    if local_dir is not None:
        final = local_copy_dir(local_dir, state) / name
        partial = local_copy_dir(local_dir, state) / PARTIAL_SUFFIX / name
    elif sha is not None:  # the cache names a large file's blob by its sha256 (its ETag)
        final = repo_folder(need.repo_id, need.cache_dir) / "blobs" / sha
        partial = final.with_name(sha + PARTIAL_SUFFIX)
    else:
        hf_hub_download(need.repo_id, name, revision=revision, cache_dir=need.cache_dir, token=token,
                        endpoint=where, tqdm_class=tqdm_class)  # fmt: skip
        return
    if not final.is_file():
        partial.parent.mkdir(parents=True, exist_ok=True)
        resume = partial.stat().st_size if partial.exists() else 0
        url = hf_hub_url(need.repo_id, name, revision=revision, endpoint=where)
        headers = build_hf_headers(token=token, library_name="lance-cf")
        with partial.open("ab") as handle:
            http_get(url, handle, resume_size=resume, headers=headers, expected_size=state.files.get(name),
                     tqdm_class=tqdm_class)  # fmt: skip
        if sha is not None:
            digest = hashlib.sha256()
            with partial.open("rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
            if digest.hexdigest() != sha:
                partial.unlink()
                raise OSError(f"{name}: the downloaded bytes do not match the sha256 the Hub lists (deleted)")
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(partial, final)
    if local_dir is None:  # the blob is there: this only links it into the snapshot (and writes the ref)
        hf_hub_download(need.repo_id, name, revision=revision, cache_dir=need.cache_dir, token=token, endpoint=where)


# A copy made by ``models download --local-dir`` carries this file: the repository and commit it is a copy of, and the
# sha256 of each of its files. A build given the copy checks the files against it; when they match, the release
# records the model as a local copy of that id at that commit (``builder.config.public_stage_dict``).
LOCAL_MARKER = ".lance-cf-model.json"


def write_local_marker(directory: Path, state: ModelState) -> None:
    """Record in a local copy which repository and commit it holds, and each file's sha256 (computed from the copy;
    a file whose Hub listing gives a sha256 must match it)."""
    files = {}
    for name in sorted(state.files):
        digest = file_sha256(directory / name)
        expected = state.sha256.get(name)
        if expected is not None and digest != expected:
            raise DownloadStopped(
                f"{directory / name}: its bytes do not match the sha256 the Hub lists for {state.need.label}; delete "
                "it and run the same command again"
            )
        files[name] = digest
    data = {"repo_id": state.need.repo_id, "revision": state.commit, "files": files}
    (directory / LOCAL_MARKER).write_text(json.dumps(data, indent=1) + "\n")


@dataclass(frozen=True)
class LocalCopy:
    """What a local model directory's marker says, checked against its files.

    Attributes:
        repo_id, revision: The repository and commit the directory is a copy of, or None without a valid marker.
        verified: Every file the marker lists is there with its sha256, and no other visible file is.
        reason: Why it is not verified (None when it is).
    """

    repo_id: str | None
    revision: str | None
    verified: bool
    reason: str | None = None

    @property
    def label(self) -> str:
        return f"{self.repo_id}@{self.revision}"


def local_copy(directory: str | os.PathLike) -> LocalCopy:
    """Whether ``directory`` is an unchanged copy of a Hub model made by ``models download --local-dir``."""
    path = Path(os.path.expanduser(os.fspath(directory)))
    if not (path / LOCAL_MARKER).exists():
        return LocalCopy(None, None, False, f"it carries no {LOCAL_MARKER}")
    try:
        data = read_json(path / LOCAL_MARKER)
    except (OSError, ValueError) as err:
        return LocalCopy(None, None, False, f"its {LOCAL_MARKER} cannot be read ({err})")
    repo_id = data.get("repo_id") if isinstance(data, dict) else None
    revision = data.get("revision") if isinstance(data, dict) else None
    files = data.get("files") if isinstance(data, dict) else None
    if not (isinstance(repo_id, str) and is_commit(revision)):
        return LocalCopy(None, None, False, f"its {LOCAL_MARKER} names no repository and commit")
    if not (isinstance(files, dict) and files and all(isinstance(v, str) for v in files.values())):
        return LocalCopy(repo_id, revision, False, f"its {LOCAL_MARKER} lists no sha256 (made by an older lance-cf)")
    present = visible_files(path)
    extra = sorted(set(present) - set(files))
    missing = sorted(set(files) - set(present))
    changed = sorted(name for name in set(files) & set(present) if file_sha256(path / name) != files[name])
    problems = [f"{what}: {', '.join(names[:3])}" + (" ..." if len(names) > 3 else "")
                for what, names in (("changed", changed), ("missing", missing), ("added", extra)) if names]  # fmt: skip
    if problems:
        return LocalCopy(repo_id, revision, False, f"its files differ from its {LOCAL_MARKER} ({'; '.join(problems)})")
    outside = links_out_of(path)
    if outside:
        return LocalCopy(repo_id, revision, False, f"it holds a link out of the copy ({outside[0]})")
    # The marker is the copy's own claim: anyone can write one, with the sha256 of any files. It is trusted only where
    # the files of that commit are known from elsewhere: the Hugging Face cache, or the Hub.
    reason = hub_confirms(repo_id, revision, files, path)
    if reason is not None:
        return LocalCopy(repo_id, revision, False, reason)
    return LocalCopy(repo_id, revision, True)


def links_out_of(directory: Path) -> list[str]:
    """``NAME -> TARGET`` for each link under ``directory`` whose target resolves outside it."""
    root = os.path.realpath(directory)
    out = []
    for folder, dirs, names in os.walk(directory):
        for name in [*dirs, *names]:
            child = os.path.join(folder, name)
            if os.path.islink(child):
                target = os.path.realpath(child)
                if os.path.commonpath([root, target]) != root:
                    out.append(f"{os.path.relpath(child, directory)} -> {target}")
    return sorted(out)


def hub_confirms(repo_id: str, revision: str, files: dict[str, str], directory: Path) -> str | None:
    """None when the sha256 a copy's marker lists are those of ``repo_id`` at ``revision``, checked against the
    Hugging Face cache (every file there), else against the Hub (its LFS sha256, or git blob id of a small file);
    otherwise why not (the commit's files differ, or they cannot be known here)."""
    from huggingface_hub import try_to_load_from_cache

    label = f"{repo_id}@{revision}"
    cached = {}
    for name in files:
        try:
            found = try_to_load_from_cache(repo_id, name, revision=revision)
        except ValueError as err:  # huggingface_hub's check of the id: the marker names no repository it could hold
            return f"its {LOCAL_MARKER} names no valid repository ({str(err).splitlines()[0][:120]})"
        if isinstance(found, str):
            cached[name] = found
    if len(cached) == len(files):
        differ = sorted(name for name, found in cached.items() if file_sha256(Path(found)) != files[name])
        if differ:
            return f"its files are not those of {label} in the Hugging Face cache ({', '.join(differ[:3])})"
        return None
    if is_offline():
        return (
            f"its {LOCAL_MARKER} cannot be checked here: {label} is not in the Hugging Face cache and the Hub is "
            "switched off (HF_HUB_OFFLINE)"
        )
    try:
        from huggingface_hub import HfApi

        listed = HfApi().get_paths_info(repo_id, sorted(files), revision=revision, expand=True)
    except Exception as err:  # any Hub or network fault: the claim stays unchecked, and the release says so
        return f"its {LOCAL_MARKER} cannot be checked against the Hub ({type(err).__name__}: {str(err)[:120]})"
    known = {}
    for entry in listed:
        lfs = getattr(entry, "lfs", None)
        known[entry.path] = ("sha256", lfs.sha256) if lfs is not None else ("git", getattr(entry, "blob_id", None))
    differ = []
    for name, digest in files.items():
        kind, expected = known.get(name, (None, None))
        if kind == "sha256" and expected == digest:
            continue
        if kind == "git" and expected is not None and expected == _git_blob_sha1(directory / name):
            continue
        differ.append(name)
    if differ:
        return f"its files are not those the Hub lists for {label} ({', '.join(sorted(differ)[:3])})"
    return None


def _git_blob_sha1(path: Path) -> str:
    """The id git gives a file's bytes (what the Hub lists for a file not stored with LFS)."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def visible_files(directory: Path) -> list[str]:
    """The files under ``directory`` (links followed, each folder once), relative POSIX paths, sorted; names starting
    with ``.`` (the marker, partial downloads, caches) are left out at every level."""
    out: list[str] = []
    seen: set[str] = set()

    def walk(folder: Path, prefix: str) -> None:
        real = os.path.realpath(folder)
        if real in seen:
            return
        seen.add(real)
        for child in sorted(folder.iterdir(), key=lambda p: p.name):
            if child.name.startswith("."):
                continue
            if child.is_dir():
                walk(child, f"{prefix}{child.name}/")
            elif child.is_file():
                out.append(prefix + child.name)

    walk(directory, "")
    return sorted(out)


def content_digest(path: Path) -> str | None:
    """``sha256:HEX`` over a file's bytes, or over a folder's visible files (``visible_files``: each relative path
    and its bytes' sha256, in path order; a flat folder hashes as before subfolders counted); None if absent."""
    digest = hashlib.sha256()
    special = _special_links(path) if path.is_dir() else []
    if special or _is_special(path):
        shown = special[0] if special else f"{path} -> {os.path.realpath(path)}"
        raise ValueError(f"{path}: holds a link to a system file ({shown}), not model or token data; copy the files in")
    try:
        if path.is_dir():
            for name in visible_files(path):
                digest.update(name.encode("utf-8", "surrogateescape") + b"\0")
                digest.update(bytes.fromhex(file_sha256(path / name)))
        elif path.is_file():
            digest.update(path.read_bytes())
        else:
            return None
    except OSError as err:  # recorded with no digest, the release could not say what it was built from
        raise ValueError(f"{path}: cannot be read to record its digest ({err})") from None
    return "sha256:" + digest.hexdigest()


_SYSTEM_TREES = ("/proc", "/sys", "/dev")


def _is_special(path: Path) -> bool:
    real = os.path.realpath(path)
    return any(real == tree or real.startswith(tree + "/") for tree in _SYSTEM_TREES)


def _special_links(directory: Path) -> list[str]:
    """``NAME -> TARGET`` for each link under ``directory`` into /proc, /sys or /dev."""
    out = []
    for folder, dirs, names in os.walk(directory):
        for name in [*dirs, *names]:
            child = Path(folder) / name
            if child.is_symlink() and _is_special(child):
                out.append(f"{child.relative_to(directory)} -> {os.path.realpath(child)}")
    return sorted(out)


# sha256 of files already read in this process, by (path, size, mtime, inode): a build asks for a model folder's
# digest several times (config hash, manifest), and its weights may be gigabytes.
_FILE_SHA256: dict[tuple, str] = {}
_FILE_SHA256_LOCK = threading.Lock()


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file's bytes (read once per process while the file is unchanged)."""
    info = os.stat(path)
    key = (os.path.realpath(path), info.st_size, info.st_mtime_ns, info.st_ino, info.st_dev)
    with _FILE_SHA256_LOCK:
        known = _FILE_SHA256.get(key)
    if known is not None:
        return known
    if info.st_size >= 1 << 30:  # seconds of reading: said, so that it is not taken for a hang
        logger.info("reading %s (%s) for its sha256, once per process", path, format_size(info.st_size))
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    with _FILE_SHA256_LOCK:
        _FILE_SHA256[key] = digest.hexdigest()
    return digest.hexdigest()


def format_size(size: int | None) -> str:
    if size is None:
        return "size unknown"
    value = float(size)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{size} B"
