"""Structured caption perturbation with a language model, the second step of LANCE.

Prabhu et al., NeurIPS 2023, "Stress-testing Visual Models by Generating Language-guided Counterfactual
Images" (arXiv 2305.19164), section 3.1 ("Structured caption perturbation") and Table 5: an LLM rewrites
the caption so that exactly one aspect changes (subject, object, background, adjective or the image
domain; weather is its own type in the authors' code) while the true class stays. The paper fine-tunes
LLaMA-7B with LoRA on such rewrites and reports that in-prompt examples help.

This module offers one interface, :meth:`PromptPerturber.perturb` ``(captions, edit_types, label_names) ->
edits``, over two backends that share all code:

* any transformers causal LM used few-shot through its chat template (default: an Apache-2.0 instruction
  model, ``Qwen/Qwen2.5-7B-Instruct``), and
* the same with a PEFT LoRA adapter (the paper's fine-tuned perturber), prompted Alpaca-style as the
  authors' adapter was trained (``### Instruction / ### Input / ### Variations``).

Our instructions are written in our own words after the paper's Table 5, tell the model which class must
stay, and ask for ``n_per_type`` variations, one per line. The answer is parsed defensively
(:func:`parse_perturber_output`): numbering, bullets and quotes are removed; duplicates, edits identical to
the caption, edits that change too much, overlong lines, preambles and a line cut off by the token limit
are dropped and counted per sample in ``perturb_stats``. Malformed output never raises.

Determinism: decoding is greedy by default. With ``do_sample=True`` every (sample, edit type) row draws
its own Gumbel noise from a generator seeded by the sample's seed and the edit type, so the edits depend
only on the seed, never on which other samples share the batch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import weakref
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, Literal

from lance_pipeline.edit_types import edit_type as edit_type_row
from lance_pipeline.edit_types import validate_edit_types
from lance_pipeline.models.needs import PEFT_ADAPTER_FILES, ModelOption
from lance_pipeline.option_types import Fraction, Interval, Options, PositiveInt, Probability, TorchDtype
from lance_pipeline.stage import Record, SampleFailure, stage_options
from lance_pipeline.text.edit_spans import diff_captions

logger = logging.getLogger(__name__)

DEFAULT_PERTURBER = "Qwen/Qwen2.5-7B-Instruct"
# A commit of Qwen/Qwen2.5-7B-Instruct: public code holds it as the Hub cache's snapshot directory
# (models--Qwen--Qwen2.5-7B-Instruct/snapshots/<this hash>), so the Hub served it (see docs/method.md).
DEFAULT_PERTURBER_REVISION = "a09a35458c702b33eeacc393d103063234e8bc28"
PROMPT_STYLES = ("auto", "chat", "alpaca")

# The instruction and worked example of each edit type come from the one table of edit types
# (lance_pipeline.edit_types), in our words after the paper's Table 5 and the six types of the authors' code.

SYSTEM_PROMPT = (
    "You edit image captions to describe counterfactual images for testing image classifiers. Each edit changes "
    "exactly one aspect of the caption and keeps the named class unchanged. Answer with one edited caption per "
    "line and nothing else."
)

ALPACA_TEMPLATE = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{caption}\n\n### Variations:\n"
)

# Reasons a line of LLM output is dropped (the keys of ``perturb_stats`` besides the totals).
DROP_REASONS = ("preamble", "identical", "duplicate", "overlong", "too_broad", "truncated", "extra")

_LIST_MARKER_RE = re.compile(r"^\s*(?:[-*•·–]+\s*|\(?\d{1,2}\s*[.):\]]\s*|#\d{1,2}\s*[.):]?\s*)")
_LABEL_PREFIX_RE = re.compile(
    r"^\s*(?:variation|caption|edit|edited|edited caption|new caption|modified caption|original|original caption"
    r"|output|answer|result|response)\s*\d*\s*[:.)-]\s*",
    re.I,
)
# Markdown emphasis that chat models wrap lines or labels in ("**a photo of ...**", "**Caption:** ...").
_EMPHASIS_RE = re.compile(r"\*\*|__")
# A line ending in one of these words stopped mid-phrase (an answer cut short without hitting the token limit).
_DANGLING_WORDS = frozenset("a an the of and or with in on at to by from for near under over its their his her".split())
_PREAMBLE_RE = re.compile(r"^(?:here (?:are|is)|sure|certainly|okay|ok,|note:|i (?:have|changed|hope))\b", re.I)
_QUOTES = "\"'“”‘’`"


@dataclass(frozen=True)
class Edit:
    """One caption edit: its type, the new caption and the spans it changed."""

    edit_type: str
    edited_caption: str
    original_span: str
    edited_span: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ParsedOutput:
    """What :func:`parse_perturber_output` kept from one LLM answer, and why it dropped the rest."""

    captions: list[str] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)
    n_lines: int = 0
    # Each dropped line (cleaned) with its reason, for datasets that keep rejections (perturber_collect).
    rejected: list[tuple[str, str]] = field(default_factory=list)


def _clean_line(line: str, caption: str) -> str:
    text = " ".join(_EMPHASIS_RE.sub("", line).split())
    for _ in range(2):  # "1. "quoted"" and '- Caption: ...' need two passes
        text = _LIST_MARKER_RE.sub("", text, count=1)
        text = _LABEL_PREFIX_RE.sub("", text, count=1)
        if len(text) >= 2 and text[0] in _QUOTES and text[-1] in _QUOTES + ".":
            text = text.strip(_QUOTES + " ").rstrip(".").strip(_QUOTES + " ") if text[-1] == "." else text[1:-1]
            text = text.strip()
    if not caption.rstrip().endswith(")"):
        text = re.sub(r"\s*\([^()]*\)\s*$", "", text)  # trailing "(changed the weather)" notes
    if text.endswith(".") and not caption.rstrip().endswith("."):
        text = text.rstrip(".").rstrip()
    return text


def parse_perturber_output(
    text: str,
    caption: str,
    *,
    n: int | None = None,
    truncated: bool = False,
    max_span_words: int = 12,
    min_shared_fraction: float = 0.5,
    max_words: int | None = None,
) -> ParsedOutput:
    """Turn one LLM answer into a list of edited captions, counting what was dropped and why.

    Args:
        text: The generated text (the continuation only, not the prompt).
        caption: The caption that was edited.
        n: Keep at most this many edits (the rest count as ``extra``); ``None`` keeps all.
        truncated: Whether generation stopped at the token limit; the last line is then dropped as
            ``truncated`` because it may be cut off.
        max_span_words: An edit whose changed span has more words than this in either caption changed more
            than one aspect (``too_broad``).
        min_shared_fraction: An edit must keep at least this fraction of the caption's words (``too_broad``
            otherwise).
        max_words: Longest acceptable edit in words (``overlong``); default ``max(2 * len(caption), len + 16)``.

    Returns:
        A :class:`ParsedOutput`. Never raises on malformed text.
    """
    result = ParsedOutput()
    if not isinstance(text, str) or not text.strip():
        return result
    caption_words = len(caption.split())
    if max_words is None:
        max_words = max(2 * caption_words, caption_words + 16)
    lines = [line for line in text.splitlines() if line.strip()]
    # The model started a new prompt section ("### Instruction:", "<|user|>"): nothing after it is an answer.
    for i, line in enumerate(lines):
        if line.lstrip().startswith(("###", "<|")):
            lines = lines[:i]
            break
    result.n_lines = len(lines)
    seen: set[str] = set()
    for index, line in enumerate(lines):
        if truncated and index == len(lines) - 1:
            result.dropped["truncated"] += 1
            result.rejected.append((line.strip(), "truncated"))
            continue
        edited = _clean_line(line, caption)
        reason = _reject_reason(edited, caption, seen, max_span_words, min_shared_fraction, max_words)
        if reason is None and n is not None and len(result.captions) >= n:
            reason = "extra"
        if reason is not None:
            result.dropped[reason] += 1
            result.rejected.append((edited, reason))
            continue
        seen.add(_norm(edited))
        result.captions.append(edited)
    return result


def _norm(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s-]", " ", text.casefold()).split())


def _reject_reason(
    edited: str, caption: str, seen: set[str], max_span_words: int, min_shared_fraction: float, max_words: int
) -> str | None:
    if not edited or _PREAMBLE_RE.match(edited) or edited.endswith(":"):
        return "preamble"
    if len(edited.split()) > max_words or len(edited) > 8 * max_words:
        return "overlong"
    if _norm(edited) == _norm(caption):
        return "identical"
    if _norm(edited) in seen:
        return "duplicate"
    last_word, caption_last_word = _norm(edited).rsplit(" ", 1)[-1], _norm(caption).rsplit(" ", 1)[-1:]
    if last_word in _DANGLING_WORDS and [last_word] != caption_last_word:
        return "truncated"
    diff = diff_captions(caption, edited)
    if diff.n_regions == 0:
        return "identical"
    n_caption = max(1, len(caption.split()))
    if max(diff.n_original_tokens, diff.n_edited_tokens) > max_span_words or (
        diff.n_shared_tokens / n_caption < min_shared_fraction
    ):
        return "too_broad"
    return None


ADAPTER_WEIGHTS = "adapter_model.safetensors"


class _LoadedLM:
    """A loaded (model, tokenizer) pair; held by the perturbers that use it."""

    def __init__(self, model, tokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer


# Perturber-backed stages of one process (e.g. the three DILLEMA stages) share one loaded copy per (model, revision,
# adapter, dtype, device). The map is weak: it keeps nothing alive once no stage holds the model.
_LOADED_LMS: weakref.WeakValueDictionary[tuple, _LoadedLM] = weakref.WeakValueDictionary()


def resolve_adapter(adapter: str, revision: str | None) -> str:
    """The local directory of a PEFT adapter, with safetensors weights.

    PEFT falls back to a pickled ``adapter_model.bin`` when no safetensors file is there; the project loads
    safetensors only, so the weights file is checked here first. A Hub id is fetched (or found in the cache when
    offline) at ``revision`` with only the adapter config and safetensors weights.

    Raises:
        ValueError: naming the adapter, when it has no ``adapter_model.safetensors``.
    """
    if os.path.isdir(adapter):
        directory = adapter
    else:
        from huggingface_hub import snapshot_download

        directory = snapshot_download(
            adapter, revision=revision, allow_patterns=["adapter_config.json", ADAPTER_WEIGHTS]
        )
    if not os.path.isfile(os.path.join(directory, ADAPTER_WEIGHTS)):
        raise ValueError(
            f"LoRA adapter {adapter!r} has no {ADAPTER_WEIGHTS} (pickled adapter_model.bin is not loaded); "
            "convert it with peft's save_pretrained(safe_serialization=True)"
        )
    return directory


def _row_seed(seed: int, edit_type: str) -> int:
    digest = hashlib.sha256(f"{int(seed)}:{edit_type}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def _user_message(instruction: str, caption: str, label_name: str | None, n: int) -> str:
    keep = f'The class "{label_name}" must stay in the caption, unchanged.\n' if label_name else ""
    return f"{instruction}\n{keep}Write {n} different edited captions, one per line.\nCaption: {caption}"


def chat_messages(
    instruction: str, caption: str, edit_type_name: str, label_name: str | None, n: int, few_shot: bool = True
) -> list[dict[str, str]]:
    """The chat prompt for one (caption, edit type): system message, the type's example, the request.

    Shared by the perturb stage (through the tokenizer's chat template) and by a teacher answering over an
    OpenAI-compatible endpoint (``lance_pipeline.perturber.collect``), so both see the same words.
    """
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    if few_shot:
        example_caption, example_label, example_edits = edit_type_row(edit_type_name).example
        shots = example_edits[:n]
        messages.append(
            {"role": "user", "content": _user_message(instruction, example_caption, example_label, len(shots))}
        )
        messages.append({"role": "assistant", "content": "\n".join(shots)})
    messages.append({"role": "user", "content": _user_message(instruction, caption, label_name, n)})
    return messages


def alpaca_prompt(instruction: str, caption: str, label_name: str | None, n: int) -> str:
    """The Alpaca-style prompt a LoRA perturber is trained and run with (``lance-cf perturber train`` uses it)."""
    if label_name:
        instruction = f'{instruction} Keep "{label_name}" unchanged. Give {n} variations.'
    return ALPACA_TEMPLATE.format(instruction=instruction, caption=caption)


@dataclass
class PerturbOptions(Options):
    """The perturber's options (documented on ``PromptPerturber``); bounds and choices are their annotations.
    ``edit_types`` is kept as the checked tuple of type names (every type for ``None``), the keys of ``instructions``
    are checked edit types too."""

    model: str = DEFAULT_PERTURBER
    revision: str | None = DEFAULT_PERTURBER_REVISION
    adapter: str | None = None
    adapter_revision: str | None = None
    edit_types: list[str] | tuple[str, ...] | str | None = None
    n_per_type: PositiveInt = 3
    prompt_style: Literal["auto", "chat", "alpaca"] = "auto"
    few_shot: bool = True
    instructions: dict[str, str] | None = None
    batch_size: PositiveInt = 8
    max_new_tokens: PositiveInt = 256
    do_sample: bool = False
    temperature: float = 0.7
    top_p: Probability = 0.9
    repetition_penalty: Annotated[float, Interval(gt=0.0)] = 1.0
    max_span_words: PositiveInt = 12
    min_shared_fraction: Fraction = 0.5
    dtype: TorchDtype = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        # Edit types are a registry (lance_pipeline.edit_types), not a fixed choice: an unknown one gets "did you mean".
        self.edit_types = validate_edit_types(self.edit_types)
        if self.instructions:
            self.instructions = {validate_edit_types([k])[0]: v for k, v in self.instructions.items()}
        if self.do_sample and self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 when do_sample is on, got {self.temperature}")


class PromptPerturber:
    """The ``perturb`` stage: an LLM (optionally with a LoRA adapter) proposes one-aspect caption edits.

    Args:
        model: Hub id or local directory of a causal LM.
        revision: Hub revision of ``model``; a 40-hex commit for reproducible releases.
        adapter: Optional PEFT LoRA adapter (Hub id or directory) applied on top of ``model``.
        adapter_revision: Hub revision of ``adapter``.
        edit_types: Edit types to request per caption (default: every type of ``lance_pipeline.edit_types``).
        n_per_type: Edits kept per edit type and caption (the paper's N).
        prompt_style: ``"chat"`` (few-shot through the tokenizer's chat template), ``"alpaca"`` (the
            authors' instruction template, for adapters trained that way) or ``"auto"`` (alpaca when an
            adapter is given or the tokenizer has no chat template, chat otherwise).
        few_shot: Put the edit type's example into the prompt.
        instructions: Override the instruction per edit type (e.g. the exact wording an adapter was trained on).
        batch_size: (caption, edit type) prompts per ``generate`` call.
        max_new_tokens: Token budget per answer.
        do_sample: Sample with per-sample seeded Gumbel noise instead of greedy decoding.
        temperature: Sampling temperature (``do_sample`` only).
        top_p: Nucleus sampling mass (``do_sample`` only).
        repetition_penalty: Passed to ``generate``.
        max_span_words: See :func:`parse_perturber_output`.
        min_shared_fraction: See :func:`parse_perturber_output`.
        dtype: ``"auto"`` (bfloat16 on CUDA, float32 elsewhere) or a torch dtype name.
    """

    name = "perturb"
    version = "1"
    consumes = {"caption": "str", "label_name": "str", "seed": "int"}
    produces = {"edits": "list", "perturb_stats": "dict"}
    model_options = (
        ModelOption("model", role="caption perturber (LLM)"),
        ModelOption("adapter", PEFT_ADAPTER_FILES, revision="adapter_revision", role="LoRA adapter of the perturber"),
    )

    options_class = PerturbOptions

    def __init__(self, options: PerturbOptions | None = None, /, **values: Any) -> None:
        o = stage_options(type(self), options, values)
        self.options = o
        self.model_id = str(o.model)
        self.revision = o.revision
        self.adapter = None if o.adapter is None else str(o.adapter)
        self.adapter_revision = o.adapter_revision
        self.edit_types = o.edit_types
        self.n_per_type = o.n_per_type
        self.prompt_style = o.prompt_style
        self.few_shot = o.few_shot
        # Overrides of the table's instructions (e.g. the exact wording an adapter was trained on).
        self.instruction_overrides = dict(o.instructions or {})
        self.batch_size = o.batch_size
        self.max_new_tokens = o.max_new_tokens
        self.do_sample = o.do_sample
        self.temperature = o.temperature
        self.top_p = o.top_p
        self.repetition_penalty = o.repetition_penalty
        self.max_span_words = o.max_span_words
        self.min_shared_fraction = o.min_shared_fraction
        self.dtype = o.dtype
        self.device: str | None = None
        self._model = None
        self._tokenizer = None
        self._style: str | None = None
        self._shared: _LoadedLM | None = None

    # -- life cycle ---------------------------------------------------------------------------------
    def load(self, device: str) -> None:
        """Load tokenizer, model and (optionally) the LoRA adapter onto ``device``."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dtype = self.dtype
        if dtype == "auto":
            dtype = "bfloat16" if str(device).startswith("cuda") else "float32"
        # Stages that use the same LLM (e.g. the three DILLEMA text stages) share one loaded copy; generation
        # settings stay per stage (they are attributes of this object, not of the model).
        key = (self.model_id, self.revision, self.adapter, self.adapter_revision, dtype, str(device))
        shared = _LOADED_LMS.get(key)
        if shared is not None:
            self._finish_load(shared, device)
            return
        logger.info("loading perturber %s (revision %s) on %s", self.model_id, self.revision, device)
        tokenizer = AutoTokenizer.from_pretrained(self.model_id, revision=self.revision)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(
            self.model_id, revision=self.revision, dtype=getattr(torch, dtype), use_safetensors=True
        )
        if self.adapter is not None:
            try:
                from peft import PeftModel
            except ImportError as error:  # pragma: no cover - peft is a project dependency
                raise ImportError("a LoRA adapter needs peft: pip install peft") from error
            logger.info("applying LoRA adapter %s (revision %s)", self.adapter, self.adapter_revision)
            adapter_dir = resolve_adapter(self.adapter, self.adapter_revision)
            model = PeftModel.from_pretrained(model, adapter_dir)
        model.to(device).eval()
        shared = _LoadedLM(model, tokenizer)
        _LOADED_LMS[key] = shared
        self._finish_load(shared, device)

    def _finish_load(self, shared: _LoadedLM, device: str) -> None:
        model, tokenizer = shared.model, shared.tokenizer
        self._shared = shared  # keeps the shared copy alive while this perturber lives
        style = self.prompt_style
        if style == "auto":
            style = "alpaca" if self.adapter is not None or not tokenizer.chat_template else "chat"
        if style == "chat" and not tokenizer.chat_template:
            raise ValueError(f"prompt_style='chat' but the tokenizer of {self.model_id!r} has no chat template")
        self._model, self._tokenizer, self._style, self.device = model, tokenizer, style, str(device)

    def describe(self) -> dict[str, Any]:
        """Model, adapter, revisions, prompts and decoding constants for the manifest."""
        return {
            "model": self.model_id,
            "revision": self.revision,
            "adapter": self.adapter,
            "adapter_revision": self.adapter_revision,
            "edit_types": list(self.edit_types),
            "n_per_type": self.n_per_type,
            "prompt_style": self._style or self.prompt_style,
            "few_shot": self.few_shot,
            "instructions": {t: self.instruction(t) for t in self.edit_types},
            "max_new_tokens": self.max_new_tokens,
            "do_sample": self.do_sample,
            "temperature": self.temperature if self.do_sample else None,
            "top_p": self.top_p if self.do_sample else None,
            "repetition_penalty": self.repetition_penalty,
            "max_span_words": self.max_span_words,
            "min_shared_fraction": self.min_shared_fraction,
            "dtype": self.dtype,
        }

    # -- prompts ------------------------------------------------------------------------------------
    def instruction(self, edit_type_name: str) -> str:
        """The instruction for one edit type: the option's override, else the table's."""
        return self.instruction_overrides.get(edit_type_name) or edit_type_row(edit_type_name).instruction

    def chat_prompt(self, system: str, user: str, response_header: str = "Response") -> str:
        """The prompt text for one system + user message in the loaded prompt style.

        Chat style goes through the tokenizer's chat template; Alpaca style puts both messages into the
        instruction and opens a ``### {response_header}:`` section.
        """
        if self._tokenizer is None:
            raise RuntimeError("PromptPerturber.load(device) must be called before chat_prompt()")
        if self._style == "alpaca":
            return (
                "Below is an instruction that describes a task. Write a response that appropriately completes the "
                f"request.\n\n### Instruction:\n{system}\n{user}\n\n### {response_header}:\n"
            )
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def build_prompt(self, caption: str, edit_type: str, label_name: str | None) -> str:
        """The full prompt text for one (caption, edit type), in the loaded prompt style."""
        if self._tokenizer is None:
            raise RuntimeError("PromptPerturber.load(device) must be called before build_prompt()")
        instruction = self.instruction(edit_type)
        if self._style == "alpaca":
            return alpaca_prompt(instruction, caption, label_name, self.n_per_type)
        messages = chat_messages(instruction, caption, edit_type, label_name, self.n_per_type, self.few_shot)
        return self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    # -- generation ---------------------------------------------------------------------------------
    def generate(self, prompts: list[str], seeds: list[int]) -> list[tuple[str, bool]]:
        """Generate one answer per prompt, batched.

        Args:
            prompts: Full prompt texts (see :meth:`build_prompt`).
            seeds: One seed per prompt (used only when sampling).

        Returns:
            ``(text, truncated)`` per prompt; ``truncated`` is true when the answer hit ``max_new_tokens``.
        """
        if self._model is None:
            raise RuntimeError("PromptPerturber.load(device) must be called before generate()")
        outputs: list[tuple[str, bool]] = []
        for start in range(0, len(prompts), self.batch_size):
            outputs.extend(
                self._generate_batch(prompts[start : start + self.batch_size], seeds[start : start + self.batch_size])
            )
        return outputs

    def _generate_batch(self, prompts: list[str], seeds: list[int]) -> list[tuple[str, bool]]:
        import torch
        from transformers import GenerationConfig, LogitsProcessorList

        tokenizer = self._tokenizer
        base_config = self._model.generation_config
        eos = base_config.eos_token_id if base_config.eos_token_id is not None else tokenizer.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos])
        config = GenerationConfig(
            do_sample=False,
            num_beams=1,
            max_new_tokens=self.max_new_tokens,
            repetition_penalty=self.repetition_penalty,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=base_config.bos_token_id,
        )
        processors = LogitsProcessorList()
        if self.do_sample:
            processors.append(SeededGumbelSampler(seeds, self.temperature, self.top_p))
        # The chat template already holds any BOS token; the Alpaca text needs the tokenizer's own specials.
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=self._style == "alpaca")
        enc = enc.to(self.device)
        with torch.inference_mode():
            out = self._model.generate(**enc, generation_config=config, logits_processor=processors)
        new_tokens = out[:, enc["input_ids"].shape[1] :].tolist()
        results = []
        for row in new_tokens:
            ended = any(tok in eos_ids for tok in row)
            if ended:
                row = row[: next(i for i, tok in enumerate(row) if tok in eos_ids)]
            results.append((tokenizer.decode(row, skip_special_tokens=True), not ended))
        return results

    # -- the interface ------------------------------------------------------------------------------
    def perturb_detailed(
        self,
        captions: list[str],
        edit_types: list[str] | tuple[str, ...] | None,
        label_names: list[str | None],
        seeds: list[int] | None = None,
    ) -> list[dict[str, Any]]:
        """Like :meth:`perturb`, plus per-sample stats and raw answers.

        Returns:
            Per caption: ``{"edits": list[Edit], "perturb_stats": dict, "raw": {edit_type: text}}``.
        """
        types = self.edit_types if edit_types is None else validate_edit_types(edit_types)
        if len(captions) != len(label_names):
            raise ValueError(f"got {len(captions)} captions but {len(label_names)} label names")
        if seeds is None:
            seeds = [0] * len(captions)
        if len(seeds) != len(captions):
            raise ValueError(f"got {len(captions)} captions but {len(seeds)} seeds")
        jobs = [(i, t) for i in range(len(captions)) for t in types]
        prompts = [self.build_prompt(captions[i], t, label_names[i]) for i, t in jobs]
        answers = self.generate(prompts, [_row_seed(seeds[i], t) for i, t in jobs])
        results = [{"edits": [], "perturb_stats": _empty_stats(), "raw": {}} for _ in captions]
        for (i, edit_type), (text, truncated) in zip(jobs, answers, strict=True):
            parsed = parse_perturber_output(
                text,
                captions[i],
                n=self.n_per_type,
                truncated=truncated,
                max_span_words=self.max_span_words,
                min_shared_fraction=self.min_shared_fraction,
            )
            stats = results[i]["perturb_stats"]
            stats["generations"] += 1
            stats["lines"] += parsed.n_lines
            stats["empty_outputs"] += int(parsed.n_lines == 0)
            stats["truncated_outputs"] += int(truncated)
            for reason, count in parsed.dropped.items():
                stats[reason] += count
                if reason != "extra":
                    stats["malformed"] += count
            stats["kept"] += len(parsed.captions)
            stats["kept_by_type"][edit_type] = len(parsed.captions)
            results[i]["raw"][edit_type] = text
            for edited in parsed.captions:
                diff = diff_captions(captions[i], edited)
                results[i]["edits"].append(Edit(edit_type, edited, diff.original_span, diff.edited_span))
        return results

    def perturb(
        self,
        captions: list[str],
        edit_types: list[str] | tuple[str, ...] | None,
        label_names: list[str | None],
        seeds: list[int] | None = None,
    ) -> list[list[Edit]]:
        """Propose edits for each caption.

        Args:
            captions: Source captions.
            edit_types: Edit types to request (``None``: the stage's ``edit_types``).
            label_names: The class each caption must keep.
            seeds: Per-caption seeds (only matter when sampling).

        Returns:
            Per caption, up to ``n_per_type`` edits per edit type.
        """
        return [r["edits"] for r in self.perturb_detailed(captions, edit_types, label_names, seeds)]

    def process(self, records: list[Record]) -> list[Record | SampleFailure]:
        """Perturb each record's ``caption``; returns ``{"edits": [...], "perturb_stats": {...}}``."""
        results: list[Record | SampleFailure] = [SampleFailure("perturb: record has no caption")] * len(records)
        todo = [i for i, r in enumerate(records) if isinstance(r.get("caption"), str) and r["caption"].strip()]
        if todo:
            detailed = self.perturb_detailed(
                [records[i]["caption"] for i in todo],
                None,
                [records[i].get("label_name") for i in todo],
                [int(records[i].get("seed", 0)) for i in todo],
            )
            for i, item in zip(todo, detailed, strict=True):
                results[i] = {"edits": [e.to_dict() for e in item["edits"]], "perturb_stats": item["perturb_stats"]}
        return results


