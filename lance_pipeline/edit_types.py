"""The edit types of LANCE's caption perturber: one table from which everything about an edit type is derived.

Prabhu et al., NeurIPS 2023, section 3.1 and Table 5: the perturber rewrites a caption so that exactly one aspect
changes (subject, object, background, adjective, domain; weather is its own type in the authors' code). One row per
type holds:

* ``instruction``: what the perturber is asked (in our words, after Table 5), also the instruction an adapter is
  trained on (``lance-cf perturber collect`` / ``train``);
* ``example``: the worked example put into the few-shot prompt (the paper found in-prompt examples help);
* ``max_span_words``: the longest change, in words on either side of the span diff, that is still one aspect of this
  type (``lance_pipeline.perturber.collect.judge_variation``);
* ``checks``: the named per-type checks a collected variation must pass (``CHECKS``, implemented in
  ``judge_variation``);
* ``description``: one line for docs and cards;
* ``editor_instruction`` and ``editor_instruction_add``: the rule that turns a structured edit of this type into the
  instruction an instruction editor is given (``lance_pipeline.instruct``): a template over the edit's spans,
  ``{original}`` and ``{edited}``; the second is used when the edit only adds words (its original span is empty).
  ``editor_instruction(edit)`` applies it; an edit of no row's type (DILLEMA's ``multi``) is given
  ``MULTI_EDIT_INSTRUCTION`` over its whole edited caption. The spans are not quoted: instruction editors trained to
  render text (Qwen-Image, LongCat) read a quoted string as text to write into the image.

Readers: the perturb stage (instructions, examples, the types it asks for by default), the DILLEMA keyword stage (the
aspects it names), the collect rules, the CLI's defaults and help, the release vocabulary
(``release_edit_types``), the cards and docs/method.md's generated table (``python -m lance_pipeline.edit_types
docs/method.md``; a test fails when it is stale). Adding a type is one row (``register_edit_type`` for a type of
your own, from your code or a test), plus a new check only if none of ``CHECKS`` says what makes it that type.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from lance_pipeline.generated_docs import run, update_block

# Checks a collected variation of a type may have to pass, in the order judge_variation applies them, with the
# rejection reason each gives. Every type is also checked for a change, the class kept, and its span limit.
CHECKS: dict[str, tuple[str, str]] = {
    "one_place": ("several_changes", "changes one place of the caption"),
    "changes_domain": ("not_a_domain_change", "changes or adds a word naming the kind of image"),
    "keeps_domain": ("changed_the_domain", "leaves the words naming the kind of image alone"),
    "adds_weather": ("not_a_weather_change", "adds a word naming weather"),
    "replaces": ("not_a_replacement", "replaces words rather than only adding or dropping some"),
}


@dataclass(frozen=True)
class EditType:
    """One edit type of the perturber (see the module docstring for what reads each field).

    Attributes:
        name: The type's name, as the release's ``edit_type`` field holds it.
        description: What the type changes, one line.
        instruction: The perturber's instruction for this type.
        example: ``(caption, class, edits)``: a worked example for the few-shot prompt (at least one edit).
        max_span_words: Longest change (words on either side of the span diff) that is still one aspect.
        checks: Names of ``CHECKS`` a collected variation must pass.
        editor_instruction: An instruction editor's instruction for an edit of this type, over ``{original}`` and
            ``{edited}`` (the edit's spans).
        editor_instruction_add: The same for an edit that only adds words (``{edited}`` only).
    """

    name: str
    description: str
    instruction: str
    example: tuple[str, str, tuple[str, ...]]
    max_span_words: int
    checks: tuple[str, ...] = ("keeps_domain",)
    editor_instruction: str = "Change {original} to {edited}. Keep everything else as it is."
    editor_instruction_add: str = "Add {edited}. Keep everything else as it is."

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").isalnum() or not self.name.islower():
            raise ValueError(f"edit type name {self.name!r} must be lower-case letters, digits and '_'")
        unknown = [c for c in self.checks if c not in CHECKS]
        if unknown:
            raise ValueError(f"edit type {self.name!r}: unknown check(s) {unknown}; checks are {', '.join(CHECKS)}")
        caption, label, edits = self.example
        if not (isinstance(caption, str) and caption and isinstance(label, str) and edits):
            raise ValueError(f"edit type {self.name!r}: example must be (caption, class, (edit, ...))")
        if not isinstance(self.max_span_words, int) or self.max_span_words < 1:
            raise ValueError(f"edit type {self.name!r}: max_span_words must be a positive int")
        if not self.instruction.strip() or not self.description.strip():
            raise ValueError(f"edit type {self.name!r}: instruction and description must be non-empty")
        for template, fields in (
            (self.editor_instruction, ("original", "edited")),
            (self.editor_instruction_add, ("edited",)),
        ):
            try:
                template.format(**dict.fromkeys(fields, "x"))
            except (KeyError, IndexError, ValueError) as err:
                raise ValueError(
                    f"edit type {self.name!r}: editor instruction {template!r} may use only {{{'}, {'.join(fields)}}}"
                ) from err
            if not all("{" + f + "}" in template for f in fields):
                raise ValueError(
                    f"edit type {self.name!r}: editor instruction {template!r} must name {{{'} and {'.join(fields)}}}"
                )


_KEEP = " Keep everything else as it is."

# The table. Instructions in our words after the paper's Table 5; examples written for this project (the class is
# never edited); span limits ours: a subject or object is a short noun phrase, an adjective one to three words, a
# background or weather phrase longer ("in a snowy pine forest at the foot of a mountain").
_BUILT_IN = (
    EditType(
        "subject",
        "the subject of the caption (the person, animal or thing doing the action)",
        "Rewrite the caption changing only its subject (the person, animal or thing doing the action) into a "
        "different one." + _KEEP,
        (
            "a photo of a man riding a horse on a beach",
            "horse",
            (
                "a photo of a woman riding a horse on a beach",
                "a photo of a young boy riding a horse on a beach",
                "a photo of a police officer riding a horse on a beach",
            ),
        ),
        4,
        ("one_place", "keeps_domain", "replaces"),
        editor_instruction="Replace {original} with {edited}." + _KEEP,
        editor_instruction_add="Add {edited}." + _KEEP,
    ),
    EditType(
        "object",
        "an object the subject acts on, holds or is next to",
        "Rewrite the caption changing only the object (the thing the subject acts on, holds or is next to) into a "
        "different one." + _KEEP,
        (
            "a photo of a man wearing sunglasses and holding a cup of coffee",
            "sunglasses",
            (
                "a photo of a man wearing sunglasses and holding a newspaper",
                "a photo of a man wearing sunglasses and holding a small dog",
                "a photo of a man wearing sunglasses and holding an umbrella",
            ),
        ),
        4,
        ("one_place", "keeps_domain", "replaces"),
        editor_instruction="Replace {original} with {edited}." + _KEEP,
        editor_instruction_add="Add {edited} next to the subject." + _KEEP,
    ),
    EditType(
        "background",
        "the background or location",
        "Rewrite the caption changing only the background or location, or adding one if none is given. Do not "
        "change the foreground or its attributes.",
        (
            "a photo of a volleyball lying on the sand at the beach",
            "volleyball",
            (
                "a photo of a volleyball lying on the grass in a city park",
                "a photo of a volleyball lying on the wooden floor of a gym",
                "a photo of a volleyball lying on the gravel of a parking lot",
            ),
        ),
        10,
        ("keeps_domain",),
        editor_instruction="Change the background from {original} to {edited}. Do not change the foreground.",
        editor_instruction_add="Put the scene {edited}. Do not change the foreground.",
    ),
    EditType(
        "weather",
        "the weather",
        "Rewrite the caption changing only the weather, or adding a weather condition if none is mentioned." + _KEEP,
        (
            "a photo of a patio with two chairs and a table",
            "patio",
            (
                "a photo of a patio with two chairs and a table on a rainy day",
                "a photo of a patio with two chairs and a table covered in snow",
                "a photo of a patio with two chairs and a table in thick fog",
            ),
        ),
        8,
        ("keeps_domain", "adds_weather"),
        editor_instruction="Change the weather from {original} to {edited}." + _KEEP,
        editor_instruction_add="Change the weather: {edited}." + _KEEP,
    ),
    EditType(
        "adjective",
        "one adjective or attribute",
        "Rewrite the caption adding or changing a single adjective or attribute." + _KEEP,
        (
            "a photo of a dog sled pulled by huskies in the snow",
            "dog sled",
            (
                "a photo of a wooden dog sled pulled by huskies in the snow",
                "a photo of a dog sled pulled by tired huskies in the snow",
                "a photo of a dog sled pulled by huskies in the deep snow",
            ),
        ),
        3,
        ("one_place", "keeps_domain"),
        editor_instruction="Change {original} to {edited}." + _KEEP,
        editor_instruction_add="Make it {edited}." + _KEEP,
    ),
    EditType(
        "domain",
        "the kind of image (photo, painting, sketch, ...)",
        "Rewrite the caption changing only the kind of image (for example photo, painting, sketch, cartoon, "
        "sculpture, 3D render), keeping its content exactly the same.",
        (
            "a photo of a howler monkey sitting in a tree",
            "howler monkey",
            (
                "a painting of a howler monkey sitting in a tree",
                "a pencil sketch of a howler monkey sitting in a tree",
                "a cartoon of a howler monkey sitting in a tree",
            ),
        ),
        4,
        ("changes_domain",),
        editor_instruction="Turn the image from {original} into {edited}, keeping its content exactly the same.",
        editor_instruction_add="Turn the image into {edited}, keeping its content exactly the same.",
    ),
)

# The types the tool knows, in table order (built-in first, then any registered).
EDIT_TYPE_TABLE: dict[str, EditType] = {t.name: t for t in _BUILT_IN}
# The built-in names, frozen (the default vocabulary of releases; a registered type extends the live table only).
EDIT_TYPES: tuple[str, ...] = tuple(EDIT_TYPE_TABLE)
# DILLEMA's counterfactuals apply up to three alternatives at once (lance_pipeline.dillema.text_stages): a release may
# also hold this type. The perturber never asks for it.
MULTI_EDIT_TYPE = "multi"
# The instruction of an edit of no row's type (``multi``): its spans may be several places, so the whole caption.
MULTI_EDIT_INSTRUCTION = "Edit the image so that it shows {edited_caption}. Keep everything else as it is."


def editor_instruction(edit: dict) -> str:
    """The instruction an instruction editor is given for a structured edit (its type's rule, see ``EditType``).

    ``edit`` is a caption edit as the perturb or DILLEMA stages write it: ``edit_type``, ``original_span``,
    ``edited_span``, ``edited_caption``. An edit of a type in the table with an edited span gets the type's template
    (``editor_instruction``, or ``editor_instruction_add`` when its original span is empty); any other edit (``multi``,
    or no edited span, i.e. words only dropped) the caption-wide ``MULTI_EDIT_INSTRUCTION``.
    """
    original = " ".join(str(edit.get("original_span") or "").split())
    edited = " ".join(str(edit.get("edited_span") or "").split())
    row = EDIT_TYPE_TABLE.get(str(edit.get("edit_type")))
    if row is None or not edited:
        caption = " ".join(str(edit.get("edited_caption") or "").split())
        if not caption:
            raise ValueError(f"edit {edit!r} has neither an edited span of a known type nor an edited caption")
        return MULTI_EDIT_INSTRUCTION.format(edited_caption=caption)
    if not original:
        return row.editor_instruction_add.format(edited=edited)
    return row.editor_instruction.format(original=original, edited=edited)


def register_edit_type(edit_type: EditType) -> EditType:
    """Add a row to the table (a type of your own); a name already there is refused."""
    if edit_type.name in EDIT_TYPE_TABLE or edit_type.name == MULTI_EDIT_TYPE:
        raise ValueError(f"edit type {edit_type.name!r} already exists")
    EDIT_TYPE_TABLE[edit_type.name] = edit_type
    return edit_type


def unregister_edit_type(name: str) -> None:
    """Remove a registered row (the built-in six stay)."""
    if name in EDIT_TYPES:
        raise ValueError(f"edit type {name!r} is built in")
    EDIT_TYPE_TABLE.pop(name)


def edit_type_names() -> tuple[str, ...]:
    """The names of every type in the table, in order: what the perturber asks for by default."""
    return tuple(EDIT_TYPE_TABLE)


def release_edit_types() -> tuple[str, ...]:
    """The vocabulary of a release's ``edit_type`` field: the table's types and DILLEMA's ``multi``."""
    return (*EDIT_TYPE_TABLE, MULTI_EDIT_TYPE)


def edit_type(name: str) -> EditType:
    """The row of ``name``; an unknown name is a ``ValueError`` with the closest known one."""
    if name not in EDIT_TYPE_TABLE:
        names = edit_type_names()
        close = difflib.get_close_matches(str(name), names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown edit type {name!r}, expected one of {', '.join(names)}{hint}")
    return EDIT_TYPE_TABLE[name]


def validate_edit_types(edit_types: list[str] | tuple[str, ...] | str | None) -> tuple[str, ...]:
    """Check and normalise a list (or comma-separated string) of edit types; ``None`` means every type.

    Raises:
        ValueError: naming an unknown type and the closest valid one.
    """
    if edit_types is None:
        return edit_type_names()
    if isinstance(edit_types, str):
        edit_types = [t for t in (s.strip() for s in edit_types.split(",")) if t]
    out: list[str] = []
    for name in edit_types:
        edit_type(name)
        if name not in out:
            out.append(name)
    if not out:
        raise ValueError(f"edit_types must name at least one of {', '.join(edit_type_names())}")
    return tuple(out)


def spoken_list(names: tuple[str, ...] | list[str]) -> str:
    """``"a, b or c"``: the types for prose (cards, help texts)."""
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


# -- the docs ------------------------------------------------------------------------------------------------------
DOCS_BEGIN = "<!-- edit-types:begin (generated by `python -m lance_pipeline.edit_types docs/method.md`) -->"
DOCS_END = "<!-- edit-types:end -->"


def _cell(text: str) -> str:
    return " ".join(str(text).replace("|", "\\|").split())


def render_markdown() -> str:
    """The docs table: one row per type, with its instruction, example, span limit and checks."""
    lines = [
        "| type | changes | instruction | example (class) | span limit | checks | instruction editor's rule (adding only) |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in EDIT_TYPE_TABLE.values():
        caption, label, edits = t.example
        checks = "; ".join(f"{CHECKS[c][1]} (`{CHECKS[c][0]}`)" for c in t.checks)
        cells = [f"`{t.name}`", t.description, t.instruction, f'"{caption}" → "{edits[0]}" ({label})',
                 f"{t.max_span_words} words", checks, f"{t.editor_instruction} ({t.editor_instruction_add})"]  # fmt: skip
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def update_docs(path: str | Path) -> bool:
    """Rewrite the generated block of ``path`` (between ``DOCS_BEGIN`` and ``DOCS_END``); whether it changed."""
    return update_block(path, DOCS_BEGIN, DOCS_END, render_markdown(), "edit-type")


def main(argv: list[str] | None = None) -> int:
    return run("lance_pipeline.edit_types", update_docs, argv)


if __name__ == "__main__":
    raise SystemExit(main())
