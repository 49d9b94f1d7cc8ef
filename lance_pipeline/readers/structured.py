"""The one reader of structured input: YAML, JSON and JSON lines, from a file or from text.

Everything the tool reads that a person or another program wrote goes through here: build configs and presets, review
studies, class maps, model markers, results files, the tokens' index, cards' front matter, the review page's request
bodies. Each reader refuses, with one ``InputError`` line naming the input (and the field where there is one):

- more than ``max_bytes`` of text (checked before reading a file);
- nesting deeper than ``MAX_DEPTH`` (Python's parsers would raise ``RecursionError``, or let a later walk of the value
  do so);
- YAML whose aliases expand past ``MAX_VALUES`` values (the "billion laughs" bomb: a 1 KB document standing for
  billions of values, harmless to load but not to walk, print or hash), or that refers to itself;
- a mapping that names a key twice (YAML and JSON parsers keep the last value silently);
- an integer of more than ``MAX_INT_DIGITS`` digits, a NaN or an infinity (``1e999``, YAML's ``.inf``).

The values come back as the parsers make them (``dict``, ``list``, ``str``, ``int``, ``float``, ``bool``, ``None``);
the ``expect_*`` helpers check a field's type without coercion (``207.9`` is not an integer, ``true`` is not 1), for
the readers of each format to say what their fields hold.

This room imports nothing from the rest of the project, so every room, the release format and the method's included,
reads through it (docs/architecture.md).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

__all__ = [
    "MAX_DEPTH",
    "MAX_INPUT_BYTES",
    "MAX_INT_DIGITS",
    "MAX_VALUES",
    "InputError",
    "check_expansion",
    "expanded_size",
    "expect_bool",
    "expect_int",
    "expect_list",
    "expect_mapping",
    "expect_number",
    "expect_str",
    "load_json",
    "load_json_lines",
    "load_yaml",
    "read_json",
    "read_json_lines",
    "read_text",
    "read_yaml",
]

# Far above any real input (a manifest of a large release, a card's front matter listing 1,000 class names per config
# is 180 KB), far below what a parser turns into gigabytes of memory.
MAX_INPUT_BYTES = 64 * 1024 * 1024
# Far above any real config or card (the largest preset is a few hundred values), far below a hang.
MAX_VALUES = 1_000_000
# Our deepest documents (a manifest, a study) nest under ten levels.
MAX_DEPTH = 100
# 2**64 has 20 digits; Python refuses to parse more than 4,300 with a ValueError no reader expects.
MAX_INT_DIGITS = 40


class InputError(ValueError):
    """A structured input was refused; the message is one line naming the input (and field) and what is wrong."""


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _shown(value: Any) -> str:
    """A value as an error shows it: its repr, cut short (a refused value can be megabytes)."""
    if isinstance(value, dict | list | tuple | set):
        return f"a {type(value).__name__} of {len(value)} value(s)"
    return _one_line(repr(value), 80)


# -- reading text -----------------------------------------------------------------------------------------------------
def read_text(path: str | Path, *, max_bytes: int = MAX_INPUT_BYTES, what: str | None = None) -> str:
    """The UTF-8 text of ``path``, refused (one line) if it is missing, not a file, larger than ``max_bytes``, or
    not UTF-8. ``what`` names the input in errors (default: the path)."""
    path = Path(path)
    origin = what or str(path)
    try:
        with path.open("rb") as handle:
            data = handle.read(max_bytes + 1)
    except FileNotFoundError:
        raise InputError(f"{origin}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{origin}: a directory, not a file") from None
    except OSError as err:
        raise InputError(f"{origin}: cannot read it ({err.strerror or err})") from None
    if len(data) > max_bytes:
        raise InputError(f"{origin}: larger than {max_bytes:,} bytes; is it the right file?")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"{origin}: not UTF-8 text (byte {err.start})") from None


def _text_of(text: str | bytes, origin: str, max_bytes: int) -> str:
    if isinstance(text, bytes | bytearray):
        if len(text) > max_bytes:
            raise InputError(f"{origin}: larger than {max_bytes:,} bytes")
        try:
            return bytes(text).decode("utf-8")
        except UnicodeDecodeError as err:
            raise InputError(f"{origin}: not UTF-8 text (byte {err.start})") from None
    if not isinstance(text, str):
        raise InputError(f"{origin}: expected text, got {type(text).__name__}")
    # A character is at most four UTF-8 bytes: only texts near the limit are encoded to measure them.
    if len(text) > max_bytes // 4 and len(text.encode("utf-8", "surrogatepass")) > max_bytes:
        raise InputError(f"{origin}: larger than {max_bytes:,} bytes")
    return text


# -- YAML ---------------------------------------------------------------------------------------------------------------
_LOADER: Any = None


def _yaml_loader() -> Any:
    """libyaml's safe loader where PyYAML has it (about ten times faster), refusing duplicate keys."""
    global _LOADER
    if _LOADER is None:
        import yaml
        from yaml.constructor import ConstructorError

        base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

        class StrictLoader(base):  # type: ignore[misc, valid-type]
            def construct_mapping(self, node, deep=False):
                if isinstance(node, yaml.MappingNode):
                    seen: set[Any] = set()
                    for key_node, _ in node.value:
                        if key_node.tag == "tag:yaml.org,2002:merge":
                            continue  # "<<: *defaults" then its own keys: overriding a merged key is the point
                        key = self.construct_object(key_node, deep=True)
                        try:
                            duplicate = key in seen
                        except TypeError:
                            continue  # an unhashable key: the base class refuses it with its own message
                        if duplicate:
                            raise ConstructorError(
                                None, None, f"the key {_shown(key)} is given twice", key_node.start_mark
                            )
                        seen.add(key)
                return super().construct_mapping(node, deep=deep)

        _LOADER = StrictLoader
    return _LOADER


