"""Build → verify → load round trips, determinism, resume after SIGKILL, refusal of foreign directories."""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from builder_helpers import (
    ALL_CONFIGS,
    FAKE_STAGES,
    cli,
    done_batches,
    env,
    make_imagefolder,
    release_files,
    write_config,
)

from builder.cli import main
from builder.config import load_config
from builder.engine import BuildRefused, build
from builder.release_format import CONFIG_NAMES, SCORE_NAMES, metadata_json_schema
from builder.release_format.verify import verify_release


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_imagefolder(tmp_path_factory.mktemp("src"), ["cat", "dog", "zebra"], per_class=4)


@pytest.fixture(scope="module")
def full_release(tmp_path_factory, folder) -> Path:
    root = tmp_path_factory.mktemp("full")
    cfg = write_config(root / "cfg.yaml", f"imagefolder:{folder}", stages=FAKE_STAGES, configs=ALL_CONFIGS)
    out = root / "release"
    cli("build", str(cfg), "--output", str(out), "--no-progress")
    return out


def test_full_release_verifies_and_counts(full_release):
    assert verify_release(full_release) == []
    manifest = json.loads((full_release / "manifest.json").read_text())
    assert manifest["configs"] == ALL_CONFIGS
    counts = manifest["counts"]
    assert counts["original"]["total"] == 12
    assert counts["reconstructed"]["total"] == 12
    assert counts["counterfactual"] == {
        "total": 24,
        "by_edit_type": {"background": 12, "weather": 12},
        "by_class": {"0": 8, "1": 8, "2": 8},
    }
    assert counts["lance_r"]["by_edit_type"] == {"none": 12}
    assert manifest["label_space"]["names"] == ["cat", "dog", "zebra"]
    assert manifest["stages"]["caption"]["model"] == "fake-captioner"
    assert manifest["failures"] == []
    assert {"torch", "datasets", "python"} <= set(manifest["packages"])


@pytest.mark.parametrize("config", CONFIG_NAMES)
def test_load_dataset_each_config_with_declared_features(full_release, config, tmp_path):
    import datasets

    ds = datasets.load_dataset(str(full_release), config, split="test", cache_dir=str(tmp_path / "hf"))
    manifest = json.loads((full_release / "manifest.json").read_text())
    assert len(ds) == manifest["counts"][config]["total"]
    assert list(ds.features) == ["__key__", "__url__", "cls", "png", "json"]
    assert isinstance(ds.features["png"], datasets.Image)
    meta_features = ds.features["json"]
    assert meta_features["self_replace"].dtype == "float64"
    for name in SCORE_NAMES:
        assert meta_features["scores"][name].dtype == "float64"
    rows = list(ds)
    schema_fields = set(metadata_json_schema()["required"])
    for row in rows:
        assert set(row["json"]) == schema_fields
        assert row["cls"] == row["json"]["label"]
        assert row["__key__"] == row["json"]["key"]
        assert row["png"].size == (32, 32)
    if config == "counterfactual":
        # An integral score (1, 0) in the first rows is a float; a null-then-set score loads.
        first = rows[0]["json"]
        assert first["self_replace"] == 1.0 and isinstance(first["self_replace"], float)
        assert first["scores"]["label_similarity"] == 0.0
        directional = [r["json"]["scores"]["clip_directional"] for r in rows if r["json"]["edit_type"] == "weather"]
        assert directional[0] is None and 0.31 in directional
    if config != "original":
        originals = {r["json"]["key"] for r in datasets.load_dataset(str(full_release), "original", split="test")}
        assert {r["json"]["source_key"] for r in rows} <= originals


@pytest.mark.parametrize("config", ["original", "counterfactual"])
def test_timm_reads_release_through_info_json(full_release, config):
    import timm.data

    manifest = json.loads((full_release / "manifest.json").read_text())
    ds = timm.data.create_dataset("wds/lance", root=str(full_release), split=config)
    assert len(ds) == manifest["counts"][config]["total"]
    labels = sorted(int(target) for _, target in ds)
    expected = sorted(int(k) for k, n in manifest["counts"][config]["by_class"].items() for _ in range(n))
    assert labels == expected


