"""Validate a build config against the stage contract before anything is loaded or written.

``lance-cf validate`` and every ``lance-cf build`` run this first. It constructs every stage's typed options once
(``check_options``), creates the stage from them (stages load no weights when constructed; ``demo:``/``pkg:`` model
references stay unresolved) and passes them on in ``ValidatedStage.options``; the config hash is computed from them
(``ValidatedBuild.config_hash``). The source's typed options are made the same way, once
(``builder.sources.check_source_options``), and the build creates the source from them. It checks:

1. every stage's options against its typed options (unknown names with "did you mean", types, bounds and choices as
   the options' annotations say them, then the relations between options);
2. the field graph of the active stages, in order: each consumed field is a source field or produced by an earlier
   active stage, with the same kind; then the source's options, as the stages' in 1;
3. the release configs: each selected config is written by exactly one active stage (or is the source's
   ``original``), and each stage's ``configs`` names only configs some stage writes.

It takes seconds and imports no model library; a typo in the last stage's options fails before the first one loads.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import os
from dataclasses import dataclass
from typing import Any

from builder import release_format as rf
from builder.config import BuildConfig, StageConfig, hashed_view, view_hash
from builder.registry import SOURCES, STAGES
from builder.sources import check_source_options
from lance_pipeline.edit_types import release_edit_types
from lance_pipeline.stage import (
    SCORE_NAMES,
    SOURCE_FIELDS,
    SOURCE_OUTPUTS,
    ReleaseOutput,
    StageContract,
    StageContractError,
    check_options,
    contract_of,
    create_stage,
    with_values,
)

ALLOW_CODE_ENV = "LANCE_CF_ALLOW_CODE"

logger = logging.getLogger(__name__)


def allow_code_from_env() -> bool:
    return os.environ.get(ALLOW_CODE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class ValidatedStage:
    config: StageConfig
    cls: type
    contract: StageContract
    is_code: bool  # named by ``module:attr`` instead of a registered name (ran only with --allow-code)
    # The typed options (``options_type``, defaults filled in), constructed and checked once, here: the engine creates
    # the stage from them (``create_stage``), the model check and the cost estimate read them. For this build: an
    # output switched off (``_switch_outputs``) is off here.
    options: Any = None

    def create(self) -> Any:
        """The stage object (nothing loaded), from the typed options."""
        return create_stage(self.cls, self.options)


@dataclass(frozen=True)
class ValidatedBuild:
    config: BuildConfig
    stages: tuple[ValidatedStage, ...]  # every stage of the config, in order
    active: tuple[ValidatedStage, ...]  # the stages the selected configs need, in order
    outputs: tuple[ReleaseOutput, ...]  # how records become samples of the selected configs
    known_configs: tuple[str, ...]  # every config this config's stages can write
    release_spec: Any  # builder.release_format.ReleaseSpec of the selected configs (declared fields included)
    # Every stage's typed options as the config writes them (before outputs are switched off for this build), by
    # stage name: what the config hash covers.
    written_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The source's typed options (its ``options_class``), constructed and checked once, here: the source is created
    # from them (``builder.sources.create_source``) and the config hash covers them.
    source_options: Any = None

    @functools.cached_property
    def hashed_view(self) -> dict[str, Any]:
        """What the config hash covers (``builder.config.hashed_view``), from the options validated here."""
        return hashed_view(self.config, self.written_options, source_options=self.source_options)

    @functools.cached_property
    def config_hash(self) -> str:
        """The config hash: of the effective options, so that writing a default changes nothing."""
        return view_hash(self.hashed_view)

    @functools.cached_property
    def config_hash_as_written(self) -> str:
        """The hash a build directory made before options were hashed by value holds for this config."""
        return self.config.config_hash_as_written()

    @property
    def code_targets(self) -> list[str]:
        """Stage types that name Python code (``module:attr``): recorded in the manifest."""
        return [s.config.type for s in self.stages if s.is_code]


def resolve_stage_class(stage: StageConfig, allow_code: bool) -> tuple[type, bool]:
    """The stage class a config names; a ``module:attr`` type is code and needs ``allow_code``."""
    where = f"stage {stage.name!r}"
    if not isinstance(stage.type, str) or not stage.type:
        raise ValueError(f"{where}: type must be a registered stage name ({', '.join(STAGES.names())})")
    is_code = stage.type not in STAGES.names() and ":" in stage.type
    if is_code and not allow_code:
        raise ValueError(
            f"{where}: type {stage.type!r} names Python code, not a registered stage; configs are data, so code runs "
            f"only with --allow-code (or {ALLOW_CODE_ENV}=1) when you trust this config"
        )
    try:
        cls = STAGES.resolve(stage.type)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{where}: cannot import {stage.type!r} ({err})") from err
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from err
    if not isinstance(cls, type):
        raise ValueError(f"{where}: {stage.type!r} is not a stage class")
    return cls, is_code


def validate_build(config: BuildConfig, *, allow_code: bool | None = None) -> ValidatedBuild:
    """Check everything about ``config`` that can be checked without data or models; raises ``ValueError``."""
    if allow_code is None:
        allow_code = allow_code_from_env()
    config.validate()
    stages = []
    for stage in config.stages:
        cls, is_code = resolve_stage_class(stage, allow_code)
        where = f"stage {stage.name!r} ({stage.type})"
        try:
            contract = contract_of(cls)
        except StageContractError as err:
            raise ValueError(f"{where}: {err}") from err
        typed = check_options(cls, stage.options, where)  # the only place a build constructs them
        try:
            create_stage(cls, typed)  # from the typed options; what the stage checks itself (a file it reads)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: {err}") from err
        stages.append(ValidatedStage(stage, cls, contract, is_code, typed))
    written = {s.config.name: s.options for s in stages}

    generates, source_fields, declared_outputs = source_declaration(config.source)
    # A source that generates (no image to read) releases nothing itself and gives its own fields instead of `image`;
    # a source may also declare its own outputs (e.g. a routed one: one config per discovered failure).
    source_outputs = () if generates else (declared_outputs or SOURCE_OUTPUTS)
    if any(o.config_field for o in source_outputs):  # a routed source output writes every selected config
        source_outputs = tuple(dataclasses.replace(source_outputs[0], config=name) for name in config.configs)
    available = {k: v for k, v in SOURCE_FIELDS.items() if not (generates and k == "image")} | source_fields

    writers: dict[str, list[tuple[ValidatedStage, ReleaseOutput]]] = {}
    for validated in stages:
        for output in validated.contract.outputs:
            if output.config_field is None:
                writers.setdefault(output.config, []).append((validated, output))
                continue
            for name in validated.config.configs:  # a routed output writes each config its stage serves
                writers.setdefault(name, []).append((validated, dataclasses.replace(output, config=name)))
    own = {o.config for o in source_outputs}
    known = [o.config for o in source_outputs] + [c for c in writers if c not in own]
    _check_config_names(config, known)

    selected = set(config.configs)
    for output in (o for s in stages for o in s.contract.outputs if o.config in selected):
        missing = [c for c in output.requires if c not in selected]
        if missing:
            raise ValueError(
                f"config {output.config!r} links its samples to config(s) {missing}, which this build does not "
                f"write; add {', '.join(map(repr, missing))} to configs"
            )
    stages = [_switch_outputs(s, selected) for s in stages]
    active = [s for s in stages if set(s.config.configs) & selected]
    _check_field_graph(active, stages, available)
    # The source's options, constructed once, like the stages' (the source itself is created by the build, after the
    # output directory is checked: creating it reads the disk). After the field graph: a source that does not give
    # what the stages read is the first thing to say of a config whose source was swapped.
    source_options = check_source_options(config.source, config.source_options)
    produced = set(available) | {f for s in active for f in s.contract.produces}
    for stage in active:
        for output in stage.contract.outputs:
            if output.config_field is not None and output.config_field not in produced:
                raise ValueError(
                    f"stage {stage.config.name!r} routes its samples by field {output.config_field!r}, which no "
                    "active stage produces (add the stage that decides the config, e.g. a filter)"
                )

    outputs: list[ReleaseOutput] = [o for o in source_outputs if o.config in selected]
    for name in config.configs:
        if name in own:
            continue
        candidates = writers.get(name, [])
        if len(candidates) > 1:
            names = ", ".join(repr(s.config.name) for s, _ in candidates)
            raise ValueError(f"config {name!r} is written by several stages ({names}); keep one")
        stage, output = candidates[0]
        if name not in stage.config.configs:
            raise ValueError(
                f"config {name!r} is written by stage {stage.config.name!r}, whose configs "
                f"{stage.config.configs} do not include it; add {name!r} to them"
            )
        outputs.append(output)
    outputs = _with_screen_fields(outputs, active)
    _check_generated_images_screened(config, active, source_outputs, selected)
    _check_judge_filter_keeps_strength_linked(active, selected)
    spec = _release_spec(config, outputs, writers)
    return ValidatedBuild(
        config, tuple(stages), tuple(active), tuple(outputs), tuple(known), spec, written, source_options
    )


def _is_safety_screen(screen: Any) -> bool:
    return any(f.name == "safety_nsfw" for f in screen.fields)


def _check_generated_images_screened(
    config: BuildConfig, active: list[ValidatedStage], source_outputs: tuple, selected: set[str]
) -> None:
    """Every generated or edited image a build releases passes Stable Diffusion's safety checker first: each (config,
    field) that a registered stage writes, or a source that declares its images generated (``generated_images``),
    needs a safety stage (an ``OutputScreen`` adding ``safety_nsfw``) on that field serving that config, unless the
    config says ``safety: off``. Stages named by code (``--allow-code``) declare nothing about their images."""
    if config.safety == "off":
        return
    released: list[tuple[str, str, str]] = []  # (config, field, writer)
    for stage in active:
        if stage.is_code:
            continue
        for output in stage.contract.outputs:
            names = [output.config] if output.config_field is None else list(stage.config.configs)
            released += [(name, output.field, f"stage {stage.config.name!r}") for name in names if name in selected]
    scheme = (config.source or "").partition(":")[0]
    if scheme in SOURCES.names() and getattr(SOURCES.resolve(scheme), "generated_images", False):
        released += [(o.config, o.field, f"source {scheme}:") for o in source_outputs if o.config in selected]
    screened = {
        (name, screen.field)
        for stage in active
        for screen in stage.contract.screens
        if _is_safety_screen(screen)
        for name in stage.config.configs
    }
    missing = [(name, field, writer) for name, field, writer in released if (name, field) not in screened]
    if missing:
        shown = "; ".join(f"config {n!r} (field {f!r}, from {w})" for n, f, w in missing[:3])
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(
            f"generated images of {shown}{more} would be released without Stable Diffusion's safety checker: add the "
            "safety_check stage of that field for that config (safety_check, safety_check_lance_r, "
            "safety_check_strength, safety_check_reconstruction, safety_check_generated, safety_check_discovery), "
            "or say `safety: off` in the config (the card then says the images were not screened)"
        )


def _check_judge_filter_keeps_strength_linked(active: list[ValidatedStage], selected: set[str]) -> None:
    """A judge that removes counterfactuals (``filter_below``) in a build of the ``strength`` config needs a judge
    stage of the strength candidates after it: otherwise the removed counterfactual's candidates would name a sample
    that is not released, which the release's declared invariants refuse only once every image is made."""
    if "strength" not in selected:
        return

    def judges(stage: ValidatedStage) -> bool:
        return any(f.name == rf.JUDGE_CLASS_FIELD for screen in stage.contract.screens for f in screen.fields)

    for index, stage in enumerate(active):
        removes = getattr(stage.options, "filter_below", None) is not None
        if not (judges(stage) and removes and "counterfactual" in stage.config.configs):
            continue
        if not any(judges(later) and "strength" in later.config.configs for later in active[index + 1 :]):
            raise ValueError(
                f"stage {stage.config.name!r}: filter_below removes counterfactuals whose strength candidates would "
                "then name a sample that is not released: add a judge_strength stage (configs: [strength]) after it"
            )