def load_yaml(text: str | bytes, origin: str, *, max_bytes: int = MAX_INPUT_BYTES) -> Any:
    """The value of one YAML document (safe tags only), or a one-line ``InputError`` naming ``origin``: too large,
    invalid YAML, a key given twice, aliases expanding past ``MAX_VALUES`` values, too deep, an oversized integer, a
    NaN or an infinity."""
    import yaml

    text = _text_of(text, origin, max_bytes)
    try:
        data = yaml.load(text, Loader=_yaml_loader())
    except yaml.YAMLError as err:
        where = re.sub(r'\s+in "<(unicode|byte) string>",', " at", str(err))
        raise InputError(f"{origin}: not valid YAML ({_one_line(where)})") from None
    except RecursionError:
        raise InputError(f"{origin}: the YAML nests too deeply to read (at most {MAX_DEPTH} levels)") from None
    except ValueError as err:  # an integer past Python's digit limit, raised by int() inside the constructor
        raise InputError(f"{origin}: {_one_line(str(err))}") from None
    _check_value(data, origin)
    return data


def read_yaml(path: str | Path, *, max_bytes: int = MAX_INPUT_BYTES, what: str | None = None) -> Any:
    """``load_yaml`` of the file ``path``, its size checked before it is read."""
    return load_yaml(read_text(path, max_bytes=max_bytes, what=what), what or str(path), max_bytes=max_bytes)


# -- JSON ---------------------------------------------------------------------------------------------------------------
def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise _Refused(f"the key {_shown(twice)} is given twice")
    return out


class _Refused(ValueError):
    """Raised inside the JSON parser's hooks; turned into ``InputError`` naming the input."""


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {len(text.lstrip('-')):,} digits (at most {MAX_INT_DIGITS})")
    return int(text)


# NaN, Infinity and 1e999 parse (to nan and inf) and are refused after, by the walk that names their field.
_DECODER = json.JSONDecoder(object_pairs_hook=_pairs, parse_int=_parse_int)


