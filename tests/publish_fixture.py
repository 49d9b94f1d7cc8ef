"""A small release directory in the v1 release format, written without the builder (for card and publish tests).

``make_release(root, version, drop_classes=...)`` writes shards for ``original`` and ``counterfactual`` (and
``lance_r``), ``manifest.json`` (canonical JSON with ``manifest_sha256``), ``_info.json`` and a ``.lance-cf/`` work
directory that must never be published. Images are tiny PNGs with deterministic content; tars use a fixed mtime.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

from PIL import Image
from release_fixture import write_manifest, write_shards

from builder import release_format as rf

CLASS_NAMES = ["tench", "goldfish", "great white shark", "tiger shark", "hammerhead"]
EDIT_CYCLE = ("subject", "background", "weather", "adjective", "domain", "object")


def _png(seed: int) -> bytes:
    img = Image.new("RGB", (24, 16), (seed * 37 % 256, seed * 91 % 256, seed * 53 % 256))
    img.putpixel((seed % 24, seed % 16), (255, 255, 255))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def make_release(
    root: Path,
    version: str = "1.0.0",
    num_sources: int = 6,
    drop_classes: tuple[int, ...] = (),
    name: str = "lance-demo",
    per_shard: int = 4,
    imagenet_derived: bool = True,
    empty_configs: tuple[str, ...] = (),
    source_spec: str = "demo",
) -> tuple[Path, dict[str, Any]]:
    """Write a release under ``root`` and return (release_dir, manifest).

    ``empty_configs`` are left out as the builder leaves out a config with no sample (named in ``empty_configs``);
    ``source_spec`` is recorded as the manifest's ``source.spec``.
    """
    release = Path(root)
    release.mkdir(parents=True, exist_ok=True)
    by_config: dict[str, list[tuple[str, bytes, int, dict[str, Any]]]] = {c: [] for c in ("original", "counterfactual")}
    for i in range(num_sources):
        label = i % len(CLASS_NAMES)
        if label in drop_classes:
            continue
        key = f"src{i:03d}"
        meta = rf.empty_metadata(key, key, label, CLASS_NAMES[label], seed=1000 + i)
        meta["caption"] = f"a photo of a {CLASS_NAMES[label]} in a lake"
        by_config["original"].append((key, _png(i), label, meta))
        for j in range(2 if i % 2 == 0 else 1):
            edit_type = EDIT_CYCLE[(i + j) % len(EDIT_CYCLE)]
            cf = dict(meta, key=f"{key}-cf{j}", edit_type=edit_type, original_span="lake", edited_span="snowy field")
            cf["edited_caption"] = f"a photo of a {CLASS_NAMES[label]} in a snowy field"
            cf["self_replace"] = 0.4 + 0.1 * j
            cf["scores"] = {n: 0.5 + 0.01 * i for n in rf.SCORE_NAMES}
            cf["scores"]["clip_image"] = 1.0  # integral float: must stay a float after loading
            by_config["counterfactual"].append((cf["key"], _png(100 + i * 3 + j), label, cf))
    for config in empty_configs:
        del by_config[config]
    shards, counts = write_shards(release, by_config, per_shard)
    manifest: dict[str, Any] = {
        "format_version": rf.FORMAT_VERSION,
        "name": name,
        "version": version,
        "tool": {"name": "lance-counterfactuals", "version": "0.1.0"},
        "image_format": "png",
        "configs": list(by_config),
        "empty_configs": list(empty_configs),
        "config": {"seed": 0, "thresholds": {"label_similarity": 0.6}},
        "config_hash": "sha256:" + hashlib.sha256(version.encode()).hexdigest(),
        "seed": 0,
        "source": {
            "spec": source_spec,
            "kind": "demo",
            "num_samples": num_sources,
            "imagenet_derived": imagenet_derived,
            "license": "ImageNet terms of access" if imagenet_derived else "cc-by-4.0",
        },
        "label_space": {"name": "custom", "num_classes": len(CLASS_NAMES), "names": CLASS_NAMES},
        "stages": {
            "caption": {"target": "lance_pipeline.caption:Captioner", "model": "tiny/blip", "revision": "abc123"},
            "label_check": {"model": "all-MiniLM-L6-v2", "revision": "local", "threshold": 0.6},
        },
        "packages": {"python": "3.11", "datasets": "5.2.0"},
        "counts": counts,
        "failures": [{"source_key": "src999", "stage": "caption", "reason": "empty caption"}],
        "shards": shards,
    }
    write_manifest(release, manifest)
    (release / rf.WORK_DIR).mkdir(exist_ok=True)
    (release / rf.WORK_DIR / "ledger.sqlite").write_bytes(b"SQLite format 3\0 not for upload")
    return release, manifest


def make_results(manifest: dict[str, Any], model: str, cf_acc: float, **overrides: Any) -> dict[str, Any]:
    """A results JSON as ``lance-cf eval`` writes it (schema v2, a full run) for a model on ``manifest``'s release.

    Original accuracy 80 (of 20 images), counterfactual accuracy ``cf_acc`` (of 400 images: any multiple of 0.25 is a
    whole number of correct samples, as validation requires) on 9 pairs; ``overrides`` replace top-level fields.
    """
    slug = model.replace(":", "-").replace("/", "_")
    paired = round(cf_acc - 80.0, 4)
    result: dict[str, Any] = {
        "schema": "lance-cf/eval-results",
        "schema_version": 2,
        "status": "ok",
        "tool": {"name": "lance-counterfactuals", "version": "0.1.0"},
        "options": {"batch_size": 8, "bootstrap": 0, "seed": 0},
        "limit": None,
        "failures": [],
        "model": {"name": model, "slug": slug, "weights": {"id": "pretrained"}},
        "release": {
            "name": manifest["name"],
            "version": manifest["version"],
            "manifest_sha256": manifest["manifest_sha256"],
            "source": "demo",
        },
        "metrics": {
            "original": {"acc1": 80.0, "acc5": 95.0, "n": 20},
            "counterfactual": {"acc1": cf_acc, "acc5": 90.0, "n": 400, "delta_acc1": paired, "delta_acc5": -5.0},
        },
        "sensitivity": {
            "overall": {"n": 9, "orig_acc1": 80.0, "acc1": cf_acc, "paired_delta_acc1": paired, "flip_rate": 0.25},
            "by_edit_type": {"subject": {"paired_delta_acc1": -30.0}, "weather": {"paired_delta_acc1": -2.0}},
        },
    }
    result.update(overrides)
    return result
