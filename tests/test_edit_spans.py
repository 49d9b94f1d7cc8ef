"""Edit-span diff: the cases the authors' ndiff-based diff got wrong, and the rest of the issue's list."""

from __future__ import annotations

import pytest

from lance_pipeline.text.edit_spans import compute_edit_spans, diff_captions, tokenize_caption

BASE = "a photo of a man in a red jacket"


@pytest.mark.parametrize(
    ("original", "edited", "expected"),
    [
        # The reference implementation returned ('man', 'woman ++\n') here.
        (BASE, "a photo of a woman in a red jacket", ("man", "woman")),
        # Multi-word swap, and a single word replaced by several.
        ("a photo of a dog in a park", "a photo of a dog in a busy city street", ("park", "busy city street")),
        ("a photo of a dog sled in the snow", "a photo of a horse cart in the snow", ("dog sled", "horse cart")),
        # Domain edit at the start of the caption.
        ("a photo of a husky", "a watercolor painting of a husky", ("photo", "watercolor painting")),
        # Insertion and deletion.
        ("a photo of a dog on the grass", "a photo of a small dog on the grass", ("", "small")),
        ("a photo of a small dog on the grass", "a photo of a dog on the grass", ("small", "")),
        ("a photo of a dog", "a photo of a dog on a rainy day", ("", "on a rainy day")),
        # Hyphenated words are single tokens; the reference gave ('snow-covered', 'snow-covered').
        ("a photo of a dog in a field", "a photo of a dog in a snow-covered field", ("", "snow-covered")),
        ("a photo of a snow covered field", "a photo of a snow-covered field", ("snow covered", "snow-covered")),
        ("a photo of a well-kept garden", "a photo of a run-down garden", ("well-kept", "run-down")),
        # Case and punctuation alone are not edits.
        ("A photo of a dog.", "a photo of a dog", ("", "")),
        ("a photo of a dog, running", "a photo of a dog running!", ("", "")),
        # Punctuation glued to a changed word stays out of the span, case is preserved from each caption.
        ("a dog, running in the park.", "a Cat, running in the park.", ("dog", "Cat")),
        # Repeated words: only the occurrence that changed is in the span.
        ("a dog next to a dog house", "a dog next to a cat house", ("dog", "cat")),
        ("a dog and a dog", "a dog and a big dog", ("", "big")),
        # A run of equal words: SequenceMatcher alone aligned the run one place off and reported the whole
        # run ('picture picture picture picture' -> 'sketch picture picture picture'); any replaced
        # occurrence must give a one-word span.
        ("picture picture picture picture", "sketch picture picture picture", ("picture", "sketch")),
        ("a picture picture picture picture", "a picture picture sketch picture", ("picture", "sketch")),
        ("picture picture picture picture", "picture picture picture sketch", ("picture", "sketch")),
        ("a a a a", "a a b a", ("a", "b")),
        ("a dog dog", "a dog", ("dog", "")),
        # The reference gave ('a', 'dogs    +\n') for a plural change with an insertion.
        ("a dog on the grass", "two dogs on the snowy grass", ("a dog on the", "two dogs on the snowy")),
    ],
)
def test_spans(original: str, edited: str, expected: tuple[str, str]) -> None:
    spans = compute_edit_spans(original, edited)
    assert spans == expected
    # Spans are exact substrings of their captions, so downstream word matching (prompt-to-prompt) finds them.
    assert spans[0] in original and spans[1] in edited


def test_two_changes_give_the_covering_span_and_region_count() -> None:
    diff = diff_captions(BASE, "a photo of a woman in a blue jacket")
    assert (diff.original_span, diff.edited_span) == ("man in a red", "woman in a blue")
    assert diff.n_regions == 2
    assert diff.n_original_tokens == diff.n_edited_tokens == 4
    assert diff.n_shared_tokens == len(BASE.split()) - 2


def test_repeated_word_change_is_located_at_the_right_occurrence() -> None:
    original, edited = "a dog next to a dog house", "a dog next to a cat house"
    diff = diff_captions(original, edited)
    assert diff.n_regions == 1 and diff.n_original_tokens == 1
    # Everything but the second "dog" is shared.
    assert diff.n_shared_tokens == len(original.split()) - 1


def test_repeated_word_run_is_one_region() -> None:
    # The perturbation parser counts regions and shared words to reject broad edits; a one-word swap inside a
    # run of repeats must count as one region that keeps every other word.
    original, edited = "picture picture picture picture of a dog", "sketch picture picture picture of a dog"
    diff = diff_captions(original, edited)
    assert (diff.n_regions, diff.n_original_tokens, diff.n_edited_tokens) == (1, 1, 1)
    assert diff.n_shared_tokens == len(original.split()) - 1


def test_identical_captions() -> None:
    diff = diff_captions(BASE, BASE)
    assert (diff.original_span, diff.edited_span, diff.n_regions) == ("", "", 0)
    assert diff.n_shared_tokens == len(BASE.split())


def test_tokenizer_keeps_offsets_and_drops_pure_punctuation() -> None:
    text = "a dog - running , fast"
    tokens = tokenize_caption(text)
    assert [t.text for t in tokens] == ["a", "dog", "running", "fast"]
    assert all(text[t.start : t.end] == t.text for t in tokens)


def test_non_string_input_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="captions must be str"):
        compute_edit_spans(BASE, None)  # type: ignore[arg-type]


def test_any_one_word_edit_among_repeats_gives_a_one_word_span() -> None:
    # Property check over captions made of a few repeated words: replacing, inserting or deleting one word must
    # give a one-word span, one region, and every other word shared, wherever the repeats sit.
    import random

    rng = random.Random(0)
    words = ["dog", "picture", "a", "sketch"]
    for _ in range(2000):
        original = [rng.choice(words[:3]) for _ in range(rng.randint(1, 8))]
        edited = list(original)
        position, new, op = rng.randrange(len(original)), rng.choice(words), rng.choice(["sub", "ins", "del"])
        if op == "sub" and new != original[position]:
            edited[position] = new
        elif op == "ins":
            edited.insert(position, new)
        elif op == "del":
            del edited[position]
        else:
            continue
        diff = diff_captions(" ".join(original), " ".join(edited))
        assert diff.n_regions == 1, (original, edited, diff)
        assert max(diff.n_original_tokens, diff.n_edited_tokens) == 1, (original, edited, diff)
        assert diff.n_shared_tokens == len(original) - (op != "ins"), (original, edited, diff)
