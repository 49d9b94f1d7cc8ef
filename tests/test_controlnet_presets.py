"""The ControlNet editor's presets: stages construct without weights, and the offline demo builds a valid release."""

from __future__ import annotations

import json
import re
import sqlite3

import pytest
from builder_helpers import cli

from builder.config import list_presets, load_config
from builder.registry import STAGES
from builder.release_format import EDIT_TYPES
from builder.release_format.verify import verify_release


def _construct(config, tmp_path):
    instances = {}
    for stage in config.stages:
        options = {
            k: (str(tmp_path) if isinstance(v, str) and v[:4] in ("demo", "pkg:") else v)
            for k, v in stage.options.items()
        }
        instances[stage.name] = STAGES.resolve(stage.type)(**options)
    return instances


@pytest.mark.e2e  # runs lance-cf as a process
@pytest.mark.parametrize("preset", ["demo-controlnet", "hardimagenet-controlnet", "hardimagenet-dillema"])
def test_controlnet_presets_construct_without_weights(preset, tmp_path):
    assert preset in list_presets()
    config = load_config(preset)
    instances = _construct(config, tmp_path)
    validated = cli("validate", preset)  # the declared field graph, without loading a model
    assert "controlnet_edit v1" in validated.stdout and "=> counterfactual" in validated.stdout
    # The editor, then the release screens (lance_pipeline/screening) on what it rendered, then its preservation.
    assert [s.type for s in config.stages][-4:] == [
        "controlnet_edit", "sensitive_edit_screen", "safety_check", "preservation",
    ]  # fmt: skip
    assert {s.name for s in config.stages} == {
        "caption", "keywords", "alternatives", "rewrite", "label_check", "edit", "screen", "safety", "preservation",
    }  # fmt: skip
    for name, instance in instances.items():
        assert instance.name == name
    if preset.startswith("hardimagenet"):
        for stage in config.stages:
            for key in ("revision", "controlnet_revision"):
                if key in stage.options:
                    assert re.fullmatch(r"[0-9a-f]{40}", stage.options[key]), f"{stage.name}: unpinned {key}"


def test_hardimagenet_dillema_differs_from_the_filtered_preset_only_in_dillemas_selection_and_captions():
    filtered, dillema = load_config("hardimagenet-controlnet"), load_config("hardimagenet-dillema")
    assert dillema.source_options == filtered.source_options and dillema.image_size == filtered.image_size
    stages = {s.name: s.options for s in filtered.stages}
    changed = {
        "caption": {"num_captions": 2, "do_sample": True, "num_beams": 1, "top_p": 0.9, "label_conditioned": False,
                    "max_new_tokens": 30, "min_new_tokens": 0, "keep_prompt": False},  # LAVIS's defaults
        "rewrite": {"n_counterfactuals": 1, "max_span_words": 48},
        "label_check": {"label_threshold": None, "span_threshold": None},
        "edit": {"keep_per_edit": 5, "clip_directional_threshold": -1.0, "clip_image_threshold": -1.0,
                 "clip_text_threshold": -1.0, "require_edited_closer": False, "long_captions": "truncate"},
    }  # fmt: skip
    for stage in dillema.stages:
        assert stage.options == {**stages[stage.name], **changed.get(stage.name, {})}, stage.name
    edit = next(s for s in dillema.stages if s.name == "edit")
    assert dict(edit.options)["images_per_edit"] == 5  # DILLEMA's 5 images, all kept


@pytest.mark.slow
def test_dillemas_selection_keeps_every_candidate_and_the_card_says_so(tmp_path):
    """demo-controlnet with DILLEMA's selection and two-caption form: every rendered candidate is released with its
    scores, the card names the selection, and its deviations list what still differs (not the selection)."""
    import yaml

    from builder.engine import build

    data = load_config("demo-controlnet").to_dict()
    dillema = {
        "caption": {"num_captions": 2, "do_sample": True, "num_beams": 1, "label_conditioned": False},
        "rewrite": {"n_counterfactuals": 1},
        "edit": {"images_per_edit": 2, "keep_per_edit": 2},
    }
    for stage in data["stages"]:
        stage["options"].update(dillema.get(stage["name"], {}))
    path = tmp_path / "dillema.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    manifest = build(load_config(str(path)), tmp_path / "out", progress=False)
    assert manifest["failures"] == []
    assert manifest["counts"]["counterfactual"]["total"] == 5 * 1 * 2  # 5 photos x 1 counterfactual x 2 images
    assert manifest["stages"]["caption"]["num_captions"] == 2
    card = (tmp_path / "out" / "README.md").read_text()
    assert "Selection as DILLEMA published it: every rendered image is kept" in card
    deviations = card[card.index("## Deviations from the papers") : card.index("## Known failure modes")]
    assert "| condition | HED edges" in deviations and "| seeds |" in deviations
    absent = ("| images kept |", "| automatic filter |", "| label check |", "| captions |", "| counterfactuals per",
            "| captioner model |")  # the last: the demo's captioner is the tiny one, not OPT-2.7B  # fmt: skip
    for row in absent:
        assert row not in deviations, row
    import tarfile

    (shard,) = (tmp_path / "out" / "data" / "counterfactual").glob("*.tar")
    with tarfile.open(shard) as tar:
        metas = [json.load(tar.extractfile(m)) for m in tar.getmembers() if m.name.endswith(".json")]
    assert len(metas) == 10 and all(isinstance(m["scores"]["clip_directional"], float) for m in metas)
    assert len({(m["source_key"], m["controlnet_seed"]) for m in metas}) == 10  # both seeds of every edit


