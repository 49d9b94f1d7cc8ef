"""An HTML report per model: headline table, plots, gallery of the most damaging counterfactuals, insights.

The page (``report.html``) and its pictures (``assets/``) are written beside the model's ``results.json``; images are
linked by relative paths, so the folder can be moved or served as is. The page layout is ``report_template.html``.
"""

from __future__ import annotations

import hashlib
import html
import logging
from pathlib import Path
from string import Template
from typing import Any

from evaluation.interfaces.shift_results import scored_shifts
from evaluation.leaderboard import fmt_number
from evaluation.plots import plot_acc_scatter, plot_class_delta_acc, plot_edit_type_sensitivity
from evaluation.release_reader import Release, read_samples
from evaluation.results import model_label

logger = logging.getLogger(__name__)

TEMPLATE_PATH = Path(__file__).with_name("report_template.html")


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, (int, float)):
        return fmt_number(value, digits)
    return html.escape(str(value))


def _ci(entry: dict[str, Any], name: str) -> str:
    ci = entry.get(f"{name}_ci")
    text = _fmt(entry.get(name))
    return f"{text} <span class='meta'>[{_fmt(ci[0])}, {_fmt(ci[1])}]</span>" if ci else text


def highlight(text: str | None, span: str | None) -> str:
    """HTML-escape ``text`` and wrap the first occurrence of ``span`` in ``<mark>``."""
    if not text:
        return ""
    escaped = html.escape(text)
    if span:
        span_escaped = html.escape(span)
        if span_escaped in escaped:
            return escaped.replace(span_escaped, f"<mark>{span_escaped}</mark>", 1)
    return escaped


def _headline_table(results: dict[str, Any]) -> str:
    """Per config: n, acc@1/5 with intervals, the paired Delta (each sample against its own original) first and the
    unpaired difference of the two sets labelled as such (it is confounded by how many edits each class kept)."""
    few_classes = (((results.get("release") or {}).get("label_space") or {}).get("num_classes") or 6) < 6
    head = (
        "<tr><th class='text'>config</th><th>n</th><th>acc@1</th><th>acc@5</th><th>paired Δ acc@1</th>"
        "<th>pairs</th><th>unpaired Δ acc@1 (set difference)</th></tr>"
    )
    pairs = {"counterfactual": (results.get("sensitivity") or {}).get("overall") or {}}
    pairs |= {c: (s or {}).get("overall") or {} for c, s in (results.get("sensitivity_by_config") or {}).items()}
    body = []
    for config, entry in results["metrics"].items():
        acc5 = "n/a (&lt;6 classes)" if few_classes else _ci(entry, "acc5")
        paired = pairs.get(config) or {}
        body.append(
            f"<tr><td class='text'>{html.escape(config)}</td><td>{entry['n']}</td><td>{_ci(entry, 'acc1')}</td>"
            f"<td>{acc5}</td><td>{_ci(paired, 'paired_delta_acc1') if paired else '–'}</td>"
            f"<td>{paired.get('n', '–')}</td><td>{_ci(entry, 'delta_acc1')}</td></tr>"
        )
    notes = []
    if results.get("limit") is not None:
        notes.append(f"--limit {int(results['limit'])} run: only the first samples of each config were scored")
    if results.get("failures"):
        first = results["failures"][0]
        notes.append(
            f"{len(results['failures'])} sample(s) could not be read (first: {first.get('shard')} "
            f"{first.get('key')}); they are left out of every number"
        )
    warning = "".join(f"<p class='meta'><b>Incomplete:</b> {html.escape(n)}.</p>" for n in notes)
    options = results.get("options") or {}
    shown = ", ".join(f"{k}={v}" for k, v in options.items() if k in RUN_OPTIONS_SHOWN and v not in (None, False))
    device = html.escape(str((results.get("run") or {}).get("device")))
    run = f"<p class='meta'>Run options: {html.escape(shown or 'defaults')} · device {device}</p>"
    return f"{warning}{run}<table>{head}{''.join(body)}</table>"


