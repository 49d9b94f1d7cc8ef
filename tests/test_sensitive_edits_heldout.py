"""The sensitive-edit screen's word list on the held-out caption pairs of benchmarks/ (written by hand, from words
not taken from the list, before the screen's rules were tuned on the separate dev set): recall at least 95% and
precision at least 90%, counted here from the pairs' labels. The word-list path is deterministic and needs no model."""

from __future__ import annotations

import json
from pathlib import Path

from lance_pipeline.screening.sensitive_edits import list_changes

HELDOUT = Path(__file__).resolve().parents[1] / "benchmarks" / "sensitive_edits_heldout.jsonl"


def test_the_word_list_keeps_its_recall_and_precision_floor_on_the_held_out_pairs():
    pairs = [json.loads(line) for line in HELDOUT.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(pairs) >= 200 and sum(p["sensitive"] for p in pairs) >= 100
    # each protected attribute the screen must catch is covered, by adjectives, nouns and phrases
    covered = {(p["attribute"], p["form"]) for p in pairs if p["sensitive"]}
    for attribute in ("race_ethnicity", "body", "disability", "age", "religion"):
        assert {form for a, form in covered if a == attribute} >= {"adjective", "noun", "phrase"}, attribute
    flagged = [bool(list_changes(p["caption"], p["edited_caption"])) for p in pairs]
    true_positives = sum(f and p["sensitive"] for f, p in zip(flagged, pairs, strict=True))
    recall = true_positives / sum(p["sensitive"] for p in pairs)
    precision = true_positives / sum(flagged)
    missed = [p["edited_caption"] for f, p in zip(flagged, pairs, strict=True) if p["sensitive"] and not f]
    false = [p["edited_caption"] for f, p in zip(flagged, pairs, strict=True) if f and not p["sensitive"]]
    assert recall >= 0.95, (recall, missed)
    assert precision >= 0.90, (precision, false)


def test_the_word_list_is_package_data_with_its_provenance():
    import tomllib

    from lance_pipeline.screening import protected_terms

    root = Path(__file__).resolve().parents[1]
    data = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    assert protected_terms.DATA_FILE in data["tool"]["setuptools"]["package-data"]["lance_pipeline.screening"]
    text = (root / "lance_pipeline" / "screening" / protected_terms.DATA_FILE).read_text(encoding="utf-8")
    assert "HolisticBias" in text and "CC BY-SA 4.0" in text and "ours" in text.lower()
    assert "HolisticBias" in protected_terms.SOURCE
    # the list's groups drive the screen: a change of group is marked, a synonym is not
    assert list_changes("a photo of a woman on a bench", "a photo of a man on a bench") == {"gender": "woman -> man"}
    assert list_changes("a photo of a woman on a bench", "a photo of a lady on a bench") == {}