def load_json(text: str | bytes, origin: str, *, max_bytes: int = MAX_INPUT_BYTES) -> Any:
    """The value of a JSON document, or a one-line ``InputError`` naming ``origin``: too large, not UTF-8, invalid
    JSON, a key given twice, too deep, an oversized integer, a NaN or an infinity."""
    text = _text_of(text, origin, max_bytes)
    try:
        data = _DECODER.decode(text)
    except _Refused as err:
        raise InputError(f"{origin}: {err}") from None
    except json.JSONDecodeError as err:
        raise InputError(f"{origin}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})") from None
    except RecursionError:
        raise InputError(f"{origin}: the JSON nests too deeply to read (at most {MAX_DEPTH} levels)") from None
    _check_value(data, origin)
    return data


def read_json(path: str | Path, *, max_bytes: int = MAX_INPUT_BYTES, what: str | None = None) -> Any:
    """``load_json`` of the file ``path``, its size checked before it is read."""
    return load_json(read_text(path, max_bytes=max_bytes, what=what), what or str(path), max_bytes=max_bytes)


def load_json_lines(text: str | bytes, origin: str, *, max_bytes: int = MAX_INPUT_BYTES) -> list[Any]:
    """One value per non-blank line (JSON lines), each read as ``load_json``; errors name the line."""
    text = _text_of(text, origin, max_bytes)
    return [
        load_json(line, f"{origin}: line {number}", max_bytes=max_bytes)
        for number, line in enumerate(text.split("\n"), 1)
        if line.strip()
    ]


def read_json_lines(path: str | Path, *, max_bytes: int = MAX_INPUT_BYTES, what: str | None = None) -> list[Any]:
    """``load_json_lines`` of the file ``path``, its size checked before it is read."""
    return load_json_lines(read_text(path, max_bytes=max_bytes, what=what), what or str(path), max_bytes=max_bytes)


# -- the value's shape ------------------------------------------------------------------------------------------------
def _field(path: Any) -> str:
    """A field's place as errors name it (``stages.0.options.seed``), from the walk's (parent, key) chain."""
    parts = []
    while path is not None:
        path, key = path
        parts.append(_one_line(str(key), 60))
    return ".".join(reversed(parts))


def _check_value(value: Any, origin: str) -> None:
    """Refuse a parsed value that expands past ``MAX_VALUES``, nests deeper than ``MAX_DEPTH``, refers to itself, or
    holds an oversized integer or a non-finite float (naming its field). Shared values (YAML aliases) are measured
    once each, so a bomb costs its distinct values, not its expansion."""
    memo: dict[int, tuple[int, int]] = {}  # id -> (expanded size, height)
    open_ids: set[int] = set()
    int_bits = MAX_INT_DIGITS * 10 // 3
    containers = (dict, list, tuple, set)

    def scalar(item: Any, path: Any) -> None:
        where = f"{origin}: '{_field(path)}'" if path is not None else origin
        if isinstance(item, float) and not math.isfinite(item):
            raise InputError(f"{where} is {item}; only finite numbers are accepted")
        if isinstance(item, int) and not isinstance(item, bool) and item.bit_length() > int_bits:
            raise InputError(f"{where} is an integer of more than {MAX_INT_DIGITS} digits")

    def measure(item: Any, path: Any, depth: int) -> tuple[int, int]:
        key = id(item)
        if key in memo:
            size, height = memo[key]
        else:
            if key in open_ids:
                raise InputError(
                    f"{origin}: {_field(path) or 'the document'} contains itself (a recursive YAML alias: an endless "
                    "alias bomb)"
                )
            if depth >= MAX_DEPTH:
                raise InputError(f"{origin}: nests deeper than {MAX_DEPTH} levels")
            open_ids.add(key)
            size, height = 1, 0
            if isinstance(item, dict):
                size += len(item)  # the keys: scalars (YAML's complex keys are walked below)
                named = item.items()
                if not all(type(k) is str for k in item):
                    named = [*((k, k) for k in item if type(k) is not str), *named]
            else:
                named = enumerate(item)
            for name, child in named:
                kind = type(child)
                if kind is str or kind is bool or child is None:
                    size += 1
                elif kind is int:
                    size += 1
                    if child.bit_length() > int_bits:
                        scalar(child, (path, name))
                elif kind is float:
                    size += 1
                    if child - child != 0.0:  # inf - inf and nan - nan are nan: not finite
                        scalar(child, (path, name))
                elif isinstance(child, containers):
                    child_size, child_height = measure(child, (path, name), depth + 1)
                    size += child_size
                    if child_height + 1 > height:
                        height = child_height + 1
                else:
                    size += 1
                    scalar(child, (path, name))
                if size > MAX_VALUES:
                    break
            open_ids.discard(key)
            memo[key] = (size, height)
        if depth + height > MAX_DEPTH:
            raise InputError(f"{origin}: nests deeper than {MAX_DEPTH} levels")
        if size > MAX_VALUES:
            raise InputError(
                f"{origin}: its aliases (*name) expand to more than {MAX_VALUES:,} values (a YAML alias bomb?); "
                "write the values out, or use fewer aliases"
            )
        return size, height

    if isinstance(value, containers):
        measure(value, None, 0)
    else:
        scalar(value, None)