def _switch_outputs(stage: ValidatedStage, selected: set[str]) -> ValidatedStage:
    """Reconcile the stage's optional outputs (``ReleaseOutput.enabled_by``) with the configs this build writes.

    A selected config whose output is switched off cannot be built: refused, naming the option. An output switched on
    whose config is not built (``--configs`` left it out) is switched off for this build, so that its samples are
    neither computed nor stored; the stage then records the option as off in the manifest.
    """
    off = {}
    for output in stage.contract.outputs:
        if output.enabled_by is None:
            continue
        enabled = getattr(stage.options, output.enabled_by)
        if output.config in selected and not enabled:
            raise ValueError(
                f"config {output.config!r} is written by stage {stage.config.name!r} only with its option "
                f"{output.enabled_by}: true; set it, or leave {output.config!r} out of configs"
            )
        if enabled and output.config not in selected:
            logger.info(
                "stage %r: %s is on, but config %r is not built; switched off for this build",
                stage.config.name,
                output.enabled_by,
                output.config,
            )
            off[output.enabled_by] = False
    if not off:
        return stage
    return dataclasses.replace(
        stage,
        config=dataclasses.replace(stage.config, options={**stage.config.options, **off}),
        options=with_values(stage.options, **off),
    )


def _with_screen_fields(outputs: list[ReleaseOutput], active: list[ValidatedStage]) -> list[ReleaseOutput]:
    """The outputs with the metadata fields that active screening stages (``OutputScreen``) add to their samples."""
    out = []
    for output in outputs:
        fields = list(output.fields)
        for stage in active:
            for screen in stage.contract.screens:
                if screen.field != output.field:
                    continue
                for field in screen.fields:
                    if any(f.name == field.name for f in fields):
                        raise ValueError(
                            f"stage {stage.config.name!r} adds metadata field {field.name!r} to config "
                            f"{output.config!r}, which already has it (two screens of one kind?)"
                        )
                    fields.append(field)
        out.append(dataclasses.replace(output, fields=tuple(fields)) if len(fields) > len(output.fields) else output)
    return out


