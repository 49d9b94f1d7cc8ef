"""Render a release's dataset card (README.md) with huggingface_hub's card classes and the template beside this file.

The YAML ``configs`` and ``dataset_info`` blocks come from ``builder.release_format`` so that the card and the shards the
builder wrote can never disagree; ``datasets`` reads those blocks instead of inferring features from the first rows.
The prose describes the method (LANCE, Prabhu et al., NeurIPS 2023), how this release was built, its counts, a
gallery of original/counterfactual pairs (PNG files stored in the release under ``assets/``), known failure modes,
an ethics note, loading and evaluation snippets, an optional leaderboard and a changelog against the previous release.
"""

from __future__ import annotations

import io
import json
import logging
import re
import tarfile
from pathlib import Path
from typing import Any

from builder import release_format as rf

logger = logging.getLogger(__name__)

TEMPLATE_PATH = Path(__file__).parent / "templates" / "release_card.md"
ASSETS_DIR = "assets"
GALLERY_PREFIX = "gallery-"
MAX_GALLERY_PAIRS = 6
GALLERY_HEIGHT = 224

CONFIG_DESCRIPTIONS = {
    "original": "the source images, unedited",
    "reconstructed": "the source images regenerated through inversion with no edit (controls for regeneration)",
    "counterfactual": "LANCE counterfactuals that passed every filter, one row per kept edit",
    "lance_r": "LANCE-R baseline: random caption edits, same editor and filters",
}
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


def render_release_card(
    release_dir: Path,
    manifest: dict,
    results: list[dict] | None = None,
    previous_manifest: dict | None = None,
    *,
    repo_id: str | None = None,
) -> str:
    """Write RELEASE/README.md (and its gallery PNGs under RELEASE/assets/) and return the card text.

    Args:
        release_dir: the release directory (shards under ``data/`` are read for the gallery).
        manifest: the release's ``manifest.json`` content.
        results: evaluation results JSONs (``model``, ``release``, ``metrics.<config>.acc1/acc5/delta_acc1/...``,
            ``sensitivity.by_edit_type``); a leaderboard section is rendered when given.
        previous_manifest: the manifest of the previous release, for the changelog.
        repo_id: the Hub repository (``ORG/NAME``) used in the loading snippets; ``ORG/<name>`` when unknown.

    Returns:
        The card text that was written to ``README.md``.
    """
    from huggingface_hub import DatasetCard

    release_dir = Path(release_dir)
    for key in ("name", "version", "configs", "counts", "shards", "source"):
        if key not in manifest:
            raise ValueError(f"manifest is missing {key!r}; expected a release manifest.json (format v1)")
    gallery = write_gallery(release_dir, manifest)
    card_data = build_card_data(manifest)
    context = _template_context(manifest, results, previous_manifest, gallery, repo_id)
    card = DatasetCard.from_template(card_data, template_path=str(TEMPLATE_PATH), **context)
    text = str(card)
    if not text.endswith("\n"):
        text += "\n"
    (release_dir / rf.CARD_NAME).write_text(text, encoding="utf-8")
    logger.info("wrote %s (%d gallery pairs)", release_dir / rf.CARD_NAME, len(gallery))
    return text


# ---------------------------------------------------------------------------------------------------------------- YAML
def build_card_data(manifest: dict[str, Any]):
    """The card's YAML metadata as a ``DatasetCardData``."""
    from huggingface_hub import DatasetCardData

    source = manifest.get("source", {})
    total = sum(c.get("total", 0) for c in manifest["counts"].values())
    licence: dict[str, Any]
    if source.get("imagenet_derived"):
        licence = {
            "license": "other",
            "license_name": "imagenet",
            "license_link": "https://www.image-net.org/download.php",
            "extra_gated_prompt": IMAGENET_TERMS,
            "extra_gated_fields": {"I agree to use this dataset for non-commercial research only": "checkbox"},
        }
    elif str(source.get("license", "")).lower() in KNOWN_LICENSES:
        licence = {"license": str(source["license"]).lower()}
    else:
        licence = {"license": "other", "license_name": "source-terms"}
    tags = ["webdataset", "image", "robustness", "counterfactual", "lance", "synthetic", "stress-test"]
    return DatasetCardData(
        pretty_name=_pretty_name(manifest),
        task_categories=["image-classification"],
        task_ids=["multi-class-image-classification"],
        size_categories=[size_category(total)],
        tags=tags,
        configs=rf.card_configs(list(manifest["configs"])),
        dataset_info=rf.card_dataset_info(manifest),
        **licence,
    )


