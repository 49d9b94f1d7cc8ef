"""The declared stage contract: validated before anything loads, enforced while stages run, configs are data."""

from __future__ import annotations

import json
import os
import pickle

import pytest
from builder_helpers import ALL_CONFIGS, FAKE_STAGES, cli, make_imagefolder, write_config

from builder.cli import main
from builder.config import load_config
from builder.engine import build
from builder.validation import validate_build
from lance_pipeline.option_types import Options
from lance_pipeline.stage import StageContractError, check_options, options_type


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_imagefolder(tmp_path_factory.mktemp("src"), ["cat", "dog"], per_class=2)


def _demo_with(tmp_path, stage_name: str, **changes) -> str:
    """The demo preset written to a file, with one stage's options changed."""
    import yaml

    config = load_config("demo")
    data = config.to_dict()
    for stage in data["stages"]:
        if stage["name"] == stage_name:
            stage["options"].update(changes)
    path = tmp_path / "demo-changed.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


@pytest.mark.e2e  # runs lance-cf as a process
def test_validate_lists_the_stage_graph_of_both_presets():
    proc = cli("validate", "demo")
    assert proc.stdout.startswith("valid: lance-demo")
    assert "edit (prompt_to_prompt_edit v2): key, caption, inversion, edits -> counterfactuals" in proc.stdout
    assert "source: demo (5 images" in proc.stdout
    proc = cli("validate", "hardimagenet", "--configs", "original,reconstructed")
    assert "reconstruct (reconstruction v" in proc.stdout and "perturb" not in proc.stdout


def test_typo_in_the_last_stage_fails_before_any_model_is_built(tmp_path, monkeypatch, capsys):
    """The last stage's option is misspelt: the build stops naming stage and option, with nothing written and no
    demo component materialised (the first stages' models were never built, let alone loaded)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("LANCE_CF_CACHE", str(cache))
    config = _demo_with(tmp_path, "lance_r_edit", lance_r_word_chek=False)
    out = tmp_path / "out"
    code = main(["build", config, "--output", str(out), "--no-progress", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "stage 'lance_r_edit'" in err and "'lance_r_word_chek'" in err and "did you mean 'lance_r_word_check'" in err
    assert not out.exists() and not cache.exists()
    assert main(["validate", config]) == 2
    assert "did you mean 'lance_r_word_check'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("stage", "option", "value", "expected"),
    [
        ("caption", "max_new_tokens", "twelve", "option max_new_tokens = 'twelve': expected an integer"),
        ("caption", "max_new_tokens", 12.0, "option max_new_tokens = 12.0: expected an integer"),
        ("perturb", "do_sample", "yes", "option do_sample = 'yes': expected true or false"),
        ("perturb", "do_sample", 1, "option do_sample = 1: expected true or false"),
        (
            "edit",
            "self_replace_sweep",
            [0.4, "x"],
            "(a list (of numbers in [0.0, 1.0]) (at least 1 item)) (Input should be a valid number (item [1]))",
        ),
        (
            "edit",
            "self_replace_sweep",
            [0.4, 1.5],
            "expected fractions of the steps (a list (of numbers in [0.0, 1.0])",
        ),
        ("perturb", "top_p", 0.0, "option top_p = 0.0: expected a number in (0.0, 1.0]"),
        (
            "label_check",
            "label_threshold",
            2.0,
            "expected a cosine similarity threshold (a number in [-1.0, 1.0]) or null",
        ),
        ("invert", "num_inference_steps", 0, "option num_inference_steps = 0: expected an integer in [1, 1000]"),
        ("invert", "image_size", 10**9, "option image_size = 1000000000: expected an integer in [8, 16384]"),
    ],
)
def test_wrong_option_values_name_the_stage_and_the_option(tmp_path, stage, option, value, expected):
    config = load_config(_demo_with(tmp_path, stage, **{option: value}))
    with pytest.raises(ValueError, match=f"stage '{stage}'") as info:
        validate_build(config)
    assert expected in str(info.value)


def test_a_non_finite_option_in_yaml_is_refused_by_the_reader_naming_the_option(tmp_path):
    """``.nan`` in a config file is refused when it is read (finite numbers only), naming the option's place."""
    with pytest.raises(ValueError, match=r"'stages\.\d+\.options\.guidance_scale' is nan; only finite numbers"):
        load_config(_demo_with(tmp_path, "edit", guidance_scale=float("nan")))