def _sensitivity_table(results: dict[str, Any]) -> str:
    sections = [("counterfactual", results.get("sensitivity") or {})]
    sections += list((results.get("sensitivity_by_config") or {}).items())
    head = (
        "<tr><th class='text'>config</th><th class='text'>group</th><th>n</th><th>mean Δp</th><th>mean |Δp|</th>"
        "<th>flip rate</th><th>paired Δ acc@1</th></tr>"
    )
    body = []
    for config, section in sections:
        overall = section.get("overall")
        if not overall:
            continue
        groups = [("all", overall)] + [(f"edit: {t}", s) for t, s in (section.get("by_edit_type") or {}).items()]
        for name, stats in groups:
            body.append(
                f"<tr><td class='text'>{config}</td><td class='text'>{html.escape(name)}</td><td>{stats['n']}</td>"
                f"<td>{_ci(stats, 'delta_p_gt_mean')}</td><td>{_ci(stats, 'delta_p_gt_abs_mean')}</td>"
                f"<td>{_ci(stats, 'flip_rate')}</td><td>{_ci(stats, 'paired_delta_acc1')}</td></tr>"
            )
    return f"<table>{head}{''.join(body)}</table>" if body else "<p>No paired samples.</p>"


def _shift_table(results: dict[str, Any]) -> str:
    """An interfaces release's per-shift metric (:mod:`evaluation.interfaces.shift_results`); "" for a LANCE release."""
    section = results.get("interfaces")
    if not isinstance(section, dict):
        return ""
    head = (
        "<tr><th class='text'>shift</th><th>n</th><th>acc@1 (shift)</th><th>acc@1 (base, same classes)</th>"
        "<th>drop [95% CI]</th><th>classes used</th><th class='text'>classes excluded</th></tr>"
    )
    body = []

    for shift, entry in scored_shifts(section).items():
        excluded = ", ".join(str(c) for c in entry["classes_excluded"]) or "–"
        body.append(
            f"<tr><td class='text'>{html.escape(shift)}</td><td>{entry['n']}</td><td>{_fmt(entry['accuracy'])}</td>"
            f"<td>{_fmt(entry['base_accuracy'])}</td><td>{_ci(entry, 'drop')}</td><td>{entry['classes']}</td>"
            f"<td class='text'>{html.escape(excluded)}</td></tr>"
        )
    note = (
        f"<p class='meta'>Interfaces release (generated images, no pairs): per shift, mean per-class top-1 accuracy "
        f"over classes with at least {int(section['min_per_class'])} images in the shift, and the drop against "
        f"<code>{html.escape(str(section.get('base_config')))}</code> over the same classes; 95% bootstrap interval "
        "over classes. The paired metrics below do not apply.</p>"
    )
    return f"<h3>Per shift</h3>{note}<table>{head}{''.join(body)}</table>"


MAX_ASSET_STEM = 100
RUN_OPTIONS_SHOWN = ("amp", "amp_dtype", "model_dtype", "channels_last", "torchcompile", "limit", "verify")


def asset_name(kind: str, key: str, ext: str) -> str:
    """The gallery file name of a sample: bounded (a key built from a 245-character class name must not exceed the
    file system's 255 bytes), still unique through a hash of the full key."""
    stem = f"{kind}-{key}"
    if len(stem) > MAX_ASSET_STEM:
        stem = f"{stem[: MAX_ASSET_STEM - 13]}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    return f"{stem}.{ext}"


def _top5_list(top: list[int], probs: list[float], label: int, release: Release) -> str:
    items = []
    for index, prob in zip(top, probs, strict=True):
        cls = " class='gt'" if index == label else ""
        items.append(f"<li{cls}>{html.escape(release.label_name(index).split(',')[0])} ({prob * 100:.1f}%)</li>")
    return f"<ol class='top5'>{''.join(items)}</ol>"


