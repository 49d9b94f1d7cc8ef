"""`lance-cf perturber train` on bad data and interrupted saves, and the paper's schedule and loss.

Bad rows fail in one line naming the file, line and field, before any model loads; a huge row costs no memory; a kill
during a checkpoint save leaves a partial checkpoint that ``--resume`` removes on its own; the loss covers only the
answer tokens; the default length is the paper's 37.5k steps with an update every 32.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from builder_helpers import REPO

from builder.cli import main
from lance_pipeline.perturber.data import MAX_ROW_BYTES, iter_instruction_rows
from lance_pipeline.perturber.training import LoraTrainingConfig, format_example, tokenize_example

GOOD = {"caption": "a photo of a dog in the snow", "edit_type": "weather", "label_name": "dog",
        "variations": ["a photo of a dog in the snow on a rainy day", "a photo of a dog in the snow in thick fog"]}  # fmt: skip


def _jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _train(*args: str) -> list[str]:
    return ["perturber", "train", "--model", "no-such-model-is-loaded", "--output", "never-written", *args]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (
            [GOOD, {**GOOD, "variations": "a photo of a cat"}],
            "data.jsonl:2: field 'variations' must be a list of edited captions, got a string",
        ),
        ([{**GOOD, "caption": None}], "data.jsonl:1: field 'caption' must be a non-empty string, got null"),
        (
            [GOOD, "", GOOD, "{not json"],
            "data.jsonl:4: not valid JSON (Expecting property name enclosed in double quotes at line 1 column 2)",
        ),
        (
            [GOOD, {**GOOD, "variations": ["ok", 3]}],
            "data.jsonl:2: field 'variations'[1] must be a non-empty string, got a number",
        ),
        ([{**GOOD, "edit_type": "wether"}], "data.jsonl:1: field 'edit_type': unknown edit type 'wether'"),
        ([GOOD, [1, 2]], "data.jsonl:2: a row must be a JSON object, got a list"),
        ([], "the train split has no rows"),
        ([{**GOOD, "variations": []}], "no train row has an accepted variation"),
    ],
)
def test_a_bad_row_is_one_line_naming_file_line_and_field(tmp_path, capsys, monkeypatch, lines, message):
    monkeypatch.chdir(tmp_path)
    data = _jsonl(tmp_path / "data.jsonl", lines)
    assert main(_train("--data", str(data))) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("lance-cf perturber: error: ") or err.startswith("lance-cf perturber train: error: "), err
    assert message in err, err
    assert not (tmp_path / "never-written").exists()  # nothing was started: the model was never looked up


def test_a_directory_without_the_split_and_a_missing_path_are_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(_train("--data", str(tmp_path / "empty"))) != 0
    assert "no train split (looked for data/train-*.parquet" in capsys.readouterr().err
    assert main(_train("--data", str(tmp_path / "nothing" / "here"))) != 0
    assert "no such file or directory" in capsys.readouterr().err


def test_the_test_split_is_checked_too_and_directories_are_streamed_by_split(tmp_path):
    (tmp_path / "data").mkdir()
    _jsonl(tmp_path / "data" / "train.jsonl", [GOOD, {**GOOD, "variations": []}])
    _jsonl(tmp_path / "data" / "test.jsonl", [GOOD, {**GOOD, "label_name": 7}])
    assert len(list(iter_instruction_rows(str(tmp_path), "train"))) == 1
    assert len(list(iter_instruction_rows(str(tmp_path), "train", accepted_only=False))) == 2
    with pytest.raises(ValueError, match=r"data/test.jsonl:2: field 'label_name' must be a string or null, got a num"):
        list(iter_instruction_rows(str(tmp_path), "test"))


def test_a_line_longer_than_the_row_limit_is_refused_unread(tmp_path):
    data = tmp_path / "data.jsonl"
    with open(data, "w") as handle:
        handle.write(json.dumps(GOOD) + "\n")
        handle.write(json.dumps({**GOOD, "variations": ["x" * (2 * MAX_ROW_BYTES)]}) + "\n")
    rows = iter_instruction_rows(str(data))
    assert next(rows)["caption"] == GOOD["caption"]
    with pytest.raises(ValueError, match=r"data.jsonl:2: the row is longer than 1 MiB"):
        next(rows)


def test_a_long_answer_is_cut_before_it_is_tokenized():
    class CountingTokenizer:
        longest = 0

        def __call__(self, text, add_special_tokens=True):
            self.longest = max(self.longest, len(text))
            return {"input_ids": [ord(c) % 50 for c in text]}

    tokenizer = CountingTokenizer()
    row = {**GOOD, "variations": ["a photo of a dog " + "very " * 200_000]}
    example = tokenize_example(row, tokenizer, eos_token_id=999, max_length=512, train_on_prompt=False)
    assert len(example["input_ids"]) == 512 and 999 not in example["input_ids"]  # cut, so no end-of-sequence
    assert tokenizer.longest == 512 * 32  # the 1 MB answer reached the tokenizer as 16 KB
    short = tokenize_example(GOOD, tokenizer, eos_token_id=999, max_length=1024, train_on_prompt=False)
    assert short["input_ids"][-1] == 999  # an answer that ends gets its end-of-sequence


def test_the_paper_schedule_is_the_default():
    config = LoraTrainingConfig()
    config.check()
    assert (config.steps, config.epochs, config.optimizer_steps) == (37_500, None, 37_500 // 32)
    assert (config.warmup_steps, config.lr_scheduler, config.weight_decay) == (100, "constant_with_warmup", 0.0)
    assert LoraTrainingConfig(steps=None, epochs=3.0).optimizer_steps is None  # epochs stay an option
    with pytest.raises(ValueError, match="steps or epochs, not both"):
        LoraTrainingConfig(epochs=2.0).check()
    with pytest.raises(ValueError, match="steps must be at least gradient_accumulation_steps"):
        LoraTrainingConfig(steps=10).check()
    import argparse

    from builder.perturber.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["perturber", "train", "--model", "m", "--data", "d", "--output", "o"])
    assert (args.steps, args.epochs, args.warmup_steps) == (None, None, 100)  # run_train fills in PAPER_STEPS
    with pytest.raises(SystemExit):
        parser.parse_args(["perturber", "train", "--model", "m", "--data", "d", "--output", "o", "--steps", "64",
                           "--epochs", "2"])  # fmt: skip


def test_the_loss_covers_only_the_answer_tokens(tmp_path, single_thread_torch):
    """The Trainer's loss on a collated batch equals a cross-entropy computed here over the answer positions only,
    and differs from one over every position."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq

    from lance_pipeline.tiny.text_components import create_tiny_causal_lm

    path = create_tiny_causal_lm(tmp_path / "lm")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    rows = [GOOD, {**GOOD, "variations": ["a painting of a dog in the snow"], "edit_type": "domain"}]
    examples = [tokenize_example(r, tokenizer, tokenizer.eos_token_id, 1024, False) for r in rows]
    for row, example in zip(rows, examples, strict=True):
        prompt, _ = format_example(row)
        n_prompt = len(tokenizer(prompt)["input_ids"])
        assert example["labels"][:n_prompt] == [-100] * n_prompt
        assert example["labels"][n_prompt:] == example["input_ids"][n_prompt:] and n_prompt < len(example["labels"])
    batch = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)(examples)
    with torch.no_grad():
        loss = model(**batch).loss.item()
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    shifted_logits, shifted_ids = logits[:, :-1].reshape(-1, logits.shape[-1]), batch["input_ids"][:, 1:].reshape(-1)
    answer = batch["labels"][:, 1:].reshape(-1) != -100
    per_token = torch.nn.functional.cross_entropy(shifted_logits, shifted_ids, reduction="none")
    assert abs(per_token[answer].mean().item() - loss) < 1e-5
    real = batch["attention_mask"][:, 1:].reshape(-1).bool()
    assert abs(per_token[real].mean().item() - loss) > 1e-3


