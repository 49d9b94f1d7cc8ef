"""The instruction editors (lance_pipeline/instruct): options, licences, instructions, the tiny pipelines loaded
through the editor's own loading code, counted cost, and the demo builds (byte-identical rebuild and resume, same
bytes on the devices engine and the stage-major schedule)."""

from __future__ import annotations

import json
import re
import shutil
import sqlite3

import numpy as np
import pytest
from PIL import Image

from lance_pipeline.edit_types import EDIT_TYPE_TABLE, MULTI_EDIT_INSTRUCTION, editor_instruction
from lance_pipeline.editing.stages import bench_edit
from lance_pipeline.instruct import cost
from lance_pipeline.instruct.editing import (
    FAMILIES,
    InstructEditorOptions,
    InstructEditStage,
    candidate_seed,
)
from lance_pipeline.registry import EDITORS
from lance_pipeline.stage import SampleFailure

OPEN_GATES = {
    "clip_directional_threshold": -1.0,
    "clip_image_threshold": -1.0,
    "clip_text_threshold": -1.0,
    "require_edited_closer": False,
}


# -- options, licences, instructions ----------------------------------------------------------------------------------


def test_every_family_is_a_registered_editor_pinned_to_a_commit_with_a_licence():
    for name, family in FAMILIES.items():
        assert name in EDITORS and EDITORS.target(name).endswith(":InstructEditor")
        options = InstructEditorOptions(editor=name)
        assert options.model == family.model and re.fullmatch(r"[0-9a-f]{40}", options.revision)
        assert options.license == family.license and not options.is_non_commercial
        assert options.num_inference_steps == family.steps and options.guidance_scale == family.guidance
    assert InstructEditorOptions().editor == "instruct_pix2pix"
    assert InstructEditorOptions(editor="instruct_pix2pix").image_guidance_scales == (1.5,)
    assert InstructEditorOptions(editor="flux2_klein").image_guidance_scales == ()


def test_non_commercial_models_are_refused_unless_accepted_and_unknown_models_state_their_licence():
    with pytest.raises(ValueError, match=r"non-commercial licence \(flux-non-commercial-license\); set "
                                         r"accept_non_commercial_license: true"):  # fmt: skip
        InstructEditorOptions(editor="flux2_klein", model="black-forest-labs/FLUX.2-klein-9B", revision="main")
    accepted = InstructEditorOptions(
        editor="flux2_klein", model="black-forest-labs/FLUX.2-klein-9B", accept_non_commercial_license=True
    )
    assert accepted.is_non_commercial and accepted.describe()["non_commercial"] is True
    with pytest.raises(ValueError, match=r"license: model 'someone/an-editor' is not one of the pinned editors"):
        InstructEditorOptions(editor="flux2_klein", model="someone/an-editor")
    with pytest.raises(ValueError, match="set accept_non_commercial_license"):
        InstructEditorOptions(editor="longcat_edit", model="someone/an-editor", license="cc-by-nc-4.0")
    assert InstructEditorOptions(editor="longcat_edit", model="someone/an-editor", license="mit").license == "mit"


def test_options_refuse_what_the_editor_has_no_knob_for():
    with pytest.raises(ValueError, match="image_guidance_scales: editor 'flux2_klein' has no image guidance"):
        InstructEditorOptions(editor="flux2_klein", image_guidance_scales=(1.5,))
    with pytest.raises(ValueError, match="keep_candidates: an instruction editor's candidates are separate"):
        InstructEditorOptions(keep_candidates=True)
    with pytest.raises(ValueError, match="image_guidance_scales has duplicates"):
        InstructEditorOptions(image_guidance_scales=(1.5, 1.5))
    with pytest.raises(ValueError, match="editor"):
        InstructEditorOptions(editor="kontext")


def test_each_edit_type_has_an_instruction_rule_over_its_spans():
    for name, row in EDIT_TYPE_TABLE.items():
        edit = {"edit_type": name, "original_span": " red  car ", "edited_span": "blue bus", "edited_caption": "x"}
        text = editor_instruction(edit)
        assert text == row.editor_instruction.format(original="red car", edited="blue bus")
        assert "red car" in text and "blue bus" in text and '"' not in text  # unquoted: quotes mean text to render
        added = editor_instruction({**edit, "original_span": ""})
        assert added == row.editor_instruction_add.format(edited="blue bus") and "red car" not in added
    assert editor_instruction({"edit_type": "weather", "original_span": "", "edited_span": "in thick fog",
                               "edited_caption": "c"}) == 'Change the weather: in thick fog. Keep everything else as it is.'  # fmt: skip
    multi = {"edit_type": "multi", "original_span": "man", "edited_span": "boy; at night", "edited_caption": "a boy"}
    assert editor_instruction(multi) == MULTI_EDIT_INSTRUCTION.format(edited_caption="a boy")