def check_expansion(value: Any, origin: str) -> None:
    """The checks of ``load_yaml`` on a value built in Python (a config given to ``build()`` directly): refused if it
    expands past ``MAX_VALUES`` values, nests too deeply or refers to itself."""
    _check_value(value, origin)


def expanded_size(value: Any, limit: int = MAX_VALUES) -> int:
    """How many values ``value`` holds with every shared list or mapping counted each time it appears; stops early
    past ``limit`` (returns ``limit + 1``). A value that contains itself, or nests deeper than ``MAX_DEPTH``, counts as
    unbounded."""
    memo: dict[int, int] = {}
    open_ids: set[int] = set()

    def size(item: Any, depth: int) -> int:
        if not isinstance(item, dict | list | tuple | set):
            return 1
        key = id(item)
        if key in memo:
            return memo[key]
        if key in open_ids or depth > MAX_DEPTH:
            return limit + 1
        open_ids.add(key)
        children = [*item.keys(), *item.values()] if isinstance(item, dict) else list(item)
        total = 1
        for child in children:
            total += size(child, depth + 1)
            if total > limit:
                break
        open_ids.discard(key)
        memo[key] = min(total, limit + 1)
        return memo[key]

    return size(value, 0)


# -- fields, without coercion -----------------------------------------------------------------------------------------
def expect_int(value: Any, where: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` if it is an integer (not a bool, not a float such as ``207.9`` or ``2.0``) within the bounds."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InputError(f"{where}: expected an integer, got {_shown(value)}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = f"{'' if minimum is None else minimum} to {'' if maximum is None else maximum}".strip()
        raise InputError(f"{where}: expected an integer in {bounds}, got {value}")
    return value


def expect_number(value: Any, where: str) -> float:
    """``value`` if it is a finite int or float (not a bool, not a string)."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise InputError(f"{where}: expected a finite number, got {_shown(value)}")
    return value


def expect_bool(value: Any, where: str) -> bool:
    """``value`` if it is ``true`` or ``false`` (not 0, 1 or "yes" as a string)."""
    if not isinstance(value, bool):
        raise InputError(f"{where}: expected true or false, got {_shown(value)}")
    return value


def expect_str(value: Any, where: str, *, max_chars: int | None = None) -> str:
    """``value`` if it is text (not a number, not null), at most ``max_chars`` characters."""
    if not isinstance(value, str):
        raise InputError(f"{where}: expected text, got {_shown(value)}")
    if max_chars is not None and len(value) > max_chars:
        raise InputError(f"{where}: at most {max_chars:,} characters, got {len(value):,}")
    return value


def expect_list(value: Any, where: str) -> list[Any]:
    """``value`` if it is a list (a YAML sequence, a JSON array)."""
    if not isinstance(value, list):
        raise InputError(f"{where}: expected a list, got {_shown(value)}")
    return value


def expect_mapping(value: Any, where: str) -> dict[Any, Any]:
    """``value`` if it is a mapping (a YAML mapping, a JSON object)."""
    if not isinstance(value, dict):
        raise InputError(f"{where}: expected a mapping, got {_shown(value)}")
    return value
