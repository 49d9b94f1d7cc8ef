"""``lance-cf perturber``: argument handling and JSON-lines output, on the tiny LM and the real label check."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from builder import cli_perturber
from lance_pipeline.perturbation import PromptPerturber
from lance_pipeline.tiny_text_components import create_tiny_causal_lm

CAPTION = "a photo of a husky pulling a sled in the snow"


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory: pytest.TempPathFactory):
    return create_tiny_causal_lm(tmp_path_factory.mktemp("tiny") / "tiny-causal-lm")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lance-cf")
    cli_perturber.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_prints_edits_with_spans_and_scores(tiny_lm, monkeypatch, capsys) -> None:
    answer = (
        "1. a photo of a husky pulling a sled in a forest\n"
        "2. a photo of a husky pulling a dog sled in the snow\n"
        "3. a photo of a husky pulling a sled in the snow on a foggy morning"
    )
    monkeypatch.setattr(PromptPerturber, "generate", lambda self, prompts, seeds: [(answer, False)] * len(prompts))
    args = _parse(
        ["perturber", CAPTION, "--label", "dog sled", "--edit-types", "background", "--model", str(tiny_lm), "--n", "3",
         "--device", "cpu", "--stats"]
    )  # fmt: skip
    assert args.func is cli_perturber.run
    assert args.func(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    edits, stats = lines[:-1], lines[-1]
    assert [(e["original_span"], e["edited_span"]) for e in edits] == [
        ("the snow", "a forest"),
        ("", "dog"),
        ("", "on a foggy morning"),
    ]
    for edit in edits:
        assert edit["caption"] == CAPTION and edit["label_name"] == "dog sled" and edit["edit_type"] == "background"
        assert set(edit["scores"]) == {"label_similarity", "span_similarity"}
    # Inserting "dog" next to "sled" rewrites the class: the label check catches it.
    assert [e["kept"] for e in edits] == [True, False, True]
    assert stats["perturb_stats"]["kept"] == 3 and stats["perturb_stats"]["generations"] == 1


def test_tiny_model_end_to_end_without_label_check(tiny_lm, capsys) -> None:
    args = _parse(
        ["perturber", CAPTION, "another caption of a dog", "--label", "dog sled", "--edit-types", "weather,domain",
         "--model", str(tiny_lm), "--max-new-tokens", "16", "--no-label-check", "--stats", "--device", "cpu"]
    )  # fmt: skip
    assert args.func(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    stats = [line["perturb_stats"] for line in lines if "perturb_stats" in line]
    assert len(stats) == 2 and all(s["generations"] == 2 for s in stats)
    assert all("scores" not in line for line in lines if "perturb_stats" not in line)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--edit-types", "wether"], "did you mean 'weather'"),
        (["--n", "0"], "--n must be"),
        (["--label", " "], "--label"),
    ],
)
def test_bad_values_are_value_errors(tiny_lm, extra, message) -> None:
    args = _parse(["perturber", CAPTION, "--label", "dog sled", "--model", str(tiny_lm), *extra])
    with pytest.raises(ValueError, match=message):
        args.func(args)


def test_module_import_is_light() -> None:
    code = "import sys, builder.cli_perturber; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
