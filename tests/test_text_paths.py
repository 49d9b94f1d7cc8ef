"""One path for text from data into the card (Markdown), pages (HTML) and exports (CSV).

Two kinds of test: rules that fail when package code writes one of these outside its path (a CSV written without
``write_csv``, a Jinja2 environment other than the two sanctioned ones, a template that turns escaping off, a card
value that is not ``Markdown``), and renders of a release whose every free-text field holds hostile strings, checked
for any of them raw.
"""

from __future__ import annotations

import ast
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest
from release_fixture import write_release

from builder import release_format as rf
from builder.release_format.text_out import csv_cell, write_csv
from dataset_cards import render_release_card
from dataset_cards.markdown import Markdown, card_value, markdown_template

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("builder", "lance_pipeline", "dataset_cards", "evaluation")

HOSTILE = (
    "<img src=x onerror=alert(1)>",
    "![tracker](https://evil.example/pixel.png)",
    "[click](javascript:alert(1))",
    "</td><script>alert(2)</script>",
    "ok\n# injected heading\n",
    "| cell | break |",
    "<!-- comment",
)
FORMULA = '=HYPERLINK("https://evil.example","x")'


def _package_files():
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


def _calls(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else None
            yield node.lineno, owner, name


# -- rules -------------------------------------------------------------------------------------------------------------
SANCTIONED = {
    "csv": {"builder/release_format/text_out.py"},
    "jinja": {"builder/release_format/text_out.py", "dataset_cards/markdown.py"},
}


@pytest.mark.slow
def test_every_csv_and_every_template_environment_goes_through_its_escaping_path():
    offenders = []
    for path in _package_files():
        rel = path.relative_to(ROOT).as_posix()
        for line, owner, name in _calls(path):
            if name == "to_csv" or (owner == "csv" and name in ("writer", "DictWriter")):
                if rel not in SANCTIONED["csv"]:
                    offenders.append(f"{rel}:{line}: writes CSV without builder.release_format.text_out.write_csv")
            if name in ("Environment", "Template", "from_string") and rel not in SANCTIONED["jinja"]:
                offenders.append(
                    f"{rel}:{line}: a Jinja2 environment or template of its own (use text_out.html_environment or "
                    "dataset_cards.markdown.markdown_template)"
                )
    assert offenders == []


def test_no_template_or_page_script_turns_escaping_off():
    offenders = []
    for path in [*ROOT.glob("*/templates/*"), *ROOT.glob("*/*/templates/*")]:
        text = path.read_text(encoding="utf-8")
        if re.search(r"\|\s*safe\b|autoescape\s+false|Markup\(", text):
            offenders.append(path.relative_to(ROOT).as_posix())
    for path in ROOT.glob("builder/review/static/*.js"):
        if re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write", path.read_text(encoding="utf-8")):
            offenders.append(path.relative_to(ROOT).as_posix())
    assert offenders == []


def test_a_card_value_that_skipped_the_escaper_stops_the_render():
    template = markdown_template("# {{ title }}\n")
    assert template.render(title=Markdown("ok")) == "# ok"
    with pytest.raises(TypeError, match="is not Markdown: pass data through md_escape"):
        template.render(title="<img src=x>")
    assert card_value(3) == "3" and card_value(None) is None


def test_csv_cells_that_a_spreadsheet_would_run_are_neutralised_and_numbers_kept(tmp_path):
    assert [csv_cell(v) for v in ("=1+1", "+1", "-cmd", "@SUM(A1)", "\tx", "\rx", "plain", -0.5, 3)] == [
        "'=1+1",
        "'+1",
        "'-cmd",
        "'@SUM(A1)",
        "'\tx",
        "'\rx",
        "plain",
        -0.5,
        3,
    ]
    path = tmp_path / "t.csv"
    write_csv(pd.DataFrame({"=bad column": [FORMULA, "fine"], "score": [-0.25, 1.0]}), path)
    read = pd.read_csv(path)
    assert list(read.columns) == ["'=bad column", "score"]
    assert read["'=bad column"].tolist() == ["'" + FORMULA, "fine"] and read["score"].tolist() == [-0.25, 1.0]


# -- renders of a hostile release --------------------------------------------------------------------------------------
def _hostile(i: int) -> str:
    return HOSTILE[i % len(HOSTILE)]


@pytest.fixture(scope="module")
def hostile_release(tmp_path_factory) -> tuple[Path, dict]:
    """A release whose class names, captions and card prose hold hostile strings, and whose manifest carries a human
    review with hostile questions, answers, seed, study name and reasons (as a tampered or careless record would)."""
    names = [f"cls{i} {_hostile(i)}" for i in range(4)]
    root = write_release(
        tmp_path_factory.mktemp("hostile") / "release",
        label_names=names,
        labels=(0, 1, 2),
        originals_per_class=1,
        edits_per_original=1,
        image_size=16,
    )
    manifest = json.loads((root / rf.MANIFEST_NAME).read_text())
    manifest["config"]["description"] = "a note " + HOSTILE[0] + HOSTILE[1]
    manifest["source"]["license"] = HOSTILE[1] + " licence"
    manifest["failures"] = [{"source_key": "x", "stage": HOSTILE[3], "reason": HOSTILE[0]}]
    manifest["review"] = {
        "study": {
            "name": HOSTILE[2],
            "seed": HOSTILE[0],
            "per_group": HOSTILE[1],
            "group_by": HOSTILE[4],
            "questions": [{"id": "q", "text": "Is it a {class}? " + HOSTILE[3], "answers": [HOSTILE[0], HOSTILE[1]]}],
        },
        "previous": {"name": "x", "version": HOSTILE[5], "manifest_sha256": "0"},
        "configs": ["counterfactual"],
        "items": 3,
        "raters": HOSTILE[0],
        "verdicts": {"accepted": HOSTILE[1], "rejected": 1},
        "reasons": {HOSTILE[0]: 1, FORMULA: 2, HOSTILE[6]: 1},
        "agreement": {HOSTILE[1]: {"raters": HOSTILE[0], "items": 2, "fleiss_kappa": HOSTILE[2], "cohen_kappa": 0.5}},
        "added_configs": [],
    }
    rf.seal_manifest(manifest)
    return root, manifest


def _raw(text: str) -> list[str]:
    return [h for h in (*HOSTILE, "<script", "<img") if h in text]


class _Tags(HTMLParser):
    """The tags, attributes and comments of an HTML document."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.comments: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_comment(self, data):
        self.comments.append(data)


def _rendered(markdown: str) -> _Tags:
    """The card's body as the Hub would show it: CommonMark with tables and raw HTML allowed."""
    from markdown_it import MarkdownIt

    parser = _Tags()
    parser.feed(MarkdownIt("commonmark", {"html": True}).enable("table").render(markdown))
    return parser


def test_the_card_of_a_hostile_release_carries_nothing_raw(hostile_release, tmp_path):
    root, manifest = hostile_release
    previous = {**manifest, "version": HOSTILE[0], "label_space": {"names": ["other " + HOSTILE[2]]}}
    text = render_release_card(root, manifest, previous_manifest=previous, output_dir=tmp_path)
    body = rf.split_card(text)[1]
    assert _raw(body) == []
    page = _rendered(body)
    assert [t for t, _ in page.tags if t in ("script", "iframe", "object", "embed")] == []
    assert [a["src"] for t, a in page.tags if t == "img" and not a.get("src", "").startswith("assets/")] == []
    assert [a.get("href") for t, a in page.tags if t == "a" and "evil" in a.get("href", "")] == []
    assert [a for _, a in page.tags if any(k.startswith("on") for k in a)] == []
    assert page.comments == []
    assert "# injected" not in [line.strip() for line in body.splitlines()]
    # the hostile values are there, escaped: nothing was dropped to pass the test
    assert "&lt;img src=x onerror=alert(1)&gt;" in body and "\\!\\[tracker\\]" in body
    assert "&lt;img src=x onerror=alert(1)&gt; reviewer(s)" in body  # the raters, as a tampered record holds them
    assert "seed &lt;img src=x onerror=alert(1)&gt;" in body  # the study's seed
    assert "(&lt;img src=x onerror=alert(1)&gt;, \\!\\[tracker\\]" in body  # the question's answers


def test_croissant_prose_of_a_hostile_release_carries_nothing_raw(hostile_release):
    from builder.croissant import croissant_about

    _, manifest = hostile_release
    about = croissant_about(rf.Manifest.from_dict(manifest))
    prose = json.dumps(about, ensure_ascii=False)
    strings = [v for v in _walk_strings(about)]
    assert [s for s in strings if _raw(s)] == [], prose[:2000]


def _walk_strings(node):
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _walk_strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk_strings(value)


def test_review_export_writes_a_formula_reason_as_text(tmp_path):
    from builder.review.store import JudgementStore

    store = JudgementStore(tmp_path, "sha")
    store.record("s", "r1", "counterfactual", "k", {"verdict": "rejected"}, reason=FORMULA)
    store.record("s", "r1", "counterfactual", "k2", {"verdict": "accepted", "q": "@SUM(1+1)"})
    path = tmp_path / "export.csv"
    store.export(path)
    text = path.read_text(encoding="utf-8")
    assert not re.search(r"(^|,)\s*\"?[=+@\-]", text.split("\n", 1)[1], re.MULTILINE), text
    rows = pd.read_csv(path)
    assert "'" + FORMULA in rows["reason"].tolist() and "'@SUM(1+1)" in rows["answer"].tolist()


def test_the_screening_section_of_a_tampered_record_carries_nothing_raw():
    from dataset_cards.screening_section import screening_section

    manifest = {
        "screening": {
            HOSTILE[3]: {
                "kind": "sensitive_edits",
                "checked": HOSTILE[0],
                "marked": HOSTILE[1],
                "dropped": 0,
                "by_attribute": {HOSTILE[2]: HOSTILE[6]},
            },
            "safety": {"kind": "safety_checker", "checked": 3, "flagged": 1},
            "judge": {"kind": "judge", "checked": 2, "removed_by_config": {HOSTILE[4]: 1}},
        },
        "stages": {
            "safety": {"model": HOSTILE[1]},
            "judge": {
                "model": HOSTILE[5],
                "revision": HOSTILE[6],
                "license": HOSTILE[2],
                "filter_below": HOSTILE[3],
                "class_question": HOSTILE[0],
                "edit_question": HOSTILE[1],
            },
        },
    }
    text = screening_section(manifest)
    assert text and _raw(text) == []
    assert "&lt;img src=x onerror=alert(1)&gt;" in text


def test_the_preservation_section_of_a_tampered_record_carries_nothing_raw():
    from dataset_cards.preservation_section import preservation_section

    stats = {"n": HOSTILE[0], "edits": HOSTILE[1], "edits_kept": 1, "forward_equivalents": HOSTILE[2]}
    manifest = {
        "screening": {
            "preservation": {
                "kind": "preservation",
                "by_editor": {HOSTILE[3]: {HOSTILE[4]: {**stats, "preservation_lpips": HOSTILE[5]}, "all": {"n": 2}}},
            }
        },
        "config": {"stages": [{"name": "preservation", "options": {"lpips_backbone": HOSTILE[6], "masks": "m"}}]},
    }
    text = preservation_section(manifest)
    assert text.startswith("## Preservation") and _raw(text) == []


def test_the_editors_section_of_a_tampered_record_carries_nothing_raw():
    from evaluation.editors_section import editors_section

    row = {"edit_type": HOSTILE[4], "editor": HOSTILE[0], "release": HOSTILE[5], "model": HOSTILE[1], "n": HOSTILE[2],
           "label_kept": HOSTILE[3], "gate_kept": 0.5}  # fmt: skip
    release = {"label": HOSTILE[5], "name": HOSTILE[2], "version": HOSTILE[6], "config_hash": HOSTILE[0],
               "counterfactuals": HOSTILE[1], "sources": HOSTILE[3]}  # fmt: skip
    manifest = {
        "name": "x",
        rf.EDITOR_COMPARISON: {
            "releases": [release],
            "models": [HOSTILE[0], HOSTILE[3]],
            "shared_sources": HOSTILE[1],
            "clip": {"model": HOSTILE[3], "pretrained": HOSTILE[0]},
            "table": [row],
        },  # fmt: skip
    }
    text = editors_section(manifest, plot=None)
    assert text.startswith("## Editors compared") and _raw(text) == []
    assert "# injected" not in [line.strip() for line in text.splitlines()]
    assert "&lt;img src=x onerror=alert(1)&gt;" in text and "\\!\\[tracker\\]" in text  # there, escaped