def _gallery(rows: list[dict[str, Any]], release: Release, assets: Path, size: int) -> str:
    originals = {r["key"]: r for r in rows if r["config"] == "original"}
    pairs = [
        (r, originals[r["source_key"]])
        for r in rows
        if r["config"] == "counterfactual" and r["source_key"] in originals
    ]
    pairs.sort(key=lambda p: p[1]["p_gt"] - p[0]["p_gt"], reverse=True)
    pairs = pairs[:size]
    if not pairs:
        return "<p>No counterfactuals with their original in this release.</p>"
    cf_samples = read_samples(release, "counterfactual", {cf["key"] for cf, _ in pairs})
    orig_samples = read_samples(release, "original", {orig["key"] for _, orig in pairs})
    assets.mkdir(parents=True, exist_ok=True)
    ext = release.image_ext
    blocks = []
    for cf, orig in pairs:
        if orig["key"] not in orig_samples or cf["key"] not in cf_samples:
            continue
        orig_file = asset_name("original", orig["key"], ext)
        cf_file = asset_name("counterfactual", cf["key"], ext)
        (assets / orig_file).write_bytes(orig_samples[orig["key"]][ext])
        (assets / cf_file).write_bytes(cf_samples[cf["key"]][ext])
        delta = (orig["p_gt"] - cf["p_gt"]) * 100.0
        blocks.append(
            f"<div class='pair'><figure><img src='assets/{orig_file}' alt='original {html.escape(orig['key'])}'>"
            f"<figcaption>original · {highlight(cf['caption'], cf['original_span'])}"
            f"{_top5_list(orig['top5'], orig['top5_prob'], orig['label'], release)}</figcaption></figure>"
            f"<figure><img src='assets/{cf_file}' alt='counterfactual {html.escape(cf['key'])}'>"
            f"<figcaption>{html.escape(cf['edit_type'] or 'edit')} · "
            f"{highlight(cf['edited_caption'], cf['edited_span'])}"
            f"{_top5_list(cf['top5'], cf['top5_prob'], cf['label'], release)}</figcaption></figure>"
            f"<div class='meta'>class {html.escape(release.label_name(cf['label']))} ({cf['label']})<br>"
            f"Δ p(y_GT) = {delta:.2f} points<br>key {html.escape(cf['key'])}</div></div>"
        )
    return "\n".join(blocks)


def _insights(results: dict[str, Any]) -> str:
    insights = results.get("insights")
    if not insights:
        return "<p>Insights were not computed for this run.</p>"
    if insights.get("error"):
        return f"<p>Insights failed: {html.escape(insights['error'])}</p>"
    head = "<tr><th class='text'>class</th><th class='text'>cluster</th><th>size</th><th>mean Δp</th>" + (
        "<th class='text'>example edits</th></tr>"
    )
    body = []
    for label, entry in insights["by_class"].items():
        for cluster in entry["top_clusters"]:
            examples = "<br>".join(
                f"{highlight(e['edited_caption'], e['edit'].split(' → ')[-1])} ({e['delta_p_gt']:.2f})"
                for e in cluster["examples"]
            )
            body.append(
                f"<tr><td class='text'>{html.escape(entry['label_name'] or label)} ({label})</td>"
                f"<td class='text'>{html.escape(cluster['name'])}</td><td>{cluster['size']}</td>"
                f"<td>{cluster['delta_p_gt_mean']:.2f}</td><td class='text'>{examples}</td></tr>"
            )
    return f"<table>{head}{''.join(body)}</table>" if body else "<p>No clustered edits.</p>"


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
    plot_html = "\n".join(f"<img src='assets/{p.name}' alt='{p.stem}'>" for p in plots)
    if (out_dir / "strength.png").is_file():  # accuracy against edit strength (evaluation.harness writes it)
        plot_html += "\n<img src='strength.png' alt='strength'>"
    page = Template(TEMPLATE_PATH.read_text(encoding="utf-8")).substitute(
        title=html.escape(f"{model_label(results)} on {release.name} {release.version}"),
        release_name=html.escape(release.name),
        release_version=html.escape(release.version),
        manifest_sha256=html.escape(release.manifest_sha256[:16]),
        weights=html.escape(results["model"]["weights"]["id"]),
        timm_version=html.escape(results["packages"].get("timm", "?")),
        created_at=html.escape(results.get("run", {}).get("created_at", "")),
        headline_table=_headline_table(results) + _shift_table(results),
        sensitivity_table=_sensitivity_table(results),
        plots=plot_html,
        gallery=_gallery(rows, release, assets, gallery_size),
        insights=_insights(results),
    )
    path = out_dir / "report.html"
    path.write_text(page, encoding="utf-8")
    logger.debug("wrote report %s", path)
    return path
