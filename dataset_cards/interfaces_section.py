"""The card section of a dataset-interfaces release (generation mode): shifts, prompts, CLIP thresholds with their
provenance, and yields per shift.

Read from the manifest only: ``source.shifts`` (each shift's name, prompt, shift caption, threshold and provenance, as
:mod:`lance_pipeline.interfaces.shifts` records them), the filter stage's ``object_threshold`` and ``build.routing`` (where each
generated image went: its shift config, ``rejected`` or ``not_released``). Empty for any other release.
"""

from __future__ import annotations

from typing import Any

from dataset_cards.markdown import code_span, md_escape

PROVENANCE = {
    "confirmed": "prompt as in MadryLab's notebook",
    "inferred": "prompt inferred from the released shift key",
    "yours": "set by this build's config",
}


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


def _object_threshold(manifest: dict[str, Any]) -> Any:
    for stage in (manifest.get("config") or {}).get("stages") or []:
        if stage.get("type") == "shift_filter":
            return (stage.get("options") or {}).get("object_threshold")
    return None


def _threshold(value: Any) -> str:
    return "unknown (keeps every image)" if value is None else f"{value:g}"


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
        "CLIP scored both the class (object caption) and the shift (shift caption) at or above the thresholds "
        "(Vendrow et al., arXiv 2302.07865). Every image's metadata carries both scores, the thresholds and whether it "
        "passed. A threshold marked unknown was not published with ImageNet*; such a shift keeps every image.",
        "",
        f"- Object-presence threshold: {_threshold(_object_threshold(manifest))}; images per class per shift: "
        f"{source.get('per_class', '?')}.",
        "",
        "| shift | prompt | shift caption | shift threshold | provenance | kept | rejected | not released |",
        "|---|---|---|---:|---|---:|---:|---:|",
    ]
    for shift in shifts:
        name = str(shift.get("name"))
        counts = yields.get(name, {})
        provenance = PROVENANCE.get(str(shift.get("provenance")), str(shift.get("provenance")))
        caption = shift.get("shift_caption")
        lines.append(
            f"| {code_span(name)} | {md_escape(str(shift.get('prompt')))} | "
            f"{md_escape(caption) if caption else '–'} | {_threshold(shift.get('threshold'))} | "
            f"{md_escape(provenance)} | {counts.get('kept', 0)} | {counts.get('rejected', 0)} | "
            f"{counts.get('not_released', 0)} |"
        )
    lines += [
        "",
        "Kept, rejected and not released count generated images per shift (summed over classes; per class in "
        "`manifest.json`, `build.routing`). Rejected images are released in a `rejected` config only when the build "
        "asked for it; otherwise they are counted as not released.",
        "",
    ]
    return "\n".join(lines)
