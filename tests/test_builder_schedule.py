"""Schedules give the same bytes; the progress bar moves per stage within a batch and stays off the log lines."""

from __future__ import annotations

import pytest
from builder_helpers import ALL_CONFIGS, FAKE_STAGES, make_imagefolder, release_files, write_config

from builder.config import load_config
from builder.engine import build
from builder.release_format.verify import verify_release


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_imagefolder(tmp_path_factory.mktemp("src"), ["cat", "dog", "emu"], per_class=3)


def test_stage_major_equals_batch_major_with_fake_stages(tmp_path, folder):
    # On the demo's real stages: tests/test_scale.py (local, interrupted and resumed; devices), test_builder_ray.py.
    stages = [FAKE_STAGES[0] | {"options": {"fail_keys": ["cat_img_000"]}}, FAKE_STAGES[1]]
    config = load_config(
        str(write_config(tmp_path / "c.yaml", f"imagefolder:{folder}", stages=stages, configs=ALL_CONFIGS))
    )
    build(config, tmp_path / "batch", progress=False)
    build(config, tmp_path / "stage", progress=False, schedule="stage-major")
    assert verify_release(tmp_path / "stage") == []
    assert release_files(tmp_path / "stage") == release_files(tmp_path / "batch")


def test_progress_moves_per_stage_and_logs_stay_off_its_line(tmp_path, folder, capsys):
    """Two stages, batches of 4: after the first stage of the first batch the bar already shows 2 of 9 images."""
    import logging

    stages = [FAKE_STAGES[0] | {"options": {"fail_keys": ["dog_img_001"]}}, FAKE_STAGES[1]]
    config = load_config(
        str(write_config(tmp_path / "c.yaml", f"imagefolder:{folder}", stages=stages, configs=ALL_CONFIGS))
    )
    logging.getLogger("builder").setLevel(logging.INFO)
    build(config, tmp_path / "out", progress=True)
    err = capsys.readouterr().err
    frames = err.replace("\r", "\n").splitlines()
    bars = [f for f in frames if f.startswith("build test-release")]
    assert any(" 2/9 " in f and "stage caption" in f for f in bars), bars
    assert any(" 9/9 " in f and "errors 1" in f for f in bars), bars
    logs = [f for f in frames if "loading stage" in f or "raised on" in f]
    assert logs and all(not f.startswith("build test-release") and "%|" not in f for f in logs)
