"""Editors side by side: how far each editor's counterfactuals stray from the source image, and what they cost models.

Two releases built from the same source images with two editors (LANCE's prompt-to-prompt, ``hardimagenet``, and
DILLEMA's ControlNet regeneration, ``hardimagenet-controlnet``) differ in how much of the image the edit disturbs.
Per counterfactual, against its source image (the ``original`` config, same ``source_key``):

* ``clip_image``: cosine similarity of the CLIP image embeddings (the quantity of LANCE's image gate, but always
  against the source photo: the prompt-to-prompt gate compares against the reconstruction, the ControlNet gate
  against the photo, so the recorded gate scores are not comparable across editors);
* ``edge_ssim``: SSIM (Wang, Bovik, Sheikh, Simoncelli, IEEE TIP 2004; Gaussian window sigma 1.5, K1 0.01,
  K2 0.03) between the Canny edge maps (OpenCV, thresholds 100/200) of the two images: does the structure survive?
  No learned metric (LPIPS) is needed;
* ``background_psnr``: PSNR over the pixels outside the object mask, where a mask is known (``--masks DIR`` with
  ``SOURCE_KEY.png``, non-zero = object, e.g. Hard ImageNet's segmentations): does the edit leave the rest alone?

Per (editor, edit type) the table joins these means with the accuracy drop that ``lance-cf eval`` measured on the
same release (``paired_delta_acc1`` and ``flip_rate`` of ``sensitivity.by_edit_type`` in each model's
``results.json``), and one plot shows them side by side. The editor of a sample is its metadata's ``editor`` field
where the release has one, else the type of the stage that wrote the config (``prompt_to_prompt_edit`` ->
``prompt_to_prompt``, ``controlnet_edit`` -> ``controlnet``).

``lance-cf compare-editors --release A --release B [--results EVAL_DIR ...] --output DIR`` writes ``fidelity.csv``,
``fidelity.md``, ``fidelity.png`` and ``fidelity_samples.csv``.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import math
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

EDITOR_OF_STAGE_TYPE = {
    "prompt_to_prompt_edit": "prompt_to_prompt",
    "controlnet_edit": "controlnet",
}
SSIM_SIGMA = 1.5
SSIM_K1, SSIM_K2 = 0.01, 0.03
CANNY_THRESHOLDS = (100, 200)
FIDELITY_COLUMNS = ("clip_image", "edge_ssim", "background_psnr")
ACCURACY_COLUMNS = ("paired_delta_acc1", "flip_rate")


# ---------------------------------------------------------------------------------------------- measures


def ssim(x, y, data_range: float = 255.0, sigma: float = SSIM_SIGMA) -> float:
    """Mean SSIM of two greyscale images (2-D arrays of the same shape), Gaussian-weighted as Wang et al. 2004.

    ``scipy.ndimage.gaussian_filter`` (truncated at 3.5 sigma, i.e. the paper's 11x11 window at sigma 1.5, with
    reflected borders) gives the local means, variances and covariance; SSIM = ((2 mu_x mu_y + C1)(2 s_xy + C2)) /
    ((mu_x^2 + mu_y^2 + C1)(s_x^2 + s_y^2 + C2)) with C1 = (0.01 L)^2, C2 = (0.03 L)^2, averaged over the image.
    """
    import numpy as np
    from scipy.ndimage import gaussian_filter

    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 2:
        raise ValueError(f"ssim needs two 2-D arrays of one shape, got {x.shape} and {y.shape}")
    c1, c2 = (SSIM_K1 * data_range) ** 2, (SSIM_K2 * data_range) ** 2

    def blur(a):
        return gaussian_filter(a, sigma=sigma, truncate=3.5, mode="reflect")

    mu_x, mu_y = blur(x), blur(y)
    var_x = blur(x * x) - mu_x**2
    var_y = blur(y * y) - mu_y**2
    cov = blur(x * y) - mu_x * mu_y
    numerator = (2 * mu_x * mu_y + c1) * (2 * cov + c2)
    denominator = (mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2)
    return float((numerator / denominator).mean())


def canny_edges(image, size: tuple[int, int] | None = None):
    """The Canny edge map (uint8, 0 or 255) of a PIL image, optionally resized first (bicubic)."""
    import cv2
    import numpy as np

    image = image.convert("RGB")
    if size is not None and image.size != size:
        image = image.resize(size, resample=3)
    return cv2.Canny(np.ascontiguousarray(np.asarray(image, dtype=np.uint8)), *CANNY_THRESHOLDS)


def edge_ssim(original, edited) -> float:
    """SSIM between the Canny edge maps of two PIL images (the edited one resized to the original's size)."""
    return ssim(canny_edges(original), canny_edges(edited, original.size))


def background_psnr(original, edited, mask) -> float | None:
    """PSNR (dB, peak 255) over the pixels where ``mask`` is zero; None when there is no background pixel.

    Args:
        original, edited: PIL images (the edited one is resized to the original's size).
        mask: 2-D array the size of ``original`` (height x width); non-zero marks the object.
    """
    import numpy as np

    a = np.asarray(original.convert("RGB"), dtype=np.float64)
    b = np.asarray(edited.convert("RGB").resize(original.size, resample=3), dtype=np.float64)
    mask = np.asarray(mask)
    if mask.shape != a.shape[:2]:
        raise ValueError(f"mask is {mask.shape}, the image is {a.shape[:2]} (height, width)")
    background = mask == 0
    if not background.any():
        return None
    mse = float(((a - b) ** 2)[background].mean())
    return math.inf if mse == 0 else 10.0 * math.log10(255.0**2 / mse)


# ---------------------------------------------------------------------------------------------- one release


def _editor_of_release(manifest: dict[str, Any]) -> str | None:
    for stage in (manifest.get("stages") or {}).values():
        editor = EDITOR_OF_STAGE_TYPE.get(stage.get("type"))
        if editor is not None:
            return editor
    return None


def _load_mask(masks_dir: Path | None, source_key: str, size: tuple[int, int]):
    if masks_dir is None:
        return None
    path = masks_dir / f"{source_key}.png"
    if not path.is_file():
        return None
    import numpy as np
    from PIL import Image

    with Image.open(path) as mask:
        return np.asarray(mask.convert("L").resize(size, resample=0))


def release_fidelity(release, *, clip=None, masks_dir: Path | None = None) -> list[dict[str, Any]]:
    """One row per counterfactual of ``release`` (an ``evaluation.release_reader.Release``).

    Args:
        release: The opened release.
        clip: A loaded ``lance_pipeline.clip_gates.ClipScorer`` for ``clip_image`` (None: the column is None).
        masks_dir: Folder of ``SOURCE_KEY.png`` object masks for ``background_psnr`` (None: the column is None).

    Returns:
        Rows with ``release``, ``editor``, ``source_key``, ``key``, ``edit_type`` and the three measures.
    """
    ext = release.image_ext
    if "counterfactual" not in release.shards or "original" not in release.shards:
        raise ValueError(f"release {release.name}: comparing editors needs its original and counterfactual configs")
    edited = _decode(release, "counterfactual", ext)
    sources = {meta["source_key"] for meta, _ in edited.values()}
    originals = {k: v for k, v in _decode(release, "original", ext, keys=sources).items()}
    default_editor = _editor_of_release(release.manifest)
    rows, pairs = [], []
    for key in sorted(edited):
        meta, image = edited[key]
        source = originals.get(meta["source_key"])
        if source is None:
            logger.warning("%s: %s has no original %s; left out", release.name, key, meta["source_key"])
            continue
        original = source[1]
        mask = _load_mask(masks_dir, meta["source_key"], original.size)
        rows.append(
            {
                "release": release.name,
                "editor": meta.get("editor") or default_editor or "unknown",
                "source_key": meta["source_key"],
                "key": key,
                "edit_type": meta.get("edit_type") or "none",
                "clip_image": None,
                "edge_ssim": edge_ssim(original, image),
                "background_psnr": None if mask is None else background_psnr(original, image, mask),
            }
        )
        pairs.append((original, image))
    if clip is not None and pairs:
        import torch

        a = clip.encode_images([p[0] for p in pairs])
        b = clip.encode_images([p[1] for p in pairs])
        for row, value in zip(rows, torch.nn.functional.cosine_similarity(a, b, dim=-1).tolist(), strict=True):
            row["clip_image"] = float(value)
    return rows


def _decode(release, config: str, ext: str, keys: set[str] | None = None) -> dict[str, tuple[dict, Any]]:
    from PIL import Image

    from evaluation.release_reader import read_samples

    out = {}
    for key, members in read_samples(release, config, keys).items():
        with Image.open(io.BytesIO(members[ext])) as image:
            out[key] = (json.loads(members["json"]), image.convert("RGB"))
    return out


# ---------------------------------------------------------------------------------------------- side by side


def _mean(values: list[float | None]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def load_results(paths: list[Path]) -> list[dict[str, Any]]:
    """Every ok ``results.json`` under the given eval output directories (or the files themselves)."""
    found = []
    for path in paths:
        files = [path] if path.is_file() else sorted(Path(path).rglob("results.json"))
        if not files:
            raise ValueError(f"--results {path}: no results.json found (run `lance-cf eval` first)")
        for file in files:
            data = json.loads(file.read_text())
            if data.get("status", "ok") == "ok" and data.get("sensitivity"):
                found.append(data)
    return found


def fidelity_table(rows: list[dict[str, Any]], results: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Per (editor, release, edit type, model): counts, fidelity means and the model's accuracy drop.

    ``results`` are eval results; those of a release (matched by its name and manifest digest, through
    ``release_digests``) contribute one row per model and edit type. Without results, one row per edit type with the
    accuracy columns empty.
    """
    by_group: dict[tuple[str, str, str], list[dict]] = {}
    for row in rows:
        by_group.setdefault((row["editor"], row["release"], row["edit_type"]), []).append(row)
        by_group.setdefault((row["editor"], row["release"], "all"), []).append(row)
    table = []
    for (editor, release, edit_type), group in sorted(
        by_group.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] == "all", kv[0][2])
    ):
        base = {
            "editor": editor,
            "release": release,
            "edit_type": edit_type,
            "n": len(group),
            **{column: _mean([r[column] for r in group]) for column in FIDELITY_COLUMNS},
        }
        matching = [r for r in results or [] if r.get("release", {}).get("name") == release]
        if not matching:
            table.append({**base, "model": None, **dict.fromkeys(ACCURACY_COLUMNS)})
            continue
        for result in matching:
            sensitivity = result["sensitivity"]
            stats = sensitivity.get("overall") if edit_type == "all" else sensitivity["by_edit_type"].get(edit_type)
            stats = stats or {}
            table.append(
                {**base, "model": result.get("model", {}).get("name"), **{c: stats.get(c) for c in ACCURACY_COLUMNS}}
            )
    return table


def table_markdown(table: list[dict[str, Any]]) -> str:
    columns = ["editor", "edit_type", "model", "n", *ACCURACY_COLUMNS, *FIDELITY_COLUMNS]
    header = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"

    def cell(value: Any) -> str:
        if value is None:
            return "–"
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
        return str(value)

    return header + "".join("| " + " | ".join(cell(row.get(c)) for c in columns) + " |\n" for row in table)


def plot_fidelity(table: list[dict[str, Any]], path: Path) -> Path:
    """One figure: per edit type, a bar per editor for each of the accuracy drop, CLIP image similarity, edge SSIM."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("paired_delta_acc1", "Δ acc@1 (pp, paired)"),
        ("clip_image", "CLIP image similarity"),
        ("edge_ssim", "SSIM of Canny edges"),
    ]
    editors = sorted({r["editor"] for r in table})
    edit_types = sorted({r["edit_type"] for r in table}, key=lambda t: (t == "all", t))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    width = 0.8 / max(len(editors), 1)
    for ax, (column, title) in zip(axes[0], panels, strict=True):
        for i, editor in enumerate(editors):
            values = []
            for edit_type in edit_types:
                cells = [r[column] for r in table if r["editor"] == editor and r["edit_type"] == edit_type]
                values.append(_mean(cells) or 0.0)
            ax.bar([x + i * width for x in range(len(edit_types))], values, width, label=editor)
        ax.set_xticks([x + width * (len(editors) - 1) / 2 for x in range(len(edit_types))], edit_types, rotation=30)
        ax.set_title(title)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def compare_editors(
    release_specs: list[str],
    output: Path,
    *,
    results_paths: list[Path] | None = None,
    clip=None,
    masks_dir: Path | None = None,
) -> list[dict[str, Any]]:
    """The side-by-side table of several releases of the same source images; writes it (CSV, Markdown, plot).

    Returns:
        The table rows (see :func:`fidelity_table`).
    """
    import csv

    from evaluation.release_reader import open_release

    if len(release_specs) < 2:
        raise ValueError("compare-editors needs at least two --release (the same source images, two editors)")
    releases = [open_release(spec) for spec in release_specs]
    names = [r.name for r in releases]
    if len(set(names)) != len(names):
        raise ValueError(f"the releases must have distinct names to be told apart, got {names}")
    rows = []
    source_sets = []
    for release in releases:
        release_rows = release_fidelity(release, clip=clip, masks_dir=masks_dir)
        rows += release_rows
        source_sets.append({r["source_key"] for r in release_rows})
    common = set.intersection(*source_sets) if source_sets else set()
    if not common:
        raise ValueError(f"releases {names} share no source image with a counterfactual: nothing to compare")
    results = load_results(results_paths or [])
    table = fidelity_table(rows, results)
    output.mkdir(parents=True, exist_ok=True)
    for name, data in (("fidelity.csv", table), ("fidelity_samples.csv", rows)):
        with open(output / name, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(data[0]))
            writer.writeheader()
            writer.writerows(data)
    (output / "fidelity.md").write_text(
        f"Source images with counterfactuals in every release: {len(common)}\n\n" + table_markdown(table)
    )
    plot_fidelity(table, output / "fidelity.png")
    return table


# ---------------------------------------------------------------------------------------------- CLI


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``compare-editors`` subcommand."""
    p = subparsers.add_parser(
        "compare-editors",
        help="side by side: image fidelity and accuracy drop of two editors' releases",
        description=(
            "Compare releases of the same source images made with different editors (prompt-to-prompt, ControlNet): "
            "per editor and edit type, CLIP image similarity to the source, SSIM of Canny edges, background PSNR "
            "(with --masks) and, from `lance-cf eval` outputs (--results), the paired accuracy drop and flip rate. "
            "Writes fidelity.csv, fidelity.md, fidelity.png and fidelity_samples.csv."
        ),
    )
    p.add_argument("--release", action="append", required=True, help="release directory or Hub id (twice or more)")
    p.add_argument("--results", action="append", type=Path, default=[], help="`lance-cf eval` output dir (repeat)")
    p.add_argument("--output", required=True, type=Path, help="output directory")
    p.add_argument("--masks", type=Path, help="folder of SOURCE_KEY.png object masks (non-zero = object)")
    p.add_argument("--clip-model", default="ViT-L-14", help="open_clip model for the CLIP image similarity")
    p.add_argument("--clip-pretrained", default="openai", help="its pretrained tag (None for a directory)")
    p.add_argument("--no-clip", action="store_true", help="skip the CLIP image similarity (no model is loaded)")
    p.add_argument("--device", default="cpu", help="device of the CLIP model")
    p.set_defaults(func=run_compare_editors)


def run_compare_editors(args: argparse.Namespace) -> int:
    clip = None
    if not args.no_clip:
        from lance_pipeline.clip_gates import ClipScorer

        pretrained = None if str(args.clip_pretrained).lower() == "none" else args.clip_pretrained
        clip = ClipScorer(model=args.clip_model, pretrained=pretrained)
        clip.load(args.device)
    if args.masks is not None and not args.masks.is_dir():
        raise ValueError(f"--masks {args.masks}: not a directory")
    table = compare_editors(args.release, args.output, results_paths=args.results, clip=clip, masks_dir=args.masks)
    print(table_markdown(table))
    print(f"wrote {args.output}/fidelity.csv, fidelity.md, fidelity.png")
    return 0
