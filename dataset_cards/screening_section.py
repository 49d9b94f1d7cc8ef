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
    lines += judge_lines(manifest)
    if (manifest.get("config") or {}).get("safety") == "off":
        lines.append(
            "- **Safety checking is off** (`safety: off` in the build config): generated or edited images of this "
            "release may have been released without Stable Diffusion's safety checker screening them."
        )
    return "\n".join(lines) + "\n"


def judge_removed(manifest: dict[str, Any]) -> dict[str, int]:
    """Per config, the samples the build's judge stages removed (``filter_below``); empty when none did."""
    removed: dict[str, int] = {}
    for entry in (manifest.get("screening") or {}).values():
        if isinstance(entry, dict) and entry.get("kind") == "judge":
            for config, n in (entry.get("removed_by_config") or {}).items():
                removed[config] = removed.get(config, 0) + int(n)
    return removed


def judge_lines(manifest: dict[str, Any]) -> list[str]:
    """The judge's bullet (only where a judge stage ran): which model, what it asked, what it removed, per config."""
    screening = manifest.get("screening") or {}
    judged = {k: v for k, v in screening.items() if v.get("kind") == "judge"}
    if not judged:
        return []
    stages = manifest.get("stages") or {}
    records = [stages.get(k) or {} for k in sorted(judged)]
    models = sorted({f"{r.get('model')}@{str(r.get('revision'))[:12]}" if r.get("revision") else str(r.get("model"))
                     for r in records})  # fmt: skip
    licences = sorted({str(r.get("license")) for r in records})
    checked = sum(int(e.get("checked", 0)) for e in judged.values())
    removed = judge_removed(manifest)
    thresholds = sorted({r.get("filter_below") for r in records if r.get("filter_below") is not None})
    if thresholds:
        per_config = ", ".join(f"{code_span(c)}: {md_escape(n)}" for c, n in sorted(removed.items())) or "none"
        outcome = (
            f"samples with `judge_class_p` below {', '.join(md_escape(t) for t in thresholds)} were removed "
            f"({per_config}) and are listed in `manifest.json` under `failures` with their scores"
        )
    else:
        outcome = "it removed nothing (no `filter_below`)"
    first = records[0]
    return [
        f"- **Judge.** {', '.join(code_span(m) for m in models)} (licence {', '.join(md_escape(x) for x in licences)}) "
        f'scored {checked} edited or generated images, VQAScore-style (the probability of the answer "Yes"): '
        f"`judge_class_p` for {code_span(first.get('class_question'))} and `judge_edit_p` for "
        f"{code_span(first.get('edit_question'))} (null for images that are not edits); {outcome}. The judge's "
        "agreement with people is only known where a review study measured it."
    ]
