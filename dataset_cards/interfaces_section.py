"""The card section of a dataset-interfaces release (generation mode): shifts, prompts, CLIP thresholds with their
provenance, the object-presence rule and where its thresholds come from, and yields per shift.

Read from the manifest only: ``source.shifts`` (each shift's name, prompt, shift caption, threshold, provenance and the
paper's yield, as :mod:`lance_pipeline.interfaces.shifts` records them), the filter stage's description in
``stages`` (its object rule and, for per-class thresholds, the thresholds file's content) and ``build.routing``
(where each generated image went: its shift config, ``rejected`` or ``not_released``). Empty for any other release.
"""

from __future__ import annotations

from typing import Any

from dataset_cards.markdown import code_span, md_escape


def shift_yields(manifest: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per shift: generated images ``kept`` (released in the shift's config), ``rejected`` and ``not_released``,
    summed over classes from ``build.routing`` (the first routed stage)."""
    routing = ((manifest.get("build") or {}).get("routing")) or {}
    yields: dict[str, dict[str, int]] = {}
    for stage in routing.values():
        for shift, per_class in (stage.get("groups") or {}).items():
            entry = yields.setdefault(shift, {"kept": 0, "rejected": 0, "not_released": 0})
            for targets in per_class.values():
                for target, count in targets.items():
                    if target == shift:
                        entry["kept"] += count
                    elif target == "rejected":
                        entry["rejected"] += count
                    else:
                        entry["not_released"] += count
        break  # one routed output per generation build; the first is the release's
    return yields


def filter_description(manifest: dict[str, Any]) -> dict[str, Any]:
    """The shift filter stage as the manifest describes it (``stages``), or its config options for older releases."""
    for description in (manifest.get("stages") or {}).values():
        if isinstance(description, dict) and description.get("type") == "shift_filter":
            return description
    for stage in (manifest.get("config") or {}).get("stages") or []:
        if stage.get("type") == "shift_filter":
            return dict(stage.get("options") or {})
    return {}


def object_rule_lines(manifest: dict[str, Any]) -> list[str]:
    """How object presence was judged, and where its thresholds come from."""
    described = filter_description(manifest)
    rule = described.get("object_rule")
    if rule is None:  # a release made before per-class thresholds existed
        rule = "global" if described.get("object_threshold") is not None else "off"
    if rule == "off":
        return [
            "- Object presence: **not filtered** (`object_filter: false`, set by this build's config). The paper "
            "filters it per class (Appendix A.3); images of this release may not show their class."
        ]
    if rule == "global":
        return [
            f"- Object presence: one threshold for every class, {described.get('object_threshold'):g} (set by this "
            "build's config). The paper sets one per class (Appendix A.3); this release does not follow that rule."
        ]
    data = described.get("object_thresholds_data") or {}
    clip = data.get("clip") or {}
    classes = data.get("classes") or {}
    counts = sorted(int(c.get("images", 0)) for c in classes.values())
    note = (
        f"the percentile's default ({data.get('percentile'):g}) is lance-cf's choice: the paper's value is not in "
        "the text this tool was built from"
        if data.get("percentile_is_default")
        else f"percentile {data.get('percentile'):g}, chosen by the builder (the paper's value is not in the text this "
        "tool was built from)"
    )
    return [
        f"- Object presence: per class, as in the paper (Appendix A.3). Each class's threshold is the "
        f'{data.get("percentile"):g}th percentile of the CLIP similarities between "a photo of a <class>" ("a '
        f"<class>\" for art styles) and that class's real images from {code_span(str(data.get('source')))}, computed "
        f"with CLIP {code_span(str(clip.get('model')))} ({md_escape(str(clip.get('pretrained')))}) by `lance-cf "
        f"interfaces calibrate` (file {code_span(str(described.get('object_thresholds')))}); {note}.",
        f"- Real images per class behind the thresholds: {counts[0] if counts else 0} to "
        f"{counts[-1] if counts else 0} ({len(classes)} classes); the values are in `manifest.json` "
        "(`stages.filter.object_thresholds_data`).",
    ]


def _threshold(value: Any) -> str:
    return "none (no shift criterion)" if value is None else f"{value:g}"


def _percent(value: Any) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def interfaces_section(manifest: dict[str, Any]) -> str:
    """The Markdown section for a generation-mode release ("" when the manifest records no shifts)."""
    source = manifest.get("source") or {}
    shifts = source.get("shifts") or []
    if source.get("kind") != "generate" or not shifts:
        return ""
    yields = shift_yields(manifest)
    lines = [
        "## Shifts (dataset interfaces)",
        "",
        "Each image was generated from a prompt naming the class by its learned token (`<TOKEN>`), then kept only when "
        'CLIP scored both the class (object caption) and the shift (shift caption, "a photo <shift>") at or above '
        "their thresholds (Vendrow et al., arXiv 2302.07865, §3.1 and Appendix A.3). Every image's metadata carries "
        "both scores, the thresholds and whether it passed.",
        "",
        *object_rule_lines(manifest),
        f"- Images generated per class per shift: {md_escape(source.get('per_class', '?'))}.",
        "",
        "| shift | prompt | shift caption | shift threshold | provenance | kept | rejected | not released | "
        "paper's yield |",
        "|---|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for shift in shifts:
        name = str(shift.get("name"))
        counts = yields.get(name, {})
        caption = shift.get("shift_caption")
        lines.append(
            f"| {code_span(name)} | {md_escape(str(shift.get('prompt')))} | "
            f"{md_escape(caption) if caption else '–'} | {_threshold(shift.get('threshold'))} | "
            f"{md_escape(str(shift.get('provenance')))} | {md_escape(counts.get('kept', 0))} | "
            f"{md_escape(counts.get('rejected', 0))} | {md_escape(counts.get('not_released', 0))} | "
            f"{_percent(shift.get('paper_yield'))} |"
        )
    lines += [
        "",
        "Kept, rejected and not released count generated images per shift (summed over classes; per class in "
        "`manifest.json`, `build.routing`). Rejected images are released in a `rejected` config only when the build "
        "asked for it; otherwise they are counted as not released. A `rejected` config is never scored as a shift. "
        "Prompts are the paper's Table 1 verbatim where the provenance says so, including its wording slips (\"in the "
        'road", "a orange", "panting"): they are the prompts ImageNet* was made with.',
        "",
    ]
    return "\n".join(lines)
