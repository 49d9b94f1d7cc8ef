"""The judge stage (lance_pipeline/screening/judge.py): its declared fields and the manifest record the card reads."""

from __future__ import annotations

import pytest

from builder import release_format as rf
from builder.registry import STAGES
from lance_pipeline.screening.judge import (
    CLASS_QUESTION,
    DEFAULT_JUDGE,
    DEFAULT_JUDGE_REVISION,
    EDIT_QUESTION,
    JUDGE_FIELDS,
    JudgeStage,
)

JUDGE_TYPES = ("judge", "judge_lance_r", "judge_strength", "judge_generated", "judge_discovery")


def test_the_judge_fields_are_declared_fractions_that_are_null_when_not_judged():
    specs = {f.name: rf.FieldSpec(f.name, f.dtype, description=f.description, minimum=f.minimum, maximum=f.maximum)
             for f in JUDGE_FIELDS}  # fmt: skip
    assert list(specs) == ["judge_class_p", "judge_edit_p"]
    for spec in specs.values():
        assert spec.check(0.25, "t") == 0.25 and spec.check(None, "t") is None and spec.check(1, "t") == 1.0
        for bad in (1.5, -0.1):
            with pytest.raises(ValueError, match=spec.name):
                spec.check(bad, "t")


@pytest.mark.parametrize("stage_type", JUDGE_TYPES)
def test_every_judge_stage_declares_the_fields_and_records_the_judge(stage_type):
    cls = STAGES.resolve(stage_type)
    assert [f.name for s in cls.screens for f in s.fields] == ["judge_class_p", "judge_edit_p"]
    record = cls().describe()  # no weights: the identity comes from the options
    assert record["model"] == DEFAULT_JUDGE and record["revision"] == DEFAULT_JUDGE_REVISION
    assert record["license"] == "apache-2.0" and record["filter_below"] is None
    assert record["class_question"] == CLASS_QUESTION and record["edit_question"] == EDIT_QUESTION
    assert record["answer_tokens"]["yes"] == "Yes" and record["answer_tokens"]["no"] == "No"


def test_filter_below_must_be_a_fraction():
    with pytest.raises(ValueError, match="filter_below"):
        JudgeStage(filter_below=1.5)