# -- real processes: memory and kills --------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return env


@pytest.mark.e2e
def test_a_40_mb_row_is_refused_with_bounded_memory(tmp_path):
    data = tmp_path / "data.jsonl"
    with open(data, "w") as handle:
        handle.write(json.dumps(GOOD) + "\n")
        handle.write(json.dumps({**GOOD, "variations": ["a photo of a dog " + "x" * (40 << 20)]}) + "\n")
    # The child's peak resident memory, measured by a wrapper process that runs only it.
    wrapper = (
        "import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
        "print(p.returncode); print(p.stderr.strip().splitlines()[-1]); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    command = [sys.executable, "-m", "builder.cli", *_train("--data", str(data))]
    out = subprocess.run([sys.executable, "-c", wrapper, *command], capture_output=True, text=True, env=_env(),
                         cwd=tmp_path, check=True).stdout.splitlines()  # fmt: skip
    code, last_line, peak_kib = int(out[0]), out[1], int(out[2])
    assert code != 0 and "data.jsonl:2: the row is longer than 1 MiB" in last_line
    # The row is refused unread, before torch is even imported: the whole run stays far below the row's 40 MB x the
    # tokenizer's blow-up (it passed 3 GiB before rows were read with a bound).
    assert peak_kib < 200 * 1024, f"peak RSS {peak_kib} KiB"


@pytest.mark.e2e
@pytest.mark.slow
def test_a_kill_during_a_checkpoint_save_is_skipped_by_resume(tmp_path, single_thread_torch):
    """A real process is killed while it writes a checkpoint (its trainer state is a FIFO, so the write blocks after
    the adapter, optimizer and RNG files); ``--resume`` removes that checkpoint and continues from the one before,
    ending with the weights of an uninterrupted run. The killed run is a process; the resume and the uninterrupted run
    are the same command in this process, on one torch thread as the process has (OMP_NUM_THREADS=1)."""
    from builder_helpers import cli
    from safetensors.torch import load_file

    from lance_pipeline.tiny.text_components import create_tiny_causal_lm

    model = create_tiny_causal_lm(tmp_path / "lm")
    rows = [{**GOOD, "caption": f"a photo of a dog number {i} in the snow"} for i in range(8)]
    rows.append({**GOOD, "variations": ["a photo of a dog in the snow " + "at dusk " * 60_000]})  # cut, not refused
    data = _jsonl(tmp_path / "data.jsonl", rows)
    options = ["--model", str(model), "--data", str(data), "--batch-size", "2", "--grad-accum", "1", "--steps", "12",
               "--save-steps", "1", "--warmup-steps", "0", "--lr", "0.01", "--device", "cpu", "--no-progress"]  # fmt: skip

    def train(output: Path) -> subprocess.Popen:
        command = [sys.executable, "-m", "builder.cli", "perturber", "train", "--output", str(output), *options]
        return subprocess.Popen(command, env=_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)  # fmt: skip

    interrupted = tmp_path / "interrupted"
    victim = train(interrupted)
    checkpoints = interrupted / "checkpoints"

    def numbers() -> list[int]:
        return (
            sorted(int(p.name.split("-")[1]) for p in checkpoints.glob("checkpoint-*")) if checkpoints.is_dir() else []
        )

    while not any((checkpoints / f"checkpoint-{n}" / "trainer_state.json").is_file() for n in numbers()):
        assert victim.poll() is None, victim.communicate()
        time.sleep(0.05)
    # Frozen while the trap is set two saves ahead, so the trap is ahead whatever the machine's speed.
    victim.send_signal(signal.SIGSTOP)
    trap = max(numbers()) + 2
    assert trap <= 12
    blocked = checkpoints / f"checkpoint-{trap}"
    blocked.mkdir()
    os.mkfifo(blocked / "trainer_state.json")
    victim.send_signal(signal.SIGCONT)
    while not (blocked / "rng_state.pth").is_file():  # the save reached its last step: writing the trainer state
        assert victim.poll() is None, victim.communicate()
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert numbers() == [trap - 1, trap]  # the Trainer keeps two; the newest is the partial one

    resumed = cli("perturber", "train", "--output", str(interrupted), *options, "--resume", check=False)
    assert resumed.returncode == 0, resumed.stderr
    err = resumed.stderr
    assert f"removing the partial checkpoint checkpoint-{trap}" in err and "Traceback" not in err
    cli("perturber", "train", "--output", str(tmp_path / "whole"), *options)
    first = load_file(str(tmp_path / "whole" / "adapter_model.safetensors"))
    second = load_file(str(interrupted / "adapter_model.safetensors"))
    assert first.keys() == second.keys()
    for name in first:
        assert (first[name] - second[name]).abs().max().item() < 1e-5, name
