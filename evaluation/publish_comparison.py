"""Publish an editor comparison to a release's Hub repository, as results are published (``publish_results``): the
files of ``lance-cf compare-editors`` under ``results/editors/`` and the card's ``## Editors compared`` section
refreshed (table and plot, the plot linked by its path in the repo), in one commit on the branch; version tags are
never moved. The comparison must include the release the branch holds (its manifest digest).

The card of a release's next version carries the comparison in its manifest instead (``lance-cf add-comparison``):
that one verifies and is kept by later publishes of that version; this one is a note on the repo's current card, as
the leaderboard is, and the next release's card replaces it.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from builder import release_format as rf
from builder.release_format.hub_client import (
    REPO_TYPE,
    RESULTS_DIR,
    PublishError,
    branch_head,
    check_repo_id,
    create_api,
    refuse_token,
    retry,
)
from evaluation.editors_section import replace_editors_section
from lance_pipeline.readers import read_json

logger = logging.getLogger(__name__)

COMPARISON_DIR = f"{RESULTS_DIR}/editors"
# compare-editors' files that are uploaded (fidelity_samples.csv and fidelity.html stay local: the card links the plot)
UPLOADED = (rf.COMPARISON_FILE, "fidelity.md", "fidelity.csv", "fidelity.png")
PLOT_IN_REPO = f"{COMPARISON_DIR}/fidelity.png"


def publish_comparison(
    comparison: Path, repo_id: str, *, revision: str = "main", dry_run: bool = False, api: Any = None
) -> dict[str, Any]:
    """Upload ``comparison``'s files under ``results/editors/`` and refresh the card's editors section, one commit.

    Raises:
        ValueError: (one line) not a compare-editors output folder, or a file of it missing.
        PublishError: the repo or branch has no release, or the comparison does not include the release it holds.
    """
    from huggingface_hub import CommitOperationAdd

    check_repo_id(repo_id)
    comparison = Path(comparison)
    record = rf.read_comparison(comparison)
    folder = comparison if comparison.is_dir() else comparison.parent
    missing = [name for name in UPLOADED if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"{folder}: no {', '.join(missing)}; give the --output folder of `lance-cf compare-editors`")
    contents = {f"{COMPARISON_DIR}/{name}": (folder / name).read_bytes() for name in UPLOADED}
    refuse_token(contents)
    files = sorted([*contents, rf.CARD_NAME])
    if dry_run:
        return {"repo_id": repo_id, "revision": revision, "files": files, "commit": None}
    api = api or create_api()
    head, _ = retry("list_repo_refs", lambda: branch_head(api, repo_id, revision))
    if head is None:
        raise PublishError(f"{repo_id} has no branch {revision!r}: publish a release before its comparison")
    remote = api.list_repo_files(repo_id, repo_type=REPO_TYPE, revision=head)
    if rf.CARD_NAME not in remote or rf.MANIFEST_NAME not in remote:
        raise PublishError(f"{repo_id}@{revision} holds no release: publish a release before its comparison")
    with tempfile.TemporaryDirectory() as tmp:

        def download(name: str) -> Path:
            return Path(api.hf_hub_download(repo_id, name, repo_type=REPO_TYPE, revision=head, local_dir=tmp))

        manifest = read_json(download(rf.MANIFEST_NAME), what=f"{repo_id}: {rf.MANIFEST_NAME}")
        readme = download(rf.CARD_NAME).read_text(encoding="utf-8")
    compared = {entry["manifest_sha256"] for entry in record["releases"]}
    if manifest.get("manifest_sha256") not in compared:
        names = ", ".join(f"{e['name']} {e['version']}" for e in record["releases"])
        raise PublishError(
            f"{comparison} compared {names}, not {manifest.get('name')} {manifest.get('version')}, the release "
            f"{repo_id}@{revision} holds; run `lance-cf compare-editors` with that release"
        )
    card = replace_editors_section(readme, {**manifest, rf.EDITOR_COMPARISON: record}, PLOT_IN_REPO)
    operations = [CommitOperationAdd(path, data) for path, data in sorted(contents.items())]
    operations.append(CommitOperationAdd(rf.CARD_NAME, card.encode()))
    info = retry(
        "create_commit",
        lambda: api.create_commit(
            repo_id,
            operations,
            commit_message=f"Add the editors compared ({len(record['releases'])} releases)",
            repo_type=REPO_TYPE,
            revision=revision,
        ),
    )
    logger.info("published the editors comparison to %s (commit %s)", repo_id, info.oid)
    return {"repo_id": repo_id, "revision": revision, "files": files, "commit": info.oid}