@pytest.mark.slow
def test_rebuild_is_byte_identical(tmp_path, folder, full_release):
    cfg = write_config(tmp_path / "cfg.yaml", f"imagefolder:{folder}", stages=FAKE_STAGES, configs=ALL_CONFIGS)
    build(load_config(str(cfg)), tmp_path / "again", progress=False)
    assert release_files(tmp_path / "again") == release_files(full_release)
    # Re-running into a finished release is a no-op that rewrites the same bytes.
    build(load_config(str(cfg)), tmp_path / "again", progress=False)
    assert release_files(tmp_path / "again") == release_files(full_release)


def test_shard_size_splits_and_still_verifies(tmp_path, folder):
    cfg = write_config(tmp_path / "cfg.yaml", f"imagefolder:{folder}", shard_max_samples=5)
    manifest = build(load_config(str(cfg)), tmp_path / "out", progress=False)
    assert [s["samples"] for s in manifest["shards"]] == [5, 5, 2]
    assert verify_release(tmp_path / "out") == []
    info = json.loads((tmp_path / "out" / "_info.json").read_text())
    assert info["splits"]["original"]["shard_lengths"] == [5, 5, 2]


def test_different_config_into_same_directory_is_refused(tmp_path, folder, capsys):
    out = tmp_path / "out"
    build(load_config(str(write_config(tmp_path / "a.yaml", f"imagefolder:{folder}"))), out, progress=False)
    other = load_config(str(write_config(tmp_path / "b.yaml", f"imagefolder:{folder}", seed=1)))
    with pytest.raises(BuildRefused, match="different config"):
        build(other, out, progress=False)
    assert main(["build", str(tmp_path / "b.yaml"), "--output", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "different config" in err and len(err.strip().splitlines()) == 1, err
    # A non-empty directory that is not a build is refused too.
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    with pytest.raises(BuildRefused, match="not empty"):
        build(load_config(str(tmp_path / "a.yaml")), stranger, progress=False)


@pytest.mark.slow
def test_killed_builds_resume_to_the_clean_result(tmp_path, folder):
    """SIGKILL a slow build at random moments, re-run the same command each time, compare with a clean build."""
    slow = [dict(s, options={"delay": 0.12}) for s in FAKE_STAGES]
    src = make_imagefolder(tmp_path / "src", ["a", "b", "c", "d"], per_class=8)
    cfg = write_config(tmp_path / "cfg.yaml", f"imagefolder:{src}", stages=slow, configs=ALL_CONFIGS, batch_size=2)
    clean = tmp_path / "clean"
    build(load_config(str(cfg)), clean, progress=False)

    out = tmp_path / "killed"
    command = [sys.executable, "-m", "builder.cli", "build", str(cfg), "--output", str(out), "--no-progress"]
    rng = random.Random(1234)
    kills = []

    for _ in range(4):
        # Wait until the build reaches a random batch (so the kill lands mid-build on any machine speed), then kill
        # at a random moment inside the following batch's stages.
        target = rng.randint(done_batches(out) + 1, 15)
        proc = subprocess.Popen(command, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while proc.poll() is None and done_batches(out) < target:  # no deadline: a busy machine only takes longer
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.3))
        if proc.poll() is not None:
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills.append(done_batches(out))
        if kills[-1] >= 15:
            break
    assert kills and any(0 < k < 16 for k in kills), f"no kill landed mid-build: {kills}"
    cli("build", str(cfg), "--output", str(out), "--no-progress")
    assert verify_release(out) == []
    assert release_files(out) == release_files(clean)


@pytest.mark.slow
def test_resume_does_not_redo_finished_stage_work(tmp_path, folder):
    """A stage's stored outputs are replayed on resume: the stage is not even loaded for finished batches."""
    cfg = write_config(tmp_path / "cfg.yaml", f"imagefolder:{folder}", stages=FAKE_STAGES, configs=ALL_CONFIGS)
    out = tmp_path / "out"
    build(load_config(str(cfg)), out, progress=False)
    import tests.fake_stages as fake

    calls = []
    original = fake.FakeCaptionStage.process
    fake.FakeCaptionStage.process = lambda self, records: calls.append(len(records)) or original(self, records)
    try:
        with sqlite3.connect(out / ".lance-cf" / "ledger.sqlite") as db:  # forget the last batch's release rows
            db.execute("DELETE FROM done_batches WHERE batch = 2")
            db.execute("DELETE FROM stage_batches WHERE batch = 2 AND stage = 'edit'")
        build(load_config(str(cfg)), out, progress=False)
    finally:
        fake.FakeCaptionStage.process = original
    assert calls == []  # captions of batch 2 were replayed from the ledger, not recomputed
    assert verify_release(out) == []


def test_crash_while_writing_shards_then_rerun_equals_clean(tmp_path, folder, full_release, monkeypatch):
    """A build that dies after some shards are written (and leaves a .tmp) rewrites the same release on re-run."""
    import builder.release as release

    cfg = write_config(tmp_path / "cfg.yaml", f"imagefolder:{folder}", stages=FAKE_STAGES, configs=ALL_CONFIGS)
    out = tmp_path / "out"
    real_write = release.write_shard
    written = []

    def dying_write(root, config, index, samples):
        if len(written) == 2:
            (root / "data" / config).mkdir(parents=True, exist_ok=True)
            (root / "data" / config / "test-000000.tar.tmp").write_bytes(b"half a shard")
            raise KeyboardInterrupt("simulated crash")
        written.append(config)
        return real_write(root, config, index, samples)

    monkeypatch.setattr(release, "write_shard", dying_write)
    with pytest.raises(KeyboardInterrupt):
        build(load_config(str(cfg)), out, progress=False)
    assert not (out / "manifest.json").exists()
    monkeypatch.setattr(release, "write_shard", real_write)
    build(load_config(str(cfg)), out, progress=False)
    assert release_files(out) == release_files(full_release)


def test_stage_error_on_the_very_first_sample_is_deferred_then_recorded(tmp_path, folder):
    """Batch size 1 and the first sample breaks the stage: the batch waits until the stage has worked elsewhere,
    then its error is recorded against that sample (an error: retried by the next run); the build finishes."""
    stages = [FAKE_STAGES[0] | {"options": {"fail_keys": ["cat_img_000"]}}, FAKE_STAGES[1]]
    cfg = write_config(tmp_path / "c.yaml", f"imagefolder:{folder}", stages=stages, configs=ALL_CONFIGS, batch_size=1)
    manifest = build(load_config(str(cfg)), tmp_path / "out", progress=False)
    assert manifest["failures"] == []
    assert [(e["source_key"], e["stage"]) for e in manifest["build"]["errors"]] == [("cat_img_000", "caption")]
    assert manifest["counts"]["original"]["total"] == 12 and manifest["counts"]["reconstructed"]["total"] == 11
    assert verify_release(tmp_path / "out") == []


def test_stage_that_never_works_stops_the_build_and_records_nothing(tmp_path, folder, capsys):
    from builder.engine import StageNotWorking

    every_key = [f"{c}_img_{i:03d}" for c in ("cat", "dog", "zebra") for i in range(4)]
    stages = [FAKE_STAGES[0] | {"options": {"fail_keys": every_key}}, FAKE_STAGES[1]]
    cfg = write_config(tmp_path / "c.yaml", f"imagefolder:{folder}", stages=stages, configs=ALL_CONFIGS)
    with pytest.raises(StageNotWorking, match="stage caption fails on every sample so far"):
        build(load_config(str(cfg)), tmp_path / "out", progress=False)
    with sqlite3.connect(tmp_path / "out" / ".lance-cf" / "ledger.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM failures").fetchone()[0] == 0  # nothing blamed on the data
    assert main(["build", str(cfg), "--output", str(tmp_path / "out"), "--no-progress"]) != 0
    assert "fails on every sample so far" in capsys.readouterr().err
