"""One checker for the values a config gives to typed options: stage options, source options, the build config.

A value read from YAML is checked against the option's annotation by pydantic's ``TypeAdapter`` in strict mode: no
coercion (``"3"`` is not an integer, ``1`` is not ``true``), except what YAML cannot say otherwise (a list stands for
a tuple, an integer for a float). Floats must be finite (YAML's ``.nan`` and ``.inf`` are refused). Bounds are part of
the annotation (``Annotated[int, Interval(ge=8, le=8192)]``, ``annotated_types``), so an option that sizes memory
(an image side, a step count) says its range once and every reader of the config checks it before any model loads.

The callers keep their one-line errors (naming the input and the expected type, ``describe_type``); this module only
decides whether a value fits. An annotation the checker cannot build a schema for (a class of the stage's own) is
checked by ``isinstance`` where it is a class, and otherwise left to the stage's own checks. pydantic is imported on
first use, so importing this module (and ``import builder``) stays light.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

from annotated_types import Ge, Gt, Interval, Le, Lt, MinLen, MultipleOf, Predicate

__all__ = [
    "CosineThreshold",
    "DiffusionSteps",
    "Fraction",
    "ImageSide",
    "Interval",
    "MAX_IMAGE_SIDE",
    "MinLen",
    "MultipleOf",
    "NonNegativeInt",
    "Options",
    "Phrase",
    "PositiveInt",
    "Probability",
    "TorchDtype",
    "check_value",
    "describe_type",
    "plain_value",
]

# The largest square side an option may ask for: a 16384-pixel square is 0.8 GB as RGB, more than any stage takes;
# beyond it, a typo (``image_size: 1000000000``) would only fail later, out of memory, after models loaded.
MAX_IMAGE_SIDE = 16384
ImageSide = typing.Annotated[int, Interval(ge=8, le=MAX_IMAGE_SIDE)]
PositiveInt = typing.Annotated[int, Interval(ge=1)]
NonNegativeInt = typing.Annotated[int, Interval(ge=0)]
Fraction = typing.Annotated[float, Interval(ge=0.0, le=1.0)]  # a share of something, both ends included
Probability = typing.Annotated[float, Interval(gt=0.0, le=1.0)]  # nucleus sampling's top_p: above 0, at most 1
# A string in an annotation's metadata names what the value is, for errors ("a cosine similarity threshold (a number
# in [-1.0, 1.0]) or null"); pydantic ignores it.
CosineThreshold = typing.Annotated[float, Interval(ge=-1.0, le=1.0), "a cosine similarity threshold"]


def not_blank(text: str) -> bool:
    """Holds a character other than white space (pydantic names this function when a phrase is blank)."""
    return bool(text.strip())


Phrase = typing.Annotated[str, Predicate(not_blank)]  # some words, not blank
TorchDtype = typing.Literal["auto", "float32", "float16", "bfloat16"]  # "auto": the device's usual dtype
# Diffusion schedulers are trained on 1000 timesteps; more sampling steps than that is a typo, not a setting.
DiffusionSteps = typing.Annotated[int, Interval(ge=1, le=1000)]


class Options:
    """Base of every typed options dataclass (a stage's ``options_class``, the one ``options_type`` derives from a
    constructor): constructing one checks every field against its annotation, whose type, bounds (``Interval``),
    choices (``Literal``) and lengths (``MinLen``) are the options' value checks, so a value is checked the same
    way whether it comes from a config or from Python. A relation between fields that no annotation can say (a
    minimum below a maximum) is checked by the subclass's ``__post_init__`` after ``super().__post_init__()``, the
    dataclass counterpart of a model validator. Raises ``ValueError``: ``option NAME = VALUE: expected TYPE (why)``.
    """

    def __post_init__(self) -> None:
        hints = _field_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if not f.init or f.name not in hints:
                continue
            value = getattr(self, f.name)
            problem = check_value(value, hints[f.name])
            if problem is not None:
                raise ValueError(f"option {f.name} = {value!r}: expected {describe_type(hints[f.name])} ({problem})")


@functools.cache
def _field_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def check_value(value: Any, annotation: Any) -> str | None:
    """``None`` if ``value`` fits ``annotation``, else pydantic's reason (one line, with the failing item's position)."""
    adapter = _adapter(annotation)
    if adapter is None:
        bare = _strip_annotated(annotation)
        if isinstance(bare, type) and not isinstance(value, bare):
            return f"not a {bare.__name__}"
        return None
    from pydantic import ValidationError

    try:
        adapter.validate_python(value)
    except ValidationError as err:
        first = err.errors()[0]
        # Item positions only: the other parts of pydantic's location name union members, not places in the value.
        where = "][".join(str(part) for part in first["loc"] if isinstance(part, int))
        return f"{first['msg']}{f' (item [{where}])' if where else ''}"
    except (TypeError, ValueError) as err:  # a value pydantic cannot even look at (e.g. an unhashable Literal test)
        return str(err).splitlines()[0]
    return None


def plain_value(value: Any, annotation: Any = Any) -> Any:
    """``value`` as its annotation reads it, in JSON's types: what a config hash covers, so that equal values hash the
    same however they were written (``1`` and ``1.0`` for a float, a list for a tuple). A value that does not fit
    the annotation (not checked here) is kept as it is."""
    adapter = _adapter(annotation)
    if adapter is not None:
        from pydantic import ValidationError

        try:
            value = adapter.validate_python(value)
        except (ValidationError, TypeError, ValueError):
            pass
    return _json_types(value)


def _json_types(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_json_types(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_types(v) for k, v in value.items()}
    return value


@functools.cache
def _adapter(annotation: Any) -> Any:
    """A strict ``TypeAdapter`` for the annotation (tuples lax: YAML has only lists), or None if none can be built."""
    from pydantic import ConfigDict, PydanticSchemaGenerationError, PydanticUserError, TypeAdapter

    try:
        return TypeAdapter(
            _lax_tuples(annotation), config=ConfigDict(strict=True, allow_inf_nan=False, arbitrary_types_allowed=True)
        )
    except (PydanticSchemaGenerationError, PydanticUserError, TypeError):
        return None


def _lax_tuples(annotation: Any) -> Any:
    """The annotation with every tuple accepting a list (its items stay strict)."""
    from pydantic import Strict

    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return typing.Annotated[(_lax_tuples(args[0]), *annotation.__metadata__)]
    if annotation is tuple or origin is tuple:
        inner = tuple[tuple(_lax_tuples(a) if a is not Ellipsis else a for a in args)] if args else tuple
        return typing.Annotated[inner, Strict(False)]
    if origin in (typing.Union, types.UnionType):
        return typing.Union[tuple(_lax_tuples(a) for a in args)]  # noqa: UP007 (a runtime union of computed args)
    if origin in (list, dict) and args:
        return origin[tuple(_lax_tuples(a) for a in args)]
    return annotation


def _strip_annotated(annotation: Any) -> Any:
    return typing.get_args(annotation)[0] if typing.get_origin(annotation) is typing.Annotated else annotation


_NAMES = {
    str: ("a string", "strings"),
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    bool: ("true or false", "booleans"),
    type(None): ("null", "null"),
    dict: ("a mapping", "mappings"),
    list: ("a list", "lists"),
    tuple: ("a list", "lists"),
}


def describe_type(annotation: Any, plural: bool = False) -> str:
    """``list[str | int] | None`` -> "a list (of strings or integers) or null"; bounds as "an integer in [8, 8192]"."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        described = describe_type(args[0], plural) + _describe_bounds(annotation.__metadata__)
        names = [item for item in annotation.__metadata__ if isinstance(item, str)]  # what the value is, in words
        return f"{names[0]} ({described})" if names else described
    if annotation is Any or annotation is object:
        return "anything"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a, plural) for a in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (list, tuple, typing.Sequence) and args:
        items = [a for a in args if a is not Ellipsis]
        of = " or ".join(dict.fromkeys(describe_type(a, plural=True) for a in items))
        return f"{'lists' if plural else 'a list'} (of {of})"
    if origin is dict and args:
        return f"{'mappings' if plural else 'a mapping'} (of {describe_type(args[1], plural=True)})"
    singular, many = _NAMES.get(origin or annotation, (None, None))
    if singular is None:
        name = getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")
        return name
    return many if plural else singular


def _describe_bounds(metadata: tuple[Any, ...]) -> str:
    """`` in [8, 8192]``, `` in (0.0, 1.0]``, `` >= 1``, `` (at least 1 item)``: an annotation's bounds, for errors."""
    low = high = None
    low_open = high_open = False
    least = multiple = None
    for item in metadata:
        if isinstance(item, Interval | Ge | Gt):
            if getattr(item, "ge", None) is not None:
                low, low_open = item.ge, False
            elif getattr(item, "gt", None) is not None:
                low, low_open = item.gt, True
        if isinstance(item, Interval | Le | Lt):
            if getattr(item, "le", None) is not None:
                high, high_open = item.le, False
            elif getattr(item, "lt", None) is not None:
                high, high_open = item.lt, True
        if isinstance(item, MinLen):
            least = item.min_length
        if isinstance(item, MultipleOf):
            multiple = item.multiple_of
    text = ""
    if low is not None and high is not None:
        text = f" in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    elif low is not None:
        text = f" {'>' if low_open else '>='} {low}"
    elif high is not None:
        text = f" {'<' if high_open else '<='} {high}"
    if multiple:
        text += f", a multiple of {multiple}"
    if least:
        text += f" (at least {least} item{'s' if least > 1 else ''})"
    return text
