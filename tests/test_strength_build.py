"""The strength config on the build side: the edit stage keeps every gate-passing candidate of its sweep (option
``keep_candidates``), at no extra UNet evaluation; the builder reconciles the option with the configs it builds."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from lance_pipeline.editing.stages import CounterfactualEditStage, InversionStage, LanceREditStage
from lance_pipeline.editing.strength import STRENGTH_CONFIG, strength_of

STEPS = 6
SIZE = 32
SWEEP = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
CAPTION = "a photo of a dog on the grass"
PASS = (0.5, 0.9, 0.3, 0.3, 0.1)  # directional, image, text original, text edited, edited vs original caption
FAIL = (0.1, 0.9, 0.3, 0.3, 0.1)  # below the directional gate (0.2)


class TableScorer:
    """CLIP scores from a table: edited caption -> one row per sweep value (0.4 .. 0.9)."""

    def __init__(self, table):
        self.table = table

    def load(self, device):
        pass

    def describe(self):
        return {"name": "table"}

    def edit_scores(self, original_images, edited_images, captions, edited_captions):
        seen, out = Counter(), []
        keys = ("clip_directional", "clip_image", "clip_text_original", "clip_text_edited")
        for caption in edited_captions:
            row = self.table[caption][seen[caption]]
            seen[caption] += 1
            out.append({**dict(zip(keys, row[:4], strict=True)), "edited_vs_original_caption": row[4]})
        return out


def _edit(caption, span, edit_type):
    return {
        "edit_type": edit_type,
        "edited_caption": caption,
        "original_span": "",
        "edited_span": span,
        "scores": {"label_similarity": 0.1, "span_similarity": 0.4},
        "kept": True,
    }


@pytest.fixture(scope="module")
def record(tiny_sd_dir, single_thread_torch):
    rng = np.random.RandomState(0)
    image = Image.fromarray((rng.rand(SIZE, SIZE, 3) * 255).astype("uint8"))
    rec = {"key": "img0", "image": image, "label": 3, "label_name": "dog", "seed": 11, "caption": CAPTION}
    invert = InversionStage(model=str(tiny_sd_dir), image_size=SIZE, num_inference_steps=STEPS, num_inner_steps=2)
    invert.load("cpu")
    (update,) = invert.process([rec])
    return {**rec, **update}


def test_strength_is_one_minus_the_self_replace_fraction():
    assert [strength_of(f) for f in SWEEP] == [0.6, 0.5, 0.4, 0.3, 0.2, 0.1]
    assert strength_of(1) == 0.0 and strength_of(0.0) == 1.0
    for bad in (-0.1, 1.5, None, True, "0.4"):
        with pytest.raises(ValueError, match="self_replace"):
            strength_of(bad)


@pytest.mark.slow
def test_the_edit_stage_keeps_every_passing_candidate_at_no_extra_unet_evaluation(record, tiny_sd_dir):
    from lance_pipeline.editing.cost import count_unet_evaluations

    cat, snow, night = CAPTION.replace("dog", "cat"), CAPTION + " in the snow", CAPTION + " at night"
    # cat: 4 of 6 pass (not 0.4 and 0.7); snow: only 0.8 passes (a single surviving candidate); night: none passes.
    table = {
        cat: [FAIL, PASS, (0.6, 0.9, 0.3, 0.3, 0.1), FAIL, PASS, PASS],
        snow: [FAIL, FAIL, FAIL, FAIL, PASS, FAIL],
        night: [FAIL] * 6,
    }
    edits = [
        _edit(cat, "cat", "subject"),
        {**_edit("unused", "x", "object"), "kept": False},  # not kept by the label check: never rendered
        _edit(snow, "in the snow", "weather"),
        _edit(night, "at night", "background"),
    ]
    options = {"model": str(tiny_sd_dir), "image_size": SIZE, "num_inference_steps": STEPS}
    runs = {}
    for keep in (False, True):
        stage = CounterfactualEditStage(scorer=TableScorer(table), keep_candidates=keep, **options)
        stage.load("cpu")
        with count_unet_evaluations(stage.editor.components.unet) as count:
            (update,) = stage.process([dict(record, edits=edits)])
        runs[keep] = (update, count)
        assert stage.describe()["prompt_to_prompt"]["keep_candidates"] is keep
    (off, off_count), (on, on_count) = runs[False], runs[True]
    # The same work: not one more UNet sample-forward or backward, and the same selection.
    assert (on_count.forwards, on_count.backwards) == (off_count.forwards, off_count.backwards) != (0, 0)
    assert "strength_samples" not in off  # without the option the stored outputs are those of a build without it
    assert on["edit_candidates"] == off["edit_candidates"]
    assert [c["edited_caption"] for c in on["counterfactuals"]] == [cat, snow]
    for a, b in zip(on["counterfactuals"], off["counterfactuals"], strict=True):
        assert a["image"].tobytes() == b["image"].tobytes()

    series = on["strength_samples"]
    passing = [c for c in on["edit_candidates"] if c["passed"]]
    assert len(series) == len(passing) == 5
    # Ordered by edit, then strength; edit_index counts the record's kept edits (the unkept one is skipped).
    assert [(s["edit_index"], s["strength"]) for s in series] == [(0, 0.1), (0, 0.2), (0, 0.4), (0, 0.5), (1, 0.2)]
    assert [s["self_replace"] for s in series] == [0.9, 0.8, 0.6, 0.5, 0.8]
    assert [s["counterfactual_key"] for s in series] == ["img0_cf000"] * 4 + ["img0_cf001"]
    assert [s["selected"] for s in series] == [False, False, True, False, True]  # 0.6 has cat's best directional
    for sample in series:
        record_ = next(
            c
            for c in passing
            if c["edit_index"] == sample["edit_index"] and c["self_replace"] == sample["self_replace"]
        )
        assert sample["scores"] == {k: record_["scores"][k] for k in sample["scores"]}
        assert sample["strength"] == strength_of(sample["self_replace"]) and sample["editor"] == "prompt_to_prompt"
    # A selected candidate is the counterfactual itself, pixel for pixel.
    for sample in (s for s in series if s["selected"]):
        chosen = on["counterfactuals"][int(sample["counterfactual_key"][-3:])]
        assert sample["image"].tobytes() == chosen["image"].tobytes()
        assert chosen["self_replace"] == sample["self_replace"]
    # Each strength sample is the candidate the sweep rendered at its fraction: two samples are the same image exactly
    # when their fractions cover the same number of steps (0.8 and 0.9 of 6 steps both cover 5).
    from lance_pipeline.editing.options import steps_of

    cat_series = series[:4]
    for a in cat_series:
        for b in cat_series:
            same_steps = steps_of(a["self_replace"], STEPS) == steps_of(b["self_replace"], STEPS)
            assert (a["image"].tobytes() == b["image"].tobytes()) is same_steps


def test_only_editors_whose_candidates_are_a_strength_series_accept_the_option(tiny_sd_dir):
    from lance_pipeline.dillema.controlnet_editing import ControlNetEditorOptions

    with pytest.raises(ValueError, match="conditioning scale sets how closely"):
        ControlNetEditorOptions(model=str(tiny_sd_dir), controlnet=str(tiny_sd_dir), keep_candidates=True)
    with pytest.raises(ValueError, match="no strength config"):
        LanceREditStage(model=str(tiny_sd_dir), keep_candidates=True)
    with pytest.raises(ValueError, match="option keep_candidates = .yes.: expected true or false"):
        CounterfactualEditStage(model=str(tiny_sd_dir), keep_candidates="yes")


def _demo(**overrides):
    from builder.config import apply_overrides, load_config

    return apply_overrides(load_config("demo"), **overrides)


def test_the_builder_reconciles_the_option_with_the_configs_it_builds():
    from builder.validation import validate_build

    validated = validate_build(_demo())
    assert STRENGTH_CONFIG in [o.config for o in validated.outputs]
    edit = next(s for s in validated.active if s.config.name == "edit")
    assert edit.config.options["keep_candidates"] is True
    spec = validated.release_spec.config(STRENGTH_CONFIG)
    # The edit stage's own fields, then those of the screens that judge every released strength image.
    assert [f.name for f in spec.fields] == [
        *("editor", "strength", "edit_index", "selected", "counterfactual_key"),
        *("sensitive_edit", "sensitive_attributes", "sensitive_triggers", "safety_nsfw", "safety_score"),
    ]

    # --configs without strength: the option is switched off for that build (nothing kept, nothing stored) ...
    validated = validate_build(_demo(configs=["original", "counterfactual"]))
    edit = next(s for s in validated.active if s.config.name == "edit")
    assert edit.config.options["keep_candidates"] is False
    assert STRENGTH_CONFIG not in [o.config for o in validated.outputs]

    # ... strength without its option is refused, as is strength without the counterfactual config it links to.
    config = _demo()
    stages = [
        dataclasses.replace(s, options={**s.options, "keep_candidates": False}) if s.name == "edit" else s
        for s in config.stages
    ]
    with pytest.raises(ValueError, match="only with its option keep_candidates: true"):
        validate_build(dataclasses.replace(config, stages=stages))
    with pytest.raises(ValueError, match=r"links its samples to config\(s\) \['counterfactual'\]"):
        validate_build(_demo(configs=["original", "strength"]))


def test_hardimagenet_keeps_no_candidates_by_default():
    from builder.config import load_config
    from builder.validation import validate_build

    config = load_config("hardimagenet")
    # the demo source stands in for imagenet, without imagenet's source options (its classes)
    validated = validate_build(dataclasses.replace(config, source="demo", source_options={}))
    assert STRENGTH_CONFIG not in config.configs
    edit = next(s for s in validated.active if s.config.name == "edit")
    assert edit.cls(**edit.config.options).options.keep_candidates is False


@pytest.mark.slow  # the session's local demo build (minutes on a loaded 2-core machine)
def test_the_engine_and_resume_comparisons_cover_the_strength_config(local_demo):
    """tests/test_scale.py and tests/test_builder_ray.py compare killed, resumed, stage-major, multi-worker and Ray
    builds of the demo's stages with this build byte for byte: it holds the strength config, so they cover it."""
    import json

    manifest = json.loads((local_demo / "manifest.json").read_text())
    assert manifest["counts"][STRENGTH_CONFIG]["total"] == 6 * manifest["counts"]["counterfactual"]["total"] > 0
