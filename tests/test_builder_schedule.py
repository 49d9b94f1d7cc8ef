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


@pytest.mark.slow
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


def test_progress_moves_per_stage_and_logs_stay_off_its_line(tmp_path, folder, monkeypatch):
    """Two stages, batches of 4, on a terminal: the caption bar shows 4/9 while the edit bar still shows 0/9 (each
    stage has its own line, whole images counted), and log lines never land on a bar's line."""
    import io
    import logging
    import re

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    handler = logging.StreamHandler(terminal)  # where lance-cf's own logging goes, as the CLI configures it
    logging.getLogger().addHandler(handler)
    stages = [FAKE_STAGES[0] | {"options": {"fail_keys": ["dog_img_001"]}}, FAKE_STAGES[1]]
    config = load_config(
        str(write_config(tmp_path / "c.yaml", f"imagefolder:{folder}", stages=stages, configs=ALL_CONFIGS))
    )
    logging.getLogger("builder").setLevel(logging.INFO)
    try:
        build(config, tmp_path / "out", progress=True)
    finally:
        logging.getLogger().removeHandler(handler)
    frames = re.split(r"[\r\n]", terminal.getvalue())
    states = [dict(re.findall(r"(\w+)\s*:\s+\d+%\|.*?\| (\d+)/9", f)) for f in frames]
    caption = [(i, int(s["caption"])) for i, s in enumerate(states) if "caption" in s]
    edit = [(i, int(s["edit"])) for i, s in enumerate(states) if "edit" in s]
    first_caption_4 = next(i for i, n in caption if n == 4)
    first_edit_4 = next(i for i, n in edit if n == 4)
    assert first_caption_4 < first_edit_4  # the first stage's line moved before the batch's second stage ran
    assert caption[-1][1] == 9 and edit[-1][1] == 9
    assert any(f.strip().startswith("build test-release images") and "errors 1" in f for f in frames)
    logs = [f for f in frames if "loading stage" in f or "raised on" in f]
    assert logs and all("%|" not in f for f in logs)
