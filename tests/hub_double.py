"""A test-only Hugging Face Hub double on 127.0.0.1 that stores every commit in a real git repository.

It implements the write routes ``huggingface_hub`` 2.x uses with ``HF_HUB_DISABLE_XET=1`` (create repo, validate-yaml,
preupload, Git-LFS batch + basic PUT upload, NDJSON commit, tags, repo settings such as gating) and serves the read
side itself (repo info at a revision with its gating, refs, tree, paths-info, commits, resolve with
``X-Repo-Commit``/``ETag``/ranges), which is what
``datasets.load_dataset("ORG/NAME", revision=...)`` needs. The read side is served here rather than by ``olah``
because the double already owns the git repository; serving it twice would add a process and a config file for no
extra fidelity (see docs/publishing.md).

Each Hub repo is a bare git repository ``ROOT/{type}s/{org}/{name}.git``. Large files are committed as Git-LFS pointer
blobs (``version https://git-lfs.github.com/spec/v1`` / ``oid sha256:`` / ``size``) and their content lives in the
standard ``lfs/objects/aa/bb/<oid>`` layout inside the git directory, so ``git lfs`` tooling and olah's offline mirror
could read the same repository. Only the stdlib and the ``git`` binary are used.

Faults for resilience tests are injected through :class:`Faults`: answer the next N requests of a kind with an HTTP
error, hold every LFS upload after the first N until the test releases them (to interrupt a client mid-upload), or
hold file downloads after N bytes until the test releases them (to kill a client mid-download). With
``gate_reads=True`` a gated repo's files are served only to the double's token, as the Hub serves them only to accounts
that accepted the conditions (off by default: the publishing tests read their gated releases back without one).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

LFS_POINTER_PREFIX = b"version https://git-lfs.github.com/spec/v1\n"
# Mirrors the Hub's default .gitattributes for dataset repos: binary formats always go through LFS.
LFS_EXTENSIONS = (".tar", ".png", ".jpg", ".jpeg", ".webp", ".parquet", ".arrow", ".zip", ".gz", ".npy", ".bin")
LFS_SIZE_THRESHOLD = 10 * 1024 * 1024
REPO_TYPES = ("models", "datasets", "spaces")
VALID_SIZE_CATEGORIES = ("n<1K", "1K<n<10K", "10K<n<100K", "100K<n<1M", "1M<n<10M", "10M<n<100M", "100M<n<1B")
ZERO_SHA = "0" * 40
# The double's write token (tests/conftest.py ``hub``): tests check it never reaches a log, a file or the Hub.
TOKEN = "hf_double_secret_token_0123456789"
REPO_ROOT = Path(__file__).resolve().parents[1]


def client_env(url: str, home: Path, **extra: str) -> dict[str, str]:
    """The environment of a client subprocess reading from (or writing to) the Hub at ``url``: this process's
    environment without proxies or ``HF_*`` settings, online, no Xet, no telemetry or progress bars, its own
    ``HF_HOME`` (an empty cache), this checkout first on ``PYTHONPATH``; ``extra`` adds or overrides variables."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy") and not k.startswith("HF_")}
    env.update(
        HF_ENDPOINT=url,
        HF_HOME=str(home),
        HF_HUB_OFFLINE="0",
        HF_DATASETS_OFFLINE="0",
        HF_UPDATE_DOWNLOAD_COUNTS="0",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        NO_PROXY="127.0.0.1,localhost",
        PYTHONPATH=str(REPO_ROOT),
        OMP_NUM_THREADS="1",
    )
    env.update(extra)
    return env


@dataclass
class Faults:
    """Fault injection shared between the test and the server threads.

    Attributes:
        fail: kind -> list of HTTP status codes still to return for the next requests of that kind. Kinds:
            ``lfs_put``, ``lfs_batch``, ``preupload``, ``commit``, ``tag``, ``create``, ``settings`` (the settings
            call is recorded, then answered with the error).
        hold_lfs_after: when set, every LFS upload after this many successful ones blocks until ``release`` is set,
            then the connection is dropped without a response.
    """

    fail: dict[str, list[int]] = field(default_factory=dict)
    hold_lfs_after: int | None = None
    release: threading.Event = field(default_factory=threading.Event)
    held: int = 0
    # When set, every download of a whole file (GET .../resolve/... without a Range) larger than this sends its
    # headers and this many bytes of the body, then waits for ``release`` and drops the connection; ``held_downloads``
    # counts them. Ranged requests (a client resuming) are served in full.
    hold_downloads_after: int | None = None
    held_downloads: int = 0

    def take(self, kind: str) -> int | None:
        codes = self.fail.get(kind)
        return codes.pop(0) if codes else None


