"""Structured perturber: output parsing, prompts, determinism, batching, LoRA, per-sample stats."""

from __future__ import annotations

import pytest

from lance_pipeline.stage import EDIT_TYPES, SampleFailure, Stage
from lance_pipeline.text.perturbation import (
    DROP_REASONS,
    Edit,
    PromptPerturber,
    parse_perturber_output,
    validate_edit_types,
)
from lance_pipeline.tiny.text_components import create_tiny_causal_lm, create_tiny_lora_adapter

CAPTION = "a photo of a husky pulling a dog sled in the snow"
CAPTIONS = [
    CAPTION,
    "a photo of a man riding a horse on a beach",
    "a photo of a volleyball on the sand",
    "a photo of a patio with two chairs",
]
LABELS = ["dog sled", "horse", "volleyball", "patio"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("tiny-text")
    base = create_tiny_causal_lm(root / "tiny-causal-lm")
    adapter = create_tiny_lora_adapter(base, root / "tiny-lora")
    return base, adapter


def _perturber(path, **options) -> PromptPerturber:
    options = {"revision": None, "batch_size": 4, "max_new_tokens": 24, **options}
    perturber = PromptPerturber(model=str(path), **options)
    perturber.load("cpu")
    return perturber


# -- parsing ---------------------------------------------------------------------------------------------


def test_parser_strips_numbering_bullets_and_quotes() -> None:
    text = "\n".join(
        [
            "1. a photo of a husky pulling a dog sled in a forest",
            "2) a photo of a husky pulling a dog sled on a city street.",
            '- "a photo of a husky pulling a dog sled on a frozen lake"',
            "* a photo of a husky pulling a dog sled in the desert",
            "Variation 5: a photo of a husky pulling a dog sled on a beach (changed the background)",
        ]
    )
    parsed = parse_perturber_output(text, CAPTION)
    assert parsed.captions == [
        "a photo of a husky pulling a dog sled in a forest",
        "a photo of a husky pulling a dog sled on a city street",
        "a photo of a husky pulling a dog sled on a frozen lake",
        "a photo of a husky pulling a dog sled in the desert",
        "a photo of a husky pulling a dog sled on a beach",
    ]
    assert sum(parsed.dropped.values()) == 0 and parsed.n_lines == 5


def test_parser_keeps_a_genuine_leading_number() -> None:
    # The reference parser dropped the first word of any line starting with a digit.
    caption = "a photo of a dog pulling a sled"
    parsed = parse_perturber_output("2 dogs pulling a sled", caption, max_span_words=8, min_shared_fraction=0.3)
    assert parsed.captions == ["2 dogs pulling a sled"]


def test_parser_drops_and_counts_malformed_lines() -> None:
    long_line = "a photo of a husky pulling a dog sled " + " ".join(["and another dog"] * 20)
    text = "\n".join(
        [
            "Here are three variations:",
            "a photo of a husky pulling a dog sled in a forest",
            "a photo of a husky pulling a dog sled in a forest.",  # duplicate up to punctuation
            "A photo of a husky pulling a dog sled in the snow.",  # identical to the input
            "an oil painting of two cats asleep on a sofa under a lamp",  # changes everything
            long_line,
            "a photo of a husky pulling a dog sled in the desert",
            "a photo of a husky pulling a dog sled at nig",  # cut off by the token limit
        ]
    )
    parsed = parse_perturber_output(text, CAPTION, truncated=True)
    assert parsed.captions == [
        "a photo of a husky pulling a dog sled in a forest",
        "a photo of a husky pulling a dog sled in the desert",
    ]
    assert dict(parsed.dropped) == {
        "preamble": 1,
        "duplicate": 1,
        "identical": 1,
        "too_broad": 1,
        "overlong": 1,
        "truncated": 1,
    }
    assert parsed.n_lines == len(parsed.captions) + sum(parsed.dropped.values())


def test_parser_handles_chat_model_formatting() -> None:
    # Instruction-tuned models wrap lines in markdown bold, label them, and echo the input as "Original: ...".
    text = "\n".join(
        [
            f"Original: {CAPTION}",
            "1. **Caption:** a photo of a husky pulling a dog sled on a beach",
            "**a photo of a husky pulling a dog sled in a forest**",
            "Edited: a photo of a husky pulling a dog sled in a city",
        ]
    )
    parsed = parse_perturber_output(text, CAPTION)
    assert parsed.captions == [
        "a photo of a husky pulling a dog sled on a beach",
        "a photo of a husky pulling a dog sled in a forest",
        "a photo of a husky pulling a dog sled in a city",
    ]
    assert parsed.dropped == {"identical": 1}


def test_parser_drops_a_line_cut_off_mid_phrase() -> None:
    # An answer that stopped on a dangling article or preposition is cut short even without hitting the token
    # limit; a caption that itself ends that way is not affected.
    text = "a photo of a husky pulling a dog sled on a frozen lake\na photo of a husky pulling a dog sled on a"
    parsed = parse_perturber_output(text, CAPTION)
    assert parsed.captions == ["a photo of a husky pulling a dog sled on a frozen lake"]
    assert parsed.dropped == {"truncated": 1}
    assert parse_perturber_output("a dog looking up at", "a cat looking up at").captions == ["a dog looking up at"]


def test_parser_span_size_limit() -> None:
    long_background = "a photo of a husky pulling a dog sled through a dense pine forest at the foot of a mountain"
    assert parse_perturber_output(long_background, CAPTION).captions == [long_background]  # 11 new words
    strict = parse_perturber_output(long_background, CAPTION, max_span_words=6)
    assert strict.captions == [] and dict(strict.dropped) == {"too_broad": 1}


def test_parser_limits_to_n_and_stops_at_a_new_prompt_section() -> None:
    text = "\n".join(
        [
            "a photo of a husky pulling a dog sled in a forest",
            "a photo of a husky pulling a dog sled in a city",
            "a photo of a husky pulling a dog sled in a desert",
            "### Instruction:",
            "a photo of a husky pulling a dog sled on a beach",
        ]
    )
    parsed = parse_perturber_output(text, CAPTION, n=2)
    assert len(parsed.captions) == 2
    assert dict(parsed.dropped) == {"extra": 1}
    assert parsed.n_lines == 3


@pytest.mark.parametrize("text", ["", "   \n\n ", None])
def test_parser_empty_answer_never_raises(text) -> None:
    parsed = parse_perturber_output(text, CAPTION)
    assert parsed.captions == [] and parsed.n_lines == 0


def test_validate_edit_types() -> None:
    assert validate_edit_types("background, weather,background") == ("background", "weather")
    with pytest.raises(ValueError, match="did you mean 'background'"):
        validate_edit_types(["backgrond"])
    with pytest.raises(ValueError, match="at least one"):
        validate_edit_types("")


def test_bad_options_are_value_errors() -> None:
    with pytest.raises(ValueError, match="n_per_type"):
        PromptPerturber(n_per_type=0)
    with pytest.raises(ValueError, match="prompt_style"):
        PromptPerturber(prompt_style="vicuna")
    with pytest.raises(ValueError, match="unknown edit type"):
        PromptPerturber(instructions={"colour": "..."})


# -- the model path --------------------------------------------------------------------------------------


def test_stage_protocol_and_prompts(tiny_lm) -> None:
    base, adapter = tiny_lm
    perturber = _perturber(base)
    assert isinstance(perturber, Stage) and perturber.name == "perturb"
    # The tiny tokenizer has a chat template, so "auto" picks the few-shot chat prompt...
    assert perturber.describe()["prompt_style"] == "chat"
    prompt = perturber.build_prompt(CAPTION, "weather", "dog sled")
    assert prompt.endswith("<|assistant|>\n")
    assert 'The class "dog sled" must stay' in prompt and f"Caption: {CAPTION}" in prompt
    assert "a photo of a patio with two chairs and a table covered in snow" in prompt  # the weather example
    # ...and an adapter switches "auto" to the Alpaca template the paper's LoRA was trained with.
    with_adapter = _perturber(base, adapter=str(adapter))
    alpaca = with_adapter.build_prompt(CAPTION, "domain", "dog sled")
    assert with_adapter.describe()["prompt_style"] == "alpaca"
    assert alpaca.endswith(f"### Input:\n{CAPTION}\n\n### Variations:\n")


def test_same_seed_same_edits_and_seed_matters(tiny_lm) -> None:
    base, _ = tiny_lm
    first = _perturber(base, do_sample=True, temperature=1.0).perturb_detailed(
        CAPTIONS[:2], ["weather"], LABELS[:2], [7, 8]
    )
    again = _perturber(base, do_sample=True, temperature=1.0).perturb_detailed(
        CAPTIONS[:2], ["weather"], LABELS[:2], [7, 8]
    )
    assert [r["raw"] for r in first] == [r["raw"] for r in again]
    assert [r["edits"] for r in first] == [r["edits"] for r in again]
    other = _perturber(base, do_sample=True, temperature=1.0).perturb_detailed(
        CAPTIONS[:2], ["weather"], LABELS[:2], [9, 10]
    )
    assert [r["raw"] for r in other] != [r["raw"] for r in first]


@pytest.mark.parametrize("do_sample", [False, True])
def test_outputs_do_not_depend_on_batch_neighbours(tiny_lm, do_sample: bool) -> None:
    base, _ = tiny_lm
    perturber = _perturber(base, do_sample=do_sample, temperature=1.0, batch_size=8)
    together = perturber.perturb_detailed(CAPTIONS, ["background", "domain"], LABELS, [1, 2, 3, 4])
    alone = perturber.perturb_detailed(CAPTIONS[2:3], ["background", "domain"], LABELS[2:3], [3])
    shuffled = perturber.perturb_detailed(
        [CAPTIONS[3], CAPTIONS[2], CAPTIONS[0]], ["background", "domain"], [LABELS[3], LABELS[2], LABELS[0]], [4, 3, 1]
    )
    assert alone[0]["raw"] == together[2]["raw"] == shuffled[1]["raw"]
    assert alone[0]["perturb_stats"] == together[2]["perturb_stats"]


def test_lora_adapter_changes_the_outputs(tiny_lm) -> None:
    base, adapter = tiny_lm
    plain = _perturber(base, prompt_style="chat").perturb_detailed(CAPTIONS[:2], ["subject"], LABELS[:2], [0, 0])
    tuned = _perturber(base, adapter=str(adapter), prompt_style="chat").perturb_detailed(
        CAPTIONS[:2], ["subject"], LABELS[:2], [0, 0]
    )
    assert [r["raw"] for r in plain] != [r["raw"] for r in tuned]


def test_pickled_adapter_is_refused(tiny_lm, tmp_path) -> None:
    # PEFT would fall back to adapter_model.bin (pickle); the project loads safetensors only.
    import shutil

    base, adapter = tiny_lm
    pickled = tmp_path / "pickled-lora"
    shutil.copytree(adapter, pickled)
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    with pytest.raises(ValueError, match="pickled-lora.*adapter_model.safetensors"):
        _perturber(base, adapter=str(pickled))


def test_process_counts_malformed_output_per_sample(tiny_lm) -> None:
    base, _ = tiny_lm
    perturber = _perturber(base, edit_types=["background", "weather", "domain"])
    records = [
        {"key": "a", "caption": CAPTIONS[0], "label_name": LABELS[0], "seed": 1},
        {"key": "b", "caption": "", "label_name": "x", "seed": 2},
        {"key": "c", "caption": CAPTIONS[1], "label_name": LABELS[1], "seed": 3},
    ]
    results = perturber.process(records)
    assert isinstance(results[1], SampleFailure)
    for result in (results[0], results[2]):
        stats = result["perturb_stats"]
        assert stats["generations"] == 3
        dropped = sum(stats[r] for r in DROP_REASONS)
        # The random tiny model writes junk: every line is accounted for, as kept or dropped with a reason.
        assert stats["lines"] == stats["kept"] + dropped
        assert stats["malformed"] == dropped - stats["extra"]
        assert stats["kept"] == len(result["edits"])
        assert set(stats["kept_by_type"]) == {"background", "weather", "domain"}


def test_perturb_turns_answers_into_edits_with_spans(tiny_lm, monkeypatch: pytest.MonkeyPatch) -> None:
    base, _ = tiny_lm
    perturber = _perturber(base, edit_types=["background", "domain"], n_per_type=2)
    answers = {
        "background": (
            "1. a photo of a husky pulling a dog sled in a forest\n"
            "2. a photo of a husky pulling a dog sled in a forest\n"
        ),
        "domain": (
            "- a pencil sketch of a husky pulling a dog sled in the snow\n"
            "- a painting of a husky pulling a dog sled in the snow\n"
            "- a cartoon of a husky pulling a dog sled in the snow"
        ),
    }

    def fake_generate(prompts, seeds):
        return [(answers["background" if "background" in p else "domain"], False) for p in prompts]

    monkeypatch.setattr(perturber, "generate", fake_generate)
    (edits,) = perturber.perturb([CAPTION], None, ["dog sled"])
    assert edits == [
        Edit("background", "a photo of a husky pulling a dog sled in a forest", "the snow", "a forest"),
        Edit("domain", "a pencil sketch of a husky pulling a dog sled in the snow", "photo", "pencil sketch"),
        Edit("domain", "a painting of a husky pulling a dog sled in the snow", "photo", "painting"),
    ]
    (result,) = perturber.process([{"caption": CAPTION, "label_name": "dog sled", "seed": 0}])
    assert result["edits"][0] == edits[0].to_dict()
    assert set(result["edits"][0]) == {"edit_type", "edited_caption", "original_span", "edited_span"}
    assert result["edits"][0]["edit_type"] in EDIT_TYPES
    stats = result["perturb_stats"]
    assert (stats["duplicate"], stats["extra"], stats["kept"], stats["malformed"]) == (1, 1, 3, 1)


def test_tiny_components_are_byte_reproducible(tiny_lm, tmp_path) -> None:
    from lance_pipeline.tiny.text_components import create_tiny_lora

    base, adapter = tiny_lm
    rebuilt = create_tiny_causal_lm(tmp_path / "tiny-causal-lm")
    standalone = create_tiny_lora(tmp_path / "tiny-lora")
    for first, second in ((base, rebuilt), (adapter, standalone)):
        names = sorted(p.name for p in first.iterdir())
        assert names == sorted(p.name for p in second.iterdir())
        assert all((first / n).read_bytes() == (second / n).read_bytes() for n in names)
