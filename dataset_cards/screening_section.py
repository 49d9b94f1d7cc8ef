"""The card's screening paragraphs (in "Ethics and limitations"): what the release screens marked and removed.

Read from the manifest's ``screening`` (one entry per screening stage, written by the builder from what each stage
decided: ``lance_pipeline.screening``) and its ``config.stages`` (the screen's mode). A release built without screens
says so, since a reader should not assume a check that did not run.
"""

from __future__ import annotations

from typing import Any

from dataset_cards.markdown import code_span, md_escape


def screening_section(manifest: dict[str, Any]) -> str:
    """Markdown for the ethics part of the card (always a paragraph: what ran, or that nothing did)."""
    screening = manifest.get("screening") or {}
    modes = {
        s.get("name"): (s.get("options") or {}).get("screen", "flag")
        for s in (manifest.get("config") or {}).get("stages") or []
        if isinstance(s, dict)
    }
    sensitive = {k: v for k, v in screening.items() if v.get("kind") == "sensitive_edits"}
    safety = {k: v for k, v in screening.items() if v.get("kind") == "safety_checker"}
    lines = []
    if sensitive:
        lines += [
            "- **Sensitive edits.** Edits that add, remove or change a perceived protected attribute of a person "
            "(gender, race or ethnicity, age, religion, body or disability) were screened with a word list "
            "(selected from HolisticBias, Smith et al. 2022) and all-MiniLM-L6-v2 (`lance_pipeline/screening`). "
            "Marked samples carry `sensitive_edit`, `sensitive_attributes` and `sensitive_triggers` in their "
            "metadata; review them before drawing conclusions about people.",
            "",
            "  | screen | mode | screened | marked | dropped | by attribute |",
            "  |---|---|---|---|---|---|",
        ]
        for name, entry in sorted(sensitive.items()):
            attributes = ", ".join(
                f"{md_escape(a)}: {md_escape(n)}" for a, n in (entry.get("by_attribute") or {}).items()
            )
            counts = " | ".join(md_escape(entry.get(k, 0)) for k in ("checked", "marked", "dropped"))
            lines.append(
                f"  | {code_span(name)} | {md_escape(modes.get(name, 'flag'))} | {counts} | {attributes or '—'} |"
            )
        lines.append("")
    else:
        lines.append(
            "- **Sensitive edits.** No sensitive-edit screen ran on this release: edits may change the perceived "
            "gender, race, age, religion or body of people without being marked."
        )
    if safety:
        models = sorted({str((manifest.get("stages") or {}).get(k, {}).get("model")) for k in safety})
        checked = sum(int(e.get("checked", 0)) for e in safety.values())
        flagged = sum(int(e.get("flagged", 0)) for e in safety.values())
        per_stage = ", ".join(f"{code_span(k)}: {md_escape(e.get('flagged', 0))} of {md_escape(e.get('checked', 0))}"
                              for k, e in sorted(safety.items()))  # fmt: skip
        lines.append(
            f"- **Safety checker.** Stable Diffusion's safety checker ({', '.join(code_span(m) for m in models)}) "
            f"scored {checked} generated images and flagged {flagged} ({per_stage}); flagged images are not in the release and are listed in `manifest.json` "
            "under `failures` with their scores. It is a coarse NSFW filter, not a review."
        )
    else:
        lines.append("- **Safety checker.** No safety checker ran on this release's images.")
    if (manifest.get("config") or {}).get("safety") == "off":
        lines.append(
            "- **Safety checking is off** (`safety: off` in the build config): generated or edited images of this "
            "release may have been released without Stable Diffusion's safety checker screening them."
        )
    return "\n".join(lines) + "\n"
