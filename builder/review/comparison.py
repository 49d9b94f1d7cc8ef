"""``lance-cf add-comparison RELEASE CMP --output NEW``: the next version of a release, its card carrying the editors
compared.

``lance-cf compare-editors --release A --release B ... --output CMP`` writes ``CMP/fidelity.json``. This command checks
that RELEASE is one of the releases compared there (by its manifest digest) and writes its next version (``MAJOR.
(MINOR+1).0``, or ``--version``): every shard copied byte for byte (``builder.review.apply.reseal_next_version``, as
``review calibrate`` does), the manifest gaining the comparison (``editor_comparison``: the releases compared with
name, version and config hash, the shared source images, the counterfactuals of each, the models whose results gave
the accuracy drop, the CLIP model, the table). The card's ``## Editors compared`` section and its plot
(``assets/editors-compared.png``, hashed into the manifest's ``assets``) are rendered from that record
(``evaluation.editors_section``), by the build's card and by publish's alike, so the new version verifies and
publishes as every release does. A new version, not an edited card: the manifest (and with it its digest) changes, and
a version names one manifest.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from builder import release_format as rf
from builder.release_format.lock import declare_output
from builder.review.apply import check_new_output, next_version, reseal_next_version
from builder.review.index import ReleaseIndex

logger = logging.getLogger(__name__)


def add_comparison(release: Path, comparison: Path, output: Path, *, version: str | None = None) -> dict[str, Any]:
    """Write the next version of ``release`` to ``output`` (new or empty), its manifest recording the comparison of
    ``comparison`` (a ``compare-editors`` output folder); return its manifest.

    Raises:
        ValueError: (one line) the comparison is not one of this release, or ``output`` is not new.
    """
    release, output = Path(release), Path(output)
    check_new_output(release, output)
    record = rf.read_comparison(comparison)
    index = ReleaseIndex(release)
    old = index.manifest
    compared = {entry["manifest_sha256"] for entry in record["releases"]}
    if old.manifest_sha256 not in compared:
        names = ", ".join(f"{e['name']} {e['version']}" for e in record["releases"])
        raise ValueError(
            f"{comparison} compared {names}, not {old.name} {old.version} (manifest sha256 "
            f"{old.manifest_sha256[:12]}…); run `lance-cf compare-editors` with --release {release}"
        )
    version = version or next_version(old.version)
    rf.parse_release_version(version)
    manifest = reseal_next_version(release, output, index, {rf.EDITOR_COMPARISON: record}, version)
    logger.info("editors compared: %s %s -> %s (%d table rows)", old.name, old.version, version, len(record["table"]))
    return manifest


# ---------------------------------------------------------------------------------------------- CLI


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``add-comparison`` subcommand."""
    p = subparsers.add_parser(
        "add-comparison",
        help="the next version of a release whose card shows the editors compared (from compare-editors' output)",
        description=(
            "Write the next version of RELEASE (same shards, byte for byte) whose manifest records the comparison "
            "`lance-cf compare-editors` wrote to COMPARISON (RELEASE must be one of the releases it compared): its "
            "card gains the section 'Editors compared' (which releases, how many shared source images and edits, "
            "which models the accuracy drop is from, the table) and its plot (assets/editors-compared.png). Verify "
            "and publish it as any release."
        ),
    )
    p.add_argument("release", metavar="RELEASE", type=Path, help="release directory (one of those compared)")
    p.add_argument("comparison", metavar="COMPARISON", type=Path, help="the --output folder of compare-editors")
    p.add_argument("--output", "-o", required=True, type=Path, help="the new release directory (new or empty)")
    p.add_argument("--version", dest="release_version", metavar="SEMVER", help="the new version (default: next minor)")
    p.set_defaults(func=run_add_comparison)
    declare_output(p, "add-comparison", lambda args: args.output)


def run_add_comparison(args: argparse.Namespace) -> int:
    manifest = add_comparison(args.release, args.comparison, args.output, version=args.release_version)
    print(
        f"wrote {manifest['name']} {manifest['version']} to {args.output}: its card shows the editors compared "
        f"({len(manifest[rf.EDITOR_COMPARISON]['releases'])} releases); lance-cf verify {args.output}"
    )
    return 0
