"""Talking to the Hub safely, for every command that publishes (a release, evaluation results, learned tokens, a
perturber): the repo id check, the API client on ``$HF_ENDPOINT`` read at call time, retries of idempotent calls on
transient errors, strict JSON bytes, and the refusals of what must never be published (a token, a path of this
machine). Credentials in an endpoint are redacted from everything printed (:func:`redact_url`); the token is never
logged, printed or written, only compared with what would be published.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from builder.release_format.versioning import is_release_version, parse_release_version

logger = logging.getLogger(__name__)

REPO_TYPE = "dataset"
# Evaluation results on a release's repo: a release commit never deletes them (they accumulate across versions).
RESULTS_DIR = "results"
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
RETRY_ATTEMPTS = 3
RETRY_WAIT_S = 0.5
T = TypeVar("T")

# ``scheme://user:password@host``: the userinfo part is replaced before any URL is printed or logged.
URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]*@")
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


def redact_url(text: str) -> str:
    """``text`` with the ``user:password@`` part of every URL in it replaced by ``***@``."""
    return URL_USERINFO.sub(r"\1***@", text)


def check_repo_id(repo_id: str) -> str:
    if not REPO_ID.match(repo_id or ""):
        raise ValueError(f"--repo-id {repo_id!r} is not a Hub repo id; expected ORG/NAME")
    return repo_id


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


def refuse_local_paths(what: str, found: list[tuple[str, str]]) -> None:
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


def hub_endpoint() -> str:
    """``$HF_ENDPOINT`` read now (huggingface_hub fixed its default at import), or huggingface_hub's default."""
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


def create_api(endpoint: str | None = None):
    """An ``HfApi`` on ``endpoint`` or ``$HF_ENDPOINT`` (read now, not at import) with the standard token sources."""
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint or hub_endpoint())


def _is_transient(exc: Exception) -> bool:
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        return exc.response.status_code in (408, 429, 500, 502, 503, 504)
    try:
        import httpx2

        return isinstance(exc, httpx2.TransportError)
    except ImportError:  # pragma: no cover - httpx2 is a huggingface_hub dependency
        return False


def retry(what: str, fn: Callable[[], T]) -> T:
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


def branch_head(api: Any, repo_id: str, revision: str) -> tuple[str | None, dict[str, str]]:
    refs = api.list_repo_refs(repo_id, repo_type=REPO_TYPE)
    head = next((b.target_commit for b in refs.branches if b.name == revision), None)
    return head, {t.name: t.target_commit for t in refs.tags}


def version_key(tag: str) -> Any:
    """The release version a tag ``v<version>`` names (ordered as ``packaging`` orders versions), or None."""
    version = tag[1:] if tag.startswith("v") else None
    return parse_release_version(version) if is_release_version(version) else None


def json_bytes(obj: Any) -> bytes:
    """Strict JSON: a NaN or an infinity is refused (``allow_nan=False``), never published as a bare ``NaN`` token."""
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n").encode()


def hub_error_message(exc: BaseException) -> str | None:
    """One line for an HTTP error or an unreachable Hub (no traceback), or ``None`` for any other exception.

    The token never appears: huggingface_hub's messages name the URL and the server's answer, not the headers.
    """
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    endpoint = redact_url(create_api().endpoint)
    if isinstance(exc, OfflineModeIsEnabled):
        return (
            f"offline mode is on (HF_HUB_OFFLINE=1) and this command needs the Hub at {endpoint}: unset HF_HUB_OFFLINE"
        )
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else None
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and "developer.mozilla.org" not in ln]
        hint = ""
        if status in (401, 403):
            hint = " (check the token: HF_TOKEN or `hf auth login`, and its write access to the repo)"
        return redact_url(f"the Hub at {endpoint} refused the request: {' '.join(lines)}{hint}")
    try:
        import httpx2
    except ImportError:  # pragma: no cover - httpx2 is a huggingface_hub dependency
        return None
    if isinstance(exc, httpx2.TransportError):
        return redact_url(
            f"cannot reach the Hub at {endpoint} ({type(exc).__name__}: {exc}); check HF_ENDPOINT and the network"
        )
    return None


class _RedactingFilter(logging.Filter):
    """Strips URL credentials from every log record, ours and huggingface_hub's, before a handler writes it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact_url(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


@contextlib.contextmanager
def _redacted_logging():
    handlers = list(logging.getLogger().handlers)
    redactor = _RedactingFilter()
    for handler in handlers:
        handler.addFilter(redactor)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(redactor)


def talk_to_hub(command: str, action):
    """Run ``action``; a refusal or a Hub/HTTP error becomes one line on stderr and ``None`` (others propagate).

    Credentials in a URL (``HF_ENDPOINT=https://user:pass@host``) are redacted from every line printed or logged.
    """
    try:
        with _redacted_logging():
            return action()
    except PublishError as exc:
        sys.stderr.write(f"lance-cf {command}: {redact_url(str(exc))}\n")
    except Exception as exc:  # noqa: BLE001 - only Hub/HTTP errors are turned into one line; others re-raised
        message = hub_error_message(exc)  # first: some Hub errors (400) are also ValueErrors
        if message is not None:
            sys.stderr.write(f"lance-cf {command}: {message}\n")
            return None
        if isinstance(exc, ValueError) and redact_url(str(exc)) != str(exc):
            raise ValueError(redact_url(str(exc))) from None  # bad input: the CLI prints it as one line
        raise
    return None
