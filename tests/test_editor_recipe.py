"""docs/architecture.md's recipe "An editor", followed from this file: an editor, its options and its stage are defined
and registered here, and a release is built, verified and described with them.

The options subclass ``EditorOptions`` and add one field: the model reference, dtype, image size, CLIP scorer and
gates come from the shared part, so the config below sets gate thresholds the editor never declared.
"""

from __future__ import annotations

import json
import tarfile
from dataclasses import dataclass

import pytest
from builder_helpers import make_imagefolder, write_config
from PIL import Image

from builder.config import load_config
from builder.engine import build
from builder.registry import STAGES
from builder.release_format.verify import verify_release
from builder.validation import validate_build
from lance_pipeline.editing.candidate_selection import Candidate, Editor, SweepResult
from lance_pipeline.editing.options import ClipGateOptions, EditorOptions
from lance_pipeline.editing.stages import CounterfactualEditStage
from lance_pipeline.models.needs import clip_option
from lance_pipeline.option_types import PositiveInt
from lance_pipeline.registry import EDITORS


@dataclass
class GreyOptions(EditorOptions):
    """The recipe's only new option; ``model`` is redeclared for its default (no weights behind it)."""

    model: str = "grey-editor"
    shade: PositiveInt = 128  # its bound is its annotation, checked on construction

    def describe(self):
        return {**super().describe(), "shade": self.shade}


class GreyEditor:
    """Renders every edit as a flat grey image: enough to run the stage's length check, gates and selection."""

    name = "grey"
    max_prompt_tokens = 12

    def __init__(self, options: GreyOptions) -> None:
        self.options = options

    @classmethod
    def load(cls, options: GreyOptions, device: str) -> GreyEditor:
        return cls(options)

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def check_source(self, record):
        return None if isinstance(record.get("image"), Image.Image) else "no source image"

    def render(self, record, requests):
        shade = self.options.shade
        grey = Image.new("RGB", record["image"].size, (shade, shade, shade))
        return SweepResult(record["image"], [Candidate(i, None, grey) for i in range(len(requests))])

    def describe(self):
        return {"editor": self.name, "shade": self.options.shade}


class GreyEditStage(CounterfactualEditStage):
    editor_name = "grey"
    options_class = GreyOptions
    editing_section = "grey_editing"
    consumes = {"key": "str", "image": "image", "caption": "str", "edits": "list"}
    model_options = (clip_option(),)  # the gates' CLIP only: `model` names no weights for this editor


class TwoEditsStage:
    """Two kept edits per caption, the second longer than the grey editor reads (refused before rendering)."""

    name = "perturb"
    version = "1"
    consumes = {"caption": "str"}
    produces = {"edits": "list"}

    def load(self, device: str) -> None:
        pass

    def process(self, records):
        def edit(text):
            return {"edit_type": "background", "edited_caption": text, "original_span": "", "edited_span": "x",
                    "kept": True}  # fmt: skip

        return [
            {"edits": [edit(r["caption"] + " at night"), edit(r["caption"] + " in a very long and winding dark alley")]}
            for r in records
        ]

    def describe(self):
        return {}


@pytest.fixture
def grey_editor_registered():
    EDITORS.register("grey", f"{__name__}:GreyEditor")
    STAGES.register("grey_edit", f"{__name__}:GreyEditStage")
    try:
        yield
    finally:
        EDITORS.unregister("grey")
        STAGES.unregister("grey_edit")


def _config(tmp_path, options):
    folder = make_imagefolder(tmp_path / "src", ["cat", "dog"], per_class=2)
    stages = [
        {"name": "caption", "type": "tests.fake_stages:FakeCaptionStage", "configs": ["counterfactual"]},
        {"name": "perturb", "type": f"{__name__}:TwoEditsStage", "configs": ["counterfactual"]},
        {"name": "edit", "type": "grey_edit", "configs": ["counterfactual"], "options": options},
    ]
    path = write_config(
        tmp_path / "c.yaml",
        f"imagefolder:{folder}",
        stages=stages,
        configs=["original", "counterfactual"],
        safety="off",  # grey images need no safety checker (the card then says they were not screened)
    )
    return load_config(str(path))


GATES_OFF = {"clip_directional_threshold": -1.0, "clip_image_threshold": -1.0, "clip_text_threshold": -1.0,
             "require_edited_closer": False}  # fmt: skip


@pytest.mark.slow
def test_an_editor_registered_from_a_test_builds_a_release(grey_editor_registered, tmp_path):
    assert isinstance(GreyEditor(GreyOptions()), Editor)
    assert {f for f in ClipGateOptions.__dataclass_fields__} <= set(GreyOptions.__dataclass_fields__)
    with pytest.raises(ValueError, match="unknown option 'shdae'; did you mean 'shade'"):
        validate_build(_config(tmp_path / "typo", {"shdae": 3}))
    with pytest.raises(ValueError, match="option shade = 0: expected an integer >= 1"):
        validate_build(_config(tmp_path / "zero", {"shade": 0}))

    options = {"shade": 90, "clip_model": "demo:tiny-open-clip", "clip_pretrained": None, **GATES_OFF}
    manifest = build(_config(tmp_path / "ok", options), tmp_path / "out", progress=False)
    assert verify_release(tmp_path / "out") == []
    # 4 photos x the one edit that fits the editor: the longer one is refused by the inherited length check (with the
    # gates off it would otherwise be released too).
    assert manifest["counts"]["counterfactual"]["total"] == 4

    edit = manifest["stages"]["edit"]
    # The image stage describes itself from the options and the editor: nothing of Stable Diffusion is assumed.
    assert {"name", "version", "model", "revision", "dtype", "image_size", "shade", "grey_editing"} == set(edit) - {
        "type"
    }
    assert edit["grey_editing"]["editor"] == "grey" and edit["grey_editing"]["gates"]["directional"] == -1.0
    (shard,) = sorted((tmp_path / "out" / "data" / "counterfactual").glob("*.tar"))
    with tarfile.open(shard) as tar:
        metas = [json.load(tar.extractfile(m)) for m in tar.getmembers() if m.name.endswith(".json")]
    assert {m["editor"] for m in metas} == {"grey"} and all(m["edited_caption"].endswith("at night") for m in metas)
