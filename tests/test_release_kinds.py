"""Declared release kinds (``lance_pipeline.release_kinds``): each target resolves in the layer that uses it, releases
and results are recognised without guessing, a new editor's card names it, and evaluation's modules no longer import
each other in a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from builder_helpers import make_imagefolder, write_config
from PIL import Image, ImageOps

from lance_pipeline.registry import EDITORS
from lance_pipeline.release_kinds import (
    RELEASE_KINDS,
    ReleaseKind,
    get_kind,
    kind_of_manifest,
    kind_of_results,
    list_kinds,
    metric_applies_to,
    resolve_target,
)
from lance_pipeline.stage import ReleaseOutput

REPO = Path(__file__).resolve().parents[1]


def test_every_kind_resolves_and_each_target_lives_in_the_layer_that_uses_it():
    """Card targets in dataset_cards, evaluation targets in evaluation: each layer resolves only its own."""
    names = [k.name for k in list_kinds()]
    assert names == RELEASE_KINDS.in_order() and {"lance", "controlnet", "interfaces", "discovery"} <= set(names)
    for kind in list_kinds():
        assert callable(resolve_target(kind.card_intro)) and kind.card_intro.startswith("dataset_cards.")
        if kind.card_section is not None:
            assert callable(resolve_target(kind.card_section)) and kind.card_section.startswith("dataset_cards.")
        for validator in kind.results_sections.values():
            assert callable(resolve_target(validator)) and validator.startswith("evaluation.")
        if kind.leaderboard is not None:
            board = resolve_target(kind.leaderboard)
            assert kind.leaderboard.startswith("evaluation.") and callable(board.markdown) and callable(board.write)
        from evaluation.metric_registry import METRICS

        assert all(m in METRICS for m in kind.metrics), kind.metrics
        assert kind.next_commands and all(c.startswith(("lance-cf ", "python ")) for c in kind.next_commands)
        if kind.card_failure_modes is not None:
            assert kind.card_failure_modes.startswith("dataset_cards.") and callable(
                resolve_target(kind.card_failure_modes)
            )
        if kind.summary_lines is not None:
            assert kind.summary_lines.startswith("evaluation.") and callable(resolve_target(kind.summary_lines))
        # the method's own targets: deviation tables and the cost estimate, in lance_pipeline
        from lance_pipeline.deviations import DeviationTable

        assert kind.papers and kind.making and kind.collection_type.startswith("Synthetic data")
        assert kind.deviations and all(isinstance(resolve_target(t), DeviationTable) for t in kind.deviations)
        assert all(t.startswith("lance_pipeline.") for t in kind.deviations)
        if kind.unet_evaluations is not None:
            assert kind.unet_evaluations.startswith("lance_pipeline.")
            assert callable(resolve_target(kind.unet_evaluations))
        # its registrations reach the builder's registries
        from builder.registry import SOURCES, STAGES

        assert all(STAGES.target(n) == t for n, t in kind.stages.items())
        assert all(SOURCES.target(n) == t for n, t in kind.sources.items())


def _manifest(source_kind="imagefolder", stage_types=(), editors=(), kind=None):
    manifest = {
        "source": {"kind": source_kind},
        "config": {"stages": [{"name": t, "type": t} for t in stage_types]},
        "stages": {f"s{i}": {"prompt_to_prompt": {"editor": e}} for i, e in enumerate(editors)},
        "configs": ["original", "counterfactual"],
        "label_space": {"name": "imagenet-1k"},
    }
    return manifest | ({"kind": kind} if kind else {})


def test_releases_without_a_recorded_kind_are_recognised_and_a_recorded_kind_wins():
    assert kind_of_manifest(_manifest()).name == "lance"
    assert kind_of_manifest(_manifest(editors=["prompt_to_prompt"])).name == "lance"
    assert kind_of_manifest(_manifest(editors=["controlnet"])).name == "controlnet"
    assert kind_of_manifest(_manifest(stage_types=["controlnet_edit"])).name == "controlnet"
    assert kind_of_manifest(_manifest(source_kind="generate")).name == "interfaces"
    assert kind_of_manifest(_manifest(source_kind="discovery")).name == "discovery"
    assert kind_of_manifest(_manifest(source_kind="generate", kind="lance")).name == "lance"  # recorded wins
    with pytest.raises(ValueError, match=r"kind 'hologram'.*known: controlnet, discovery, instruct, interfaces, lance"):
        kind_of_manifest(_manifest(kind="hologram"))


def test_results_carry_their_kind_and_older_results_are_recognised():
    assert kind_of_results({"release": {"kind": "interfaces", "configs": ["original"]}}).name == "interfaces"
    # before kinds were recorded: by the kind's results section, or by its configs without an original
    assert kind_of_results({"release": {"configs": ["x"]}, "interfaces": {"shifts": {}}}).name == "interfaces"
    assert kind_of_results({"release": {"configs": ["base", "in_the_snow"]}}).name == "interfaces"
    assert kind_of_results({"release": {"configs": ["original", "base"]}}).name == "lance"
    with pytest.raises(ValueError, match="kind 'hologram'"):
        kind_of_results({"release": {"kind": "hologram"}})


def test_kind_specific_metrics_apply_to_their_kinds_only():
    assert metric_applies_to("shift_accuracy_drop", "interfaces")
    assert not metric_applies_to("shift_accuracy_drop", "lance")
    assert metric_applies_to("flip_rate", "controlnet") and not metric_applies_to("flip_rate", "interfaces")
    assert metric_applies_to("accuracy", "discovery")  # listed by no kind: every kind
    assert metric_applies_to("insights", None)


def test_next_commands_follow_the_kind_and_the_label_space():
    lance = get_kind("lance").next_lines("out/r", _manifest())
    assert lance[0] == "lance-cf verify out/r" and "'out/r', 'counterfactual'" in lance[1]
    assert lance[2] == "lance-cf eval --release out/r --model resnet50.a1_in1k --output eval-out"
    star = _manifest(source_kind="generate") | {"configs": ["base", "in_the_snow"], "label_space": {"name": "mine"}}
    lines = kind_of_manifest(star).next_lines("out/s", star)
    assert "'out/s', 'base'" in lines[1] and "original" not in " ".join(lines)
    assert lines[2].endswith("--class-map CLASS_MAP --output eval-out")


# ------------------------------------------------------------------------------------ a new editor, from this file
class NegativeEditor:
    """An editor registered from this test file: its counterfactual is the negative of the source image."""

    name = "negative_editor"

    def describe(self):
        return {"editor": self.name, "strength": 1.0}

    def render(self, image: Image.Image) -> Image.Image:
        return ImageOps.invert(image)


class NegativeEditStage:
    """A model-free stand-in of ``CounterfactualEditStage``: resolves its editor from ``EDITORS`` by name and records
    the editor's description, as the real edit stages do."""

    name = "edit"
    version = "1"
    editor_name = "negative_editor"
    consumes = {"caption": "str"}
    produces = {"counterfactuals": "list"}
    outputs = (ReleaseOutput("counterfactual", "counterfactuals", "cf", many=True),)

    def __init__(self):
        self.editor = None

    def load(self, device: str) -> None:
        self.editor = EDITORS.resolve(self.editor_name)()

    def process(self, records):
        return [
            {
                "counterfactuals": [
                    {
                        "image": self.editor.render(r["image"]),
                        "edit_type": "background",
                        "edited_caption": r["caption"] + " at night",
                        "original_span": "",
                        "edited_span": "at night",
                        "self_replace": 0.5,
                        "scores": {},
                    }
                ]
            }
            for r in records
        ]

    def describe(self):
        editor = self.editor.describe() if self.editor is not None else {"editor": self.editor_name}
        return {"name": self.name, "version": self.version, "prompt_to_prompt": editor}


