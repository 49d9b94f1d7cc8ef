"""Editors side by side: how far each editor's counterfactuals stray from the source image, and what they cost models.

Two releases built from the same source images with two editors (LANCE's prompt-to-prompt, ``hardimagenet``, and
DILLEMA's ControlNet regeneration, ``hardimagenet-controlnet``) differ in how much of the image the edit disturbs.
Per counterfactual, against its source image (the ``original`` config, same ``source_key``):

* ``clip_image``: cosine similarity of the CLIP image embeddings (the quantity of LANCE's image gate, but always
  against the source photo: the prompt-to-prompt gate compares against the reconstruction, the ControlNet gate
  against the photo, so the recorded gate scores are not comparable across editors);
* ``edge_ssim``: SSIM (Wang, Bovik, Sheikh, Simoncelli, IEEE TIP 2004; Gaussian window sigma 1.5, K1 0.01,
  K2 0.03) between the Canny edge maps (OpenCV, thresholds 100/200) of the two images: does the structure survive?
  structure only;
* ``background_psnr``: PSNR over the pixels outside the object mask, where a mask is known (``--masks DIR`` with
  ``SOURCE_KEY.png``, non-zero = object, e.g. Hard ImageNet's segmentations): does the edit leave the rest alone?
* ``lpips``, ``psnr``, ``ssim`` and their ``_outside`` forms: preservation of the source image
  (``lance_pipeline.preservation``), from each counterfactual's metadata where the build measured it, else PSNR and
  SSIM computed here (LPIPS empty).

Per (editor, edit type) of each release, from its manifest: ``gate_kept`` (edits kept by the gates over edits given
to the editor), ``forward_equivalents_per_kept`` and ``tflops_per_kept`` (the cost its edit stage counted, per kept
edit; :func:`editing_accounting`) and ``label_kept`` (the judge's ``judge_class_p`` at the release's calibrated
threshold, or ``not judged`` / ``not calibrated``: never a number that was not measured).

Per (editor, edit type, model) the table joins these means with the accuracy drop that ``lance-cf eval`` measured on
the same release (``paired_delta_acc1`` and ``flip_rate`` of ``sensitivity.by_edit_type`` in each model's results),
and one plot shows them side by side. The editor of a sample is its metadata's ``editor`` field where the release has
one, else the editor its stages recorded (``editor`` in their descriptions), else the editor its release kind declares
(``ReleaseKind.editor``, ``lance_pipeline.release_kinds``).

This module owns the side-by-side (:func:`side_by_side`). ``lance-cf eval --release A --release B ...`` evaluates
each release and then calls it with the fresh results (``OUTPUT/side_by_side/``); ``lance-cf compare-editors
--release A --release B [--results EVAL_DIR ...] --output DIR`` is the same table without evaluating a model (from
earlier eval outputs, or fidelity only). Both write ``fidelity.md``, ``fidelity.csv``, ``fidelity.json``,
``fidelity.png``, ``fidelity.html`` and ``fidelity_samples.csv``.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import math
from pathlib import Path
from typing import Any

from builder import release_format as rf
from builder.release_format.lock import declare_output
from builder.release_format.text_out import md_escape, write_csv
from evaluation.pages import render_page
from evaluation.plots import _figure, _plain, _pyplot
from evaluation.release_reader import open_release
from evaluation.results import model_label
from lance_pipeline import preservation as pv
from lance_pipeline.clip.gates import ClipScorer
from lance_pipeline.models.needs import clip_need
from lance_pipeline.readers import load_json, read_json
from lance_pipeline.release_kinds import editors_of, kind_of_manifest

logger = logging.getLogger(__name__)

SSIM_SIGMA = 1.5
SSIM_K1, SSIM_K2 = 0.01, 0.03
CANNY_THRESHOLDS = (100, 200)
FIDELITY_COLUMNS = ("clip_image", "edge_ssim", "background_psnr")
ACCURACY_COLUMNS = ("paired_delta_acc1", "flip_rate")
# Preservation of the source image (lance_pipeline.preservation): the sample's metadata where the build measured it.
PRESERVATION_COLUMNS = ("lpips", "psnr", "ssim", "lpips_outside", "psnr_outside", "ssim_outside")
# Per (editor, edit type) of a release: edits kept by the gates, kept by the calibrated judge, cost per kept edit.
EDITING_COLUMNS = ("gate_kept", "label_kept", "forward_equivalents_per_kept", "tflops_per_kept")
JUDGE_CLASS_FIELD = "judge_class_p"  # lance_pipeline.screening.judge's declared field
JUDGE_CALIBRATION = "judge_calibration"  # the manifest record of `lance-cf review calibrate` (its `threshold`)
# What the columns mean: under fidelity.md's table and the card's (dataset_cards.editors_section).
COLUMN_NOTE = (
    "paired_delta_acc1: counterfactual minus original top-1, points (negative = the edits cost accuracy); clip_image, "
    "edge_ssim, background_psnr: counterfactual against its source image. gate_kept: share of the rendered edits that "
    "the release's gates kept (counted by its edit stage); label_kept: share of the judged counterfactuals the judge "
    "keeps at the release's calibrated threshold (judge_class_p >= threshold; 'not judged' / 'not calibrated' where "
    "it has no scores / no calibration); forward_equivalents_per_kept, tflops_per_kept: what the editing cost (every "
    "network forward of the editor and its gates, null-text inversion included where the editor needs one, and the "
    "render's FLOPs, counted by hooks at build time) per kept edit; lpips, psnr, ssim and their _outside forms: "
    "preservation of the source image (each counterfactual's metadata where the build measured it; else PSNR and SSIM "
    "computed here and LPIPS empty)."
)


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
    """The editor the release's stages recorded (the first by name when several did), else its kind's."""
    recorded = sorted(editors_of(manifest))
    return recorded[0] if recorded else kind_of_manifest(manifest).editor


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


def counterfactual_metadata(release) -> dict[str, dict[str, Any]]:
    """``key -> metadata`` of every counterfactual, from the shards' ``.json`` members only (read by the release
    format's reader, which skips the images' bytes). A sample that cannot be read or whose metadata is not valid JSON
    is left out (eval records it as a failure)."""
    out: dict[str, dict[str, Any]] = {}
    for shard in release.shards.get("counterfactual", []):
        for key, sample in rf.iter_shard(shard, wanted={rf.METADATA_EXT}, errors="sample"):
            if not isinstance(sample, dict) or rf.METADATA_EXT not in sample:
                continue
            try:
                meta = load_json(sample[rf.METADATA_EXT], f"{key}.json")
            except ValueError:
                continue
            if isinstance(meta, dict) and meta.get("source_key"):
                out[key] = meta
    return out


def release_fidelity(
    release, *, clip=None, masks_dir: Path | None = None, label: str | None = None, chunk_sources: int = 64
) -> list[dict[str, Any]]:
    """One row per counterfactual of ``release`` (an ``evaluation.release_reader.Release``), sorted by key.

    Images are read ``chunk_sources`` source images at a time (their originals and counterfactuals), so memory does
    not grow with the release.

    Args:
        release: The opened release.
        clip: A loaded ``lance_pipeline.clip.gates.ClipScorer`` for ``clip_image`` (None: the column is None).
        masks_dir: Folder of ``SOURCE_KEY.png`` object masks for ``background_psnr`` (None: the column is None).
        label: The ``release`` column (default: the release's name).

    Returns:
        Rows with ``release``, ``editor``, ``source_key``, ``key``, ``edit_type`` and the three measures.
    """
    ext = release.image_ext
    if "counterfactual" not in release.shards or "original" not in release.shards:
        raise ValueError(f"release {release.name}: comparing editors needs its original and counterfactual configs")
    metadata = counterfactual_metadata(release)
    by_source: dict[str, list[str]] = {}
    for key in sorted(metadata):
        by_source.setdefault(metadata[key]["source_key"], []).append(key)
    sources = sorted(by_source)
    default_editor = _editor_of_release(release.manifest)
    rows = []
    for start in range(0, len(sources), chunk_sources):
        chunk = sources[start : start + chunk_sources]
        originals = _decode(release, "original", ext, keys=set(chunk))
        edited = _decode(release, "counterfactual", ext, keys={k for s in chunk for k in by_source[s]})
        chunk_rows, pairs = [], []
        for key in sorted(edited):
            meta, image = edited[key]
            source = originals.get(meta["source_key"])
            if source is None:
                logger.warning("%s: %s has no original %s; left out", release.name, key, meta["source_key"])
                continue
            original = source[1]
            mask = _load_mask(masks_dir, meta["source_key"], original.size)
            chunk_rows.append(
                {
                    "release": label or release.name,
                    "editor": meta.get("editor") or default_editor or "unknown",
                    "source_key": meta["source_key"],
                    "key": key,
                    "edit_type": meta.get("edit_type") or "none",
                    "clip_image": None,
                    "edge_ssim": edge_ssim(original, image),
                    "background_psnr": None if mask is None else background_psnr(original, image, mask),
                    **preservation_of(meta, original, image, mask),
                    JUDGE_CLASS_FIELD: _number_or_none(meta.get(JUDGE_CLASS_FIELD)),
                }
            )
            pairs.append((original, image))
        if clip is not None and pairs:
            import torch

            a = clip.encode_images([p[0] for p in pairs])
            b = clip.encode_images([p[1] for p in pairs])
            similarities = torch.nn.functional.cosine_similarity(a, b, dim=-1).tolist()
            for row, value in zip(chunk_rows, similarities, strict=True):
                row["clip_image"] = float(value)
        rows += chunk_rows
    return sorted(rows, key=lambda r: r["key"])


def _number_or_none(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def preservation_of(meta: dict[str, Any], original, edited, mask) -> dict[str, Any]:
    """The preservation columns of one counterfactual: its metadata's ``preservation_*`` fields where the build
    measured them (``lance_pipeline.preservation``, LPIPS included), else PSNR and SSIM computed here with the same
    functions (LPIPS then stays empty: it needs the backbone the build loaded). Outside the object: the metadata's
    where the build had masks, else computed here from ``mask`` (PSNR and SSIM)."""
    out: dict[str, Any] = {}
    measured = _number_or_none(meta.get("preservation_ssim")) is not None
    for measure in pv.MEASURES:
        out[measure] = _number_or_none(meta.get(pv.field_name(measure, False))) if measured else None
    if not measured:
        out["psnr"], out["ssim"] = pv.psnr(original, edited), pv.ssim(original, edited)
    measured_outside = _number_or_none(meta.get(pv.field_name("ssim", True))) is not None
    for measure in pv.MEASURES:
        out[f"{measure}_outside"] = (
            _number_or_none(meta.get(pv.field_name(measure, True))) if measured_outside else None
        )
    if not measured_outside and mask is not None:
        out["psnr_outside"], out["ssim_outside"] = pv.psnr(original, edited, mask), pv.ssim(original, edited, mask)
    out["preservation_from"] = "metadata" if measured else "computed"
    return out


def editing_accounting(manifest: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """``editor -> edit type -> {edits, edits_kept, forward_equivalents, flops}`` from the manifest's
    preservation record (``screening``, kind ``preservation``: what the edit stages counted, by hooks, per record),
    summed over the release's preservation stages; empty for a release built without one."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for entry in (manifest.get("screening") or {}).values():
        if not isinstance(entry, dict) or entry.get("kind") != "preservation":
            continue
        for editor, by_type in (entry.get("by_editor") or {}).items():
            for edit_type, stats in (by_type or {}).items():
                if not isinstance(stats, dict) or stats.get("edits") is None:
                    continue
                slot = out.setdefault(editor, {}).setdefault(edit_type, dict.fromkeys(pv.ACCOUNTING_KEYS, 0))
                for name in pv.ACCOUNTING_KEYS:
                    value = stats.get(name)
                    # a cost not counted for every record (None) stays unknown
                    slot[name] = None if value is None or slot[name] is None else slot[name] + value
    return out


def judge_threshold(manifest: dict[str, Any]) -> float | None:
    """The judge's calibrated threshold (``lance-cf review calibrate``), or None (not calibrated)."""
    record = manifest.get(JUDGE_CALIBRATION)
    return _number_or_none(record.get("threshold")) if isinstance(record, dict) else None


def label_kept(scores: list[float | None], threshold: float | None) -> float | str:
    """Share of the judged samples the calibrated judge keeps (``judge_class_p >= threshold``, as calibrate decides),
    or why there is no number: ``not judged`` (no sample scored), ``not calibrated`` (no threshold)."""
    judged = [s for s in scores if s is not None]
    if not judged:
        return "not judged"
    if threshold is None:
        return "not calibrated"
    return sum(s >= threshold for s in judged) / len(judged)


def _decode(release, config: str, ext: str, keys: set[str] | None = None) -> dict[str, tuple[dict, Any]]:
    from PIL import Image

    out = {}
    for key, members in rf.read_samples(release.shards.get(config, []), keys).items():
        if ext not in members or "json" not in members:
            logger.warning("%s: %s/%s has no .%s or .json member; left out", release.name, config, key, ext)
            continue
        with Image.open(io.BytesIO(members[ext])) as image:
            out[key] = (load_json(members["json"], f"{config}/{key}.json"), image.convert("RGB"))
    return out


# ---------------------------------------------------------------------------------------------- side by side


def release_labels(releases: list[Any]) -> list[str]:
    """How each release is named in the table and in ``lance-cf eval``'s output folders: its name, or, when two
    releases share a name, ``<name>-v<version>-<manifest hash prefix>`` (as ``leaderboard --split-releases``)."""
    names = [r.name for r in releases]
    labels = []
    for release in releases:
        raw = release.name
        if names.count(release.name) > 1:
            raw = f"{release.name}-v{release.version}-{release.manifest_sha256[:12]}"
        labels.append("".join(c if c.isalnum() or c in "._-" else "_" for c in raw)[:120])
    if len(set(labels)) != len(labels):
        raise ValueError(f"releases {labels} are given more than once; give each release once")
    return labels


def shared_sources(releases: list[Any], labels: list[str] | None = None) -> set[str]:
    """The source images (``source_key``) that have counterfactuals in every release; read from metadata only.

    Raises:
        ValueError: (one line) a release without counterfactual/original configs, or no source image in common.
    """
    labels = labels or [r.name for r in releases]
    source_sets = []
    for release, label in zip(releases, labels, strict=True):
        if "counterfactual" not in release.shards or "original" not in release.shards:
            raise ValueError(
                f"release {label} has no original and counterfactual configs (it has {', '.join(release.configs)}): "
                "the side-by-side compares editors' counterfactual releases; evaluate it on its own"
            )
        source_sets.append({meta["source_key"] for meta in counterfactual_metadata(release).values()})
    common = set.intersection(*source_sets) if source_sets else set()
    if not common:
        raise ValueError(
            f"releases {', '.join(labels)} share no source image (no source_key has counterfactuals in all of them): "
            "build them from the same --source (same classes and --limit), one per editor, or evaluate them one at a "
            "time"
        )
    return common


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
            data = read_json(file)
            if data.get("status", "ok") == "ok" and data.get("sensitivity"):
                found.append(data)
    return found


def results_of_release(release, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The eval results of ``release``: same manifest hash where the results record one, else the same name."""
    matching = []
    for result in results:
        described = result.get("release") or {}
        if described.get("manifest_sha256"):
            if described["manifest_sha256"] == release.manifest_sha256:
                matching.append(result)
        elif described.get("name") == release.name:
            matching.append(result)
    return matching


def fidelity_table(
    rows: list[dict[str, Any]],
    results_by_release: dict[str, list[dict[str, Any]]] | None = None,
    manifests_by_release: dict[str, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Per (edit type, editor, release, model): counts, fidelity means and the model's accuracy drop.

    Args:
        rows: :func:`release_fidelity` rows of every release.
        results_by_release: eval results (``results.json`` objects with a ``sensitivity`` section) per release
            label (the rows' ``release``); each model contributes one row per edit type, its
            ``sensitivity.by_edit_type`` (``overall`` for the ``all`` row). A release without results gets one row
            per edit type with the accuracy columns empty.
        manifests_by_release: each release's manifest, for the editing columns: the share of rendered edits the
            gates kept and the cost per kept edit (:func:`editing_accounting`), and the judge's calibrated threshold
            for ``label_kept`` (:func:`label_kept`). Without it those columns are empty.
    """
    by_group: dict[tuple[str, str, str], list[dict]] = {}
    for row in rows:
        by_group.setdefault((row["editor"], row["release"], row["edit_type"]), []).append(row)
        by_group.setdefault((row["editor"], row["release"], "all"), []).append(row)
    table = []
    # Grouped by edit type (the row "all" last), the editors next to each other within it: the side by side.
    for (editor, release, edit_type), group in sorted(
        by_group.items(), key=lambda kv: (kv[0][2] == "all", kv[0][2], kv[0][0], kv[0][1])
    ):
        base = {
            "editor": editor,
            "release": release,
            "edit_type": edit_type,
            "n": len(group),
            **{column: _mean([r[column] for r in group]) for column in FIDELITY_COLUMNS},
            **{column: _mean([r.get(column) for r in group]) for column in PRESERVATION_COLUMNS},
            **_editing_columns(editor, edit_type, group, (manifests_by_release or {}).get(release)),
        }
        matching = [r for r in (results_by_release or {}).get(release, []) if r.get("sensitivity")]
        if not matching:
            table.append({**base, "model": None, **dict.fromkeys(ACCURACY_COLUMNS)})
            continue
        for result in matching:
            sensitivity = result["sensitivity"]
            by_type = sensitivity.get("by_edit_type") or {}
            stats = (sensitivity.get("overall") if edit_type == "all" else by_type.get(edit_type)) or {}
            table.append({**base, "model": model_label(result), **{c: stats.get(c) for c in ACCURACY_COLUMNS}})
    return table


def _editing_columns(editor: str, edit_type: str, group: list[dict], manifest: dict[str, Any] | None) -> dict:
    """gate_kept, label_kept and the cost per kept edit of one (editor, edit type) of a release."""
    out: dict[str, Any] = dict.fromkeys(EDITING_COLUMNS)
    if manifest is None:
        return out
    out["label_kept"] = label_kept([r.get(JUDGE_CLASS_FIELD) for r in group], judge_threshold(manifest))
    stats = editing_accounting(manifest).get(editor, {}).get(edit_type)
    if stats and stats["edits"]:
        kept = stats["edits_kept"]
        out["gate_kept"] = kept / stats["edits"]
        if kept and stats["forward_equivalents"] is not None:
            out["forward_equivalents_per_kept"] = stats["forward_equivalents"] / kept
        if kept and stats["flops"] is not None:
            out["tflops_per_kept"] = stats["flops"] / kept / 1e12
    return out


def table_markdown(table: list[dict[str, Any]], *, escaped: bool = False) -> str:
    """The side-by-side table in Markdown; a ``release`` column appears when one editor has several releases.
    ``escaped``: text cells through the Markdown escaper (``md_escape``), for ``fidelity.md``; the copy printed to the
    terminal only keeps a ``|`` in a name from ending its cell."""
    releases_per_editor: dict[str, set[str]] = {}
    for row in table:
        releases_per_editor.setdefault(row["editor"], set()).add(row["release"])
    with_release = any(len(r) > 1 for r in releases_per_editor.values())
    columns = ["edit_type", "editor", *(["release"] if with_release else []), "model", "n"]
    columns += [*ACCURACY_COLUMNS, *FIDELITY_COLUMNS, *EDITING_COLUMNS, *PRESERVATION_COLUMNS]
    header = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"

    def cell(value: Any) -> str:
        if value is None:
            return "–"
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}" if abs(value) < 1e5 else f"{value:.3g}"
        return md_escape(value) if escaped else str(value).replace("|", "\\|")

    return header + "".join("| " + " | ".join(cell(row.get(c)) for c in columns) + " |\n" for row in table)


def plot_fidelity(table: list[dict[str, Any]], path: Path) -> Path:
    """One figure: per edit type, a bar per editor for each of the accuracy drop, the share of edits the gates kept,
    the share the calibrated judge keeps, LPIPS and SSIM to the source image, and the forward-equivalents per kept
    edit.

    With several models the accuracy bar is their mean. A missing value (no eval results, not judged, not measured)
    is no bar.
    """
    panels = [
        ("paired_delta_acc1", "paired Δ acc@1 (points; mean over models)"),
        ("gate_kept", "share of edits kept by the gates"),
        ("label_kept", "share kept by the calibrated judge"),
        ("lpips", "LPIPS to the source (lower = preserved)"),
        ("ssim", "SSIM to the source"),
        ("forward_equivalents_per_kept", "network forward-equivalents per kept edit"),
    ]
    editors = sorted({r["editor"] for r in table})
    edit_types = sorted({r["edit_type"] for r in table}, key=lambda t: (t == "all", t))
    fig, axes = _figure(nrows=2, ncols=3, figsize=(15, 7.2), squeeze=False)
    width = 0.8 / max(len(editors), 1)
    for ax, (column, title) in zip([a for row in axes for a in row], panels, strict=True):
        drawn = []
        for i, editor in enumerate(editors):
            xs, values = [], []
            for x, edit_type in enumerate(edit_types):
                value = _mean(
                    [
                        r.get(column) if isinstance(r.get(column), (int, float)) else None
                        for r in table
                        if r["editor"] == editor and r["edit_type"] == edit_type
                    ]
                )
                if value is not None:
                    xs.append(x + i * width)
                    values.append(value)
            ax.bar(xs, values, width, label=_plain(editor), color=f"C{i % 10}")
            drawn += values
        ax.set_xticks([x + width * (len(editors) - 1) / 2 for x in range(len(edit_types))], edit_types, rotation=30)
        ax.axhline(0, color="black", linewidth=0.6)
        ax.set_title(title)
        if not drawn:  # no release measured it: say so rather than leave an empty axis
            ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", va="center", color="grey")
    axes[0][1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def _clip_description(clip) -> dict[str, Any] | None:
    if clip is None:
        return None
    try:
        described = clip.describe()
    except Exception:  # a description must never lose the table
        return {"model": str(getattr(clip, "model", "?"))}
    return {k: v for k, v in described.items() if k in ("model", "pretrained", "revision", "weights_sha256")}


def side_by_side(
    releases: list[Any],
    output: Path,
    *,
    results_by_release: dict[str, list[dict[str, Any]]] | None = None,
    labels: list[str] | None = None,
    clip=None,
    masks_dir: Path | None = None,
) -> list[dict[str, Any]]:
    """THE side-by-side of several releases of the same source images (used by ``lance-cf eval`` with several
    ``--release`` and by ``lance-cf compare-editors``): measures every counterfactual, joins the eval results, and
    writes ``fidelity.md`` (the table), ``fidelity.csv``, ``fidelity.json`` (table, releases, CLIP model),
    ``fidelity.png`` (the plot), ``fidelity.html`` (table and plot) and ``fidelity_samples.csv`` (one row per
    counterfactual) into ``output``.

    Args:
        releases: Opened releases (``evaluation.release_reader.Release``), at least two.
        output: Folder for the files (created).
        results_by_release: eval results per release label (see :func:`fidelity_table`).
        labels: Names of the releases in the table (default :func:`release_labels`).
        clip: A loaded ``ClipScorer`` for the CLIP image similarity, or None (column empty).
        masks_dir: Object masks for the background PSNR, or None (column empty).

    Returns:
        The table rows.

    Raises:
        ValueError: (one line) fewer than two releases, or releases that share no source image.
    """

    if len(releases) < 2:
        raise ValueError("the side-by-side needs at least two releases (the same source images, two editors)")
    labels = labels or release_labels(releases)
    common = shared_sources(releases, labels)
    rows = []
    counts = {}
    for release, label in zip(releases, labels, strict=True):
        release_rows = release_fidelity(release, clip=clip, masks_dir=masks_dir, label=label)
        counts[label] = len({r["source_key"] for r in release_rows})
        rows += release_rows
    manifests = {label: r.manifest for r, label in zip(releases, labels, strict=True)}
    table = fidelity_table(rows, results_by_release, manifests)
    output.mkdir(parents=True, exist_ok=True)
    import pandas as pd  # lazy: a heavy import for one table

    for name, data in (("fidelity.csv", table), ("fidelity_samples.csv", rows)):
        write_csv(pd.DataFrame(data, columns=list(data[0])), output / name)
    note = (
        f"Source images with counterfactuals in every release: {len(common)} "
        f"({', '.join(f'{label}: {n}' for label, n in counts.items())}). Each release's numbers are over all of its "
        f"own counterfactuals. {COLUMN_NOTE}"
    )
    limits = sorted({r["limit"] for group in (results_by_release or {}).values() for r in group if r.get("limit")})
    if limits:
        note += (
            f" The accuracy columns come from --limit runs ({', '.join(map(str, limits))} samples per config), the "
            "fidelity columns from every counterfactual."
        )
    markdown = table_markdown(table, escaped=True)
    (output / "fidelity.md").write_text(f"{note}\n\n{markdown}", encoding="utf-8")
    plot_fidelity(table, output / "fidelity.png")
    edits = {label: sum(r["release"] == label for r in rows) for label in labels}
    summary = {
        "releases": [
            {
                "label": label,
                "name": r.name,
                "version": r.version,
                "config_hash": r.manifest.get("config_hash"),
                "manifest_sha256": r.manifest_sha256,
                "counterfactuals": edits[label],
                "sources": counts[label],
            }
            for r, label in zip(releases, labels, strict=True)
        ],
        # the models whose eval results gave the accuracy columns
        "models": sorted({str(row["model"]) for row in table if row.get("model") is not None}),
        "shared_sources": len(common),
        "sources_with_counterfactuals": counts,
        "clip": _clip_description(clip),
        "masks": masks_dir is not None,
        "table": table,
    }
    (output / "fidelity.json").write_text(json.dumps(summary, indent=2, allow_nan=False), encoding="utf-8")
    _write_html(output / "fidelity.html", note, table)
    return table


def _write_html(path: Path, note: str, table: list[dict[str, Any]]) -> None:
    """``fidelity.html`` from ``templates/fidelity.html.jinja`` (autoescaped)."""
    columns = ["edit_type", "editor", "release", "model", "n", *ACCURACY_COLUMNS, *FIDELITY_COLUMNS]
    columns += [*EDITING_COLUMNS, *PRESERVATION_COLUMNS]

    def cell(value: Any) -> str:
        if value is None:
            return "–"
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 1e5 else f"{value:.3g}"
        return str(value)

    rows = [[cell(row.get(c)) for c in columns] for row in table]
    path.write_text(render_page("fidelity.html.jinja", note=note, columns=columns, rows=rows), encoding="utf-8")


def _declared_models(args: argparse.Namespace) -> list:
    """compare-editors loads one CLIP model (checked before it starts), unless --no-clip-similarity."""
    if args.no_clip_similarity:
        return []
    need = clip_need(args.clip_model, args.clip_pretrained, used_by="compare-editors", key="--clip-model")
    return [need] if need is not None else []


def _require_two_releases(release_specs: list[str]) -> None:
    if len(release_specs) < 2:
        raise ValueError("compare-editors needs at least two --release (the same source images, two editors)")


def check_compare_editors_arguments(args: argparse.Namespace) -> None:
    """The checks that need no model, before the model check (builder.cli): one line, nothing loaded or written."""
    check_masks(args.masks)
    _require_two_releases(args.release)


def load_side_by_side_clip(model: str, pretrained: str | None, device: str):
    """The CLIP scorer of the CLIP image similarity, loaded; a model that cannot be loaded is one line (ValueError)."""
    pretrained = None if pretrained is None or str(pretrained).lower() == "none" else pretrained
    try:
        clip = ClipScorer(model=model, pretrained=pretrained)
        clip.load(device)
    except (OSError, RuntimeError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"side by side: CLIP model {model!r} ({pretrained or 'no tag'}) could not be loaded "
            f"({type(error).__name__}: {first_line}); pass a local open_clip directory with --clip-model DIR, or "
            "--no-clip-similarity"
        ) from error
    return clip


def compare_editors(
    release_specs: list[str],
    output: Path,
    *,
    results_paths: list[Path] | None = None,
    clip=None,
    masks_dir: Path | None = None,
) -> list[dict[str, Any]]:
    """:func:`side_by_side` of releases given by spec, with eval results read from ``results_paths``.

    Returns:
        The table rows (see :func:`fidelity_table`).
    """
    _require_two_releases(release_specs)
    releases = [open_release(spec) for spec in release_specs]
    labels = release_labels(releases)
    results = load_results(results_paths or [])
    by_release = {label: results_of_release(r, results) for r, label in zip(releases, labels, strict=True)}
    return side_by_side(releases, output, results_by_release=by_release, labels=labels, clip=clip, masks_dir=masks_dir)


# ---------------------------------------------------------------------------------------------- CLI


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``compare-editors`` subcommand (the side-by-side of ``lance-cf eval`` without evaluating models)."""
    p = subparsers.add_parser(
        "compare-editors",
        help="side by side from existing eval outputs (or fidelity only): `lance-cf eval --release A --release B` "
        "evaluates and writes the same table",
        description=(
            "The side-by-side table of `lance-cf eval --release A --release B`, without evaluating any model: per "
            "editor and edit type, the image fidelity (CLIP image similarity, SSIM of Canny edges, background PSNR "
            "with --masks), the share of edits the gates kept, the share the calibrated judge keeps, the cost per "
            "kept counterfactual (forward-equivalents and FLOPs counted at build time) and the preservation of the "
            "source image (LPIPS, PSNR, SSIM, whole and outside the object) of two or more releases of the same "
            "source images and, from earlier `lance-cf eval` outputs (--results), the paired accuracy drop and flip "
            "rate. Writes fidelity.md, fidelity.csv, fidelity.json, fidelity.png, fidelity.html and "
            "fidelity_samples.csv. Then `lance-cf add-comparison RELEASE OUTPUT --output NEW` puts the table and the "
            "plot on a compared release's card (its next version), or `lance-cf publish-comparison OUTPUT --repo-id "
            "ORG/NAME` on a published one's."
        ),
    )
    p.add_argument("--release", action="append", required=True, help="release directory or Hub id (twice or more)")
    p.add_argument("--results", action="append", type=Path, default=[], help="`lance-cf eval` output dir (repeat)")
    p.add_argument("--output", required=True, type=Path, help="output directory")
    add_side_by_side_arguments(p, no_clip_aliases=("--no-clip",))
    p.add_argument("--clip-model", default="ViT-L-14", help="open_clip model for the CLIP image similarity")
    p.add_argument("--clip-pretrained", default="openai", help="its pretrained tag (None for a directory)")
    p.add_argument("--device", default="cpu", help="device of the CLIP model")
    p.set_defaults(func=run_compare_editors, models=_declared_models, check=check_compare_editors_arguments)
    declare_output(p, "compare-editors", lambda args: args.output)


def add_side_by_side_arguments(parser: argparse.ArgumentParser, no_clip_aliases: tuple[str, ...] = ()) -> None:
    """The options the side-by-side adds (shared by ``eval`` and ``compare-editors``)."""
    parser.add_argument(
        "--masks",
        type=Path,
        help="side by side: folder of SOURCE_KEY.png object masks (non-zero = object) for the background PSNR",
    )
    parser.add_argument(
        "--no-clip-similarity",
        *no_clip_aliases,
        dest="no_clip_similarity",
        action="store_true",
        help="side by side: skip the CLIP image similarity (no CLIP model is loaded for it)",
    )


def check_masks(masks: Path | None) -> None:
    if masks is not None and not masks.is_dir():
        raise ValueError(f"--masks {masks}: not a directory; give the folder of SOURCE_KEY.png object masks")


def run_compare_editors(args: argparse.Namespace) -> int:
    check_masks(args.masks)
    clip = None
    if not args.no_clip_similarity:
        clip = load_side_by_side_clip(args.clip_model, args.clip_pretrained, args.device)
    table = compare_editors(args.release, args.output, results_paths=args.results, clip=clip, masks_dir=args.masks)
    print(table_markdown(table))
    print(f"wrote {args.output}/fidelity.md, fidelity.csv, fidelity.json, fidelity.png, fidelity.html")
    print(
        f"on a release's card: lance-cf add-comparison RELEASE {args.output} --output NEW (its next version), or "
        f"lance-cf publish-comparison {args.output} --repo-id ORG/NAME (a published release)"
    )
    return 0