def size_category(n: int) -> str:
    """The Hub's ``size_categories`` bucket for ``n`` rows."""
    for bound, name in ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"), (1_000_000, "100K<n<1M")):
        if n < bound:
            return name
    return "1M<n<10M"


def _pretty_name(manifest: dict[str, Any]) -> str:
    name = manifest["name"]
    words = [w.upper() if w.lower() in ("lance", "cf") else w.capitalize() for w in re.split(r"[-_]", name) if w]
    pretty = " ".join(words)
    return pretty.replace("Hardimagenet", "HardImageNet").replace("Imagenet", "ImageNet")


# ------------------------------------------------------------------------------------------------------------- gallery
def read_shard_samples(path: Path) -> dict[str, dict[str, bytes]]:
    """All samples of a WebDataset shard: key -> {extension: bytes}."""
    samples: dict[str, dict[str, bytes]] = {}
    with tarfile.open(path) as tar:
        for member in tar:
            if not member.isfile():
                continue
            base = member.name.rsplit("/", 1)[-1]
            key, _, ext = base.partition(".")
            data = tar.extractfile(member)
            if data is not None:
                samples.setdefault(key, {})[ext] = data.read()
    return samples


def _config_samples(release_dir: Path, manifest: dict[str, Any], config: str) -> dict[str, dict[str, bytes]]:
    samples: dict[str, dict[str, bytes]] = {}
    for shard in manifest["shards"]:
        if shard["config"] == config and (release_dir / shard["path"]).exists():
            samples.update(read_shard_samples(release_dir / shard["path"]))
    return samples


def select_pairs(
    originals: dict[str, dict[str, bytes]], counterfactuals: dict[str, dict[str, bytes]], limit: int
) -> list[tuple[dict[str, Any], bytes, bytes]]:
    """Pick up to ``limit`` (metadata, original image, counterfactual image) pairs, one edit type at a time."""
    by_type: dict[str, list[tuple[dict[str, Any], bytes, bytes]]] = {}
    for key in sorted(counterfactuals):
        members = counterfactuals[key]
        meta = json.loads(members.get(rf.METADATA_EXT, b"{}"))
        source = originals.get(meta.get("source_key", ""))
        cf_image = next((members[e] for e in rf.IMAGE_FORMATS if e in members), None)
        orig_image = next((source[e] for e in rf.IMAGE_FORMATS if e in source), None) if source else None
        if cf_image is None or orig_image is None:
            continue
        by_type.setdefault(meta.get("edit_type") or "none", []).append((meta, orig_image, cf_image))
    ordered = [t for t in (*rf.EDIT_TYPES, "none") if t in by_type]
    pairs: list[tuple[dict[str, Any], bytes, bytes]] = []
    # Round-robin over edit types; within a type, the first pair (in key order) of the source image shown least so
    # far, so that the gallery spreads over source images instead of showing every edit of the first one.
    shown: dict[str, int] = {}
    while len(pairs) < limit and any(by_type[t] for t in ordered):
        for edit_type in ordered:
            candidates = by_type[edit_type]
            if not candidates or len(pairs) >= limit:
                continue
            pick = min(range(len(candidates)), key=lambda i: (shown.get(candidates[i][0].get("source_key", ""), 0), i))
            pair = candidates.pop(pick)
            shown[pair[0].get("source_key", "")] = shown.get(pair[0].get("source_key", ""), 0) + 1
            pairs.append(pair)
    return pairs