@pytest.fixture
def negative_editor():
    EDITORS.register("negative_editor", f"{__name__}:NegativeEditor")
    yield
    EDITORS.unregister("negative_editor")


def test_a_new_editors_release_records_its_kind_and_its_card_names_the_editor(tmp_path, negative_editor):
    from builder.config import load_config
    from builder.engine import build

    folder = make_imagefolder(tmp_path / "src", ["cat", "dog"], per_class=2)
    stages = [
        {"name": "caption", "type": "tests.fake_stages:FakeCaptionStage", "configs": ["counterfactual"]},
        {"name": "edit", "type": f"{__name__}:NegativeEditStage", "configs": ["counterfactual"]},
    ]
    path = write_config(
        tmp_path / "c.yaml", f"imagefolder:{folder}", stages=stages, configs=["original", "counterfactual"]
    )
    manifest = build(load_config(str(path)), tmp_path / "out", progress=False)
    assert manifest["kind"] == "lance"  # recorded by the build
    card = (tmp_path / "out" / "README.md").read_text()
    assert "by the `negative_editor` editor" in card and "prompt-to-prompt attention control" not in card
    assert 'weather = ds.filter(lambda row: row["json"]["edit_type"] == "weather")' in card
    # the paper's editor keeps the paper's sentence
    from builder import release_format as rf
    from dataset_cards.kind_sections import lance_intro

    typed = rf.load_manifest(tmp_path / "out")
    typed.stages["edit"]["prompt_to_prompt"]["editor"] = "prompt_to_prompt"
    assert "null-text inversion and prompt-to-prompt attention control" in lance_intro(typed, "X")


