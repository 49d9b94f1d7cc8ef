"""Publish evaluation results to a release's Hub repository: the results JSONs under ``results/``, the leaderboard
(Markdown, and the same rows as Parquet and as the ``leaderboard`` config's WebDataset shard) and the card's
leaderboard section refreshed, in one commit on the branch; version tags are never moved. Results are checked first:
complete, computed on a release published in that repository (its manifest digest at the tag), no machine path and no
token in them.
"""

from __future__ import annotations

import json
import logging
import re
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
    json_bytes,
    refuse_token,
    retry,
    scrub_local_paths,
    version_key,
)
from builder.release_format.yaml_text import dump_yaml
from evaluation.leaderboard import build_leaderboard_by_config, leaderboard_markdown, replace_leaderboard_section
from evaluation.results import is_complete, is_results, missing_default_metrics, validate_results
from lance_pipeline.readers import InputError, read_json

logger = logging.getLogger(__name__)

LEADERBOARD_NAME = "leaderboard.md"
# The leaderboard as a table on the dataset repo: Parquet for pandas/SQL, and the same rows as one WebDataset shard
# for the `leaderboard` config, `load_dataset(REPO, "leaderboard", split="train")` (see leaderboard_tar for why).
LEADERBOARD_PARQUET = "leaderboard.parquet"
LEADERBOARD_TAR = "leaderboard.tar"
LEADERBOARD_CONFIG = "leaderboard"
LEADERBOARD_SPLIT = "train"