def compose_pair(meta: dict[str, Any], original: bytes, counterfactual: bytes) -> Any:
    """Original | counterfactual side by side over the edited caption, with the edited span highlighted."""
    from PIL import Image, ImageDraw, ImageFont

    images = []
    for data in (original, counterfactual):
        img = Image.open(io.BytesIO(data)).convert("RGB")
        width = max(1, round(img.width * GALLERY_HEIGHT / img.height))
        images.append(img.resize((width, GALLERY_HEIGHT), Image.Resampling.BICUBIC))
    gap, pad = 8, 8
    width = images[0].width + images[1].width + gap
    font = ImageFont.load_default(size=13)
    lines = _wrap_caption(meta, font, width - 2 * pad)
    line_height = 18
    canvas = Image.new("RGB", (width, GALLERY_HEIGHT + pad * 2 + line_height * max(1, len(lines))), "white")
    canvas.paste(images[0], (0, 0))
    canvas.paste(images[1], (images[0].width + gap, 0))
    draw = ImageDraw.Draw(canvas)
    y = GALLERY_HEIGHT + pad
    for line in lines:
        x = pad
        for text, highlighted in line:
            box = draw.textbbox((x, y), text, font=font)
            if highlighted:
                draw.rectangle((box[0] - 1, y - 1, box[2] + 1, y + line_height - 3), fill=(255, 221, 87))
            draw.text((x, y), text, fill="black", font=font)
            x = box[2]
        y += line_height
    return canvas


def _caption_segments(meta: dict[str, Any]) -> list[tuple[str, bool]]:
    """The edited caption split into (text, is_edited_span) segments."""
    caption = meta.get("edited_caption") or meta.get("caption") or ""
    span = meta.get("edited_span") or ""
    index = caption.find(span) if span else -1
    if index < 0:
        return [(caption, False)]
    return [(caption[:index], False), (span, True), (caption[index + len(span) :], False)]


def _wrap_caption(meta: dict[str, Any], font: Any, max_width: int) -> list[list[tuple[str, bool]]]:
    prefix = f"[{meta.get('edit_type') or 'edit'}] "
    words: list[tuple[str, bool]] = [(prefix, False)]
    for text, highlighted in _caption_segments(meta):
        for word in re.findall(r"\S+\s*|\s+", text):
            words.append((word, highlighted))
    lines: list[list[tuple[str, bool]]] = [[]]
    width = 0.0
    for word, highlighted in words:
        word_width = font.getlength(word)
        if lines[-1] and width + word_width > max_width:
            lines.append([])
            width = 0.0
        lines[-1].append((word, highlighted))
        width += word_width
    return lines


def write_gallery(release_dir: Path, manifest: dict[str, Any], limit: int = MAX_GALLERY_PAIRS) -> list[dict[str, str]]:
    """Write ``assets/gallery-NN.png`` for original/counterfactual pairs and return their card entries."""
    assets = release_dir / ASSETS_DIR
    for stale in assets.glob(f"{GALLERY_PREFIX}*.png") if assets.exists() else []:
        stale.unlink()
    if "counterfactual" not in manifest["configs"] or "original" not in manifest["configs"]:
        return []
    pairs = select_pairs(
        _config_samples(release_dir, manifest, "original"),
        _config_samples(release_dir, manifest, "counterfactual"),
        limit,
    )
    entries = []
    for i, (meta, original, counterfactual) in enumerate(pairs):
        assets.mkdir(exist_ok=True)
        name = f"{ASSETS_DIR}/{GALLERY_PREFIX}{i:02d}.png"
        # Fixed PNG options keep the bytes reproducible, so re-rendering an unchanged release uploads nothing new.
        compose_pair(meta, original, counterfactual).save(release_dir / name, format="PNG", optimize=False)
        segments = _caption_segments(meta)
        edited_md = "".join(f"**{_md_escape(t)}**" if hl and t else _md_escape(t) for t, hl in segments)
        entries.append(
            {
                "path": name,
                "alt": f"{meta.get('edit_type')} edit of {meta.get('label_name')}",
                "edit_type": meta.get("edit_type") or "edit",
                "label_name": _md_escape(str(meta.get("label_name", ""))),
                "caption": _md_escape(meta.get("caption") or ""),
                "edited_caption_md": edited_md,
            }
        )
    return entries


def _md_escape(text: str) -> str:
    return re.sub(r"([\\`*_\[\]|<>])", r"\\\1", text)


