"""Build configuration: typed dataclasses loaded from a preset or a YAML file, overridable from the CLI.

The resolved config and its hash go into the manifest; the hash decides whether a build directory may be resumed.
Runtime-only settings (device, output directory, progress display) are not part of the config: they do not change
what is built.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import hashlib
import json
import logging
import os
import re
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

from builder.registry import STAGES
from builder.release_format import CONFIG_NAMES, IMAGE_FORMATS, is_release_version
from builder.release_format.yaml_text import check_expansion, load_yaml
from builder.sources import _path_name, check_source_options, public_spec
from lance_pipeline.models.hub_cache import content_digest, local_copy
from lance_pipeline.models.needs import LOCAL_PREFIXES as MODEL_PREFIXES
from lance_pipeline.models.needs import local_model_inputs
from lance_pipeline.option_types import ImageSide, Interval, check_value, describe_type, plain_value
from lance_pipeline.stage import StageContractError, check_options, option_values, options_type

logger = logging.getLogger(__name__)

AtLeast0 = Annotated[int, Interval(ge=0)]
AtLeast1 = Annotated[int, Interval(ge=1)]


@dataclass
class StageConfig:
    """One method stage: ``type`` names a registered stage class, ``options`` are its constructor arguments."""

    name: str
    type: str
    configs: list[str]  # the release configs that need this stage; it runs only if one of them is built
    options: dict[str, Any] = field(default_factory=dict)
    # At most this many records per call of the stage: sub-batches of the build batch, in key order. It can change
    # the stage's results (batched numerics), so it is config (hashed); None = the whole build batch per call.
    batch_size: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The stage as the config records it; ``batch_size`` only when set (older configs hash unchanged)."""
        data = dataclasses.asdict(self)
        if self.batch_size is None:
            del data["batch_size"]
        return data


# Top-level keys added after releases were made: recorded (and hashed) only when set, so older configs keep their hash.
KEYS_RECORDED_WHEN_SET = ("release_date", "safety")


