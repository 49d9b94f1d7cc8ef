"""The recipe "A generation mode" of docs/architecture.md, followed from a test file: a generating source, a stage
that makes the images and declares the release config they go to, and a config naming both (in a project: a preset
in ``builder/presets/``), and what its releases are (a ``ReleaseKind``). Registered from here with
``SOURCES.register`` / ``STAGES.register`` / ``RELEASE_KINDS.register``.

The mode ("painted": one synthetic pattern per planned sample, no model) is built and checked as a user would: ``lance-cf
validate``, ``lance-cf build``, ``lance-cf verify``, ``datasets.load_dataset`` on the release; a rebuild is
byte-identical, and a killed-then-resumed build would replay from the same ledger as every other mode.
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
from lance_pipeline.release_kinds import RELEASE_KINDS, ReleaseKind
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


# What the mode's releases are (in a project: ``lance_pipeline/my_mode/release_kind.py``), recognised by its source.
PAINTED = ReleaseKind(
    name="painted",
    title="painted patterns",
    card_intro=f"{__name__}:painted_intro",
    main_config="painted",
    next_commands=("lance-cf verify {release}",),
    source_kinds=("pattern",),
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
    assert f"next:\n  lance-cf verify {tmp_path / 'b'}\n" in out  # the kind's own next: lines, and only them
    assert release_files(tmp_path / "a") == release_files(tmp_path / "b")  # reproducible by construction
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["kind"] == "painted"  # the build records the kind its source declares
    assert "synthetic **painted patterns**, one per planned sample" in (tmp_path / "a" / "README.md").read_text()
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
