"""``generate:`` sources: a plan of images to GENERATE (class x shift x index), for dataset interfaces.

Where other sources list real images, this one lists what a generation mode must make: for each class of a label
space, each named shift (``lance_pipeline.interfaces.shifts``) and ``per_class`` indices, one sample whose record carries the
shift's prompt template, CLIP captions and threshold instead of an image. The key ``{class}_{shift}_{i:03d}`` is
made from names only, so seeds (derived from the key) do not depend on anything local.

- ``generate:imagenet``: ImageNet-1k classes (``classes`` picks a subset by synset, index or name, as ``imagenet:``).
- ``generate:FILE.txt``: one class name per line, labels in file order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder import imagenet
from builder.release_format import sanitize_key
from builder.sources import LabelSpace, Source, SourceSample, imagenet_label_space
from lance_pipeline.interfaces.shifts import shifts_by_name
from lance_pipeline.option_types import Options, PositiveInt
from lance_pipeline.stage import stage_options

# The fields every generated record carries in place of an image (name -> contract kind).
GENERATED_FIELDS = {
    "shift": "str",
    "prompt_template": "str",
    "object_caption": "str",
    "shift_caption": "any",  # str, or None for base
    "shift_threshold": "any",  # float, or None when unknown
}


@dataclass
class GenerationSourceOptions(Options):
    classes: list[str | int] | None = None  # a subset of the label space (ImageNet: synsets, indices or names)
    shifts: list[str] | None = None  # shift names (``lance-cf interfaces shifts``); left out: every built-in shift
    custom_shifts: list[dict] | None = None  # shifts of the config's own (name, prompt, ...)
    per_class: PositiveInt = 50  # images of each class and shift

    def __post_init__(self) -> None:
        super().__post_init__()
        # A look-up and a relation no annotation can say: every shift named is built in or among custom_shifts.
        shifts_by_name(self.shifts, self.custom_shifts)


class GenerationSource(Source):
    """Plans class x shift x index samples; nothing is read from disk but an optional class-name file."""

    generates = True
    fields = GENERATED_FIELDS  # what each record starts with instead of an image (validated before any build)

    options_class = GenerationSourceOptions

    def __init__(self, spec: str, path: str, options: GenerationSourceOptions | None = None, /, **values: Any):
        options = stage_options(type(self), options, values)
        super().__init__(spec=spec, kind="generate", options=options)
        classes, per_class = options.classes, options.per_class
        self.shifts = shifts_by_name(options.shifts, options.custom_shifts)
        self.per_class = per_class
        if path == "imagenet":
            self.label_space = imagenet_label_space()
            self.imagenet_derived = False  # generated images hold no ImageNet pixels
            wanted = sorted({imagenet.resolve_class(str(c)) for c in classes}) if classes else None
            labels = wanted if wanted is not None else list(range(self.label_space.num_classes))
            class_keys = {i: imagenet.synsets()[i] for i in labels}
        else:
            names_file = Path(path)
            if not names_file.is_file():
                raise ValueError(
                    f"source {spec!r}: expected generate:imagenet or generate:FILE.txt (one class per line)"
                )
            names = [line.strip() for line in names_file.read_text(encoding="utf-8").splitlines() if line.strip()]
            if not names or len(set(names)) != len(names):
                raise ValueError(f"source {spec!r}: {path} must list distinct class names, one per line")
            self.label_space = LabelSpace("custom", names)
            if classes:
                unknown = [c for c in classes if str(c) not in names]
                if unknown:
                    raise ValueError(f"source {spec!r}: classes {unknown} are not in {path}")
                labels = [names.index(str(c)) for c in classes]
            else:
                labels = list(range(len(names)))
            class_keys = {i: _class_key(names[i]) for i in labels}
        self.license = (
            "Generated images; the generator's licence applies (Stable Diffusion 2: CreativeML Open RAIL++-M)."
        )
        self._by_key: dict[str, dict[str, Any]] = {}
        samples = []
        for label in sorted(class_keys):
            for shift in self.shifts:
                for i in range(per_class):
                    key = f"{class_keys[label]}_{shift.name}_{i:03d}"
                    samples.append(SourceSample(key, label, f"{self.label_space.names[label]} / {shift.name} / {i}"))
                    self._by_key[key] = {
                        "shift": shift.name,
                        "prompt_template": shift.prompt,
                        "object_caption": shift.object_caption(self.label_space.names[label]),
                        "shift_caption": shift.shift_caption,
                        "shift_threshold": shift.threshold,
                    }
        self.samples = sorted(samples, key=lambda s: s.key)

    def read(self, sample: SourceSample) -> bytes:
        raise TypeError("a generate: source has no images to read; its records are made by a generation stage")

    def record_fields(self, sample: SourceSample) -> dict[str, Any]:
        """The JSON fields this sample's record starts with (in place of a decoded image)."""
        return dict(self._by_key[sample.key])

    def release_configs(self) -> list[str]:
        """One release config per shift, in the declared order."""
        return [s.name for s in self.shifts]

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "per_class": self.per_class, "shifts": [s.to_dict() for s in self.shifts]}

    # What `presets --show` says beside these keys for a build with this source (builder.config_docs).
    key_docs = {
        "configs": (
            "release configs to build: base and the shifts (`lance-cf interfaces shifts` lists them), plus rejected "
            "when the filter keeps rejected images",
            "Vendrow et al. 2023, Table 1",
        ),
        "image_size": (
            "not used by a generation build: the generate stage's image_size is the released images' side",
            "tool",
        ),
    }


MAX_CLASS_KEY = 48  # with a shift name (at most 64) and the index, a key stays a short file name


def _class_key(name: str) -> str:
    """A class's part of every sample key, from its name only: sanitised, and bounded (a long name keeps its first 39
    characters and a hash of the whole)."""
    import hashlib

    key = sanitize_key(name.replace(" ", "_"))
    if len(key) > MAX_CLASS_KEY:
        key = f"{key[:39]}-{hashlib.sha256(name.encode('utf-8')).hexdigest()[:8]}"
    return key
