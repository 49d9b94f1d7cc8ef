"""LoRA finetuning and evaluation of the structured caption perturber of LANCE.

Prabhu et al., NeurIPS 2023, "Stress-testing Visual Models by Generating Language-guided Counterfactual Images"
(arXiv 2305.19164), section 3.1, Implementation details and Table 6: LLaMA-7B finetuned with LoRA (rank 8, alpha 16,
dropout 0.05 on the attention query, key and value projections; learning rate 3e-4, effective batch 128 with gradient
accumulation 32, maximum sequence length 1024) on ~0.6k caption perturbations, for 37.5k steps with a weight update
every 32 (so 1,171 updates of 128 examples). The authors' adapter is a lit-llama state dict
that no current library loads, and they released neither the data nor the script. Here:

* :func:`train_perturber_lora` finetunes *any* transformers causal LM with PEFT through the transformers
  ``Trainer`` (accelerate underneath: one GPU, several, or CPU), on the rows written by
  :mod:`lance_pipeline.perturber.collect` (read and checked row by row by :mod:`lance_pipeline.perturber.data`, memory
  bounded whatever a row's size), in the Alpaca prompt the perturb stage uses for adapters
  (:func:`~lance_pipeline.text.perturbation.alpaca_prompt`), with the loss on the answer tokens only. It checkpoints,
  resumes, and writes a PEFT adapter (safetensors) with a model card that
  :class:`~lance_pipeline.text.perturbation.PromptPerturber` loads by path or Hub id.
* :func:`evaluate_perturbers` runs a base model and base + adapter side by side on held-out captions: parse
  rate, edit-type accuracy (:func:`~lance_pipeline.perturber.collect.judge_variation`), label preservation (the
  class check of :mod:`lance_pipeline.text.label_checks`) and diversity.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lance_pipeline.deviations import render_table, rows_of
from lance_pipeline.edit_types import edit_type as edit_type_row
from lance_pipeline.edit_types import validate_edit_types
from lance_pipeline.perturber.collect import judge_variation
from lance_pipeline.perturber.data import count_instruction_rows, iter_instruction_rows
from lance_pipeline.readers import read_json
from lance_pipeline.text.perturbation import alpaca_prompt

logger = logging.getLogger(__name__)

# Leaf names of the attention query/key/value projections in transformers models, in the order tried; the first
# set found in a model is its q/k/v. Fused projections (GPT-2's c_attn, GPT-NeoX's query_key_value) hold all three.
QKV_MODULE_NAMES: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),  # Llama, Mistral, Qwen2, Gemma, OPT, Phi, GPT-J, ...
    ("query", "key", "value"),  # BERT-style attention in some decoders
    ("qkv_proj",),  # Phi-3
    ("query_key_value",),  # GPT-NeoX, Falcon, BLOOM
    ("c_attn",),  # GPT-2
    ("Wqkv",),  # MPT
)

ADAPTER_CARD = "README.md"
TRAINING_RECORD = "lance_training.json"
CHECKPOINTS = "checkpoints"
# The paper's length: "37.5k steps updating the weights every 32 steps" (Implementation details), i.e. forward/backward
# steps of one micro-batch on one device (lit-llama's finetune/lora.py: max_iters = 50000 * 3 // micro_batch_size 4).
PAPER_STEPS = 37_500
# Text cut before tokenising: no tokenizer's tokens average this many characters, so nothing that could fit in
# max_length tokens is lost, and a huge answer never reaches the tokenizer whole.
MAX_CHARS_PER_TOKEN = 32


@dataclass
class LoraTrainingConfig:
    """Hyperparameters; the defaults are the paper's (Table 6) where it gives one, marked "ours" otherwise."""

    rank: int = 8  # paper
    alpha: int = 16  # paper
    dropout: float = 0.05  # paper
    target_modules: list[str] | None = None  # paper: q, k, v; None maps them to the model's own module names
    learning_rate: float = 3e-4  # paper
    batch_size: int = 128  # paper: effective batch (per-device batch x accumulation x devices)
    gradient_accumulation_steps: int = 32  # paper
    max_length: int = 1024  # paper
    steps: int | None = PAPER_STEPS  # paper: forward/backward steps; the optimizer updates every accumulation
    epochs: float | None = None  # instead of steps: passes over the data
    # lit-llama's finetune/lora.py, whose other defaults are the paper's Table 6 and whose length is the paper's 37.5k
    # steps: 100 updates of linear warmup, then a constant learning rate (the paper states neither).
    warmup_steps: float = 100  # an int is optimizer updates, a float in (0, 1) a fraction of the run
    weight_decay: float = 0.0  # paper
    lr_scheduler: str = "constant_with_warmup"  # lit-llama
    save_steps: int = 50  # ours: checkpoint every this many optimizer steps
    save_total_limit: int | None = 2  # ours
    logging_steps: int = 1
    seed: int = 0
    train_on_prompt: bool = False  # ours: the loss covers the answer only
    dtype: str = "auto"  # bfloat16 on a GPU that supports it, float32 otherwise

    def check(self) -> None:
        """Raise ``ValueError`` naming the first bad value."""
        for name in ("rank", "alpha", "batch_size", "gradient_accumulation_steps", "max_length", "save_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.epochs is not None:
            if self.steps is not None:
                raise ValueError(f"give steps or epochs, not both (got steps={self.steps}, epochs={self.epochs})")
            if not self.epochs > 0:
                raise ValueError(f"epochs must be > 0, got {self.epochs}")
        elif self.steps is None or self.steps < self.gradient_accumulation_steps:
            raise ValueError(
                f"steps must be at least gradient_accumulation_steps ({self.gradient_accumulation_steps}), one "
                f"update, got {self.steps}"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")

    @property
    def optimizer_steps(self) -> int | None:
        """Weight updates of a steps-based run (``steps // gradient_accumulation_steps``: 1,171 for the paper's), or
        ``None`` when it runs by epochs."""
        return None if self.epochs is not None else self.steps // self.gradient_accumulation_steps

    def per_device_batch_size(self, world_size: int = 1) -> int:
        """The micro-batch that gives the effective ``batch_size`` with the accumulation on ``world_size`` devices."""
        per_step = self.gradient_accumulation_steps * world_size
        if self.batch_size % per_step:
            raise ValueError(
                f"batch_size {self.batch_size} is not a multiple of gradient_accumulation_steps x devices "
                f"({self.gradient_accumulation_steps} x {world_size}); the paper's pair is 128 and 32"
            )
        return self.batch_size // per_step


def find_qkv_modules(model: Any) -> list[str]:
    """The leaf names of ``model``'s attention q/k/v projections (see :data:`QKV_MODULE_NAMES`).

    Raises:
        ValueError: when none of the known names is a linear layer of the model; pass ``target_modules``.
    """
    import torch

    leaves = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if _is_linear(module, torch)}
    for names in QKV_MODULE_NAMES:
        if all(n in leaves for n in names):
            return list(names)
    raise ValueError(
        f"cannot find the attention q/k/v projections of {type(model).__name__} (linear layers: "
        f"{', '.join(sorted(leaves)[:12])}...); pass --target-modules with their names"
    )


def _is_linear(module: Any, torch: Any) -> bool:
    if isinstance(module, torch.nn.Linear):
        return True
    return type(module).__name__ == "Conv1D"  # GPT-2's transposed linear layer (transformers.pytorch_utils)


# -- data ---------------------------------------------------------------------------------------------------


def load_instruction_rows(
    data: str, split: str = "train", revision: str | None = None, accepted_only: bool = True
) -> list[dict[str, Any]]:
    """The checked rows of one split as a list (training streams them instead: ``iter_instruction_rows``).

    Args:
        data: A directory, a ``.jsonl``/``.parquet`` file or a Hub dataset id (:mod:`lance_pipeline.perturber.data`).
        split: ``train`` or ``test``.
        revision: Hub revision of ``data``.
        accepted_only: Only rows with at least one accepted variation (the ones there is something to learn from).

    Raises:
        InstructionDataError: (a ``ValueError``) at the first bad row, naming its file, line and field.
    """
    return list(iter_instruction_rows(data, split, revision, accepted_only))


def format_example(row: dict[str, Any]) -> tuple[str, str]:
    """The (prompt, answer) text of one row, as the perturb stage prompts an adapter."""
    instruction = row.get("instruction") or edit_type_row(row["edit_type"]).instruction
    variations = list(row["variations"])
    prompt = alpaca_prompt(instruction, row["caption"], row.get("label_name"), len(variations))
    return prompt, "\n".join(variations)


def tokenize_example(
    row: dict[str, Any], tokenizer: Any, eos_token_id: int, max_length: int, train_on_prompt: bool
) -> dict[str, list[int]] | None:
    """Token ids, attention mask and labels of one row (prompt labels are -100 unless ``train_on_prompt``).

    The prompt is tokenized with the tokenizer's special tokens, as the perturb stage does at inference; the answer
    ends with the model's end-of-sequence id (the one ``generate`` stops at). Returns ``None`` when the prompt
    alone fills ``max_length`` (nothing of the answer would be learnt).

    Text is cut to ``max_length * MAX_CHARS_PER_TOKEN`` characters before it is tokenized, so a huge row costs no more
    than a long one: a prompt longer than that cannot fit (``None``), and an answer longer than that is cut by
    ``max_length`` anyway (it then gets no end-of-sequence id: it did not end there).
    """
    prompt, answer = format_example(row)
    limit = max_length * MAX_CHARS_PER_TOKEN
    if len(prompt) > limit:
        return None
    prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if len(prompt_ids) >= max_length:
        return None
    answer_ids = tokenizer(answer[:limit], add_special_tokens=False)["input_ids"]
    if len(answer) <= limit:
        answer_ids = answer_ids + [eos_token_id]
    input_ids = (prompt_ids + answer_ids)[:max_length]
    labels = list(input_ids) if train_on_prompt else [-100] * len(prompt_ids) + input_ids[len(prompt_ids) :]
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


def _eos_id(model: Any, tokenizer: Any) -> int:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    if isinstance(eos, list):
        eos = eos[0]
    if eos is None:
        raise ValueError("the model has no end-of-sequence token (generation_config.eos_token_id or the tokenizer's)")
    return int(eos)


# -- training -----------------------------------------------------------------------------------------------


@dataclass
class TrainingOutcome:
    """Where the adapter went and what the run measured."""

    adapter_dir: Path
    metrics: dict[str, Any] = field(default_factory=dict)
    log_history: list[dict[str, Any]] = field(default_factory=list)


def train_perturber_lora(
    model: str,
    data: str,
    output: str | Path,
    config: LoraTrainingConfig | None = None,
    revision: str | None = None,
    data_revision: str | None = None,
    resume: bool = False,
    device: str | None = None,
    progress: bool = False,
    callbacks: list[Any] | None = None,
) -> TrainingOutcome:
    """LoRA-finetune ``model`` on the instruction data ``data`` and write the adapter to ``output``.

    Args:
        model: Hub id or local directory of a causal LM (the base the adapter is for).
        data: Dataset written by ``lance-cf perturber collect`` (directory or Hub id); its ``test`` split, if any,
            gives the held-out loss.
        output: Adapter directory; checkpoints go to ``output/checkpoints``.
        config: Hyperparameters (default: the paper's).
        revision: Hub revision of ``model``.
        data_revision: Hub revision of ``data``.
        resume: Continue from the newest checkpoint in ``output/checkpoints``. Without it, existing checkpoints
            are an error (nothing is silently overwritten or silently resumed).
        device: ``"cpu"`` forces the CPU; otherwise accelerate picks the available accelerators.
        progress: Show the Trainer's progress bar.
        callbacks: Extra ``transformers.TrainerCallback`` objects (logging, early stopping, tests).

    Returns:
        A :class:`TrainingOutcome` with the adapter directory, the metrics written to the card and the loss log.
    """
    config = config or LoraTrainingConfig()
    config.check()
    output = Path(output)
    checkpoints = output / CHECKPOINTS
    last, partial = find_checkpoints(checkpoints)
    if (last or partial) and not resume:
        found = (last or partial[-1]).name
        raise ValueError(f"{output} already has checkpoints ({found}); pass --resume or a new --output")
    if resume and not (last or partial):
        raise ValueError(f"--resume: no checkpoint in {checkpoints}; start without --resume")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    micro_batch = config.per_device_batch_size(world_size)

    # 1. Data: every row of both splits checked, streamed, before any model is loaded (a bad row is one line naming
    #    its file, line and field); rows with accepted variations become examples in the Alpaca prompt with
    #    answer-only labels.
    count_instruction_rows(data, "train", data_revision)
    has_test = count_instruction_rows(data, "test", data_revision)["with_variations"] > 0
    if resume:
        # A checkpoint whose save was interrupted (the process killed mid-save) has no complete trainer state: it is
        # removed, and training resumes from the newest complete one (or from the start when there is none).
        for broken in partial:
            logger.warning("removing the partial checkpoint %s (its save was interrupted)", broken.name)
            shutil.rmtree(broken)
        if last is None:
            logger.warning("no complete checkpoint in %s: training from the start", checkpoints)
    # The libraries load only now: bad data or options fail in a second, with little memory.
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        PrinterCallback,
        Trainer,
        TrainingArguments,
        set_seed,
    )

    set_seed(config.seed)
    tokenizer = AutoTokenizer.from_pretrained(model, revision=revision)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    use_cpu = device == "cpu" or not torch.cuda.is_available()
    dtype = config.dtype
    if dtype == "auto":
        dtype = "bfloat16" if not use_cpu and torch.cuda.is_bf16_supported() else "float32"
    base = AutoModelForCausalLM.from_pretrained(
        model, revision=revision, dtype=getattr(torch, dtype), use_safetensors=True
    )
    eos_id = _eos_id(base, tokenizer)
    train_set, n_too_long = _tokenize_split(data, "train", data_revision, tokenizer, eos_id, config)
    test_set, _ = _tokenize_split(data, "test", data_revision, tokenizer, eos_id, config) if has_test else (None, 0)

    # 2. LoRA on the attention q/k/v projections (the model's own names), the paper's shape.
    targets = config.target_modules or find_qkv_modules(base)
    lora = LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=sorted(targets),
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(base, lora)
    trainable, total = peft_model.get_nb_trainable_parameters()
    logger.info("LoRA on %s: %d trainable of %d parameters", ",".join(sorted(targets)), trainable, total)

    # 3. Train with the transformers Trainer: checkpoints every save_steps, resumable with the RNG state.
    args = TrainingArguments(
        output_dir=str(checkpoints),
        per_device_train_batch_size=micro_batch,
        per_device_eval_batch_size=micro_batch,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        learning_rate=config.learning_rate,
        num_train_epochs=config.epochs if config.epochs is not None else 1.0,
        max_steps=config.optimizer_steps if config.optimizer_steps is not None else -1,
        warmup_steps=config.warmup_steps,
        weight_decay=config.weight_decay,
        lr_scheduler_type=config.lr_scheduler,
        logging_steps=config.logging_steps,
        logging_first_step=True,
        save_strategy="steps",
        save_steps=config.save_steps,
        save_total_limit=config.save_total_limit,
        seed=config.seed,
        data_seed=config.seed,
        bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
        use_cpu=use_cpu,
        optim="adamw_torch",
        report_to="none",
        remove_unused_columns=False,
        disable_tqdm=not progress,
        dataloader_num_workers=0,
    )
    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    trainer = Trainer(
        model=peft_model,
        args=args,
        data_collator=collator,
        train_dataset=train_set,
        eval_dataset=test_set,
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    # The Trainer prints each log line to stdout when its progress bar is off; route them to logging instead.
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(_LogToLogger())
    train_result = trainer.train(resume_from_checkpoint=str(last) if resume and last else None)

    # 4. Measure: train loss, held-out loss with and without the adapter.
    metrics: dict[str, Any] = {
        "train_loss": round(float(train_result.training_loss), 6),
        "optimizer_steps": int(trainer.state.global_step),
        "epochs": round(float(trainer.state.epoch or 0.0), 4),
        "train_examples": len(train_set),
        "train_examples_dropped_too_long": n_too_long,
        "test_examples": len(test_set) if test_set else 0,
    }
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    if losses:
        metrics["first_logged_loss"], metrics["last_logged_loss"] = round(losses[0], 6), round(losses[-1], 6)
    if test_set:
        metrics["test_loss_adapter"] = round(float(trainer.evaluate()["eval_loss"]), 6)
        with peft_model.disable_adapter():
            metrics["test_loss_base"] = round(float(trainer.evaluate()["eval_loss"]), 6)

    # 5. The adapter (safetensors) and its card.
    output.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(output), safe_serialization=True)
    _normalise_adapter_config(output, model)
    record = {
        "base_model": _public_name(model),
        "base_model_revision": revision,
        "data": _public_name(data),
        "data_revision": data_revision,
        "hyperparameters": {
            **asdict(config),
            "target_modules": sorted(targets),
            "per_device_batch_size": micro_batch,
            "world_size": world_size,
            "dtype": dtype,
        },  # fmt: skip
        "prompt_style": "alpaca",
        "metrics": metrics,
        "versions": package_versions(),
    }
    (output / TRAINING_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    (output / ADAPTER_CARD).write_text(render_adapter_card(record))
    return TrainingOutcome(output, metrics, list(trainer.state.log_history))


def _LogToLogger():
    from transformers import TrainerCallback

    class LogToLogger(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs:
                logger.info("step %d: %s", state.global_step, json.dumps(logs, sort_keys=True))

    return LogToLogger()


def _tokenize_split(
    data: str, split: str, revision: str | None, tokenizer: Any, eos_id: int, config: LoraTrainingConfig
):
    """The split's examples as a ``datasets.Dataset``, rows streamed and tokenized a chunk at a time."""
    import datasets

    chunks, dropped = [], 0
    columns: dict[str, list] = {"input_ids": [], "attention_mask": [], "labels": []}
    for row in iter_instruction_rows(data, split, revision):
        example = tokenize_example(row, tokenizer, eos_id, config.max_length, config.train_on_prompt)
        if example is None:
            dropped += 1
            continue
        for name, values in columns.items():
            values.append(example[name])
        if len(columns["input_ids"]) >= 1000:
            chunks.append(datasets.Dataset.from_dict(columns))
            columns = {name: [] for name in columns}
    if columns["input_ids"]:
        chunks.append(datasets.Dataset.from_dict(columns))
    if dropped:
        logger.warning("%d %s example(s) dropped: prompt longer than max_length=%d", dropped, split, config.max_length)
    if not chunks:
        if split == "train":
            raise ValueError(f"every train prompt is longer than max_length={config.max_length} tokens")
        return None, dropped
    return (chunks[0] if len(chunks) == 1 else datasets.concatenate_datasets(chunks)), dropped


def find_checkpoints(directory: Path) -> tuple[Path | None, list[Path]]:
    """The newest complete Trainer checkpoint in ``directory`` and the partial ones, oldest first.

    A checkpoint is complete when its trainer state, which the Trainer writes last, is a file that parses, and its
    adapter weights are there; a process killed while saving leaves the state missing, a pipe or half written.
    """
    found = []
    if directory.is_dir():
        for entry in directory.iterdir():
            prefix, _, number = entry.name.partition("-")
            if prefix == "checkpoint" and number.isdigit() and entry.is_dir():
                found.append((int(number), entry))
    complete, partial = [], []
    for _, entry in sorted(found):
        (complete if _is_complete_checkpoint(entry) else partial).append(entry)
    return (complete[-1] if complete else None), partial


def _is_complete_checkpoint(checkpoint: Path) -> bool:
    state = checkpoint / "trainer_state.json"
    if not state.is_file() or not (checkpoint / "adapter_model.safetensors").is_file():
        return False
    try:
        return "global_step" in read_json(state)
    except (OSError, ValueError):
        return False


def _public_name(reference: str) -> str:
    """A Hub id as is; a local directory by its last component only (no private paths in published files)."""
    return Path(reference).name if os.path.isdir(reference) else reference


def _normalise_adapter_config(output: Path, model: str) -> None:
    # PEFT writes target_modules from a set (order varies with PYTHONHASHSEED) and the base as given, which for a
    # local directory is a private absolute path; PEFT's own README stub names it too and is replaced by our card.
    config_file = output / "adapter_config.json"
    adapter_config = read_json(config_file)
    adapter_config["target_modules"] = sorted(adapter_config["target_modules"])
    adapter_config["base_model_name_or_path"] = _public_name(model)
    config_file.write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")


def package_versions() -> dict[str, str]:
    """Versions of the libraries that shape the result."""
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for package in ("torch", "transformers", "peft", "accelerate", "datasets", "lance-counterfactuals"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = "not installed"
    return versions


_PAPER_VALUES = {
    "rank": "8 (paper)",
    "alpha": "16 (paper)",
    "dropout": "0.05 (paper)",
    "learning_rate": "3e-4 (paper)",
    "batch_size": "128 (paper, effective)",
    "gradient_accumulation_steps": "32 (paper)",
    "max_length": "1024 (paper)",
    "steps": "37500 (paper: an update every 32, so 1171 updates)",
    "weight_decay": "0 (paper)",
    "warmup_steps": "100 (lit-llama's recipe, whose defaults the paper's are)",
    "lr_scheduler": "constant_with_warmup (lit-llama's recipe)",
}


def render_adapter_card(record: dict[str, Any]) -> str:
    """The adapter's model card: base model, data, hyperparameters (with the paper's values), metrics, usage."""
    hyper = record["hyperparameters"]
    base, data = record["base_model"], record["data"]
    rows = "".join(
        f"| `{name}` | `{value}` | {_PAPER_VALUES.get(name, 'ours')} |\n"
        for name, value in sorted(hyper.items())
        if name not in ("dtype", "world_size", "per_device_batch_size")
    )
    metrics = "".join(f"| {name} | {value} |\n" for name, value in sorted(record["metrics"].items()))
    versions = ", ".join(f"{k} {v}" for k, v in sorted(record["versions"].items()))
    revision = f" at revision `{record['base_model_revision']}`" if record["base_model_revision"] else ""
    return (
        f"---\nlibrary_name: peft\nbase_model: {base}\npipeline_tag: text-generation\n"
        "tags:\n- lora\n- peft\n- lance\n- caption-editing\n---\n\n"
        f"# LANCE caption perturber: LoRA adapter for `{base}`\n\n"
        "A LoRA adapter that turns a causal LM into the structured caption perturber of LANCE (Prabhu et al., "
        "NeurIPS 2023, section 3.1): given a caption, an edit type and the class to keep, it writes variations that "
        "change only that aspect. Trained with `lance-cf perturber train`.\n\n"
        f"- Base model: `{base}`{revision}\n"
        f"- Data: `{data}` ({record['metrics']['train_examples']} training examples), written by "
        "`lance-cf perturber collect`\n"
        "- Prompt: the Alpaca template of `lance_pipeline.text.perturbation.alpaca_prompt` "
        "(`### Instruction / ### Input / ### Variations`); loss on the answer only\n\n"
        "## Use\n\n```bash\n"
        f'lance-cf perturber try "a photo of a husky pulling a sled in the snow" --label "dog sled" \\\n'
        f"    --model {base} --adapter ADAPTER_ID_OR_DIR\n```\n\n"
        "In a build config: `options: {model: BASE, revision: ..., adapter: ADAPTER_ID_OR_DIR, adapter_revision: "
        "...}` on the `perturb` stage.\n\n"
        "## Hyperparameters\n\n| name | value | source |\n|---|---|---|\n" + rows + "\n"
        "## Metrics\n\n| metric | value |\n|---|---|\n" + metrics + "\n"
        "## Deviations from the paper\n\n" + render_table(rows_of("perturber"), with_applies=False) + "\n"
        f"Software: {versions}.\n"
    )


# -- evaluation ---------------------------------------------------------------------------------------------


def evaluate_perturber(
    perturber: Any,
    captions: list[tuple[str, str | None]],
    edit_types: list[str] | tuple[str, ...] | None = None,
    label_check: Any | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Score one loaded perturber on held-out captions.

    Args:
        perturber: A loaded :class:`~lance_pipeline.text.perturbation.PromptPerturber`.
        captions: ``(caption, class name)`` pairs.
        edit_types: Types to request (default: the perturber's).
        label_check: A loaded :class:`~lance_pipeline.text.label_checks.LabelPreservationCheck`, or ``None`` to skip
            label preservation.
        seed: Per-caption seeds are ``seed + index`` (they matter only when sampling).

    Returns:
        ``generations`` (caption x edit type answers), ``parse_rate`` (share of answers with at least one usable
        edit), ``line_parse_rate`` (kept lines over all answer lines), ``edits_per_generation``,
        ``edit_type_accuracy`` (share of parsed edits that change only the requested aspect, by
        :func:`~lance_pipeline.perturber.collect.judge_variation`; also ``..._by_type``), ``label_preservation``
        (share of parsed edits the class check keeps; ``None`` without a check), ``diversity`` (mean distinct
        edited spans per caption) and ``rejected_by_reason``.
    """
    from collections import Counter

    texts = [c for c, _ in captions]
    labels = [label for _, label in captions]
    types = perturber.edit_types if edit_types is None else validate_edit_types(edit_types)
    detailed = perturber.perturb_detailed(texts, types, labels, [seed + i for i in range(len(texts))])
    generations = lines = kept_lines = answered = 0
    judged: Counter = Counter()
    accepted_by_type: Counter = Counter()
    parsed_by_type: Counter = Counter()
    distinct_spans: list[int] = []
    for (caption, label), item in zip(captions, detailed, strict=True):
        stats = item["perturb_stats"]
        generations += stats["generations"]
        lines += stats["lines"]
        kept_lines += stats["kept"]
        answered += sum(1 for n in stats["kept_by_type"].values() if n)
        spans = set()
        for edit in item["edits"]:
            _, reason = judge_variation(caption, edit.edited_caption, edit.edit_type, label)
            judged[reason or "accepted"] += 1
            parsed_by_type[edit.edit_type] += 1
            accepted_by_type[edit.edit_type] += int(reason is None)
            spans.add(" ".join(edit.edited_span.casefold().split()))
        distinct_spans.append(len(spans))
    n_edits = sum(judged.values())
    label_kept = None
    if label_check is not None and n_edits:
        samples = [
            ([e.to_dict() for e in item["edits"]], label or "")
            for (_, label), item in zip(captions, detailed, strict=True)
        ]
        checked = label_check.check_batch([s for s in samples if s[0] and s[1]])
        n_checked = sum(len(edits) for edits in checked)
        label_kept = round(sum(e["kept"] for edits in checked for e in edits) / n_checked, 4) if n_checked else None
    return {
        "captions": len(captions),
        "generations": generations,
        "parse_rate": round(answered / generations, 4) if generations else 0.0,
        "line_parse_rate": round(kept_lines / lines, 4) if lines else 0.0,
        "edits_per_generation": round(n_edits / generations, 4) if generations else 0.0,
        "edit_type_accuracy": round(judged["accepted"] / n_edits, 4) if n_edits else 0.0,
        "edit_type_accuracy_by_type": {
            t: round(accepted_by_type[t] / parsed_by_type[t], 4) for t in types if parsed_by_type[t]
        },
        "label_preservation": label_kept,
        "diversity": round(sum(distinct_spans) / len(distinct_spans), 4) if distinct_spans else 0.0,
        "rejected_by_reason": {k: v for k, v in sorted(judged.items()) if k != "accepted"},
    }


EVAL_COLUMNS = ("parse_rate", "line_parse_rate", "edits_per_generation", "edit_type_accuracy", "label_preservation",
                "diversity")  # fmt: skip


def render_eval_table(results: dict[str, dict[str, Any]]) -> str:
    """A Markdown table with one row per perturber (base model, adapters)."""
    header = "| perturber | " + " | ".join(EVAL_COLUMNS) + " |\n|---|" + "---|" * len(EVAL_COLUMNS) + "\n"
    body = "".join(
        f"| {name} | " + " | ".join("n/a" if r[c] is None else f"{r[c]:.3f}" for c in EVAL_COLUMNS) + " |\n"
        for name, r in results.items()
    )
    return header + body
