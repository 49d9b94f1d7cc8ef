"""The per-sample metadata record (``KEY.json``) and everything generated from it.

``SampleMetadata`` is the one description of the record: the JSON schema (``metadata_json_schema``), the ``datasets``
features of the card's YAML (``hf_features``) and the canonical bytes (``encode_metadata``) are all derived from its
fields and from the release's declaration (``ReleaseSpec``: edit types, score names, a config's extra fields).
"""

from __future__ import annotations

import functools
import json
import math
import operator
import typing
from dataclasses import dataclass, field, fields
from typing import Any

from builder.release_format.layout import DEFAULT_IMAGE_FORMAT, KEY_PATTERN, LABEL_EXT, METADATA_EXT
from builder.release_format.spec import V1_FIELD_NAMES, V1_SPEC, ReleaseSpec
from lance_pipeline.readers import load_json

SCHEMA_ID = "https://github.com/lance-counterfactuals/lance-counterfactuals/docs/metadata.schema.json"


@dataclass
class SampleMetadata:
    """One sample's metadata. The first 12 fields are format v1's, in their on-disk order; ``extra`` holds the fields
    the sample's config declares (v2). Field metadata: ``pattern``/``minimum`` go into the JSON schema, ``vocabulary``
    names the ``ReleaseSpec`` attribute that constrains the field, ``doc`` documents it."""

    key: str = field(metadata={"pattern": KEY_PATTERN.pattern, "doc": "this sample's key"})
    source_key: str = field(
        metadata={"pattern": KEY_PATTERN.pattern, "doc": "the original sample it derives from (itself for original)"}
    )
    label: int = field(metadata={"minimum": 0, "doc": "class index in the release's label space"})
    label_name: str = field(metadata={"doc": "readable class name"})
    edit_type: str | None = field(
        default=None, metadata={"vocabulary": "edit_types", "doc": "the kind of edit; null where no edit"}
    )
    caption: str | None = field(default=None, metadata={"doc": "the source image's caption"})
    edited_caption: str | None = field(default=None, metadata={"doc": "the caption the image was edited towards"})
    original_span: str | None = field(default=None, metadata={"doc": "the words of the caption the edit replaced"})
    edited_span: str | None = field(default=None, metadata={"doc": "the words that replaced them"})
    seed: int = field(default=0, metadata={"minimum": 0, "doc": "the sample's seed (release seed, source key)"})
    self_replace: float | None = field(default=None, metadata={"doc": "self-attention injection fraction chosen"})
    scores: dict[str, float | None] = field(
        default_factory=dict, metadata={"vocabulary": "score_names", "doc": "filter scores, null where not computed"}
    )
    extra: dict[str, Any] = field(default_factory=dict, metadata={"doc": "the config's declared extra fields"})

    @classmethod
    def from_dict(cls, data: dict[str, Any], spec: ReleaseSpec = V1_SPEC, config: str | None = None) -> SampleMetadata:
        """Validate and coerce a metadata dict (as a stage or a shard gives it). Errors name the field.

        Args:
            data: the fields; the v1 ones may be missing where nullable, extras must be declared by ``config``.
            spec: the release's declaration (v1 by default).
            config: the sample's config; its declared extra fields are accepted (none when ``None``).
        """
        where = f"config {config!r}" if config else "sample metadata"
        extras = spec.config(config).fields if config else ()
        declared = {f.name: f for f in extras}
        unknown = sorted(set(data) - set(V1_FIELD_NAMES) - set(declared))
        if unknown:
            raise ValueError(
                f"{where}: metadata field(s) {unknown} are not declared (v1 fields and {sorted(declared) or 'none'})"
            )
        values: dict[str, Any] = {}
        for name in ("key", "source_key", "label_name"):
            if not isinstance(data.get(name), str):
                raise ValueError(f"{where}: metadata field {name!r} is {data.get(name)!r}, expected a string")
            values[name] = data[name]
        for name in ("label", "seed"):
            try:
                values[name] = operator.index(data.get(name))
            except TypeError:
                raise ValueError(
                    f"{where}: metadata field {name!r} is {data.get(name)!r}, expected an integer"
                ) from None
            if values[name] < 0 or isinstance(data.get(name), bool):
                raise ValueError(f"{where}: metadata field {name!r} is {data.get(name)!r}, expected an integer >= 0")
        for name in ("caption", "edited_caption", "original_span", "edited_span", "edit_type"):
            value = data.get(name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{where}: metadata field {name!r} is {value!r}, expected a string or null")
            values[name] = value
        if values["edit_type"] is not None and values["edit_type"] not in spec.edit_types:
            raise ValueError(
                f"{where}: edit_type {values['edit_type']!r} is not one of the declared {list(spec.edit_types)}"
            )
        self_replace = data.get("self_replace")
        values["self_replace"] = None if self_replace is None else _float(self_replace, "self_replace", where)
        if values["self_replace"] is not None and not 0.0 <= values["self_replace"] <= 1.0:
            raise ValueError(
                f"{where}: metadata field 'self_replace' is {self_replace!r}, expected a fraction in [0, 1]"
            )
        scores = data.get("scores") or {}
        if not isinstance(scores, dict):
            raise ValueError(f"{where}: metadata field 'scores' is {scores!r}, expected an object")
        unknown_scores = sorted(set(scores) - set(spec.score_names))
        if unknown_scores:
            raise ValueError(f"{where}: score(s) {unknown_scores} are not declared ({list(spec.score_names)})")
        values["scores"] = {
            n: None if scores.get(n) is None else _float(scores[n], f"scores.{n}", where) for n in spec.score_names
        }
        values["extra"] = {f.name: f.check(data.get(f.name), where) for f in extras}
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object written to ``KEY.json``: v1 fields in order, then the declared extras in order."""
        out = {name: getattr(self, name) for name in V1_FIELD_NAMES}
        out.update(self.extra)
        return out

    def encode(self) -> bytes:
        """Canonical bytes: fixed key order, no whitespace, UTF-8, floats as floats."""
        return json.dumps(self.to_dict(), ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def _float(value: Any, name: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: metadata field {name!r} is {value!r}, expected a finite number or null")
    return float(value)


if tuple(f.name for f in fields(SampleMetadata) if f.name != "extra") != V1_FIELD_NAMES:
    raise RuntimeError("SampleMetadata's fields must be spec.V1_FIELD_NAMES, in that order: format v1 is frozen")
METADATA_FIELDS = V1_FIELD_NAMES  # former name


class InvariantCheck:
    """Every invariant a release declares, checked sample by sample as a writer writes them or a reader reads them.

    One check serves the writers (``builder.release.seal_release`` refuses to seal a release whose check is not
    clean or did not see every sample), ``verify`` (which reports every breach by key) and ``lance-cf eval`` (which
    refuses a release that breaks one, unless ``--no-verify``). Per sample: the record passes
    ``SampleMetadata.from_dict`` (types, declared vocabulary, ranges, finite floats, labels and seeds >= 0). Between
    samples: no key twice in a config; an original's ``source_key`` is its key, a derived sample's names an original
    (when the release holds the ``original`` config); every field that ``references`` a config names a sample of it;
    every ``unique`` group of fields is unique in its config; every ``one_true_per`` group has exactly one sample
    whose flag is true.
    """

    def __init__(self, spec: ReleaseSpec, configs: list[str] | tuple[str, ...], *, declared: bool = True) -> None:
        """``declared``: whether samples carry their config's extra fields (format v2); v1 records have none."""
        self.spec = spec
        self.configs = tuple(configs)
        self.declared = declared
        self.keys: dict[str, set[str]] = {c: set() for c in self.configs}
        self.counts: dict[str, int] = dict.fromkeys(self.configs, 0)
        self._problems: list[str] = []
        self._links: list[tuple[str, str, str, str, str]] = []  # (config, key, field, target config, value)
        self._unique: dict[tuple[str, tuple[str, ...]], dict[tuple[Any, ...], str]] = {}
        self._flags: dict[tuple[str, str, str], dict[Any, list[str]]] = {}

    def add(self, config: str, meta: dict[str, Any] | SampleMetadata, where: str | None = None) -> bool:
        """Check one sample of ``config`` (its record, or the record already parsed); False when it breaks one."""
        where = where or f"{config}:{meta['key'] if isinstance(meta, dict) else meta.key}"
        if config not in self.keys:
            self._problems.append(f"{where}: config {config!r} is not among the release's configs")
            return False
        if isinstance(meta, dict):
            try:
                meta = SampleMetadata.from_dict(meta, self.spec, config if self.declared else None)
            except ValueError as err:
                self._problems.append(f"{where}: {_without_where(str(err))}")
                return False
        self.counts[config] += 1
        key = meta.key
        if key in self.keys[config]:
            self._problems.append(f"{where}: duplicate key in config {config}")
        self.keys[config].add(key)
        if config == "original" and meta.source_key != key:
            self._problems.append(f"{where}: an original's source_key must equal its key")
        elif config != "original" and "original" in self.configs:
            self._links.append((config, key, "source_key", "original", meta.source_key))
        if not self.declared:
            return True
        declared = self.spec.config(config)
        record = {**meta.to_dict()}
        for f in declared.fields:
            if f.references is not None and record.get(f.name) is not None:
                self._links.append((config, key, f.name, f.references, record[f.name]))
        for group in declared.unique:
            values = tuple(record.get(name) for name in group)
            if any(v is None for v in values):
                continue
            first = self._unique.setdefault((config, group), {}).setdefault(values, key)
            if first != key:
                shown = ", ".join(f"{n}={v!r}" for n, v in zip(group, values, strict=True))
                self._problems.append(f"{where}: {shown} is also sample {first!r}'s (declared unique in {config})")
        for flag, group in declared.one_true_per:
            value = record.get(group)
            if value is None:
                continue
            members = self._flags.setdefault((config, flag, group), {}).setdefault(value, [])
            if record.get(flag) is True:
                members.append(key)
        return True

    def problems(self) -> list[str]:
        """Every breach found so far, the relations between samples included (call once every sample is added)."""
        problems = list(self._problems)
        for config, key, name, target, value in self._links:
            if target not in self.keys:
                problems.append(f"{config}:{key}: {name} {value!r} names config {target!r}, which the release lacks")
            elif value not in self.keys[target]:
                what = "has no original sample" if name == "source_key" else f"names no sample of config {target}"
                problems.append(f"{config}:{key}: {name} {value!r} {what}")
        for (config, flag, group), by_value in self._flags.items():
            for value, keys in by_value.items():
                if len(keys) != 1:
                    shown = f" ({', '.join(sorted(keys)[:5])}{', ...' if len(keys) > 5 else ''})" if keys else ""
                    problems.append(
                        f"{config}: {len(keys)} samples with {group}={value!r} have {flag} true{shown}, expected "
                        "exactly one"
                    )
        return problems

    def check_complete(self, counts: dict[str, int]) -> None:
        """Raise ValueError unless this check saw exactly ``counts`` samples per config and found no breach: what a
        writer calls before it seals a release."""
        if dict(self.counts) != {c: counts.get(c, 0) for c in self.configs} or set(counts) - set(self.configs):
            raise ValueError(
                f"the release's invariants were checked on {dict(self.counts)} samples, but it holds {counts}: "
                "every sample a writer writes must go through InvariantCheck.add"
            )
        problems = self.problems()
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise ValueError(f"refusing to write a release that breaks its declared invariants: {problems[0]}{more}")


def _without_where(message: str) -> str:
    """``SampleMetadata.from_dict``'s message without its leading ``config 'x': `` (the caller names the sample)."""
    head, sep, rest = message.partition(": ")
    return rest if sep and (head.startswith("config ") or head == "sample metadata") else message


@functools.cache
def _v1_fields() -> tuple[tuple[str, Any, dict[str, Any]], ...]:
    """(name, annotation, metadata) of every v1 field of ``SampleMetadata``, worked out once (callers only read them):
    resolving the type hints took 5 ms a call (profiled, load 10), and verify asks for them for every config it reads."""
    hints = typing.get_type_hints(SampleMetadata)
    return tuple((f.name, hints[f.name], dict(f.metadata)) for f in fields(SampleMetadata) if f.name != "extra")


def _scalar(annotation: Any) -> tuple[type, bool]:
    """(scalar type, nullable) of ``str``, ``int``, ``float`` or ``X | None``."""
    args = typing.get_args(annotation)
    if args:
        inner = [a for a in args if a is not type(None)]
        return inner[0], type(None) in args
    return annotation, False


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}
_HF_DTYPES = {str: "string", int: "int64", float: "float64", bool: "bool"}
_SPEC_DTYPES = {"string": str, "int64": int, "float64": float, "bool": bool}


