"""DILLEMA's three LLM stages: JSON parsing, keyword/alternative/rewrite checks, seeding, the label check, LoRA."""

from __future__ import annotations

import json
import re

import pytest

from lance_pipeline.dillema.text_stages import (
    DillemaAlternativesStage,
    DillemaCounterfactualStage,
    DillemaKeywordStage,
    edit_spans,
    names_class,
    parse_json_answer,
)
from lance_pipeline.stage import SampleFailure
from lance_pipeline.tiny.text_components import create_tiny_causal_lm, create_tiny_lora_adapter

CAPTION = "a husky pulling a dog sled in the snow at night"
LABEL = "dog sled"


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    root = tmp_path_factory.mktemp("dillema-lm")
    base = create_tiny_causal_lm(root / "lm")
    return base, create_tiny_lora_adapter(base, root / "lora")


def _record(seed: int = 3, caption: str = CAPTION, label: str = LABEL, key: str = "k") -> dict:
    return {"key": key, "label": 0, "label_name": label, "seed": seed, "caption": caption}


class Script:
    """A scripted LLM: answers each prompt with the first rule whose pattern it matches, and logs the calls."""

    def __init__(self, rules: list[tuple[str, list[str] | str]]):
        self.rules = rules
        self.calls: list[tuple[str, int]] = []
        self.answered: dict[str, int] = {}

    def __call__(self, prompts: list[str], seeds: list[int]) -> list[tuple[str, bool]]:
        out = []
        for prompt, seed in zip(prompts, seeds, strict=True):
            self.calls.append((prompt, seed))
            for pattern, answers in self.rules:
                if re.search(pattern, prompt):
                    answers = [answers] if isinstance(answers, str) else answers
                    n = self.answered.get(pattern, 0)
                    self.answered[pattern] = n + 1
                    out.append((answers[min(n, len(answers) - 1)], False))
                    break
            else:
                raise AssertionError(f"no scripted answer for prompt {prompt!r}")
        return out


def _scripted(stage, tiny_lm, rules):
    stage.load("cpu")
    script = Script(rules)
    stage.backend.generate = script
    return stage, script


def _options(tiny_lm, **extra):
    return {"model": str(tiny_lm[0]), "revision": None, **extra}


# -- parsing ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expect", "value", "outcome"),
    [
        ('{"man": "subject", "snow": "weather"}', dict, {"man": "subject", "snow": "weather"}, "json"),
        ('Sure! ```json\n["red", "blue"]\n```', list, ["red", "blue"], "json"),
        ("result = {'night': 'weather'}", dict, {"night": "weather"}, "repaired"),
        ('["sunny", "snowy",]', list, ["sunny", "snowy"], "repaired"),
        ("{“man”: “subject”}", dict, {"man": "subject"}, "repaired"),
        (
            "1. a woman\n2. a young boy\n- 'a police officer'",
            list,
            ["a woman", "a young boy", "a police officer"],
            "salvaged",
        ),
        ("sunny, snowy, clear.", list, ["sunny", "snowy", "clear"], "salvaged"),
        ("husky: subject\nsnow: weather", dict, {"husky": "subject", "snow": "weather"}, "salvaged"),
        ("I cannot help with that", dict, None, "unparseable"),
        ("", list, None, "empty"),
        ("[1, 2", list, ["1", "2"], "salvaged"),
        ("Here are the words:\nI am not sure about that.", list, None, "unparseable"),
    ],
)
def test_parse_json_answer(text, expect, value, outcome):
    assert parse_json_answer(text, expect) == (value, outcome)


def test_parse_never_evaluates_code():
    value, outcome = parse_json_answer("['a', __import__('os').system('echo hacked')]", list)
    assert outcome == "salvaged" and all(isinstance(v, str) for v in value)


def test_words_naming_the_class_and_spans():
    assert names_class("dog", "dog sled") and names_class("sleds", "dog sled") and names_class("Huskies", "husky")
    assert names_class("cat", "tabby, tabby cat") and not names_class("snow", "dog sled")
    assert not names_class("the", "the dog")  # stopwords never count
    assert edit_spans(CAPTION, CAPTION.replace("snow", "sand")) == ("snow", "sand")
    assert edit_spans(CAPTION, "a wolf pulling a dog sled in the sand at night") == ("husky; snow", "wolf; sand")


# -- stage (a): keywords --------------------------------------------------------------------------------------------


