"""An HTML report per model: headline table, plots, gallery of the most damaging counterfactuals, insights.

The page (``report.html``) and its pictures (``assets/``) are written beside the model's ``results.json``; images are
linked by relative paths, so the folder can be moved or served as is. The page is ``templates/report.html.jinja``,
rendered with autoescape (:mod:`evaluation.pages`): this module builds its context as plain data.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from builder import release_format as rf
from evaluation.judge_kept import SECTION as JUDGE_KEPT_SECTION
from evaluation.leaderboard import fmt_number
from evaluation.metric_registry import metric_columns
from evaluation.pages import render_page
from evaluation.plots import plot_acc_scatter, plot_class_delta_acc, plot_edit_type_sensitivity
from evaluation.release_reader import Release
from evaluation.results import model_label
from lance_pipeline.release_kinds import kind_of_results, resolve_target

logger = logging.getLogger(__name__)


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, (int, float)):
        return fmt_number(value, digits)
    return str(value)


def _stat(entry: dict[str, Any], name: str) -> dict[str, Any]:
    """A statistic and its interval (``<name>_ci``) as text, for the template's ``stat`` macro."""
    ci = entry.get(f"{name}_ci")
    return {"text": _fmt(entry.get(name)), "ci": [_fmt(ci[0]), _fmt(ci[1])] if ci else None}


def highlight(text: str | None, span: str | None) -> tuple[str, str, str]:
    """``text`` split around the first occurrence of ``span``: (before, span, after), for the template to mark."""
    if not text:
        return ("", "", "")
    if span and span in text:
        before, _, after = text.partition(span)
        return (before, span, after)
    return (text, "", "")


def _headline(results: dict[str, Any]) -> dict[str, Any]:
    """Per config: n, acc@1/5 with intervals, the paired Delta (each sample against its own original) first and the
    unpaired difference of the two sets labelled as such (it is confounded by how many edits each class kept)."""
    few_classes = (((results.get("release") or {}).get("label_space") or {}).get("num_classes") or 6) < 6
    pairs = {"counterfactual": (results.get("sensitivity") or {}).get("overall") or {}}
    pairs |= {c: (s or {}).get("overall") or {} for c, s in (results.get("sensitivity_by_config") or {}).items()}
    rows = []
    for config, entry in results["metrics"].items():
        paired = pairs.get(config) or {}
        rows.append(
            {
                "config": config,
                "n": entry["n"],
                "acc1": _stat(entry, "acc1"),
                "acc5": None if few_classes else _stat(entry, "acc5"),
                "paired": _stat(paired, "paired_delta_acc1") if paired else None,
                "pairs": paired.get("n", "–"),
                "delta": _stat(entry, "delta_acc1"),
            }
        )
    incomplete = []
    if results.get("limit") is not None:
        incomplete.append(f"--limit {int(results['limit'])} run: only the first samples of each config were scored")
    if results.get("failures"):
        first = results["failures"][0]
        incomplete.append(
            f"{len(results['failures'])} sample(s) could not be read (first: {first.get('shard')} "
            f"{first.get('key')}); they are left out of every number"
        )
    options = results.get("options") or {}
    shown = ", ".join(f"{k}={v}" for k, v in options.items() if k in RUN_OPTIONS_SHOWN and v not in (None, False))
    return {
        "headline": rows,
        "incomplete": incomplete,
        "run_options": shown or "defaults",
        "device": str((results.get("run") or {}).get("device")),
    }


def _judge_kept(results: dict[str, Any]) -> dict[str, Any] | None:
    """The headline table again on the judge-kept samples (results' ``judge_kept`` section), with what it kept."""
    section = results.get(JUDGE_KEPT_SECTION)
    if not section:
        return None
    view = {k: section.get(k) for k in ("metrics", "sensitivity", "sensitivity_by_config")} | {
        "release": results.get("release")
    }
    counts = section.get("counts") or {}
    kept = "; ".join(
        f"{config}: {c.get('kept')} kept, {c.get('below')} below, {c.get('unscored')} unscored"
        for config, c in counts.items()
    )
    return {
        "threshold": _fmt(section.get("threshold"), 4),
        "calibrated": bool(section.get("calibrated")),
        "counts": kept,
        "rows": _headline(view)["headline"],
    }


def _sensitivity(results: dict[str, Any]) -> list[dict[str, Any]]:
    sections = [("counterfactual", results.get("sensitivity") or {})]
    sections += list((results.get("sensitivity_by_config") or {}).items())
    rows = []
    for config, section in sections:
        overall = section.get("overall")
        if not overall:
            continue
        groups = [("all", overall)] + [(f"edit: {t}", s) for t, s in (section.get("by_edit_type") or {}).items()]
        for name, stats in groups:
            rows.append(
                {
                    "config": config,
                    "group": name,
                    "n": stats["n"],
                    "dp": _stat(stats, "delta_p_gt_mean"),
                    "dp_abs": _stat(stats, "delta_p_gt_abs_mean"),
                    "flip": _stat(stats, "flip_rate"),
                    "paired": _stat(stats, "paired_delta_acc1"),
                }
            )
    return rows


def _kind_section(results: dict[str, Any]) -> dict[str, Any] | None:
    """The table the release's kind adds to the report (``report_section`` of ``lance_pipeline.release_kinds``: the
    interfaces' per-shift table), asked of the kind, not guessed."""
    kind = kind_of_results(results)
    return resolve_target(kind.report_section)(results) if kind.report_section else None


