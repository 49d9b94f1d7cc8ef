"""The recipe "A source kind" of docs/architecture.md, followed from a test file: one module (its typed options and a
``Source`` subclass) and one registry line (here ``SOURCES.register`` from the test, in a project the line in
``builder/registry.py``), nothing else: two files.

The new source (``stripes:N``: N classes of synthetic striped images) is then used the way a user would: ``lance-cf
validate`` and ``lance-cf build`` (in process), ``lance-cf verify``; its options are checked by the one option
checker (their annotations: "did you mean", one-line errors); two builds give byte-identical releases, and writing an
option at its default is the same config.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
import pytest
from builder_helpers import release_files, write_config
from PIL import Image

from builder.cli import main
from builder.config import load_config
from builder.registry import SOURCES
from builder.sources import LabelSpace, Source, SourceSample
from lance_pipeline.option_types import Fraction, Interval, Options, PositiveInt
from lance_pipeline.stage import stage_options


@dataclass
class StripesOptions(Options):
    """The source's options: each annotation is the value's only check (type, bounds)."""

    per_class: PositiveInt = 2
    size: Annotated[int, Interval(ge=8, le=256)] = 24
    brightness: Fraction = 1.0  # of the stripes' colour


class StripesSource(Source):
    """``stripes:N``: N classes; class c's images have c + 1 stripes, each image a different colour."""

    options_class = StripesOptions

    def __init__(self, spec: str, path: str, options: StripesOptions | None = None, /, **values: Any):
        options = stage_options(type(self), options, values)  # validation's typed options, or made from keywords
        super().__init__(spec=spec, kind="stripes", license="Synthetic images, CC0.", options=options)
        if not path.isdigit() or int(path) < 1:
            raise ValueError(f"source {spec!r}: expected stripes:N with N >= 1 classes")
        self.size, self.brightness = options.size, options.brightness
        self.label_space = LabelSpace("custom", [f"{i + 1} stripes" for i in range(int(path))])
        self.samples = [
            SourceSample(f"s{label}_{i:03d}", label, f"class {label} image {i}")
            for label in range(int(path))
            for i in range(options.per_class)
        ]

    def read(self, sample: SourceSample) -> bytes:
        label, index = sample.label, int(sample.key.rsplit("_", 1)[1])
        image = np.zeros((self.size, self.size, 3), np.uint8)
        width = self.size // (2 * (label + 1))
        for stripe in range(label + 1):
            colour = np.array([40 * index % 256, 200, 90]) * self.brightness
            image[:, 2 * stripe * width : (2 * stripe + 1) * width] = colour.round().astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        return buffer.getvalue()


@pytest.fixture
def stripes():
    SOURCES.register("stripes", f"{__name__}:StripesSource")
    yield
    SOURCES.unregister("stripes")


def test_a_source_registered_from_a_test_file_builds_verifies_and_rebuilds_identically(tmp_path, capsys, stripes):
    config = write_config(tmp_path / "c.yaml", "stripes:3", source_options={"per_class": 2}, image_size=16)
    assert main(["validate", str(config)]) == 0
    assert "source: stripes:3 (6 images, 3 classes)" in capsys.readouterr().out
    for name in ("a", "b"):
        assert main(["build", str(config), "--output", str(tmp_path / name), "--no-progress"]) == 0
        assert main(["verify", str(tmp_path / name)]) == 0
    a, b = release_files(tmp_path / "a"), release_files(tmp_path / "b")
    assert a == b and any(path.endswith(".tar") for path in a)
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["label_space"]["names"] == ["1 stripes", "2 stripes", "3 stripes"]
    assert manifest["counts"]["original"]["by_class"] == {"0": 2, "1": 2, "2": 2}
    assert manifest["source"]["kind"] == "stripes" and manifest["source"]["license"] == "Synthetic images, CC0."


def test_the_new_sources_options_are_checked_by_the_one_checker(tmp_path, capsys, stripes):
    for options, expected in [
        ({"per_class": "two"}, "source 'stripes:3': option per_class = 'two': expected an integer >= 1"),
        ({"size": 4}, "source 'stripes:3': option size = 4: expected an integer in [8, 256]"),
        ({"per_clas": 2}, "source 'stripes:3': unknown option 'per_clas'; did you mean 'per_class'?"),
    ]:
        config = write_config(tmp_path / "c.yaml", "stripes:3", source_options=options)
        assert main(["validate", str(config)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and expected in err, err


def test_the_new_sources_defaults_written_out_are_the_same_config(tmp_path, stripes):
    """Its options are hashed by their effective values: its defaults written out (``brightness: 1`` for ``1.0``) are
    the same config, with the same shards and index; another value is another config."""
    configs = {}
    for name, options in [("bare", {}), ("written", {"per_class": 2, "size": 24, "brightness": 1}), ("dim", {})]:
        options = {"brightness": 0.5} if name == "dim" else options
        configs[name] = write_config(tmp_path / f"{name}.yaml", "stripes:2", source_options=options, image_size=16)
    hashes = {name: load_config(str(path)).config_hash() for name, path in configs.items()}
    assert hashes["bare"] == hashes["written"] != hashes["dim"]
    releases = {}
    for name in ("bare", "written"):
        assert main(["build", str(configs[name]), "--output", str(tmp_path / name), "--no-progress"]) == 0
        releases[name] = release_files(tmp_path / name)
        manifest = json.loads((tmp_path / name / "manifest.json").read_text())
        assert manifest["config_hash"] == hashes[name]
    samples = [{k: v for k, v in files.items() if k.startswith(("data/", "index/"))} for files in releases.values()]
    assert samples[0] == samples[1] and any(k.startswith("index/") for k in samples[0])