def test_a_kind_registered_from_a_test_renders_its_own_card_paragraph(tmp_path):
    """A mode of one's own: its declaration (recognised by its source kind) decides the card's opening paragraph."""
    from release_fixture import write_release

    from builder import release_format as rf
    from dataset_cards.card import render_release_card

    root = write_release(tmp_path / "rel", originals_per_class=1, edits_per_original=1)
    manifest = rf.read_manifest_dict(root)
    RELEASE_KINDS.register("ours", f"{__name__}:OURS")
    try:
        text = render_release_card(root, manifest | {"kind": "ours"}, output_dir=tmp_path)
    finally:
        RELEASE_KINDS.unregister("ours")
    assert "made by our own mode" in text and "LANCE** (*Language-guided" not in text


def ours_intro(manifest, pretty_name):
    return f"{pretty_name} was made by our own mode.\n"


OURS = ReleaseKind(
    name="ours",
    title="our mode",
    card_intro=f"{__name__}:ours_intro",
    next_commands=("lance-cf verify {release}",),
)


# ------------------------------------------------------------------------------------- no import cycle in evaluation
def _module_imports(path: Path, package: str) -> set[str]:
    """First-party modules of ``package`` a file imports, lazy imports inside functions included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m.split(".")[0] == package}


def import_cycle(root: Path, package: str) -> list[str] | None:
    """A cycle among the modules of ``root/package`` (lazy imports included), or None."""
    modules = {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
        for p in sorted((root / package).rglob("*.py"))
    }
    graph = {m: {i for i in _module_imports(p, package) if i in modules and i != m} for m, p in modules.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:  # depth-first search; a module met again while open closes a cycle
        state[module] = 1
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return [*stack[stack.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


@pytest.mark.parametrize("package", ["evaluation", "dataset_cards"])
def test_modules_of_a_package_import_each_other_without_a_cycle(package):
    assert len(list((REPO / package).rglob("*.py"))) > 5
    assert import_cycle(REPO, package) is None


def test_the_cycle_check_finds_a_lazy_cycle(tmp_path):
    pkg = tmp_path / "evaluation"
    pkg.mkdir()
    (pkg / "a.py").write_text("def f():\n    from evaluation.b import g\n")
    (pkg / "b.py").write_text("from evaluation import a\n")
    (pkg / "c.py").write_text("import evaluation.a\n")
    assert import_cycle(tmp_path, "evaluation") == ["evaluation.a", "evaluation.b", "evaluation.a"]


def _summary(manifest, capsys, **kwargs):
    from builder.cli import _summarize_build

    code = _summarize_build(Path("out/r"), manifest, **kwargs)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_build_summary_gives_next_commands_only_after_a_success_and_for_the_kind(capsys):
    counts = {"total": 3, "by_edit_type": {}, "by_class": {}}
    star = _manifest(source_kind="generate") | {"configs": ["base", "in_the_snow"], "failures": []}
    star |= {"counts": {"base": counts, "in_the_snow": counts}, "label_space": {"name": "imagenet-1k"}}
    code, out, _ = _summary(star, capsys)
    assert code == 0 and "next:\n  lance-cf verify out/r\n" in out
    assert "load_dataset('out/r', 'base'" in out and "'original'" not in out
    # a retryable error: no next step, exit 1
    failed = star | {"build": {"errors": [{"source_key": "k", "stage": "generate", "message": "CUDA out of memory"}]}}
    code, out, _ = _summary(failed, capsys)
    assert code == 1 and "next:" not in out
    # nothing was released: one plain line, no next step, no empty parentheses
    empty = star | {"configs": [], "counts": {}, "empty_configs": ["base", "in_the_snow"]}
    empty["failures"] = [{"source_key": f"k{i}", "stage": "filter", "reason": "no shift"} for i in range(18)]
    code, out, err = _summary(empty, capsys)
    assert code == 1 and out.startswith("built out/r (no samples; 18 failure(s), 0 error(s))\n") and "next:" not in out
    assert "config(s) base, in_the_snow ended with no samples" in err
    # a label space of one's own: the eval line says a class map is needed
    custom = star | {"label_space": {"name": "photos"}}
    code, out, _ = _summary(custom, capsys)
    assert code == 0 and "--class-map CLASS_MAP --output eval-out" in out and "CLASS_MAP is a file" in out