def _empty_stats() -> dict[str, Any]:
    stats: dict[str, Any] = {
        "generations": 0,
        "lines": 0,
        "kept": 0,
        "malformed": 0,
        "empty_outputs": 0,
        "truncated_outputs": 0,
    }
    stats.update({reason: 0 for reason in DROP_REASONS})
    stats["kept_by_type"] = {}
    return stats


class SeededGumbelSampler:
    """Sampling as argmax(logits / T + Gumbel noise), with one seeded generator per batch row.

    Greedy decoding over these scores draws from softmax(logits / T) (restricted to the top-p nucleus), and
    each row's noise comes only from its own seed, so a sample's output does not depend on its neighbours.
    """

    def __init__(self, seeds: list[int], temperature: float, top_p: float) -> None:
        import torch
        from transformers import TopPLogitsWarper

        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
        self.temperature = temperature
        self.top_p = TopPLogitsWarper(top_p) if top_p < 1.0 else None

    def __call__(self, input_ids, scores):
        import torch

        scores = scores.float() / self.temperature
        if self.top_p is not None:
            scores = self.top_p(input_ids, scores)
        uniform = torch.stack([torch.rand(scores.shape[-1], generator=g) for g in self.generators])
        gumbel = -torch.log(-torch.log(uniform.clamp(1e-10, 1.0 - 1e-7)))
        return scores + gumbel.to(scores.device)


# The name the builder's stage registry uses.
PerturbStage = PromptPerturber
