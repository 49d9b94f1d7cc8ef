"""What the release declares to its readers besides the manifest: the card's YAML blocks and timm's ``_info.json``.

All generated from the manifest (and its ``release_spec``), so the card, ``_info.json`` and the shards cannot disagree.
"""

from __future__ import annotations

import re
from typing import Any

from builder.release_format.layout import SPLIT, shard_glob
from builder.release_format.manifest import Manifest
from builder.release_format.metadata import hf_features
from builder.release_format.papers import release_kind, release_papers

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
    _share_class_names(infos)
    return infos


def _share_class_names(infos: list[dict[str, Any]]) -> None:
    """Make every config's ``ClassLabel`` names one object, so that the YAML writer prints the class list once (an
    anchor on the first config, an alias on the others: standard YAML that the Hub's parsers, ``datasets`` and
    huggingface_hub read back as the same list). A 1,000-class release's front matter is then about 1,000 lines
    shorter per config."""
    first = None
    for info in infos:
        for feature in info["features"]:
            names = (
                feature.get("dtype", {}).get("class_label", {}).get("names")
                if isinstance(feature.get("dtype"), dict)
                else None
            )
            if names is None:
                continue
            if first is None:
                first = names
            elif names == first:
                feature["dtype"]["class_label"]["names"] = first


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


# The Hub indexes datasets by these card keys (hub-docs datasetcard.md); the values of the creators and size keys are
# the field's own vocabularies, as `datasets` ships them (datasets/utils/resources/creators.json, size_categories.json).
CARD_TAGS = ("webdataset", "image", "robustness", "counterfactual", "lance", "synthetic", "stress-test")


def size_category(n: int) -> str:
    """The Hub's ``size_categories`` bucket for ``n`` rows."""
    for bound, name in ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"), (1_000_000, "100K<n<1M")):
        if n < bound:
            return name
    return "1M<n<10M"


def pretty_name(name: str) -> str:
    """The card's title and ``pretty_name`` from the release name (``lance-hardimagenet`` -> ``LANCE HardImageNet``)."""
    words = [w.upper() if w.lower() in ("lance", "cf") else w.capitalize() for w in re.split(r"[-_]", name) if w]
    pretty = " ".join(words)
    return pretty.replace("Hardimagenet", "HardImageNet").replace("Imagenet", "ImageNet")


def source_datasets(manifest: Manifest | dict[str, Any]) -> list[str]:
    """``source_datasets`` in the Hub's convention: ``original`` for images generated from text (a kind that declares
    itself ``generated``), ``extended|<dataset>`` for edits of a source dataset's images (ImageNet-1k, a Hub dataset by
    its id, else ``other``)."""
    m = _manifest(manifest)
    source = m.source
    kind, spec = str(source.get("kind")), str(source.get("spec"))
    if release_kind(m).generated:
        return ["original"]
    if kind == "imagenet" or source.get("imagenet_derived"):
        return ["extended|imagenet-1k"]
    if kind == "hf" and spec.startswith("hf:"):
        return [f"extended|{spec.removeprefix('hf:').split(':')[0]}"]
    return ["extended|other"]


def card_creators(manifest: Manifest | dict[str, Any]) -> dict[str, list[str]]:
    """``annotations_creators`` and ``language_creators``: who made the labels and the text of the release.

    Labels of edits are the source images' labels (ImageNet's were crowdsourced, a folder's or a Hub dataset's are
    taken as found); labels of generated images (a kind that declares itself ``generated``) are the class the generator
    was asked for. Who wrote the text of the metadata is the kind's ``language_creators``.
    """
    m = _manifest(manifest)
    kind = release_kind(m)
    if kind.generated:
        annotations = ["machine-generated"]
    else:
        annotations = ["crowdsourced" if m.source.get("imagenet_derived") else "found", "machine-generated"]
    return {"annotations_creators": annotations, "language_creators": list(kind.language_creators)}


def card_metadata(manifest: Manifest | dict[str, Any]) -> dict[str, Any]:
    """The card YAML keys the Hub indexes a dataset by, from the manifest: name, task, size, sources, creators,
    language and tags, with an ``arxiv:<id>`` tag for each paper the release's kind implements."""
    m = _manifest(manifest)
    total = sum(int(c["total"]) for c in m.counts.values())
    return {
        "pretty_name": pretty_name(m.name),
        "language": ["en"],
        "task_categories": ["image-classification"],
        "task_ids": list(release_kind(m).task_ids),
        "size_categories": [size_category(total)],
        "source_datasets": source_datasets(m),
        **card_creators(m),
        "tags": [*CARD_TAGS, *(f"arxiv:{p.arxiv}" for p in release_papers(m))],
    }


def card_yaml_expected(manifest: Manifest | dict[str, Any]) -> dict[str, Any]:
    """The card YAML keys that must equal what the manifest implies (``verify`` compares them)."""
    m = _manifest(manifest)
    return {
        "configs": card_configs(m.configs),
        "dataset_info": card_dataset_info(m),
        **card_licence(m),
        **card_metadata(m),
    }


# The Hub's viewer converts each config's split to Parquet and stops after this many bytes of Parquet: the production
# setting parquetAndInfo.maxDatasetSizeBytes of huggingface/dataset-viewer (chart/env/prod.yaml), documented in
# hub-docs docs/hub/datasets-viewer.md ("Large scale datasets": for WebDataset and other non-Parquet formats over 5GB
# the viewer only shows the first 5GB). The Hub's own Croissant is generated from the same conversion.
VIEWER_MAX_PARQUET_BYTES = 5_000_000_000


def viewer_partial_configs(manifest: Manifest | dict[str, Any]) -> dict[str, int]:
    """The configs the Hub's viewer will show only in part, with their shard bytes.

    A config's Parquet holds its images' bytes and metadata, close to its shards' bytes less the tar headers, so a
    config whose shards exceed the limit is taken to exceed it; one below it is converted whole.
    """
    m = _manifest(manifest)
    sizes = {c: sum(s.bytes for s in m.shards_of(c)) for c in m.configs}
    return {c: size for c, size in sizes.items() if size > VIEWER_MAX_PARQUET_BYTES}


def viewer_statement(manifest: Manifest | dict[str, Any]) -> str:
    """One sentence: whether the Hub's viewer (and the Croissant the Hub generates from it) covers the whole
    release, and if not which configs it shows only in part."""
    partial = viewer_partial_configs(manifest)
    limit = f"{VIEWER_MAX_PARQUET_BYTES:,} bytes"
    if not partial:
        return (
            f"The Hub's dataset viewer shows the whole release: every config is under the viewer's Parquet conversion "
            f"limit of {limit} per split."
        )
    listed = ", ".join(f"{c} ({size:,} bytes of shards)" for c, size in partial.items())
    return (
        f"The Hub's dataset viewer shows only part of this release: it converts each config's split to Parquet up to "
        f"{limit}, so it shows only the first rows of {listed}; the Hub's generated Croissant covers the same part. "
        "Every row is in the shards, in croissant.json and in load_dataset."
    )


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
