"""Options hashed by value: a default written out is the same config (same hash, same bytes, resumed), a changed value
is refused naming its key, an out-of-range value is refused by ``lance-cf validate`` in one line, and a build
directory made before options were hashed by value (tests/data/pre-value-hash: a release and its ledger built by the
previous version of lance-cf) is resumed."""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
import typing
from pathlib import Path

import pytest
import yaml
from builder_helpers import ALL_CONFIGS, FAKE_STAGES, make_imagefolder, release_files, write_config

from builder.cli import main
from builder.config import load_config, preset_path
from builder.engine import BuildRefused, build
from builder.sources import MAX_IMAGE_BYTES
from builder.validation import validate_build

OLD = Path(__file__).parent / "data" / "pre-value-hash"
# A release (manifest and shards; its work directory deleted) built by the version before sources declared their options
# as an ``Options`` class, when the config hash took a source's options by value from its constructor's keywords.
OLD_SOURCE_OPTIONS = Path(__file__).parent / "data" / "pre-source-options"


def _demo(tmp_path: Path, name: str, stage: str, **options) -> Path:
    """The demo preset as a file, with options of one stage set."""
    data = yaml.safe_load(Path(preset_path("demo")).read_text())
    for s in data["stages"]:
        if s["name"] == stage:
            s["options"] = {**s["options"], **options}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_a_default_written_out_is_the_same_config_hash(tmp_path):
    plain = load_config("demo")
    # Defaults of three stages written out, one of them as an integer where the option is a float.
    written = _demo(tmp_path, "a", "perturb", few_shot=True, top_p=0.9, repetition_penalty=1)
    written = load_config(str(written))
    written.stages[2].options["batch_size"] = 64  # label_check's default
    written.stages[4].options["guidance_scale"] = 7.5  # invert's default
    assert written.to_dict() != plain.to_dict()
    assert written.config_hash() == plain.config_hash()
    # Hashed as written (what releases before this change record), they differed: the reason for the change.
    assert written.config_hash_as_written() != plain.config_hash_as_written()
    # A value that is not the default is another config.
    changed = load_config(str(_demo(tmp_path, "b", "perturb", top_p=0.8)))
    assert changed.config_hash() != plain.config_hash()


@pytest.mark.slow
def test_a_default_written_out_gives_the_same_bytes_and_resumes_and_a_changed_value_is_refused(tmp_path):
    folder = make_imagefolder(tmp_path / "src", ["cat", "dog"], per_class=2)
    plain = write_config(tmp_path / "plain.yaml", f"imagefolder:{folder}", stages=FAKE_STAGES, configs=ALL_CONFIGS)
    explicit = [dict(FAKE_STAGES[0], options={"delay": 0, "fail_keys": None}), FAKE_STAGES[1]]
    written = write_config(tmp_path / "written.yaml", f"imagefolder:{folder}", stages=explicit, configs=ALL_CONFIGS)
    first = build(load_config(str(plain)), tmp_path / "a", progress=False, allow_code=True)
    second = build(load_config(str(written)), tmp_path / "b", progress=False, allow_code=True)
    assert first["config_hash"] == second["config_hash"]
    # The same samples, byte for byte; the manifest (and the card made from it) records the config as written.
    assert _data(tmp_path / "a") == _data(tmp_path / "b") != {}
    assert first["config"]["stages"][0]["options"] == {} != second["config"]["stages"][0]["options"]
    # The directory built without the defaults is resumed with them written out (and the bytes stay).
    build(load_config(str(written)), tmp_path / "a", progress=False, allow_code=True)
    assert _data(tmp_path / "a") == _data(tmp_path / "b")
    # A value that is not the default is refused, naming the option and both values.
    slow = [dict(FAKE_STAGES[0], options={"delay": 0.5}), FAKE_STAGES[1]]
    other = write_config(tmp_path / "other.yaml", f"imagefolder:{folder}", stages=slow, configs=ALL_CONFIGS)
    with pytest.raises(BuildRefused, match=r"stages\[caption\]\.options\.delay: 0\.0 -> 0\.5"):
        build(load_config(str(other)), tmp_path / "a", progress=False, allow_code=True)


