"""Reading a release through its ``croissant.json`` with mlcroissant, and comparing every record with what
``datasets.load_dataset`` gives for the same release (used by the croissant tests of every kind of release)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from builder import release_format as rf


def mlcroissant_issues(path: Path) -> list[str]:
    """mlcroissant's errors and warnings about a croissant file (publish's own check)."""
    from builder.publish import croissant_issues

    return croissant_issues(path)


def _plain(value: Any) -> Any:
    """mlcroissant's value as ``datasets`` gives it: text is bytes there, str here; numpy scalars are Python's."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.generic):
        return value.item()
    return value


def mlcroissant_records(release: Path, config: str) -> dict[str, dict[str, Any]]:
    """Every record of ``config`` read by mlcroissant from the release's croissant.json, by key.

    With mlcroissant's default cache: a shard's path names its content, so an extraction it reuses is always the
    right one (``test_two_releases_read_in_one_process_give_their_own_records``).
    """
    import mlcroissant as mlc

    records = list(mlc.Dataset(str(release / rf.CROISSANT_NAME)).records(config))
    out: dict[str, dict[str, Any]] = {}
    prefix = f"{config}/"
    for record in records:
        row = {}
        for name, value in record.items():
            short = name.removeprefix(prefix)
            if isinstance(value, dict):
                value = {k.removeprefix(f"{name}/"): _plain(v) for k, v in value.items()}
            row[short] = _plain(value)
        out[row["key"]] = row
    return out


def assert_croissant_matches_datasets(release: Path, tmp_path: Path) -> int:
    """For every config: mlcroissant accepts croissant.json (with no remark when the config has a ``release_date``,
    else only the missing publication date), and its records hold the same keys, images (pixel for pixel), labels
    and metadata (every field) as ``datasets.load_dataset`` on the same release. Returns the number of records
    compared."""
    import datasets

    manifest = rf.load_manifest(release)
    issues = mlcroissant_issues(release / rf.CROISSANT_NAME)
    undated = [
        f'[Metadata({manifest.name})] Property "https://schema.org/datePublished" is recommended, but does not exist.'
    ]
    assert issues == ([] if manifest.config.get("release_date") else undated), issues
    compared = 0
    for config in manifest.configs:
        got = mlcroissant_records(release, config)
        rows = datasets.load_dataset(str(release), config, split="test", cache_dir=str(tmp_path / "hf"))
        assert len(got) == len(rows) == manifest.counts[config]["total"]
        for row in rows:
            record = got[row["__key__"]]
            assert np.array_equal(np.asarray(record["image"].convert("RGB")), np.asarray(row[manifest.image_ext]))
            assert record["label"] == row["cls"] == row["json"]["label"]
            for name, value in row["json"].items():
                if name in ("key", "label"):
                    assert record[name] == value
                    continue
                assert record[name] == value, (config, row["__key__"], name, record[name], value)
            compared += 1
    return compared