class HubDouble:
    """The server: start with :meth:`start`, stop with :meth:`stop`; ``url`` is the endpoint for ``HF_ENDPOINT``."""

    def __init__(self, root: Path, token: str | None = None, gate_reads: bool = False) -> None:
        self.root = Path(root)
        self.token = token
        self.gate_reads = gate_reads
        self.faults = Faults()
        self.log: list[tuple[str, str, int]] = []
        # Every file download: (path, Range header or None), to see a client resume where it stopped.
        self.downloads: list[tuple[str, str | None]] = []
        # Repo settings as the Hub stores them ("gated": False | "auto" | "manual"), and every settings call received.
        self.settings: dict[tuple[str, str], dict[str, Any]] = {}
        self.settings_calls: list[tuple[str, str, dict[str, Any]]] = []
        self.lfs_puts_ok = 0
        self._lock = threading.RLock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> HubDouble:
        double = self

        class Handler(_Handler):
            hub = double

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.faults.release.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def url(self) -> str:
        assert self._server is not None, "server not started"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # ------------------------------------------------------------------ git storage
    def git_dir(self, repo_type: str, repo_id: str) -> Path:
        return self.root / repo_type / f"{repo_id}.git"

    def git(self, gdir: Path, *args: str, data: bytes | None = None, env: dict[str, str] | None = None) -> bytes:
        full_env = {
            **os.environ,
            "GIT_DIR": str(gdir),
            "GIT_AUTHOR_NAME": "hub-double",
            "GIT_AUTHOR_EMAIL": "hub-double@127.0.0.1",
            "GIT_COMMITTER_NAME": "hub-double",
            "GIT_COMMITTER_EMAIL": "hub-double@127.0.0.1",
            **(env or {}),
        }
        proc = subprocess.run(
            ["git", *args], input=data, capture_output=True, env=full_env, timeout=600, check=False
        )  # hang guard
        if proc.returncode != 0:
            raise GitError(proc.stderr.decode(errors="replace").strip())
        return proc.stdout

    def exists(self, repo_type: str, repo_id: str) -> bool:
        return (self.git_dir(repo_type, repo_id) / "HEAD").exists()

    def create(self, repo_type: str, repo_id: str) -> bool:
        with self._lock:
            gdir = self.git_dir(repo_type, repo_id)
            if self.exists(repo_type, repo_id):
                return False
            gdir.mkdir(parents=True)
            subprocess.run(["git", "init", "--bare", "-q", "-b", "main", str(gdir)], check=True, timeout=600)
            # The Hub creates every repo with an initial commit holding .gitattributes.
            attrs = "".join(f"*{ext} filter=lfs diff=lfs merge=lfs -text\n" for ext in LFS_EXTENSIONS).encode()
            self.commit(repo_type, repo_id, "main", "initial commit", "", [("add", ".gitattributes", attrs)], None)
            return True

    def resolve(self, repo_type: str, repo_id: str, rev: str) -> str | None:
        gdir = self.git_dir(repo_type, repo_id)
        rev = urllib.parse.unquote(rev)
        for candidate in (f"refs/heads/{rev}", f"refs/tags/{rev}", rev):
            try:
                return self.git(gdir, "rev-parse", "--verify", "-q", f"{candidate}^{{commit}}").decode().strip()
            except GitError:
                continue
        return None

    def lfs_object(self, repo_type: str, repo_id: str, oid: str) -> Path:
        return self.git_dir(repo_type, repo_id) / "lfs" / "objects" / oid[:2] / oid[2:4] / oid

    def entries(self, repo_type: str, repo_id: str, commit: str) -> dict[str, dict[str, Any]]:
        """All files of a commit: path -> {blob, size, lfs: {oid, size, pointerSize} | None}."""
        gdir = self.git_dir(repo_type, repo_id)
        out = self.git(gdir, "ls-tree", "-r", "-l", "-z", commit)
        files: dict[str, dict[str, Any]] = {}
        pointers = []
        for item in out.split(b"\0"):
            if not item:
                continue
            meta, path = item.split(b"\t", 1)
            _mode, _kind, blob, size = meta.decode().split()
            entry = {"blob": blob, "size": int(size), "lfs": None}
            files[path.decode()] = entry
            if int(size) < 300:
                pointers.append(entry)
        if pointers:
            blobs = self.git(gdir, "cat-file", "--batch", data="".join(e["blob"] + "\n" for e in pointers).encode())
            pos = 0
            for entry in pointers:
                header_end = blobs.index(b"\n", pos)
                size = int(blobs[pos:header_end].split()[2])
                content = blobs[header_end + 1 : header_end + 1 + size]
                pos = header_end + 1 + size + 1
                lfs = parse_pointer(content)
                if lfs is not None:
                    entry["lfs"] = {"oid": lfs[0], "size": lfs[1], "pointerSize": size}
        return files

    def read_file(self, repo_type: str, repo_id: str, entry: dict[str, Any]) -> bytes:
        if entry["lfs"] is not None:
            return self.lfs_object(repo_type, repo_id, entry["lfs"]["oid"]).read_bytes()
        return self.git(self.git_dir(repo_type, repo_id), "cat-file", "blob", entry["blob"])

    def commit(
        self,
        repo_type: str,
        repo_id: str,
        branch: str,
        summary: str,
        description: str,
        ops: list[tuple[str, str, bytes | None]],
        parent_commit: str | None,
    ) -> str:
        """Apply ``ops`` (("add", path, bytes) | ("delete", path, None) | ("delete_folder", path, None)) as one commit."""
        with self._lock:
            gdir = self.git_dir(repo_type, repo_id)
            head = self.resolve(repo_type, repo_id, branch)
            if parent_commit is not None and parent_commit != head:
                raise HubError(412, f"parentCommit {parent_commit} is not the head of {branch} ({head})")
            with tempfile.TemporaryDirectory() as tmp:
                env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
                if head is not None:
                    self.git(gdir, "read-tree", head, env=env)
                current = set(self.entries(repo_type, repo_id, head)) if head else set()
                for kind, path, content in ops:
                    if kind == "add":
                        blob = self.git(gdir, "hash-object", "-w", "--stdin", data=content).decode().strip()
                        self.git(gdir, "update-index", "--add", "--cacheinfo", f"100644,{blob},{path}", env=env)
                        current.add(path)
                    elif kind == "delete":
                        if path not in current:
                            raise HubError(404, f"A file with this name doesn't exist: {path}")
                        self._remove_from_index(gdir, path, env)
                        current.discard(path)
                    else:
                        prefix = path.rstrip("/") + "/"
                        for existing in [p for p in current if p.startswith(prefix)]:
                            self._remove_from_index(gdir, existing, env)
                            current.discard(existing)
                tree = self.git(gdir, "write-tree", env=env).decode().strip()
            message = summary + (f"\n\n{description}" if description else "")
            parents = ["-p", head] if head else []
            sha = self.git(gdir, "commit-tree", tree, *parents, "-m", message).decode().strip()
            self.git(gdir, "update-ref", f"refs/heads/{branch}", sha, head or ZERO_SHA)
            return sha

    def _remove_from_index(self, gdir: Path, path: str, env: dict[str, str]) -> None:
        # `update-index --force-remove` needs a work tree; a mode-0 `--index-info` entry removes the path in a bare repo.
        self.git(gdir, "update-index", "--index-info", data=f"0 {ZERO_SHA}\t{path}\n".encode(), env=env)

    def commits(self, repo_type: str, repo_id: str, rev: str = "main") -> list[dict[str, Any]]:
        sha = self.resolve(repo_type, repo_id, rev)
        if sha is None:
            return []
        out = self.git(self.git_dir(repo_type, repo_id), "log", "--format=%H%x1f%s%x1f%B%x1f%aI%x1e", sha).decode()
        result = []
        for record in out.split("\x1e"):
            record = record.strip("\n")
            if record:
                commit_id, title, body, date = record.split("\x1f")
                result.append({"id": commit_id, "title": title, "message": body.strip(), "date": date, "authors": []})
        return result

    def refs(self, repo_type: str, repo_id: str) -> dict[str, list[dict[str, str]]]:
        out = self.git(
            self.git_dir(repo_type, repo_id), "for-each-ref", "--format=%(refname)%09%(objectname)%09%(*objectname)"
        )
        branches, tags = [], []
        for line in out.decode().splitlines():
            ref, obj, peeled = line.split("\t")
            target = peeled or obj
            if ref.startswith("refs/heads/"):
                branches.append({"name": ref.removeprefix("refs/heads/"), "ref": ref, "targetCommit": target})
            elif ref.startswith("refs/tags/"):
                tags.append({"name": ref.removeprefix("refs/tags/"), "ref": ref, "targetCommit": target})
        return {"branches": branches, "tags": tags, "converts": [], "pullRequests": []}


