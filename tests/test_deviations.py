"""The tables of deviations from the papers, one per system and listed by the release kinds: docs generated from them,
rows decided from a release's manifest."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from lance_pipeline import deviations as dv

REPO = Path(__file__).resolve().parents[1]


def test_docs_method_holds_the_generated_tables():
    text = (REPO / "docs" / "method.md").read_text(encoding="utf-8")
    assert dv.DOCS_BEGIN in text and dv.DOCS_END in text
    block = text.split(dv.DOCS_BEGIN, 1)[1].split(dv.DOCS_END, 1)[0]
    assert block == "\n" + dv.render_markdown(), (
        "docs/method.md's deviations tables are stale: run `python -m lance_pipeline.deviations docs/method.md`"
    )
    for table in dv.all_tables():
        if table.rows:
            assert f"### {table.title}\n" in block


def test_update_docs_rewrites_only_the_block(tmp_path):
    page = tmp_path / "m.md"
    page.write_text(f"# head\n\n{dv.DOCS_BEGIN}\nold\n{dv.DOCS_END}\n\ntail\n", encoding="utf-8")
    assert dv.update_docs(page) is True
    text = page.read_text(encoding="utf-8")
    assert text.startswith("# head\n\n") and text.endswith(f"{dv.DOCS_END}\n\ntail\n") and "\nold\n" not in text
    assert dv.update_docs(page) is False
    (tmp_path / "none.md").write_text("no markers\n")
    with pytest.raises(ValueError, match="no generated deviations block"):
        dv.update_docs(tmp_path / "none.md")


def test_every_row_belongs_to_its_table_and_is_well_formed():
    seen = set()
    for row in (row for table in dv.all_tables() for row in table.rows):
        assert row.mode in {t.name for t in dv.all_tables()} and row in dv.rows_of(row.mode)
        assert (row.mode, row.topic) not in seen, f"duplicate topic {row.topic!r} in mode {row.mode}"
        seen.add((row.mode, row.topic))
        for text in (row.topic, row.paper, row.ours, row.why, row.change, row.applies_when):
            assert text.strip() and "\n" not in text
        # An old or partial manifest never makes a predicate raise: it just does not apply.
        assert row.applies({}) in (True, False)
        assert row.applies({"config": {"stages": [{"type": "llm_perturber"}]}, "stages": {"x": None}}) in (True, False)


def _lance_manifest(**changes):
    """A LANCE release's manifest with only the parts the rows read (config stages and their descriptions)."""
    manifest = {
        "config": {
            "stages": [
                {"name": n, "type": t}
                for n, t in (
                    ("caption", "blip2_captioner"),
                    ("perturb", "llm_perturber"),
                    ("label_check", "label_check"),
                    ("invert", "null_text_inversion"),
                    ("edit", "prompt_to_prompt_edit"),
                )
            ]
        },
        "stages": {
            "caption": {"type": "blip2_captioner", "label_conditioned": True},
            "perturb": {"type": "llm_perturber", "adapter": None, "edit_types": ["subject", "weather"]},
            "label_check": {"type": "label_check", "label_threshold": 0.5, "span_threshold": 0.8},
            "invert": {"type": "null_text_inversion", "inversion": "null_text"},
            "edit": {
                "type": "prompt_to_prompt_edit",
                "prompt_to_prompt": {
                    "selection": "best_directional",
                    "gates": {"directional": 0.2, "image": 0.7, "text": 0.2, "require_edited_closer": True},
                },
            },
        },
    }
    for path, value in changes.items():
        target = manifest["stages"]
        *keys, last = path.split("__")
        for key in keys:
            target = target[key]
        target[last] = value
    return manifest


def _topics(manifest):
    return {(d.mode, d.topic) for d in dv.deviations_for(manifest)}


def test_a_default_lance_release_gets_the_lance_rows_that_hold_and_no_other_mode():
    topics = _topics(_lance_manifest())
    assert [t.name for t, _ in dv.tables_for(_lance_manifest())] == ["lance"]
    assert {t for m, t in topics} >= {"perturber model", "edit types", "label check", "CLIP directional criterion"}
    assert {m for m, _ in topics} == {"lance"}
    # Rows caused only by a non-default option, or by the demo's switched-off filters, are absent.
    assert not {t for _, t in topics} & {"selection in the sweep", "inversion", "label check off", "CLIP gates off"}