def test_hardimagenet_controlnet_shares_classes_captions_and_label_check_with_hardimagenet():
    lance, controlnet = load_config("hardimagenet"), load_config("hardimagenet-controlnet")
    assert controlnet.source_options == lance.source_options and controlnet.image_size == lance.image_size
    for name in ("caption", "label_check"):
        assert (
            next(s for s in controlnet.stages if s.name == name).options
            == next(s for s in lance.stages if s.name == name).options
        )
    perturber = next(s for s in lance.stages if s.name == "perturb").options
    for name in ("keywords", "alternatives", "rewrite"):
        stage = next(s for s in controlnet.stages if s.name == name).options
        assert (stage["model"], stage["revision"]) == (perturber["model"], perturber["revision"])


@pytest.fixture(scope="module")
def demo_controlnet(shared_release):
    """``lance-cf build demo-controlnet``, built once for the session; the tests here only read it."""
    return shared_release("demo-controlnet")


@pytest.mark.e2e  # builds demo-controlnet through the CLI (the module's release)
@pytest.mark.slow
def test_review_apply_on_demo_controlnet_keeps_every_sample_and_verifies(demo_controlnet, tmp_path):
    """A ControlNet release reviewed by people: its counterfactuals are the default study, every sample is kept."""
    from review_check import assert_review_apply_keeps_every_sample

    assert_review_apply_keeps_every_sample(demo_controlnet, tmp_path)


@pytest.mark.e2e
@pytest.mark.slow
def test_demo_controlnet_builds_verifies_and_loads(demo_controlnet, tmp_path):
    import datasets

    assert verify_release(demo_controlnet) == []
    manifest = json.loads((demo_controlnet / "manifest.json").read_text())
    assert manifest["failures"] == []
    assert manifest["counts"]["counterfactual"]["total"] == 10  # 5 photos x 2 counterfactual captions
    edit = manifest["stages"]["edit"]
    assert edit["type"] == "controlnet_edit" and edit["editor"] == "controlnet"
    assert edit["controlnet_editing"]["scheduler"]["class"] == "UniPCMultistepScheduler"
    assert manifest["stages"]["keywords"]["step"] == "keywords"
    rows = list(datasets.load_dataset(str(demo_controlnet), "counterfactual", split="test", cache_dir=str(tmp_path)))
    assert len(rows) == 10
    for row in rows:
        meta = row["json"]
        assert meta["edit_type"] in EDIT_TYPES and meta["edited_caption"] != meta["caption"]
        assert meta["self_replace"] is None and isinstance(meta["scores"]["clip_directional"], float)
        assert row["png"].size == (64, 64)
        # The editor and DILLEMA's LLM trace, declared extra fields of the counterfactual config.
        assert meta["editor"] == "controlnet" and meta["condition"] == "canny" and meta["controlnet_scale"] == 1.0
        assert isinstance(meta["controlnet_seed"], int)
        keywords = json.loads(meta["llm_keywords"])
        alternatives = json.loads(meta["llm_alternatives"])
        applied = json.loads(meta["llm_applied_alternatives"])
        assert applied and set(applied) <= set(keywords) and set(applied) <= set(alternatives)
        assert all(applied[word] in alternatives[word] for word in applied)
        assert meta["edit_type"] == (
            "multi" if len(applied) > 1 or keywords[next(iter(applied))] is None else keywords[next(iter(applied))]
        )
    spec = manifest["release_spec"]
    declared = spec["configs"]["counterfactual"]["fields"]
    assert [f["name"] for f in declared][:2] == ["editor", "controlnet_seed"]


@pytest.mark.e2e
@pytest.mark.slow
def test_demo_controlnet_ledger_keeps_the_llm_trace(demo_controlnet):
    db = sqlite3.connect(demo_controlnet / ".lance-cf" / "ledger.sqlite")
    stages = {stage for (stage,) in db.execute("select distinct stage from stage_outputs")}
    assert {"keywords", "alternatives", "rewrite", "edit"} <= stages
    payloads = [bytes(p) for (p,) in db.execute("select payload from stage_outputs where stage = 'edit'")]
    text = b"".join(payloads).decode("utf-8", "replace")
    assert '"editor": "controlnet"' in text and '"llm_applied_alternatives"' in text


@pytest.mark.e2e
@pytest.mark.slow
def test_demo_controlnet_rebuild_is_byte_identical(demo_controlnet, tmp_path, monkeypatch):
    from builder_helpers import release_files

    monkeypatch.setenv("LANCE_CF_CACHE", str(tmp_path / "other-cache"))
    again = tmp_path / "again"
    cli("build", "demo-controlnet", "--output", str(again), "--no-progress", "--device", "cpu", timeout=None)
    assert release_files(again) == release_files(demo_controlnet)
