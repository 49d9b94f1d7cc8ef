"""``lance-cf publish-results``: add evaluation results and the leaderboard to a published release's Hub repo.

Top-level imports stay light (argparse and stdlib): huggingface_hub is imported when the command runs.
"""

from __future__ import annotations

import argparse

from builder.release_format.hub_client import talk_to_hub
from builder.release_format.lock import declare_output
from evaluation.publish_comparison import publish_comparison
from evaluation.publish_results import publish_results


def register(subparsers) -> None:
    """Add the ``publish-results`` subcommand."""
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
    declare_output(results, "publish-results", None)  # to the Hub

    comparison = subparsers.add_parser(
        "publish-comparison",
        help="add the editors compared (compare-editors' output) to a published release repo's card",
        description=(
            "Upload compare-editors' fidelity.json, .md, .csv and .png under results/editors/ and refresh the card's "
            "'Editors compared' section (table and plot), as one new commit; the comparison must include the release "
            "the branch holds. Existing version tags are not moved. (`lance-cf add-comparison` makes a release's "
            "next version that carries it instead.)"
        ),
    )
    comparison.add_argument("comparison", metavar="COMPARISON", help="the --output folder of compare-editors")
    comparison.add_argument("--repo-id", required=True, help="target dataset repo, ORG/NAME")
    comparison.add_argument("--dry-run", action="store_true", help="print the files that would be added only")
    comparison.add_argument("--revision", default="main", help="branch to commit to (default: main)")
    comparison.set_defaults(func=run_publish_comparison)
    declare_output(comparison, "publish-comparison", None)  # to the Hub


def run_publish_results(args: argparse.Namespace) -> int:
    outcome = talk_to_hub(
        "publish-results",
        lambda: publish_results(args.results_dir, args.repo_id, revision=args.revision, dry_run=args.dry_run),
    )
    return _report_commit(outcome, "results files", dry_run=args.dry_run)


def run_publish_comparison(args: argparse.Namespace) -> int:
    outcome = talk_to_hub(
        "publish-comparison",
        lambda: publish_comparison(args.comparison, args.repo_id, revision=args.revision, dry_run=args.dry_run),
    )
    return _report_commit(outcome, "files", dry_run=args.dry_run)


def _report_commit(outcome: dict | None, what: str, *, dry_run: bool) -> int:
    """Print what a publishing command committed (or would add, on a dry run), one file a line; its exit code (1 when
    the Hub refused, which ``talk_to_hub`` already said in one line)."""
    if outcome is None:
        return 1
    prefix = "dry run: would add" if dry_run else f"committed {outcome['commit']}:"
    print(f"{prefix} {len(outcome['files'])} {what} to {outcome['repo_id']}@{outcome['revision']}")
    for path in outcome["files"]:
        print(f"  {path}")
    return 0
