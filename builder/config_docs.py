"""What each build-config key means, and the resolved, commented YAML that ``lance-cf presets --show`` prints.

One owner for the meaning of the top-level keys: ``presets --show`` comments every key from ``KEY_DOCS`` and
docs/config.md documents the same keys (a test keeps both in step with ``BuildConfig``'s fields). Light at import:
nothing here loads a model library.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from builder.registry import SOURCES
from builder.release_format.yaml_text import load_yaml

# key -> (what it does, where the value comes from). Shown as the comment beside each key.
KEY_DOCS: dict[str, tuple[str, str]] = {
    "name": ("release name: the Hub dataset's pretty name and the manifest's name", "yours"),
    "version": ("semantic version of the release; publish tags the Hub commit v<version>", "yours"),
    "description": ("paragraph at the top of the dataset card", "yours"),
    "seed": ("release seed; each sample's seed is sha256(seed, source key), never order or time", "tool"),
    "source": (
        "where the images come from: imagefolder:PATH, imagenet:PATH, hf:NAME[:SPLIT], wds:PATTERN, demo",
        "yours",
    ),
    "source_options": ("options of the source, e.g. imagenet's classes and per_class", "yours"),
    "configs": ("release configs to build: original, reconstructed, counterfactual, lance_r", "paper §4"),
    "limit": ("use only the first N source images in key order (quick runs)", "tool"),
    "image_size": (
        "centre crop + resize to this square side before any stage; null keeps the source size",
        "paper §4: 512",
    ),
    "image_format": ("lossless image encoding in the shards: png or webp", "tool"),
    "shard_max_samples": ("maximum samples per WebDataset shard", "tool"),
    "shard_max_bytes": ("maximum bytes per shard", "tool"),
    "batch_size": ("source images per stage batch (and per ledger transaction)", "tool"),
    "min_image_side": ("images with a smaller side are recorded as failures", "tool"),
    "max_image_pixels": ("larger images are refused as decompression bombs (Pillow's limit)", "tool"),
    "license": ("licence note on the card; overrides the source's", "yours"),
    "source_hint": ("what --source a preset without a source expects (shown in the error)", "tool"),
    "stages": ("the method stages, in order; see the stage table in docs/config.md", "paper Algorithm 1"),
}

STAGE_KEY_DOCS: dict[str, str] = {
    "name": "unique name of this stage in the build (the ledger and manifest use it)",
    "type": "registered stage type (lance-cf validate lists them)",
    "configs": "release configs that need this stage; it runs only when one of them is built",
    "options": "the stage's options; every one is documented in docs/config.md",
    "batch_size": "at most this many records per call of the stage (sub-batches of the build batch; hashed)",
}


def undocumented_keys(config_cls: type) -> list[str]:
    """Fields of the config dataclass that ``KEY_DOCS`` does not explain (a test keeps this empty)."""
    return sorted({f.name for f in dataclasses.fields(config_cls)} - set(KEY_DOCS))


def _source_key_docs(spec: Any) -> dict[str, tuple[str, str]]:
    """What a source class says beside some keys instead (``key_docs``): a generation source's configs are shifts,
    not LANCE's configs."""
    scheme = spec.partition(":")[0] if isinstance(spec, str) else ""
    if scheme not in SOURCES.names():
        return {}
    return dict(getattr(SOURCES.resolve(scheme), "key_docs", None) or {})


def _dump(value: Any) -> str:
    """One YAML scalar or flow collection on one line (anchors and aliases already resolved)."""
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**6, allow_unicode=True)
    return text.strip().removesuffix("...").strip()


def commented_yaml(data: dict[str, Any], *, origin: str) -> str:
    """The resolved config as YAML with every top-level key and every stage field commented.

    ``data`` is ``BuildConfig.to_dict()``; YAML anchors and merge keys of the preset file are resolved, so what is
    printed is exactly what a build uses.
    """
    lines = [f"# {origin}, resolved (anchors expanded); every key is explained in docs/config.md"]
    docs = {**KEY_DOCS, **_source_key_docs(data.get("source"))}
    for key, value in data.items():
        meaning, source = docs.get(key, ("", ""))
        comment = f"  # {meaning} [{source}]" if meaning else ""
        if key == "stages":
            lines.append(f"stages:{comment}")
            for i, stage in enumerate(value):
                # The stage fields are explained once, on the first stage.
                note = {k: f"  # {doc}" if i == 0 else "" for k, doc in STAGE_KEY_DOCS.items()}
                lines.append(f"  - name: {_dump(stage['name'])}{note['name']}")
                lines.append(f"    type: {_dump(stage['type'])}{note['type']}")
                lines.append(f"    configs: {_dump(stage['configs'])}{note['configs']}")
                if stage.get("batch_size") is not None:
                    lines.append(f"    batch_size: {_dump(stage['batch_size'])}  # {STAGE_KEY_DOCS['batch_size']}")
                options = stage.get("options") or {}
                if not options:
                    lines.append("    options: {}")
                    continue
                lines.append(f"    options:{note['options']}")
                for option, option_value in options.items():
                    lines.append(f"      {option}: {_dump(option_value)}")
            continue
        if isinstance(value, dict) and value:
            lines.append(f"{key}:{comment}")
            for sub, sub_value in value.items():
                lines.append(f"  {sub}: {_dump(sub_value)}")
            continue
        lines.append(f"{key}: {_dump(value)}{comment}")
    text = "\n".join(lines) + "\n"
    # What is printed must load back to the same config: a reader can copy it into a file and build from it.
    if load_yaml(text, "the commented config") != data:
        raise AssertionError("commented YAML does not round-trip")  # a bug here, not bad input
    return text
