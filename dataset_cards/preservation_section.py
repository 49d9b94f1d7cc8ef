"""The card's "Preservation of the source image" section: how much of each source image the edits left alone.

Read from the manifest's ``screening`` entry of kind ``preservation`` (``lance_pipeline.preservation``: the means of
LPIPS, PSNR and SSIM per editor and edit type, over the whole image and outside the object) and the stage's options
in ``config.stages`` (which LPIPS backbone; whether masks were given). A release built without the stage has no
section.
"""

from __future__ import annotations

from typing import Any

from dataset_cards.markdown import code_span, md_escape

COLUMNS = (
    ("preservation_lpips", "LPIPS ↓"),
    ("preservation_psnr", "PSNR dB ↑"),
    ("preservation_ssim", "SSIM ↑"),
    ("preservation_lpips_outside", "LPIPS outside ↓"),
    ("preservation_psnr_outside", "PSNR outside ↑"),
    ("preservation_ssim_outside", "SSIM outside ↑"),
)


def _cell(value: Any) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "–"
    return f"{value:.2f}" if abs(value) >= 10 else f"{value:.3f}"


def preservation_section(manifest: dict[str, Any]) -> str:
    """Markdown for the card ("" when no preservation stage ran)."""
    screening = manifest.get("screening") or {}
    entries = {k: v for k, v in screening.items() if isinstance(v, dict) and v.get("kind") == "preservation"}
    if not entries:
        return ""
    stages = {s.get("name"): s for s in (manifest.get("config") or {}).get("stages") or [] if isinstance(s, dict)}
    lines = [
        "## Preservation of the source image",
        "",
        "How much of its source image each counterfactual keeps (`lance_pipeline/preservation.py`): LPIPS (Zhang "
        "et al. 2018, VGG, v0.1; lower = closer), PSNR (dB) and SSIM (Wang et al. 2004) against the source image, "
        "over the whole image and outside the object where an object mask was given. Means over the released "
        "counterfactuals; "
        "each sample's values are in its metadata (`preservation_lpips`, `preservation_psnr`, `preservation_ssim` "
        "and their `_outside` forms).",
        "",
    ]
    for name, entry in sorted(entries.items()):
        options = (stages.get(name) or {}).get("options") or {}
        backbone = str(options.get("lpips_backbone") or "timm/vgg16.tv_in1k")
        if backbone.startswith("demo:"):
            lines += [
                f"- LPIPS's backbone here is {code_span(backbone)}, random weights: its LPIPS numbers measure nothing "
                "perceptual.",
            ]
        else:
            lines += [f"- LPIPS's VGG16 backbone: {code_span(backbone)}."]
        if not options.get("masks"):
            lines += ["- No object masks were given: the outside-the-object columns are empty."]
        lines += [
            "- Kept by the gates: the share of the edits given to the editor that its gates kept; cost per kept: "
            "network forward-equivalents (every forward of the editor's and the gates' networks, null-text inversion "
            "included where the editor needs one) and TFLOPs, counted by hooks during the build, over the kept edits.",
            "",
            "| editor | edit type | n | kept by the gates | forward-equivalents per kept | TFLOPs per kept | "
            + " | ".join(t for _, t in COLUMNS)
            + " |",
        ]
        lines += ["|---|---|---|---|---|---|" + "---|" * len(COLUMNS)]
        for editor, by_type in sorted((entry.get("by_editor") or {}).items()):
            ordered = sorted(by_type.items(), key=lambda kv: (kv[0] == "all", kv[0]))
            for edit_type, stats in ordered:
                cells = " | ".join(_cell(stats.get(field)) for field, _ in COLUMNS)
                edits, kept = stats.get("edits"), stats.get("edits_kept")
                numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (edits, kept))
                share = f"{kept / edits:.0%} ({md_escape(kept)} of {md_escape(edits)})" if numbers and edits else "–"
                per_kept = [
                    _cell(stats.get(name) / kept / scale)
                    if numbers and kept and isinstance(stats.get(name), (int, float))
                    else "–"
                    for name, scale in (("forward_equivalents", 1.0), ("flops", 1e12))
                ]
                lines.append(
                    f"| {md_escape(editor)} | {md_escape(edit_type)} | {md_escape(stats.get('n', 0))} | {share} | "
                    f"{' | '.join(per_kept)} | {cells} |"
                )
        lines.append("")
    return "\n".join(lines) + "\n"