def metadata_json_schema(spec: ReleaseSpec = V1_SPEC, config: str | None = None) -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of one sample's ``KEY.json`` in ``config`` (v1 fields only when ``None``).

    docs/metadata.schema.json is this schema for the v1 declaration (a test keeps the two equal).
    """
    properties: dict[str, Any] = {}
    for name, annotation, meta in _v1_fields():
        vocabulary = getattr(spec, meta["vocabulary"]) if "vocabulary" in meta else None
        if typing.get_origin(annotation) is dict:
            member = {"type": ["number", "null"]}
            properties[name] = {
                "type": "object",
                "additionalProperties": False,
                "required": list(vocabulary),
                "properties": dict.fromkeys(vocabulary, member),
            }
            continue
        scalar, nullable = _scalar(annotation)
        if vocabulary is not None:
            properties[name] = {"enum": [*vocabulary, *([None] if nullable else [])]}
            continue
        kind = _JSON_TYPES[scalar]
        properties[name] = {"type": [kind, "null"] if nullable else kind}
        properties[name].update({k: meta[k] for k in ("pattern", "minimum") if k in meta})
    extras = spec.config(config).fields if config else ()
    for f in extras:
        properties[f.name] = (
            {"enum": [*f.enum, None]} if f.enum is not None else {"type": [_JSON_TYPES[_SPEC_DTYPES[f.dtype]], "null"]}
        )
        if f.minimum is not None:
            properties[f.name]["exclusiveMinimum" if f.minimum_exclusive else "minimum"] = f.minimum
        if f.maximum is not None:
            properties[f.name]["maximum"] = f.maximum
    title = "LANCE counterfactual release: per-sample metadata" + (f" of config {config}" if config else "")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": title,
        "type": "object",
        "additionalProperties": False,
        "required": list(properties),
        "properties": properties,
    }


def class_label_names(names: list[str] | tuple[str, ...]) -> list[str]:
    """Class names made unique for a ``datasets.ClassLabel``: a name used twice (ImageNet's ``sunglasses``,
    ``missile``) gets its index appended to every use, e.g. ``sunglasses (836)``."""
    seen: dict[str, int] = {}
    for name in names:
        seen[name] = seen.get(name, 0) + 1
    return [f"{name} ({i})" if seen[name] > 1 else name for i, name in enumerate(names)]


def hf_features(
    image_format: str = DEFAULT_IMAGE_FORMAT,
    spec: ReleaseSpec = V1_SPEC,
    config: str | None = None,
    class_names: list[str] | tuple[str, ...] | None = None,
) -> list[dict[str, Any]]:
    """The ``dataset_info.features`` list of one config for the card YAML.

    Declared, never inferred: ``datasets`` then casts every row to these types, so an integral score is still a float
    and a field that is null in the first rows and set later still loads. With ``class_names``, ``cls`` is a
    ``ClassLabel`` carrying them (format v2); without, a plain int64 (v1).
    """
    struct: list[dict[str, Any]] = []
    for name, annotation, meta in _v1_fields():
        if typing.get_origin(annotation) is dict:
            names = getattr(spec, meta["vocabulary"])
            struct.append({"name": name, "struct": [{"name": n, "dtype": "float64"} for n in names]})
        else:
            struct.append({"name": name, "dtype": _HF_DTYPES[_scalar(annotation)[0]]})
    extras = spec.config(config).fields if config else ()
    struct += [{"name": f.name, "dtype": f.dtype} for f in extras]
    label: dict[str, Any] = (
        {"name": LABEL_EXT, "dtype": {"class_label": {"names": dict(enumerate(class_label_names(class_names)))}}}
        if class_names is not None
        else {"name": LABEL_EXT, "dtype": "int64"}
    )
    if class_names is not None:  # YAML keys of class_label names are strings, as the Hub writes them
        label["dtype"]["class_label"]["names"] = {str(k): v for k, v in label["dtype"]["class_label"]["names"].items()}
    return [
        {"name": "__key__", "dtype": "string"},
        {"name": "__url__", "dtype": "string"},
        label,
        {"name": image_format, "dtype": "image"},
        {"name": METADATA_EXT, "struct": struct},
    ]


def empty_metadata(key: str, source_key: str, label: int, label_name: str, seed: int) -> dict[str, Any]:
    """A v1 metadata record with every field present and the unused ones null."""
    return {
        "key": key,
        "source_key": source_key,
        "label": label,
        "label_name": label_name,
        "edit_type": None,
        "caption": None,
        "edited_caption": None,
        "original_span": None,
        "edited_span": None,
        "seed": seed,
        "self_replace": None,
        "scores": dict.fromkeys(V1_SPEC.score_names),
    }


def normalize_metadata(meta: dict[str, Any], spec: ReleaseSpec = V1_SPEC, config: str | None = None) -> dict[str, Any]:
    """The validated, coerced JSON object of a metadata dict (see ``SampleMetadata.from_dict``)."""
    return SampleMetadata.from_dict(meta, spec, config).to_dict()


def encode_metadata(meta: dict[str, Any], spec: ReleaseSpec = V1_SPEC, config: str | None = None) -> bytes:
    """Canonical bytes of a sample's metadata, validated against ``spec`` and ``config``'s declared fields."""
    return SampleMetadata.from_dict(meta, spec, config).encode()


def decode_metadata(data: bytes, spec: ReleaseSpec = V1_SPEC, config: str | None = None) -> SampleMetadata:
    """Parse and validate a ``KEY.json`` member (raises ValueError naming the problem)."""
    try:
        obj = load_json(data, "its metadata")
    except ValueError as err:
        raise ValueError(str(err)) from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    return SampleMetadata.from_dict(obj, spec, config)