class GitError(RuntimeError):
    pass


class HubError(Exception):
    def __init__(self, status: int, message: str, error_code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_code = error_code


def parse_pointer(content: bytes) -> tuple[str, int] | None:
    if not content.startswith(LFS_POINTER_PREFIX):
        return None
    fields = dict(line.split(" ", 1) for line in content.decode().splitlines() if " " in line)
    return fields["oid"].removeprefix("sha256:"), int(fields["size"])


def lfs_pointer(oid: str, size: int) -> bytes:
    return LFS_POINTER_PREFIX + f"oid sha256:{oid}\nsize {size}\n".encode()


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def validate_card_yaml(content: str, repo_type: str) -> list[str]:
    """A subset of the Hub's README metadata checks: YAML mapping, known enums, well-formed configs/dataset_info."""
    match = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", content, re.DOTALL)
    if match is None:
        return []
    try:
        meta = yaml.safe_load(match.group(1))
    except yaml.YAMLError as exc:
        return [f"YAML front matter does not parse: {exc}"]
    if meta is None:
        return []
    if not isinstance(meta, dict):
        return ["YAML front matter must be a mapping"]
    errors = []
    for key in ("tags", "task_categories", "task_ids", "size_categories", "language", "source_datasets"):
        value = meta.get(key)
        if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            errors.append(f'"{key}" must be a list of strings')
    for size in meta.get("size_categories") or []:
        if size not in VALID_SIZE_CATEGORIES:
            errors.append(f'"size_categories" value {size!r} is not one of {VALID_SIZE_CATEGORIES}')
    if meta.get("license") == "other" and not meta.get("license_name"):
        errors.append('"license: other" requires "license_name"')
    if repo_type == "dataset":
        configs = meta.get("configs", [])
        if not isinstance(configs, list):
            errors.append('"configs" must be a list')
            configs = []
        names = set()
        for config in configs:
            if not isinstance(config, dict) or not isinstance(config.get("config_name"), str):
                errors.append('every item of "configs" needs a "config_name"')
                continue
            names.add(config["config_name"])
            data_files = config.get("data_files")
            if not isinstance(data_files, (str, list)):
                errors.append(f'config {config["config_name"]!r}: "data_files" must be a string or a list')
        infos = meta.get("dataset_info", [])
        for info in infos if isinstance(infos, list) else [infos]:
            if not isinstance(info, dict) or not isinstance(info.get("features"), list):
                errors.append('every "dataset_info" item needs a "features" list')
                continue
            if len(infos if isinstance(infos, list) else [infos]) > 1 and info.get("config_name") not in names:
                errors.append(f'dataset_info config_name {info.get("config_name")!r} has no entry in "configs"')
    return errors


class _Handler(BaseHTTPRequestHandler):
    hub: HubDouble
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - BaseHTTPRequestHandler's signature
        pass

    # ------------------------------------------------------------------ plumbing
    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, head: bool = False) -> None:
        self.send_response(status)
        headers = {"Content-Type": "application/json", **(headers or {})}
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)
        self.hub.log.append((self.command, self.path, status))

    def _json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers)

    def _error(self, exc: HubError) -> None:
        headers = {"X-Error-Message": exc.message[:200].replace("\n", " ")}
        if exc.error_code:
            headers["X-Error-Code"] = exc.error_code
        self._json(exc.status, {"error": exc.message}, headers)

    def _require_auth(self) -> None:
        if self.hub.token is None:
            return
        if self.headers.get("Authorization") != f"Bearer {self.hub.token}":
            raise HubError(401, "Invalid credentials in Authorization header")

    def _repo(self, repo_type: str, org: str, name: str) -> str:
        repo_id = f"{org}/{name}"
        if not self.hub.exists(repo_type, repo_id):
            raise HubError(404, f"Repository Not Found for url: {self.path}", "RepoNotFound")
        return repo_id

    def _commit_of(self, repo_type: str, repo_id: str, rev: str) -> str:
        sha = self.hub.resolve(repo_type, repo_id, rev)
        if sha is None:
            raise HubError(404, f"Revision Not Found: {rev}", "RevisionNotFound")
        return sha

    def _fault(self, kind: str) -> bool:
        """Answer with an injected error if one is queued for ``kind`` (call after reading the request body)."""
        code = self.hub.faults.take(kind)
        if code is None:
            return False
        self._json(code, {"error": f"injected transient error on {kind}"})
        return True

    def _dispatch(self, routes: list[tuple[str, Any]]) -> None:
        parsed = urllib.parse.urlsplit(self.path)
        self.query = urllib.parse.parse_qs(parsed.query)
        try:
            for pattern, handler in routes:
                match = re.fullmatch(pattern, parsed.path)
                if match:
                    handler(**match.groupdict())
                    return
            raise HubError(404, f"no route for {self.command} {parsed.path}")
        except HubError as exc:
            self._error(exc)
        except GitError as exc:
            self._error(HubError(500, f"git failed: {exc}"))
        except (BrokenPipeError, ConnectionResetError):
            pass

    # ------------------------------------------------------------------ verbs
    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        self._dispatch(self._read_routes())

    def do_HEAD(self) -> None:  # noqa: N802
        self._dispatch(self._read_routes())

    def do_POST(self) -> None:  # noqa: N802
        t = "(?P<repo_type>models|datasets|spaces)"
        repo = r"(?P<org>[^/]+)/(?P<name>[^/]+)"
        self._dispatch(
            [
                (r"/api/repos/create", self.create_repo),
                (r"/api/validate-yaml", self.validate_yaml),
                (rf"/api/{t}/{repo}/preupload/(?P<rev>.+)", self.preupload),
                (rf"/api/{t}/{repo}/commit/(?P<rev>.+)", self.commit),
                (rf"/api/{t}/{repo}/tag/(?P<rev>.+)", self.tag),
                (rf"/api/{t}/{repo}/paths-info/(?P<rev>.+)", self.paths_info),
                (rf"/(?:(?P<repo_type>datasets|spaces)/)?{repo}\.git/info/lfs/objects/batch", self.lfs_batch),
            ]
        )

    def do_PUT(self) -> None:  # noqa: N802
        t = "(?P<repo_type>models|datasets|spaces)"
        self._dispatch(
            [
                (rf"/lfs-upload/{t}/(?P<org>[^/]+)/(?P<name>[^/]+)/(?P<oid>[0-9a-f]{{64}})", self.lfs_put),
                (rf"/api/{t}/(?P<org>[^/]+)/(?P<name>[^/]+)/settings", self.update_settings),
            ]
        )

    def _read_routes(self) -> list[tuple[str, Any]]:
        t = "(?P<repo_type>models|datasets|spaces)"
        repo = r"(?P<org>[^/]+)/(?P<name>[^/]+)"
        return [
            (r"/api/whoami-v2", self.whoami),
            (rf"/api/{t}/{repo}/revision/(?P<rev>[^/]+)", self.repo_info),
            (rf"/api/{t}/{repo}", self.repo_info),
            (rf"/api/{t}/{repo}/refs", self.list_refs),
            (rf"/api/{t}/{repo}/commits/(?P<rev>[^/]+)", self.list_commits),
            (rf"/api/{t}/{repo}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?", self.tree),
            (rf"/(?P<repo_type>datasets|spaces)/{repo}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", self.resolve_file),
            (rf"/{repo}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", self.resolve_file),
        ]

    # ------------------------------------------------------------------ write routes
    def create_repo(self) -> None:
        self._require_auth()
        payload = json.loads(self._body() or b"{}")
        if self._fault("create"):
            return
        repo_type = (payload.get("type") or "model") + "s"
        repo_id = f"{payload.get('organization')}/{payload['name']}"
        url = f"{self.hub.url}/{'' if repo_type == 'models' else repo_type + '/'}{repo_id}"
        if not self.hub.create(repo_type, repo_id):
            self._json(409, {"error": "You already created this repo", "url": url})
            return
        self._json(200, {"url": url, "name": repo_id, "id": repo_id})

    def validate_yaml(self) -> None:
        payload = json.loads(self._body() or b"{}")
        errors = validate_card_yaml(payload.get("content", ""), payload.get("repoType", "model"))
        if errors:
            self._json(400, {"error": "; ".join(errors), "errors": [{"message": e} for e in errors]})
        else:
            self._json(200, {"errors": [], "warnings": []})

    def preupload(self, repo_type: str, org: str, name: str, rev: str) -> None:
        self._require_auth()
        repo_id = self._repo(repo_type, org, name)
        payload = json.loads(self._body() or b"{}")
        if self._fault("preupload"):
            return
        sha = self.hub.resolve(repo_type, repo_id, rev)
        existing = self.hub.entries(repo_type, repo_id, sha) if sha else {}
        files = []
        for item in payload.get("files", []):
            path, size = item["path"], int(item["size"])
            sample = base64.b64decode(item.get("sample", ""))
            is_lfs = path.lower().endswith(LFS_EXTENSIONS) or size > LFS_SIZE_THRESHOLD or b"\0" in sample
            entry = existing.get(path)
            oid = None
            if entry is not None:
                oid = entry["lfs"]["oid"] if entry["lfs"] else entry["blob"]
            files.append(
                {"path": path, "uploadMode": "lfs" if is_lfs else "regular", "shouldIgnore": False, "oid": oid}
            )
        self._json(200, {"files": files, "commitOid": sha})

    def lfs_batch(self, org: str, name: str, repo_type: str | None = None) -> None:
        self._require_auth()
        repo_type = repo_type or "models"
        repo_id = self._repo(repo_type, org, name)
        payload = json.loads(self._body() or b"{}")
        if self._fault("lfs_batch"):
            return
        objects = []
        for obj in payload.get("objects", []):
            oid, size = obj["oid"], int(obj["size"])
            entry: dict[str, Any] = {"oid": oid, "size": size, "authenticated": True}
            if not self.hub.lfs_object(repo_type, repo_id, oid).exists():
                href = f"{self.hub.url}/lfs-upload/{repo_type}/{repo_id}/{oid}"
                entry["actions"] = {"upload": {"href": href, "header": {}, "expires_in": 3600}}
            objects.append(entry)
        self._json(200, {"transfer": "basic", "objects": objects}, {"Content-Type": "application/vnd.git-lfs+json"})

    def lfs_put(self, repo_type: str, org: str, name: str, oid: str) -> None:
        repo_id = self._repo(repo_type, org, name)
        faults = self.hub.faults
        with self.hub._lock:
            hold = faults.hold_lfs_after is not None and self.hub.lfs_puts_ok >= faults.hold_lfs_after
            if hold:
                faults.held += 1
        if hold:
            # Simulates a server that stops answering mid-publish: wait for the test (or ``stop``), then drop the
            # connection. No timeout: a busy machine may take long to reach the kill, and a timed-out hold would let
            # the client finish instead.
            faults.release.wait()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        data = self._body()
        code = faults.take("lfs_put")
        if code is not None:
            self._json(code, {"error": "injected transient error on lfs_put"})
            return
        if hashlib.sha256(data).hexdigest() != oid:
            raise HubError(400, f"uploaded content does not match oid {oid}")
        path = self.hub.lfs_object(repo_type, repo_id, oid)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".part")
        tmp.write_bytes(data)
        tmp.replace(path)
        with self.hub._lock:
            self.hub.lfs_puts_ok += 1
        self._send(200, b"", {"Content-Type": "text/plain"})

    def commit(self, repo_type: str, org: str, name: str, rev: str) -> None:
        self._require_auth()
        repo_id = self._repo(repo_type, org, name)
        body = self._body()
        if self.hub.faults.take("commit") is not None:
            self._json(503, {"error": "injected transient error on commit"})
            return
        header: dict[str, Any] = {}
        ops: list[tuple[str, str, bytes | None]] = []
        for line in body.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                header = value
            elif key == "file":
                ops.append(("add", value["path"], base64.b64decode(value["content"])))
            elif key == "lfsFile":
                obj = self.hub.lfs_object(repo_type, repo_id, value["oid"])
                if not obj.exists():
                    raise HubError(400, f"LFS object {value['oid']} for {value['path']} was never uploaded")
                size = value.get("size", obj.stat().st_size)
                ops.append(("add", value["path"], lfs_pointer(value["oid"], int(size))))
            elif key == "deletedFile":
                ops.append(("delete", value["path"], None))
            elif key == "deletedFolder":
                ops.append(("delete_folder", value["path"], None))
            else:
                raise HubError(400, f"unknown commit operation {key!r}")
        branch = urllib.parse.unquote(rev)
        if self.hub.resolve(repo_type, repo_id, f"refs/heads/{branch}") is None:
            raise HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
        sha = self.hub.commit(
            repo_type,
            repo_id,
            branch,
            header.get("summary", ""),
            header.get("description", ""),
            ops,
            header.get("parentCommit"),
        )
        prefix = "" if repo_type == "models" else f"{repo_type}/"
        self._json(200, {"commitUrl": f"{self.hub.url}/{prefix}{repo_id}/commit/{sha}", "commitOid": sha})

    def update_settings(self, repo_type: str, org: str, name: str) -> None:
        """``HfApi.update_repo_settings``: ``{"gated": "auto"|"manual"|false, "visibility": ...}``, recorded."""
        self._require_auth()
        repo_id = self._repo(repo_type, org, name)
        payload = json.loads(self._body() or b"{}")
        self.hub.settings_calls.append((repo_type, repo_id, payload))
        if self._fault("settings"):
            return
        if "gated" in payload and payload["gated"] not in ("auto", "manual", False):
            raise HubError(400, f"invalid gated value {payload['gated']!r}")
        with self.hub._lock:
            self.hub.settings.setdefault((repo_type, repo_id), {}).update(payload)
        self._json(200, {})

    def tag(self, repo_type: str, org: str, name: str, rev: str) -> None:
        self._require_auth()
        repo_id = self._repo(repo_type, org, name)
        payload = json.loads(self._body() or b"{}")
        if self._fault("tag"):
            return
        sha = self._commit_of(repo_type, repo_id, rev)
        tag = payload["tag"]
        gdir = self.hub.git_dir(repo_type, repo_id)
        with self.hub._lock:
            if self.hub.resolve(repo_type, repo_id, f"refs/tags/{tag}") is not None:
                raise HubError(409, f"Tag {tag} already exists")
            self.hub.git(gdir, "update-ref", f"refs/tags/{tag}", sha, ZERO_SHA)
        self._json(200, {})

    # ------------------------------------------------------------------ read routes
    def whoami(self) -> None:
        self._require_auth()
        self._json(200, {"type": "user", "name": "hub-double", "orgs": [], "auth": {"type": "access_token"}})

    def _file_info(self, path: str, entry: dict[str, Any]) -> dict[str, Any]:
        info: dict[str, Any] = {"type": "file", "oid": entry["blob"], "size": entry["size"], "path": path}
        if entry["lfs"] is not None:
            info["size"] = entry["lfs"]["size"]
            info["lfs"] = dict(entry["lfs"])
        return info

    def _sibling(self, path: str, entry: dict[str, Any]) -> dict[str, Any]:
        """A ``siblings`` item; with ``?blobs=true`` (``files_metadata=True``) also size, blob id and LFS info."""
        if self.query.get("blobs", ["false"])[0].lower() not in ("1", "true"):
            return {"rfilename": path}
        sibling: dict[str, Any] = {"rfilename": path, "size": entry["size"], "blobId": entry["blob"]}
        if entry["lfs"] is not None:
            lfs = entry["lfs"]
            sibling["size"] = lfs["size"]
            sibling["lfs"] = {"sha256": lfs["oid"], "size": lfs["size"], "pointerSize": lfs["pointerSize"]}
        return sibling

    def repo_info(self, repo_type: str, org: str, name: str, rev: str = "main") -> None:
        repo_id = self._repo(repo_type, org, name)
        sha = self._commit_of(repo_type, repo_id, rev)
        files = self.hub.entries(repo_type, repo_id, sha)
        card_data = None
        if "README.md" in files:
            readme = self.hub.read_file(repo_type, repo_id, files["README.md"]).decode()
            match = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", readme, re.DOTALL)
            card_data = yaml.safe_load(match.group(1)) if match else None
        date = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())
        self._json(
            200,
            {
                "_id": hashlib.sha1(repo_id.encode(), usedforsecurity=False).hexdigest()[:24],
                "id": repo_id,
                "author": org,
                "sha": sha,
                "private": False,
                "gated": self.hub.settings.get((repo_type, repo_id), {}).get("gated", False),
                "disabled": False,
                "lastModified": date,
                "createdAt": date,
                "tags": [],
                "cardData": card_data,
                "siblings": [self._sibling(p, files[p]) for p in sorted(files)],
            },
        )

    def list_refs(self, repo_type: str, org: str, name: str) -> None:
        repo_id = self._repo(repo_type, org, name)
        self._json(200, self.hub.refs(repo_type, repo_id))

    def list_commits(self, repo_type: str, org: str, name: str, rev: str) -> None:
        repo_id = self._repo(repo_type, org, name)
        self._commit_of(repo_type, repo_id, rev)
        self._json(200, self.hub.commits(repo_type, repo_id, rev))

    def tree(self, repo_type: str, org: str, name: str, rev: str, path: str | None = None) -> None:
        repo_id = self._repo(repo_type, org, name)
        sha = self._commit_of(repo_type, repo_id, rev)
        files = self.hub.entries(repo_type, repo_id, sha)
        base = urllib.parse.unquote(path or "").strip("/")
        recursive = self.query.get("recursive", ["false"])[0].lower() in ("1", "true")
        prefix = base + "/" if base else ""
        if base and base in files:
            raise HubError(404, f"{base} is a file, not a folder", "EntryNotFound")
        listed: dict[str, dict[str, Any]] = {}
        for file_path, entry in sorted(files.items()):
            if not file_path.startswith(prefix):
                continue
            rest = file_path[len(prefix) :].split("/")
            for depth in range(1, len(rest)):
                folder = prefix + "/".join(rest[:depth])
                if (recursive or depth == 1) and folder not in listed:
                    listed[folder] = {
                        "type": "directory",
                        "oid": git_blob_sha1(folder.encode()),
                        "size": 0,
                        "path": folder,
                    }
            if recursive or len(rest) == 1:
                listed[file_path] = self._file_info(file_path, entry)
        if base and not listed:
            raise HubError(404, f"Entry Not Found: {base}", "EntryNotFound")
        self._json(200, list(listed.values()))

    def paths_info(self, repo_type: str, org: str, name: str, rev: str) -> None:
        repo_id = self._repo(repo_type, org, name)
        body = self._body().decode()
        if self.headers.get("Content-Type", "").startswith("application/json"):
            paths = json.loads(body).get("paths", [])
        else:
            paths = urllib.parse.parse_qs(body).get("paths", [])
        sha = self._commit_of(repo_type, repo_id, rev)
        files = self.hub.entries(repo_type, repo_id, sha)
        result = []
        for path in paths:
            path = path.strip("/")
            if path in files:
                result.append(self._file_info(path, files[path]))
            elif any(p.startswith(path + "/") for p in files) or path == "":
                result.append({"type": "directory", "oid": git_blob_sha1(path.encode()), "size": 0, "path": path})
        self._json(200, result)

    def resolve_file(self, org: str, name: str, rev: str, path: str, repo_type: str = "models") -> None:
        repo_id = self._repo(repo_type, org, name)
        gated = self.hub.gate_reads and self.hub.settings.get((repo_type, repo_id), {}).get("gated", False)
        if gated and (self.hub.token is None or self.headers.get("Authorization") != f"Bearer {self.hub.token}"):
            raise HubError(401, f"Access to model {repo_id} is restricted: you must accept its conditions", "GatedRepo")
        sha = self._commit_of(repo_type, repo_id, rev)
        path = urllib.parse.unquote(path)
        files = self.hub.entries(repo_type, repo_id, sha)
        entry = files.get(path)
        if entry is None:
            self._send(
                404,
                json.dumps({"error": "Entry not found"}).encode(),
                {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": sha},
                head=self.command == "HEAD",
            )
            return
        etag = entry["lfs"]["oid"] if entry["lfs"] else entry["blob"]
        headers = {
            "Content-Type": "application/octet-stream",
            "X-Repo-Commit": sha,
            "ETag": f'"{etag}"',
            "Accept-Ranges": "bytes",
        }
        size = entry["lfs"]["size"] if entry["lfs"] else entry["size"]
        if self.command == "HEAD":
            self.send_response(200)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            self.hub.log.append((self.command, self.path, 200))
            return
        data = self.hub.read_file(repo_type, repo_id, entry)
        range_header = self.headers.get("Range")
        self.hub.downloads.append((path, range_header))
        faults = self.hub.faults
        hold = faults.hold_downloads_after
        if hold is not None and len(data) > hold and not range_header:
            # A download stuck mid-body: the full length announced, part of the body sent, then nothing until the
            # test (having killed the client) releases it.
            self.send_response(200)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[:hold])
            self.wfile.flush()
            with self.hub._lock:
                faults.held_downloads += 1
            faults.release.wait()  # the test's release, or ``stop``; no timeout (see the large-file upload hold)
            self.close_connection = True
            self.connection.shutdown(2)
            return
        match = re.fullmatch(r"bytes=(\d*)-(\d*)", range_header or "")
        if match and (match.group(1) or match.group(2)):
            if match.group(1):
                start = int(match.group(1))
                end = int(match.group(2)) if match.group(2) else len(data) - 1
            else:
                start, end = max(0, len(data) - int(match.group(2))), len(data) - 1
            end = min(end, len(data) - 1)
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            self._send(206, data[start : end + 1], headers)
            return
        self._send(200, data, headers)