def test_keywords_keep_caption_words_and_drop_the_class(tiny_lm):
    answer = (
        '{"husky": "subject", "dog": "object", "sled": "object", "snow": "background", "night": "time", '
        '"beach": "background", "husky ": "subject"}'
    )
    stage, script = _scripted(DillemaKeywordStage(**_options(tiny_lm)), tiny_lm, [("Which words", answer)])
    result = stage.process([_record()])[0]
    assert result["keywords"] == {"husky": "subject", "snow": "background", "night": None}
    stats = result["keyword_stats"]
    assert stats["json"] == 1 and stats["malformed"] == 0 and stats["attempts"] == 1
    assert stats["dropped"] == {"names_class": 2, "not_in_caption": 1, "untyped": 1, "duplicate": 1}
    prompt = script.calls[0][0]
    assert "ImageNet image classification with 1000 labels" in prompt and '"dog sled"' in prompt and CAPTION in prompt


@pytest.mark.parametrize(
    "answer",
    [
        '{"keywords": {"husky": "subject", "snow": "background"}}',
        '[{"word": "husky", "aspect": "subject"}, {"keyword": "snow", "type": "background"}]',
        'Here they are: {"husky": "subject", "snow": "background",}',
    ],
)
def test_keywords_read_common_wrappings(tiny_lm, answer):
    stage, _ = _scripted(DillemaKeywordStage(**_options(tiny_lm)), tiny_lm, [("Which words", answer)])
    assert stage.process([_record()])[0]["keywords"] == {"husky": "subject", "snow": "background"}


def test_keywords_retry_malformed_answers_with_new_seeds_and_count_them(tiny_lm):
    stage, script = _scripted(
        DillemaKeywordStage(**_options(tiny_lm, max_attempts=3)),
        tiny_lm,
        [("Which words", ["I have no idea", "['dog', 'sled']", "['husky', 'snow']"])],
    )
    result = stage.process([_record()])[0]
    assert result["keywords"] == {"husky": None, "snow": None}  # DILLEMA's own list format: no aspects
    stats = result["keyword_stats"]
    assert (stats["attempts"], stats["unparseable"], stats["repaired"], stats["malformed"]) == (3, 1, 2, 3)
    assert stats["dropped"]["names_class"] == 2
    assert len({seed for _, seed in script.calls}) == 3  # each attempt samples with its own seed
    # Nothing usable in any attempt: a failure that says what the answers held.
    stage, _ = _scripted(DillemaKeywordStage(**_options(tiny_lm, max_attempts=2)), tiny_lm, [("Which", "['sled']")])
    failure = stage.process([_record()])[0]
    assert isinstance(failure, SampleFailure)
    assert "no usable keyword in 2 answer(s)" in failure.reason and "names_class=2" in failure.reason
    # Greedy decoding would repeat itself: one attempt only.
    stage, script = _scripted(
        DillemaKeywordStage(**_options(tiny_lm, do_sample=False, max_attempts=3)), tiny_lm, [("Which", "nothing")]
    )
    assert isinstance(stage.process([_record()])[0], SampleFailure) and len(script.calls) == 1


def test_keyword_fallback_uses_caption_words_that_do_not_name_the_class(tiny_lm):
    stage, _ = _scripted(
        DillemaKeywordStage(**_options(tiny_lm, fallback_to_caption_words=True, max_keywords=3)),
        tiny_lm,
        [("Which", "???")],
    )
    result = stage.process([_record()])[0]
    assert result["keywords"] == {"husky": None, "pulling": None, "snow": None}
    assert result["keyword_stats"]["fallback"] == 3
    missing = stage.process([{**_record(), "caption": None}, {**_record(), "label_name": ""}])
    assert all(isinstance(r, SampleFailure) for r in missing)


# -- stage (b): alternatives ----------------------------------------------------------------------------------------


