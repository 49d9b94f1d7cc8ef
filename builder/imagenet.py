"""ImageNet-1k label space: synsets (WordNet ids) to indices and readable class names.

Both lists ship with this package (``builder/imagenet_classes.json``), so reading a label space imports neither torch,
timm nor open_clip. Indices and synsets are timm's ImageNet metadata (``timm.data.ImageNetInfo``), the order every
ImageNet-1k classifier in timm uses. Readable names are OpenAI CLIP's cleaned class names as bundled by open_clip
(``"dog sled"`` rather than ``"dogsled, dog sled, dog sleigh"``): the label-preservation check compares edit spans
against these names, so they must read like words, not WordNet glosses. A test checks the file against both packages.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from importlib import resources
from typing import Any

NUM_CLASSES = 1000
SYNSET_PATTERN = re.compile(r"^n\d{8}$")

# Hard ImageNet (Moayeri et al., NeurIPS 2022): 15 classes whose models rely on spurious features; LANCE Table 2
# evaluates on their 50 ImageNet validation images each. "sunglasses" is n04356056 (index 837).
HARD_IMAGENET_CLASSES = {
    "dog sled": 537,
    "howler monkey": 379,
    "seat belt": 785,
    "ski": 795,
    "sunglasses": 837,
    "swimming cap": 433,
    "balance beam": 416,
    "gymnastic horizontal bar": 602,
    "patio": 706,
    "hockey puck": 746,
    "miniskirt": 655,
    "keyboard space bar": 810,
    "volleyball": 890,
    "baseball player": 981,
    "snorkel": 801,
}


CLASSES_FILE = "imagenet_classes.json"


@functools.cache
def _classes() -> dict[str, Any]:
    data = json.loads((resources.files("builder") / CLASSES_FILE).read_text(encoding="utf-8"))
    for field in ("synsets", "names"):
        if len(data[field]) != NUM_CLASSES:  # a damaged installation, not a user error
            raise RuntimeError(
                f"builder/{CLASSES_FILE}: {field} has {len(data[field])} entries, expected {NUM_CLASSES}"
            )
    return data


@functools.cache
def class_names() -> tuple[str, ...]:
    """Readable ImageNet-1k class names, index order."""
    return tuple(_classes()["names"])


@functools.cache
def synsets() -> tuple[str, ...]:
    """WordNet synsets (``n01440764``), index order."""
    return tuple(_classes()["synsets"])


@functools.cache
def synset_to_index() -> dict[str, int]:
    return {s: i for i, s in enumerate(synsets())}


def is_synset(name: str) -> bool:
    return bool(SYNSET_PATTERN.match(name)) and name in synset_to_index()


def resolve_class(spec: str) -> int:
    """An ImageNet-1k class given as a synset (``n03218198``), an index (``537``) or a name (``dog sled``)."""
    spec = spec.strip()
    if SYNSET_PATTERN.match(spec):
        if spec not in synset_to_index():
            raise ValueError(f"class {spec!r}: not an ImageNet-1k synset")
        return synset_to_index()[spec]
    if spec.isdigit():
        index = int(spec)
        if not 0 <= index < NUM_CLASSES:
            raise ValueError(f"class {spec!r}: ImageNet-1k indices run from 0 to 999")
        return index
    names = [n.lower() for n in class_names()]
    matches = [i for i, n in enumerate(names) if n == spec.lower()]
    if len(matches) > 1:  # e.g. "sunglasses" names both 836 and 837
        raise ValueError(f"class {spec!r} is ambiguous: ImageNet-1k indices {matches}; give the index or synset")
    if matches:
        return matches[0]
    close = difflib.get_close_matches(spec.lower(), names, n=3)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise ValueError(f"class {spec!r}: not an ImageNet-1k synset, index or class name{hint}")
