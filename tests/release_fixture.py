"""A small synthetic release in the exact release format, so that evaluation tests do not depend on the builder.

Everything is written through the release format unit (``builder.release_format``: shard writer, tally, canonical
manifest, ``_info.json``, card YAML), so a fixture release passes ``verify``. ``format_version=1`` writes a v1 release
as the v1 code wrote it (same shard bytes, no ``release_spec`` or ``assets``, ``cls`` declared as int64).

Images are simple generated pictures (a class-coloured shape on noise); the metadata mimics what the builder writes:
captions, edits of several types with their spans, LANCE-R edits, filter scores and seeds.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from builder import release_format as rf

_EDITS = {
    "subject": ("dog", "cat"),
    "object": ("ball", "stick"),
    "background": ("grass", "snow"),
    "weather": ("sunny day", "rainy day"),
    "adjective": ("small", "large"),
    "domain": ("photo", "painting"),
}


def _image(rng: np.random.Generator, label: int, variant: int, size: int) -> Image.Image:
    pixels = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    image = Image.fromarray(pixels, "RGB")
    draw = ImageDraw.Draw(image)
    colour = tuple(int(c) for c in rng.integers(0, 256, size=3))
    lo, hi = size // 6 + variant, size - size // 6 - variant
    if label % 2:
        draw.ellipse([lo, lo, hi, hi], fill=colour)
    else:
        draw.rectangle([lo, lo, hi, hi], fill=colour)
    return image


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def write_shards(
    root: Path,
    rows: dict[str, list[tuple[str, bytes, int, dict[str, Any]]]],
    shard_size: int,
    spec: rf.ReleaseSpec | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Write each config's (key, png, label, metadata) rows as shards; return the manifest's shards and counts.
    Metadata is checked against ``spec`` (v1's fields when omitted)."""
    shards: list[dict[str, Any]] = []
    counts: dict[str, Any] = {}
    for config, samples in rows.items():
        tally = rf.Tally()
        encoded = []
        for key, png, label, meta in samples:
            tally.add(label, meta["edit_type"])
            metadata = rf.encode_metadata(meta, spec, config) if spec else rf.encode_metadata(meta)
            encoded.append(rf.ShardSample(key, "png", png, label, metadata))
        for index, start in enumerate(range(0, len(encoded), shard_size)):
            shards.append(rf.write_shard(root, config, index, encoded[start : start + shard_size]).to_dict())
        counts[config] = tally.to_dict()
    return shards, counts


def write_manifest(root: Path, manifest: dict[str, Any], *, croissant: bool = True) -> dict[str, Any]:
    """Seal the manifest with its manifest_sha256 and write it with the matching _info.json (and, in the current
    format, croissant.json with its metadata indexes).

    A current-format manifest without a declaration gets the LANCE one for its configs, and its gallery is rendered
    and recorded under ``assets`` as the builder does.
    """
    if manifest["format_version"] >= 2:
        from dataset_cards import write_gallery

        if "release_spec" not in manifest:
            manifest["release_spec"] = rf.lance_release_spec(manifest["configs"]).to_dict()
        if "assets" not in manifest:
            gallery = write_gallery(root, manifest["configs"], manifest["shards"])
            manifest["assets"] = []
            for entry in gallery:
                digest, size = rf.file_sha256(root / entry["path"])
                manifest["assets"].append({"path": entry["path"], "sha256": digest, "bytes": size})
    manifest.setdefault("empty_configs", [])
    rf.seal_manifest(manifest)
    (root / rf.MANIFEST_NAME).write_bytes(rf.canonical_json(manifest))
    (root / rf.TIMM_INFO_NAME).write_bytes(rf.canonical_json(rf.timm_info(manifest)))
    if croissant and manifest["format_version"] >= 2:
        from builder.croissant import write_release_croissant

        write_release_croissant(root, manifest)  # croissant.json and the metadata indexes, as the builder writes them
    return manifest


def write_card(root: Path, manifest: dict[str, Any]) -> None:
    """A short card whose YAML is exactly what the manifest implies (what ``verify`` checks)."""
    import yaml

    front = rf.card_yaml_expected(manifest)
    text = f"---\n{yaml.safe_dump(front, sort_keys=False)}---\n\n# {manifest['name']}\n\nSynthetic fixture release.\n"
    (root / rf.CARD_NAME).write_text(text, encoding="utf-8")