def test_options_type_is_derived_from_the_signature_or_declared():
    from lance_pipeline.editing.stages import ImageEditorOptions, InversionStage
    from lance_pipeline.text.captioning import LabelConditionedCaptioner
    from tests.fake_stages import FakeCaptionStage

    assert options_type(InversionStage) is ImageEditorOptions
    typed = check_options(LabelConditionedCaptioner, {"max_new_tokens": 70}, "stage caption")
    assert typed.max_new_tokens == 70 and typed.num_beams == 5  # defaults filled in from the declaration
    # A custom stage that declares no options class: derived from its constructor, checked the same way.
    derived = check_options(FakeCaptionStage, {"delay": 0.5}, "stage fake")
    assert (derived.delay, derived.fail_keys) == (0.5, None) and isinstance(derived, Options)
    with pytest.raises(ValueError, match="stage fake: option delay = 'soon': expected a number"):
        check_options(FakeCaptionStage, {"delay": "soon"}, "stage fake")
    assert pickle.loads(pickle.dumps(derived)) == derived  # crosses to device workers
    with pytest.raises(ValueError, match="missing option"):

        class Needy:
            def __init__(self, model: str) -> None: ...

        check_options(Needy, {}, "stage needy")


def _fake(tmp_path, folder, stages, configs=ALL_CONFIGS):
    return load_config(str(write_config(tmp_path / "c.yaml", f"imagefolder:{folder}", stages=stages, configs=configs)))


def test_field_graph_names_the_missing_producer_and_the_fix(tmp_path, folder):
    caption, edit = FAKE_STAGES
    # The caption stage is not active for lance_r, but the edit stage (which consumes caption) is.
    config = _fake(tmp_path, folder, [caption | {"configs": ["reconstructed"]}, edit], configs=["original", "lance_r"])
    with pytest.raises(ValueError, match=r"stage 'edit' consumes field 'caption', but stage 'caption'.*add them"):
        validate_build(config)
    config = _fake(tmp_path, folder, [edit, caption])
    with pytest.raises(ValueError, match="runs after it; move it earlier"):
        validate_build(config)
    config = _fake(tmp_path, folder, [edit])
    with pytest.raises(ValueError, match="no stage produces it"):
        validate_build(config)


def test_every_selected_config_needs_an_active_writer(tmp_path, folder):
    caption, edit = FAKE_STAGES
    config = _fake(tmp_path, folder, [caption, edit | {"configs": ["reconstructed"]}])
    with pytest.raises(ValueError, match="config 'counterfactual' is written by stage 'edit'.*add 'counterfactual'"):
        validate_build(config)
    config = _fake(tmp_path, folder, [caption, edit], configs=["original", "counterfactuals"])
    with pytest.raises(ValueError, match="did you mean 'counterfactual'"):
        validate_build(config)


def test_the_outputs_declared_by_stages_decide_the_configs(tmp_path, folder):
    """A config the core never heard of, declared by a stage defined in a test module, is released."""
    stages = [
        FAKE_STAGES[0] | {"configs": ["mirrored"]},
        {"name": "mirror", "type": "tests.fake_stages:MirrorStage", "configs": ["mirrored"]},
    ]
    config = _fake(tmp_path, folder, stages, configs=["original", "mirrored"])
    validated = validate_build(config)
    assert [o.config for o in validated.outputs] == ["original", "mirrored"]
    manifest = build(config, tmp_path / "out", progress=False)
    assert manifest["counts"]["mirrored"]["total"] == 4
    assert (tmp_path / "out" / "data" / "mirrored").is_dir()
    assert manifest["release_spec"]["configs"]["mirrored"]["description"] == "the source images, mirrored"
    from builder.release_format.verify import verify_release

    assert verify_release(tmp_path / "out") == []


