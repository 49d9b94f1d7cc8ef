"""Generation under named shifts (dataset interfaces) on the tiny Stable Diffusion and tiny CLIP: real classes."""

from __future__ import annotations

import io

import pytest
import torch
from builder_helpers import photo

from lance_pipeline.interfaces.generation import GenerationOptions, ShiftGenerator, clip_presence_scores
from lance_pipeline.interfaces.shifts import IMAGENET_STAR_SHIFTS, Shift, shifts_by_name
from lance_pipeline.interfaces.textual_inversion import TextualInversionOptions, TextualInversionTrainer, save_token

pytestmark = pytest.mark.usefixtures("single_thread_torch")


@pytest.fixture(scope="module")
def token_dir(tiny_sd_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokens")
    trainer = TextualInversionTrainer(
        TextualInversionOptions(model=str(tiny_sd_dir), revision=None, steps=3, resolution=32)
    )
    for label, name in ((0, "tench"), (1, "goldfish")):
        learned = trainer.learn([photo(label)], name, f"<{name}-{label}>")
        save_token(directory / f"{label}.safetensors", learned)
    return directory


@pytest.fixture(scope="module")
def generator(tiny_sd_dir, token_dir):
    options = GenerationOptions(
        model=str(tiny_sd_dir), revision=None, tokens=str(token_dir), num_inference_steps=3, generation_size=32,
        image_size=24,
    )  # fmt: skip
    gen = ShiftGenerator(options)
    gen.load()
    return gen


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.slow
def test_tokens_are_loaded_and_replace_the_placeholder(generator):
    assert generator.tokens == {0: "<tench-0>", 1: "<goldfish-1>"}
    snow = next(s for s in IMAGENET_STAR_SHIFTS if s.name == "in_the_snow")
    assert snow.render(generator.class_word(1, "goldfish")) == "A photo of a <goldfish-1> in the snow"
    ids = generator.pipe.tokenizer("<goldfish-1>", add_special_tokens=False).input_ids
    assert ids == [generator.pipe.tokenizer.convert_tokens_to_ids("<goldfish-1>")]  # one token, not word pieces


@pytest.mark.slow
def test_generation_is_seeded_per_image(generator):
    prompts = ["a photo of a <tench-0>", "a photo of a <goldfish-1> in the snow"]
    first = [_png(im) for im in generator.generate(prompts, [11, 12])]
    again = [_png(im) for im in generator.generate(prompts, [11, 12])]
    other = [_png(im) for im in generator.generate(prompts, [11, 13])]
    assert first == again
    assert other[0] == first[0] and other[1] != first[1]  # one image's seed does not move its neighbour
    assert generator.generate(prompts[:1], [11])[0].size == (24, 24)


def test_plain_prompt_needs_no_tokens_and_options_are_checked(tiny_sd_dir):
    gen = ShiftGenerator(GenerationOptions(model=str(tiny_sd_dir), revision=None, plain_prompt=True))
    assert gen.class_word(3, "tiger shark") == "tiger shark"
    with pytest.raises(ValueError, match="tokens"):
        GenerationOptions(model=str(tiny_sd_dir))
    with pytest.raises(ValueError, match="scheduler"):
        GenerationOptions(plain_prompt=True, scheduler="pndm2")


def test_clip_presence_scores_equal_independent_cosines(tmp_path):
    import open_clip

    from lance_pipeline.clip.gates import ClipScorer
    from lance_pipeline.tiny.clip_components import create_tiny_open_clip

    clip_dir = str(create_tiny_open_clip(tmp_path / "clip"))
    scorer = ClipScorer(model=clip_dir, pretrained=None)
    scorer.load("cpu")
    images = [photo(1), photo(2)]
    objects, shifts = clip_presence_scores(
        scorer, images, ["a photo of a tench", "a goldfish"], [None, "a photo in the snow"]
    )
    assert shifts[0] is None
    # recomputed independently with open_clip's own calls
    model, preprocess = open_clip.create_model_from_pretrained("local-dir:" + clip_dir)
    tokenizer = open_clip.get_tokenizer("local-dir:" + clip_dir)
    model.eval()
    with torch.no_grad():
        img = model.encode_image(torch.stack([preprocess(i) for i in images]))
        txt = model.encode_text(tokenizer(["a photo of a tench", "a goldfish", "a photo in the snow"]))
    img = img / img.norm(dim=-1, keepdim=True)
    txt = txt / txt.norm(dim=-1, keepdim=True)
    assert objects == pytest.approx([float(img[0] @ txt[0]), float(img[1] @ txt[1])], abs=1e-5)
    assert shifts[1] == pytest.approx(float(img[1] @ txt[2]), abs=1e-5)


def test_user_shifts_join_the_named_ones():
    chosen = shifts_by_name(
        ["base", "in_the_snow"],
        [
            {
                "name": "on_mars",
                "prompt": "a photo of a <TOKEN> on mars",
                "shift_caption": "a photo on mars",
                "threshold": 0.2,
            }
        ],
    )
    assert [s.name for s in chosen] == ["base", "in_the_snow", "on_mars"]
    assert chosen[2].provenance == "yours"
    with pytest.raises(ValueError, match="<TOKEN>"):
        Shift("x", "a photo of a dog", None)
    with pytest.raises(ValueError, match="listed twice"):
        shifts_by_name(["base"], [{"name": "base", "prompt": "<TOKEN>"}])


def test_shift_verdict_rules():
    from lance_pipeline.interfaces.generation import shift_verdict

    assert shift_verdict(0.3, 0.2, 0.25, 0.16)["passed"]
    assert not shift_verdict(0.3, 0.15, 0.25, 0.16)["passed"]  # the shift is not there
    assert not shift_verdict(0.2, 0.5, 0.25, 0.16)["passed"]  # the object is not there
    assert shift_verdict(0.2, None, None, None)["passed"]  # base: no shift caption, unknown thresholds
    v = shift_verdict(0.5, 0.1, None, None)
    assert v["passed"] and v["object_threshold"] is None and v["shift_threshold"] is None


@pytest.mark.slow
def test_generation_and_filter_stages_on_tiny_models(tiny_sd_dir, token_dir, tmp_path):
    from lance_pipeline.interfaces.generation import ShiftFilterStage, ShiftGenerationStage, clip_presence_scores
    from lance_pipeline.tiny.clip_components import create_tiny_open_clip

    gen = ShiftGenerationStage(model=str(tiny_sd_dir), revision=None, tokens=str(token_dir), num_inference_steps=2,
                               generation_size=32, image_size=24, batch_size=2)  # fmt: skip
    gen.load("cpu")
    records = [
        {"key": "a", "label": 0, "label_name": "tench", "seed": 5, "prompt_template": "a photo of a <TOKEN> in the snow",
         "shift": "in_the_snow", "object_caption": "a photo of a tench", "shift_caption": "a photo in the snow"},
        {"key": "b", "label": 1, "label_name": "goldfish", "seed": 6, "prompt_template": "a photo of a <TOKEN>",
         "shift": "base", "object_caption": "a photo of a goldfish", "shift_caption": None},
        {"key": "c", "label": 7, "label_name": "cock", "seed": 7, "prompt_template": "a photo of a <TOKEN>",
         "shift": "base", "object_caption": "a photo of a cock", "shift_caption": None},
    ]  # fmt: skip
    out = gen.process(records)
    assert out[0]["prompt"] == "a photo of a <tench-0> in the snow" and out[0]["token"] == "<tench-0>"
    assert out[2].reason.startswith("no learned token for class 7")
    for record, update in zip(records[:2], out[:2], strict=True):
        record.update(update)
    clip_dir = str(create_tiny_open_clip(tmp_path / "clip"))
    live = records[:2]
    objects, shifts = None, None
    filt = ShiftFilterStage(clip_model=clip_dir, clip_pretrained=None, object_filter=False, keep_rejected=True)
    filt.load("cpu")
    objects, shifts = clip_presence_scores(filt.scorer, [r["generated"] for r in live],
                                           [r["object_caption"] for r in live], [r["shift_caption"] for r in live])  # fmt: skip
    # a threshold just above this image's shift score must reject it; one just below must keep it
    live[0]["shift_threshold"] = shifts[0] + 1e-4
    live[1]["shift_threshold"] = None
    verdicts = filt.process(live)
    assert verdicts[0]["release_config"] == "rejected" and not verdicts[0]["passed"]
    assert verdicts[1]["release_config"] == "base" and verdicts[1]["shift_score"] is None
    assert verdicts[0]["object_score"] == pytest.approx(objects[0], abs=1e-6)
    live[0]["shift_threshold"] = shifts[0] - 1e-4
    assert filt.process(live)[0]["release_config"] == "in_the_snow"
