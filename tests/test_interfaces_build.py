"""Dataset interfaces as a build: the demo-star preset (tiny models, offline) end to end, routing and rejections."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import yaml
from builder_helpers import cli, env, release_files, stored_stage_outputs

from builder.config import load_config
from builder.engine import build
from builder.release_format.verify import verify_release

pytestmark = pytest.mark.e2e
SHIFTS = ["base", "in_the_snow", "pencil_sketch"]


@pytest.fixture(scope="module")
def star(shared_release):
    return shared_release("demo-star")


def test_demo_star_builds_one_verified_config_per_shift_with_every_score(star, tmp_path):
    import datasets

    assert verify_release(star) == []
    manifest = json.loads((star / "manifest.json").read_text())
    assert manifest["configs"] == SHIFTS
    for shift in SHIFTS:
        rows = datasets.load_dataset(str(star), shift, split="test", cache_dir=str(tmp_path / "hf"))
        assert len(rows) == 6  # 3 classes x 2 images
        for row in rows:
            meta = row["json"]
            assert meta["shift"] == shift and meta["passed"] is True
            assert meta["token"] == f"<{meta['label_name'].replace(' ', '_')}-{meta['label']}>"
            assert meta["prompt"].replace(meta["token"], "<TOKEN>") in {
                "A photo of a <TOKEN>", "A photo of a <TOKEN> in the snow",
                "A black and white pencil sketch of a <TOKEN>",
            }  # fmt: skip
            assert isinstance(meta["object_score"], float) and meta["object_threshold"] == -1.0
            assert (meta["shift_score"] is None) == (shift == "base")
            assert rows.features["cls"].names[meta["label"]] == meta["label_name"]
    card = (star / "README.md").read_text()
    assert "generated** under named distribution shifts" in card and "made with **LANCE**" not in card
    assert 'load_dataset("ORG/lance-demo-star", "base", split="test"' in card  # a config the release has
    routing = manifest["build"]["routing"]["generate"]
    assert routing["decided_by"] == "safety"  # the safety checker has the last word on where an image goes
    assert routing["groups"] == {s: {str(c): {s: 2} for c in (281, 652, 967)} for s in SHIFTS}


def test_demo_star_croissant_reads_as_datasets_does(star, tmp_path):
    """An interfaces release through croissant.json: the shift fields typed and equal to what datasets reads."""
    from croissant_check import assert_croissant_matches_datasets

    assert assert_croissant_matches_datasets(star, tmp_path) == sum(
        c["total"] for c in json.loads((star / "manifest.json").read_text())["counts"].values()
    )


def test_review_apply_on_demo_star_keeps_every_sample_and_verifies(star, tmp_path):
    """An interfaces release reviewed by people: every shift's samples kept, accepted and rejected ones in their
    configs (the default study reviews every shift)."""
    from review_check import assert_review_apply_keeps_every_sample

    assert_review_apply_keeps_every_sample(star, tmp_path)


def test_demo_star_reads_with_timm(star):
    from timm.data import create_dataset

    dataset = create_dataset("wds/demo-star", root=str(star), split="in_the_snow", batch_size=1)
    assert len(list(iter(dataset))) == 6


def test_rejections_are_counted_and_kept_in_a_rejected_config_when_asked(tmp_path):
    from builder.config import preset_path

    data = yaml.safe_load(open(preset_path("demo-star")))
    data["source_options"]["custom_shifts"][1]["threshold"] = 0.99  # far above the tiny CLIP's cosines: all fail
    data["configs"] = ["base", "rejected"]
    for stage in data["stages"]:
        stage["configs"] = [*SHIFTS, "rejected"]
    data["stages"][1]["options"]["keep_rejected"] = True
    path = tmp_path / "star.yaml"
    path.write_text(yaml.safe_dump(data))
    out = tmp_path / "release"
    build(load_config(str(path)), out, progress=False, device="cpu")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["base"]["total"] == 6 and manifest["counts"]["rejected"]["total"] == 6
    groups = manifest["build"]["routing"]["generate"]["groups"]
    assert groups["in_the_snow"] == {str(c): {"rejected": 2} for c in (281, 652, 967)}
    assert groups["pencil_sketch"] == {str(c): {"not_released": 2} for c in (281, 652, 967)}  # not built
    import datasets

    for row in datasets.load_dataset(str(out), "rejected", split="test", cache_dir=str(tmp_path / "hf")):
        meta = row["json"]
        assert meta["shift"] == "in_the_snow" and meta["passed"] is False and meta["shift_score"] < 0.99


def test_generation_source_needs_a_generator_stage_and_refuses_original(tmp_path):
    proc = cli("build", "demo-star", "--configs", "original", "--output", str(tmp_path / "x"), check=False)
    assert proc.returncode == 2 and "config 'original'" in proc.stderr


@pytest.mark.slow
def test_killed_demo_star_build_resumes_byte_identical(star, tmp_path):
    out = tmp_path / "killed"
    command = [sys.executable, "-m", "builder.cli", "build", "demo-star", "--output", str(out), "--no-progress",
               "--device", "cpu"]  # fmt: skip

    proc = subprocess.Popen(command, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proc.poll() is None and stored_stage_outputs(out) < 6:  # the first batch's generation is stored
        time.sleep(0.05)
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert 0 < stored_stage_outputs(out) < 36, "the kill did not land mid-build"
    cli("build", "demo-star", "--output", str(out), "--no-progress", "--device", "cpu")
    assert release_files(out) == release_files(star)
