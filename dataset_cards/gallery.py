"""The card's gallery: original | counterfactual pairs with the edited caption, as PNG files under ``assets/``."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

from builder import release_format as rf
from dataset_cards.markdown import Markdown, md_escape
from lance_pipeline.readers import load_json

GALLERY_PREFIX = "gallery-"
MAX_GALLERY_PAIRS = 6
GALLERY_HEIGHT = 224


def read_shard_samples(path: Path) -> dict[str, dict[str, bytes]]:
    """All samples of a WebDataset shard: key -> {extension: bytes} (read by the release format's reader)."""
    return rf.read_samples([Path(path)])


def select_pairs(
    originals: dict[str, dict[str, bytes]],
    counterfactuals: dict[str, dict[str, bytes]],
    limit: int,
    edit_types: tuple[str, ...] = rf.V1_EDIT_TYPES,
) -> list[tuple[dict[str, Any], bytes, bytes]]:
    """Pick up to ``limit`` (metadata, original image, counterfactual image) pairs, one edit type at a time."""
    by_type: dict[str, list[tuple[dict[str, Any], bytes, bytes]]] = {}
    for key in sorted(counterfactuals):
        members = counterfactuals[key]
        meta = load_json(members.get(rf.METADATA_EXT, b"{}"), f"{key}.json")
        source = originals.get(meta.get("source_key", ""))
        cf_image = next((members[e] for e in rf.IMAGE_FORMATS if e in members), None)
        orig_image = next((source[e] for e in rf.IMAGE_FORMATS if e in source), None) if source else None
        if cf_image is None or orig_image is None:
            continue
        by_type.setdefault(meta.get("edit_type") or "none", []).append((meta, orig_image, cf_image))
    ordered = [t for t in (*edit_types, "none") if t in by_type] + sorted(
        t for t in by_type if t not in (*edit_types, "none")
    )
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


def write_gallery(
    release_dir: Path,
    configs: list[str],
    shards: list[dict[str, Any]],
    limit: int = MAX_GALLERY_PAIRS,
    *,
    output_dir: Path | None = None,
    edit_types: tuple[str, ...] = rf.V1_EDIT_TYPES,
) -> list[dict[str, str]]:
    """Write ``assets/gallery-NN.png`` for original/counterfactual pairs and return their card entries.

    Shards (the manifest's shard list) are read from ``release_dir``; the PNGs go to ``output_dir`` (default
    ``release_dir``). The bytes depend only on the shards, so the builder records their hashes in the manifest and a
    re-render (publish) writes the same files.
    """
    output_dir = Path(output_dir) if output_dir is not None else Path(release_dir)
    assets = output_dir / rf.ASSETS_DIR
    for stale in assets.glob(f"{GALLERY_PREFIX}*.png") if assets.exists() else []:
        stale.unlink()
    if "counterfactual" not in configs or "original" not in configs:
        return []

    def samples(config: str) -> dict[str, dict[str, bytes]]:
        return rf.read_samples(Path(release_dir) / s["path"] for s in shards if s["config"] == config)

    pairs = select_pairs(samples("original"), samples("counterfactual"), limit, edit_types)
    entries = []
    for i, (meta, original, counterfactual) in enumerate(pairs):
        assets.mkdir(parents=True, exist_ok=True)
        name = f"{rf.ASSETS_DIR}/{GALLERY_PREFIX}{i:02d}.png"
        # Fixed PNG options keep the bytes reproducible, so re-rendering an unchanged release uploads nothing new.
        compose_pair(meta, original, counterfactual).save(output_dir / name, format="PNG", optimize=False)
        segments = _caption_segments(meta)
        edited_md = Markdown("".join(f"**{md_escape(t)}**" if hl and t.strip() else md_escape(t) for t, hl in segments))
        entries.append(
            {
                "path": Markdown(name),  # the gallery's own file name
                "alt": md_escape(f"{meta.get('edit_type') or 'edit'} edit of {meta.get('label_name')}"),
                "edit_type": md_escape(meta.get("edit_type") or "edit"),
                "label_name": md_escape(meta.get("label_name", "")),
                "caption": md_escape(meta.get("caption") or ""),
                "edited_caption_md": edited_md,
            }
        )
    return entries
