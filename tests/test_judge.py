"""The judge stage (lance_pipeline/screening/judge.py): its declared fields and the manifest record the card reads."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from builder import release_format as rf
from builder.registry import STAGES
from lance_pipeline.screening.judge import (
    CLASS_QUESTION,
    DEFAULT_JUDGE,
    DEFAULT_JUDGE_REVISION,
    EDIT_QUESTION,
    JUDGE_FIELDS,
    JudgeStage,
    LanceRJudgeStage,
)

JUDGE_TYPES = ("judge", "judge_lance_r", "judge_strength", "judge_generated", "judge_discovery")


def test_the_judge_fields_are_declared_fractions_that_are_null_when_not_judged():
    specs = {f.name: rf.FieldSpec(f.name, f.dtype, description=f.description, minimum=f.minimum, maximum=f.maximum)
             for f in JUDGE_FIELDS}  # fmt: skip
    assert list(specs) == ["judge_class_p", "judge_edit_p"]
    assert list(specs) == [rf.JUDGE_CLASS_FIELD, rf.JUDGE_EDIT_FIELD]  # the names review, cards and eval read
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


def test_filter_below_must_be_a_fraction_and_max_pixels_at_least_qwens_minimum():
    with pytest.raises(ValueError, match="filter_below"):
        JudgeStage(filter_below=1.5)
    with pytest.raises(ValueError, match="max_pixels"):
        JudgeStage(max_pixels=1000)  # below 56 x 56, Qwen2.5-VL's processor minimum


# -- the tiny model of the judge's architecture, through the loading code of the pinned id -----------------------------
@pytest.fixture(scope="module")
def tiny_judge(tmp_path_factory):
    from lance_pipeline.tiny.judge_components import create_tiny_judge

    return create_tiny_judge(tmp_path_factory.mktemp("judge") / "tiny-judge")


def test_the_tiny_judge_loads_through_the_stage_and_its_p_yes_is_the_models_own(tiny_judge, single_thread_torch):
    """P(yes) of the stage (batched, left-padded) equals an independent computation: each prompt alone through
    transformers' own classes, softmax over the vocabulary at the last position, the yes token's entry."""
    import torch
    from PIL import Image
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    stage = JudgeStage(model=str(tiny_judge), batch_size=3)
    stage.load("cpu")
    images = [Image.new("RGB", (40 + 8 * i, 32), (30 * i, 200 - 20 * i, 90)) for i in range(4)]
    questions = [CLASS_QUESTION.format(label=w) for w in ("dog", "cat", "sled dog", "monkey")]
    ours = stage.judge.p_yes(images, questions, batch_size=3)

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tiny_judge)).eval()
    size = {"shortest_edge": 56 * 56, "longest_edge": stage.options.max_pixels}
    processor = AutoProcessor.from_pretrained(str(tiny_judge))
    yes = processor.tokenizer.convert_tokens_to_ids("Yes")
    for image, question, p in zip(images, questions, ours, strict=True):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        with torch.inference_mode():
            logits = model(**processor(text=[text], images=[image], size=size, return_tensors="pt")).logits[0, -1]
        assert p == pytest.approx(torch.softmax(logits.float(), -1)[yes].item(), abs=2e-6)
        assert 0.0 <= p <= 1.0
    assert stage.describe()["answer_tokens"]["yes_id"] == yes
    assert stage.describe()["revision"] is None  # a local directory: no revision recorded
    # One load per process: a second judge stage with the same model gets the same object.
    other = LanceRJudgeStage(model=str(tiny_judge))
    other.load("cpu")
    assert other.judge is stage.judge


def test_max_pixels_holds_for_a_repository_laid_out_as_the_hubs(tiny_judge, tmp_path, single_thread_torch):
    """Qwen's repository has a preprocessor_config.json with its own min_pixels / max_pixels (12.8 MP), which
    transformers prefers to a size given at loading: the stage's budget is given with every call, so a 512 px image
    becomes 32 x 32 patches (448 x 448) from either layout."""
    import json
    import shutil

    hub = tmp_path / "hub-layout"
    shutil.copytree(tiny_judge, hub)
    saved = json.loads((hub / "processor_config.json").read_text())["image_processor"]
    (hub / "processor_config.json").unlink()
    (hub / "preprocessor_config.json").write_text(json.dumps({
        **{k: saved[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")},
        "min_pixels": 3136, "max_pixels": 12845056, "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
    }))  # fmt: skip
    (hub / "chat_template.json").write_text(json.dumps({"chat_template": (hub / "chat_template.jinja").read_text()}))
    (hub / "chat_template.jinja").unlink()
    for directory in (tiny_judge, hub):
        stage = JudgeStage(model=str(directory))
        stage.load("cpu")
        inputs = stage.judge.inputs([Image.new("RGB", (512, 512))], [CLASS_QUESTION.format(label="cat")])
        assert inputs["image_grid_thw"].tolist() == [[1, 32, 32]], directory


# -- a deterministic stand-in judge for behaviour (builds through the engine) -------------------------------------------
class StandInJudge:
    """Deterministic stand-in for the VLM (not a model): P(yes) is 0.9 for a question naming 'cat' and 0.2 otherwise,
    plus the image's mean red / 10000 (so every image gets its own score). Records what it was asked."""

    yes_id, no_id = 1, 2

    def __init__(self):
        self.asked: list[str] = []

    def p_yes(self, images, questions, batch_size):
        import numpy as np

        self.asked += questions
        return [
            round((0.9 if "cat" in q else 0.2) + float(np.asarray(im)[..., 0].mean()) / 10000, 6)
            for im, q in zip(images, questions, strict=True)
        ]