# -- the editor on tiny pipelines ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    from lance_pipeline.tiny.clip_components import create_tiny_open_clip
    from lance_pipeline.tiny.instruct_components import create_tiny_flux2_klein, create_tiny_instruct_pix2pix

    root = tmp_path_factory.mktemp("tiny-instruct")
    return {
        "instruct_pix2pix": create_tiny_instruct_pix2pix(root / "ip2p"),
        "flux2_klein": create_tiny_flux2_klein(root / "klein"),
        "clip": create_tiny_open_clip(root / "clip"),
    }


def _stage(tiny_dirs, editor: str, **options) -> InstructEditStage:
    stage = InstructEditStage(
        editor=editor,
        model=str(tiny_dirs[editor]),
        image_size=64,
        clip_model=str(tiny_dirs["clip"]),
        clip_pretrained=None,
        **{"num_inference_steps": 3, **OPEN_GATES, **options},
    )
    stage.load("cpu")
    return stage


def _photo(seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    array = np.zeros((64, 64, 3), dtype=np.uint8)
    for _ in range(6):
        x, y = rng.integers(0, 48, size=2)
        array[y : y + 16, x : x + 16] = rng.integers(0, 256, size=3)
    return Image.fromarray(array)


EDITS = [
    {"edit_type": "subject", "edited_caption": "a photo of a woman with a dog", "original_span": "man",
     "edited_span": "woman", "kept": True, "scores": {"label_similarity": 0.1, "span_similarity": 0.3}},
    {"edit_type": "weather", "edited_caption": "a photo of a man with a dog in the snow", "original_span": "",
     "edited_span": "in the snow", "kept": True},
    {"edit_type": "object", "edited_caption": "a photo of a man with a cat", "kept": False},
]  # fmt: skip


def _record(key: str = "k0", seed: int = 11) -> dict:
    return {"key": key, "image": _photo(), "label": 1, "label_name": "dog", "seed": seed,
            "caption": "a photo of a man with a dog", "edits": [dict(e) for e in EDITS]}  # fmt: skip


def _bytes(image: Image.Image) -> bytes:
    return np.asarray(image).tobytes()


@pytest.mark.slow
@pytest.mark.parametrize("editor", ["instruct_pix2pix", "flux2_klein"])
def test_stage_renders_each_instruction_gates_and_counts_its_denoiser(tiny_dirs, editor, single_thread_torch):
    scales = {"image_guidance_scales": (1.2, 2.0)} if editor == "instruct_pix2pix" else {}
    stage = _stage(tiny_dirs, editor, images_per_edit=2, batch_size=3, **scales)
    assert type(stage.editor.pipeline).__name__ == FAMILIES[editor].pipeline  # the family's class, from the directory
    out = stage.process([_record()])[0]
    result = bench_edit(stage, _record())  # counts from zero (a fresh counter) over one more record
    per_edit = 2 * max(1, len(scales.get("image_guidance_scales", ())))
    kept = [e for e in EDITS if e["kept"]]
    assert result.candidates == len(out["edit_candidates"]) == len(kept) * per_edit
    # Cost, counted by the forward hook: 3 steps, one sample-forward per guidance branch and candidate (InstructPix2Pix
    # guides text and image: 3 branches; the distilled klein none: 1), as the build's estimate plans it.
    branches = 3 if editor == "instruct_pix2pix" else 1
    assert result.counts.denoiser_samples == len(kept) * per_edit * 3 * branches
    # Without a perturb stage the estimate plans one edit per image; this record has two.
    planned = cost.unet_evaluations([("edit", "instruct_edit", stage.options, lambda: stage)])["edit"]
    assert planned * len(kept) == result.counts.denoiser_samples
    assert result.counts.text_encoder_samples > 0
    samples = out["counterfactuals"]
    assert [s["edit_type"] for s in samples] == ["subject", "weather"]
    assert samples[0]["instruction"] == "Replace man with woman. Keep everything else as it is."
    assert samples[1]["instruction"] == "Change the weather: in the snow. Keep everything else as it is."
    for sample in samples:
        assert sample["editor"] == editor and sample["image"].size == (64, 64) and sample["self_replace"] is None
        assert sample["instruct_seed"] in {candidate_seed(11, 0), candidate_seed(11, 1)}
        assert sample["image_guidance_scale"] == (None if editor == "flux2_klein" else sample["image_guidance_scale"])
    candidates = out["edit_candidates"]
    assert {c["instruction"] for c in candidates} == {s["instruction"] for s in samples}
    assert sum(c["chosen"] for c in candidates) == 2 and all(c["passed"] for c in candidates)
    if editor == "instruct_pix2pix":
        assert {c["image_guidance_scale"] for c in candidates} == {1.2, 2.0}
    description = stage.describe()
    assert description["editor"] == editor and description["instruct_editing"]["editor"] == editor
    assert description["license"] == "not stated (local directory)"
    assert description["instruct_editing"]["strength"].startswith("image_guidance" if scales else "none")


@pytest.mark.slow
def test_same_seed_same_bytes_and_the_instruction_reaches_the_image(tiny_dirs, single_thread_torch):
    stage = _stage(tiny_dirs, "instruct_pix2pix")
    editor = stage.editor
    image = _photo()
    first = editor.generate(image, ["make it snow", "make it a painting"], [5, 5], 1.5)
    again = editor.generate(image, ["make it snow", "make it a painting"], [5, 5], 1.5)
    assert [_bytes(i) for i in first] == [_bytes(i) for i in again]
    assert _bytes(first[0]) != _bytes(first[1])  # only the instruction differs
    graded = editor.generate(image, ["make it snow", "make it a painting"], [5, 5], 2.5)
    assert _bytes(graded[0]) != _bytes(first[0])  # the image guidance reaches the image
    assert candidate_seed(7, 0) == candidate_seed(7, 0) and len({candidate_seed(7, 0), candidate_seed(7, 1)}) == 2
    # A record is rendered in calls of its own candidates only: its images do not depend on the batch it came in.
    alone = stage.process([_record("k1", seed=12)])[0]
    together = stage.process([_record("k0"), _record("k1", seed=12)])[1]
    assert [_bytes(s["image"]) for s in alone["counterfactuals"]] == [
        _bytes(s["image"]) for s in together["counterfactuals"]
    ]


@pytest.mark.slow
def test_a_long_instruction_is_refused_before_rendering_and_a_record_without_an_image_fails(
    tiny_dirs, single_thread_torch
):
    stage = _stage(tiny_dirs, "instruct_pix2pix")  # CLIP's 77 tokens
    long = {"edit_type": "subject", "edited_caption": "x", "original_span": "man",
            "edited_span": " ".join(["woman"] * 90), "kept": True}  # fmt: skip
    out = stage.process([{**_record(), "edits": [long]}])[0]
    assert out["counterfactuals"] == [] and "instruction is" in out["edit_candidates"][0]["reject_reason"]
    failed = stage.process([{**_record(), "image": None}])[0]
    assert isinstance(failed, SampleFailure) and "no source image" in failed.reason


@pytest.mark.slow  # the pipeline resizes the reference image to a megapixel for its VAE: about a minute on a CPU
def test_qwen_image_edit_runs_one_candidate_per_call_through_the_same_loading_code(tmp_path, single_thread_torch):
    from lance_pipeline.tiny.instruct_components import create_tiny_qwen_image_edit

    directory = create_tiny_qwen_image_edit(tmp_path / "qwen")
    options = InstructEditorOptions(editor="qwen_image_edit", model=str(directory), image_size=64,
                                    num_inference_steps=1, guidance_scale=1.0)  # fmt: skip
    editor = EDITORS.resolve("qwen_image_edit").load(options, "cpu")
    assert type(editor.pipeline).__name__ == "QwenImageEditPlusPipeline" and not editor.family.batched
    images = editor.generate(_photo(), ["make it snow", "make it a painting"], [1, 2], None)
    assert [i.size for i in images] == [(64, 64), (64, 64)]
    # One call per instruction (its processor wants one image per prompt), no guidance branch at scale 1: 1 step each.
    assert editor.counts.denoiser_calls == 2 and editor.counts.denoiser_samples == 2
    assert editor.counts.text_encoder_samples == 2


@pytest.mark.slow  # the pipeline renders at a megapixel whatever the input: tens of seconds per candidate on a CPU
def test_longcat_edit_renders_through_the_same_loading_code_and_comes_back_at_the_image_size(
    tmp_path, single_thread_torch
):
    from lance_pipeline.tiny.instruct_components import create_tiny_longcat_edit

    directory = create_tiny_longcat_edit(tmp_path / "longcat")
    stage = InstructEditStage(editor="longcat_edit_turbo", model=str(directory), image_size=64,
                              num_inference_steps=1, clip_model=create_tiny_clip(tmp_path), clip_pretrained=None,
                              **OPEN_GATES)  # fmt: skip
    stage.load("cpu")
    assert type(stage.editor.pipeline).__name__ == "LongCatImageEditPipeline" and not stage.editor.family.batched
    record = {**_record(), "edits": [EDITS[0]]}
    out = stage.process([record])[0]
    assert [s["image"].size for s in out["counterfactuals"]] == [(64, 64)]  # rendered at 1024 px, resized back
    assert out["counterfactuals"][0]["editor"] == "longcat_edit_turbo"
    assert stage.editor.counts.denoiser_samples == 1  # Turbo: guidance 1, no second branch, 1 step


def create_tiny_clip(tmp_path) -> str:
    from lance_pipeline.tiny.clip_components import create_tiny_open_clip

    return str(create_tiny_open_clip(tmp_path / "clip"))


# -- the demo builds -------------------------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.slow
def test_demo_instruct_rebuilds_resumes_and_runs_on_the_devices_engine_stage_major_to_the_same_bytes(
    shared_release, tmp_path
):
    from builder_helpers import DEMO_INSTRUCT, demo_instruct_config, release_files

    from builder.engine import build
    from builder.release_format.verify import verify_release

    # The clean build is the session's shared one (tests/test_compare_editors_families.py reads it too).
    config = demo_instruct_config()
    clean = shared_release.of_config(DEMO_INSTRUCT, demo_instruct_config)
    manifest = json.loads((clean / "manifest.json").read_text())
    assert verify_release(clean) == [] and manifest["kind"] == "instruct"
    assert manifest["counts"]["counterfactual"]["total"] > 0
    # Resume: forget the last batch's edits and its release rows, build again: the edit stage reruns on it only. The
    # finished build to forget them from is a copy of the clean one (the devices and stage-major builds below are the
    # byte-identical rebuilds from scratch).
    resumed = tmp_path / "resumed"
    shutil.copytree(clean, resumed)
    with sqlite3.connect(resumed / ".lance-cf" / "ledger.sqlite") as db:
        db.execute("DELETE FROM done_batches WHERE batch = 1")
        db.execute("DELETE FROM stage_batches WHERE batch = 1 AND stage = 'edit'")
    build(config, resumed, progress=False, device="cpu")
    assert release_files(resumed) == release_files(clean)
    # Engine independence: two worker processes, then the stage-major schedule, give the local engine's bytes.
    build(config, tmp_path / "devices", progress=False, engine="devices", engine_options={"devices": ["cpu", "cpu"]})
    build(config, tmp_path / "stage", progress=False, device="cpu", schedule="stage-major")
    for out in ("devices", "stage"):
        assert release_files(tmp_path / out) == release_files(clean), out


def test_the_card_names_the_editor_and_its_licence_and_warns_of_a_non_commercial_model(tmp_path):
    from release_fixture import write_release

    from builder import release_format as rf
    from dataset_cards.kind_sections import instruct_intro

    typed = rf.load_manifest(write_release(tmp_path / "rel", originals_per_class=1, edits_per_original=1))
    accepted = InstructEditorOptions(
        editor="flux2_klein", model="black-forest-labs/FLUX.2-klein-9B", accept_non_commercial_license=True
    )
    typed.stages["edit"] = {**accepted.describe(), "instruct_editing": {"editor": "flux2_klein"}}
    text = instruct_intro(typed, "X")
    assert "`flux2_klein` (`black-forest-labs/FLUX.2-klein-9B`, licence flux-non-commercial-license)" in text
    assert "**Non-commercial model.**" in text and "accept_non_commercial_license" in text
    typed.stages["edit"] = {**InstructEditorOptions(editor="flux2_klein").describe(), "instruct_editing": {}}
    text = instruct_intro(typed, "X")
    assert "licence apache-2.0" in text and "Non-commercial" not in text and "weights:" not in text
    # InstructPix2Pix: MIT code, weights fine-tuned from Stable Diffusion v1.5 under CreativeML OpenRAIL-M's use-based
    # restrictions (the repository's LICENSE); both recorded and stated, and commercial use stays allowed.
    pix2pix = InstructEditorOptions(editor="instruct_pix2pix")
    assert pix2pix.license_terms()["weights_license"] == "creativeml-openrail-m" and not pix2pix.is_non_commercial
    typed.stages["edit"] = {**pix2pix.describe(), "instruct_editing": {}}
    text = " ".join(instruct_intro(typed, "X").split())
    assert "licence mit; weights: creativeml-openrail-m: MIT covers the code; the weights are fine-tuned from " in text
    assert "Stable Diffusion v1.5" in text and "use-based restrictions (commercial use allowed)" in text
    assert "Non-commercial" not in text
    # a model that is not the family's own inherits no terms from it
    other = InstructEditorOptions(editor="instruct_pix2pix", model="someone/an-editor", license="mit")
    assert other.license_terms() == {"license": "mit"}


@pytest.mark.slow
def test_models_list_and_download_fetch_exactly_the_files_the_editor_loads_from_a_hub_id(hub, tmp_path, capsys,
                                                                                          monkeypatch):  # fmt: skip
    """The tiny FLUX.2 [klein] pushed to the Hub double as a repository (with a safety checker and a pickle it never
    needs): ``models list`` names it with its files and size, ``download`` fetches exactly those, and the editor then
    loads the Hub id at its commit offline, through the same ``from_pretrained`` as the pinned id."""
    from huggingface_hub import constants
    from test_models import _point_at, push

    from builder.cli import main
    from builder.config import preset_path
    from lance_pipeline.instruct.editing import load_instruct_pipeline
    from lance_pipeline.models.needs import select_files
    from lance_pipeline.readers import read_yaml
    from lance_pipeline.tiny.instruct_components import create_tiny_flux2_klein

    hub.gate_reads = True
    _point_at(monkeypatch, tmp_path, hub.url)
    local = create_tiny_flux2_klein(tmp_path / "klein")
    files = {str(p.relative_to(local)): p.read_bytes() for p in sorted(local.rglob("*")) if p.is_file()}
    files |= {"safety_checker/model.safetensors": b"never read", "transformer/diffusion_pytorch_model.bin": b"pickle",
              "README.md": b"---\nlicense: apache-2.0\n---\n"}  # fmt: skip
    commit = push(hub, tmp_path, "org/tiny-klein", files)
    needed = select_files(list(files), InstructEditStage.model_options[0].files)
    assert "transformer/diffusion_pytorch_model.safetensors" in needed and "model_index.json" in needed
    assert not {"safety_checker/model.safetensors", "transformer/diffusion_pytorch_model.bin", "TINY_MODEL.json"} & set(
        needed
    )
    data = read_yaml(preset_path("demo-instruct"))
    edit = next(s for s in data["stages"] if s["name"] == "edit")
    edit["options"].update(model="org/tiny-klein", revision=commit, license="apache-2.0")
    config = tmp_path / "hub-instruct.yaml"
    config.write_text(json.dumps(data))

    assert main(["models", "list", str(config)]) == 0
    out = capsys.readouterr().out
    assert f"org/tiny-klein@{commit}" in out and f"in {len(needed)} file(s), licence apache-2.0" in out
    assert "instruction editor for stages[edit].options.model" in out
    assert main(["models", "download", str(config), "--no-progress"]) == 0
    snapshot = tmp_path / "hf-cache" / "models--org--tiny-klein" / "snapshots" / commit
    assert sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file()) == needed

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    options = InstructEditorOptions(editor="flux2_klein", model="org/tiny-klein", revision=commit, license="apache-2.0")
    pipeline = load_instruct_pipeline(options, "cpu")
    assert type(pipeline).__name__ == "Flux2KleinPipeline" and pipeline.config.is_distilled
