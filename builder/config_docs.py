"""What each build-config key means, and the resolved, commented YAML that ``lance-cf presets --show`` prints.

One owner for the meaning of the top-level keys: ``presets --show`` comments every key from ``KEY_DOCS`` and
docs/config.md documents the same keys (a test keeps both in step with ``BuildConfig``'s fields). Light at import:
nothing here loads a model library.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from builder.config import KEYS_RECORDED_WHEN_SET
from builder.registry import SOURCES, STAGES
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
    "safety": (
        "off: release generated images without a safety-checker stage (refused otherwise; the card says so)",
        "tool",
    ),
    "release_date": ("the release's date, YYYY-MM-DD: croissant.json's datePublished (absent: none)", "yours"),
}

# source_options, by name (every option of every registered source; a test keeps them in step with the sources).
SOURCE_OPTION_DOCS: dict[str, str] = {
    "classes": "class subset: ImageNet synsets, indices or names (default: every class)",
    "per_class": "at most this many images (imagenet) or generated samples (generate) per class",
    "max_image_bytes": "larger image files are recorded as failures, never read whole",
    "image_column": "hf: the image column (default: the one of Image type)",
    "label_column": "hf: the label column (default: label)",
    "key_column": "hf: a column of unique sample keys (default: the row index)",
    "label_space": "imagenet-1k: labels are ImageNet-1k indices; custom: the source's own classes",
    "class_names": "names of the labels 0..N-1, when the source does not carry them",
    "num_classes": "hf: the number of classes, when the source does not say",
    "max_classes": "hf: refuse a label space larger than this (a stray huge label)",
    "revision": "hf: the dataset's Hub revision",
    "shifts": "generate: the named shifts (lance_pipeline/interfaces/shifts.py)",
    "custom_shifts": "generate: shifts of your own: name, prompt with <TOKEN>, shift_caption, threshold, style",
}

STAGE_KEY_DOCS: dict[str, str] = {
    "name": "unique name of this stage in the build (the ledger and manifest use it)",
    "type": "registered stage type (lance-cf validate lists them)",
    "configs": "release configs that need this stage; it runs only when one of them is built",
    "options": "the stage's options, each described by its stage (all of them, with defaults: docs/config.md)",
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
    # Keys a config records only when set are shown anyway, unset, so that every key can be found here.
    data = {**data, **{key: None for key in KEYS_RECORDED_WHEN_SET if key not in data}}
    for key, value in data.items():
        meaning, source = docs.get(key, ("", ""))
        comment = f"  # {meaning} [{source}]" if meaning else ""
        if key == "stages":
            lines.append(f"stages:{comment}")
            for i, stage in enumerate(value):
                # The stage fields are explained in full on the first stage, briefly on the others; a stage's type
                # by its class's own summary.
                note = {
                    k: f"  # {doc if i == 0 else doc.split(' (')[0].split(';')[0]}" for k, doc in STAGE_KEY_DOCS.items()
                }
                summary = stage_summary(stage["type"])
                lines.append(f"  - name: {_dump(stage['name'])}{note['name']}")
                lines.append(f"    type: {_dump(stage['type'])}" + (f"  # {summary}" if summary else note["type"]))
                lines.append(f"    configs: {_dump(stage['configs'])}{note['configs']}")
                if stage.get("batch_size") is not None:
                    lines.append(f"    batch_size: {_dump(stage['batch_size'])}  # {STAGE_KEY_DOCS['batch_size']}")
                options = stage.get("options") or {}
                if not options:
                    lines.append("    options: {}")
                    continue
                lines.append(f"    options:{note['options']}")
                described = stage_option_comments(stage["type"])
                for option, option_value in options.items():
                    about = described.get(option)
                    lines.append(f"      {option}: {_dump(option_value)}" + (f"  # {about}" if about else ""))
            continue
        if isinstance(value, dict) and value:
            lines.append(f"{key}:{comment}")
            for sub, sub_value in value.items():
                about = SOURCE_OPTION_DOCS.get(sub) if key == "source_options" else None
                lines.append(f"  {sub}: {_dump(sub_value)}" + (f"  # {about}" if about else ""))
            continue
        lines.append(f"{key}: {_dump(value)}{comment}")
    text = "\n".join(lines) + "\n"
    # What is printed must load back to the same config: a reader can copy it into a file and build from it.
    if load_yaml(text, "the commented config") != data:
        raise AssertionError("commented YAML does not round-trip")  # a bug here, not bad input
    return text


# -- stage options, described by their own docstrings ------------------------------------------------------------------
def _docstring_entries(doc: str | None) -> dict[str, str]:
    """``name: description`` entries of the ``Args:``/``Attributes:`` sections of a Google-style docstring (one entry
    may name several options: ``clip_model, clip_pretrained: The CLIP scorer``)."""
    import inspect
    import re

    entries: dict[str, str] = {}
    if not doc:
        return entries
    lines = inspect.cleandoc(doc).splitlines()
    in_section, current, indent = False, None, None
    for line in lines:
        stripped = line.strip()
        if re.fullmatch(r"(Args|Arguments|Attributes|Parameters):", stripped):
            in_section, current, indent = True, None, None
            continue
        if not in_section:
            continue
        if stripped and not line.startswith(" "):  # the next section or prose
            in_section = False
            continue
        if not stripped:
            continue
        level = len(line) - len(line.lstrip())
        match = re.match(r"^([A-Za-z_][\w]*(?:\s*,\s*[A-Za-z_][\w]*)*)(?:\s*\([^)]*\))?:\s*(.*)$", stripped)
        if match and (indent is None or level <= indent):
            indent = level
            current = [n.strip() for n in match.group(1).split(",")]
            for name in current:
                entries[name] = match.group(2).strip()
        elif current:
            for name in current:
                entries[name] = f"{entries[name]} {stripped}".strip()
    return entries


def option_descriptions(cls: type) -> dict[str, str]:
    """Each option of a stage class, described by the docstrings that define it: the options dataclass (and its
    bases), else the class and its ``__init__``."""
    sources: list[Any] = []
    declared = getattr(cls, "options_class", None)
    for owner in (declared.__mro__ if declared is not None else ()) + cls.__mro__:
        sources += [owner.__doc__, getattr(owner.__dict__.get("__init__"), "__doc__", None)]
    found: dict[str, str] = {}
    for doc in sources:
        for name, text in _docstring_entries(doc).items():
            found.setdefault(name, text)
    return found


def short(text: str, limit: int = 110) -> str:
    """The first sentence of a description, markup removed, at most ``limit`` characters."""
    import re

    text = re.sub(r"``([^`]*)``", r"\1", " ".join(text.split()))
    text = re.sub(r":(?:func|class|meth|attr):`~?([^`]*)`", r"\1", text)
    sentence = re.split(r"(?<=[.;])\s", text, maxsplit=1)[0].rstrip(".;")
    return sentence if len(sentence) <= limit else sentence[: limit - 1].rstrip() + "…"


def stage_option_comments(stage_type: str) -> dict[str, str]:
    """Option name -> one-line description, for a registered (or ``module:attr``) stage type; {} if it cannot be
    imported."""
    try:
        cls = STAGES.resolve(stage_type)
    except (ImportError, AttributeError, ValueError):
        return {}
    return {name: short(text) for name, text in option_descriptions(cls).items() if text}


def stage_summary(stage_type: str) -> str | None:
    """The first sentence of a stage class's docstring (what the stage does), or None."""
    try:
        cls = STAGES.resolve(stage_type)
    except (ImportError, AttributeError, ValueError):
        return None
    doc = (cls.__doc__ or "").strip()
    return short(doc.split("\n\n")[0]) if doc else None
