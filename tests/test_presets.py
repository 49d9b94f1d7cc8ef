"""Presets resolve: every stage type is registered, its options are accepted, its models are pinned."""

from __future__ import annotations

import re

import pytest
from builder_helpers import MEASURE_STAGES, METHOD_STAGES, SCREEN_STAGES, STRENGTH_SCREENS, cli

from builder.config import list_presets, load_config
from builder.imagenet import HARD_IMAGENET_CLASSES, resolve_class, synsets
from builder.registry import STAGES


@pytest.mark.parametrize("preset", ["demo", "hardimagenet"])
def test_preset_stages_construct_without_loading_weights(preset, tmp_path):
    config = load_config(preset)
    assert {s.name for s in config.stages} == METHOD_STAGES | SCREEN_STAGES | MEASURE_STAGES | (
        STRENGTH_SCREENS if preset == "demo" else set()
    )
    served = {c for s in config.stages for c in s.configs}
    # The demo also keeps the sweep's candidates as the strength config; hardimagenet does not (its size).
    assert served == {"reconstructed", "counterfactual", "lance_r"} | ({"strength"} if preset == "demo" else set())
    for stage in config.stages:
        cls = STAGES.resolve(stage.type)
        options = dict(stage.options)
        if preset == "demo":  # demo:/pkg: references resolve at build time; constructing needs only strings
            options = {
                k: (str(tmp_path) if isinstance(v, str) and v[:4] in ("demo", "pkg:") else v)
                for k, v in options.items()
            }
        instance = cls(**options)
        assert instance.name == stage.name
        if preset == "hardimagenet":
            described = repr(instance.describe())
            for key in ("model", "clip_model", "lpips_backbone"):
                if key in stage.options and "/" in str(stage.options[key]):
                    assert stage.options[key] in described
            revision = stage.options.get("revision")
            assert revision and re.fullmatch(r"[0-9a-f]{40}", revision), f"{stage.name}: unpinned revision"


def test_hardimagenet_classes_are_the_fifteen_with_their_indices():
    config = load_config("hardimagenet")
    indices = [resolve_class(str(c)) for c in config.source_options["classes"]]
    assert indices == list(HARD_IMAGENET_CLASSES.values())
    assert [resolve_class(name) for name in HARD_IMAGENET_CLASSES if name != "sunglasses"] == [
        i for name, i in HARD_IMAGENET_CLASSES.items() if name != "sunglasses"
    ]
    with pytest.raises(ValueError, match="ambiguous"):
        resolve_class("sunglasses")
    assert indices == [537, 379, 785, 795, 837, 433, 416, 602, 706, 746, 655, 810, 890, 981, 801]
    assert synsets()[537] == "n03218198" and config.source_options["per_class"] == 50


@pytest.mark.e2e  # runs lance-cf as a process
def test_hardimagenet_without_source_says_what_it_needs():
    proc = cli("build", "hardimagenet", "--output", "unused", check=False)
    assert proc.returncode == 2 and "imagenet:/path/to/imagenet/val" in proc.stderr


@pytest.mark.e2e  # runs lance-cf as a process
def test_presets_listed():
    assert {"demo", "hardimagenet"} <= set(list_presets())
    assert "hardimagenet" in cli("presets").stdout


def test_a_folder_named_like_a_preset_is_not_taken_for_a_config(tmp_path, monkeypatch):
    """`build demo --output demo`, run again from the same folder: `demo` is still the preset, not the release folder
    beside it; a folder that names no preset gets one line saying it is a folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "manifest.json").write_text("{}")
    assert load_config("demo").name == "lance-demo"  # the preset (the folder used to give "does not exist")
    (tmp_path / "photos").mkdir()
    with pytest.raises(ValueError, match=r"^'photos' is a folder: neither a preset \(.*\) nor a YAML config file$"):
        load_config("photos")