# --------------------------------------------------------------------------------------------------------------- prose
def _template_context(
    manifest: dict[str, Any],
    results: list[dict] | None,
    previous_manifest: dict | None,
    gallery: list[dict[str, str]],
    repo_id: str | None,
) -> dict[str, Any]:
    configs = list(manifest["configs"])
    counts = manifest["counts"]
    names = manifest.get("label_space", {}).get("names") or []
    source = manifest.get("source", {})
    tool = manifest.get("tool", {})
    edit_type_columns = [*rf.EDIT_TYPES, "none"]
    labels = sorted({int(k) for c in configs for k in counts.get(c, {}).get("by_class", {})})
    failures = manifest.get("failures", [])
    failure_stages: dict[str, int] = {}
    for failure in failures:
        failure_stages[failure.get("stage", "?")] = failure_stages.get(failure.get("stage", "?"), 0) + 1
    licence_text = (
        "The source images are ImageNet-derived, so this release follows the ImageNet terms of access"
        " (non-commercial research and education only) and is gated: accept the terms on the Hub to download it."
        if source.get("imagenet_derived")
        else f"Source data terms: {str(source.get('license') or 'not stated by the source').rstrip('.')}."
    )
    return {
        "pretty_name": _pretty_name(manifest),
        "description": (manifest.get("config") or {}).get("description"),
        "name": manifest["name"],
        "version": manifest["version"],
        "repo_id": repo_id or f"ORG/{manifest['name']}",
        "tool_name": tool.get("name", "lance-counterfactuals"),
        "tool_version": tool.get("version", "unknown"),
        "config_hash": manifest.get("config_hash", "n/a"),
        "image_format": manifest.get("image_format", rf.DEFAULT_IMAGE_FORMAT),
        "configs": configs,
        "config_rows": [
            {"config": c, "description": CONFIG_DESCRIPTIONS.get(c, c), "total": counts.get(c, {}).get("total", 0)}
            for c in configs
        ],
        "edit_type_columns": edit_type_columns,
        "edit_type_rows": [
            {
                "config": c,
                "cells": [counts.get(c, {}).get("by_edit_type", {}).get(t, 0) for t in edit_type_columns],
                "total": counts.get(c, {}).get("total", 0),
            }
            for c in configs
        ],
        "class_rows": [
            {
                "label": label,
                "name": _md_escape(names[label]) if label < len(names) else str(label),
                "cells": [counts.get(c, {}).get("by_class", {}).get(str(label), 0) for c in configs],
            }
            for label in labels
        ],
        "gallery": gallery,
        "leaderboard_section": leaderboard_section(results or []),
        "stage_rows": _stage_rows(manifest),
        "thresholds": _thresholds(manifest),
        "source_spec": source.get("spec", "?"),
        "source_kind": source.get("kind", "?"),
        "source_num_samples": source.get("num_samples", "?"),
        "label_space_name": manifest.get("label_space", {}).get("name", "custom"),
        "num_classes": manifest.get("label_space", {}).get("num_classes", len(names)),
        "seed": manifest.get("seed", "?"),
        "packages": ", ".join(f"{k} {v}" for k, v in sorted(manifest.get("packages", {}).items())) or "not recorded",
        "num_failures": len(failures),
        "failure_stages": ", ".join(f"{k}: {v}" for k, v in sorted(failure_stages.items())),
        "licence_text": licence_text,
        "hard_imagenet_note": "hardimagenet" in manifest["name"].replace("-", "").replace("_", "").lower(),
        "changelog": changelog(manifest, previous_manifest) if previous_manifest is not None else None,
    }


def _stage_rows(manifest: dict[str, Any]) -> list[dict[str, str]]:
    rows = []
    for stage, desc in manifest.get("stages", {}).items():
        desc = desc if isinstance(desc, dict) else {}
        models = [f"`{v}`" for k, v in desc.items() if "model" in k and isinstance(v, str) and v]
        revisions = [f"`{v}`" for k, v in desc.items() if "revision" in k and isinstance(v, str) and v]
        rows.append({"stage": stage, "model": ", ".join(models) or "—", "revision": ", ".join(revisions) or "—"})
    return rows


