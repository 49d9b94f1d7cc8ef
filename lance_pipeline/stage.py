"""The contract between the builder and the method stages.

A stage is one step of LANCE (Prabhu et al., NeurIPS 2023, Algorithm 1): captioning, caption
perturbation, label-preservation checks, inversion, editing. The builder owns all I/O and bookkeeping
(sources, ledger, shards, manifest); a stage only turns plain records into plain updates, in batches.

Declarations (class attributes, checked by ``lance-cf validate`` and before every build, without loading a model):

- ``version``: a string recorded in the manifest; bump it when the same inputs and options give different outputs.
- ``consumes`` / ``produces``: every record field the stage reads / returns, with its kind (``FIELD_KINDS``). Every
  consumed field must be a source field (``SOURCE_FIELDS``) or produced by an earlier active stage. At run time a
  stage sees a ``DeclaredRecord`` (reading an undeclared field raises ``StageContractError``) and its updates are
  checked against ``produces``: a wrong key is a programming error that stops the build, never per-sample data.
- ``outputs``: the ``ReleaseOutput``s (record field -> release config) the engine writes from this stage's fields.
- ``screens`` (optional): the ``OutputScreen``s of a stage that checks another stage's release samples (a safety
  checker, the sensitive-edit screen): it produces the screened field again, may add metadata fields to its samples
  and lists the samples it removed, with their reasons (the builder records each as a failure).
- ``options_class`` (optional): a dataclass of the stage's options; without it the options type is derived from the
  constructor's annotated signature (``options_type``). Options are weight-free: constructing a stage loads nothing.

Life cycle, driven by the builder:

1. The stage object is created from its options (no weights are touched: ``--help``, config validation
   and listing run anywhere).
2. ``load(device)`` materialises models once per build.
3. ``process(records)`` is called once per batch. ``records`` is a list of dicts holding at least the
   builder's fields (see ``SOURCE_FIELDS``) plus every field earlier stages returned. It returns, in the
   same order, either an *update* (a dict of new fields, merged into the record and persisted in the
   ledger so a resumed build never recomputes it) or a ``SampleFailure`` (recorded with its reason; the
   sample skips the remaining stages but its ``original`` image is still released). A ``SampleFailure`` is
   final; an *exception* raised on a sample is recorded as an error and retried when the build is re-run.
4. ``describe()`` returns what the manifest records about the stage: model ids, revisions, constants.

Values allowed in an update: JSON types (str, int, float, bool, None, lists, dicts with str keys),
``PIL.Image.Image`` and ``torch.Tensor`` (stored losslessly: PNG and safetensors), nested freely.

Seeds: ``record["seed"]`` is derived by the builder from (release seed, source key), never from order or
time. A stage that draws random numbers must derive them from that seed only (e.g.
``torch.Generator().manual_seed(record["seed"])``), so a sample's outputs do not depend on which batch it
landed in.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import inspect
import typing
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from lance_pipeline.edit_types import EDIT_TYPES, MULTI_EDIT_TYPE
from lance_pipeline.option_types import Options, check_value, describe_type

Record = dict[str, Any]

# The kinds a record field may hold. Stages declare the kind of every field they read and write; validation checks
# that a consumer's kind matches its producer's, and the engine checks every update's values at run time.
FIELD_KINDS = ("str", "int", "float", "bool", "image", "tensor", "list", "dict", "any")

# Fields the builder puts into every record before the first stage runs.
SOURCE_FIELDS: dict[str, str] = {
    "key": "str",  # source key, only [A-Za-z0-9_-]
    "image": "image",  # PIL.Image.Image, RGB, already centre-cropped/resized to the build's image_size
    "label": "int",  # index in the release's label space
    "label_name": "str",  # human-readable class name (e.g. "dog sled")
    "seed": "int",  # per-sample seed
}

SCORE_NAMES = (
    "label_similarity",
    "span_similarity",
    "clip_directional",
    "clip_image",
    "clip_text_original",
    "clip_text_edited",
)

# The edit types live in one table (lance_pipeline.edit_types); these are its built-in names and DILLEMA's "multi".
# Code that must see a type registered at run time calls edit_types.edit_type_names() / release_edit_types().
RELEASE_EDIT_TYPES = (*EDIT_TYPES, MULTI_EDIT_TYPE)


@dataclass(frozen=True)
class SampleFailure:
    """A per-sample failure. Failures are data: the builder records ``reason`` and carries on."""

    reason: str


@dataclass(frozen=True)
class MetadataField:
    """An extra per-sample metadata field of a release config (beyond the v1 fields), e.g. ``editor``.

    Same shape as ``builder.release_format.FieldSpec`` (which validates it); kept here so that stages never import
    the builder. ``dtype``: ``string``, ``int64``, ``float64`` or ``bool``; values are nullable. ``minimum``,
    ``maximum`` (``minimum_exclusive``) declare a number's range, ``references`` the config whose sample key a string
    names: the release's writer, ``verify`` and ``eval`` refuse a sample that breaks them.
    """

    name: str
    dtype: str
    enum: tuple[str, ...] | None = None
    description: str = ""
    minimum: float | None = None
    maximum: float | None = None
    minimum_exclusive: bool = False
    references: str | None = None


@dataclass(frozen=True)
class ReleaseOutput:
    """A record field that becomes samples of a release config (declared by the stage that produces the field).

    Attributes:
        config: Release config name, e.g. ``"counterfactual"``.
        field: The record field. ``many=False``: one image; ``many=True``: a list of dicts, each holding ``"image"``
            plus per-sample metadata fields (``edit_type``, ``edited_caption``, spans, ``self_replace``, ``scores``).
        key_suffix: Sample key suffix: ``KEY_<suffix>`` (one) or ``KEY_<suffix>000``, ``KEY_<suffix>001``...
            (many); ``None`` keeps the source key (only the source's own ``original``).
        many: Whether the field holds a list of samples.
        description: One line for the card, for a config that is not one of LANCE's four (which have theirs).
        fields: Extra metadata fields of the config; their values are read from each item (``many``) or from the
            record (one), by name.
        config_field: Route each record to the config its field of this name names (``many=False`` only): the
            output then writes every config listed in its stage's ``configs`` (e.g. one per shift), ``config`` is
            only a label, and a record whose field is null (or names a config not built) is not released. The
            engine counts where every routed record went, per class, in the manifest's ``build.routing``.
        enabled_by: A boolean option of the stage that switches this output on (off: the stage writes nothing to it).
            The builder refuses to build the config while the option is off, and switches the option off for a build
            that does not build the config, so that nothing is computed and stored for it.
        requires: Configs whose samples this config's samples link to (by key): building it without them is refused.
        unique: Groups of metadata fields that no two samples of the config share (see ``builder.release_format``
            ``ConfigSpec``); ``one_true_per``: ``(flag, group)`` pairs, exactly one sample per group has the flag.
    """

    config: str
    field: str
    key_suffix: str | None
    many: bool = False
    description: str = ""
    fields: tuple[MetadataField, ...] = ()
    config_field: str | None = None
    enabled_by: str | None = None
    requires: tuple[str, ...] = ()
    unique: tuple[tuple[str, ...], ...] = ()
    one_true_per: tuple[tuple[str, str], ...] = ()

    def sample_key(self, source_key: str, index: int = 0) -> str:
        if self.key_suffix is None:
            return source_key
        return f"{source_key}_{self.key_suffix}{index:03d}" if self.many else f"{source_key}_{self.key_suffix}"


@dataclass(frozen=True)
class OutputScreen:
    """A stage's check of the samples another stage's ``ReleaseOutput`` writes from record field ``field``.

    The screening stage produces ``field`` again: the same samples, each carrying ``fields`` (on every item of a list
    field; on the record for a single image), minus the ones it removed (a list item left out; a single image set to
    ``None``). When ``removed`` names a produced list field, each entry ``{"reason": ...}`` of it becomes a failure of
    the stage in the manifest, so a sample never leaves a release silently. ``fields`` join the declared metadata of
    every selected config written from ``field``.
    """

    field: str
    fields: tuple[MetadataField, ...] = ()
    removed: str | None = None


# An item of a list output (``ReleaseOutput(many=True)``) may carry its position under this name: its key is then built
# from it, not from its place in the list, so a screen that removes samples renumbers none of the others (and keys that
# other samples name, such as the strength config's ``counterfactual_key``, stay true).
SAMPLE_INDEX = "sample_index"


# What the builder releases straight from the source, before any stage.
SOURCE_OUTPUTS = (ReleaseOutput("original", "image", None),)


class StageContractError(TypeError):
    """A stage broke its declared contract (read or wrote an undeclared field, wrong kind): a programming error."""


@runtime_checkable
class Stage(Protocol):
    """What every method stage implements. See the module docstring for the life cycle and the declarations."""

    name: str
    version: str
    consumes: dict[str, str]
    produces: dict[str, str]
    # Optional: ``outputs: tuple[ReleaseOutput, ...]`` (default none) and ``options_class`` (a dataclass).

    def load(self, device: str) -> None: ...

    def process(self, records: list[Record]) -> list[Record | SampleFailure]: ...

    def describe(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class StageContract:
    """A stage class's declarations, checked for internal consistency."""

    version: str
    consumes: dict[str, str]
    produces: dict[str, str]
    outputs: tuple[ReleaseOutput, ...]
    screens: tuple[OutputScreen, ...] = ()


def contract_of(cls: type) -> StageContract:
    """The declared contract of a stage class; raises ``StageContractError`` naming what is missing or wrong."""
    where = f"stage class {cls.__module__}.{cls.__qualname__}"
    missing = [a for a in ("version", "consumes", "produces") if not hasattr(cls, a)]
    if missing:
        raise StageContractError(f"{where} does not declare {', '.join(missing)} (see lance_pipeline/stage.py)")
    version, consumes, produces = cls.version, dict(cls.consumes), dict(cls.produces)
    outputs = tuple(getattr(cls, "outputs", ()))
    if not isinstance(version, str) or not version:
        raise StageContractError(f"{where}: version must be a non-empty string, got {version!r}")
    for what, fields in (("consumes", consumes), ("produces", produces)):
        for name, kind in fields.items():
            if kind not in FIELD_KINDS:
                raise StageContractError(f"{where}: {what}[{name!r}] = {kind!r}; kinds are {', '.join(FIELD_KINDS)}")
    # A screen produces the field it screens again; of a source's own image (a source of generated images, e.g.
    # discovery:) that is the one source field a stage may produce.
    rescreened = {s.field for s in getattr(cls, "screens", ()) if isinstance(s, OutputScreen)}
    clobbered = sorted((set(produces) - rescreened) & set(SOURCE_FIELDS))
    if clobbered:
        raise StageContractError(f"{where} produces source field(s) {clobbered}; stages may only add fields")
    for output in outputs:
        if not isinstance(output, ReleaseOutput):
            raise StageContractError(f"{where}: outputs must hold ReleaseOutput, got {output!r}")
        expected = "list" if output.many else "image"
        if produces.get(output.field) != expected:
            raise StageContractError(
                f"{where}: output {output.config!r} reads field {output.field!r}, which the stage must produce "
                f"as {expected!r} (produces: {produces})"
            )
        if output.key_suffix is None:
            raise StageContractError(f"{where}: output {output.config!r} needs a key_suffix")
    screens = tuple(getattr(cls, "screens", ()))
    for screen in screens:
        if not isinstance(screen, OutputScreen):
            raise StageContractError(f"{where}: screens must hold OutputScreen, got {screen!r}")
        for name in (screen.field, screen.removed):
            if name is not None and name not in produces:
                raise StageContractError(f"{where}: screen of {screen.field!r} names field {name!r}, not produced")
        if screen.removed is not None and produces[screen.removed] != "list":
            raise StageContractError(f"{where}: screen field {screen.removed!r} must be produced as 'list'")
    return StageContract(version, consumes, produces, outputs, screens)


# -- options -----------------------------------------------------------------------------------------------------------
@functools.cache
def options_type(cls: type) -> type:
    """The stage's (or source's) options as a dataclass: ``cls.options_class`` as declared (an ``Options`` subclass,
    whose field annotations are its value checks), or, for a class that declares none (a custom stage or source), one
    derived from ``__init__``'s signature, with a field per keyword parameter, its annotation and default (a source's
    ``spec`` and ``path``, named by its ``non_option_arguments``, are not options).
    """
    declared = getattr(cls, "options_class", None)
    if declared is not None:
        if not dataclasses.is_dataclass(declared):
            raise StageContractError(f"{cls.__qualname__}.options_class must be a dataclass")
        return declared
    hints = typing.get_type_hints(cls.__init__, include_extras=True)
    fields = []
    not_options = {"self", *getattr(cls, "non_option_arguments", ())}
    for name, parameter in inspect.signature(cls.__init__).parameters.items():
        if name in not_options or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        annotation = hints.get(name, Any)
        if parameter.default is parameter.empty:
            fields.append((name, annotation))
        else:
            default = parameter.default
            fields.append((name, annotation, dataclasses.field(default_factory=lambda d=default: d)))
    # Pickled as (stage class, values): a derived class is found through its stage, not by a module attribute.
    namespace = {"__reduce__": lambda self: (_derived_options, (cls, option_values(self)))}
    return dataclasses.make_dataclass(f"{cls.__name__}Options", fields, bases=(Options,), namespace=namespace)


def _derived_options(cls: type, values: dict[str, Any]) -> Any:
    return options_type(cls)(**values)


def check_options(cls: type, options: dict[str, Any], where: str) -> Any:
    """The stage's typed options from a config's ``options`` mapping, defaults filled in: constructed, and so checked
    (``Options``: each value against its field's annotation, then the relations between fields), once.

    Raises ``ValueError`` naming ``where`` and the option: unknown names (with "did you mean"), missing required ones,
    values of the wrong type or out of range. Nothing is loaded.
    """
    if not isinstance(options, dict):
        raise ValueError(f"{where}: options must be a mapping of name: value, got {type(options).__name__}")
    kind = options_type(cls)
    fields = {f.name: f for f in dataclasses.fields(kind) if f.init}
    for name in options:
        if name not in fields:
            close = difflib.get_close_matches(str(name), list(fields), n=1)
            takes = f"options are {', '.join(fields)}" if fields else "it takes no options"
            hint = f"; did you mean {close[0]!r}?" if close else f"; {takes}"
            raise ValueError(f"{where}: unknown option {name!r}{hint}")
    if not issubclass(kind, Options):  # a plain dataclass of a custom stage: its values checked here
        hints = typing.get_type_hints(kind, include_extras=True)
        for name, value in options.items():
            annotation = hints.get(name, Any)
            problem = check_value(value, annotation)
            if problem is not None:
                raise ValueError(
                    f"{where}: option {name} = {value!r}: expected {describe_type(annotation)} ({problem})"
                )
    required = [
        n
        for n, f in fields.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and n not in options
    ]
    if required:
        raise ValueError(f"{where}: missing option(s) {', '.join(required)}")
    try:
        return kind(**options)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from err


def option_values(options: Any) -> dict[str, Any]:
    """Every option of typed ``options`` by name, defaults filled in (the constructor's fields, in declared order)."""
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options) if f.init}