def test_options_in_the_manifest_decide_which_rows_apply():
    with_adapter = _topics(_lance_manifest(perturb__adapter="org/lora"))
    assert ("lance", "perturber model") not in with_adapter
    assert ("lance", "edit types") not in _topics(_lance_manifest(perturb__edit_types=["subject"]))
    assert ("lance", "selection in the sweep") in _topics(
        _lance_manifest(edit__prompt_to_prompt__selection="largest_passing")
    )
    assert ("lance", "inversion") in _topics(_lance_manifest(invert__inversion="direct"))
    demo_like = _lance_manifest(
        label_check__label_threshold=None,
        label_check__span_threshold=None,
        edit__prompt_to_prompt__gates={
            "directional": -1.0,
            "image": -1.0,
            "text": -1.0,
            "require_edited_closer": False,
        },
    )
    topics = _topics(demo_like)
    assert {("lance", "label check off"), ("lance", "CLIP gates off")} <= topics
    assert not {("lance", "label check"), ("lance", "CLIP directional criterion")} & topics


def _dillema_manifest(keep_per_edit=1, images_per_edit=5, directional=0.2, condition="canny"):
    return {
        "config": {"stages": [{"type": t} for t in ("blip2_captioner", "dillema_keywords", "controlnet_edit")]},
        "stages": {
            "edit": {
                "type": "controlnet_edit",
                "controlnet_editing": {
                    "condition": {"name": condition},
                    "candidates": {"images_per_edit": images_per_edit, "conditioning_scales": [1.0],
                                   "keep_per_edit": keep_per_edit},
                    "gates": {"directional": directional, "image": -1.0, "text": -1.0, "require_edited_closer": False},
                },
            }
        },
    }  # fmt: skip


def test_a_dillema_release_gets_dillema_rows_by_its_selection():
    filtered = _topics(_dillema_manifest())
    assert [t.name for t, _ in dv.tables_for(_dillema_manifest())] == ["dillema"]
    assert {("dillema", "condition"), ("dillema", "automatic filter"), ("dillema", "images kept")} <= filtered
    as_published = _topics(_dillema_manifest(keep_per_edit=5, directional=-1.0))
    assert ("dillema", "condition") in as_published
    assert not {("dillema", "automatic filter"), ("dillema", "images kept")} & as_published
    assert ("dillema", "condition") not in _topics(_dillema_manifest(condition="depth"))


def test_perturber_training_rows_reach_the_docs_but_never_a_release():
    assert dv.rows_of("perturber") and not {t.name: t for t in dv.all_tables()}["perturber"].releases
    everything = copy.deepcopy(_lance_manifest())
    everything["config"]["stages"] += _dillema_manifest()["config"]["stages"]
    assert all(d.mode != "perturber" for d in dv.deviations_for(everything))
    assert "### Perturber training" in dv.render_markdown()
    with pytest.raises(ValueError, match="unknown deviation table"):
        dv.rows_of("nope")


def test_dillema_selection_and_the_card_section_follow_the_manifest():
    from dataset_cards.deviations_section import deviations_section

    assert dv.dillema_selection(_lance_manifest()) is None
    assert dv.dillema_selection(_dillema_manifest()) == "lance"  # gates filter, the best of 5 kept
    assert dv.dillema_selection(_dillema_manifest(directional=-1.0)) == "lance"  # no gate, but 1 of 5 kept
    assert dv.dillema_selection(_dillema_manifest(keep_per_edit=5, directional=-1.0)) == "dillema"
    with_label_check = _dillema_manifest(keep_per_edit=5, directional=-1.0)
    with_label_check["stages"]["label_check"] = {"type": "label_check", "label_threshold": 0.5}
    assert dv.dillema_selection(with_label_check) == "lance"

    section = deviations_section(_dillema_manifest())
    assert section.startswith("## Deviations from the papers\n") and "**DILLEMA (the ControlNet editor)**" in section
    assert "| images kept |" in section and "| perturber model |" not in section
    assert "| images kept |" not in deviations_section(_dillema_manifest(keep_per_edit=5, directional=-1.0))
    assert deviations_section({"config": {"stages": []}}) == ""
