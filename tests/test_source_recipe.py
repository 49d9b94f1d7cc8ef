"""The recipe "A source" of docs/architecture.md, followed from a test file: a ``Source`` subclass and one registry
line (here ``SOURCES.register`` from the test, in a project the line in ``builder/registry.py``), nothing else.

The new source (``stripes:N``: N classes of synthetic striped images) is then used the way a user would: ``lance-cf
validate`` and ``lance-cf build`` (in process), ``lance-cf verify``; its options are checked by the one option
checker; two builds give byte-identical releases.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from builder_helpers import release_files, write_config
from PIL import Image

from builder.cli import main
from builder.registry import SOURCES
from builder.sources import LabelSpace, Source, SourceSample


class StripesSource(Source):
    """``stripes:N``: N classes; class c's images have c + 1 stripes, each image a different colour."""

    def __init__(self, spec: str, path: str, per_class: int = 2, size: int = 24):
        super().__init__(spec=spec, kind="stripes", license="Synthetic images, CC0.")
        if not path.isdigit() or int(path) < 1:
            raise ValueError(f"source {spec!r}: expected stripes:N with N >= 1 classes")
        self.size = size
        self.label_space = LabelSpace("custom", [f"{i + 1} stripes" for i in range(int(path))])
        self.samples = [
            SourceSample(f"s{label}_{i:03d}", label, f"class {label} image {i}")
            for label in range(int(path))
            for i in range(per_class)
        ]

    def read(self, sample: SourceSample) -> bytes:
        label, index = sample.label, int(sample.key.rsplit("_", 1)[1])
        image = np.zeros((self.size, self.size, 3), np.uint8)
        width = self.size // (2 * (label + 1))
        for stripe in range(label + 1):
            image[:, 2 * stripe * width : (2 * stripe + 1) * width] = (40 * index % 256, 200, 90)
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
        ({"per_class": "two"}, "option per_class = 'two' should be an integer"),
        ({"per_clas": 2}, "does not take option(s) per_clas"),
    ]:
        config = write_config(tmp_path / "c.yaml", "stripes:3", source_options=options)
        assert main(["validate", str(config)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and expected in err, err
