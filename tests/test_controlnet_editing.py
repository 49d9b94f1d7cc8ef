"""The ControlNet editor (DILLEMA's image side): Canny conditions, seeded rendering, gates, candidates, options."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from lance_pipeline.dillema.controlnet_editing import (
    DILLEMA_NEGATIVE_PROMPT,
    ControlNetEditorOptions,
    ControlNetEditStage,
    candidate_seed,
    canny_condition,
)
from lance_pipeline.editing.stages import bench_edit
from lance_pipeline.stage import SCORE_NAMES, SampleFailure

OPEN_GATES = {
    "clip_directional_threshold": -1.0,
    "clip_image_threshold": -1.0,
    "clip_text_threshold": -1.0,
    "require_edited_closer": False,
}


# -- Canny conditions -------------------------------------------------------------------------------------------------


def _step_image(low: int, high: int, size: int = 32) -> Image.Image:
    """A vertical step edge at column size // 2, from grey level ``low`` to ``high``, in all three channels."""
    array = np.full((size, size, 3), low, dtype=np.uint8)
    array[:, size // 2 :] = high
    return Image.fromarray(array)


def test_canny_is_opencv_canny_of_the_rgb_image_in_three_channels():
    import cv2

    rng = np.random.default_rng(0)
    array = (rng.random((48, 40, 3)) * 255).astype(np.uint8)
    array[10:30, 8:20] = 255  # a block with sharp borders among the noise
    edges = np.asarray(canny_condition(Image.fromarray(array), 100, 200))
    assert edges.shape == (48, 40, 3) and edges.dtype == np.uint8
    assert (edges[..., 0] == edges[..., 1]).all() and (edges[..., 0] == edges[..., 2]).all()
    assert np.array_equal(edges[..., 0], cv2.Canny(array, 100, 200))
    assert set(np.unique(edges)) <= {0, 255}


def test_canny_thresholds_follow_the_sobel_gradient_of_a_step():
    # Across a step of height h, OpenCV's 3x3 Sobel gives |gx| = 4h (weights 1, 2, 1) and gy = 0, so with the L1
    # norm the gradient is 4h: h = 10 -> 40 (below the low threshold 100, no edge); h = 60 -> 240 (above 200, edge).
    assert not np.asarray(canny_condition(_step_image(100, 110))).any()
    strong = np.asarray(canny_condition(_step_image(100, 160)))[..., 0]
    columns = np.nonzero(strong.any(axis=0))[0]
    assert set(columns) <= {15, 16}, columns  # on the step, not elsewhere
    assert strong[2:-2, columns[0]].all()  # one unbroken vertical line (borders aside)
    # h = 30 -> 120: between the thresholds, with no strong pixel to connect to: hysteresis drops it.
    assert not np.asarray(canny_condition(_step_image(100, 130))).any()
    # The same step passes once the high threshold is below 120.
    assert np.asarray(canny_condition(_step_image(100, 130), 100, 110)).any()
    assert not np.asarray(canny_condition(Image.new("RGB", (32, 32), (90, 20, 200)))).any()
    with pytest.raises(ValueError, match="low <= high"):
        canny_condition(_step_image(0, 255), 200, 100)


# -- options ------------------------------------------------------------------------------------------------------------


def test_options_default_to_dillema_and_refuse_what_cannot_be_loaded(tmp_path):
    options = ControlNetEditorOptions()
    assert options.num_inference_steps == 5 and options.negative_prompt == DILLEMA_NEGATIVE_PROMPT
    assert options.controlnet == "lllyasviel/sd-controlnet-canny" and len(options.controlnet_revision) == 40
    assert options.model == "stable-diffusion-v1-5/stable-diffusion-v1-5" and len(options.revision) == 40
    with pytest.raises(ValueError, match="pickle checkpoint; this project loads safetensors only"):
        ControlNetEditorOptions(condition="hed")
    with pytest.raises(ValueError, match="condition 'depth' needs depth_model"):
        ControlNetEditorOptions(condition="depth")
    with pytest.raises(ValueError, match="needs a depth ControlNet"):
        ControlNetEditorOptions(condition="depth", depth_model="Intel/dpt-hybrid-midas")
    with pytest.raises(ValueError, match="depth_model is only used with condition 'depth'"):
        ControlNetEditorOptions(depth_model="Intel/dpt-hybrid-midas")
    with pytest.raises(ValueError, match="condition 'sobel' is unknown"):
        ControlNetEditorOptions(condition="sobel")
    with pytest.raises(ValueError, match="must not exceed"):
        ControlNetEditorOptions(canny_low_threshold=250, canny_high_threshold=200)
    with pytest.raises(ValueError, match="conditioning_scales has duplicates"):
        ControlNetEditorOptions(conditioning_scales=[1.0, 1.0])
    with pytest.raises(ValueError, match="option images_per_edit = 0: expected an integer >= 1"):
        ControlNetEditorOptions(images_per_edit=0)
    with pytest.raises(ValueError, match="controlnet directory not found"):
        ControlNetEditorOptions(controlnet=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="known options: .*conditioning_scales"):
        ControlNetEditStage(conditioning_scale=0.5)
    assert ControlNetEditorOptions(conditioning_scales=0.5).conditioning_scales == (0.5,)


def test_candidate_seeds_depend_on_sample_seed_and_image_index_only():
    assert candidate_seed(7, 0) == candidate_seed(7, 0)
    assert len({candidate_seed(7, 0), candidate_seed(7, 1), candidate_seed(8, 0)}) == 3


# -- the stage on tiny components ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_controlnet_dir(tmp_path_factory):
    from lance_pipeline.tiny.controlnet_components import create_tiny_controlnet

    return create_tiny_controlnet(tmp_path_factory.mktemp("tiny-controlnet"))


@pytest.fixture(scope="module")
def tiny_clip_dir(tmp_path_factory):
    from lance_pipeline.tiny.clip_components import create_tiny_open_clip

    return create_tiny_open_clip(tmp_path_factory.mktemp("tiny-clip"))


def _stage(tiny_sd_dir, tiny_controlnet_dir, tiny_clip_dir, **options) -> ControlNetEditStage:
    options = {
        "model": str(tiny_sd_dir),
        "controlnet": str(tiny_controlnet_dir),
        "image_size": 64,
        "clip_model": str(tiny_clip_dir),
        "clip_pretrained": None,
        **OPEN_GATES,
        **options,
    }
    stage = ControlNetEditStage(**options)
    stage.load("cpu")
    return stage


def _photo(seed: int = 0) -> Image.Image:
    """A deterministic image with structure (blocks), so its Canny map has edges."""
    rng = np.random.default_rng(seed)
    array = np.zeros((64, 64, 3), dtype=np.uint8)
    for _ in range(6):
        x, y = rng.integers(0, 48, size=2)
        array[y : y + 16, x : x + 16] = rng.integers(0, 256, size=3)
    return Image.fromarray(array)


EDITS = [
    {
        "edit_type": "subject",
        "edited_caption": "a photo of a woman with a dog",
        "original_span": "man",
        "edited_span": "woman",
        "kept": True,
        "scores": {"label_similarity": 0.1, "span_similarity": 0.3},
    },
    {
        "edit_type": "multi",
        "edited_caption": "a photo of a boy with a dog at night",
        "original_span": "man",
        "edited_span": "boy; at night",
        "kept": True,
        "llm_keywords": '{"man":"subject"}',
        "llm_alternatives": '{"man":["boy"]}',
        "llm_applied_alternatives": '{"man":"boy"}',
    },
    {"edit_type": "object", "edited_caption": "a photo of a man with a cat", "kept": False},
]


def _record(key: str = "k0", seed: int = 11, image_seed: int = 0) -> dict:
    return {
        "key": key,
        "image": _photo(image_seed),
        "label": 1,
        "label_name": "dog",
        "seed": seed,
        "caption": "a photo of a man with a dog",
        "edits": [dict(e) for e in EDITS],
    }


def _bytes(image: Image.Image) -> bytes:
    return np.asarray(image).tobytes()


@pytest.mark.slow
def test_stage_renders_every_variant_gates_and_records_candidates(
    tiny_sd_dir, tiny_controlnet_dir, tiny_clip_dir, single_thread_torch
):
    stage = _stage(
        tiny_sd_dir, tiny_controlnet_dir, tiny_clip_dir, images_per_edit=2, conditioning_scales=[1.0, 0.5], batch_size=3
    )
    result = stage.process([_record()])[0]
    candidates = result["edit_candidates"]
    # Two kept edits x two seeds x two conditioning scales; the unkept edit is not rendered.
    assert len(candidates) == 8 and {c["edit_index"] for c in candidates} == {0, 1}
    assert {(c["seed"], c["conditioning_scale"]) for c in candidates if c["edit_index"] == 0} == {
        (candidate_seed(11, i), s) for i in (0, 1) for s in (1.0, 0.5)
    }
    assert all(c["editor"] == "controlnet" and c["passed"] for c in candidates)
    assert sum(c["chosen"] for c in candidates) == 2
    samples = result["counterfactuals"]
    assert [s["edited_caption"] for s in samples] == [EDITS[0]["edited_caption"], EDITS[1]["edited_caption"]]
    for sample, edit_index in zip(samples, (0, 1), strict=True):
        chosen = next(c for c in candidates if c["chosen"] and c["edit_index"] == edit_index)
        best = max(c["scores"]["clip_directional"] for c in candidates if c["edit_index"] == edit_index)
        assert chosen["scores"]["clip_directional"] == best
        assert (sample["controlnet_seed"], sample["controlnet_scale"]) == (chosen["seed"], chosen["conditioning_scale"])
        assert sample["editor"] == "controlnet" and sample["condition"] == "canny" and sample["self_replace"] is None
        assert set(sample["scores"]) == set(SCORE_NAMES)
        assert sample["image"].size == (64, 64)
    assert samples[0]["llm_keywords"] is None  # a LANCE edit carries no LLM trace
    assert json.loads(samples[1]["llm_applied_alternatives"]) == {"man": "boy"}
    assert samples[1]["edit_type"] == "multi"
    # 8 candidates x 5 UniPC steps x 2 (classifier-free guidance): the UNet and the ControlNet see 80 samples.
    stage.editor.counts.__init__()
    bench = bench_edit(stage, _record())
    assert (bench.counts.unet_samples, bench.counts.controlnet_samples, bench.candidates) == (80, 80, 8)
    # Per scale 4 candidates in chunks of 3: 2 pipeline calls; 2 scales x 2 calls x 5 steps = 20 UNet calls.
    assert bench.counts.unet_calls == 20
    described = stage.describe()
    assert described["editor"] == "controlnet" and described["controlnet_editing"]["scheduler"]["class"] == (
        "UniPCMultistepScheduler"
    )
    assert described["controlnet_editing"]["num_inference_steps"] == 5


@pytest.mark.slow
def test_same_seed_same_bytes_and_the_condition_reaches_the_image(
    tiny_sd_dir, tiny_controlnet_dir, tiny_clip_dir, single_thread_torch
):
    stage = _stage(tiny_sd_dir, tiny_controlnet_dir, tiny_clip_dir)
    alone = stage.process([_record()])[0]["counterfactuals"]
    # In a batch with another record, and again: byte-identical (the seed is the sample's, not the batch's).
    batched = stage.process([_record("k1", seed=5, image_seed=3), _record()])
    again = batched[1]["counterfactuals"]
    assert [_bytes(s["image"]) for s in alone] == [_bytes(s["image"]) for s in again]
    other_seed = stage.process([_record(seed=12)])[0]["counterfactuals"]
    assert _bytes(other_seed[0]["image"]) != _bytes(alone[0]["image"])
    # Same seed and caption, another source structure: the (tiny, trained-looking) ControlNet changes the image.
    other_image = batched[0]["counterfactuals"]
    record = _record(image_seed=3)
    moved = stage.process([record])[0]["counterfactuals"]
    assert _bytes(moved[0]["image"]) != _bytes(alone[0]["image"])
    assert other_image  # the other record rendered too
    # Conditioning scale 0 switches the ControlNet off: the image no longer depends on the structure.
    off = _stage(tiny_sd_dir, tiny_controlnet_dir, tiny_clip_dir, conditioning_scales=[0.0])
    first = off.process([_record()])[0]["counterfactuals"][0]["image"]
    second = off.process([_record(image_seed=3)])[0]["counterfactuals"][0]["image"]
    assert _bytes(first) == _bytes(second)


@pytest.mark.slow
def test_closed_gates_reject_with_reasons_and_keep_per_edit_ranks(
    tiny_sd_dir, tiny_controlnet_dir, tiny_clip_dir, single_thread_torch
):
    closed = _stage(tiny_sd_dir, tiny_controlnet_dir, tiny_clip_dir, clip_image_threshold=1.0)
    result = closed.process([_record()])[0]
    assert result["counterfactuals"] == []
    assert all(
        not c["passed"] and "original/edited image similarity too low" in c["reject_reason"]
        for c in result["edit_candidates"]
    )
    several = _stage(tiny_sd_dir, tiny_controlnet_dir, tiny_clip_dir, images_per_edit=3, keep_per_edit=2)
    result = several.process([_record()])[0]
    samples, candidates = result["counterfactuals"], result["edit_candidates"]
    assert len(samples) == 4
    for edit_index in (0, 1):
        rows = [c for c in candidates if c["edit_index"] == edit_index]
        ranked = sorted(rows, key=lambda c: -c["scores"]["clip_directional"])
        assert [c["chosen"] for c in ranked] == [True, True, False]
        assert ranked[2]["reject_reason"].startswith("not selected")
    assert samples[0]["scores"]["clip_directional"] >= samples[1]["scores"]["clip_directional"]


@pytest.mark.slow
def test_records_that_cannot_be_edited(tiny_sd_dir, tiny_controlnet_dir, tiny_clip_dir, single_thread_torch):
    stage = _stage(tiny_sd_dir, tiny_controlnet_dir, tiny_clip_dir)
    no_caption = {**_record(), "caption": ""}
    long_edit = {**_record(), "edits": [{**EDITS[0], "edited_caption": "a photo of " + "a very red dog " * 30}]}
    results = stage.process([no_caption, long_edit])
    assert isinstance(results[0], SampleFailure) and "no caption" in results[0].reason
    assert results[1]["counterfactuals"] == []
    assert "more than the text encoder's 77" in results[1]["edit_candidates"][0]["reject_reason"]
    with pytest.raises(ValueError, match="has no edited_caption"):
        stage.process([{**_record(), "edits": [{"kept": True, "edited_caption": " "}]}])
    # DILLEMA's behaviour: the pipeline cuts the prompt at 77 tokens and renders it; same image as the cut caption
    truncating = _stage(tiny_sd_dir, tiny_controlnet_dir, tiny_clip_dir, long_captions="truncate")
    (result,) = truncating.process([long_edit])
    (sample,) = result["counterfactuals"]
    tokenizer = truncating.editor.components.tokenizer
    ids = tokenizer(long_edit["edits"][0]["edited_caption"]).input_ids
    assert len(ids) > 77
    cut = tokenizer.decode(ids[1:76])  # what the pipeline keeps: BOS, 75 tokens, EOS
    (same,) = truncating.process([{**_record(), "edits": [{**EDITS[0], "edited_caption": cut}]}])
    assert _bytes(sample["image"]) == _bytes(same["counterfactuals"][0]["image"])
    assert truncating.describe()["long_captions"] == "truncate" and stage.describe()["long_captions"] == "refuse"
    with pytest.raises(ValueError, match="long_captions = 'drop'"):
        _stage(tiny_sd_dir, tiny_controlnet_dir, tiny_clip_dir, long_captions="drop")


# -- depth condition ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_depth_dir(tmp_path_factory):
    from lance_pipeline.tiny.controlnet_components import create_tiny_depth_estimator

    return create_tiny_depth_estimator(tmp_path_factory.mktemp("tiny-depth"))


def test_depth_condition_is_the_depth_estimation_pipelines_map(tiny_depth_dir, single_thread_torch):
    from transformers import pipeline

    from lance_pipeline.dillema.controlnet_editing import depth_condition, load_depth_estimator

    image = _photo(2)
    condition = np.asarray(depth_condition(image, *load_depth_estimator(str(tiny_depth_dir), None, "cpu")))
    expected = np.asarray(pipeline("depth-estimation", model=str(tiny_depth_dir), device="cpu")(image)["depth"])
    assert condition.shape == (64, 64, 3) and expected.shape == (64, 64)
    assert np.array_equal(condition[..., 0], expected) and np.array_equal(condition[..., 2], expected)
    assert condition.min() == 0 and condition.max() == 255


@pytest.mark.slow
def test_stage_with_a_depth_condition(
    tiny_sd_dir, tiny_controlnet_dir, tiny_clip_dir, tiny_depth_dir, single_thread_torch
):
    stage = _stage(tiny_sd_dir, tiny_controlnet_dir, tiny_clip_dir, condition="depth", depth_model=str(tiny_depth_dir))
    first = stage.process([_record()])[0]["counterfactuals"]
    again = stage.process([_record()])[0]["counterfactuals"]
    assert first and first[0]["condition"] == "depth"
    assert [_bytes(s["image"]) for s in first] == [_bytes(s["image"]) for s in again]
    described = stage.describe()["controlnet_editing"]["condition"]
    assert described["name"] == "depth" and described["depth_model"] == tiny_depth_dir.name
    canny = _stage(tiny_sd_dir, tiny_controlnet_dir, tiny_clip_dir).process([_record()])[0]["counterfactuals"]
    assert _bytes(canny[0]["image"]) != _bytes(first[0]["image"])  # another condition, another image


# -- benchmarks/bench_edit.py's ControlNet row --------------------------------------------------------------------------


@pytest.mark.slow
def test_bench_edit_counts_the_controlnet_editor_with_the_presets_settings(tiny_sd, single_thread_torch):
    """The row bench_edit prints beside prompt-to-prompt: the hardimagenet-controlnet preset's settings, the UNet counted
    by the same hook as the other rows, every edit rendered images_per_edit times, nothing per image."""
    import importlib.util
    from pathlib import Path

    import yaml

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_edit.py"
    spec = importlib.util.spec_from_file_location("bench_edit", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    preset = yaml.safe_load(
        (Path(bench.__file__).parents[1] / "builder/presets/hardimagenet-controlnet.yaml").read_text()
    )
    preset_options = next(s for s in preset["stages"] if s["type"] == "controlnet_edit")["options"]
    options = bench.controlnet_options(image_size=32)
    assert options.images_per_edit == preset_options["images_per_edit"] == 5 and options.num_inference_steps == 5
    images, captions, edits = bench.workload(n_images=2, n_edits=2, image_size=32)
    result = bench.run_controlnet(tiny_sd, bench.build_controlnet(tiny_sd), options, images, captions, edits, "cpu")
    # 2 images x 2 edits x 5 images per edit x 5 UniPC steps x 2 (classifier-free guidance), the ControlNet likewise.
    assert result["inversion_count"].forward_equivalents == 0
    assert (result["edit_count"].forwards, result["edit_count"].backwards, result["controlnet_forwards"]) == (
        200,
        0,
        200,
    )
    assert len(result["images"]) == 2 * 2 * 5 and result["other_editor"]
