"""Per-class object-presence thresholds of dataset interfaces (Vendrow et al., arXiv 2302.07865, Appendix A.3).

The paper keeps a generated image of class c only if its CLIP similarity to "a photo of a <class>" reaches a threshold
set **per class**: a percentile of the similarities between that caption and every real image of c (ImageNet's
validation set). The percentile's value is missing from the copy of the paper this project works from ("at the
percentile"), so it is an option; ``DEFAULT_PERCENTILE`` is ours, and a thresholds file says whether its percentile
was that default.

A thresholds file (JSON, written by ``lance-cf interfaces calibrate``) holds, per class **index** (the label of the
source's label space, with the class's name beside it), the threshold for the photo caption and for the art-style
caption "a <class>" (§3.1, footnote 2: art-style shifts score object presence against it), with the number of real
images each was computed from, plus the CLIP model, the percentile and the source. Never per name: ImageNet-1k's
readable names repeat (two "missile", two "sunglasses"), and a file keyed by name kept one class of each pair and
silently gave it to both. The filter stage (``generation.ShiftFilterStage``) reads it and refuses a file made with another CLIP model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lance_pipeline.interfaces.shifts import OBJECT_CAPTION, STYLE_OBJECT_CAPTION
from lance_pipeline.readers import read_json

FORMAT = "lance-cf object thresholds"
# Version 1 keyed classes by name (one of two same-named classes overwrote the other); it is refused, not converted.
FORMAT_VERSION = 2
# Ours: the paper's percentile did not survive in our copy. Its base yield (92.6% of base images kept by the object
# filter alone, Table 1) points at a low percentile; 5 rejects about one real image in twenty.
DEFAULT_PERCENTILE = 5.0
METHOD = "numpy.percentile, linear interpolation, over the cosine similarities of one class's real images"
CAPTIONS = {"photo": OBJECT_CAPTION, "style": STYLE_OBJECT_CAPTION}


def percentile_threshold(similarities: list[float], percentile: float) -> float:
    """The ``percentile``-th percentile of one class's similarities (numpy's default, linear interpolation)."""
    import numpy as np

    if not similarities:
        raise ValueError("no similarities to take a percentile of")
    return float(np.percentile(np.asarray(similarities, dtype=np.float64), percentile))


def check_percentile(percentile: Any) -> float:
    if isinstance(percentile, bool) or not isinstance(percentile, int | float) or not 0.0 <= percentile <= 100.0:
        raise ValueError(f"percentile {percentile!r}: expected a number from 0 to 100")
    return float(percentile)


@dataclass
class ClassThreshold:
    label: int
    images: int
    photo: float
    style: float
    name: str = ""


@dataclass
class ObjectThresholds:
    """A thresholds file's content. ``clip`` names the CLIP model (``model``, ``pretrained``, ``revision``)."""

    clip: dict[str, Any]
    percentile: float
    percentile_is_default: bool
    source: str
    classes: dict[int, ClassThreshold] = field(default_factory=dict)

    def threshold(self, label: int, style: bool) -> float | None:
        """The threshold of class index ``label`` (never looked up by name: names repeat)."""
        entry = self.classes.get(label)
        if entry is None:
            return None
        return entry.style if style else entry.photo

    def mismatched_names(self, classes: dict[int, str]) -> list[tuple[int, str, str]]:
        """(label, the build's name, the file's name) of each class whose index names another class in the file: the
        file was calibrated on another label space."""
        return [
            (label, name, self.classes[label].name)
            for label, name in sorted(classes.items())
            if label in self.classes and self.classes[label].name != name
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "clip": dict(self.clip),
            "percentile": self.percentile,
            "percentile_is_default": self.percentile_is_default,
            "percentile_note": (
                "the default percentile is lance-cf's choice: the paper's value is not in the text we work from"
                if self.percentile_is_default
                else "percentile chosen by the user"
            ),
            "captions": dict(CAPTIONS),
            "method": METHOD,
            "source": self.source,
            "classes": {
                str(label): {"label": c.label, "name": c.name, "images": c.images, "photo": c.photo, "style": c.style}
                for label, c in sorted(self.classes.items())
            },
        }

    def write(self, path: str | Path) -> Path:
        import os

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
        tmp.replace(path)
        return path

    @classmethod
    def read(cls, path: str | Path) -> ObjectThresholds:
        """Read and check a thresholds file; every problem is one ``ValueError`` line naming the file."""
        path = Path(path)
        where = f"object thresholds {path}"
        if not path.exists():
            raise ValueError(f"{where}: no such file; make it with `lance-cf interfaces calibrate`")
        data = read_json(path, what=where)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{where}: not a thresholds file of `lance-cf interfaces calibrate`")
        if data.get("format_version") == 1:
            raise ValueError(
                f"{where}: format version 1 keyed thresholds by class name, so of two classes with one name (ImageNet's "
                "two 'missile', two 'sunglasses') one was lost; recalibrate with `lance-cf interfaces calibrate`"
            )
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{where}: format version {data.get('format_version')!r}, expected {FORMAT_VERSION}")
        clip = data.get("clip")
        if not isinstance(clip, dict) or not isinstance(clip.get("model"), str):
            raise ValueError(f"{where}: 'clip' must name the CLIP model the thresholds were computed with")
        try:
            percentile = check_percentile(data.get("percentile"))
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        raw = data.get("classes")
        if not isinstance(raw, dict) or not raw:
            raise ValueError(f"{where}: 'classes' must map class indices to their thresholds")
        classes: dict[int, ClassThreshold] = {}
        for key, entry in raw.items():
            if not isinstance(entry, dict):
                raise ValueError(f"{where}: class {key[:60]!r}: expected label, name, images, photo and style")
            for field_name in ("photo", "style"):
                value = entry.get(field_name)
                if (
                    isinstance(value, bool)
                    or not isinstance(value, int | float)
                    or not math.isfinite(value)
                    or not -1.0 <= value <= 1.0
                ):
                    raise ValueError(f"{where}: class {key[:60]!r}: {field_name} {value!r} is not a cosine in [-1, 1]")
            for field_name in ("label", "images"):
                value = entry.get(field_name)
                if (
                    isinstance(value, bool)
                    or not isinstance(value, int)
                    or value < (1 if field_name == "images" else 0)
                ):
                    raise ValueError(f"{where}: class {key[:60]!r}: {field_name} {value!r} is not a count")
            if key != str(entry["label"]):
                raise ValueError(f"{where}: class {key[:60]!r}: keys are class indices, and this one's label is "
                                 f"{entry['label']}")  # fmt: skip
            if not isinstance(entry.get("name"), str) or not entry["name"]:
                raise ValueError(f"{where}: class {key[:60]!r}: 'name' must be the class's name")
            classes[entry["label"]] = ClassThreshold(
                entry["label"], entry["images"], float(entry["photo"]), float(entry["style"]), entry["name"]
            )
        return cls(
            clip={k: clip.get(k) for k in ("model", "pretrained", "revision")},
            percentile=percentile,
            percentile_is_default=bool(data.get("percentile_is_default")),
            source=str(data.get("source", "")),
            classes=classes,
        )


def class_similarities(scorer: Any, images: Any, class_name: str, batch: int = 32) -> tuple[list[float], list[float]]:
    """CLIP cosine similarities of real images (an iterable of PIL images, read lazily, ``batch`` at a time) to the
    photo caption and to the style caption of ``class_name``; ``scorer`` is a loaded ``clip.gates.ClipScorer``."""
    texts = scorer.encode_texts([OBJECT_CAPTION.format(class_name), STYLE_OBJECT_CAPTION.format(class_name)])
    photo: list[float] = []
    style: list[float] = []
    pending: list[Any] = []

    def flush() -> None:
        if pending:
            sims = scorer.encode_images(pending) @ texts.T
            photo.extend(sims[:, 0].tolist())
            style.extend(sims[:, 1].tolist())
            pending.clear()

    for image in images:
        pending.append(image)
        if len(pending) >= batch:
            flush()
    flush()
    return photo, style