def write_release(
    root: Path,
    *,
    labels: tuple[int, ...] = (1, 207, 281),
    label_names: list[str] | None = None,
    originals_per_class: int = 2,
    edits_per_original: int = 3,
    image_size: int = 48,
    shard_size: int = 8,
    configs: tuple[str, ...] = rf.CONFIG_NAMES,
    name: str = "lance-fixture",
    version: str = "1.0.0",
    seed: int = 0,
    format_version: int = rf.FORMAT_VERSION,
    strength_levels: tuple[float, ...] = (),
) -> Path:
    """Write a release under ``root`` and return ``root``.

    Args:
        labels: the label indices used by the samples.
        label_names: the full label space; the ImageNet-1k names from timm when omitted.
        originals_per_class: original images per label.
        edits_per_original: counterfactuals per original; their edit types cycle through LANCE's six.
        image_size: side of the square images.
        shard_size: samples per shard (several shards per config once a config holds more).
        configs: the configs to write.
        format_version: 1 writes a v1 release (as the v1 code did), 2 the current format.
        strength_levels: when given, a ``strength`` config too: every counterfactual at each level, as a build's
            sweep writes it; the last level's row is the selected one and holds the counterfactual's very bytes.
    """
    if strength_levels:
        configs = (*configs, "strength")
    if label_names is None:
        from timm.data import ImageNetInfo

        label_names = list(ImageNetInfo().label_descriptions())
        space_name = "imagenet-1k"
    else:
        space_name = "custom"
    rng = np.random.default_rng(seed)
    rows: dict[str, list[tuple[str, bytes, int, dict[str, Any]]]] = {c: [] for c in configs}
    edit_counter = 0
    for label in labels:
        label_name = label_names[label]
        for i in range(originals_per_class):
            source_key = f"src-{label:04d}-{i:02d}"
            caption = f"a photo of a small dog with a ball on the grass on a sunny day, {label_name}"
            item_seed = int(rng.integers(0, 2**31 - 1))
            original = _image(rng, label, i, image_size)
            meta = rf.empty_metadata(source_key, source_key, label, label_name, item_seed)
            meta["caption"] = caption
            if "original" in configs:
                rows["original"].append((source_key, _png(original), label, meta))
            if "reconstructed" in configs:
                recon = np.asarray(original).astype(np.int16) + rng.integers(-12, 13, size=(image_size, image_size, 3))
                image = Image.fromarray(np.clip(recon, 0, 255).astype(np.uint8), "RGB")
                rec_meta = rf.empty_metadata(f"{source_key}-rec", source_key, label, label_name, item_seed)
                rec_meta["caption"] = caption
                rows["reconstructed"].append((f"{source_key}-rec", _png(image), label, rec_meta))
            for j in range(edits_per_original):
                edit_type = list(_EDITS)[edit_counter % len(_EDITS)]
                edit_counter += 1
                span, new_span = _EDITS[edit_type]
                for config, suffix in (("counterfactual", "cf"), ("lance_r", "lr")):
                    if config not in configs or (config == "lance_r" and j > 0):
                        continue
                    key = f"{source_key}-{suffix}{j:02d}"
                    image = _image(rng, label if rng.random() < 0.6 else label + 1, j + 3, image_size)
                    m = rf.empty_metadata(key, source_key, label, label_name, item_seed)
                    replacement = new_span if config == "counterfactual" else f"{new_span} {j}"
                    m.update(
                        caption=caption,
                        edited_caption=caption.replace(span, replacement, 1),
                        original_span=span,
                        edited_span=replacement,
                        edit_type=edit_type if config == "counterfactual" else None,
                        self_replace=float(rng.choice([0.4, 0.6, 0.8])),
                        scores={n: float(np.round(rng.random(), 4)) for n in rf.SCORE_NAMES},
                    )
                    rows[config].append((key, _png(image), label, m))
                    if config == "counterfactual" and strength_levels:
                        for level_index, level in enumerate(strength_levels):
                            selected = level_index == len(strength_levels) - 1
                            swept = image if selected else _image(rng, label, j + 7 + level_index, image_size)
                            sm = dict(m, key=f"{key}-st{level_index}", strength=level, selected=selected,
                                      counterfactual_key=key, edit_index=j)  # fmt: skip
                            rows["strength"].append((sm["key"], _png(swept), label, sm))
    root.mkdir(parents=True, exist_ok=True)
    spec = None
    if strength_levels:  # the strength config as the edit stage declares it (the builder's declaration)
        from builder.validation import declared_config
        from lance_pipeline.editing.strength import STRENGTH_OUTPUT

        extra = (declared_config(STRENGTH_OUTPUT, STRENGTH_OUTPUT.description),)
        spec = rf.lance_release_spec(configs, extra=extra)
    shards, counts = write_shards(root, rows, shard_size, spec)
    build_config = {"seed": seed, "source": "fixture", "edits_per_original": edits_per_original}
    config_hash = "sha256:" + hashlib.sha256(json.dumps(build_config, sort_keys=True).encode()).hexdigest()
    manifest: dict[str, Any] = {
        "format_version": format_version,
        "name": name,
        "version": version,
        "tool": {"name": "lance-counterfactuals", "version": "0.1.0"},
        "image_format": "png",
        "configs": list(configs),
        "config": build_config,
        "config_hash": config_hash,
        "seed": seed,
        "source": {
            "spec": "fixture",
            "kind": "demo",
            "num_samples": len(labels) * originals_per_class,
            "imagenet_derived": space_name == "imagenet-1k",
            "license": "synthetic test data",
        },
        "label_space": {"name": space_name, "num_classes": len(label_names), "names": label_names},
        "stages": {"caption": {"target": "fixture", "model": "none", "revision": "none"}},
        "packages": {"python": "3.11"},
        "counts": counts,
        "failures": [],
        "shards": shards,
    }
    if spec is not None:
        manifest["release_spec"] = spec.to_dict()
    write_manifest(root, manifest)
    write_card(root, manifest)
    return root
