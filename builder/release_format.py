"""Release format v1: the single source of truth for what a release directory holds.

The builder writes this format, ``lance-cf verify`` checks it, ``dataset_cards`` declares it in the card's YAML,
and ``evaluation`` reads it. This module imports nothing from the rest of ``builder`` (only the method's vocabulary
from ``lance_pipeline.stage``) so that readers of the format do not depend on the build machinery. Human-readable description: docs/release-format.md.
"""

from __future__ import annotations

import json
import re
from typing import Any

# The method's vocabulary, defined once beside the stage contract (importing it pulls in nothing heavy).
from lance_pipeline.stage import RELEASE_EDIT_TYPES as EDIT_TYPES  # the six of LANCE and DILLEMA's "multi"
from lance_pipeline.stage import SCORE_NAMES

FORMAT_VERSION = 1
SPLIT = "test"
CONFIG_NAMES = ("original", "reconstructed", "counterfactual", "lance_r")
METADATA_FIELDS = (
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
# The members of one WebDataset sample: KEY.<ext>. The image extension is per release (lossless by default).
IMAGE_FORMATS = ("png", "webp")
DEFAULT_IMAGE_FORMAT = "png"
LABEL_EXT = "cls"
METADATA_EXT = "json"

MANIFEST_NAME = "manifest.json"
CARD_NAME = "README.md"
TIMM_INFO_NAME = "_info.json"
DATA_DIR = "data"
WORK_DIR = ".lance-cf"  # build work directory (ledger); never hashed, never published

KEY_PATTERN = re.compile(r"^[A-Za-z0-9_-]+$")


def shard_path(config: str, index: int) -> str:
    """Path of a shard relative to the release root, e.g. ``data/counterfactual/test-000003.tar``."""
    return f"{DATA_DIR}/{config}/{SPLIT}-{index:06d}.tar"


def shard_glob(config: str) -> str:
    return f"{DATA_DIR}/{config}/{SPLIT}-*.tar"


def is_valid_key(key: str) -> bool:
    return bool(KEY_PATTERN.match(key))


def sanitize_key(text: str) -> str:
    """Map any source identifier to a key made only of ``[A-Za-z0-9_-]``.

    Characters outside the set become ``_``; a short stable hash is appended whenever that changed the text, so that
    two different identifiers never collide after sanitising (``a.b`` and ``a_b`` stay distinct).
    """
    import hashlib

    cleaned = re.sub(r"[^A-Za-z0-9_-]", "_", text)
    if cleaned != text or not cleaned:
        cleaned = f"{cleaned}-{hashlib.sha256(text.encode('utf-8')).hexdigest()[:8]}"
    return cleaned


def metadata_json_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of one sample's ``KEY.json``. Also written to docs/metadata.schema.json."""
    nullable_str = {"type": ["string", "null"]}
    nullable_num = {"type": ["number", "null"]}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://github.com/lance-counterfactuals/lance-counterfactuals/docs/metadata.schema.json",
        "title": "LANCE counterfactual release v1: per-sample metadata",
        "type": "object",
        "additionalProperties": False,
        "required": list(METADATA_FIELDS),
        "properties": {
            "key": {"type": "string", "pattern": KEY_PATTERN.pattern},
            "source_key": {"type": "string", "pattern": KEY_PATTERN.pattern},
            "label": {"type": "integer", "minimum": 0},
            "label_name": {"type": "string"},
            "edit_type": {"enum": [*EDIT_TYPES, None]},
            "caption": nullable_str,
            "edited_caption": nullable_str,
            "original_span": nullable_str,
            "edited_span": nullable_str,
            "seed": {"type": "integer", "minimum": 0},
            "self_replace": nullable_num,
            "scores": {
                "type": "object",
                "additionalProperties": False,
                "required": list(SCORE_NAMES),
                "properties": {name: nullable_num for name in SCORE_NAMES},
            },
        },
    }


def empty_metadata(key: str, source_key: str, label: int, label_name: str, seed: int) -> dict[str, Any]:
    """A metadata record with every field present and the unused ones null."""
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
        "scores": dict.fromkeys(SCORE_NAMES),
    }