MAX_ASSET_STEM = 100
RUN_OPTIONS_SHOWN = ("amp", "amp_dtype", "model_dtype", "channels_last", "torchcompile", "limit", "verify")


def asset_name(kind: str, key: str, ext: str) -> str:
    """The gallery file name of a sample: bounded (a key built from a 245-character class name must not exceed the
    file system's 255 bytes), still unique through a hash of the full key."""
    stem = f"{kind}-{key}"
    if len(stem) > MAX_ASSET_STEM:
        stem = f"{stem[: MAX_ASSET_STEM - 13]}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    return f"{stem}.{ext}"


def _top5(top: list[int], probs: list[float], label: int, release: Release) -> list[dict[str, Any]]:
    return [
        {"name": release.label_name(index).split(",")[0], "prob": f"{prob * 100:.1f}%", "gt": index == label}
        for index, prob in zip(top, probs, strict=True)
    ]


def _gallery(rows: list[dict[str, Any]], release: Release, assets: Path, size: int) -> list[dict[str, Any]]:
    originals = {r["key"]: r for r in rows if r["config"] == "original"}
    pairs = [
        (r, originals[r["source_key"]])
        for r in rows
        if r["config"] == "counterfactual" and r["source_key"] in originals
    ]
    pairs.sort(key=lambda p: p[1]["p_gt"] - p[0]["p_gt"], reverse=True)
    pairs = pairs[:size]
    if not pairs:
        return []
    cf_samples = rf.read_samples(release.shards.get("counterfactual", []), {cf["key"] for cf, _ in pairs})
    orig_samples = rf.read_samples(release.shards.get("original", []), {orig["key"] for _, orig in pairs})
    assets.mkdir(parents=True, exist_ok=True)
    ext = release.image_ext
    shown = []
    for cf, orig in pairs:
        if orig["key"] not in orig_samples or cf["key"] not in cf_samples:
            continue
        orig_file = asset_name("original", orig["key"], ext)
        cf_file = asset_name("counterfactual", cf["key"], ext)
        (assets / orig_file).write_bytes(orig_samples[orig["key"]][ext])
        (assets / cf_file).write_bytes(cf_samples[cf["key"]][ext])
        shown.append(
            {
                "original_file": orig_file,
                "original_key": orig["key"],
                "caption": highlight(cf["caption"], cf["original_span"]),
                "original_top5": _top5(orig["top5"], orig["top5_prob"], orig["label"], release),
                "counterfactual_file": cf_file,
                "key": cf["key"],
                "edit_type": cf["edit_type"] or "edit",
                "edited_caption": highlight(cf["edited_caption"], cf["edited_span"]),
                "counterfactual_top5": _top5(cf["top5"], cf["top5_prob"], cf["label"], release),
                "class_name": release.label_name(cf["label"]),
                "label": cf["label"],
                "delta": f"{(orig['p_gt'] - cf['p_gt']) * 100.0:.2f}",
            }
        )
    return shown


def _insights(results: dict[str, Any]) -> dict[str, Any] | None:
    insights = results.get("insights")
    if not insights:
        return None
    if insights.get("error"):
        return {"error": insights["error"], "rows": []}
    rows = [
        {
            "class_name": entry["label_name"] or label,
            "label": label,
            "cluster": cluster["name"],
            "size": cluster["size"],
            "mean": f"{cluster['delta_p_gt_mean']:.2f}",
            "examples": [
                {
                    "caption": highlight(e["edited_caption"], e["edit"].split(" → ")[-1]),
                    "delta": f"{e['delta_p_gt']:.2f}",
                }
                for e in cluster["examples"]
            ],
        }
        for label, entry in insights["by_class"].items()
        for cluster in entry["top_clusters"]
    ]
    return {"error": None, "rows": rows}


def write_model_report(
    results: dict[str, Any], rows: list[dict[str, Any]], release: Release, out_dir: Path, gallery_size: int = 12
) -> Path:
    """Write ``out_dir/report.html`` and its ``assets/`` for one model's results and prediction rows."""
    out_dir = Path(out_dir)
    assets = out_dir / "assets"
    plots = []
    if results.get("sensitivity", {}).get("by_edit_type"):
        plots.append(plot_edit_type_sensitivity([results], assets / "edit_type_sensitivity.png"))
    if "counterfactual" in results["metrics"] and "original" in results["metrics"]:
        plots.append(plot_class_delta_acc([results], assets / "class_delta_acc.png"))
        plots.append(plot_acc_scatter([results], assets / "acc_original_vs_counterfactual.png"))
    page = render_page(
        "report.html.jinja",
        title=f"{model_label(results)} on {release.name} {release.version}",
        release_name=release.name,
        release_version=release.version,
        manifest_sha256=release.manifest_sha256[:16],
        weights=results["model"]["weights"]["id"],
        timm_version=results["packages"].get("timm", "?"),
        created_at=results.get("run", {}).get("created_at", ""),
        **_headline(results),
        kind_section=_kind_section(results),
        judge_kept=_judge_kept(results),
        extra_metrics=metric_columns(results),
        sensitivity=_sensitivity(results),
        plots=[{"src": f"assets/{p.name}", "alt": p.stem} for p in plots]
        # accuracy against edit strength, beside the report (evaluation.harness writes it)
        + ([{"src": "strength.png", "alt": "strength"}] if (out_dir / "strength.png").is_file() else []),
        gallery=_gallery(rows, release, assets, gallery_size),
        insights=_insights(results),
    )
    path = out_dir / "report.html"
    path.write_text(page, encoding="utf-8")
    logger.debug("wrote report %s", path)
    return path
