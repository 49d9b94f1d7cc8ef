"""Build configuration: typed dataclasses loaded from a preset or a YAML file, overridable from the CLI.

The resolved config and its hash go into the manifest; the hash decides whether a build directory may be resumed.
Runtime-only settings (device, output directory, progress display) are not part of the config: they do not change
what is built.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from builder.release_format import CONFIG_NAMES, IMAGE_FORMATS

SEMVER = re.compile(r"^\d+\.\d+\.\d+(?:-[0-9A-Za-z.-]+)?$")


@dataclass
class StageConfig:
    """One method stage: ``type`` names a registered stage class, ``options`` are its constructor arguments."""

    name: str
    type: str
    configs: list[str]  # the release configs that need this stage; it runs only if one of them is built
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class BuildConfig:
    name: str
    version: str = "1.0.0"
    description: str | None = None  # shown at the top of the dataset card
    seed: int = 0
    source: str | None = None  # SCHEME:ARG, see builder.sources
    source_options: dict[str, Any] = field(default_factory=dict)
    configs: list[str] = field(default_factory=lambda: list(CONFIG_NAMES))
    limit: int | None = None  # first N source samples in key order
    image_size: int | None = 512  # centre crop + resize to a square of this side; None keeps the source size
    image_format: str = "png"
    shard_max_samples: int = 1000
    shard_max_bytes: int = 1 << 30
    batch_size: int = 8
    min_image_side: int = 16
    max_image_pixels: int = 89_478_485  # Pillow's decompression-bomb limit
    license: str | None = None  # overrides the source's licence note
    source_hint: str | None = None  # what --source a preset without a source expects (shown in the error)
    stages: list[StageConfig] = field(default_factory=list)

    def validate(self) -> None:
        if not self.name or not re.match(r"^[A-Za-z0-9._-]+$", self.name):
            raise ValueError(f"name {self.name!r}: use letters, digits, '.', '_' or '-'")
        if not SEMVER.match(self.version):
            raise ValueError(f"version {self.version!r}: expected a semantic version such as 1.0.0")
        if not self.configs:
            raise ValueError("configs: at least one config is needed")
        for config in self.configs:
            if config not in CONFIG_NAMES:
                raise ValueError(f"config {config!r}: expected one of {', '.join(CONFIG_NAMES)}")
        if len(set(self.configs)) != len(self.configs):
            raise ValueError(f"configs {self.configs}: listed twice")
        if self.image_format not in IMAGE_FORMATS:
            raise ValueError(f"image_format {self.image_format!r}: expected one of {', '.join(IMAGE_FORMATS)}")
        for name, value, low in [
            ("seed", self.seed, 0),
            ("shard_max_samples", self.shard_max_samples, 1),
            ("shard_max_bytes", self.shard_max_bytes, 1),
            ("batch_size", self.batch_size, 1),
            ("min_image_side", self.min_image_side, 1),
            ("max_image_pixels", self.max_image_pixels, 1),
        ]:
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} {value!r}: expected an integer >= {low}")
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit < 1):
            raise ValueError(f"limit {self.limit!r}: expected a positive integer")
        if self.image_size is not None and (not isinstance(self.image_size, int) or self.image_size < 8):
            raise ValueError(f"image_size {self.image_size!r}: expected an integer >= 8 or null")
        if self.source is None:
            hint = f" ({self.source_hint})" if self.source_hint else ""
            raise ValueError(f"build {self.name!r} has no source: pass --source SCHEME:ARG{hint}")
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stages: duplicate stage names in {names}")
        for stage in self.stages:
            for config in stage.configs:
                if config not in CONFIG_NAMES:
                    raise ValueError(f"stage {stage.name!r}: config {config!r} is not one of {CONFIG_NAMES}")
        needed = {c for c in self.configs if c != "original"}
        served = {c for s in self.stages for c in s.configs}
        missing = sorted(needed - served)
        if missing:
            raise ValueError(
                f"configs {missing} need method stages, but build {self.name!r} defines none for them; "
                f"build only --configs original, or use a preset with stages (demo, hardimagenet)"
            )

    def active_stages(self) -> list[StageConfig]:
        """Stages needed by the selected configs, in declared order."""
        return [s for s in self.stages if set(s.configs) & set(self.configs)]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def config_hash(self) -> str:
        """Hash of everything that decides the release's content. Inactive stages are left out."""
        data = self.to_dict()
        data["stages"] = [dataclasses.asdict(s) for s in self.active_stages()]
        canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


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
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{origin}: unknown field(s) {unknown}; known fields: {sorted(known)}")
    stages = []
    for i, raw in enumerate(data.get("stages") or []):
        if not isinstance(raw, dict) or not {"name", "type", "configs"} <= set(raw):
            raise ValueError(f"{origin}: stages[{i}] needs name, type and configs")
        extra = sorted(set(raw) - {"name", "type", "configs", "options"})
        if extra:
            raise ValueError(f"{origin}: stages[{i}] has unknown field(s) {extra}")
        stages.append(StageConfig(raw["name"], raw["type"], list(raw["configs"]), dict(raw.get("options") or {})))
    values = {k: v for k, v in data.items() if k != "stages"}
    return BuildConfig(**values, stages=stages)


def load_config(preset_or_path: str) -> BuildConfig:
    """Load a preset by name (``demo``, ``hardimagenet``) or a YAML file by path."""
    path = Path(preset_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
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
            raise ValueError(
                f"{preset_or_path!r} is neither a preset ({', '.join(presets)}) nor a YAML config file{hint}"
            )
        text = (resources.files("builder") / "presets" / f"{preset_or_path}.yaml").read_text()
        origin = f"preset {preset_or_path!r}"
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"{origin}: not valid YAML ({err})") from err
    return _from_dict(data, origin)


def apply_overrides(config: BuildConfig, **overrides: Any) -> BuildConfig:
    """CLI overrides; ``None`` means "not given"."""
    values = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(config, **values)
