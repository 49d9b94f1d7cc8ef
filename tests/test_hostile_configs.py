"""Configs a careless or hostile user writes, through the commands they would run (``lance-cf validate`` and
``lance-cf build``, in process): YAML alias bombs and self-references, sizes that would exhaust memory, non-finite
numbers. Each must fail in one line naming the input, before any model loads and without writing anything.

The alias bombs expand to 9**9 (387 million) values: a check that walked them would hang this test (no wall-clock
limit is needed to see it fail), one that measures them answers at once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from builder_helpers import make_imagefolder

from builder.config import BuildConfig, StageConfig, load_config
from builder.engine import build
from builder.release_format.yaml_text import MAX_YAML_VALUES, expanded_size, load_yaml
from lance_pipeline.option_types import check_value, describe_type

BOMB = "\n".join(
    ["  l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    + [f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
)


def _one_line_refusal(lance_cf, config: Path, output: Path, expected: str) -> None:
    """``validate`` and ``build`` both refuse ``config`` in one line holding ``expected``; nothing is written."""
    for args in (["validate", str(config)], ["build", str(config), "--output", str(output), "--device", "cpu"]):
        code, _, err = lance_cf(*args)
        assert code == 2, (args, err)
        assert len(err.strip().splitlines()) == 1, err
        assert expected in err, err
    assert not output.exists()


@pytest.mark.parametrize("where", ["source_options", "stage options"])
def test_a_yaml_alias_bomb_is_refused_in_one_line_by_validate_and_build(tmp_path, capsys, where, lance_cf):
    folder = make_imagefolder(tmp_path / "photos", ["cat", "dog"], per_class=1)
    if where == "source_options":
        text = f"name: bomb\nsource: imagefolder:{folder}\nconfigs: [original]\nsource_options:\n{BOMB}\n"
    else:
        indented = BOMB.replace("\n", "\n    ")
        text = (
            f"name: bomb\nsource: imagefolder:{folder}\nconfigs: [original]\nstages:\n  - name: caption\n"
            f"    type: blip2_captioner\n    configs: [original]\n    options:\n    {indented}\n"
        )
    config = tmp_path / "bomb.yaml"
    config.write_text(text)
    assert len(text) < 1500  # a 1 KB file
    _one_line_refusal(lance_cf, config, tmp_path / "out", "expand to more than 1,000,000 values")


def test_a_yaml_document_that_contains_itself_is_refused(tmp_path, capsys, lance_cf):
    config = tmp_path / "loop.yaml"
    config.write_text("name: loop\nsource: demo\nconfigs: [original]\nsource_options: &me {self: *me}\n")
    _one_line_refusal(lance_cf, config, tmp_path / "out", "alias bomb")


def test_a_config_built_in_python_with_shared_values_is_bounded_too(tmp_path):
    """The Python API skips the YAML loader: ``build`` must still measure before it hashes the config."""
    level: list = ["x"] * 9
    for _ in range(8):
        level = [level] * 9
    config = BuildConfig(name="bomb", source="demo", configs=["original"], source_options={"x": level})
    with pytest.raises(ValueError, match="source_options: its aliases"):
        build(config, tmp_path / "out", progress=False)
    stage = StageConfig("caption", "blip2_captioner", ["original"], {"x": level})
    config = BuildConfig(name="bomb", source="demo", configs=["original"], stages=[stage])
    with pytest.raises(ValueError, match="stage 'caption': options: its aliases"):
        build(config, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_expanded_size_counts_shared_values_each_time_and_stops_past_the_limit():
    shared = [1, 2, 3]
    assert expanded_size({"a": shared, "b": shared}) == 1 + 2 + 2 * 4  # the mapping, its keys, each list counted
    with pytest.raises(ValueError, match="t: its aliases"):
        load_yaml(f"bomb:\n{BOMB}\n", "t")
    assert expanded_size([[0] * 10] * 10, limit=50) == 51
    assert load_yaml("a: &a [1, 2]\nb: *a\n", "t") == {"a": [1, 2], "b": [1, 2]}  # ordinary aliases still load
    assert MAX_YAML_VALUES >= 1_000_000


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("image_size: 1000000000", "image_size 1000000000: expected an integer in [8, 16384] or null"),
        ("batch_size: .inf", "'batch_size' is inf; only finite numbers are accepted"),
        ("seed: 1.5", "seed 1.5: expected an integer >= 0"),
        ("limit: true", "limit True: expected an integer >= 1 or null"),
    ],
)
def test_config_numbers_out_of_range_fail_in_one_line_before_anything_runs(tmp_path, capsys, line, expected, lance_cf):
    config = tmp_path / "c.yaml"
    config.write_text(f"name: big\nsource: demo\nconfigs: [original]\n{line}\n")
    _one_line_refusal(lance_cf, config, tmp_path / "out", expected)


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("image_size", 10**9, "option image_size = 1000000000: expected an integer in [8, 16384]"),
        ("num_inference_steps", 10**9, "option num_inference_steps = 1000000000: expected an integer in [1,"),
        ("guidance_scale", float("nan"), "'stages.4.options.guidance_scale' is nan; only finite numbers"),
    ],
)
def test_stage_options_that_size_memory_are_bounded_before_any_model_loads(
    tmp_path, capsys, option, value, expected, lance_cf
):
    """The demo preset with one editing option raised: refused by validate and by build, no demo component built."""
    loaded = load_config("demo")
    invert = next(s for s in loaded.stages if s.type == "null_text_inversion")
    invert.options[option] = value
    data = loaded.to_dict()
    data["source"] = "demo"
    config = tmp_path / "demo.yaml"
    config.write_text(yaml.safe_dump(data))
    _one_line_refusal(lance_cf, config, tmp_path / "out", expected)


def test_one_checker_describes_and_checks_every_option_type():
    from typing import Annotated, Literal

    from lance_pipeline.option_types import Interval

    assert describe_type(list[str | int] | None) == "a list (of strings or integers) or null"
    assert describe_type(Annotated[int, Interval(ge=1, le=9)]) == "an integer in [1, 9]"
    assert describe_type(Literal["a", "b"]) == "one of 'a', 'b'"
    assert check_value(3, float) is None  # YAML writes 3 for 3.0
    assert check_value([1, 2.5], tuple[float, ...]) is None  # and a list for a tuple
    for value, annotation in [(True, int), ("3", int), (1, bool), (float("inf"), float), ("c", Literal["a", "b"])]:
        assert check_value(value, annotation) is not None, (value, annotation)
    assert "item [1]" in check_value([1, "x"], tuple[float, ...])


@pytest.mark.parametrize("case", ["under a file", "name too long", "a file", "unwritable parent"])
def test_a_bad_output_path_fails_in_one_line_before_any_model_loads(tmp_path, capsys, monkeypatch, case, lance_cf):
    """The full demo preset (its models would be built into the cache first): refused before the cache is touched."""
    import os

    cache = tmp_path / "cache"
    monkeypatch.setenv("LANCE_CF_CACHE", str(cache))
    (tmp_path / "afile").write_text("x")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    output, expected = {
        "under a file": (tmp_path / "afile" / "out", "is a file, so nothing can be created under it"),
        "name too long": (tmp_path / ("n" * 300), "a name of 300 bytes is longer than this file system allows"),
        "a file": (tmp_path / "afile", "is a file; give a directory"),
        "unwritable parent": (locked / "out", "not writable by this user"),
    }[case]
    if case == "unwritable parent" and os.access(locked, os.W_OK):
        pytest.skip("running as root: permissions do not stop this user")
    code, _, err = lance_cf("build", "demo", "--output", str(output), "--device", "cpu", "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1 and expected in err, err
    assert not cache.exists()