def _thresholds(manifest: dict[str, Any]) -> list[dict[str, str]]:
    """Scalar constants of every stage (thresholds, steps, guidance), without model ids and revisions."""
    rows = []
    for stage, desc in manifest.get("stages", {}).items():
        for key, value in desc.items() if isinstance(desc, dict) else []:
            if "model" in key or "revision" in key or key == "target":
                continue
            if isinstance(value, (int, float, bool)) or (isinstance(value, str) and len(value) < 60):
                rows.append({"name": f"{stage}.{key}", "value": json.dumps(value)})
    seen = {row["name"] for row in rows}

    def walk(node: Any, prefix: str) -> None:
        # Thresholds set in the resolved build config, wherever they sit in it.
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        elif "threshold" in prefix and isinstance(node, (int, float)) and f"config.{prefix}" not in seen:
            rows.append({"name": f"config.{prefix}", "value": json.dumps(node)})

    walk(manifest.get("config") or {}, "")
    return rows


def _metric(value: Any, *names: str) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, dict):
        for name in names:
            if isinstance(value.get(name), (int, float)):
                return float(value[name])
    return None


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _leaderboard_configs(results: list[dict]) -> list[str]:
    present = {c for r in results if isinstance(r.get("metrics"), dict) for c in r["metrics"]}
    return [c for c in rf.CONFIG_NAMES if c in present]


def model_name(result: dict[str, Any]) -> str:
    """The model's name in a results JSON (``lance-cf eval`` writes ``model: {name, slug, ...}``; a string is accepted)."""
    model = result.get("model")
    if isinstance(model, dict):
        return str(model.get("name") or model.get("slug") or "?")
    return str(model or "?")


def weights_label(result: dict[str, Any]) -> str | None:
    """How a results JSON's weights differ from the model's pretrained ones (``None`` for pretrained or unknown).

    The same architecture evaluated with random weights or a local checkpoint must not read as the pretrained model.
    """
    model = result.get("model")
    weights = model.get("weights") if isinstance(model, dict) else None
    weights_id = str(weights.get("id") or "") if isinstance(weights, dict) else ""
    if weights_id == "random" or weights_id.startswith("random:"):
        return "random weights"
    if weights_id.startswith("checkpoint:"):
        return f"checkpoint {weights_id.rsplit(':', 1)[-1][:12]}"
    return None


def leaderboard_rows(results: list[dict]) -> list[dict[str, Any]]:
    """One row per results JSON with metrics (failed runs are left out), best counterfactual top-1 first."""
    results = [r for r in results if isinstance(r.get("metrics"), dict) and r.get("status", "ok") != "error"]
    configs = _leaderboard_configs(results)
    rows = []
    for result in results:
        metrics = result["metrics"]
        delta_source = metrics.get("counterfactual") or next(
            (m for m in metrics.values() if isinstance(m, dict) and "delta_acc1" in m), {}
        )
        by_edit = (result.get("sensitivity") or {}).get("by_edit_type") or {}
        # The most sensitive edit type: the largest paired drop in top-1 accuracy.
        scored = {t: _metric(v, "paired_delta_acc1", "delta_acc1", "acc1") for t, v in by_edit.items()}
        scored = {t: v for t, v in scored.items() if v is not None}
        worst = min(scored, key=lambda t: scored[t]) if scored else None
        release = result.get("release") or {}
        weights = weights_label(result)
        rows.append(
            {
                "model": f"`{model_name(result)}`" + (f" ({weights})" if weights else ""),
                "release": f"v{release.get('version', '?')}",
                "acc1": [_fmt(_metric(metrics.get(c), "acc1")) for c in configs],
                "delta_acc1": _fmt(_metric(delta_source, "delta_acc1")),
                "delta_acc5": _fmt(_metric(delta_source, "delta_acc5")),
                "worst_edit": f"{worst} ({_fmt(scored[worst])})" if worst else "—",
                "_sort": _metric(metrics.get("counterfactual"), "acc1") or 0.0,
            }
        )
    rows.sort(key=lambda r: (-r["_sort"], r["model"]))
    return rows


