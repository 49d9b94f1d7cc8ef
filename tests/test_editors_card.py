"""The editors comparison on a release's card: ``lance-cf compare-editors`` writes it, ``lance-cf add-comparison``
makes the release's next version whose manifest records it, and every render of the card (build, publish) shows the
``## Editors compared`` section with the table and the plot, which verify checks and publish uploads."""

from __future__ import annotations

import json

import pytest
from release_fixture import write_manifest, write_release

from builder import release_format as rf
from builder.cli import main
from builder.release_format.verify import verify_release
from evaluation.editors_section import COMPARISON_RECORD, EDITORS_HEADING, PLOT_PATH, editors_section
from evaluation.fidelity import table_markdown


def _editor_release(root, name: str, editor: str, seed: int):
    # Same source keys (src-LABEL-I) in both; another seed draws other pixels, so the editors' numbers differ.
    write_release(root, name=name, configs=("original", "counterfactual"), label_names=["a", "b|c"], labels=(0, 1),
                  seed=seed, originals_per_class=1, edits_per_original=2)  # fmt: skip
    manifest = json.loads((root / "manifest.json").read_text())
    del manifest["manifest_sha256"]
    manifest["stages"]["edit"] = {"type": "edit", "editing": {"editor": editor}}
    write_manifest(root, manifest)
    return root


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """Two releases of the same sources (editors ``ed_one`` and ``ed*two``, a name Markdown would read), a model's
    results on the second, and compare-editors' output."""
    root = tmp_path_factory.mktemp("cmp")
    one = _editor_release(root / "one", "rel-one", "ed_one", seed=0)
    two = _editor_release(root / "two", "rel-two", "ed*two", seed=1)
    sha = json.loads((two / "manifest.json").read_text())["manifest_sha256"]
    results = root / "eval" / "m" / "results.json"
    results.parent.mkdir(parents=True)
    results.write_text(json.dumps({
        "status": "ok", "release": {"name": "rel-two", "manifest_sha256": sha}, "model": {"name": "model|x"},
        "sensitivity": {"overall": {"paired_delta_acc1": -12.5, "flip_rate": 25.0}, "by_edit_type": {}},
    }))  # fmt: skip
    argv = ["compare-editors", "--release", str(one), "--release", str(two), "--no-clip", "--output", str(root / "c")]
    assert main([*argv, "--results", str(results.parent.parent)]) == 0
    return one, two, root / "c"


@pytest.mark.slow
def test_add_comparison_writes_a_next_version_that_verifies_with_the_section_and_plot(compared, tmp_path, capsys):
    one, two, cmp = compared
    summary = json.loads((cmp / "fidelity.json").read_text())
    assert [r["config_hash"] for r in summary["releases"]] == [
        json.loads((r / "manifest.json").read_text())["config_hash"] for r in (one, two)
    ]
    assert summary["models"] == ["model|x"] and summary["shared_sources"] == 2
    assert [r["counterfactuals"] for r in summary["releases"]] == [4, 4]

    new = tmp_path / "two-1.1"
    assert main(["add-comparison", str(two), str(cmp), "--output", str(new)]) == 0
    assert "rel-two 1.1.0" in capsys.readouterr().out
    assert verify_release(new) == []
    old_manifest = rf.load_manifest(two)
    manifest = rf.load_manifest(new)
    assert manifest.version == "1.1.0" and manifest.shards == old_manifest.shards  # the same shards, byte for byte
    assert manifest.extra[COMPARISON_RECORD]["table"] == summary["table"]
    assert PLOT_PATH in {a.path for a in manifest.assets} and (new / PLOT_PATH).stat().st_size > 0

    card = (new / rf.CARD_NAME).read_text()
    section = card[card.index(EDITORS_HEADING) : card.index("## How it was built")]
    # the table is compare-editors' own Markdown, text cells escaped (the editor `ed*two`, the model `model|x`)
    assert table_markdown(summary["table"], escaped=True).strip() in section
    assert "| all | ed\\*two | model\\|x |" in section and "| all | ed\\_one | – |" in section
    assert f"![Editors compared: per edit type and editor]({PLOT_PATH})" in section
    # which releases (name, version, config hash), how many shared images and edits, which models, costs by hooks
    assert f"| rel-one | `1.0.0` | `{summary['releases'][0]['config_hash']}` | `ed_one` | 4 (2) |" in section
    assert "| rel-two (this release's samples) | `1.0.0` |" in section
    assert "2 source images have counterfactuals in every release" in section
    assert "the model set model\\|x" in section and "counted by forward hooks at build time" in section

    # A tampered plot fails verify (it is a recorded asset); the untouched release stays as it was.
    (new / PLOT_PATH).write_bytes(b"not the plot")
    assert any(PLOT_PATH in p for p in verify_release(new))
    assert verify_release(two) == [] and EDITORS_HEADING not in (two / rf.CARD_NAME).read_text()


