"""compare-editors across the three editor families on the same source images and edits: the offline demos of
prompt-to-prompt (``demo``), ControlNet (``demo-controlnet``) and an instruction editor (``demo-instruct``), each built
through the engine with the preservation stage, then compared by ``lance-cf compare-editors``, and the comparison put on
``demo-instruct``'s card by ``lance-cf add-comparison`` (README's walk). The three releases are the session's shared
builds (``shared_release``), which other modules read too; this test only reads them."""

from __future__ import annotations

import json

import pytest
from builder_helpers import DEMO_INSTRUCT, demo_instruct_config

from builder import release_format as rf
from builder.cli import main
from builder.release_format.verify import verify_release
from evaluation.fidelity import table_markdown

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # three demo builds, when no other test has asked for them yet

PRESETS = {"demo": "prompt_to_prompt", "demo-controlnet": "controlnet", "demo-instruct": None}


def test_compare_editors_reads_every_familys_gates_cost_and_preservation(shared_release, tmp_path, capsys):
    releases = {
        "demo": shared_release("demo"),
        "demo-controlnet": shared_release("demo-controlnet"),
        "demo-instruct": shared_release.of_config(DEMO_INSTRUCT, demo_instruct_config),
    }
    argv = ["compare-editors", "--no-clip", "--output", str(tmp_path / "cmp")]
    for release in releases.values():
        argv += ["--release", str(release)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    summary = json.loads((tmp_path / "cmp" / "fidelity.json").read_text())
    table = summary["table"]
    editors = {r["editor"] for r in table}
    assert {"prompt_to_prompt", "controlnet"} < editors and len(editors) == 3  # the instruction editor is the third
    for preset, release in releases.items():
        manifest = json.loads((release / "manifest.json").read_text())
        record = manifest["screening"]["preservation"]["by_editor"]
        (editor,) = record
        assert PRESETS[preset] in (None, editor)
        overall = next(r for r in table if r["editor"] == editor and r["edit_type"] == "all")
        counted = record[editor]["all"]
        # the table's columns are the manifest's counts, divided
        assert overall["gate_kept"] == pytest.approx(counted["edits_kept"] / counted["edits"])
        assert overall["forward_equivalents_per_kept"] == pytest.approx(
            counted["forward_equivalents"] / counted["edits_kept"]
        )
        assert overall["forward_equivalents_per_kept"] > 0 and overall["tflops_per_kept"] > 0
        # preservation from each counterfactual's metadata (LPIPS measured at build time)
        assert overall["lpips"] == pytest.approx(counted["preservation_lpips"], abs=1e-6)
        assert overall["n"] == counted["n"] == manifest["counts"]["counterfactual"]["total"]
        assert overall["label_kept"] in ("not judged", "not calibrated")  # no calibrated judge in the demos
    samples = (tmp_path / "cmp" / "fidelity_samples.csv").read_text()
    assert "computed" not in samples.split("\n", 1)[1]  # every row's preservation came from its metadata
    assert "forward_equivalents_per_kept" in printed and (tmp_path / "cmp" / "fidelity.png").stat().st_size > 0

    # The next step of README's walk: the table and the plot onto demo-instruct's card, in its next version.
    assert main(["add-comparison", str(releases["demo-instruct"]), str(tmp_path / "cmp"), "--output",
                 str(tmp_path / "instruct-1.1")]) == 0  # fmt: skip
    assert verify_release(tmp_path / "instruct-1.1") == []
    card = (tmp_path / "instruct-1.1" / rf.CARD_NAME).read_text()
    section = card[card.index("## Editors compared") : card.index("## How it was built")]
    assert table_markdown(table, escaped=True).strip() in section
    assert f"]({rf.COMPARISON_PLOT})" in section and (tmp_path / "instruct-1.1" / rf.COMPARISON_PLOT).is_file()
    for entry in summary["releases"]:
        assert f"`{entry['config_hash']}`" in section
    assert f"{summary['shared_sources']} source images have counterfactuals in every release" in section
