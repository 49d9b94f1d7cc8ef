"""The newcomer's config path: the `lance` preset takes any source, every key is documented, presets --show works."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import yaml
from builder_helpers import REPO, cli, make_imagefolder

from builder.config import KEYS_RECORDED_WHEN_SET, BuildConfig, list_presets, load_config
from builder.config_docs import KEY_DOCS, commented_yaml, undocumented_keys
from builder.registry import STAGES

CONFIG_DOC = (REPO / "docs" / "config.md").read_text()
EXAMPLE = REPO / "docs" / "examples" / "my-config.yaml"


def _documented_in_config_md(name: str) -> bool:
    return re.search(rf"`{re.escape(name)}`", CONFIG_DOC) is not None


def test_every_top_level_key_is_documented():
    assert undocumented_keys(BuildConfig) == []
    missing = [f.name for f in dataclasses.fields(BuildConfig) if not _documented_in_config_md(f.name)]
    assert missing == [], f"docs/config.md lacks {missing}"
    assert set(KEY_DOCS) <= {f.name for f in dataclasses.fields(BuildConfig)}, "KEY_DOCS explains a removed key"


def _stage_options(stage_type: str) -> list[str]:
    """Option names a stage type accepts, from its declared options (``lance_pipeline.stage.options_type``)."""
    from lance_pipeline.stage import options_type

    return [f.name for f in dataclasses.fields(options_type(STAGES.resolve(stage_type))) if not f.name.startswith("_")]


@pytest.mark.parametrize("stage_type", STAGES.names())
def test_every_stage_option_is_documented(stage_type):
    missing = [o for o in _stage_options(stage_type) if not _documented_in_config_md(o)]
    assert missing == [], f"docs/config.md lacks options {missing} of stage type {stage_type}"
    assert _documented_in_config_md(stage_type)


@pytest.mark.e2e  # runs lance-cf as a process
@pytest.mark.parametrize("preset", list_presets())
def test_presets_show_prints_every_key_commented_and_round_trips(preset):
    shown = cli("presets", "--show", preset).stdout
    config = load_config(preset)
    unset = dict.fromkeys(k for k in KEYS_RECORDED_WHEN_SET if k not in config.to_dict())  # shown, as null
    assert yaml.safe_load(shown) == {**config.to_dict(), **unset}
    for key in KEY_DOCS:
        line = next(line for line in shown.splitlines() if line.startswith(f"{key}:"))
        assert "  # " in line, f"{key} has no comment"


def test_commented_yaml_of_a_file_is_what_the_build_uses(tmp_path):
    text = commented_yaml(load_config(str(EXAMPLE)).to_dict(), origin="example")
    copy = tmp_path / "copy.yaml"
    copy.write_text(text)
    assert load_config(str(copy)) == load_config(str(EXAMPLE))


@pytest.mark.e2e  # runs lance-cf as a process
def test_presets_listing_names_files_and_the_show_command():
    out = cli("presets").stdout
    assert "lance:" in out and "lance.yaml" in out and "--show" in out


def test_annotated_example_config_loads_validates_and_constructs_its_stages(tmp_path):
    config = load_config(str(EXAMPLE))
    config.validate()
    assert config.configs == ["original", "counterfactual"]
    edit = next(s for s in config.stages if s.name == "edit")
    assert edit.options["model"] == "CompVis/stable-diffusion-v1-4"  # the YAML merge key resolved
    for stage in config.stages:
        STAGES.resolve(stage.type)(**stage.options)  # options accepted; no weights are loaded


@pytest.mark.e2e  # runs lance-cf as a process
def test_lance_preset_uses_the_paper_models_and_takes_any_source(tmp_path):
    lance = load_config("lance")
    assert lance.source is None and lance.source_options == {}
    assert lance.configs == ["original", "reconstructed", "counterfactual", "lance_r"]
    # hardimagenet is the lance method on a fixed ImageNet subset: the stages must not drift apart.
    assert [dataclasses.asdict(s) for s in lance.stages] == [
        dataclasses.asdict(s) for s in load_config("hardimagenet").stages
    ]
    photos = make_imagefolder(tmp_path / "photos", ["cat", "dog"], 2)
    out = tmp_path / "mine"
    cli(
        "build", "lance", "--source", f"imagefolder:{photos}", "--configs", "original", "--output", str(out),
        "--name", "my-pets", "--version", "0.2.0", "--description", "Our lab's pets.", "--license", "cc-by-4.0",
        "--no-progress", "--device", "cpu",
    )  # fmt: skip
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["name"] == "my-pets" and manifest["version"] == "0.2.0"
    assert manifest["counts"]["original"]["total"] == 4
    card = (out / "README.md").read_text()
    assert "Our lab's pets." in card and "cc-by-4.0" in card
    assert "lance-demo" not in card and "offline demo" not in card


@pytest.mark.e2e  # runs lance-cf as a process
def test_lance_preset_without_source_says_what_it_takes():
    proc = cli("build", "lance", "--output", "unused", check=False)
    assert proc.returncode == 2
    assert "imagefolder:PATH" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.e2e  # runs lance-cf as a process
def test_a_build_whose_configs_end_empty_exits_non_zero_unless_allowed(tmp_path):
    folder = tmp_path / "broken" / "cat"
    folder.mkdir(parents=True)
    for i in range(3):
        (folder / f"img_{i}.png").write_bytes(b"not an image at all")
    args = ["build", "lance", "--source", f"imagefolder:{folder.parent}", "--configs", "original", "--no-progress"]
    proc = cli(*args, "--output", str(tmp_path / "out"), check=False)
    assert proc.returncode == 1
    assert "config(s) original ended with no samples" in proc.stderr and "--allow-empty" in proc.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["empty_configs"] == ["original"] and len(manifest["failures"]) == 3  # recorded, not hidden
    assert cli(*args, "--output", str(tmp_path / "ok"), "--allow-empty", check=False).returncode == 0


@pytest.mark.e2e  # runs lance-cf as a process
def test_a_model_that_cannot_be_fetched_offline_is_named_with_the_command_that_fetches_it():
    """`perturber try` with its default Hub model and no network: the model, and what to do; no traceback. (The label
    check's model ships installed, so it is not missing.)"""
    args = ("perturber", "try", "a photo of a dog on the grass", "--label", "dog", "--device", "cpu")
    proc = cli(*args, check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 3 and "1 model(s) needed are neither cached nor reachable" in lines[0], proc.stderr
    assert (
        "HF_HUB_OFFLINE" in lines[0]
        and lines[1].strip().startswith("Qwen/Qwen2.5-7B-Instruct@")
        and "--model" in lines[1]
    )
    assert lines[2].endswith("lance-cf models download " + " ".join(repr(a) if " " in a else a for a in args))
