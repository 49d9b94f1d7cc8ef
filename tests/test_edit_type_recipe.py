"""docs/architecture.md's recipe "An edit type", followed from this file: one row of the table, and every reader sees
it (the perturber's prompt, the collect rules, the training prompt, the CLI's default, the release vocabulary)."""

from __future__ import annotations

import argparse

import pytest

from lance_pipeline import edit_types as et
from lance_pipeline.perturber.collect import CaptionItem, TeacherAnswer, collect_edits, judge_variation
from lance_pipeline.perturber.training import format_example
from lance_pipeline.text.perturbation import PromptPerturber, chat_messages

LIGHTING = et.EditType(
    "lighting",
    "the light the scene is in",
    "Rewrite the caption changing only the lighting of the scene, or adding one if none is given.",
    (
        "a photo of a dog sled pulled by huskies",
        "dog sled",
        (
            "a photo of a dog sled pulled by huskies at golden hour",
            "a photo of a dog sled pulled by huskies in moonlight",
        ),
    ),
    max_span_words=4,
    checks=("one_place", "keeps_domain"),
)


@pytest.fixture
def lighting():
    et.register_edit_type(LIGHTING)
    try:
        yield LIGHTING
    finally:
        et.unregister_edit_type("lighting")


def test_the_built_in_table_is_the_edit_types_and_its_examples_pass_their_own_checks():
    assert et.EDIT_TYPES and all(et.EDIT_TYPE_TABLE[name].name == name for name in et.EDIT_TYPES)
    assert et.release_edit_types() == (*et.EDIT_TYPES, "multi")
    for row in et.EDIT_TYPE_TABLE.values():
        caption, label, edits = row.example
        for edited in edits:
            assert judge_variation(caption, edited, row.name, label)[1] is None, (row.name, edited)
    with pytest.raises(ValueError, match="unknown edit type 'wether'.*did you mean 'weather'"):
        et.validate_edit_types("subject,wether")
    with pytest.raises(ValueError, match="unknown check"):
        et.EditType("x", "d", "i", ("c", "l", ("e",)), 3, checks=("nope",))
    with pytest.raises(ValueError, match="already exists"):
        et.register_edit_type(et.EDIT_TYPE_TABLE["weather"])


def test_an_edit_type_added_as_one_row_reaches_every_reader(lighting):
    # The table and the release vocabulary.
    assert et.edit_type_names()[-1] == "lighting" and "lighting" in et.release_edit_types()
    # Its own example passes its own checks; the span limit and checks are the row's.
    caption, label, edits = lighting.example
    assert all(judge_variation(caption, e, "lighting", label)[1] is None for e in edits)
    assert judge_variation(caption, caption + " under a dim and flickering orange street lamp", "lighting")[1] == (
        "changed_too_much"
    )
    assert judge_variation(caption, caption.replace("photo", "painting") + " at dusk", "lighting")[1] == (
        "several_changes"
    )
    # The perturb stage asks for every type by default, with the row's instruction and worked example.
    perturber = PromptPerturber(model="unused")
    assert perturber.edit_types[-1] == "lighting"
    assert perturber.describe()["instructions"]["lighting"] == lighting.instruction
    messages = chat_messages(perturber.instruction("lighting"), "a photo of a cat", "lighting", "cat", 2)
    assert lighting.instruction in messages[1]["content"] and caption in messages[1]["content"]
    assert messages[2]["content"] == "\n".join(edits)

    # Collecting data: the teacher is asked with the row's instruction, and the rows record it.
    class Teacher:
        counts: dict = {}

        def describe(self):
            return {"model": "rules"}

        def answer(self, requests):
            return [TeacherAnswer(f"{r.caption} at dawn\n{r.caption} in harsh neon light") for r in requests]

    result = collect_edits([CaptionItem("a photo of a cat on a sofa", "cat")], Teacher(), None, 2, 0.0)
    rows = {r["edit_type"]: r for r in result.rows}
    assert set(rows) == set(et.edit_type_names())
    assert rows["lighting"]["instruction"] == lighting.instruction and len(rows["lighting"]["variations"]) == 2
    # Training: the Alpaca prompt carries the row's instruction.
    prompt, answer = format_example({"caption": "a photo of a cat", "edit_type": "lighting", "variations": ["x"]})
    assert lighting.instruction in prompt
    # The CLI's default and help come from the table.
    from builder.perturber.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["perturber", "collect", "--teacher", "openai:m", "--output", "o", "--captions-file", "f"])
    assert args.edit_types is None and et.validate_edit_types(args.edit_types)[-1] == "lighting"
    assert "lighting" in et.render_markdown()


def test_docs_method_holds_the_generated_edit_type_table():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "method.md").read_text(encoding="utf-8")
    block = text.split(et.DOCS_BEGIN, 1)[1].split(et.DOCS_END, 1)[0]
    assert block == "\n" + et.render_markdown(), (
        "docs/method.md's edit-type table is stale: run `python -m lance_pipeline.edit_types docs/method.md`"
    )