def declared_config(output: ReleaseOutput, description: str) -> rf.ConfigSpec:
    """The release format's declaration of the config a stage's output writes: its fields with their types, values,
    ranges and references, and the relations between its samples (what the writer, ``verify`` and ``eval`` check)."""
    fields = tuple(
        rf.FieldSpec(f.name, f.dtype, f.enum, f.description, f.minimum, f.maximum, f.minimum_exclusive, f.references)
        for f in output.fields
    )
    return rf.ConfigSpec(output.config, description, fields, output.unique, output.one_true_per)


def _release_spec(config: BuildConfig, outputs: list[ReleaseOutput], writers: dict) -> Any:
    """The release's declaration (``builder.release_format``): LANCE's configs as v1 describes them, any other
    config and any extra metadata field as its stage declares them."""
    v1 = {c.name: c for c in rf.V1_CONFIGS}
    extra = []
    for output in outputs:
        if output.config in v1 and not output.fields and not output.description:
            continue
        stage = writers[output.config][0][0].config.name if output.config in writers else "the source"
        description = output.description or (
            v1[output.config].description if output.config in v1 else f"samples written by stage {stage}"
        )
        try:
            extra.append(declared_config(output, description))
        except ValueError as err:
            raise ValueError(f"stage {stage!r}: {err}") from err
    return rf.lance_release_spec(config.configs, release_edit_types(), SCORE_NAMES, extra=tuple(extra))


