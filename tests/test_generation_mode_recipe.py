"""The recipes "A generation mode" and "Release kinds" of docs/architecture.md, followed from a test file: a
generating source, a stage that makes the images and declares the release config they go to, and a config naming both
(in a project: a preset in ``builder/presets/``), and what its releases are (one ``ReleaseKind``: its card paragraph,
papers, how its images were made, Hub metadata, deviations from its paper, ``next:`` lines). Registered from here with
``SOURCES.register`` / ``STAGES.register`` / ``RELEASE_KINDS.register``.

The mode ("painted": one synthetic pattern per planned sample, no model) is built and checked as a user would: ``lance-cf
validate``, ``lance-cf build``, ``lance-cf verify``, ``datasets.load_dataset`` on the release; a rebuild is
byte-identical, and a killed-then-resumed build would replay from the same ledger as every other mode. Everything the
card, ``croissant.json`` and the Hub metadata say about how the images were made comes from the test's declaration,
none of it from another kind's.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import yaml
from builder_helpers import release_files
from PIL import Image

from builder.cli import main
from builder.registry import SOURCES, STAGES
from builder.sources import LabelSpace, Source, SourceSample
from lance_pipeline.deviations import Deviation, DeviationTable, has_stage
from lance_pipeline.release_kinds import RELEASE_KINDS, Paper, ReleaseKind
from lance_pipeline.stage import MetadataField, ReleaseOutput

PATTERNS = ("stripes", "checks")


class PatternSource(Source):
    """``pattern:CLASS,CLASS,...``: plans ``per_class`` samples per class, each with a pattern to paint; no image."""

    generates = True  # records start from ``fields`` instead of a decoded image
    fields = {"pattern": "str"}  # the record fields this source gives (name -> contract kind), checked by validate

    def __init__(self, spec: str, path: str, per_class: int = 2):
        super().__init__(spec=spec, kind="pattern", license="Generated patterns, CC0.")
        names = [name.strip() for name in path.split(",") if name.strip()]
        if not names:
            raise ValueError(f"source {spec!r}: expected pattern:CLASS,CLASS,...")
        self.label_space = LabelSpace("custom", names)
        self.samples = [
            SourceSample(f"{name}_{i:03d}", label, f"{name} / {i}")
            for label, name in enumerate(names)
            for i in range(per_class)
        ]

    def read(self, sample: SourceSample) -> bytes:
        raise TypeError("a pattern: source has no images to read; the paint stage makes them")

    def record_fields(self, sample: SourceSample) -> dict[str, Any]:
        return {"pattern": PATTERNS[int(sample.key.rsplit("_", 1)[1]) % len(PATTERNS)]}


class PaintStage:
    """Paints each planned sample's pattern, in a colour drawn from its seed (the engine's per-sample seed)."""

    name = "paint"
    version = "1"
    consumes = {"label": "int", "seed": "int", "pattern": "str"}
    produces = {"painted": "image"}
    outputs = (
        ReleaseOutput(
            "painted",
            "painted",
            "pt",
            description="a synthetic pattern per planned sample (the generation-mode recipe's test)",
            fields=(MetadataField("pattern", "string", description="the pattern painted"),),
        ),
    )

    def __init__(self, size: int = 16):
        self.size = size

    def load(self, device: str) -> None:
        pass

    def process(self, records):
        out = []
        for record in records:
            colour = np.random.default_rng(record["seed"]).integers(0, 256, size=3, dtype=np.uint8)
            grid = np.indices((self.size, self.size)) // (2 + record["label"])
            mask = grid[1] % 2 == 0 if record["pattern"] == "stripes" else (grid[0] + grid[1]) % 2 == 0
            image = np.where(mask[..., None], colour, 255 - colour).astype(np.uint8)
            out.append({"painted": Image.fromarray(image)})
        return out

    def describe(self):
        return {"size": self.size}


def painted_intro(manifest, pretty_name: str) -> str:
    """The card's opening paragraph of the mode's releases (in a project: a function in ``dataset_cards/``)."""
    return f"{pretty_name} holds synthetic **painted patterns**, one per planned sample.\n"


# Where the mode departs from its paper (in a project: ``lance_pipeline/my_mode/deviations.py``).
PAINTED_DEVIATIONS = DeviationTable(
    "painted",
    "Painted patterns",
    "Mondrian et al., arXiv 9999.00001: section 2",
    (
        Deviation(
            "painted",
            "palette",
            "primary colours only",
            "any colour drawn from the sample's seed",
            "the test needs colours that differ per sample",
            "cannot be changed",
            "a paint stage ran",
            has_stage("pattern_paint"),
        ),
        Deviation("painted", "canvas", "oil on canvas", "pixels", "a stress test is made of images", "cannot be changed",
                  "never", lambda manifest: False),
    ),
)  # fmt: skip

# What the mode's releases are (in a project: ``lance_pipeline/my_mode/release_kind.py``), recognised by its source.
PAINTED = ReleaseKind(
    name="painted",
    title="painted patterns",
    card_intro=f"{__name__}:painted_intro",
    main_config="painted",
    next_commands=("lance-cf verify {release}", "lance-cf eval --release {release} --model painted-net{class_map}"),
    source_kinds=("pattern",),
    papers=(Paper("mondrian2031painted", "9999.00001", "Painted Patterns as Stress Tests", ("Mondrian, Piet",), 2031),),
    making="Every image is a pattern painted in a colour drawn from its sample's seed (the painted mode).",
    collection_type="Synthetic data: painted patterns",
    generated=True,
    language_creators=("expert-generated",),
    task_ids=("multi-label-image-classification",),
    deviations=(f"{__name__}:PAINTED_DEVIATIONS",),
)


@pytest.fixture
def painted_mode():
    SOURCES.register("pattern", f"{__name__}:PatternSource")
    STAGES.register("pattern_paint", f"{__name__}:PaintStage")
    RELEASE_KINDS.register("painted", f"{__name__}:PAINTED")
    yield
    SOURCES.unregister("pattern")
    STAGES.unregister("pattern_paint")
    RELEASE_KINDS.unregister("painted")


def _config(tmp_path) -> str:
    config = {
        "name": "painted-patterns",
        "description": "Synthetic patterns, one per planned sample.",
        "source": "pattern:cat,dog",
        "source_options": {"per_class": 3},
        "configs": ["painted"],
        "image_size": None,
        "safety": "off",  # painted patterns need no safety checker (the card says they were not screened)
        "stages": [{"name": "paint", "type": "pattern_paint", "configs": ["painted"], "options": {"size": 16}}],
    }
    path = tmp_path / "painted.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


def test_a_generation_mode_registered_from_a_test_file_builds_verifies_and_loads(tmp_path, capsys, painted_mode):
    import datasets

    config = _config(tmp_path)
    assert main(["validate", config]) == 0
    out = capsys.readouterr().out
    assert "paint (pattern_paint v1): label, seed, pattern -> painted => painted" in out
    for name in ("a", "b"):
        assert main(["build", config, "--output", str(tmp_path / name), "--no-progress"]) == 0
        assert main(["verify", str(tmp_path / name)]) == 0
    out = capsys.readouterr().out
    release = tmp_path / "b"
    # the kind's own next: lines, and only them
    assert (
        f"next:\n  lance-cf verify {release}\n  lance-cf eval --release {release} --model painted-net --class-map "
        in out
    )
    assert release_files(tmp_path / "a") == release_files(tmp_path / "b")  # reproducible by construction
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["kind"] == "painted"  # the build records the kind its source declares
    card = (tmp_path / "a" / "README.md").read_text()
    assert "synthetic **painted patterns**, one per planned sample" in card
    # The card's metadata, croissant.json and deviations: the kind's declaration, no other kind's words.
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["source_datasets"] == ["original"] and front["annotations_creators"] == ["machine-generated"]
    assert front["language_creators"] == ["expert-generated"]
    assert front["task_ids"] == ["multi-label-image-classification"]
    assert [t for t in front["tags"] if t.startswith("arxiv:")] == ["arxiv:9999.00001"]
    assert "Painted Patterns as Stress Tests" in card and "@misc{mondrian2031painted," in card
    assert "**Painted patterns** (Mondrian et al., arXiv 9999.00001: section 2)" in card and "| palette |" in card
    assert "| canvas |" not in card  # a row whose own predicate does not hold
    croissant = json.loads((tmp_path / "a" / "croissant.json").read_text())
    assert "painted in a colour drawn from its sample's seed (the painted mode)" in croissant["description"]
    assert croissant["rai:dataCollectionType"] == ["Synthetic data: painted patterns"]
    assert croissant["citeAs"].startswith("@misc{mondrian2031painted,")
    limitations = " ".join(croissant["rai:dataLimitations"])
    assert "Deviation from Mondrian et al., arXiv 9999.00001: section 2 (palette)" in limitations
    assert "Generated images decoded to RGB" in croissant["rai:dataPreprocessingProtocol"][0]
    tool_citation = card.index("building and publishing LANCE counterfactual test sets")  # the tool's own title
    everything = json.dumps(croissant) + card[:tool_citation] + card[tool_citation + 60 :]
    # the platform's screening statement names the safety checker the release went without, whatever its kind
    everything = everything.replace("Stable Diffusion's safety checker", "the safety checker")
    for other in ("LANCE", "Stable Diffusion", "prompt-to-prompt", "null-text", "DILLEMA", "ControlNet", "Vendrow",
                  "Wiles", "2305.19164"):  # fmt: skip
        assert other not in everything, other
    assert manifest["configs"] == ["painted"] and manifest["counts"]["painted"]["by_class"] == {"0": 3, "1": 3}
    rows = datasets.load_dataset(str(tmp_path / "a"), "painted", split="test")
    assert rows.features["cls"].names == ["cat", "dog"]  # the label space the source declared
    metadata = [row["json"] for row in rows]
    assert sorted(m["pattern"] for m in metadata) == sorted(["stripes", "checks", "stripes"] * 2)
    assert {m["key"] for m in metadata} == {f"{c}_{i:03d}_pt" for c in ("cat", "dog") for i in range(3)}


def test_the_mode_is_checked_before_anything_runs(tmp_path, capsys, painted_mode):
    """A stage reading a field the generating source does not give is refused by validate, naming both."""
    data = yaml.safe_load(open(_config(tmp_path)).read())
    data["source"] = "demo"  # a source of real images: no `pattern` field
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "pattern" in err, err
