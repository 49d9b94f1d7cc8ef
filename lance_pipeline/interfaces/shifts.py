"""Named distribution shifts for generation modes: ImageNet*'s 23 shifts plus ``base`` (dataset interfaces).

Vendrow et al., "Dataset Interfaces" (arXiv 2302.07865) generate each class under a shift with the prompt of their
Table 1 (Appendix A.5), the class written as its learned token, and keep an image only when CLIP finds both the class
and the shift in it (§3.1, Appendix A.3):

* shift presence: CLIP similarity between the image and "a photo <shift>" (Appendix C), at least the shift's
  threshold of Table 1 (``base`` has none);
* object presence: CLIP similarity between the image and "a photo of a <class>" ("a <class>" for the art styles, which
  are no longer photos: §3.1, footnote 2), at least a per-class threshold (``object_thresholds.py``).

``IMAGENET_STAR_SHIFTS`` is Table 1 as printed: every prompt verbatim, including its oddities ("on the road" and "on
the rocks" are prompted "in the road" / "in the rocks", "A photo of a orange", "An oil panting"), because those are
the prompts the published images were made with. A space lost after ``<class>`` in the text is restored. The shift
caption is "a photo " plus the shift's name in Table 1 ("a photo on the road", "a photo blue"), as Appendix C writes
it. Corrected wordings exist only as separately named variants (``CORRECTED_VARIANTS``, ``*_corrected``), never as
the default.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TOKEN_PLACEHOLDER = "<TOKEN>"
PAPER = "paper, Table 1"
MAX_SHIFT_NAME = 64  # a shift name is a release config name: a folder and part of every sample's key


@dataclass(frozen=True)
class Shift:
    """One named shift.

    Attributes:
        name: Config name in the release (``[a-z0-9_]+``, at most ``MAX_SHIFT_NAME`` characters).
        prompt: Generation prompt; ``<TOKEN>`` becomes the class token (or the class name for plain prompts).
        shift_caption: CLIP text for shift presence ("a photo in the snow"); None for ``base``.
        style: An art style: object presence is scored against "a <class>" instead of "a photo of a <class>".
        threshold: Minimum CLIP shift-presence similarity to keep an image; None: no shift criterion (``base``).
        paper_yield: Share of generated images the paper kept after both filters (Table 1), None if not the paper's.
        released_kept_fraction: Share kept by the masks MadryLab released (``masks.npy``), for reference.
        provenance: Where prompt, caption and threshold come from (``paper, Table 1``, ``ours: ...``, ``yours``).
    """

    name: str
    prompt: str
    shift_caption: str | None
    style: bool = False
    threshold: float | None = None
    paper_yield: float | None = None
    released_kept_fraction: float | None = None
    provenance: str = "yours"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", self.name):
            raise ValueError(
                f"shift name {self.name!r}: use lowercase letters, digits and '_', starting with a letter (it names a "
                "config)"
            )
        if len(self.name) > MAX_SHIFT_NAME:
            raise ValueError(
                f"shift name {self.name[:40]!r}... is {len(self.name)} characters: at most {MAX_SHIFT_NAME} (it names "
                "a folder and every sample of the shift)"
            )
        if not isinstance(self.prompt, str) or TOKEN_PLACEHOLDER not in self.prompt:
            raise ValueError(f"shift {self.name!r}: prompt {self.prompt!r} must contain {TOKEN_PLACEHOLDER}")
        if self.shift_caption is not None and not isinstance(self.shift_caption, str):
            raise ValueError(f"shift {self.name!r}: shift_caption must be text or null")
        if self.threshold is not None and (
            isinstance(self.threshold, bool)
            or not isinstance(self.threshold, int | float)
            or not -1.0 <= self.threshold <= 1.0
        ):
            raise ValueError(f"shift {self.name!r}: threshold {self.threshold!r} is not a cosine similarity in [-1, 1]")
        if not isinstance(self.style, bool):
            raise ValueError(f"shift {self.name!r}: style must be true or false")

    def object_caption(self, class_name: str) -> str:
        """CLIP text for object presence (§3.1 and its footnote 2)."""
        return object_caption(class_name, self.style)

    def render(self, token_or_name: str) -> str:
        return self.prompt.replace(TOKEN_PLACEHOLDER, token_or_name)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "prompt": self.prompt,
            "shift_caption": self.shift_caption,
            "style": self.style,
            "threshold": self.threshold,
            "paper_yield": self.paper_yield,
            "provenance": self.provenance,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Shift:
        known = {"name", "prompt", "shift_caption", "style", "threshold"}
        if not isinstance(data, dict):
            raise ValueError(f"custom shift {data!r}: expected a mapping with name, prompt, shift_caption, threshold")
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"shift {data.get('name')!r}: unknown key(s) {unknown}; known: {sorted(known)}")
        if "name" not in data or "prompt" not in data:
            raise ValueError(f"shift {data!r}: needs at least name and prompt")
        values = {"shift_caption": None, **data, "provenance": "yours"}
        return cls(**values)


OBJECT_CAPTION = "a photo of a {}"  # §3.1
STYLE_OBJECT_CAPTION = "a {}"  # §3.1, footnote 2: art styles are no longer photos
SHIFT_CAPTION = "a photo {}"  # Appendix C


def object_caption(class_name: str, style: bool) -> str:
    return (STYLE_OBJECT_CAPTION if style else OBJECT_CAPTION).format(class_name)


def _paper(
    name: str, shift: str, prompt: str, threshold: float, paper_yield: float, kept: float, style: bool = False
) -> Shift:
    """A row of Table 1: config name (the released mask key), the shift's name in the table, its prompt (``<class>``
    written as ``<TOKEN>``), CLIP threshold and yield; ``kept`` is the share the released masks keep."""
    return Shift(
        name,
        prompt.replace("<class>", TOKEN_PLACEHOLDER),
        SHIFT_CAPTION.format(shift),
        style=style,
        threshold=threshold,
        paper_yield=paper_yield,
        released_kept_fraction=kept,
        provenance=PAPER,
    )


IMAGENET_STAR_SHIFTS: tuple[Shift, ...] = (
    Shift(
        "base",
        f"A photo of a {TOKEN_PLACEHOLDER}",
        None,
        paper_yield=0.926,
        released_kept_fraction=0.926,
        provenance=PAPER,
    ),
    _paper("in_the_grass", "in the grass", "A photo of a <class> in the grass", 0.127, 0.803, 0.803),
    _paper("in_the_beach", "in the beach", "A photo of a <class> in the beach", 0.175, 0.629, 0.629),
    _paper("in_the_forest", "in the forest", "A photo of a <class> in the forest", 0.153, 0.673, 0.673),
    _paper("in_the_water", "in the water", "A photo of a <class> in the water", 0.163, 0.601, 0.601),
    _paper("on_the_road", "on the road", "A photo of a <class> in the road", 0.154, 0.645, 0.645),
    _paper("on_the_rocks", "on the rocks", "A photo of a <class> in the rocks", 0.124, 0.766, 0.766),
    _paper("in_the_snow", "in the snow", "A photo of a <class> in the snow", 0.160, 0.732, 0.732),
    _paper("in_the_rain", "in the rain", "A photo of a <class> in the rain", 0.173, 0.483, 0.483),
    _paper("in_the_fog", "in the fog", "A photo of a <class> in the fog", 0.152, 0.593, 0.593),
    _paper("in_bright_sunlight", "in bright sunlight", "A photo of a <class> in bright sunlight", 0.124, 0.899, 0.899),
    _paper("at_dusk", "at dusk", "A photo of a <class> at dusk", 0.158, 0.619, 0.619),
    _paper("at_night", "at night", "A photo of a <class> at night", 0.147, 0.611, 0.611),
    _paper("studio_lighting", "studio lighting", "A photo of a <class> in studio lighting", 0.140, 0.666, 0.666),
    _paper("blue", "blue", "A photo of a blue <class>", 0.163, 0.591, 0.591),
    _paper("green", "green", "A photo of a green <class>", 0.190, 0.513, 0.513),
    _paper("red", "red", "A photo of a red <class>", 0.167, 0.596, 0.596),
    _paper("yellow", "yellow", "A photo of a yellow <class>", 0.212, 0.433, 0.433),
    _paper("orange", "orange", "A photo of a orange <class>", 0.216, 0.410, 0.410),
    _paper("person_and_a", "person and a", "A photo of a person and a <class>", 0.181, 0.299, 0.299),
    _paper("and_a_flower", "and a flower", "A photo of a <class> and a flower", 0.148, 0.619, 0.619),
    _paper("oil_painting", "oil painting", "An oil panting of a <class>", 0.214, 0.672, 0.467, style=True),
    _paper("pencil_sketch", "pencil sketch", "A black and white pencil sketch of a <class>", 0.223, 0.618, 0.446, True),
    _paper("embroidery", "embroidery", "An embroidery of a <class>", 0.259, 0.330, 0.221, style=True),
)


def _corrected(paper_name: str, prompt: str) -> Shift:
    """A variant with corrected prompt wording; caption, style and threshold stay the paper's (they were chosen for
    that caption, not for the prompt's wording)."""
    paper = next(s for s in IMAGENET_STAR_SHIFTS if s.name == paper_name)
    return Shift(
        f"{paper_name}_corrected",
        prompt.replace("<class>", TOKEN_PLACEHOLDER),
        paper.shift_caption,
        style=paper.style,
        threshold=paper.threshold,
        provenance=f"ours: corrected wording of {paper_name}; caption and threshold from the paper's Table 1",
    )