def with_values(options: Any, **values: Any) -> Any:
    """``options`` with some values replaced by values already checked (a model reference resolved to its directory,
    an output switched off for this build), without constructing the options again."""
    if not values:
        return options
    changed = copy.copy(options)
    for name, value in values.items():
        object.__setattr__(changed, name, value)
    return changed


def create_stage(cls: type, options: Any) -> Any:
    """The stage of class ``cls`` from its typed options (``check_options``), which are not constructed again: a stage
    that declares ``options_class`` takes the options object (``cls(options)``), one whose options are derived from
    its constructor takes their values as keywords."""
    if getattr(cls, "options_class", None) is not None:
        return cls(options)
    return cls(**option_values(options))


def stage_options(cls: type, options: Any, values: dict[str, Any]) -> Any:
    """For a stage's ``__init__(self, options=None, /, **values)`` (and a source's ``__init__(self, spec, path,
    options=None, /, **values)``): the typed options given (by the builder, checked once), or constructed (and so
    checked) from keyword values, as tests and Python callers write them."""
    declared = cls.options_class
    if options is None:
        return declared(**values)
    if values or not isinstance(options, declared):
        raise TypeError(f"{cls.__name__} takes its options as one {declared.__name__} or as keywords, not both")
    return options


# -- records at run time -----------------------------------------------------------------------------------------------
def kind_of(value: Any) -> str:
    """The field kind of a value (see ``FIELD_KINDS``)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, list | tuple):
        return "list"
    if isinstance(value, dict):
        return "dict"
    if type(value).__module__.startswith("PIL.") or hasattr(value, "getpixel"):
        return "image"
    if type(value).__module__.startswith("torch"):
        return "tensor"
    return type(value).__name__


def check_update(stage: str, produces: dict[str, str], update: dict[str, Any]) -> None:
    """Raise ``StageContractError`` if an update writes an undeclared field or a value of the wrong kind.

    ``None`` is accepted for any declared field (an optional result).
    """
    for name, value in update.items():
        if name not in produces:
            close = difflib.get_close_matches(name, list(produces), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise StageContractError(
                f"stage {stage} returned field {name!r}, which it does not declare in produces{hint}"
            )
        declared, actual = produces[name], kind_of(value)
        if value is not None and declared != "any" and not (declared == "float" and actual == "int"):
            if actual != declared:
                raise StageContractError(f"stage {stage} returned {name}={actual}, but declares it as {declared}")


class DeclaredRecord(dict):
    """A record as one stage sees it: reading a field the stage did not declare is a ``StageContractError``.

    Reads are checked (``record["x"]``, ``record.get("x")``, ``"x" in record``) so that a stage which forgot a field
    in ``consumes`` fails on its first batch, instead of reading ``None`` and turning a bug into per-sample data.
    """

    __slots__ = ("_stage", "_allowed")

    def __init__(self, data: dict[str, Any], stage: str, allowed: frozenset[str]):
        super().__init__(data)
        self._stage = stage
        self._allowed = allowed

    def _check(self, name: Any) -> None:
        if name not in self._allowed:
            raise StageContractError(
                f"stage {self._stage} read record field {name!r}, which it does not declare in consumes"
            )

    def __getitem__(self, name: str) -> Any:
        self._check(name)
        return super().__getitem__(name)

    def get(self, name: str, default: Any = None) -> Any:
        self._check(name)
        return super().get(name, default)

    def __contains__(self, name: object) -> bool:
        self._check(name)
        return super().__contains__(name)

    def __reduce__(self):  # crosses to Ray actors as itself
        return (DeclaredRecord, (dict(self), self._stage, self._allowed))
