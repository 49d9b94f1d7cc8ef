"""Label-conditioned BLIP-2 captioner on a tiny random BLIP-2 loaded through the real from_pretrained path."""

from __future__ import annotations

import pytest
from PIL import Image

from lance_pipeline.stage import SampleFailure, Stage
from lance_pipeline.text.captioning import LabelConditionedCaptioner, caption_prompt, join_caption
from lance_pipeline.tiny.text_components import create_tiny_blip2

COLOURS = [(220, 30, 30), (30, 30, 220), (30, 200, 30), (240, 240, 240)]
LABELS = ["dog sled", "husky", "ice cream", "patio"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny_blip2(tmp_path_factory: pytest.TempPathFactory):
    return create_tiny_blip2(tmp_path_factory.mktemp("tiny") / "tiny-blip2")


@pytest.fixture(scope="module")
def images():
    return [Image.new("RGB", (48, 40), colour) for colour in COLOURS]


def _captioner(path, **options) -> LabelConditionedCaptioner:
    options = {"revision": None, "min_new_tokens": 3, "max_new_tokens": 12, **options}
    captioner = LabelConditionedCaptioner(model=str(path), **options)
    captioner.load("cpu")
    return captioner


def test_prompt_and_join() -> None:
    assert caption_prompt("dog sled") == "a photo of a dog sled"
    assert caption_prompt("ice  cream") == "a photo of an ice cream"
    assert caption_prompt("dog sled", label_conditioned=False) == "a photo of"
    assert join_caption("a photo of a dog", " , running\n fast ") == "a photo of a dog, running fast"
    assert join_caption("a photo of a dog", "") == "a photo of a dog"


def test_captions_are_label_conditioned_and_start_with_the_domain_phrase(tiny_blip2, images) -> None:
    captioner = _captioner(tiny_blip2)
    assert isinstance(captioner, Stage) and captioner.name == "caption"
    captions = captioner.caption(images, LABELS)
    for caption, label in zip(captions, LABELS, strict=True):
        assert caption.startswith(caption_prompt(label) + " ")
        assert "\n" not in caption
    unconditioned = _captioner(tiny_blip2, label_conditioned=False).caption(images[:1], LABELS[:1])
    assert unconditioned[0].startswith("a photo of ") and "sled" not in unconditioned[0]


def test_the_image_reaches_the_decoder(tiny_blip2, images) -> None:
    # Same prompt, different pixels: if pixel_values were ignored the captions would be equal.
    captions = _captioner(tiny_blip2).caption(images, ["dog"] * len(images))
    assert len(set(captions)) > 1


def test_generated_length_bounds(tiny_blip2, images) -> None:
    prompt = caption_prompt("dog")
    captioner = _captioner(tiny_blip2, min_new_tokens=4, max_new_tokens=4)
    for caption in captioner.caption(images, ["dog"] * len(images)):
        # The tiny tokenizer is word level: one generated token is at most one word.
        assert 1 <= len(caption[len(prompt) :].split()) <= 4


@pytest.mark.slow
def test_deterministic_and_independent_of_batch_neighbours(tiny_blip2, images) -> None:
    batched = _captioner(tiny_blip2, batch_size=4).caption(images, LABELS)
    again = _captioner(tiny_blip2, batch_size=4).caption(images, LABELS)
    single = _captioner(tiny_blip2, batch_size=1)
    assert batched == again
    assert [single.caption([im], [label])[0] for im, label in zip(images, LABELS, strict=True)] == batched
    # Reordered neighbours, including a different label (prompt length) per batch.
    assert single.caption(images[::-1], LABELS[::-1])[::-1] == batched


def test_process_and_describe(tiny_blip2, images) -> None:
    captioner = _captioner(tiny_blip2)
    records = [
        {"key": "a", "image": images[0], "label": 0, "label_name": "dog sled", "seed": 1},
        {"key": "b", "image": None, "label": 1, "label_name": "husky", "seed": 2},
    ]
    results = captioner.process(records)
    assert set(results[0]) == {"caption"} and results[0]["caption"].startswith("a photo of a dog sled")
    assert isinstance(results[1], SampleFailure) and "no image" in results[1].reason
    description = LabelConditionedCaptioner().describe()
    assert description["num_beams"] == 5
    assert (description["min_new_tokens"], description["max_new_tokens"]) == (20, 100)
    assert description["model"] == "Salesforce/blip2-opt-2.7b" and len(description["revision"]) == 40


def test_dillemas_two_sampled_captions_are_seeded_per_sample(tiny_blip2, images) -> None:
    """DILLEMA's form: two nucleus-sampled captions joined with ". ", each drawn from (sample seed, index) only."""
    options = {"num_captions": 2, "do_sample": True, "num_beams": 1, "label_conditioned": False}
    seeds = [11, 12, 13, 14]
    batched = _captioner(tiny_blip2, batch_size=4, **options).caption(images, LABELS, seeds)
    single = _captioner(tiny_blip2, batch_size=1, **options)
    assert [
        single.caption([im], [label], [seed])[0] for im, label, seed in zip(images, LABELS, seeds, strict=True)
    ] == (batched)
    for caption in batched:
        first, second = caption.split(". a photo of")
        assert first.startswith("a photo of") and first != "a photo of" + second  # two different draws
    assert single.caption([images[0]], [LABELS[0]], [99]) != [batched[0]]  # another seed, other captions
    description = single.describe()
    assert (description["num_captions"], description["caption_separator"], description["do_sample"]) == (2, ". ", True)
    assert (description["top_p"], description["temperature"]) == (0.9, 1.0)
    # Without sampling, the two best beams; the default form's description is what it always was.
    beams = _captioner(tiny_blip2, num_captions=2).caption(images[:1], LABELS[:1])[0]
    assert beams.count(". a photo of a ") == 1
    assert "num_captions" not in LabelConditionedCaptioner().describe()


def test_dillemas_captions_drop_the_prompt_as_lavis_decodes(tiny_blip2, images) -> None:
    """``keep_prompt: false`` (preset hardimagenet-dillema): each caption is the continuation alone, the same text
    the prompt-keeping captioner appends to "a photo of"; at most ``max_new_tokens`` words (word-level tokenizer)."""
    options = {"num_captions": 2, "do_sample": True, "num_beams": 1, "label_conditioned": False,
               "min_new_tokens": 0, "max_new_tokens": 5}  # fmt: skip
    seeds = [11, 12, 13, 14]
    kept = _captioner(tiny_blip2, **options).caption(images, LABELS, seeds)
    dropped_stage = _captioner(tiny_blip2, keep_prompt=False, **options)
    dropped = dropped_stage.caption(images, LABELS, seeds)
    for with_prompt, without in zip(kept, dropped, strict=True):
        halves = with_prompt.split(". a photo of")
        expected = [" ".join(h.removeprefix("a photo of").split()) for h in halves]
        assert without == ". ".join(expected)
        assert not without.startswith("a photo of")
        assert all(len(part.split()) <= 5 for part in expected)
    assert dropped_stage.describe()["keep_prompt"] is False
    assert "keep_prompt" not in LabelConditionedCaptioner().describe()  # the default form's description is unchanged


def test_the_dillema_preset_captions_with_lavis_defaults() -> None:
    from builder.config import load_config

    config = load_config("hardimagenet-dillema")
    (caption,) = [s for s in config.stages if s.type == "blip2_captioner"]
    options = caption.options
    assert (options["max_new_tokens"], options["min_new_tokens"], options["keep_prompt"]) == (30, 0, False)
    assert (options["num_captions"], options["do_sample"], options["top_p"]) == (2, True, 0.9)
    (edit,) = [s for s in config.stages if s.type == "controlnet_edit"]
    assert edit.options["long_captions"] == "truncate"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"do_sample": True}, "set num_beams: 1"),
        ({"num_captions": 6}, "must not exceed num_beams"),
        ({"num_captions": 0}, "num_captions"),
        ({"batch_size": 0}, "batch_size"),
        ({"num_beams": 0}, "num_beams"),
        ({"min_new_tokens": 30, "max_new_tokens": 10}, "min_new_tokens"),
        ({"dtype": "float8"}, "dtype"),
    ],
)
def test_bad_options(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        LabelConditionedCaptioner(**options)
