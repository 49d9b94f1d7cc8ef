"""``lance-cf publish``: push a release to the Hub (``publish-results`` is evaluation's: :mod:`evaluation.cli_publish`).

Top-level imports stay light (argparse and stdlib): huggingface_hub is imported inside ``run``.
"""

from __future__ import annotations

import argparse

from builder.publish import publish_release
from builder.release_format.hub_client import talk_to_hub
from builder.release_format.lock import declare_output


def register(subparsers) -> None:
    """Add the ``publish`` subcommand."""
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
    declare_output(publish, "publish", None)  # to the Hub; holds the release itself


def run_publish(args: argparse.Namespace) -> int:
    outcome = talk_to_hub(
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
