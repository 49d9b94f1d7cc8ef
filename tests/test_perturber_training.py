"""Perturber training: variation judging, instruction data, LoRA training, resume, adapter round trip, evaluation.

A rule-based teacher (a deterministic stand-in, so the data is known exactly) writes a small instruction set; the
tiny random Llama of ``tiny_text_components`` is finetuned on it through the real PEFT + transformers Trainer path.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lance_pipeline.perturber.collect import (
    CaptionItem,
    TeacherAnswer,
    collect_edits,
    judge_variation,
    load_dataset_split,
    write_instruction_dataset,
)
from lance_pipeline.perturber.training import (
    LoraTrainingConfig,
    evaluate_perturber,
    find_qkv_modules,
    format_example,
    load_instruction_rows,
    train_perturber_lora,
)
from lance_pipeline.text.perturbation import PromptPerturber, alpaca_prompt
from lance_pipeline.tiny.text_components import create_tiny_causal_lm

SUBJECTS = ("dog", "cat", "horse", "man", "woman", "boy")
PLACES = ("snow", "grass", "beach", "forest", "city", "field")
DOMAINS = ("painting", "sketch", "cartoon")
WEATHER = (" on a rainy day", " in the fog", " at night")  # "at night" is not weather: rejected


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, single_thread_torch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


class RuleTeacher:
    """Answers like a teacher LLM would, by rule: three domain swaps, or three appended weather phrases."""

    def __init__(self) -> None:
        self.counts = {"requests": 0}

    def describe(self) -> dict:
        return {"kind": "rules", "model": "rule-teacher"}

    def answer(self, requests):
        self.counts["requests"] += len(requests)
        answers = []
        for request in requests:
            caption = request.caption
            if request.edit_type == "domain":
                lines = [caption.replace("photo", d, 1) for d in DOMAINS]
            else:
                lines = ["Here are three variations:"] + [caption + w for w in WEATHER]
            answers.append(TeacherAnswer("\n".join(f"{i}. {line}" for i, line in enumerate(lines, 1))))
        return answers


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_causal_lm(tmp_path_factory.mktemp("tiny") / "tiny-causal-lm")


@pytest.fixture(scope="module")
def instruction_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    items = [CaptionItem(f"a photo of a {s} in the {p}", s) for s in SUBJECTS for p in PLACES]
    items.append(CaptionItem("A photo of a  dog in the snow", "dog"))  # a duplicate up to case and spacing
    result = collect_edits(items, RuleTeacher(), ["domain", "weather"], n_per_type=3, test_fraction=0.25)
    return write_instruction_dataset(result, tmp_path_factory.mktemp("data") / "data", RuleTeacher().describe(),
                                     "rule-made captions", {"x": "1"})  # fmt: skip


def _tiny_config(**overrides) -> LoraTrainingConfig:
    # 8 updates of 2 micro-batches, no warmup: the tiny model learns something in a few steps.
    options = dict(batch_size=4, gradient_accumulation_steps=2, learning_rate=2e-2, steps=16, warmup_steps=0,
                   save_steps=4)  # fmt: skip
    return LoraTrainingConfig(**{**options, **overrides})


# -- judging variations ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edited", "edit_type", "reason"),
    [
        ("a photo of a dog pulling a sled in a forest", "background", None),
        ("a painting of a dog pulling a sled in the snow", "domain", None),
        ("a photo of a dog pulling a sled in the snow on a rainy day", "weather", None),
        ("a photo of a small dog pulling a sled in the snow", "adjective", None),
        ("a photo of a wolf pulling a sled in the snow", "subject", None),
        ("a photo of a dog pulling a sled in the snow", "subject", "identical"),
        ("a photo of a dog pulling a cart in the snow", "object", "class_removed"),
        ("a painting of a dog pulling a sled in a forest", "background", "changed_the_domain"),
        ("a photo of a dog pulling a sled in the snow at night", "weather", "not_a_weather_change"),
        ("a photo of a dog pulling a sled in deep snow", "domain", "not_a_domain_change"),
        ("a photo of a dog pulling a sled in the snow with a man", "subject", "not_a_replacement"),
        ("a photo of a small dog pulling a sled in the white snow", "adjective", "several_changes"),
        ("a photo of a dog pulling a sled in a big snowy pine forest next to a lake", "adjective", "changed_too_much"),
    ],
)
def test_judge_variation(edited: str, edit_type: str, reason: str | None) -> None:
    caption = "a photo of a dog pulling a sled in the snow"
    diff, got = judge_variation(caption, edited, edit_type, "sled")
    assert got == reason
    if reason is None:
        assert diff.n_regions >= 1 and (diff.original_span or diff.edited_span)


def test_the_stage_in_prompt_examples_pass_their_own_type() -> None:
    # The few-shot examples the perturb stage shows the model are edits of their type by construction: the validator
    # must accept every one of them, and reject the non-domain ones as domain edits.
    from lance_pipeline.edit_types import EDIT_TYPE_TABLE

    EXAMPLES = {name: row.example for name, row in EDIT_TYPE_TABLE.items()}  # noqa: N806
    for edit_type, (caption, label, edits) in EXAMPLES.items():
        for edited in edits:
            assert judge_variation(caption, edited, edit_type, label)[1] is None, (edit_type, edited)
            if edit_type != "domain":
                assert judge_variation(caption, edited, "domain", label)[1] is not None, (edit_type, edited)
    weather_caption, _, weather_edits = EXAMPLES["weather"]
    assert judge_variation(weather_caption, weather_edits[0], "subject")[1] == "not_a_replacement"


def test_collect_validates_dedupes_and_keeps_rejections(instruction_data: Path) -> None:
    stats = json.loads((instruction_data / "collect_stats.json").read_text())
    assert stats["captions_in"] == 37 and stats["duplicate_captions_dropped"] == 1 and stats["captions"] == 36
    assert stats["requests"] == 72 and stats["failed_requests"] == 0
    # Per caption: 3 domain swaps + 2 weather phrases accepted; "at night" and the preamble rejected.
    assert stats["variations_accepted"] == 36 * 5
    assert stats["rejected_by_reason"] == {"not_a_weather_change": 36, "parse_preamble": 36}
    rows = load_instruction_rows(str(instruction_data), "train") + load_instruction_rows(str(instruction_data), "test")
    assert len(rows) == 72 and 0 < len(load_instruction_rows(str(instruction_data), "test")) < 36
    weather = next(r for r in rows if r["edit_type"] == "weather" and r["caption"] == "a photo of a cat in the beach")
    assert weather["variations"] == [
        "a photo of a cat in the beach on a rainy day",
        "a photo of a cat in the beach in the fog",
    ]
    assert weather["spans"] == [{"original_span": "", "edited_span": "on a rainy day"},
                                {"original_span": "", "edited_span": "in the fog"}]  # fmt: skip
    assert weather["rejected"] == [
        {"variation": "Here are three variations:", "reason": "parse_preamble"},
        {"variation": "a photo of a cat in the beach at night", "reason": "not_a_weather_change"},
    ]
    # All edit types of a caption land in the same split.
    splits = {}
    for row in rows:
        splits.setdefault(row["caption"], set()).add(row["split"])
    assert all(len(s) == 1 for s in splits.values())
    card = (instruction_data / "README.md").read_text()
    assert "configs:" in card and "data/train-*.parquet" in card and "rule-teacher" in card


def test_local_datasets_are_not_served_from_a_stale_cache(tmp_path: Path) -> None:
    # datasets caches local folders by name: two different folders called "data" must still read their own rows.
    first, second = [], []
    for root, sink in ((tmp_path / "a" / "data", first), (tmp_path / "b" / "data", second)):
        result = collect_edits([CaptionItem(f"a photo of a {root.parent.name} dog", "dog")], RuleTeacher(), ["domain"],
                               test_fraction=0.0)  # fmt: skip
        write_instruction_dataset(result, root, {"model": "m", "kind": "k"}, "x", {})
        sink.extend(load_dataset_split(str(root), "train")["caption"])
    assert first == ["a photo of a a dog"] and second == ["a photo of a b dog"]


def test_training_prompt_is_the_stage_prompt() -> None:
    row = {"caption": "a photo of a dog", "label_name": "dog", "edit_type": "domain", "instruction": "Do it.",
           "variations": ["a painting of a dog", "a sketch of a dog"]}  # fmt: skip
    prompt, answer = format_example(row)
    assert prompt == alpaca_prompt("Do it.", "a photo of a dog", "dog", 2)
    assert prompt.endswith("### Input:\na photo of a dog\n\n### Variations:\n") and "Give 2 variations" in prompt
    assert answer == "a painting of a dog\na sketch of a dog"


def test_qkv_modules_are_found_by_their_names(tiny_lm: Path) -> None:
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    assert find_qkv_modules(AutoModelForCausalLM.from_pretrained(tiny_lm)) == ["q_proj", "k_proj", "v_proj"]
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8))
    assert find_qkv_modules(gpt2) == ["c_attn"]


def test_paper_defaults_and_bad_values() -> None:
    config = LoraTrainingConfig()
    assert (config.rank, config.alpha, config.dropout, config.learning_rate) == (8, 16, 0.05, 3e-4)
    assert (config.batch_size, config.gradient_accumulation_steps, config.max_length) == (128, 32, 1024)
    assert config.per_device_batch_size() == 4 and config.per_device_batch_size(world_size=2) == 2
    with pytest.raises(ValueError, match="not a multiple"):
        LoraTrainingConfig(batch_size=100).per_device_batch_size()
    with pytest.raises(ValueError, match="dropout"):
        LoraTrainingConfig(dropout=1.5).check()


# -- training --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tiny_lm: Path, instruction_data: Path, tmp_path_factory: pytest.TempPathFactory):
    output = tmp_path_factory.mktemp("adapter") / "perturber-lora"
    return train_perturber_lora(str(tiny_lm), str(instruction_data), output, _tiny_config(), device="cpu")


def test_training_lowers_the_loss_and_writes_a_carded_safetensors_adapter(trained, tiny_lm: Path) -> None:
    metrics = trained.metrics
    losses = [entry["loss"] for entry in trained.log_history if "loss" in entry]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.05
    assert metrics["test_loss_adapter"] < metrics["test_loss_base"] - 0.05
    assert metrics["optimizer_steps"] == 8 and metrics["train_examples"] > 0 and metrics["test_examples"] > 0
    adapter = trained.adapter_dir
    assert (adapter / "adapter_model.safetensors").is_file() and not (adapter / "adapter_model.bin").exists()
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["target_modules"] == ["k_proj", "q_proj", "v_proj"]
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (8, 16, 0.05)
    assert config["base_model_name_or_path"] == "tiny-causal-lm"  # the directory's name, not a private path
    card = (adapter / "README.md").read_text()
    assert "base_model: tiny-causal-lm" in card and "library_name: peft" in card
    assert "| `rank` | `8` | 8 (paper) |" in card and "test_loss_adapter" in card
    assert "## Deviations from the paper" in card and "| LoRA placement |" in card  # lance_pipeline.deviations
    assert "| `steps` | `16` | 37500 (paper: an update every 32, so 1171 updates) |" in card
    for path in adapter.glob("*.*"):
        assert str(tiny_lm.parent) not in path.read_text(errors="ignore"), path.name


def test_adapter_loads_into_the_perturb_stage_and_changes_its_outputs(trained, tiny_lm: Path) -> None:
    def answers(adapter):
        perturber = PromptPerturber(model=str(tiny_lm), revision=None, adapter=adapter, prompt_style="alpaca",
                                    edit_types=["domain", "weather"], max_new_tokens=12)  # fmt: skip
        perturber.load("cpu")
        return [r["raw"] for r in perturber.perturb_detailed(["a photo of a girl in the park"], None, ["girl"])]

    base = answers(None)
    tuned = answers(str(trained.adapter_dir))
    assert tuned != base
    assert answers(str(trained.adapter_dir)) == tuned  # deterministic


def test_existing_checkpoints_need_resume(trained, tiny_lm: Path, instruction_data: Path) -> None:
    with pytest.raises(ValueError, match="--resume"):
        train_perturber_lora(str(tiny_lm), str(instruction_data), trained.adapter_dir, _tiny_config(), device="cpu")


@pytest.mark.slow
def test_resume_from_a_checkpoint_matches_an_uninterrupted_run(trained, tiny_lm, instruction_data, tmp_path) -> None:
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    class CrashAfterFirstCheckpoint(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            raise KeyboardInterrupt("killed after the first checkpoint")

    output = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        train_perturber_lora(str(tiny_lm), str(instruction_data), output, _tiny_config(), device="cpu",
                             callbacks=[CrashAfterFirstCheckpoint()])  # fmt: skip
    assert sorted(p.name for p in (output / "checkpoints").iterdir()) == ["checkpoint-4"]
    assert not (output / "adapter_model.safetensors").exists()
    resumed = train_perturber_lora(str(tiny_lm), str(instruction_data), output, _tiny_config(), resume=True,
                                   device="cpu")  # fmt: skip
    assert resumed.metrics["optimizer_steps"] == 8
    first = load_file(str(trained.adapter_dir / "adapter_model.safetensors"))
    second = load_file(str(output / "adapter_model.safetensors"))
    assert first.keys() == second.keys()
    for name in first:
        assert (first[name] - second[name]).abs().max().item() < 1e-5, name


# -- evaluation ------------------------------------------------------------------------------------------


def test_evaluate_perturber_counts(tiny_lm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    perturber = PromptPerturber(model=str(tiny_lm), revision=None, edit_types=["domain", "weather"], max_new_tokens=8)
    perturber.load("cpu")
    answers = {
        ("a photo of a dog in the snow", "domain"): "a painting of a dog in the snow\na sketch of a dog in the snow",
        ("a photo of a dog in the snow", "weather"): "a photo of a dog in the snow at night\nSure!",
        ("a photo of a cat on a sofa", "domain"): "a painting of a cat on a sofa",
        ("a photo of a cat on a sofa", "weather"): "",
    }

    def fake_generate(prompts, seeds):
        out = []
        for prompt in prompts:
            key = next(k for k in answers if f"Caption: {k[0]}" in prompt and perturber.instruction(k[1]) in prompt)
            out.append((answers[key], False))
        return out

    monkeypatch.setattr(perturber, "generate", fake_generate)
    result = evaluate_perturber(
        perturber, [("a photo of a dog in the snow", "dog"), ("a photo of a cat on a sofa", "cat")]
    )
    assert result["generations"] == 4
    assert result["parse_rate"] == 0.75  # three of the four answers gave at least one edit
    assert result["line_parse_rate"] == 0.8  # 4 of 5 lines kept ("Sure!" is a preamble)
    assert result["edit_type_accuracy"] == 0.75  # "at night" is not a weather change
    assert result["edit_type_accuracy_by_type"] == {"domain": 1.0, "weather": 0.0}
    assert result["rejected_by_reason"] == {"not_a_weather_change": 1}
    assert result["diversity"] == 2.0  # dog: painting, sketch, "at night"; cat: painting
    assert result["label_preservation"] is None


@pytest.mark.slow
def test_same_seed_same_adapter_bytes_and_another_seed_differs(trained, tiny_lm, instruction_data, tmp_path) -> None:
    again = train_perturber_lora(str(tiny_lm), str(instruction_data), tmp_path / "again", _tiny_config(), device="cpu")
    for name in ("adapter_model.safetensors", "adapter_config.json", "README.md", "lance_training.json"):
        assert (again.adapter_dir / name).read_bytes() == (trained.adapter_dir / name).read_bytes(), name
    other = train_perturber_lora(str(tiny_lm), str(instruction_data), tmp_path / "other", _tiny_config(seed=1),
                                 device="cpu")  # fmt: skip
    weights = "adapter_model.safetensors"
    assert (other.adapter_dir / weights).read_bytes() != (trained.adapter_dir / weights).read_bytes()


@pytest.mark.slow
def test_a_fused_qkv_architecture_trains_and_loads(tiny_lm: Path, instruction_data: Path, tmp_path: Path) -> None:
    # GPT-2 keeps q, k and v in one Conv1D (c_attn): the default targets map to it, and the adapter loads in the stage.
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(tiny_lm)
    config = GPT2Config(vocab_size=len(tokenizer), n_layer=1, n_embd=16, n_head=2, n_positions=512,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.convert_tokens_to_ids("<|end|>"),
                        pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    base = tmp_path / "tiny-gpt2"
    GPT2LMHeadModel(config).save_pretrained(base)
    tokenizer.save_pretrained(base)
    outcome = train_perturber_lora(str(base), str(instruction_data), tmp_path / "lora", _tiny_config(steps=4),
                                   device="cpu")  # fmt: skip
    assert json.loads((outcome.adapter_dir / "adapter_config.json").read_text())["target_modules"] == ["c_attn"]
    perturber = PromptPerturber(model=str(base), revision=None, adapter=str(outcome.adapter_dir),
                                edit_types=["domain"], max_new_tokens=4)  # fmt: skip
    perturber.load("cpu")
    assert perturber.describe()["prompt_style"] == "alpaca"
    assert len(perturber.perturb_detailed(["a photo of a dog"], None, ["dog"])) == 1