def _check_config_names(config: BuildConfig, known: list[str]) -> None:
    def unknown(name: str, where: str) -> ValueError:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return ValueError(f"{where}config {name!r}: expected one of {', '.join(known)}{hint}")

    for name in config.configs:
        if name not in known:
            if not config.stages and name in _DEFAULT_METHOD_CONFIGS:
                raise ValueError(
                    f"configs [{name!r}] need method stages, but build {config.name!r} defines none for them; "
                    "build only --configs original, or use a preset with stages (demo, hardimagenet)"
                )
            raise unknown(name, "")
    for stage in config.stages:
        for name in stage.configs:
            if name not in known:
                raise unknown(name, f"stage {stage.name!r}: ")


# The method's configs, named in the error for a stage-less config that asks for them.
_DEFAULT_METHOD_CONFIGS = ("reconstructed", "counterfactual", "lance_r")


def source_declaration(spec: str | None) -> tuple[bool, dict[str, str], tuple[ReleaseOutput, ...]]:
    """(generates, record fields, outputs) a registered source class declares, read without constructing it.

    A generating source (``builder.interfaces.source``) plans samples without images; its records start with the
    fields it declares (name -> contract kind) instead of ``image``. Any source may declare record fields and its
    own release outputs (default: ``original``).
    """
    scheme = (spec or "").partition(":")[0]
    if scheme not in SOURCES.names():
        return False, {}, ()
    cls = SOURCES.resolve(scheme)
    generates = bool(getattr(cls, "generates", False))
    return generates, dict(getattr(cls, "fields", None) or {}), tuple(getattr(cls, "outputs", None) or ())


