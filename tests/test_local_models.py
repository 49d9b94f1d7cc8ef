"""A model option given a local directory is recorded by the folder's name and a digest of its files, and an unchanged
copy made by ``lance-cf models download --local-dir`` as the Hub id and commit it is a copy of; never by its path.
(The whole air-gapped flow, download to build to publish, is tests/test_models.py's.)"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil

import pytest

from builder.config import BuildConfig, StageConfig, public_stage_dict
from builder.release_format.hub_client import local_paths
from lance_pipeline.models.hub_cache import LOCAL_MARKER, ModelState, local_copy, write_local_marker
from lance_pipeline.models.needs import SENTENCE_TRANSFORMERS_FILES, ModelNeed

COMMIT = "0123456789abcdef0123456789abcdef01234567"
FILES = {
    "config.json": b'{"model_type": "bert"}',
    "model.safetensors": b"weights" * 100,
    "1_Pooling/config.json": b"{}",
}


def _copy(root, name="org--minilm", marker=True):
    """A folder as ``models download --local-dir`` leaves it: the files and (``marker``) the marker written by the
    download's own code."""
    folder = root / name
    for path, data in FILES.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_bytes(data)
    (folder / ".lance-cf-partial").mkdir()  # what an interrupted download leaves: not part of the model
    if marker:
        need = ModelNeed("org/minilm", COMMIT, SENTENCE_TRANSFORMERS_FILES, (), "stage label_check", "model")
        state = ModelState(need, [need], commit=COMMIT, files={k: len(v) for k, v in FILES.items()}, exact=True)
        write_local_marker(folder, state)
    return folder


@pytest.fixture(autouse=True)
def hub_cache(tmp_path, monkeypatch):
    """The Hugging Face cache of the machine the copies were made on: it holds org/minilm at COMMIT, which is what
    lets a copy's marker be believed (tests/test_model_provenance.py for a marker nothing confirms)."""
    from huggingface_hub import constants

    snapshot = tmp_path / "hf-cache" / "models--org--minilm" / "snapshots" / COMMIT
    for path, data in FILES.items():
        (snapshot / path).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / path).write_bytes(data)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))


def _stage(model: str) -> StageConfig:
    return StageConfig("label_check", "label_check", ["counterfactual"], {"model": model, "revision": COMMIT})


def _config(model: str) -> BuildConfig:
    return BuildConfig(name="x", source="demo", configs=["original", "counterfactual"], stages=[_stage(model)])


def test_an_unchanged_copy_is_recorded_as_the_hub_model_it_copies(tmp_path, monkeypatch):
    folder = _copy(tmp_path / "a")
    marker = json.loads((folder / LOCAL_MARKER).read_text())
    assert marker["files"]["model.safetensors"] == hashlib.sha256(FILES["model.safetensors"]).hexdigest()
    recorded = public_stage_dict(_stage(str(folder)))
    assert recorded["options"]["model"] == "org--minilm" and recorded["options"]["revision"] == COMMIT
    assert recorded["local_inputs"]["model"].startswith("sha256:")
    assert recorded["local_copies"] == {"model": f"org/minilm@{COMMIT}"}
    assert local_paths(recorded) == [] and str(tmp_path) not in json.dumps(recorded)

    # The same files at another path (and given as a relative path): the same record, the same config hash.
    other = shutil.copytree(folder, tmp_path / "b" / "deeper" / "org--minilm")
    assert public_stage_dict(_stage(str(other))) == recorded
    assert _config(str(other)).config_hash() == _config(str(folder)).config_hash()
    monkeypatch.chdir(other.parent)
    assert public_stage_dict(_stage("./org--minilm")) == recorded
    # A Hub id is left as it is.
    assert public_stage_dict(_stage("sentence-transformers/all-MiniLM-L6-v2"))["options"]["model"].startswith("sent")


def test_a_changed_or_unmarked_copy_is_recorded_by_name_and_digest(tmp_path, caplog):
    folder = _copy(tmp_path / "a")
    recorded = public_stage_dict(_stage(str(folder)))
    caplog.set_level(logging.WARNING)

    (folder / "1_Pooling" / "config.json").write_bytes(b'{"pooling_mode_mean_tokens": true}')  # a file changed
    changed = public_stage_dict(_stage(str(folder)))
    assert "local_copies" not in changed and changed["options"]["model"] == "org--minilm"
    assert changed["local_inputs"]["model"] != recorded["local_inputs"]["model"]
    assert not local_copy(folder).verified and "changed: 1_Pooling/config.json" in local_copy(folder).reason
    assert f"not as a copy of org/minilm@{COMMIT}" in caplog.text and "1_Pooling/config.json" in caplog.text

    added = _copy(tmp_path / "b")
    (added / "pytorch_model.bin").write_bytes(b"more")  # a file the marker does not list: not the Hub's copy either
    assert "local_copies" not in public_stage_dict(_stage(str(added)))
    assert "added: pytorch_model.bin" in local_copy(added).reason

    plain = _copy(tmp_path / "c", marker=False)  # a folder of one's own: by name and digest
    unmarked = public_stage_dict(_stage(str(plain)))
    assert "local_copies" not in unmarked and unmarked["local_inputs"] == recorded["local_inputs"]  # same files
    assert unmarked["options"]["model"] == "org--minilm"


def test_the_card_names_the_copy_or_the_folder_and_its_digest(tmp_path):
    from types import SimpleNamespace

    from dataset_cards.card import stage_models

    copy, plain = _copy(tmp_path / "a"), _copy(tmp_path / "b", name="my-encoder", marker=False)
    other = StageConfig("other", "label_check", ["counterfactual"], {"model": str(plain)})
    stages = [public_stage_dict(_stage(str(copy))), public_stage_dict(other)]
    # What the stages described (the engine names the folders as the config does).
    described = {"label_check": {"model": "org--minilm", "revision": COMMIT}, "other": {"model": "my-encoder"}}
    models = {stage: found for stage, found, _ in stage_models(SimpleNamespace(config={"stages": stages},
                                                                                stages=described))}  # fmt: skip
    assert models["label_check"] == [f"local copy of org/minilm@{COMMIT}"]
    digest = stages[1]["local_inputs"]["model"]
    assert models["other"] == [f"local directory my-encoder ({digest[:19]}…)"]
