"""ImageNet*'s shift table and filter rules against the paper (Vendrow et al., arXiv 2302.07865, Table 1, A.3),
read independently of the module's constants: from a copy typed from the paper (tests/data) and, where the checkout
has it beside it, from the paper's text itself."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lance_pipeline.interfaces.shifts import (
    CORRECTED_VARIANTS,
    IMAGENET_STAR_SHIFTS,
    MAX_SHIFT_NAME,
    TOKEN_PLACEHOLDER,
    Shift,
    shifts_by_name,
)

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "tests" / "data" / "imagenet_star_table1.txt"
ART_STYLES = {"oil_painting", "pencil_sketch", "embroidery"}  # §3.1 footnote 2: "no longer a photo"


def _restore_space(prompt: str) -> str:
    """Our text of the paper lost the space after <class> ("<class>in the grass")."""
    return re.sub(r"<class>(?=\w)", "<class> ", prompt)


def typed_table() -> list[dict]:
    rows = []
    for line in TABLE.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, key, prompt, threshold, paper_yield = (cell.strip() for cell in line.split("|"))
        rows.append({
            "shift": name,
            "key": key,
            "prompt": _restore_space(prompt),
            "threshold": None if threshold == "-" else float(threshold),
            "yield": round(float(paper_yield.rstrip("%")) / 100, 6),
        })  # fmt: skip
    return rows


def _shared() -> Path | None:
    """The shared papers folder: in the checkout, or beside it (CI clones the repository with shared/ at ../shared)."""
    for candidate in (REPO / "shared", REPO.parent / "shared", REPO.parent.parent / "shared"):
        if (candidate / "papers").is_dir():
            return candidate
    return None


def test_the_23_shifts_and_base_are_the_papers_table_1_verbatim():
    table = typed_table()
    assert len(table) == 24 and table[0]["key"] == "base"
    assert [s.name for s in IMAGENET_STAR_SHIFTS] == [row["key"] for row in table]  # the paper's order
    for shift, row in zip(IMAGENET_STAR_SHIFTS, table, strict=True):
        assert shift.prompt == row["prompt"].replace("<class>", TOKEN_PLACEHOLDER), shift.name
        assert shift.threshold == row["threshold"], shift.name
        assert shift.paper_yield == pytest.approx(row["yield"], abs=1e-9), shift.name
        assert shift.provenance == "paper, Table 1"
        # Appendix C: the shift caption is "a photo <shift>", with the shift's name as Table 1 writes it.
        assert shift.shift_caption == (None if row["key"] == "base" else f"a photo {row['shift']}")
        assert shift.style == (row["key"] in ART_STYLES)
        assert shift.object_caption("tench") == ("a tench" if shift.style else "a photo of a tench")
    # every shift but base has its threshold: none passes every image any more
    assert all(s.threshold is not None for s in IMAGENET_STAR_SHIFTS[1:])


def test_corrected_wordings_are_separately_named_variants_never_the_default():
    names = {s.name for s in shifts_by_name()}
    assert names == {row["key"] for row in typed_table()}
    for variant in CORRECTED_VARIANTS:
        assert variant.name.endswith("_corrected") and variant.name not in names
        assert variant.provenance.startswith("ours:")
    road = shifts_by_name(["on_the_road_corrected"])[0]
    assert road.prompt == f"A photo of a {TOKEN_PLACEHOLDER} on the road"
    assert road.threshold == 0.154 and road.shift_caption == "a photo on the road"  # the paper's caption and value


def test_typed_table_equals_the_paper_text_and_the_reference_note():
    shared = _shared()
    if shared is None:
        pytest.skip(
            "no shared/ folder beside the checkout: the paper's text is not here to compare the typed copy with"
        )
    paper = (shared / "papers" / "dataset-interfaces-vendrow-2023.md").read_text(encoding="utf-8")
    lines = paper[paper.index("Shift Name | Prompt | CLIP Threshold | % Yield") :].splitlines()[1:25]
    from_paper = []
    for line in lines:
        cells = [c.strip() for c in line.split("|")]
        name = cells[0].strip("“”")
        if name == "base":  # the text shifts base's yield into the threshold column (it has no threshold)
            threshold, paper_yield = None, cells[2]
        else:
            threshold, paper_yield = float(cells[2]), cells[3]
        from_paper.append((name, _restore_space(cells[1]), threshold, round(float(paper_yield.rstrip("%")) / 100, 6)))
    assert from_paper == [(r["shift"], r["prompt"], r["threshold"], r["yield"]) for r in typed_table()]
    note = (shared / "reference" / "imagenet-star-table1.md").read_text(encoding="utf-8")
    for row in typed_table():
        assert f"| {row['shift']} | {row['prompt']} |" in note


def test_shifts_command_lists_the_table_in_text_and_json(capsys, lance_cf):
    code, out, _ = lance_cf("interfaces", "shifts", "--format", "json")
    assert code == 0
    rows = json.loads(out)
    default = [r for r in rows if r["default"]]
    assert [(r["name"], r["threshold"], r["paper_yield"]) for r in default] == [
        (row["key"], row["threshold"], row["yield"]) for row in typed_table()
    ]
    assert {"name", "prompt", "shift_caption", "threshold", "provenance", "paper_yield", "object_caption"} <= set(
        rows[0]
    )
    assert {r["name"] for r in rows if not r["default"]} == {v.name for v in CORRECTED_VARIANTS}
    code, out, _ = lance_cf("interfaces", "shifts")
    assert code == 0
    line = next(line for line in out.splitlines() if line.startswith("on_the_road "))
    assert "A photo of a <TOKEN> in the road" in line and "a photo on the road" in line and "0.154" in line
    assert "64.5%" in line and "paper, Table 1" in line


def test_shift_names_are_checked_before_any_work():
    with pytest.raises(ValueError, match=f"at most {MAX_SHIFT_NAME}"):
        Shift("x" * 300, f"a photo of a {TOKEN_PLACEHOLDER}", None)
    with pytest.raises(ValueError, match="lowercase"):
        Shift("Snow", f"a photo of a {TOKEN_PLACEHOLDER}", None)
    with pytest.raises(ValueError, match="did you mean in_the_snow"):
        shifts_by_name(["in_the_snwo"])


def _star_manifest(rule="per_class", percentile_is_default=True, provenance="paper, Table 1", plain=False):
    return {
        "config": {"stages": [{"name": "generate", "type": "shift_generation"}, {"name": "filter",
                                                                                  "type": "shift_filter"}]},
        "source": {"kind": "generate", "shifts": [
            {"name": "base", "threshold": None, "provenance": provenance},
            {"name": "in_the_snow", "threshold": 0.16, "provenance": provenance},
        ]},
        "stages": {
            "generate": {"type": "shift_generation", "plain_prompt": plain},
            "filter": {"type": "shift_filter", "object_rule": rule,
                       "object_thresholds_data": {"percentile": 5.0, "percentile_is_default": percentile_is_default}},
        },
    }  # fmt: skip


def test_the_deviations_of_an_interfaces_release_are_decided_from_its_manifest():
    from lance_pipeline import deviations as dv

    def topics(manifest):
        return {t for m, t in ((d.mode, d.topic) for d in dv.deviations_for(manifest)) if m == "interfaces"}

    assert [t.name for t, _ in dv.tables_for(_star_manifest())] == ["interfaces"]
    faithful = topics(_star_manifest())
    assert faithful == {"object-threshold percentile", "art-style object thresholds", "shift thresholds reused",
                        "seeds", "token training precision"}  # fmt: skip
    assert "object-threshold percentile" not in topics(_star_manifest(percentile_is_default=False))
    demo_like = topics(_star_manifest(rule="global", provenance="yours"))
    assert {"object filter not per class", "shifts not the paper's"} <= demo_like
    assert not demo_like & {"object-threshold percentile", "art-style object thresholds", "shift thresholds reused"}
    assert "token training precision" not in topics(_star_manifest(plain=True))
    # the docs table has the mode's rows
    assert "### Dataset interfaces (ImageNet*)" in (REPO / "docs" / "method.md").read_text(encoding="utf-8")


def test_presets_show_comments_a_star_preset_with_its_own_configs(capsys, lance_cf):
    for preset in ("imagenet-star", "demo-star"):
        code, out, _ = lance_cf("presets", "--show", preset)
        assert code == 0
        line = next(line for line in out.splitlines() if line.startswith("configs:"))
        assert "base and the shifts" in line and "original" not in line and "counterfactual" not in line
    code, out, _ = lance_cf("presets", "--show", "demo")  # a LANCE preset keeps LANCE's comment
    assert "original, reconstructed, counterfactual" in next(ln for ln in out.splitlines() if ln.startswith("configs:"))
