"""What the release declares to its readers besides the manifest: the card's YAML blocks and timm's ``_info.json``.

All generated from the manifest (and its ``release_spec``), so the card, ``_info.json`` and the shards cannot disagree.
"""

from __future__ import annotations

from typing import Any

from builder.release_format.layout import SPLIT, shard_glob
from builder.release_format.manifest import Manifest
from builder.release_format.metadata import hf_features

# Licence ids the Hub accepts in ``license:`` that a source might carry; anything else becomes ``other``.
KNOWN_LICENSES = (
    "apache-2.0",
    "mit",
    "cc0-1.0",
    "cc-by-4.0",
    "cc-by-sa-4.0",
    "cc-by-nc-4.0",
    "cc-by-nc-sa-4.0",
    "cc-by-nd-4.0",
    "cc-by-nc-nd-4.0",
    "cc-by-2.0",
    "cc-by-3.0",
    "odc-by",
    "openrail",
    "unknown",
)
IMAGENET_TERMS = (
    "The images of this dataset are edits of ImageNet images. By requesting access you agree to the ImageNet terms of"
    " access (https://www.image-net.org/download.php): use them only for non-commercial research and educational"
    " purposes, do not redistribute them, and accept full responsibility for your use of the data."
)


def _manifest(manifest: Manifest | dict[str, Any]) -> Manifest:
    return manifest if isinstance(manifest, Manifest) else Manifest.from_dict(manifest)


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


def card_dataset_info(manifest: Manifest | dict[str, Any]) -> list[dict[str, Any]]:
    """The ``dataset_info`` block of the card YAML: features, split sizes and bytes per config.

    v1 releases declare ``cls`` as int64 and the v1 metadata; v2 releases a ``ClassLabel`` with the label space's
    names and each config's declared extra fields.
    """
    m = _manifest(manifest)
    class_names = m.label_names if m.format_version >= 2 else None
    infos = []
    for config in m.configs:
        shards = m.shards_of(config)
        size = sum(s.bytes for s in shards)
        infos.append(
            {
                "config_name": config,
                "features": hf_features(
                    m.image_ext, m.release_spec, config if m.format_version >= 2 else None, class_names
                ),
                "splits": [{"name": SPLIT, "num_bytes": size, "num_examples": sum(s.samples for s in shards)}],
                "download_size": size,
                "dataset_size": size,
            }
        )
    return infos


def card_licence(manifest: Manifest | dict[str, Any]) -> dict[str, Any]:
    """The card YAML's licence keys implied by the manifest's source (gated for ImageNet-derived data)."""
    source = _manifest(manifest).source
    if source.get("imagenet_derived"):
        return {
            "license": "other",
            "license_name": "imagenet",
            "license_link": "https://www.image-net.org/download.php",
            "extra_gated_prompt": IMAGENET_TERMS,
            "extra_gated_fields": {"I agree to use this dataset for non-commercial research only": "checkbox"},
        }
    if str(source.get("license") or "").lower() in KNOWN_LICENSES:
        return {"license": str(source["license"]).lower()}
    return {"license": "other", "license_name": "source-terms"}


def card_yaml_expected(manifest: Manifest | dict[str, Any]) -> dict[str, Any]:
    """The card YAML keys that must equal what the manifest implies (``verify`` compares them)."""
    m = _manifest(manifest)
    return {"configs": card_configs(m.configs), "dataset_info": card_dataset_info(m), **card_licence(m)}


def timm_info(manifest: Manifest | dict[str, Any]) -> dict[str, Any]:
    """``_info.json`` for timm's WebDataset reader: one split per config (``split="counterfactual"``)."""
    m = _manifest(manifest)
    splits = {}
    for config in m.configs:
        shards = m.shards_of(config)
        splits[config] = {
            "name": config,
            "num_samples": sum(s.samples for s in shards),
            "filenames": [s.path for s in shards],
            "shard_lengths": [s.samples for s in shards],
        }
    return {"name": m.name, "version": m.version, "splits": splits}