def test_an_option_out_of_its_range_is_refused_by_validate_in_one_line(tmp_path, capsys):
    config = _demo(tmp_path, "bad", "perturb", top_p=1.5)
    assert main(["validate", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "stage 'perturb' (llm_perturber): option top_p = 1.5: expected a number in (0.0, 1.0]" in err


def _data(release: Path) -> dict[str, str]:
    """sha256 of the release's shards and indexes: its samples. A shard is keyed by its config and index, without
    the digest that names of the current version carry (``test-000000-<sha256[:16]>.tar``, the previous version's
    ``test-000000.tar``); a current name's digest is checked against its bytes."""
    out = {}
    for name, digest in release_files(release).items():
        if not name.startswith(("data/", "index/")):
            continue
        match = re.fullmatch(r"(data/.+/test-\d{6})(?:-([0-9a-f]{16}))?\.tar", name)
        if match:
            assert match.group(2) in (None, digest[:16]), name
            name = match.group(1)
        out[name] = digest
    return out


def _old_build(tmp_path: Path, monkeypatch) -> Path:
    """The fixture's photos, config and build directory (made by the previous version) in ``tmp_path``, which becomes
    the working directory: its config names the photos by a relative path, as its ledger's plan records them."""
    root = tmp_path / "old"
    shutil.copytree(OLD, root)
    monkeypatch.chdir(root)
    return root


def _ledger_hash(release: Path) -> str:
    with sqlite3.connect(release / ".lance-cf" / "ledger.sqlite") as db:
        return db.execute("SELECT value FROM meta WHERE name = 'config_hash'").fetchone()[0]


def test_a_build_directory_of_the_previous_version_is_resumed(tmp_path, monkeypatch):
    root = _old_build(tmp_path, monkeypatch)
    old_manifest = json.loads((root / "release" / "manifest.json").read_text())
    config = load_config("config.yaml")  # writes two options at their defaults (delay: 0.0, refuse_keys: null)
    # The previous version hashed the options as written: that hash is still computed, and is the one it recorded.
    validated = validate_build(config, allow_code=True)  # its stages are code (tests.fake_stages), imported here
    assert old_manifest["config_hash"] == validated.config_hash_as_written == _ledger_hash(root / "release")
    assert validated.config_hash != validated.config_hash_as_written
    old_shards = _data(root / "release")

    # Resumed (the environment it recorded is this machine's when it was made: other versions are accepted here).
    manifest = build(config, root / "release", progress=False, allow_code=True, allow_version_change=True)
    assert {k: v for k, v in _data(root / "release").items() if k.startswith("data/")} == old_shards
    # The ledger and the manifest now hold the hash by value, so the defaults may be left out from now on.
    assert manifest["config_hash"] == validated.config_hash == _ledger_hash(root / "release")
    bare = yaml.safe_load(Path("config.yaml").read_text())
    for stage in bare["stages"]:
        stage["options"] = {}
    Path("bare.yaml").write_text(yaml.safe_dump(bare))
    build(load_config("bare.yaml"), root / "release", progress=False, allow_code=True, allow_version_change=True)
    assert {k: v for k, v in _data(root / "release").items() if k.startswith("data/")} == old_shards

    # The source's options too: its default written out is the same config, resumed; the manifest keeps the config as
    # written.
    written = dict(bare, source_options={"max_image_bytes": MAX_IMAGE_BYTES})
    Path("written.yaml").write_text(yaml.safe_dump(written))
    assert validate_build(load_config("written.yaml"), allow_code=True).config_hash == validated.config_hash
    manifest = build(
        load_config("written.yaml"), root / "release", progress=False, allow_code=True, allow_version_change=True
    )
    assert manifest["config_hash"] == validated.config_hash
    assert manifest["config"]["source_options"] == {"max_image_bytes": MAX_IMAGE_BYTES}
    assert {k: v for k, v in _data(root / "release").items() if k.startswith("data/")} == old_shards
    # Another value of it is another config, refused naming the option and both values.
    Path("halved.yaml").write_text(yaml.safe_dump(dict(bare, source_options={"max_image_bytes": 1 << 20})))
    with pytest.raises(BuildRefused, match=rf"source_options\.max_image_bytes: {MAX_IMAGE_BYTES} -> {1 << 20}"):
        build(load_config("halved.yaml"), root / "release", progress=False, allow_code=True, allow_version_change=True)


def test_a_changed_value_on_a_build_directory_of_the_previous_version_is_refused(tmp_path, monkeypatch):
    root = _old_build(tmp_path, monkeypatch)
    data = yaml.safe_load(Path("config.yaml").read_text())
    data["stages"][0]["options"]["delay"] = 0.25
    Path("changed.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(BuildRefused, match=r"stages\[caption\]\.options\.delay: 0\.0 -> 0\.25"):
        build(load_config("changed.yaml"), root / "release", progress=False, allow_code=True, allow_version_change=True)


def test_a_release_of_the_previous_version_without_its_ledger_is_rebuilt_in_place(tmp_path, monkeypatch):
    """A finished release whose work directory was deleted is recognised by its manifest's (old-style) hash."""
    root = _old_build(tmp_path, monkeypatch)
    shutil.rmtree(root / "release" / ".lance-cf")
    old_shards = _data(root / "release")
    build(load_config("config.yaml"), root / "release", progress=False, allow_code=True)
    assert {k: v for k, v in _data(root / "release").items() if k.startswith("data/")} == old_shards


def test_a_release_built_before_sources_declared_options_is_rebuilt_in_place_with_a_source_default_written(
    tmp_path, monkeypatch
):
    root = tmp_path / "old"
    shutil.copytree(OLD_SOURCE_OPTIONS, root)
    shutil.copytree(OLD / "photos", root / "photos")
    monkeypatch.chdir(root)
    old_hash = json.loads((root / "release" / "manifest.json").read_text())["config_hash"]
    old_shards = _data(root / "release")
    written = yaml.safe_load(Path("config.yaml").read_text())
    assert "source_options" not in written
    written["source_options"] = {"max_image_bytes": MAX_IMAGE_BYTES}
    Path("written.yaml").write_text(yaml.safe_dump(written))
    # The hash that version recorded is this version's hash by value, of the config as it was and with the default.
    for name in ("config.yaml", "written.yaml"):
        assert validate_build(load_config(name), allow_code=True).config_hash == old_hash
    manifest = build(load_config("written.yaml"), root / "release", progress=False, allow_code=True)
    assert manifest["config_hash"] == old_hash
    assert {k: v for k, v in _data(root / "release").items() if k.startswith("data/")} == old_shards


def test_a_source_option_written_at_its_default_is_the_same_config_hash(tmp_path):
    folder = make_imagefolder(tmp_path / "src", ["cat"], per_class=1)
    plain = load_config(str(write_config(tmp_path / "a.yaml", f"imagefolder:{folder}")))
    written = load_config(
        str(
            write_config(
                tmp_path / "b.yaml", f"imagefolder:{folder}", source_options={"max_image_bytes": MAX_IMAGE_BYTES}
            )
        )
    )
    halved = load_config(
        str(write_config(tmp_path / "c.yaml", f"imagefolder:{folder}", source_options={"max_image_bytes": 1 << 20}))
    )
    assert plain.config_hash() == written.config_hash() != halved.config_hash()


def test_the_choices_an_annotation_lists_are_the_ones_the_code_knows():
    """A ``Literal`` annotation is an option's only check of its choices: it lists what the code that reads it knows."""
    from lance_pipeline.dillema.text_stages import DillemaLLMOptions
    from lance_pipeline.editing import attention_control, candidate_selection, options, sd_components
    from lance_pipeline.interfaces.generation import SCHEDULERS, GenerationOptions
    from lance_pipeline.text.perturbation import PROMPT_STYLES, PerturbOptions

    def choices(cls, name):
        return typing.get_args(typing.get_type_hints(cls, include_extras=True)[name])

    editor = options.ImageEditorOptions
    assert choices(editor, "compile") == sd_components.COMPILE_MODES
    assert choices(editor, "precision") == options.PRECISIONS
    assert choices(editor, "attention_edit") == options.ATTENTION_EDITS
    assert choices(editor, "refine_padding") == attention_control.REFINE_PADDINGS == options.REFINE_PADDINGS
    assert choices(editor, "selection") == candidate_selection.SELECTIONS == options.SELECTIONS
    assert choices(editor, "dtype") == sd_components.DTYPES
    assert choices(GenerationOptions, "scheduler") == tuple(SCHEDULERS)
    assert choices(PerturbOptions, "prompt_style") == choices(DillemaLLMOptions, "prompt_style") == PROMPT_STYLES