# Not built unless named: the paper's prompts are the default, these say what the shift's name says.
CORRECTED_VARIANTS: tuple[Shift, ...] = (
    _corrected("in_the_beach", "A photo of a <class> on the beach"),
    _corrected("on_the_road", "A photo of a <class> on the road"),
    _corrected("on_the_rocks", "A photo of a <class> on the rocks"),
    _corrected("orange", "A photo of an orange <class>"),
    _corrected("oil_painting", "An oil painting of a <class>"),
)

KNOWN_SHIFTS: dict[str, Shift] = {s.name: s for s in (*IMAGENET_STAR_SHIFTS, *CORRECTED_VARIANTS)}


def shifts_by_name(names: list[str] | None = None, custom: list[dict] | None = None) -> list[Shift]:
    """The shifts a build uses: named shifts (default: ImageNet*'s 24, base first) plus user-defined ones (dicts)."""
    chosen: list[Shift] = []
    for name in names if names is not None else [s.name for s in IMAGENET_STAR_SHIFTS]:
        if name not in KNOWN_SHIFTS:
            import difflib

            close = difflib.get_close_matches(str(name), KNOWN_SHIFTS, n=2)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(
                f"unknown shift {str(name)[:80]!r}{hint} (define it under custom_shifts, or pick one that "
                "`lance-cf interfaces shifts` lists)"
            )
        chosen.append(KNOWN_SHIFTS[name])
    if custom is not None and not isinstance(custom, list):
        raise ValueError(f"custom_shifts must be a list of shifts (name, prompt, ...), got {type(custom).__name__}")
    chosen += [Shift.from_dict(d) for d in custom or []]
    names_seen = [s.name for s in chosen]
    if len(set(names_seen)) != len(names_seen):
        raise ValueError(f"shifts listed twice: {sorted({n for n in names_seen if names_seen.count(n) > 1})}")
    return chosen
