"""ImageNet-1k label space: synsets (WordNet ids) to indices and readable class names.

Indices and synsets come from timm's bundled ImageNet metadata (``timm.data.ImageNetInfo``), the same order every
ImageNet-1k classifier in timm uses. Readable names are OpenAI CLIP's cleaned class names as bundled by open_clip
(``"dog sled"`` rather than ``"dogsled, dog sled, dog sleigh"``): the label-preservation check compares edit spans
against these names, so they must read like words, not WordNet glosses.
"""

from __future__ import annotations

import difflib
import functools
import re

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


@functools.cache
def _info():
    from timm.data import ImageNetInfo

    return ImageNetInfo("imagenet-1k")


@functools.cache
def class_names() -> tuple[str, ...]:
    """Readable ImageNet-1k class names, index order."""
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES

    if len(IMAGENET_CLASSNAMES) != NUM_CLASSES:
        raise RuntimeError(f"open_clip's ImageNet class list has {len(IMAGENET_CLASSNAMES)} names, expected 1000")
    return tuple(IMAGENET_CLASSNAMES)


@functools.cache
def synsets() -> tuple[str, ...]:
    return tuple(_info().label_names())


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
