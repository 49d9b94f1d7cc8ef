"""What a release declares about its configs: their names, descriptions and extra per-sample metadata fields.

The set of release configs is open. Format v1 knew exactly four (``V1_CONFIGS``) and one vocabulary of edit types and
score names (``V1_EDIT_TYPES``, ``V1_SCORE_NAMES``, frozen here because v1 manifests do not record them). From v2 on a
manifest carries its ``release_spec``: every config it holds, with a description and any extra metadata fields (a
generation mode can declare one config per shift and a ``shift`` field, say), and the vocabulary its method used.
The JSON schema, the ``datasets`` features, ``_info.json`` and the card's YAML are all generated from this declaration.
The 12 v1 metadata fields are present in every config of every version, unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from builder.release_format.layout import is_valid_config_name

FIELD_DTYPES = ("string", "int64", "float64", "bool")

# The vocabulary of format v1, frozen: the method's live vocabulary is lance_pipeline.stage.RELEASE_EDIT_TYPES and
# SCORE_NAMES, which the builder records into each v2 manifest (a test checks the two still agree). v1 releases hold
# LANCE's six edit types and, since the DILLEMA editor, "multi".
LANCE_EDIT_TYPES = ("subject", "object", "background", "weather", "adjective", "domain")
V1_EDIT_TYPES = (*LANCE_EDIT_TYPES, "multi")
# The 12 per-sample metadata fields of format v1, in their on-disk order: present in every config of every version
# (metadata.SampleMetadata lays them out and checks it holds exactly these); a config's extra fields must not shadow
# them.
V1_FIELD_NAMES = (
    "key",
    "source_key",
    "label",
    "label_name",
    "edit_type",
    "caption",
    "edited_caption",
    "original_span",
    "edited_span",
    "seed",
    "self_replace",
    "scores",
)
V1_SCORE_NAMES = (
    "label_similarity",
    "span_similarity",
    "clip_directional",
    "clip_image",
    "clip_text_original",
    "clip_text_edited",
)
# The judge stage's declared fields (``lance_pipeline.screening.judge.JUDGE_FIELDS``, which the method declares with
# their types and ranges; a test keeps the names equal): the names that review, cards and eval read from a sample.
JUDGE_CLASS_FIELD = "judge_class_p"
JUDGE_EDIT_FIELD = "judge_edit_p"


@dataclass(frozen=True)
class FieldSpec:
    """One extra per-sample metadata field a config declares. Always nullable (null where not computed).

    Args:
        name: the field's key in ``KEY.json`` (``[a-z][a-z0-9_]*``, not one of the v1 fields).
        dtype: ``string``, ``int64``, ``float64`` or ``bool``.
        enum: for a string field, the values it may take.
        description: one line for the card and the docs.
        minimum, maximum: for a number field, its range (``maximum`` inclusive); ``minimum_exclusive`` makes the lower
            bound exclusive (a strength in (0, 1]). A float64 is finite whether or not a range is declared.
        references: for a string field, the release config whose sample's key it names (``counterfactual_key``
            names a sample of ``counterfactual``): a value that names no sample there breaks the release.
    """

    name: str
    dtype: str
    enum: tuple[str, ...] | None = None
    description: str = ""
    minimum: float | None = None
    maximum: float | None = None
    minimum_exclusive: bool = False
    references: str | None = None

    def __post_init__(self) -> None:
        if not is_valid_config_name(self.name):
            raise ValueError(f"metadata field {self.name!r}: use lower-case letters, digits and '_'")
        if self.dtype not in FIELD_DTYPES:
            raise ValueError(f"metadata field {self.name!r}: dtype {self.dtype!r} is not one of {FIELD_DTYPES}")
        if self.enum is not None:
            if self.dtype != "string":
                raise ValueError(f"metadata field {self.name!r}: enum values are only for string fields")
            object.__setattr__(self, "enum", tuple(self.enum))
        for bound in ("minimum", "maximum"):
            value = getattr(self, bound)
            if value is None:
                continue
            if self.dtype not in ("int64", "float64"):
                raise ValueError(f"metadata field {self.name!r}: a {bound} is only for number fields")
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"metadata field {self.name!r}: {bound} {value!r} is not a finite number")
        if self.minimum is not None and self.maximum is not None and self.minimum > self.maximum:
            raise ValueError(f"metadata field {self.name!r}: minimum {self.minimum} is above maximum {self.maximum}")
        if self.minimum_exclusive and self.minimum is None:
            raise ValueError(f"metadata field {self.name!r}: minimum_exclusive needs a minimum")
        if self.references is not None and (self.dtype != "string" or not is_valid_config_name(self.references)):
            raise ValueError(f"metadata field {self.name!r}: references names a config and is only for string fields")

    def check(self, value: Any, where: str) -> Any:
        """``value`` coerced to this field's type (ints to float for float64), or a ValueError naming the field and
        the declared type, values or range it breaks."""
        if value is None:
            return None
        ok = {
            "string": isinstance(value, str),
            "int64": isinstance(value, int) and not isinstance(value, bool),
            "float64": isinstance(value, (int, float)) and not isinstance(value, bool),
            "bool": isinstance(value, bool),
        }[self.dtype]
        if not ok:
            raise ValueError(f"{where}: metadata field {self.name!r} is {value!r}, expected {self.dtype} or null")
        if self.enum is not None and value not in self.enum:
            raise ValueError(f"{where}: metadata field {self.name!r} is {value!r}, expected one of {list(self.enum)}")
        if self.dtype == "float64" and not math.isfinite(value):
            raise ValueError(f"{where}: metadata field {self.name!r} is {value!r}, expected a finite number")
        if not self.in_range(value):
            raise ValueError(
                f"{where}: metadata field {self.name!r} is {value!r}, expected a value in {self.range_text}"
            )
        return float(value) if self.dtype == "float64" else value

    def in_range(self, value: float) -> bool:
        if self.minimum is not None and (value <= self.minimum if self.minimum_exclusive else value < self.minimum):
            return False
        return self.maximum is None or value <= self.maximum

    @property
    def range_text(self) -> str:
        low = "-inf" if self.minimum is None else f"{self.minimum:g}"
        high = "inf" if self.maximum is None else f"{self.maximum:g}"
        return f"{'(' if self.minimum_exclusive or self.minimum is None else '['}{low}, {high}{']' if self.maximum is not None else ')'}"

    def to_dict(self) -> dict[str, Any]:
        """The declaration for the manifest; a range or a reference is written only where declared, so the
        declarations of fields without one (and of releases written before ranges existed) keep their bytes."""
        out: dict[str, Any] = {
            "name": self.name,
            "dtype": self.dtype,
            "enum": list(self.enum) if self.enum is not None else None,
            "description": self.description,
        }
        if self.minimum is not None:
            out["minimum"] = self.minimum
            if self.minimum_exclusive:
                out["minimum_exclusive"] = True
        if self.maximum is not None:
            out["maximum"] = self.maximum
        if self.references is not None:
            out["references"] = self.references
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FieldSpec:
        if (
            not isinstance(data, dict)
            or not isinstance(data.get("name"), str)
            or not isinstance(data.get("dtype"), str)
        ):
            raise ValueError(f"release_spec: a metadata field declaration is {data!r}, expected name and dtype")
        enum = data.get("enum")
        if enum is not None and (not isinstance(enum, list) or not all(isinstance(v, str) for v in enum)):
            raise ValueError(f"release_spec: field {data['name']!r}: enum {enum!r} is not a list of strings")
        exclusive = data.get("minimum_exclusive", False)
        if not isinstance(exclusive, bool):
            raise ValueError(f"release_spec: field {data['name']!r}: minimum_exclusive {exclusive!r} is not a boolean")
        references = data.get("references")
        if references is not None and not isinstance(references, str):
            raise ValueError(f"release_spec: field {data['name']!r}: references {references!r} is not a config name")
        return cls(
            data["name"],
            data["dtype"],
            tuple(enum) if enum is not None else None,
            str(data.get("description", "")),
            data.get("minimum"),
            data.get("maximum"),
            exclusive,
            references,
        )


@dataclass(frozen=True)
class ConfigSpec:
    """One release config: its name (a folder under ``data/``), its card description, its extra fields and the
    relations between its samples.

    Args:
        unique: groups of field names whose values together identify one sample: no two samples of the config share
            them (the strength config's ``(counterfactual_key, strength)``: one candidate per edit and strength).
        one_true_per: pairs ``(flag, group)``: among the samples with one value of field ``group``, exactly one has
            the boolean field ``flag`` true (the strength config's one ``selected`` candidate per edit).
    """

    name: str
    description: str
    fields: tuple[FieldSpec, ...] = ()
    unique: tuple[tuple[str, ...], ...] = ()
    one_true_per: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not is_valid_config_name(self.name):
            raise ValueError(f"release config {self.name!r}: use lower-case letters, digits and '_'")
        object.__setattr__(self, "fields", tuple(self.fields))
        object.__setattr__(self, "unique", tuple(tuple(group) for group in self.unique))
        object.__setattr__(self, "one_true_per", tuple(tuple(pair) for pair in self.one_true_per))
        names = [f.name for f in self.fields]
        if names:
            clash = sorted(set(names) & set(V1_FIELD_NAMES))
            if clash:
                raise ValueError(f"release config {self.name!r}: extra field(s) {clash} shadow v1 metadata fields")
            if len(set(names)) != len(names):
                raise ValueError(f"release config {self.name!r}: a field is declared twice in {names}")
        known = {*V1_FIELD_NAMES, *names}
        for group in self.unique:
            if not group or not set(group) <= known:
                raise ValueError(f"release config {self.name!r}: unique {list(group)} names no declared field(s)")
        for pair in self.one_true_per:
            if len(pair) != 2 or not set(pair) <= known:
                raise ValueError(f"release config {self.name!r}: one_true_per {list(pair)} is not (flag, group)")
            flag = next((f for f in self.fields if f.name == pair[0]), None)
            if flag is None or flag.dtype != "bool":
                raise ValueError(f"release config {self.name!r}: one_true_per flag {pair[0]!r} is not a bool field")

    def field(self, name: str) -> FieldSpec | None:
        return next((f for f in self.fields if f.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"description": self.description, "fields": [f.to_dict() for f in self.fields]}
        if self.unique:  # written only where declared: the declarations of other configs keep their bytes
            out["unique"] = [list(group) for group in self.unique]
        if self.one_true_per:
            out["one_true_per"] = [list(pair) for pair in self.one_true_per]
        return out

    @classmethod
    def from_dict(cls, name: str, data: dict[str, Any]) -> ConfigSpec:
        if not isinstance(data, dict):
            raise ValueError(f"release_spec: config {name!r} is {data!r}, expected a mapping")
        groups = {}
        for key in ("unique", "one_true_per"):
            value = data.get(key, [])
            if not isinstance(value, list) or not all(
                isinstance(g, list) and all(isinstance(n, str) for n in g) for g in value
            ):
                raise ValueError(f"release_spec: config {name!r}: {key} {value!r} is not a list of field-name lists")
            groups[key] = tuple(tuple(g) for g in value)
        fields = data.get("fields", [])
        if not isinstance(fields, list):
            raise ValueError(f"release_spec: config {name!r}: fields {fields!r} is not a list")
        return cls(
            name,
            str(data.get("description", "")),
            tuple(FieldSpec.from_dict(f) for f in fields),
            groups["unique"],
            groups["one_true_per"],
        )


@dataclass(frozen=True)
class ReleaseSpec:
    """Everything a release declares about its samples: configs (in order) and the method's vocabulary."""

    configs: tuple[ConfigSpec, ...]
    edit_types: tuple[str, ...] = V1_EDIT_TYPES
    score_names: tuple[str, ...] = V1_SCORE_NAMES

    def __post_init__(self) -> None:
        object.__setattr__(self, "configs", tuple(self.configs))
        object.__setattr__(self, "edit_types", tuple(self.edit_types))
        object.__setattr__(self, "score_names", tuple(self.score_names))
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"release configs {list(self.names)}: a config is declared twice")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.configs)

    def config(self, name: str) -> ConfigSpec:
        for config in self.configs:
            if config.name == name:
                return config
        raise ValueError(f"release config {name!r} is not declared (declared: {', '.join(self.names) or 'none'})")

    def restricted(self, names: list[str] | tuple[str, ...]) -> ReleaseSpec:
        """The same declaration with only ``names`` (in that order)."""
        return ReleaseSpec(tuple(self.config(n) for n in names), self.edit_types, self.score_names)

    def to_dict(self) -> dict[str, Any]:
        return {
            "configs": {c.name: c.to_dict() for c in self.configs},
            "config_order": list(self.names),
            "edit_types": list(self.edit_types),
            "score_names": list(self.score_names),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReleaseSpec:
        for key in ("configs", "config_order", "edit_types", "score_names"):
            if key not in data:
                raise ValueError(f"release_spec is missing {key!r}")
        if not isinstance(data["configs"], dict) or not isinstance(data["config_order"], list):
            raise ValueError("release_spec: configs is not a mapping or config_order not a list")
        missing = [n for n in data["config_order"] if n not in data["configs"]]
        if missing:
            raise ValueError(f"release_spec: config_order names undeclared config(s) {missing}")
        configs = tuple(ConfigSpec.from_dict(name, data["configs"][name]) for name in data["config_order"])
        return cls(configs, tuple(data["edit_types"]), tuple(data["score_names"]))


V1_CONFIGS = (
    ConfigSpec("original", "the source images, unedited"),
    ConfigSpec(
        "reconstructed",
        "the source images regenerated through inversion with no edit (controls for regeneration)",
    ),
    ConfigSpec("counterfactual", "LANCE counterfactuals that passed every filter, one row per kept edit"),
    ConfigSpec("lance_r", "LANCE-R baseline: random caption edits, same editor and filters"),
)
V1_SPEC = ReleaseSpec(V1_CONFIGS, V1_EDIT_TYPES, V1_SCORE_NAMES)
CONFIG_NAMES = V1_SPEC.names  # the LANCE configs (format v1); a v2 release may declare others


def lance_release_spec(
    configs: list[str] | tuple[str, ...],
    edit_types: tuple[str, ...] = V1_EDIT_TYPES,
    score_names: tuple[str, ...] = V1_SCORE_NAMES,
    extra: tuple[ConfigSpec, ...] = (),
) -> ReleaseSpec:
    """The declaration of a LANCE build of ``configs``: the v1 configs it names, then any ``extra`` declared ones."""
    declared = {c.name: c for c in (*V1_CONFIGS, *extra)}
    unknown = [c for c in configs if c not in declared]
    if unknown:
        raise ValueError(f"release config(s) {unknown} are not declared (declared: {', '.join(declared)})")
    return ReleaseSpec(tuple(declared[c] for c in configs), tuple(edit_types), tuple(score_names))