def _build(tmp_path, name, judge_stages, monkeypatch, judge=None, model=None):
    from builder_helpers import make_imagefolder, write_config

    from builder.config import load_config
    from builder.engine import build

    monkeypatch.setenv("LANCE_CF_ALLOW_CODE", "1")
    if judge is not None:
        monkeypatch.setattr("lance_pipeline.screening.judge.load_judge", lambda options, device: judge)
    folder = tmp_path / "src"
    if not folder.exists():
        make_imagefolder(folder, ["cat", "dog"], per_class=2)
    configs = ["original", "reconstructed", "counterfactual", "lance_r"]
    judge_stages = [{**s, "options": {**s.get("options", {}), "model": str(model)}} for s in judge_stages]
    stages = [{"name": "edit", "type": "tests.test_screening:PeopleEditStage", "configs": configs[1:]}, *judge_stages]
    path = write_config(tmp_path / f"{name}.yaml", f"imagefolder:{folder}", stages=stages, configs=configs,
                        safety="off")  # fmt: skip
    return build(load_config(str(path)), tmp_path / name, progress=False)


def _samples(release, config):
    import tarfile

    out = {}
    for shard in sorted((release / "data" / config).glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                key, ext = member.name.split(".", 1)
                out.setdefault(key, {})[ext] = tar.extractfile(member).read()
    return out


JUDGE_ALL = [
    {"name": "judge", "type": "judge", "configs": ["counterfactual"]},
    {"name": "judge_lance_r", "type": "judge_lance_r", "configs": ["lance_r"]},
]


@pytest.mark.slow
def test_the_judge_scores_every_edit_and_changes_nothing_else_of_a_sample(tmp_path, monkeypatch, tiny_judge):
    import json

    from builder.release_format import verify_release

    plain = _build(tmp_path, "plain", [], monkeypatch)
    judge = StandInJudge()
    judged = _build(tmp_path, "judged", JUDGE_ALL, monkeypatch, judge=judge, model=tiny_judge)
    assert verify_release(tmp_path / "judged") == []
    # Every edited image was asked both questions (class, then the edit's caption); the class is the sample's.
    assert len(judge.asked) == 2 * (4 * 2 + 4 * 1)
    assert {q for q in judge.asked if "holding" not in q} == {CLASS_QUESTION.format(label=c) for c in ("cat", "dog")}
    for config in ("original", "reconstructed"):  # not judged: byte-identical shards
        assert [s["sha256"] for s in judged["shards"] if s["config"] == config] == [
            s["sha256"] for s in plain["shards"] if s["config"] == config
        ]
    for config in ("counterfactual", "lance_r"):
        before, after = _samples(tmp_path / "plain", config), _samples(tmp_path / "judged", config)
        assert list(before) == list(after) and len(after) == {"counterfactual": 8, "lance_r": 4}[config]
        for key, sample in after.items():
            assert sample["png"] == before[key]["png"] and sample["cls"] == before[key]["cls"]
            meta = json.loads(sample["json"])
            class_p, edit_p = meta.pop("judge_class_p"), meta.pop("judge_edit_p")
            assert meta == json.loads(before[key]["json"])  # every other field as without the judge, in order
            red = float(np.asarray(Image.open(io.BytesIO(sample["png"])))[..., 0].mean()) / 10000
            assert class_p == pytest.approx((0.9 if meta["label_name"] == "cat" else 0.2) + red, abs=1e-6)
            cat_caption = "cat" in meta["edited_caption"]  # the edit question names the class in the caption
            assert edit_p == pytest.approx((0.9 if cat_caption else 0.2) + red, abs=1e-6)
    assert judged["stages"]["judge"]["class_question"] == CLASS_QUESTION
    assert judged["screening"]["judge"] | {"fields": None} == {
        "fields": None, "kind": "judge", "checked": 8, "questions": 16, "removed_by_config": {},
        "removed": {"counterfactuals": 0},
    }  # fmt: skip
    fields = [f["name"] for f in judged["release_spec"]["configs"]["counterfactual"]["fields"]]
    assert fields == ["judge_class_p", "judge_edit_p"]
    assert judged["failures"] == []
    card = (tmp_path / "judged" / "README.md").read_text()
    assert "**Judge.**" in card and "scored 12 edited or generated images" in card and "removed nothing" in card
    assert "**Judge.**" not in (tmp_path / "plain" / "README.md").read_text()


def test_filter_below_removes_what_the_judge_doubts_and_the_manifest_counts_it_per_config(
    tmp_path, monkeypatch, tiny_judge
):
    from builder.release_format import verify_release

    stages = [{**s, "options": {"filter_below": 0.5}} for s in JUDGE_ALL]
    manifest = _build(tmp_path, "filtered", stages, monkeypatch, judge=StandInJudge(), model=tiny_judge)
    assert verify_release(tmp_path / "filtered") == []
    # the dog images score 0.2 + red/10000 < 0.5: removed; the cat images 0.9 + ...: kept
    assert manifest["counts"]["counterfactual"]["total"] == 4 and manifest["counts"]["lance_r"]["total"] == 2
    assert manifest["screening"]["judge"]["removed_by_config"] == {"counterfactual": 4}
    assert manifest["screening"]["judge_lance_r"]["removed_by_config"] == {"lance_r": 2}
    reasons = [f for f in manifest["failures"] if f["stage"] in ("judge", "judge_lance_r")]
    assert len(reasons) == 6 and all("judged not to show its class" in f["reason"] for f in reasons)
    assert {f["source_key"].split("_")[0] for f in reasons} == {"dog"}
    kept = _samples(tmp_path / "filtered", "counterfactual")
    assert sorted(k.rsplit("_", 1)[1] for k in kept) == [
        "cf000",
        "cf000",
        "cf001",
        "cf001",
    ]  # keys kept, not renumbered
    card = (tmp_path / "filtered" / "README.md").read_text()
    assert "below 0.5 were removed (`counterfactual`: 4, `lance_r`: 2)" in card


def test_the_strength_candidates_follow_their_counterfactual_and_never_contradict_it():
    """The selected candidate is the counterfactual's image: it takes the counterfactual's scores (not asked again),
    and with filter_below an edit whose counterfactual was removed loses every candidate (they would link to a sample
    that is not released)."""
    from lance_pipeline.editing.strength import STRENGTH_FIELD
    from lance_pipeline.screening.judge import StrengthJudgeStage

    image = Image.new("RGB", (8, 8), (100, 0, 0))  # red mean 100: the stand-in adds 0.01
    stage = StrengthJudgeStage(filter_below=0.5)
    stage.judge = judge = StandInJudge()
    cf = {"image": image, "edited_caption": "a dog in the snow"}
    record = {
        "key": "dog_1",
        "label_name": "cat",  # the stand-in says 0.91 to the class question
        # the judge stage before kept cf000 (scored 0.3: say a batch decided it) and removed cf001
        "counterfactuals": [{**cf, "sample_index": 0, "judge_class_p": 0.3, "judge_edit_p": 0.25}],
        STRENGTH_FIELD: [
            {**cf, "selected": True, "counterfactual_key": "dog_1_cf000", "sample_index": 0},
            {**cf, "selected": False, "counterfactual_key": "dog_1_cf000", "sample_index": 1},
            {**cf, "selected": True, "counterfactual_key": "dog_1_cf001", "sample_index": 2},
            {**cf, "selected": False, "counterfactual_key": "dog_1_cf001", "sample_index": 3},
        ],
    }
    (update,) = stage.process([record])
    # asked (class + edit each): the unselected candidates and cf001's selected one (its counterfactual has no
    # scores); cf000's selected candidate is not asked again
    assert len(judge.asked) == 2 * 3 == update[f"{STRENGTH_FIELD}_judge_questions"]
    # cf000's selected candidate takes 0.3 < 0.5 from its counterfactual: removed with its whole edit; cf001 was not
    # released: its edit goes too, although the stand-in would say 0.91 to its candidates
    assert update[STRENGTH_FIELD] == []
    removed = sorted((r["index"], r["reason"].split(":")[0]) for r in update[f"{STRENGTH_FIELD}_judge_removed"])
    assert [i for i, _ in removed] == [0, 1, 2, 3]
    # without a filter nothing goes, and the selected candidate carries exactly the counterfactual's scores
    stage = StrengthJudgeStage()
    stage.judge = StandInJudge()
    (update,) = stage.process([record])
    kept = {item["sample_index"]: item for item in update[STRENGTH_FIELD]}
    assert (kept[0]["judge_class_p"], kept[0]["judge_edit_p"]) == (0.3, 0.25)
    assert kept[1]["judge_class_p"] == pytest.approx(0.91) and kept[3]["judge_class_p"] == pytest.approx(0.91)


@pytest.mark.parametrize("stage_type", ["judge_generated", "judge_discovery"])
def test_a_generated_image_gets_the_class_question_only_and_a_removed_one_is_routed_nowhere(stage_type):
    cls = STAGES.resolve(stage_type)
    route = "release_config" if stage_type == "judge_generated" else "discovery_config"
    image = Image.new("RGB", (8, 8), (0, 0, 0))
    records = [
        {cls.field: image, route: "in_the_snow", "prompt": "a cat in the snow", "label_name": "cat"},
        {cls.field: image, route: "in_the_snow", "prompt": "a dog in the snow", "label_name": "dog"},
        {cls.field: None, route: None, "prompt": "a dog in the fog", "label_name": "dog"},  # nothing generated
    ]
    stage = cls(filter_below=0.5)
    stage.judge = judge = StandInJudge()
    kept, removed, empty = stage.process(records)
    assert judge.asked == [CLASS_QUESTION.format(label="cat"), CLASS_QUESTION.format(label="dog")]
    assert (kept["judge_class_p"], kept["judge_edit_p"], kept[route]) == (0.9, None, "in_the_snow")
    assert kept[cls.field] is image and kept[stage.removed_field] == []
    assert removed[cls.field] is None and removed[route] is None  # routed to no config: counted as not released
    assert removed["judge_class_p"] == 0.2 and removed[stage.removed_field][0]["config"] == "in_the_snow"
    assert "judged not to show its class" in removed[stage.removed_field][0]["reason"]
    assert empty == {
        cls.field: None, route: None, stage.removed_field: [], "judge_class_p": None, "judge_edit_p": None,
        stage.questions_field: 0,
    }  # fmt: skip
    assert (kept[stage.questions_field], removed[stage.questions_field]) == (1, 1)
    summary = cls.summarize([kept, removed, empty])
    assert summary == {"kind": "judge", "checked": 2, "questions": 2, "removed_by_config": {"in_the_snow": 1}}


@pytest.mark.slow  # one more build of the demo's stages (18 to 20 s on the 2-core machine); the plain one is shared
def test_the_demo_with_the_tiny_judge_changes_no_image_and_no_other_field_of_any_config(local_demo, tmp_path):
    """The demo's real tiny stages plus every LANCE judge stage on the tiny Qwen2.5-VL, against the same build without
    them: unjudged configs byte-identical shards; judged ones the same images, labels and other fields; the strength
    config's selected candidates carry exactly their counterfactual's scores."""
    import dataclasses
    import json

    from builder_helpers import demo_config

    from builder.config import StageConfig
    from builder.engine import build
    from builder.release_format import verify_release

    config = demo_config()
    tiny = {"model": "demo:tiny-judge", "revision": None}
    judges = [StageConfig(t, t, [c], dict(tiny)) for t, c in
              (("judge", "counterfactual"), ("judge_lance_r", "lance_r"), ("judge_strength", "strength"))]  # fmt: skip
    manifest = build(dataclasses.replace(config, stages=[*config.stages, *judges]), tmp_path / "r", progress=False)
    assert verify_release(tmp_path / "r") == []
    plain = json.loads((local_demo / "manifest.json").read_text())
    assert manifest["configs"] == plain["configs"]
    for config_name in plain["configs"]:
        before, after = _samples(local_demo, config_name), _samples(tmp_path / "r", config_name)
        assert list(after) == list(before)
        judged = config_name in ("counterfactual", "lance_r", "strength")
        for key, sample in after.items():
            assert sample["png"] == before[key]["png"] and sample["cls"] == before[key]["cls"]
            meta = json.loads(sample["json"])
            scores = [meta.pop(name, None) for name in ("judge_class_p", "judge_edit_p")]
            assert meta == json.loads(before[key]["json"])
            assert all(0.0 <= p <= 1.0 for p in scores) if judged else scores == [None, None]
        if not judged:
            assert [s["sha256"] for s in manifest["shards"] if s["config"] == config_name] == [
                s["sha256"] for s in plain["shards"] if s["config"] == config_name
            ]
    counterfactuals = {k: json.loads(s["json"]) for k, s in _samples(tmp_path / "r", "counterfactual").items()}
    selected = [m for m in map(json.loads, (s["json"] for s in _samples(tmp_path / "r", "strength").values()))
                if m["selected"]]  # fmt: skip
    assert selected and all(
        (m["judge_class_p"], m["judge_edit_p"])
        == (
            counterfactuals[m["counterfactual_key"]]["judge_class_p"],
            counterfactuals[m["counterfactual_key"]]["judge_edit_p"],
        )
        for m in selected
    )


def test_a_filtering_judge_in_a_strength_build_needs_the_strength_judge_after_it():
    import dataclasses

    from builder.config import StageConfig, load_config
    from builder.validation import validate_build

    config = load_config("demo")
    tiny = {"model": "demo:tiny-judge", "revision": None}
    judge = StageConfig("judge", "judge", ["counterfactual"], {**tiny, "filter_below": 0.5})
    strength = StageConfig("judge_strength", "judge_strength", ["strength"], dict(tiny))
    with pytest.raises(ValueError, match="add a judge_strength stage") as error:
        validate_build(dataclasses.replace(config, stages=[*config.stages, judge]))
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="add a judge_strength stage"):  # before it is too early
        validate_build(dataclasses.replace(config, stages=[*config.stages, strength, judge]))
    validate_build(dataclasses.replace(config, stages=[*config.stages, judge, strength]))
    no_filter = StageConfig("judge", "judge", ["counterfactual"], dict(tiny))
    validate_build(dataclasses.replace(config, stages=[*config.stages, no_filter]))  # removes nothing: no link breaks


def test_the_demo_judged_preset_is_the_demo_plus_the_three_judge_stages():
    """demo-judged (the offline walk of the judge's calibration) cannot drift from demo: the same config and stages,
    plus the judge on every edited config on the tiny judge, removing nothing."""
    from builder.config import load_config

    demo, judged = load_config("demo").to_dict(), load_config("demo-judged").to_dict()
    extra = judged["stages"][len(demo["stages"]) :]
    assert judged["stages"][: len(demo["stages"])] == demo["stages"]
    assert [(s["type"], s["configs"]) for s in extra] == [
        ("judge", ["counterfactual"]), ("judge_lance_r", ["lance_r"]), ("judge_strength", ["strength"])
    ]  # fmt: skip
    assert all(s["options"] == {"model": "demo:tiny-judge", "revision": None} for s in extra)
    same = {k: v for k, v in judged.items() if k not in ("stages", "name", "description")}
    assert same == {k: v for k, v in demo.items() if k not in ("stages", "name", "description")}