@dataclass
class BuildConfig:
    name: str
    version: str = "1.0.0"
    description: str | None = None  # shown at the top of the dataset card
    seed: AtLeast0 = 0
    source: str | None = None  # SCHEME:ARG, see builder.sources
    source_options: dict[str, Any] = field(default_factory=dict)
    configs: list[str] = field(default_factory=lambda: list(CONFIG_NAMES))
    limit: AtLeast1 | None = None  # first N source samples in key order
    # Centre crop + resize to a square of this side; None keeps the source size.
    image_size: ImageSide | None = 512
    image_format: str = "png"
    shard_max_samples: AtLeast1 = 1000
    shard_max_bytes: AtLeast1 = 1 << 30
    batch_size: AtLeast1 = 8
    min_image_side: AtLeast1 = 16
    max_image_pixels: AtLeast1 = 89_478_485  # Pillow's decompression-bomb limit
    license: str | None = None  # overrides the source's licence note
    source_hint: str | None = None  # what --source a preset without a source expects (shown in the error)
    stages: list[StageConfig] = field(default_factory=list)
    # The release's date (YYYY-MM-DD), Croissant's datePublished. An input like ``version``, never the build's clock,
    # so identical configs give identical bytes on any day; recorded (and hashed) only when set.
    release_date: str | None = None
    # ``off``: release generated images that no safety-checker stage screened (refused otherwise, builder.validation);
    # the card says so. Unset (on) is not recorded, so configs hash as before the key existed.
    safety: str | None = None

    def __post_init__(self) -> None:
        # YAML reads `safety: off` as false and `on` as true
        if self.safety is False:
            self.safety = "off"
        elif self.safety is True or self.safety == "on":
            self.safety = None

    def validate(self) -> None:
        """Check the config's own fields (types and ranges). Stages and configs: ``builder.validation``."""
        if not isinstance(self.name, str) or not re.match(r"^[A-Za-z0-9._-]+$", self.name):
            raise ValueError(f"name {self.name!r}: use a string of letters, digits, '.', '_' or '-' (quote it in YAML)")
        if self.release_date is not None and not is_iso_date(self.release_date):
            raise ValueError(
                f'release_date {self.release_date!r}: expected a date as YYYY-MM-DD (quote it in YAML: "2026-11-26")'
            )
        if self.safety not in (None, "off"):
            raise ValueError(f"safety {self.safety!r}: leave it out (on), or say `safety: off`")
        if not is_release_version(self.version):  # semver, parsed by packaging.version (release_format)
            raise ValueError(
                f'version {self.version!r}: expected a semantic version such as 1.0.0 (quote it in YAML: "1.0.0")'
            )
        hints = typing.get_type_hints(BuildConfig, include_extras=True)
        for name in ("description", "license", "source", "source_hint", "seed", "limit", "image_size"):
            self._check_field(name, hints[name])
        if not isinstance(self.source_options, dict):
            raise ValueError(
                f"source_options {self.source_options!r}: expected a mapping of name: value, not a "
                f"{type(self.source_options).__name__}"
            )
        # A config built in Python (not read by load_yaml) may share values too: bounded before anything walks it.
        check_expansion(self.source_options, "source_options")
        for stage in self.stages:
            check_expansion(stage.options, f"stage {stage.name!r}: options")
        if not isinstance(self.configs, list) or not all(isinstance(c, str) for c in self.configs):
            raise ValueError(f"configs {self.configs!r}: expected a list of config names, e.g. [original]")
        if not self.configs:
            raise ValueError("configs: at least one config is needed")
        if len(set(self.configs)) != len(self.configs):
            raise ValueError(f"configs {self.configs}: listed twice")
        if self.image_format not in IMAGE_FORMATS:
            raise ValueError(f"image_format {self.image_format!r}: expected one of {', '.join(IMAGE_FORMATS)}")
        for name in ("shard_max_samples", "shard_max_bytes", "batch_size", "min_image_side", "max_image_pixels"):
            self._check_field(name, hints[name])
        if self.source is None:
            hint = f" ({self.source_hint})" if self.source_hint else ""
            raise ValueError(f"build {self.name!r} has no source: pass --source SCHEME:ARG{hint}")
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stages: duplicate stage names in {names}")
        for stage in self.stages:
            size = stage.batch_size
            if check_value(size, AtLeast1 | None) is not None:
                raise ValueError(
                    f"stage {stage.name!r}: batch_size {size!r}: expected an integer >= 1 (records per call of the "
                    "stage), or leave it out for the whole build batch"
                )

    def _check_field(self, name: str, annotation: Any) -> None:
        """One field against its annotation (type and bounds), by the checker stage and source options use."""
        value = getattr(self, name)
        if check_value(value, annotation) is not None:
            raise ValueError(f"{name} {value!r}: expected {describe_type(annotation)}")

    def active_stages(self) -> list[StageConfig]:
        """Stages needed by the selected configs, in declared order."""
        return [s for s in self.stages if set(s.configs) & set(self.configs)]

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["stages"] = [s.to_dict() for s in self.stages]
        for key in KEYS_RECORDED_WHEN_SET:  # configs without them hash as before the keys existed
            if data[key] is None:
                del data[key]
        return data

    def public_dict(self) -> dict[str, Any]:
        """The config as a release records it: the source spec without machine paths (``imagefolder:/home/me/x`` is
        ``imagefolder:x``), so that the same photos at two locations give the same manifest and nothing local is
        published."""
        data = self.to_dict()
        if self.source is not None:
            data["source"] = public_spec(self.source)
        data["stages"] = [public_stage_dict(s) for s in self.stages]
        return data

    def config_hash(self, typed: dict[str, Any] | None = None) -> str:
        """Hash of everything that decides the release's content (``hashed_view``): the options by their effective
        value, so that writing an option at its default changes nothing. ``typed``: the stages' typed options by stage
        name, when validation has them (``ValidatedBuild``), so that they are not constructed again; a stage type
        that names code (``module:attr``) is not imported here, so its options count as written unless given)."""
        return view_hash(hashed_view(self, typed))

    def config_hash_as_written(self) -> str:
        """The hash releases and ledgers made before options were hashed by value record: of the options as written
        (a default written out changed it). A build directory holding it is resumed as one holding ``config_hash``."""
        return view_hash(hashed_view(self, as_written=True))