@pytest.mark.parametrize(
    ("first", "message"),
    [
        ("tests.fake_stages:FakeCaptionStage", "read record field 'caption', which it does not declare"),
        ("tests.fake_stages:WritesUndeclaredField", "returned field 'captoin'"),
    ],
)
def test_a_stage_breaking_its_contract_stops_the_build_and_records_nothing(tmp_path, folder, first, message):
    import sqlite3

    second = (
        "tests.fake_stages:ReadsUndeclaredField"
        if first.endswith("FakeCaptionStage")
        else "tests.fake_stages:MirrorStage"
    )
    stages = [
        {"name": "caption", "type": first, "configs": ["mirrored"]},
        {"name": "mirror", "type": second, "configs": ["mirrored"]},
    ]
    config = _fake(tmp_path, folder, stages, ["original", "mirrored"])
    with pytest.raises(StageContractError, match=message):
        build(config, tmp_path / "out", progress=False)
    with sqlite3.connect(tmp_path / "out" / ".lance-cf" / "ledger.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM failures").fetchone()[0] == 0
        assert db.execute("SELECT COUNT(*) FROM outputs").fetchone()[0] == 0


def test_a_config_naming_code_is_refused_unless_allowed(tmp_path, folder, monkeypatch, capsys):
    monkeypatch.delenv("LANCE_CF_ALLOW_CODE", raising=False)
    marker = tmp_path / "ran"
    stage = {"name": "x", "type": "os:system", "configs": ["reconstructed"], "options": {"command": f"touch {marker}"}}
    path = write_config(tmp_path / "evil.yaml", f"imagefolder:{folder}", stages=[stage], configs=["original"])
    for command in (["validate", str(path)], ["build", str(path), "--output", str(tmp_path / "out")]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert "names Python code" in err and "--allow-code" in err and len(err.strip().splitlines()) == 1
    assert not marker.exists() and not (tmp_path / "out").exists()
    # Allowed, it is still not a stage class: refused before anything runs.
    assert main(["validate", str(path), "--allow-code"]) == 2
    assert "is not a stage class" in capsys.readouterr().err and not marker.exists()
    # A test stage by module:attr needs the flag too, and the manifest says that code ran.
    path = write_config(tmp_path / "ok.yaml", f"imagefolder:{folder}", stages=FAKE_STAGES, configs=ALL_CONFIGS)
    assert main(["build", str(path), "--output", str(tmp_path / "out2"), "--no-progress"]) == 2
    assert "--allow-code" in capsys.readouterr().err
    assert main(["build", str(path), "--output", str(tmp_path / "out2"), "--no-progress", "--allow-code"]) == 0
    manifest = json.loads((tmp_path / "out2" / "manifest.json").read_text())
    assert manifest["build"]["code"] == ["tests.fake_stages:FakeCaptionStage", "tests.fake_stages:FakeEditStage"]
    monkeypatch.setenv("LANCE_CF_ALLOW_CODE", "1")
    assert main(["validate", str(path)]) == 0
    assert os.environ["LANCE_CF_ALLOW_CODE"] == "1"


def test_a_demo_component_finished_meanwhile_by_another_process_is_kept_not_replaced(tmp_path, monkeypatch):
    """Two builds (or two test workers) materialise the same component at once: the one that finishes second keeps
    the first one's folder, which the first may already be reading, and discards its own copy."""
    from builder import model_refs

    monkeypatch.setenv("LANCE_CF_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "cache" / "demo-components" / "tiny-thing"

    def create(folder):
        (folder / "weights.bin").write_bytes(b"ours")
        # The other process finishes while this one is still writing its copy.
        target.mkdir(parents=True)
        (target / "weights.bin").write_bytes(b"theirs")
        (target / ".complete").write_text("ok\n")

    monkeypatch.setattr(model_refs.DEMO_COMPONENTS, "resolve", lambda name: create)
    assert model_refs.materialize_demo_component("tiny-thing") == target
    assert (target / "weights.bin").read_bytes() == b"theirs"
    assert [p.name for p in target.parent.iterdir()] == ["tiny-thing"]  # our copy is gone, nothing half-written left
