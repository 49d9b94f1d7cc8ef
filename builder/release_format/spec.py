"""What a release declares about its configs: their names, descriptions and extra per-sample metadata fields.

The set of release configs is open. Format v1 knew exactly four (``V1_CONFIGS``) and one vocabulary of edit types and
score names (``V1_EDIT_TYPES``, ``V1_SCORE_NAMES``, frozen here because v1 manifests do not record them). From v2 on a
manifest carries its ``release_spec``: every config it holds, with a description and any extra metadata fields (a
generation mode can declare one config per shift and a ``shift`` field, say), and the vocabulary its method used.
The JSON schema, the ``datasets`` features, ``_info.json`` and the card's YAML are all generated from this declaration.
The 12 v1 metadata fields are present in every config of every version, unchanged.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class FieldSpec:
    """One extra per-sample metadata field a config declares. Always nullable (null where not computed).

    Args:
        name: the field's key in ``KEY.json`` (``[a-z][a-z0-9_]*``, not one of the v1 fields).
        dtype: ``string``, ``int64``, ``float64`` or ``bool``.
        enum: for a string field, the values it may take.
        description: one line for the card and the docs.
    """

    name: str
    dtype: str
    enum: tuple[str, ...] | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if not is_valid_config_name(self.name):
            raise ValueError(f"metadata field {self.name!r}: use lower-case letters, digits and '_'")
        if self.dtype not in FIELD_DTYPES:
            raise ValueError(f"metadata field {self.name!r}: dtype {self.dtype!r} is not one of {FIELD_DTYPES}")
        if self.enum is not None:
            if self.dtype != "string":
                raise ValueError(f"metadata field {self.name!r}: enum values are only for string fields")
            object.__setattr__(self, "enum", tuple(self.enum))

    def check(self, value: Any, where: str) -> Any:
        """``value`` coerced to this field's type (ints to float for float64), or a ValueError naming the field."""
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
        return float(value) if self.dtype == "float64" else value

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "enum": list(self.enum) if self.enum is not None else None,
            "description": self.description,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FieldSpec:
        enum = data.get("enum")
        return cls(data["name"], data["dtype"], tuple(enum) if enum is not None else None, data.get("description", ""))


@dataclass(frozen=True)
class ConfigSpec:
    """One release config: its name (a folder under ``data/``), its card description and its extra fields."""

    name: str
    description: str
    fields: tuple[FieldSpec, ...] = ()

    def __post_init__(self) -> None:
        if not is_valid_config_name(self.name):
            raise ValueError(f"release config {self.name!r}: use lower-case letters, digits and '_'")
        object.__setattr__(self, "fields", tuple(self.fields))
        names = [f.name for f in self.fields]
        if not names:
            return
        clash = sorted(set(names) & set(V1_FIELD_NAMES))
        if clash:
            raise ValueError(f"release config {self.name!r}: extra field(s) {clash} shadow v1 metadata fields")
        if len(set(names)) != len(names):
            raise ValueError(f"release config {self.name!r}: a field is declared twice in {names}")

    def to_dict(self) -> dict[str, Any]:
        return {"description": self.description, "fields": [f.to_dict() for f in self.fields]}


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
        configs = tuple(
            ConfigSpec(
                name,
                data["configs"][name]["description"],
                tuple(FieldSpec.from_dict(f) for f in data["configs"][name].get("fields", [])),
            )
            for name in data["config_order"]
        )
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
