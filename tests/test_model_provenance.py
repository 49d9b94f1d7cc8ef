"""A local model copy's marker (``.lance-cf-model.json``) is the copy's own claim: it is believed only where the files
of the commit it names are known from elsewhere (the Hugging Face cache, or the Hub). A rewritten marker, or an
unverifiable one, leaves the release naming the folder by its digest with no Hub id, and saying why; links out of the
copy, and links to system files, are refused."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from lance_pipeline.models.hub_cache import LOCAL_MARKER, content_digest, local_copy

REPO, COMMIT = "google-bert/bert-base-uncased", "a" * 40


def _copy(folder: Path, files: dict[str, bytes], repo: str = REPO) -> Path:
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    (folder / LOCAL_MARKER).write_text(json.dumps({"repo_id": repo, "revision": COMMIT, "files": digests}))
    return folder


def _cache(monkeypatch, root: Path, files: dict[str, bytes]) -> None:
    """A Hugging Face cache holding REPO at COMMIT with ``files``."""
    from huggingface_hub import constants

    snapshot = root / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        (snapshot / name).write_bytes(data)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))


FILES = {"config.json": b'{"hidden_size": 8}', "model.safetensors": b"weights of the real model"}


def test_a_marker_is_believed_when_the_cache_holds_the_same_files(tmp_path, monkeypatch):
    _cache(monkeypatch, tmp_path / "cache", FILES)
    copy = local_copy(_copy(tmp_path / "copy", FILES))
    assert copy.verified and copy.label == f"{REPO}@{COMMIT}"


def test_a_rewritten_marker_over_other_files_is_not_believed(tmp_path, monkeypatch):
    """The attack: other weights, and a marker rewritten with their sha256 that names a known model."""
    _cache(monkeypatch, tmp_path / "cache", FILES)
    other = {**FILES, "model.safetensors": b"some other weights"}
    copy = local_copy(_copy(tmp_path / "copy", other))
    assert not copy.verified
    assert "not those of google-bert/bert-base-uncased@" in copy.reason and "model.safetensors" in copy.reason


def test_a_marker_that_cannot_be_checked_offline_is_not_believed_and_says_why(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    copy = local_copy(_copy(tmp_path / "copy", FILES))
    assert not copy.verified
    assert "cannot be checked here" in copy.reason and "HF_HUB_OFFLINE" in copy.reason


def test_links_out_of_the_copy_are_refused(tmp_path, monkeypatch):
    _cache(monkeypatch, tmp_path / "cache", FILES)
    folder = _copy(tmp_path / "copy", FILES)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x")
    os.symlink(outside, folder / "extra.bin")
    copy = local_copy(folder)
    assert not copy.verified  # an added file, and a link out of the copy


def test_a_link_to_a_system_file_is_refused_not_recorded_without_a_digest(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    os.symlink("/proc/self/environ", folder / "weights.bin")
    with pytest.raises(ValueError, match="holds a link to a system file"):
        content_digest(folder)


def test_the_release_names_a_refused_copy_by_digest_and_says_why(tmp_path, monkeypatch):
    """Through the builder's record of a stage (what the manifest and the card show)."""
    from huggingface_hub import constants

    from builder.config import StageConfig, public_stage_dict

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    folder = _copy(tmp_path / "bert-copy", FILES)
    stage = StageConfig(
        name="label_check", type="label_check", configs=["counterfactual"], options={"model": str(folder)}
    )
    data = public_stage_dict(stage)
    assert "local_copies" not in data
    assert data["local_inputs"]["model"].startswith("sha256:")
    assert "not recorded as a copy of google-bert/bert-base-uncased@" in data["local_copies_refused"]["model"]
    from dataset_cards.card import local_models

    shown = local_models(data)["bert-copy"]
    assert shown.startswith("local directory bert-copy (sha256:") and "cannot be checked here" in shown