def load_results(results_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The evaluation results JSONs under a directory (``lance-cf eval`` writes ``OUT/<release>/<model>/results.json``) or one
    file, each validated by evaluation's own validator (:func:`evaluation.results.validate_results`).

    Other JSON files in the directory are ignored; a file that claims to be results (or is named ``results.json``) and
    does not validate is an error naming the file and the field.
    """
    results_dir = Path(results_dir)
    if not results_dir.exists():
        raise ValueError(f"{results_dir}: no such file or directory (expected the output of `lance-cf eval`)")
    paths = [results_dir] if results_dir.is_file() else sorted(results_dir.rglob("*.json"))
    loaded = []
    for path in paths:
        try:
            result = read_json(path)
        except InputError as exc:
            raise ValueError(str(exc)) from None
        if is_results(result) or path.name == "results.json" or results_dir.is_file():
            try:
                validate_results(result)
            except ValueError as exc:
                raise ValueError(f"{path}: {exc}") from None
            loaded.append((path, result))
        else:
            logger.debug("skipping %s: not a results JSON", path)
    if not loaded:
        raise ValueError(f"{results_dir}: no results JSON files found (expected the output of `lance-cf eval`)")
    return loaded


def publishable_results(loaded: list[tuple[Path, dict[str, Any]]]) -> list[tuple[Path, dict[str, Any]]]:
    """The results that may enter the leaderboard, scrubbed of machine paths.

    Refused: a ``--limit`` run or a run where samples could not be read (not complete; ranking it as complete would
    be wrong). Left out with a warning: a model whose evaluation failed (nothing to rank). Any absolute path of this
    machine left in a string (a local release's directory, a class map, a checkpoint) is reduced to its last
    component, as a second line of defence behind the evaluation writing none.

    Raises:
        PublishError: a result is not complete, or no result is left.
    """
    kept = []
    for path, result in loaded:
        if result.get("status") != "ok":
            logger.warning("%s: not published: the evaluation of this model failed (%s)", path, result.get("error"))
            continue
        if result.get("limit") is not None:
            raise PublishError(
                f"{path}: results of a --limit {result['limit']} run score part of the release and never enter a "
                "leaderboard; re-run `lance-cf eval` without --limit"
            )
        missing = missing_default_metrics(result)
        if missing:
            raise PublishError(
                f"{path}: computed without the metrics {', '.join(missing)} (--metrics), so these results are not "
                "complete; re-run `lance-cf eval` without --metrics"
            )
        if not is_complete(result):
            failed = len(result.get("failures") or [])
            raise PublishError(
                f"{path}: {failed} sample(s) could not be scored (see 'failures'), so these results are not complete; "
                "fix or re-download the release and re-run `lance-cf eval`"
            )
        clean, changed = scrub_local_paths(result)
        if changed:
            logger.warning("%s: machine paths removed before publishing from %s", path, ", ".join(changed))
        kept.append((path, clean))
    if not kept:
        raise PublishError(f"no publishable results among {len(loaded)} file(s): every evaluation failed")
    return kept


def results_path_in_repo(result: dict[str, Any]) -> str:
    model = result["model"]
    name = (model.get("slug") or model.get("name")) if isinstance(model, dict) else model
    return f"{RESULTS_DIR}/v{result['release']['version']}/{re.sub(r'[^A-Za-z0-9._-]', '_', str(name))}.json"


def by_release(results: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Results grouped by the release they were computed on (name, version, manifest hash), oldest version first.

    Models are only compared within a group: numbers on different releases are not comparable.
    """
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for result in results:
        release = result.get("release") or {}
        key = (str(release.get("name")), str(release.get("version")), str(release.get("manifest_sha256")))
        groups.setdefault(key, []).append(result)
    lowest = rf.parse_release_version("0.0.0")

    def order(item: tuple[tuple[str, str, str], Any]) -> tuple:
        version = version_key(f"v{item[0][1]}")
        return (version is None, lowest if version is None else version, item[0])

    ordered = sorted(groups.items(), key=order)
    return [({"name": n, "version": v, "manifest_sha256": h}, group) for (n, v, h), group in ordered]


def leaderboard_table(results: list[dict[str, Any]], repo_id: str | None = None) -> Any:
    """The published leaderboard: one row per model and release config, over every release version of the repo.

    Rows come from evaluation's :func:`evaluation.leaderboard.build_leaderboard_by_config`, computed per release (ranks
    and effective robustness compare models on the same data only) and concatenated; ``release_version`` tells them
    apart; with ``repo_id``, ``release_id`` names the release's repository (its provenance: id, version, manifest
    digest, and the ``metric_versions`` of each row).
    """
    import pandas as pd

    frames = [build_leaderboard_by_config(group) for _, group in by_release(results)]
    frames = [f for f in frames if len(f)]
    table = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    if repo_id is not None and len(table):  # provenance: the release's id beside its version and manifest digest
        table.insert(table.columns.get_loc("release"), "release_id", repo_id)
    return table


def leaderboard_document(results: list[dict[str, Any]], repo_id: str | None = None) -> str:
    """``results/leaderboard.md``: evaluation's ranked table, one section per release, newest first, each saying
    which release it is (repository, version, manifest digest); the table's note names the metrics and versions."""
    sections = ["# Leaderboard", ""]
    for release, group in reversed(by_release(results)):
        where = f"`{repo_id}` " if repo_id else ""
        sections += [
            f"## {release['name']} v{release['version']}",
            "",
            f"Release {where}v{release['version']}, manifest sha256 `{release['manifest_sha256']}`; "
            f"{len(group)} model(s).",
            "",
            leaderboard_markdown(group) or "No model was evaluated successfully.",
            "",
        ]
    return "\n".join(sections).rstrip("\n") + "\n"


def leaderboard_parquet(table: Any) -> bytes:
    """The table as Parquet bytes (deterministic: the same rows give the same bytes, so re-running commits nothing)."""
    import io

    buffer = io.BytesIO()
    table.to_parquet(buffer, index=False)
    return buffer.getvalue()


def leaderboard_rows(table: Any) -> list[dict[str, Any]]:
    """The table's rows as JSON-ready dicts (missing values as None)."""
    import pandas as pd

    return [
        {k: (None if not isinstance(v, (list, dict)) and pd.isna(v) else _plain(v)) for k, v in row.items()}
        for row in table.astype(object).to_dict("records")
    ]


def _plain(value: Any) -> Any:
    """numpy scalars as Python values, for JSON."""
    return value.item() if hasattr(value, "item") else value


def leaderboard_tar(table: Any) -> bytes:
    """The table as one WebDataset shard, a sample per row (``row-NNNNNN.json``), for the ``leaderboard`` config.

    Why not the Parquet file itself: ``datasets`` picks ONE builder per repo, from the first config's data files
    (``load.py``, ``infer_module_for_data_files``), here the WebDataset builder of the release configs, so a Parquet
    config on this repo would fail to load. The same rows are published as Parquet beside it for pandas and SQL.
    """
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for index, row in enumerate(leaderboard_rows(table)):
            data = json.dumps(row, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
            info = tarfile.TarInfo(f"row-{index:06d}.json")
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def leaderboard_features(table: Any) -> list[dict[str, Any]]:
    """The ``dataset_info.features`` of the ``leaderboard`` config, from the table's Arrow schema (declared, so a column
    that is null in the first rows still loads with its type)."""
    import pyarrow as pa

    schema = pa.Schema.from_pandas(table, preserve_index=False)
    fields = []
    for column in schema:
        kind = column.type
        if pa.types.is_boolean(kind):
            dtype = "bool"
        elif pa.types.is_integer(kind):
            dtype = "int64"
        elif pa.types.is_floating(kind):
            dtype = "float64"
        elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
            dtype = "string"
        elif pa.types.is_null(kind):
            dtype = "null"
        else:
            raise ValueError(f"leaderboard column {column.name!r} has type {kind}, which the card cannot declare")
        fields.append({"name": column.name, "dtype": dtype})
    return [
        {"name": "__key__", "dtype": "string"},
        {"name": "__url__", "dtype": "string"},
        {"name": "json", "struct": fields},
    ]


def with_leaderboard_config(card_text: str, table: Any) -> str:
    """The card with a ``leaderboard`` config (and its declared features) in its YAML, so that
    ``load_dataset(REPO, "leaderboard", split="train")`` reads the table and the Hub viewer shows it. Nothing else
    in the card changes."""
    if card_text.startswith("---"):
        meta, body = rf.split_card(card_text, "the card on the Hub")
    else:  # a hand-written README without YAML: the block is added (as huggingface_hub's card class does)
        meta, body = {}, card_text
    configs = [c for c in (meta.get("configs") or []) if c.get("config_name") != LEADERBOARD_CONFIG]
    configs.append(
        {
            "config_name": LEADERBOARD_CONFIG,
            "data_files": [{"split": LEADERBOARD_SPLIT, "path": f"{RESULTS_DIR}/{LEADERBOARD_TAR}"}],
        }
    )
    infos = meta.get("dataset_info") or []
    infos = [infos] if isinstance(infos, dict) else list(infos)
    infos = [i for i in infos if i.get("config_name") != LEADERBOARD_CONFIG]
    infos.append(
        {
            "config_name": LEADERBOARD_CONFIG,
            "features": leaderboard_features(table),
            "splits": [{"name": LEADERBOARD_SPLIT, "num_examples": len(table)}],
        }
    )
    meta["configs"] = configs
    meta["dataset_info"] = infos
    text = f"---\n{dump_yaml(meta)}\n---\n{body}"
    return text if text.endswith("\n") else text + "\n"


def publish_results(
    results_dir: Path,
    repo_id: str,
    *,
    revision: str = "main",
    dry_run: bool = False,
    api: Any = None,
) -> dict[str, Any]:
    """Add results JSONs under ``results/``, the leaderboard (Markdown and the Parquet table of the ``leaderboard``
    config) and a refreshed card leaderboard in one commit.

    Existing version tags are never moved: this is a new commit on ``revision`` only.
    """
    from huggingface_hub import CommitOperationAdd

    check_repo_id(repo_id)
    new = publishable_results(load_results(Path(results_dir)))
    new_paths = {results_path_in_repo(r): r for _, r in new}
    refuse_token({str(path): json_bytes(result) for path, result in new})
    if dry_run:
        return {"repo_id": repo_id, "revision": revision, "files": sorted(new_paths), "commit": None}
    api = api or create_api()
    head, tags = retry("list_repo_refs", lambda: branch_head(api, repo_id, revision))
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
                results[path] = read_json(local, what=f"{repo_id}: {path}")
        results.update(new_paths)
        readme_path = api.hf_hub_download(repo_id, rf.CARD_NAME, repo_type=REPO_TYPE, revision=head, local_dir=tmp)
        readme = Path(readme_path).read_text(encoding="utf-8")
        manifest_path = api.hf_hub_download(
            repo_id, rf.MANIFEST_NAME, repo_type=REPO_TYPE, revision=head, local_dir=tmp
        )
        branch_release = read_json(manifest_path, what=f"{repo_id}: {rf.MANIFEST_NAME}").get("manifest_sha256")
    ordered = [results[p] for p in sorted(results)]
    table = leaderboard_table(ordered, repo_id)
    # The card on the branch describes one release: its leaderboard lists the results on that release only.
    on_branch = [r for r in ordered if (r.get("release") or {}).get("manifest_sha256") == branch_release]
    card = with_leaderboard_config(replace_leaderboard_section(readme, on_branch), table)
    markdown = leaderboard_document(ordered, repo_id)
    operations = [CommitOperationAdd(path, json_bytes(result)) for path, result in sorted(new_paths.items())]
    operations.append(CommitOperationAdd(f"{RESULTS_DIR}/{LEADERBOARD_NAME}", markdown.encode()))
    operations.append(CommitOperationAdd(f"{RESULTS_DIR}/{LEADERBOARD_PARQUET}", leaderboard_parquet(table)))
    operations.append(CommitOperationAdd(f"{RESULTS_DIR}/{LEADERBOARD_TAR}", leaderboard_tar(table)))
    operations.append(CommitOperationAdd(rf.CARD_NAME, card.encode()))
    info = retry(
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
        path = retry(
            f"download manifest of {tag}",
            lambda tag=tag: api.hf_hub_download(repo_id, rf.MANIFEST_NAME, repo_type=REPO_TYPE, revision=tag),
        )
        published = read_json(path, what=f"{repo_id}@{tag}: {rf.MANIFEST_NAME}")
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
