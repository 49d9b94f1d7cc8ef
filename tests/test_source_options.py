"""Sources declare their options one way: every registered source has one typed ``Options`` dataclass
(``options_class``), constructed once per build by validation and reused by the engine; the one-line docs of
``presets --show`` cover every option; a source written before sources declared options (its options are its
constructor's keywords) is still checked and hashed by value."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import pytest
from builder_helpers import make_imagefolder, write_config

from builder.cli import main
from builder.config import load_config
from builder.config_docs import SOURCE_OPTION_DOCS
from builder.engine import build
from builder.registry import SOURCES
from builder.sources import (
    ImageFolderOptions,
    ImageFolderSource,
    LabelSpace,
    Source,
    SourceSample,
    check_source_options,
    create_source,
)
from lance_pipeline.option_types import Options, PositiveInt
from lance_pipeline.stage import options_type, stage_options


def test_every_registered_source_declares_one_typed_options_class():
    for scheme in SOURCES.names():
        cls = SOURCES.resolve(scheme)
        declared = cls.__dict__.get("options_class")
        assert declared is not None and issubclass(declared, Options), scheme
        assert dataclasses.is_dataclass(declared) and options_type(cls) is declared, scheme


def test_presets_show_describes_every_option_of_every_source():
    fields = {f.name for s in SOURCES.names() for f in dataclasses.fields(SOURCES.resolve(s).options_class)}
    assert fields == set(SOURCE_OPTION_DOCS)


def test_a_python_caller_writes_keywords_or_one_typed_options_object(tmp_path):
    folder = make_imagefolder(tmp_path / "photos", ["cat"], per_class=1)
    spec = f"imagefolder:{folder}"
    assert ImageFolderSource(spec, str(folder), max_image_bytes=1 << 20).options == ImageFolderOptions(1 << 20)
    with pytest.raises(ValueError, match=r"option max_image_bytes = 0: expected an integer >= 1"):
        ImageFolderSource(spec, str(folder), max_image_bytes=0)
    with pytest.raises(TypeError, match="not both"):
        ImageFolderSource(spec, str(folder), ImageFolderOptions(), max_image_bytes=1)
    typed = check_source_options(spec, {"max_image_bytes": 4096})
    assert create_source(spec, typed).options is typed  # not constructed again


# -- constructed once per build --------------------------------------------------------------------------------------
CONSTRUCTED: list[Any] = []


@dataclass
class CountedOptions(Options):
    per_class: PositiveInt = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        CONSTRUCTED.append(self)


class _GreySource(Source):
    """``SCHEME:N``: N classes of ``per_class`` grey images."""

    def _list(self, path: str, per_class: int) -> None:
        self.label_space = LabelSpace("custom", [f"c{i}" for i in range(int(path))])
        self.samples = [
            SourceSample(f"c{label}_{i}", label, f"class {label} image {i}")
            for label in range(int(path))
            for i in range(per_class)
        ]

    def read(self, sample: SourceSample) -> bytes:
        import io

        from PIL import Image

        buffer = io.BytesIO()
        Image.new("RGB", (16, 16), (20 * sample.label, 90, 90)).save(buffer, format="PNG")
        return buffer.getvalue()


class CountedSource(_GreySource):
    """Counts how often its options are constructed (``CONSTRUCTED``)."""

    options_class = CountedOptions

    def __init__(self, spec: str, path: str, options: CountedOptions | None = None, /, **values: Any):
        options = stage_options(type(self), options, values)
        super().__init__(spec=spec, kind="counted", options=options)
        self._list(path, options.per_class)


@pytest.fixture
def counted():
    SOURCES.register("counted", f"{__name__}:CountedSource")
    CONSTRUCTED.clear()
    yield
    SOURCES.unregister("counted")


def test_a_build_constructs_the_source_options_once(tmp_path, counted, capsys):
    config = write_config(tmp_path / "c.yaml", "counted:2", source_options={"per_class": 2}, image_size=16)
    manifest = build(load_config(str(config)), tmp_path / "out", progress=False)
    assert manifest["counts"]["original"]["total"] == 4
    assert len(CONSTRUCTED) == 1
    CONSTRUCTED.clear()
    assert main(["validate", str(config)]) == 0
    assert "source: counted:2 (4 images, 2 classes)" in capsys.readouterr().out
    assert len(CONSTRUCTED) == 1


# -- a source written before sources declared options_class -----------------------------------------------------------
class KeywordSource(_GreySource):
    """Options as annotated constructor keywords, the way sources declared them before ``options_class``."""

    def __init__(self, spec: str, path: str, per_class: PositiveInt = 1):
        super().__init__(spec=spec, kind="keyword")
        self._list(path, per_class)


@pytest.fixture
def keyword():
    SOURCES.register("keyword", f"{__name__}:KeywordSource")
    yield
    SOURCES.unregister("keyword")


def test_a_source_with_keyword_options_is_still_checked_and_hashed_by_value(tmp_path, keyword, capsys):
    assert [f.name for f in dataclasses.fields(options_type(KeywordSource))] == ["per_class"]
    assert len(create_source("keyword:2", {"per_class": 2}).samples) == 4
    bad = write_config(tmp_path / "bad.yaml", "keyword:2", source_options={"per_class": 0})
    assert main(["validate", str(bad)]) == 2
    assert "source 'keyword:2': option per_class = 0: expected an integer >= 1" in capsys.readouterr().err
    hashes = [
        load_config(str(write_config(tmp_path / f"{n}.yaml", "keyword:2", source_options=o))).config_hash()
        for n, o in (("bare", {}), ("written", {"per_class": 1}), ("two", {"per_class": 2}))
    ]
    assert hashes[0] == hashes[1] != hashes[2]
