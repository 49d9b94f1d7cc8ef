"""Named distribution shifts for generation modes: ImageNet*'s 23 shifts plus ``base`` (dataset interfaces).

Vendrow et al., "Dataset Interfaces" (arXiv 2302.07865) generate each class under a shift with a prompt such as
"a photo of a <token> in the snow" and keep an image only when CLIP finds both the class ("a photo of a <class>")
and the shift ("a photo in the snow") in it.

Provenance of every value, stated per shift in ``Shift.provenance``:

* ``confirmed``: the prompt appears verbatim in MadryLab's example notebook (base, in the grass, in the snow, in bright
  sunlight, oil painting).
* ``inferred``: the prompt follows the released shift key (``in_the_water`` -> "... in the water"); the paper's exact
  wording could not be read from this offline machine.
* ``threshold``: only two CLIP thresholds are known here (paper Table 1, as quoted in our issue tracker: "in the
  snow" 0.160, "pencil sketch" 0.223). Every other shift has ``threshold=None``: such a shift keeps every image unless
  the build config sets a threshold, and the card says so. ``released_kept_fraction`` is the share of images the
  released ImageNet* masks keep for that shift (read from ``masks.npy``; see docs), a reference to calibrate against.

Style shifts use "a <class>" rather than "a photo of a <class>" in the object-presence prompt, as the paper does for
them: a pencil sketch of a dog is not a photo of a dog.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TOKEN_PLACEHOLDER = "<TOKEN>"


@dataclass(frozen=True)
class Shift:
    """One named shift.

    Attributes:
        name: Config name in the release (``[a-z0-9_]+``).
        prompt: Generation prompt; ``<TOKEN>`` becomes the class token (or the class name for plain prompts).
        shift_caption: CLIP text for shift presence ("a photo in the snow"); None for ``base``.
        style: A style shift: object presence is scored against "a <class>" instead of "a photo of a <class>".
        threshold: Minimum CLIP shift-presence similarity to keep an image; None keeps all (unknown threshold).
        released_kept_fraction: Share kept by ImageNet*'s released masks (reference only), None if not released.
        provenance: ``confirmed`` or ``inferred`` (the prompt), see the module docstring.
    """

    name: str
    prompt: str
    shift_caption: str | None
    style: bool = False
    threshold: float | None = None
    released_kept_fraction: float | None = None
    provenance: str = "inferred"

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9_]+", self.name):
            raise ValueError(f"shift name {self.name!r}: use lowercase letters, digits and '_' (it names a config)")
        if TOKEN_PLACEHOLDER not in self.prompt:
            raise ValueError(f"shift {self.name!r}: prompt {self.prompt!r} must contain {TOKEN_PLACEHOLDER}")
        if self.threshold is not None and not -1.0 <= self.threshold <= 1.0:
            raise ValueError(f"shift {self.name!r}: threshold {self.threshold} is not a cosine similarity")

    def object_caption(self, class_name: str) -> str:
        """CLIP text for object presence."""
        return f"a {class_name}" if self.style else f"a photo of a {class_name}"

    def render(self, token_or_name: str) -> str:
        return self.prompt.replace(TOKEN_PLACEHOLDER, token_or_name)

    @classmethod
    def from_dict(cls, data: dict) -> Shift:
        known = {"name", "prompt", "shift_caption", "style", "threshold", "released_kept_fraction", "provenance"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"shift {data.get('name')!r}: unknown key(s) {unknown}; known: {sorted(known)}")
        if "name" not in data or "prompt" not in data:
            raise ValueError(f"shift {data!r}: needs at least name and prompt")
        values = {"shift_caption": None, "provenance": "yours", **data}
        return cls(**values)


def _photo(name: str, phrase: str, kept: float, threshold: float | None = None, confirmed: bool = False) -> Shift:
    return Shift(
        name,
        f"a photo of a {TOKEN_PLACEHOLDER} {phrase}",
        f"a photo {phrase}",
        threshold=threshold,
        released_kept_fraction=kept,
        provenance="confirmed" if confirmed else "inferred",
    )


def _colour(colour: str, kept: float) -> Shift:
    return Shift(
        colour, f"a photo of a {colour} {TOKEN_PLACEHOLDER}", f"a photo of something {colour}", False, None, kept
    )


IMAGENET_STAR_SHIFTS: tuple[Shift, ...] = (
    Shift("base", f"a photo of a {TOKEN_PLACEHOLDER}", None, released_kept_fraction=0.926, provenance="confirmed"),
    # background
    _photo("in_the_grass", "in the grass", 0.803, confirmed=True),
    _photo("in_the_beach", "on the beach", 0.629),  # the released key is spelled "in_the_beach"
    _photo("in_the_forest", "in the forest", 0.673),
    _photo("in_the_water", "in the water", 0.601),
    _photo("on_the_road", "on the road", 0.645),
    _photo("on_the_rocks", "on the rocks", 0.766),
    # weather
    _photo("in_the_snow", "in the snow", 0.732, threshold=0.160, confirmed=True),
    _photo("in_the_rain", "in the rain", 0.483),
    _photo("in_the_fog", "in the fog", 0.593),
    # lighting / time of day
    _photo("in_bright_sunlight", "in bright sunlight", 0.899, confirmed=True),
    _photo("at_night", "at night", 0.611),
    _photo("at_dusk", "at dusk", 0.619),
    _photo("studio_lighting", "in studio lighting", 0.666),
    # object colour
    _colour("blue", 0.591),
    _colour("green", 0.513),
    _colour("red", 0.596),
    _colour("yellow", 0.433),
    _colour("orange", 0.410),
    # co-occurrence
    Shift("person_and_a", f"a photo of a person and a {TOKEN_PLACEHOLDER}", "a photo of a person", False, None, 0.299),
    Shift("and_a_flower", f"a photo of a {TOKEN_PLACEHOLDER} and a flower", "a photo of a flower", False, None, 0.619),
    # style / medium
    Shift(
        "oil_painting", f"an oil painting of a {TOKEN_PLACEHOLDER}", "an oil painting", True, None, 0.467, "confirmed"
    ),
    Shift("pencil_sketch", f"a pencil sketch of a {TOKEN_PLACEHOLDER}", "a pencil sketch", True, 0.223, 0.446),
    Shift("embroidery", f"an embroidery of a {TOKEN_PLACEHOLDER}", "an embroidery", True, None, 0.221),
)


def shifts_by_name(names: list[str] | None = None, custom: list[dict] | None = None) -> list[Shift]:
    """The shifts a build uses: named ImageNet* shifts (default: all) plus user-defined ones (dicts)."""
    table = {s.name: s for s in IMAGENET_STAR_SHIFTS}
    chosen: list[Shift] = []
    for name in names if names is not None else list(table):
        if name not in table:
            import difflib

            close = difflib.get_close_matches(name, table, n=2)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(
                f"unknown shift {name!r}{hint} (define it under custom_shifts, or pick from {sorted(table)})"
            )
        chosen.append(table[name])
    chosen += [Shift.from_dict(d) for d in custom or []]
    names_seen = [s.name for s in chosen]
    if len(set(names_seen)) != len(names_seen):
        raise ValueError(f"shifts listed twice: {sorted({n for n in names_seen if names_seen.count(n) > 1})}")
    return chosen