def test_alternatives_one_question_per_keyword(tiny_lm):
    rules = [
        ('word "husky"', '["wolf", "Husky", "sled dog", "golden retriever", "wolf"]'),
        ('word "snow"', "Here you go:\n- sand\n- grass\n- a very long alternative that goes on and on"),
        ('word "night"', "I am not sure about that."),
    ]
    stage, script = _scripted(DillemaAlternativesStage(**_options(tiny_lm, max_attempts=1)), tiny_lm, rules)
    record = {**_record(), "keywords": {"husky": "subject", "snow": "background", "night": None}}
    result = stage.process([record])[0]
    assert result["alternatives"] == {"husky": ["wolf", "golden retriever"], "snow": ["sand", "grass"]}
    stats = result["alternative_stats"]
    assert (stats["json"], stats["salvaged"], stats["unparseable"], stats["answers"]) == (1, 1, 1, 3)
    assert stats["dropped"] == {
        "same_as_keyword": 1,
        "names_class": 1,
        "duplicate": 1,
        "too_long": 1,
        "keyword_without_alternative": 1,
    }
    seeds = [seed for _, seed in script.calls]
    assert len(set(seeds)) == 3  # one seed per keyword question
    none_left = stage.process([{**record, "keywords": {"night": None}}])[0]
    assert isinstance(none_left, SampleFailure) and "no usable alternative" in none_left.reason
    assert isinstance(stage.process([_record()])[0], SampleFailure)  # no keywords: run the keyword stage first


# -- stage (c): counterfactual captions -----------------------------------------------------------------------------


KEYWORDS = {"husky": "subject", "snow": "background", "night": "weather", "pulling": None}
ALTERNATIVES = {"husky": ["wolf", "malamute"], "snow": ["sand", "grass"], "night": ["day"], "pulling": ["towing"]}


def _rewrite_record(seed: int = 3) -> dict:
    return {**_record(seed), "keywords": KEYWORDS, "alternatives": ALTERNATIVES}


def _apply(caption: str, applied: dict[str, str]) -> str:
    for word, alternative in applied.items():
        caption = re.sub(rf"\b{word}\b", alternative, caption)
    return caption


class Rewriter:
    """A scripted LLM that rewrites correctly: it reads the applied alternatives out of the prompt."""

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, seeds):
        out = []
        for prompt, seed in zip(prompts, seeds, strict=True):
            self.calls.append((prompt, seed))
            applied = json.loads(re.search(r"alternatives: (\{.*?\})\.", prompt).group(1))
            out.append((f"Rewritten caption: {_apply(CAPTION, applied)}", False))
        return out


def test_rewrite_picks_are_seeded_and_edits_carry_the_trace(tiny_lm):
    stage = DillemaCounterfactualStage(**_options(tiny_lm, n_counterfactuals=3))
    stage.load("cpu")
    stage.backend.generate = Rewriter()
    first = stage.process([_rewrite_record()])[0]
    again = stage.process([_rewrite_record()])[0]
    assert first == again
    edits = first["edits"]
    assert 1 <= len(edits) <= 3
    for edit in edits:
        applied = json.loads(edit["llm_applied_alternatives"])
        assert len(applied) == 3  # DILLEMA: min(#keywords, 3)
        assert edit["edited_caption"] == _apply(CAPTION, applied)
        assert edit["edit_type"] == "multi"
        assert json.loads(edit["llm_keywords"]) == KEYWORDS and json.loads(edit["llm_alternatives"]) == ALTERNATIVES
        assert all(applied[k] in ALTERNATIVES[k] for k in applied)
    others = {
        edit["llm_applied_alternatives"]
        for seed in range(4, 12)
        for edit in stage.process([_rewrite_record(seed)])[0]["edits"]
    }
    assert len(others) > 1  # other seeds pick otherwise
    assert first["rewrite_stats"]["kept"] == len(edits)


def test_one_applied_alternative_gets_its_lance_type(tiny_lm):
    stage = DillemaCounterfactualStage(**_options(tiny_lm, n_counterfactuals=6, max_keywords_per_edit=1))
    stage.load("cpu")
    stage.backend.generate = Rewriter()
    edits = stage.process([_rewrite_record()])[0]["edits"]
    assert edits
    for edit in edits:
        ((word, alternative),) = json.loads(edit["llm_applied_alternatives"]).items()
        assert edit["edit_type"] == (KEYWORDS[word] or "multi")
        assert (edit["original_span"], edit["edited_span"]) == (word, alternative)


def test_rewrite_checks_reject_with_reasons(tiny_lm):
    rules = [
        (
            "Rewrite",
            [
                "Sure, here is the caption:",  # a preamble only
                "a husky pulling a cart in the snow at night",  # dropped the class, not the alternatives
                CAPTION,  # identical
            ],
        ),
    ]
    stage, _ = _scripted(DillemaCounterfactualStage(**_options(tiny_lm, max_attempts=3)), tiny_lm, rules)
    failure = stage.process([_rewrite_record()])[0]
    assert isinstance(failure, SampleFailure)
    assert "preamble=1" in failure.reason and "identical=1" in failure.reason
    assert "alternative_missing=1" in failure.reason
    lax = DillemaCounterfactualStage(**_options(tiny_lm, max_attempts=1, require_alternatives=False))
    lax, _ = _scripted(lax, tiny_lm, [("Rewrite", "a husky pulling a cart in the snow at night")])
    assert "class_removed=1" in lax.process([_rewrite_record()])[0].reason


