"""``lance-cf publish`` and ``lance-cf publish-results``: push a release (or evaluation results) to the Hub.

Top-level imports stay light (argparse and stdlib): huggingface_hub is imported inside ``run``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

from builder.publish import PublishError, create_api, publish_release, publish_results, redact_url


def register(subparsers) -> None:
    """Add the ``publish`` and ``publish-results`` subcommands."""
    publish = subparsers.add_parser(
        "publish",
        help="upload a release to the Hugging Face Hub and tag it v<version>",
        description=(
            "Verify a release directory and check that load_dataset opens every config, then create the dataset repo "
            "if missing, gate it when the card says so, upload exactly the files the manifest lists plus the card "
            "rendered for the repo as one commit (large files through the Hub's large-file path) and tag it "
            "v<version>. Other files in the directory are named and left out; links are never followed; the "
            "directory is only read. A version whose tag exists is refused; re-running after an interruption resumes "
            "without duplicating files or commits. The token comes from HF_TOKEN or `hf auth login`; HF_ENDPOINT "
            "selects a self-hosted hub."
        ),
    )
    publish.add_argument("release_dir", metavar="DIR", help="release directory (contains manifest.json)")
    publish.add_argument("--repo-id", required=True, help="target dataset repo, ORG/NAME")
    publish.add_argument("--private", action="store_true", help="create the repo private (ignored if it exists)")
    publish.add_argument("--dry-run", action="store_true", help="print the plan (files, sizes, revision, tag) only")
    publish.add_argument("--revision", default="main", help="branch to commit to (default: main)")
    publish.add_argument(
        "--strict",
        action="store_true",
        help="refuse a release directory holding files the manifest does not list (default: leave them out, named)",
    )
    publish.add_argument(
        "--gated",
        choices=("auto", "manual"),
        default=None,
        help="access requests approved automatically or by hand; set when the card says gated (ImageNet-derived "
        "releases). Default: auto, or the mode the repo already has",
    )
    publish.add_argument(
        "--allow-local-paths",
        action="store_true",
        help="publish a manifest or card that holds this machine's paths (refused by default)",
    )
    publish.set_defaults(func=run_publish)

    results = subparsers.add_parser(
        "publish-results",
        help="add evaluation results and the leaderboard to a published release repo",
        description=(
            "Upload evaluation results JSONs under results/, write results/leaderboard.md and refresh the card's "
            "leaderboard section, as one new commit. Existing version tags are not moved."
        ),
    )
    results.add_argument("results_dir", metavar="RESULTS_DIR", help="directory of results JSONs (or one JSON file)")
    results.add_argument("--repo-id", required=True, help="target dataset repo, ORG/NAME")
    results.add_argument("--dry-run", action="store_true", help="print the files that would be added only")
    results.add_argument("--revision", default="main", help="branch to commit to (default: main)")
    results.set_defaults(func=run_publish_results)


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


def _talk_to_hub(command: str, action):
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


def run_publish(args: argparse.Namespace) -> int:
    outcome = _talk_to_hub(
        "publish",
        lambda: publish_release(
            args.release_dir,
            args.repo_id,
            private=args.private,
            dry_run=args.dry_run,
            revision=args.revision,
            strict=args.strict,
            gated=args.gated,
            allow_local_paths=args.allow_local_paths,
        ),
    )
    if outcome is None:
        return 1
    if args.dry_run:
        print("dry run: nothing was uploaded")
        print(outcome.describe())
    else:
        gating = f", gated: {outcome.gated}" if outcome.gated else ""
        print(f"published {outcome.repo_id} {outcome.tag} (commit {outcome.commit}, {outcome.files} files{gating})")
        print(f'load with: load_dataset("{outcome.repo_id}", "counterfactual", split="test", revision="{outcome.tag}")')
    return 0


def run_publish_results(args: argparse.Namespace) -> int:
    outcome = _talk_to_hub(
        "publish-results",
        lambda: publish_results(args.results_dir, args.repo_id, revision=args.revision, dry_run=args.dry_run),
    )
    if outcome is None:
        return 1
    prefix = "dry run: would add" if args.dry_run else f"committed {outcome['commit']}:"
    print(f"{prefix} {len(outcome['files'])} results files to {outcome['repo_id']}@{outcome['revision']}")
    for path in outcome["files"]:
        print(f"  {path}")
    return 0