def view_hash(view: dict[str, Any]) -> str:
    """The config hash of a ``hashed_view``: sha256 of its canonical JSON."""
    canonical = json.dumps(view, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def public_stage_dict(stage: StageConfig, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """A stage as a release records it, with no path of the build machine in it.

    Every option that names something on this machine is recorded by its name, as sources are, and its content by a
    digest under ``local_inputs``, so that the same files at two locations give the same config (a moved folder
    resumes) and other files another (a changed one does not): the options a stage declares local paths (field
    metadata ``local_path``, e.g. a folder of class tokens) and the model options it declares (``model_options``)
    whose value is a local directory. A model directory that is an unchanged copy of a Hub model (its
    ``models download --local-dir`` marker matches its files) is also recorded, under ``local_copies``, as the Hub id
    and commit it is a copy of, so the release names the real model. ``options``: the options to record instead of
    those written (``effective_options``: what the hash covers)."""
    data = stage.to_dict()
    if options is not None:
        data["options"] = dict(options)
    local_inputs, local_copies, refused = {}, {}, {}
    for name, (path, is_model) in local_stage_inputs(stage).items():
        data["options"][name] = _path_name(path)
        local_inputs[name] = content_digest(Path(os.path.expanduser(path)))
        copy = local_copy(path) if is_model and Path(os.path.expanduser(path)).is_dir() else None
        if copy is not None and copy.verified:
            local_copies[name] = copy.label
        elif copy is not None and copy.repo_id is not None:
            refused[name] = f"not recorded as a copy of {copy.label}: {copy.reason}"
            _warn_once(f"model directory {path} for stage {stage.name!r} is recorded by its name and digest, not as a "
                       f"copy of {copy.label}: {copy.reason}")  # fmt: skip
    if local_inputs:
        data["local_inputs"] = local_inputs
    if local_copies:
        data["local_copies"] = local_copies
    if refused:  # the release says why a copy's marker was not taken for the model it names
        data["local_copies_refused"] = refused
    return data


# What a stage dict records about its local model copies from outside their bytes (whether a marker could be checked
# against the Hugging Face cache or the Hub): provenance, not content, so not hashed (local_inputs' digests are).
PROVENANCE_KEYS = ("local_copies", "local_copies_refused")


def local_stage_inputs(stage: StageConfig) -> dict[str, tuple[str, bool]]:
    """``{option: (local path, is a model)}``: the options of a stage whose value is a path on this machine (see
    ``public_stage_dict``); none for code stage types and unknown names."""
    cls = _stage_class(stage.type)
    if cls is None:
        return {}
    found: dict[str, tuple[str, bool]] = {}
    try:
        fields = dataclasses.fields(options_type(cls))
    except Exception:  # as in _stage_class: validation names a stage whose options cannot be read
        fields = ()
    for f in fields:
        value = stage.options.get(f.name)
        if f.metadata.get("local_path") and isinstance(value, str) and value and not value.startswith(MODEL_PREFIXES):
            found[f.name] = (value, False)
    for name, path in local_model_inputs(cls, stage.options).items():
        found.setdefault(name, (path, True))
    return found


def _stage_class(stage_type: str) -> type | None:
    """A registered stage type's class, or None (code stage types and unknown names: validation reports them)."""
    if not isinstance(stage_type, str) or stage_type not in STAGES.names():
        return None
    try:
        return STAGES.resolve(stage_type)
    except Exception:  # validation reports a stage that cannot be imported; recording it is not the place
        return None


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


def preset_path(name: str) -> str:
    """Where a preset's YAML lies (inside the installed package), for ``lance-cf presets``."""
    return str(resources.files("builder") / "presets" / f"{name}.yaml")


def list_presets() -> list[str]:
    files = resources.files("builder") / "presets"
    return sorted(p.name.removesuffix(".yaml") for p in files.iterdir() if p.name.endswith(".yaml"))


def _from_dict(data: dict[str, Any], origin: str) -> BuildConfig:
    if not isinstance(data, dict):
        raise ValueError(f"{origin}: expected a mapping at the top level")
    known = {f.name for f in dataclasses.fields(BuildConfig)}
    unknown = sorted(set(data) - known, key=str)
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), sorted(known), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; known fields: {', '.join(sorted(known))}"
        raise ValueError(f"{origin}: unknown field {unknown[0]!r}{hint}" + (
            f" (and {len(unknown) - 1} more unknown)" if len(unknown) > 1 else ""))  # fmt: skip
    stages = []
    raw_stages = data.get("stages") or []
    if not isinstance(raw_stages, list):
        raise ValueError(f"{origin}: stages must be a list of stages (each with name, type, configs, options)")
    for i, raw in enumerate(raw_stages):
        if not isinstance(raw, dict) or not {"name", "type", "configs"} <= set(raw):
            raise ValueError(f"{origin}: stages[{i}] needs name, type and configs")
        allowed = ("name", "type", "configs", "options", "batch_size")
        extra = sorted(set(raw) - set(allowed), key=str)
        if extra:
            close = difflib.get_close_matches(str(extra[0]), allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; a stage has {', '.join(allowed)}"
            raise ValueError(f"{origin}: stages[{i}] has unknown field {extra[0]!r}{hint}")
        where = f"{origin}: stage {raw['name']!r}"
        if not isinstance(raw["name"], str) or not re.match(r"^[A-Za-z0-9_-]+$", raw["name"]):
            raise ValueError(f"{origin}: stages[{i}] name {raw['name']!r}: use letters, digits, '_' or '-'")
        if not isinstance(raw["configs"], list) or not all(isinstance(c, str) for c in raw["configs"]):
            raise ValueError(f"{where}: configs {raw['configs']!r}: expected a list of config names, e.g. [original]")
        options = raw.get("options") or {}
        if not isinstance(options, dict):
            raise ValueError(f"{where}: options must be a mapping of name: value, not a {type(options).__name__}")
        stages.append(StageConfig(raw["name"], raw["type"], list(raw["configs"]), dict(options), raw.get("batch_size")))
    for name in ("source_options",):
        if name in data and data[name] is not None and not isinstance(data[name], dict):
            raise ValueError(f"{origin}: {name} must be a mapping of name: value, not a {type(data[name]).__name__}")
    if "configs" in data and not isinstance(data["configs"], list):
        raise ValueError(f"{origin}: configs {data['configs']!r}: expected a list of config names, e.g. [original]")
    values = {k: v for k, v in data.items() if k != "stages"}
    if values.get("source_options") is None:
        values.pop("source_options", None)
    return BuildConfig(**values, stages=stages)


def load_config(preset_or_path: str) -> BuildConfig:
    """Load a preset by name (``demo``, ``hardimagenet``) or a YAML file by path."""
    path = Path(preset_or_path)
    # A folder is never a config: `build demo --output demo`, run again, finds the release folder `demo/` here and
    # still means the preset.
    if path.suffix in (".yaml", ".yml") or path.is_file():
        if not path.is_file():
            raise ValueError(f"config file {preset_or_path!r} does not exist")
        text = path.read_text()
        origin = str(path)
    else:
        presets = list_presets()
        if preset_or_path not in presets:
            import difflib

            close = difflib.get_close_matches(preset_or_path, presets, n=2)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            what = "a folder: neither a preset" if path.is_dir() else "neither a preset"
            raise ValueError(f"{preset_or_path!r} is {what} ({', '.join(presets)}) nor a YAML config file{hint}")
        text = (resources.files("builder") / "presets" / f"{preset_or_path}.yaml").read_text()
        origin = f"preset {preset_or_path!r}"
    return _from_dict(load_yaml(text, origin), origin)


def is_iso_date(value: Any) -> bool:
    """A calendar date written YYYY-MM-DD (a string: YAML's own dates are refused, so the record is the text given)."""
    if not isinstance(value, str) or not re.fullmatch(r"\d{4}-\d{2}-\d{2}", value):
        return False
    try:
        datetime.date.fromisoformat(value)
    except ValueError:
        return False
    return True


def apply_overrides(config: BuildConfig, **overrides: Any) -> BuildConfig:
    """CLI overrides; ``None`` means "not given"."""
    values = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(config, **values)


def config_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What differs between two configs as dicts (``to_dict``/``public_dict``): ``key: old -> new``, stages by name
    (``stages[perturb].options.n_per_type: 3 -> 2``), for a refused resume to say what changed."""

    def flat(value: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                flat(item, f"{prefix}.{key}" if prefix else str(key), out)
        elif isinstance(value, list) and value and all(isinstance(s, dict) and "name" in s for s in value):
            for stage in value:
                flat({k: v for k, v in stage.items() if k != "name"}, f"{prefix}[{stage['name']}]", out)
        else:
            out[prefix] = value
        return out

    old, new = flat(before, "", {}), flat(after, "", {})
    missing = object()
    changes = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, missing), new.get(key, missing)
        if a != b:
            changes.append(f"{key}: {'(none)' if a is missing else repr(a)} -> {'(none)' if b is missing else repr(b)}")
    return changes


def hashed_view(
    config: BuildConfig,
    typed: dict[str, Any] | None = None,
    as_written: bool = False,
    source_options: Any = None,
) -> dict[str, Any]:
    """What the config hash covers: the public config with the active stages only (local inputs by name and digest),
    each stage's options and the source's by their effective value (``effective_options``, ``effective_source_options``;
    ``typed``: the stages' typed options by name, ``source_options``: the source's, when the caller has them).
    ``as_written``: the options as the config writes them, as releases made before options were hashed by value hashed
    them (``BuildConfig.config_hash_as_written``)."""
    data = config.public_dict()
    data["stages"] = [
        {
            k: v
            for k, v in public_stage_dict(
                s, None if as_written else effective_options(s, (typed or {}).get(s.name))
            ).items()
            if as_written or k not in PROVENANCE_KEYS  # releases hashed as written hashed their local_copies too
        }
        for s in config.active_stages()
    ]
    if not as_written:
        data["source_options"] = effective_source_options(config.source, config.source_options, source_options)
    return data


def effective_source_options(spec: Any, options: Any, typed: Any = None) -> Any:
    """The source's options as they take effect: every field of its typed options (``options_class``, constructed by
    ``builder.sources.check_source_options`` unless given as ``typed``), defaults filled in, each value as its
    annotation reads it, so that a default written out, or left out, is the same config. As written for a spec or
    options that validation refuses (it reports them), or a source that cannot be imported."""
    if typed is None:
        try:
            typed = check_source_options(spec, options)
        except Exception:  # as in _stage_class: validation reports a source that is unknown, refused or not importable
            return options
    return plain_options(typed)


def effective_options(stage: StageConfig, typed: Any = None) -> dict[str, Any]:
    """The stage's options as they take effect: every option of its typed options (``check_options``), defaults filled
    in, each value as its annotation reads it (a list for a tuple, 1.0 for a float written 1), so that a default written
    out, or left out, is the same config. A stage whose typed options cannot be made here (a ``module:attr`` code
    type not given as ``typed``, options that validation refuses) gives its options as written."""
    if typed is None:
        cls = _stage_class(stage.type)
        if cls is None:
            return dict(stage.options)
        try:
            typed = check_options(cls, stage.options, f"stage {stage.name!r} ({stage.type})")
        except (TypeError, ValueError, StageContractError):
            return dict(stage.options)
    return plain_options(typed)


def plain_options(typed: Any) -> dict[str, Any]:
    """Typed options (a stage's or a source's) by name, every field, each value as its annotation reads it
    (``plain_value``): what the config hash covers of them."""
    hints = typing.get_type_hints(type(typed), include_extras=True)
    return {name: plain_value(value, hints.get(name, Any)) for name, value in option_values(typed).items()}


def explain_config_change(
    stored: dict[str, Any],
    config: BuildConfig,
    stored_view: dict[str, Any] | None = None,
    typed: dict[str, Any] | None = None,
    source_options: Any = None,
) -> str:
    """Why a build directory refuses ``config``: what changed since the config it was started with (``stored``, a
    ``to_dict``/``public_dict`` as the ledger or manifest keeps it, or better ``stored_view``, its ``hashed_view``
    from then: local files that changed since are only seen there), and what to do, in one sentence. ``typed``: the
    stages' typed options (``source_options``: the source's), when the stored view holds options by value; without
    them, the options are compared as written (a build directory from before options were hashed by value)."""
    as_written = typed is None
    try:
        before = (
            stored_view
            if stored_view is not None
            else hashed_view(_from_dict(stored, "the stored config"), as_written=as_written)
        )
    except (TypeError, ValueError):
        before = stored
    changes = config_changes(before, hashed_view(config, typed, as_written=as_written, source_options=source_options))
    if not changes:
        return "it was started with another config; resume with that config, or use a new --output directory"
    if [c.split(":")[0] for c in changes] == ["version"]:
        return (
            f"only the release version differs ({changes[0].split(': ', 1)[1]}), and a build keeps the version it "
            "was started with (it is written into the release's manifest and card): resume with the original "
            "--version, then build the new version into a new --output directory"
        )
    shown = "; ".join(changes[:6]) + (f"; and {len(changes) - 6} more" if len(changes) > 6 else "")
    return f"the config changed since it was started ({shown}): resume with the original config, or use a new --output"