def normalize_metadata(meta: dict[str, Any]) -> dict[str, Any]:
    """Coerce types so that JSON encoding is stable: floats stay floats (``1`` becomes ``1.0``), order is fixed."""
    out = {name: meta.get(name) for name in METADATA_FIELDS}
    if out["self_replace"] is not None:
        out["self_replace"] = float(out["self_replace"])
    scores = meta.get("scores") or {}
    out["scores"] = {name: (None if scores.get(name) is None else float(scores[name])) for name in SCORE_NAMES}
    out["label"] = int(out["label"])
    out["seed"] = int(out["seed"])
    return out


def encode_metadata(meta: dict[str, Any]) -> bytes:
    """Canonical bytes of a sample's metadata (fixed key order, no whitespace variance)."""
    return json.dumps(normalize_metadata(meta), ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def hf_features(image_format: str = DEFAULT_IMAGE_FORMAT) -> list[dict[str, Any]]:
    """The ``dataset_info.features`` list for the card YAML, identical for every config.

    Declared, never inferred: ``datasets`` then casts every row to these types, so an integral score is still a float
    and a field that is null in the first rows and set later still loads.
    """
    float_field = "float64"
    string_field = "string"
    return [
        {"name": "__key__", "dtype": string_field},
        {"name": "__url__", "dtype": string_field},
        {"name": LABEL_EXT, "dtype": "int64"},
        {"name": image_format, "dtype": "image"},
        {
            "name": METADATA_EXT,
            "struct": [
                {"name": "key", "dtype": string_field},
                {"name": "source_key", "dtype": string_field},
                {"name": "label", "dtype": "int64"},
                {"name": "label_name", "dtype": string_field},
                {"name": "edit_type", "dtype": string_field},
                {"name": "caption", "dtype": string_field},
                {"name": "edited_caption", "dtype": string_field},
                {"name": "original_span", "dtype": string_field},
                {"name": "edited_span", "dtype": string_field},
                {"name": "seed", "dtype": "int64"},
                {"name": "self_replace", "dtype": float_field},
                {"name": "scores", "struct": [{"name": n, "dtype": float_field} for n in SCORE_NAMES]},
            ],
        },
    ]


def card_configs(configs: list[str] | tuple[str, ...]) -> list[dict[str, Any]]:
    """The ``configs`` block of the card YAML: one entry per config, the ``test`` split pointing at its shards."""
    return [
        {
            "config_name": config,
            "data_files": [{"split": SPLIT, "path": shard_glob(config)}],
            **({"default": True} if config == "original" or (i == 0 and "original" not in configs) else {}),
        }
        for i, config in enumerate(configs)
    ]


def card_dataset_info(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``dataset_info`` block of the card YAML: features, split sizes and bytes per config."""
    image_format = manifest.get("image_format", DEFAULT_IMAGE_FORMAT)
    infos = []
    for config in manifest["configs"]:
        shards = [s for s in manifest["shards"] if s["config"] == config]
        infos.append(
            {
                "config_name": config,
                "features": hf_features(image_format),
                "splits": [
                    {
                        "name": SPLIT,
                        "num_bytes": sum(s["bytes"] for s in shards),
                        "num_examples": sum(s["samples"] for s in shards),
                    }
                ],
                "download_size": sum(s["bytes"] for s in shards),
                "dataset_size": sum(s["bytes"] for s in shards),
            }
        )
    return infos


def timm_info(manifest: dict[str, Any]) -> dict[str, Any]:
    """``_info.json`` for timm's WebDataset reader: one split per config (``split="counterfactual"``)."""
    splits = {}
    for config in manifest["configs"]:
        shards = [s for s in manifest["shards"] if s["config"] == config]
        splits[config] = {
            "name": config,
            "num_samples": sum(s["samples"] for s in shards),
            "filenames": [s["path"] for s in shards],
            "shard_lengths": [s["samples"] for s in shards],
        }
    return {"name": manifest["name"], "version": manifest["version"], "splits": splits}