def leaderboard_markdown(results: list[dict]) -> str:
    """The leaderboard table (Markdown) for evaluation results JSONs; empty string when there are none."""
    if not leaderboard_rows(results):
        return ""
    configs = _leaderboard_configs(results)
    header = ["model", "release", *(f"{c} acc@1" for c in configs), "Δ acc@1", "Δ acc@5", "most sensitive edit"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in leaderboard_rows(results):
        cells = [row["model"], row["release"], *row["acc1"], row["delta_acc1"], row["delta_acc5"], row["worst_edit"]]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Δ is counterfactual minus original accuracy; lower means more sensitive to the edits."]
    return "\n".join(lines) + "\n"


LEADERBOARD_HEADING = "## Leaderboard\n"
LEADERBOARD_ANCHOR = "## How it was built\n"


def leaderboard_section(results: list[dict]) -> str:
    """The card's ``## Leaderboard`` section (heading, table, trailing blank line), or ``""`` without results."""
    table = leaderboard_markdown(results)
    return f"{LEADERBOARD_HEADING}\n{table}\n" if table else ""


def replace_leaderboard_section(card_text: str, results: list[dict]) -> str:
    """Refresh the leaderboard of an already rendered card (no shards needed), keeping everything else."""
    section = leaderboard_section(results)
    start = card_text.find("\n" + LEADERBOARD_HEADING)
    if start >= 0:
        start += 1
        end = card_text.find("\n## ", start + len(LEADERBOARD_HEADING))
        end = len(card_text) if end < 0 else end + 1
        return card_text[:start] + section + card_text[end:]
    anchor = card_text.find("\n" + LEADERBOARD_ANCHOR)
    if anchor < 0:
        return card_text.rstrip("\n") + "\n\n" + section
    return card_text[: anchor + 1] + section + card_text[anchor + 1 :]


def changelog(manifest: dict[str, Any], previous: dict[str, Any]) -> dict[str, Any]:
    """Counts gained and lost per config, edit type and class against the previous release."""
    new_names = manifest.get("label_space", {}).get("names") or []
    old_names = previous.get("label_space", {}).get("names") or []
    # With one label space (ImageNet-1k) classes are matched by index, since names repeat there ("crane"). When the
    # label spaces differ they are matched by name: an imagefolder source indexes its classes by the folders present,
    # so label 1 can be "dog" in one version and "zebra" in the next.
    by_name = bool(new_names and old_names and new_names != old_names)
    new_index = {name: i for i, name in enumerate(new_names)}
    old_index = {name: i for i, name in enumerate(old_names)}

    def class_key(label: str, names: list[str]) -> str:
        return names[int(label)] if by_name and label.isdigit() and int(label) < len(names) else label

    def class_value(key: str) -> str:
        if not by_name:
            return f"{_md_escape(new_names[int(key)])} ({key})" if key.isdigit() and int(key) < len(new_names) else key
        if key in new_index:
            return f"{_md_escape(key)} ({new_index[key]})"
        return f"{_md_escape(key)} ({old_index[key]} in v{previous.get('version', '?')})" if key in old_index else key

    def class_order(key: str) -> tuple[int, str]:
        if not by_name:
            return (int(key), key) if key.isdigit() else (1 << 30, key)
        return (new_index.get(key, len(new_names) + old_index.get(key, 0)), key)

    rows = []
    for config in [c for c in rf.CONFIG_NAMES if c in set(manifest["counts"]) | set(previous.get("counts", {}))]:
        new = manifest["counts"].get(config, {})
        old = previous.get("counts", {}).get(config, {})
        new_classes = {class_key(k, new_names): v for k, v in new.get("by_class", {}).items()}
        old_classes = {class_key(k, old_names): v for k, v in old.get("by_class", {}).items()}
        groups = [
            ("total", {"all": new.get("total", 0)}, {"all": old.get("total", 0)}, lambda k: (len(k), k)),
            ("edit type", new.get("by_edit_type", {}), old.get("by_edit_type", {}), lambda k: (len(k), k)),
            ("class", new_classes, old_classes, class_order),
        ]
        for group, after_counts, before_counts, order in groups:
            for key in sorted(set(after_counts) | set(before_counts), key=order):
                before, after = before_counts.get(key, 0), after_counts.get(key, 0)
                if before == after:
                    continue
                rows.append(
                    {
                        "config": config,
                        "group": group,
                        "value": class_value(key) if group == "class" else key,
                        "before": before,
                        "after": after,
                        "delta": f"{after - before:+d}",
                    }
                )
    return {"previous_version": previous.get("version", "?"), "rows": rows}
