"""LANCE-R text part: seeded masking of a non-stop word, filled by a tiny random masked LM."""

from __future__ import annotations

import pytest

from lance_pipeline.stage import SampleFailure, Stage
from lance_pipeline.text.edit_spans import tokenize_caption
from lance_pipeline.text.random_edits import RandomWordEditor, candidate_positions
from lance_pipeline.tiny.text_components import create_tiny_masked_lm

CAPTION = "a photo of a husky pulling a dog sled in the snow."
CAPTIONS = [CAPTION, "a photo of a man riding a horse on a beach", "a photo of a red car near a river"]
LABELS = ["dog sled", "horse", "car"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def editor(tmp_path_factory: pytest.TempPathFactory) -> RandomWordEditor:
    path = create_tiny_masked_lm(tmp_path_factory.mktemp("tiny") / "tiny-masked-lm")
    editor = RandomWordEditor(model=str(path), revision=None, n_edits=2, batch_size=8)
    editor.load("cpu")
    return editor


def test_candidates_skip_stop_words_and_the_class_name() -> None:
    words = [tokenize_caption(CAPTION)[i].norm for i in candidate_positions(CAPTION, "dog sled")]
    assert words == ["photo", "husky", "pulling", "snow"]
    unprotected = [tokenize_caption(CAPTION)[i].norm for i in candidate_positions(CAPTION, "dog sled", False)]
    assert unprotected == ["photo", "husky", "pulling", "dog", "sled", "snow"]
    assert candidate_positions("the of a and it", None) == []
    # A plural of a class word is still the class.
    assert [
        tokenize_caption("two huskies and sleds")[i].norm for i in candidate_positions("two huskies and sleds", "sled")
    ] == ["huskies"]


def test_edits_replace_exactly_one_word(editor: RandomWordEditor) -> None:
    from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS  # here, not at collection: sklearn is heavy

    assert isinstance(editor, Stage) and editor.name == "random_edit"
    results = editor.edit(CAPTIONS, LABELS, [1, 2, 3])
    assert all(1 <= len(edits) <= 2 for edits in results)
    for caption, label, edits in zip(CAPTIONS, LABELS, results, strict=True):
        allowed = {tokenize_caption(caption)[i].norm for i in candidate_positions(caption, label)}
        for edit in edits:
            assert edit["edit_type"] is None
            assert edit["original_span"].casefold() in allowed
            assert edit["edited_span"] and edit["edited_span"].casefold() != edit["original_span"].casefold()
            assert edit["edited_span"].casefold() not in label.split()
            assert edit["edited_span"].casefold() not in ENGLISH_STOP_WORDS
            before, after = caption.split(), edit["edited_caption"].split()
            assert len(before) == len(after)
            changed = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
            assert len(changed) == 1 and changed[0][0].strip(".") == edit["original_span"]
        # The two edits of a caption mask different words.
        assert len({e["original_span"] for e in edits}) == len(edits)


def test_seeded_and_independent_of_batch_neighbours(editor: RandomWordEditor) -> None:
    together = editor.edit(CAPTIONS, LABELS, [1, 2, 3])
    assert editor.edit(CAPTIONS, LABELS, [1, 2, 3]) == together
    assert editor.edit(CAPTIONS[1:2], LABELS[1:2], [2]) == together[1:2]
    assert editor.edit(CAPTIONS[::-1], LABELS[::-1], [3, 2, 1]) == together[::-1]
    # The masked word follows the seed: over a few seeds more than one word gets picked.
    picks = {tuple(editor.choose_positions(CAPTION, "dog sled", seed)) for seed in range(12)}
    assert len(picks) > 1
    assert all(
        editor.choose_positions(CAPTION, "dog sled", s) == editor.choose_positions(CAPTION, "dog sled", s)
        for s in range(5)
    )


def test_process(editor: RandomWordEditor) -> None:
    records = [
        {"key": "a", "caption": CAPTION, "label_name": "dog sled", "seed": 5},
        {"key": "b", "label_name": "x", "seed": 6},
        {"key": "c", "caption": "the of a and", "label_name": "x", "seed": 7},
    ]
    results = editor.process(records)
    assert results[0]["random_edits"] == editor.edit([CAPTION], ["dog sled"], [5])[0]
    assert isinstance(results[1], SampleFailure)
    assert results[2] == {"random_edits": []}  # nothing to mask is an empty result, not a failure


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="n_edits"):
        RandomWordEditor(n_edits=0)
    with pytest.raises(ValueError, match="top_k"):
        RandomWordEditor(top_k=1)


def test_spans_are_the_replaced_word_even_among_repeats(editor: RandomWordEditor) -> None:
    # A diff of "picture picture picture picture" against one replaced occurrence used to report the whole
    # run; LANCE-R knows which word it replaced, so the spans are exactly that word and its fill.
    caption = "picture picture picture picture of a dog."
    for seed in range(6):
        (edits,) = editor.edit([caption], ["dog"], [seed])
        assert edits, "the tiny masked LM found no fill"
        for edit in edits:
            assert edit["original_span"] == "picture"
            before, after = caption.split(), edit["edited_caption"].split()
            changed = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
            assert changed == [("picture", edit["edited_span"])]


def test_fill_skips_stop_words_subwords_the_word_itself_and_the_class() -> None:
    # A stub fill-mask pipeline with a fixed ranking isolates the fill rule from the random tiny model.
    class StubFill:
        tokenizer = type("Tok", (), {"mask_token": "[MASK]"})()

        def __call__(self, texts, top_k, batch_size):
            ranking = ["the", "##s", "husky", "Huskies", "sled", "Sleds", "of", "wolf"]
            return [[{"token_str": t, "score": 1.0} for t in ranking] for _ in texts]

    editor = RandomWordEditor(n_edits=1)
    editor._fill = StubFill()
    caption = "a husky pulling a sled"
    seed = next(
        s
        for s in range(50)
        if tokenize_caption(caption)[editor.choose_positions(caption, "sled", s)[0]].norm == "husky"
    )
    (edits,) = editor.edit([caption], ["sled"], [seed])
    assert edits == [
        {"edit_type": None, "edited_caption": "a wolf pulling a sled", "original_span": "husky", "edited_span": "wolf"}
    ]