def _check_field_graph(
    active: list[ValidatedStage], every: list[ValidatedStage], source_fields: dict[str, str] | None = None
) -> None:
    fields = SOURCE_FIELDS if source_fields is None else source_fields
    available: dict[str, tuple[str, str]] = {name: (kind, "the source") for name, kind in fields.items()}
    for stage in active:
        name = stage.config.name
        for field, kind in stage.contract.consumes.items():
            if field not in available:
                raise ValueError(
                    f"stage {name!r} consumes field {field!r}, but {_why_missing(field, stage, active, every)}"
                )
            produced_kind, producer = available[field]
            if "any" not in (kind, produced_kind) and kind != produced_kind:
                raise ValueError(
                    f"stage {name!r} consumes {field!r} as {kind}, but {producer} produces it as {produced_kind}"
                )
        for field, kind in stage.contract.produces.items():
            if field in available and "any" not in (kind, available[field][0]) and kind != available[field][0]:
                raise ValueError(
                    f"stage {name!r} produces {field!r} as {kind}, but {available[field][1]} already produced it "
                    f"as {available[field][0]}"
                )
            available[field] = (kind, f"stage {name!r}")


def _why_missing(
    field: str, consumer: ValidatedStage, active: list[ValidatedStage], every: list[ValidatedStage]
) -> str:
    producers = [s for s in every if field in s.contract.produces]
    if not producers:
        return "no stage produces it (check the field name and the stage types)"
    for producer in producers:
        if producer in active:
            return f"stage {producer.config.name!r}, which produces it, runs after it; move it earlier"
    producer = producers[0]
    missing = sorted(set(consumer.config.configs) - set(producer.config.configs))
    return (
        f"stage {producer.config.name!r}, which produces it, is not active for configs {missing}; "
        f"add them to its configs"
    )


def describe_validation(validated: ValidatedBuild) -> list[str]:
    """Human-readable lines: the stages that will run, what each consumes and produces, and the configs."""
    lines = []
    for stage in validated.active:
        contract = stage.contract
        writes = ", ".join(o.config for o in contract.outputs)
        lines.append(
            f"  {stage.config.name} ({stage.config.type} v{contract.version}): "
            f"{', '.join(contract.consumes) or '-'} -> {', '.join(contract.produces) or '-'}"
            + (f" => {writes}" if writes else "")
        )
    return lines


def check_stages_against_source(validated: ValidatedBuild, source: Any) -> None:
    """Checks that need the source's classes, before any model loads: an active stage whose class defines
    ``check_classes(classes)`` (label -> class name of every class the build will process) is asked whether it can
    serve them, e.g. a generation stage's token folder covers them. Raises ``ValueError`` naming the stage."""
    checked = [s for s in validated.active if callable(getattr(s.cls, "check_classes", None))]
    if not checked:
        return
    names = source.label_space.names
    labels = sorted({s.label for s in source.samples if not s.problem and s.label >= 0})
    classes = {label: names[label] if label < len(names) else str(label) for label in labels}
    for stage in checked:
        try:
            stage.create().check_classes(classes)
        except ValueError as err:
            raise ValueError(f"stage {stage.config.name!r} ({stage.config.type}): {err}") from None