# -- the label check on DILLEMA edits -------------------------------------------------------------------------------


def test_label_check_rejects_edits_whose_changed_words_name_the_class():
    from lance_pipeline.text.label_checks import LabelPreservationCheck

    check = LabelPreservationCheck(model="sentence-transformers/all-MiniLM-L6-v2", revision=None)
    check.load("cpu")
    kept_caption = "a wolf pulling a dog sled in the sand at night"
    changed_class = "a wolf pulling a cart in the sand at night"
    edits = []
    for rewrite in (kept_caption, changed_class):
        original_span, edited_span = edit_spans(CAPTION, rewrite)
        edits.append({"edited_caption": rewrite, "original_span": original_span, "edited_span": edited_span})
    judged = check.check(edits, LABEL)
    assert judged[0]["kept"] and judged[0]["original_span"] == "husky; snow"
    assert not judged[1]["kept"] and judged[1]["reject_reason"] == "label_similarity"
    assert judged[1]["original_span"] == "husky; dog sled; snow"  # each changed region, not the words between


# -- the real tiny LLM: seeding and LoRA ------------------------------------------------------------------------------


def _chain(tiny_lm, records, adapter=None):
    options = _options(tiny_lm, max_new_tokens=16, adapter=None if adapter is None else str(adapter))
    keywords = DillemaKeywordStage(**options, fallback_to_caption_words=True)
    alternatives = DillemaAlternativesStage(**options)
    rewrite = DillemaCounterfactualStage(
        **options, require_alternatives=False, require_class_kept=False, min_shared_fraction=0.0, max_span_words=100
    )
    for stage in (keywords, alternatives, rewrite):
        stage.load("cpu")
    out = [dict(r) for r in records]
    for stage in (keywords, alternatives, rewrite):
        for record, update in zip(out, stage.process(out), strict=True):
            record.update(update if isinstance(update, dict) else {"failure": update.reason})
    return out, keywords


@pytest.mark.slow
def test_three_stages_on_a_real_tiny_llm_are_seeded_and_share_one_model(tiny_lm, single_thread_torch):
    records = [_record(seed=s, key=f"k{s}") for s in (1, 2)]
    first, keywords = _chain(tiny_lm, records)
    second, _ = _chain(tiny_lm, list(reversed(records)))
    assert first == list(reversed(second))  # the same seed gives the same answers, whatever the batch order
    assert any(r.get("edits") for r in first)
    third, _ = _chain(tiny_lm, [_record(seed=9, key="k1")])
    assert third[0] != first[0]
    # All three stages hold the same loaded model object.
    other = DillemaAlternativesStage(**_options(tiny_lm))
    other.load("cpu")
    assert other.backend._model is keywords.backend._model
    # With a LoRA adapter the prompts are Alpaca-style, as the paper's adapter was trained; the chain still runs.
    with_lora, lora_keywords = _chain(tiny_lm, records, adapter=tiny_lm[1])
    prompt = lora_keywords._prompt("Which words?")
    assert "### Instruction:" in prompt and prompt.endswith("### Response:\n")
    assert lora_keywords.backend._model is not keywords.backend._model
    assert all("keywords" in r for r in with_lora)


def test_options_are_checked_without_loading(tiny_lm):
    with pytest.raises(ValueError, match="option max_attempts = 0: expected an integer >= 1"):
        DillemaKeywordStage(max_attempts=0)
    with pytest.raises(ValueError, match="option n_alternatives = 0: expected an integer >= 1"):
        DillemaAlternativesStage(n_alternatives=0)
    with pytest.raises(ValueError, match="min_shared_fraction"):
        DillemaCounterfactualStage(min_shared_fraction=2)
    with pytest.raises(ValueError, match="known options: .*n_counterfactuals"):
        DillemaCounterfactualStage(n_counterfactual=2)
    described = DillemaCounterfactualStage(**_options(tiny_lm)).describe()
    assert described["temperature"] == 0.1 and described["top_p"] == 0.85 and described["do_sample"] is True