@pytest.mark.slow
def test_add_comparison_refuses_a_release_that_was_not_compared_and_a_non_comparison(compared, tmp_path, capsys):
    one, _, cmp = compared
    other = _editor_release(tmp_path / "other", "rel-other", "ed_one", seed=3)
    assert main(["add-comparison", str(other), str(cmp), "--output", str(tmp_path / "n")]) == 2
    err = capsys.readouterr().err
    assert "compared rel-one 1.0.0, rel-two 1.0.0, not rel-other 1.0.0" in err and len(err.strip().splitlines()) == 1
    assert main(["add-comparison", str(one), str(tmp_path), "--output", str(tmp_path / "n")]) == 2
    assert "no fidelity.json; give the --output folder of `lance-cf compare-editors`" in capsys.readouterr().err
    assert not (tmp_path / "n").exists()


def test_a_card_without_a_comparison_has_no_section():
    assert editors_section({"name": "x"}) == ""


@pytest.mark.slow  # two publishes to the Hub double
def test_the_published_card_shows_the_table_and_the_plot_file_it_links(compared, hub_env, tmp_path, capsys):
    """Through the Hub client to the Hub double (a real HTTP server), both ways: ``publish-comparison`` onto the card of
    a published release (a new commit, the tag not moved), then ``publish`` of the next version ``add-comparison``
    made. Each card read back from the repo has the table's rows and links the plot by a relative path to a file the
    repo holds."""
    from builder.publish import publish_release

    one, two, cmp = compared
    repo = "org/rel-two"
    first = publish_release(two, repo)
    # 1. publish-comparison: the card of the release on main gains the section; v1.0.0 stays where it was
    assert main(["publish-comparison", str(cmp), "--repo-id", repo]) == 0
    assert "results/editors/fidelity.png" in capsys.readouterr().out
    assert hub_env.resolve("datasets", repo, "v1.0.0") == first.commit != hub_env.resolve("datasets", repo, "main")
    entries = hub_env.entries("datasets", repo, "main")
    card = hub_env.read_file("datasets", repo, entries[rf.CARD_NAME]).decode()
    assert EDITORS_HEADING in card and "](results/editors/fidelity.png)" in card
    assert "| all | ed\\*two | model\\|x | 4 | -12.5 | 25.0 |" in card and "| all | ed\\_one | – | 4 |" in card
    assert entries["results/editors/fidelity.png"]["lfs"]["oid"] == rf.file_sha256(cmp / "fidelity.png")[0]
    # a comparison that did not include the release on the branch is refused, nothing committed
    other = tmp_path / "cmp-other"
    commits = len(hub_env.commits("datasets", repo))
    one_copy = tmp_path / "one-copy"
    assert main(["add-comparison", str(one), str(cmp), "--output", str(one_copy)]) == 0  # rel-one 1.1.0
    argv = ["compare-editors", "--release", str(one), "--release", str(one_copy), "--no-clip", "--output", str(other)]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(["publish-comparison", str(other), "--repo-id", repo]) == 1
    assert "not rel-two 1.0.0, the release org/rel-two@main holds" in capsys.readouterr().err
    assert len(hub_env.commits("datasets", repo)) == commits

    # 2. the next version made by add-comparison, published: its own card carries the section and the plot asset
    new = tmp_path / "two-1.1"
    assert main(["add-comparison", str(two), str(cmp), "--output", str(new)]) == 0
    assert publish_release(new, repo).tag == "v1.1.0"
    entries = hub_env.entries("datasets", repo, "v1.1.0")
    card = hub_env.read_file("datasets", repo, entries[rf.CARD_NAME]).decode()
    assert card.count(EDITORS_HEADING) == 1 and f"]({PLOT_PATH})" in card
    assert "| all | ed\\*two | model\\|x | 4 | -12.5 | 25.0 |" in card and "| all | ed\\_one | – | 4 |" in card
    recorded = {a.path: a.sha256 for a in rf.load_manifest(new).assets}
    assert entries[PLOT_PATH]["lfs"]["oid"] == recorded[PLOT_PATH] == rf.file_sha256(new / PLOT_PATH)[0]
