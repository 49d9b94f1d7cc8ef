"""DILLEMA's language side: keywords, alternatives and counterfactual captions, in three seeded LLM stages.

Baresi, Hu, Mas'udi, Quattrocchi, "DILLEMA: Diffusion and Large Language Models for Multi-Modal Augmentation"
(arXiv 2502.04378, 2025; code ``irfanmasoudi/DILLEMA``, ``counterfactual/DILLEMA_counterfactual_imagenet.py``).
Where LANCE asks an LLM for one-aspect rewrites per edit type (``perturbation.py``), DILLEMA asks three questions:

1. ``dillema_keywords``: which words of the caption can change without changing the class? The prompt names the task
   ("ImageNet image classification with 1000 labels") and the class. Ours also asks which aspect of the image each
   word describes (LANCE's six edit types), so that an edit that applies one alternative gets LANCE's edit type.
2. ``dillema_alternatives``: for each keyword, a JSON list of alternative values (another colour, weather, person,
   time of day, place, ...). DILLEMA asked once per caption for a JSON object; we ask once per keyword, which small
   models answer more reliably, and each answer is one list.
3. ``dillema_counterfactual``: pick up to 3 keywords and one alternative each (seeded), and ask the LLM to rewrite the
   caption with them.

All three run through the perturber's backend (``perturbation.PromptPerturber``: any local transformers causal LM
through its chat template, or with a PEFT LoRA adapter in Alpaca style), share one loaded copy of the model, and
sample with per-row seeded Gumbel noise derived from the sample's seed, so the answers depend only on the seed.

Parsing is defensive and counted, never a crash or a restart (DILLEMA looped until its regex matched, and a shell
loop restarted the script on crashes): an answer is read as strict JSON, else as a Python literal
(``ast.literal_eval``, what DILLEMA used) or JSON with trailing commas and smart quotes repaired, else salvaged from
a bulleted or comma-separated list; each outcome is counted per sample (``*_stats``: ``json``, ``repaired``,
``salvaged``, ``unparseable``, ``empty``, ``malformed`` = all but ``json``), and a sampled answer that yields nothing
usable is asked again with a new seed, up to ``max_attempts``.

Every keyword must be a word (or phrase of up to 3 words) of the caption and must not name the class (no word in
common with the class name or its synonyms). The counterfactual captions are returned as ``edits`` in the
perturber's shape (``edit_type``, ``edited_caption``, ``original_span``, ``edited_span``), so the ``label_check``
stage judges them exactly as it judges LANCE's; each edit also carries the LLM trace (``llm_keywords``,
``llm_alternatives``, ``llm_applied_alternatives``, canonical JSON strings) for the release's metadata. Its
``edit_type`` is the keyword's aspect when one alternative was applied and the LLM named that aspect, else
``multi``. With several changed regions, the spans are the regions' words joined by ``"; "`` (one covering span
would also cover the unchanged words between them, the class name included, and fail the label check for nothing).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import hashlib
import json
import logging
import random
import re
from collections import Counter
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from lance_pipeline.edit_types import MULTI_EDIT_TYPE, edit_type_names
from lance_pipeline.option_types import (
    Fraction,
    Interval,
    Options,
    Phrase,
    PositiveInt,
    Probability,
    TorchDtype,
)
from lance_pipeline.stage import Record, SampleFailure, stage_options
from lance_pipeline.text.edit_spans import STRIP_CHARS, diff_captions, tokenize_caption
from lance_pipeline.text.perturbation import (
    DEFAULT_PERTURBER,
    DEFAULT_PERTURBER_REVISION,
    PromptPerturber,
    parse_perturber_output,
)

logger = logging.getLogger(__name__)

# DILLEMA's task line (counterfactual/DILLEMA_counterfactual_imagenet.py).
DILLEMA_TASK = "ImageNet image classification with 1000 labels"
# DILLEMA's decoding: llama-2-13b-chat with temperature 0.1 and top_p 0.85.
DILLEMA_TEMPERATURE = 0.1
DILLEMA_TOP_P = 0.85
# DILLEMA samples min(#keywords, 3) keywords per counterfactual.
DILLEMA_MAX_KEYWORDS_PER_EDIT = 3
SPAN_SEPARATOR = "; "

SYSTEM_PROMPT = (
    "You help build counterfactual test images for image classifiers: images that differ from a real photo in some "
    "aspect but still show the same class. Follow the requested answer format exactly and add nothing else."
)
KEYWORDS_PROMPT = (
    'Task: {task}. The image\'s class is "{label}".\n'
    'Caption of the image: "{caption}"\n'
    "Which words of the caption can be changed without changing the class of the image? Never include the class "
    "name or a word of it. For each word, name the aspect of the image it describes: one of {aspects}.\n"
    'Answer only with a JSON object mapping each word to its aspect, for example {{"man": "subject", '
    '"beach": "background", "red": "adjective", "rainy": "weather"}}.'
)
ALTERNATIVES_PROMPT = (
    'Caption of an image of a "{label}": "{caption}"\n'
    'Give {n} alternatives for the word "{keyword}" ({aspect}) that could replace it in this caption: a different '
    "value of the same kind (another colour, weather, person, time of day, place, material, ...), so that the image "
    'still shows a "{label}". Never use the class name or a word of it.\n'
    'Answer only with a JSON list of strings, for example ["woman", "young boy", "police officer"].'
)
REWRITE_PROMPT = (
    'Caption: "{caption}"\n'
    "Rewrite the caption replacing words with these alternatives: {applied}.\n"
    'Change nothing else, keep the caption natural, and keep "{label}" in it.\n'
    "Answer with the rewritten caption only, on one line."
)

STOPWORDS = frozenset(
    "a an the of in on at with and or by to from near under over its their his her is are was were be this that "
    "these those it they he she there here some one two three photo picture image".split()
)
PARSE_OUTCOMES = ("json", "repaired", "salvaged", "unparseable", "empty")
_FENCE_RE = re.compile(r"```(?:json|python)?", re.I)
_BULLET_RE = re.compile(r"^\s*(?:[-*•·–]+\s*|\(?\d{1,2}\s*[.):\]]\s*)")
_TRAILING_COMMA_RE = re.compile(r",\s*([\]}])")
_NOT_AN_ITEM_RE = re.compile(r"^(?:i|i'm|here|sure|sorry|certainly|okay|ok|note|as an|unfortunately)\b", re.I)
# A label the model puts before its rewrite ("Rewritten caption: ...").
_REWRITE_LABEL_RE = re.compile(
    r"^\s*(?:rewritten|revised|new|counterfactual|edited|modified)?\s*(?:caption|sentence)\s*:\s*", re.I | re.M
)
_SMART_QUOTES = str.maketrans({"“": '"', "”": '"', "‘": "'", "’": "'"})


# ---------------------------------------------------------------------------------------------- parsing


def parse_json_answer(text: str, expect: type) -> tuple[Any, str]:
    """Read the JSON value (``dict`` or ``list``) out of one LLM answer, as robustly as is honest.

    Tried in order: the outermost ``{...}``/``[...]`` as strict JSON (outcome ``json``); as a Python literal
    (``ast.literal_eval``, never ``eval``) or as JSON with smart quotes and trailing commas repaired (``repaired``);
    for a list, the answer's lines (or comma-separated items of a one-line answer) with bullets, numbers and quotes
    removed, and for a dict, its ``key: value`` lines (``salvaged``).

    Args:
        text: The generated answer.
        expect: ``dict`` or ``list``.

    Returns:
        ``(value, outcome)``: the value (``None`` when nothing could be read) and one of ``PARSE_OUTCOMES``.
    """
    if expect not in (dict, list):
        raise ValueError(f"expect must be dict or list, got {expect!r}")
    if not isinstance(text, str) or not text.strip():
        return None, "empty"
    body = _FENCE_RE.sub("", text)
    opener, closer = ("{", "}") if expect is dict else ("[", "]")
    start, end = body.find(opener), body.rfind(closer)
    if start != -1 and end > start:
        snippet = body[start : end + 1]
        try:
            value = json.loads(snippet)
            if isinstance(value, expect):
                return value, "json"
        except ValueError:
            pass
        for attempt in (snippet, _TRAILING_COMMA_RE.sub(r"\1", snippet.translate(_SMART_QUOTES))):
            for reader in (json.loads, ast.literal_eval):
                try:
                    value = reader(attempt)
                except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                    continue
                if isinstance(value, expect):
                    return value, "repaired"
    salvaged = _salvage(body, expect)
    if salvaged:
        return salvaged, "salvaged"
    return None, "unparseable"


def _clean_item(item: str) -> str:
    item = _BULLET_RE.sub("", item.strip())
    return " ".join(item.strip().strip("\"'`[]{}").strip().rstrip(".").split())


def _salvage(body: str, expect: type) -> Any:
    # Preambles ("Here are the words:") and refusals ("I am not sure ...") are no items.
    lines = [line for line in body.splitlines() if line.strip() and not line.rstrip().endswith(":")]
    lines = [line for line in lines if not _NOT_AN_ITEM_RE.match(_clean_item(line))]
    if expect is dict:
        out = {}
        for line in lines:
            key, sep, value = _clean_item(line).partition(":")
            if sep and key.strip() and len(key.split()) <= 3:
                out[key.strip().strip("\"'")] = value.strip().strip("\"',")
        return out
    if len(lines) == 1 and "," in lines[0]:
        lines = lines[0].split(",")
    return [item for item in (_clean_item(line) for line in lines) if item]


# ---------------------------------------------------------------------------------------------- word checks


def _norm(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s-]", " ", str(text).casefold()).split())


def _stem(word: str) -> str:
    """A crude singular, enough to see that "dogs" names "dog" and "huskies" names "husky"."""
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 3 and word.endswith("es") and word[-3] in "sxz":
        return word[:-2]
    if len(word) > 3 and word.endswith("s") and not word.endswith("ss"):
        return word[:-1]
    return word


def _content_stems(text: str) -> set[str]:
    return {_stem(w) for w in re.split(r"[\s-]+", _norm(text)) if w and w not in STOPWORDS}


def class_names(label_name: str) -> list[str]:
    """The class name and its comma-separated synonyms ("tabby, tabby cat" -> both)."""
    return [n for n in (" ".join(part.split()) for part in str(label_name).split(",")) if n] or [str(label_name)]


def names_class(phrase: str, label_name: str) -> bool:
    """Whether ``phrase`` shares a content word with the class name or a synonym ("dog" names "dog sled")."""
    class_words = set().union(*(_content_stems(name) for name in class_names(label_name)))
    return bool(_content_stems(phrase) & class_words)


def in_caption(phrase: str, caption: str) -> bool:
    """Whether ``phrase`` occurs in ``caption`` as whole words (case and punctuation ignored)."""
    needle = _norm(phrase)
    return bool(needle) and re.search(rf"(?<![\w-]){re.escape(needle)}(?![\w-])", _norm(caption)) is not None


def caption_fallback_words(caption: str, label_name: str) -> list[str]:
    """The caption's words that do not name the class, once each: content words first, then stopwords."""
    words: list[str] = []
    for token in tokenize_caption(caption):
        if token.norm not in words and re.search(r"[a-z]", token.norm) and not names_class(token.norm, label_name):
            words.append(token.norm)
    return [w for w in words if w not in STOPWORDS] + [w for w in words if w in STOPWORDS]


def changed_regions(original: str, edited: str) -> list[tuple[str, str]]:
    """Each separately changed run of words: ``(removed words, inserted words)``, in caption order."""
    a, b = tokenize_caption(original), tokenize_caption(edited)
    matcher = difflib.SequenceMatcher(a=[t.norm for t in a], b=[t.norm for t in b], autojunk=False)
    regions = []
    for op, a_lo, a_hi, b_lo, b_hi in matcher.get_opcodes():
        if op == "equal":
            continue
        removed = original[a[a_lo].start : a[a_hi - 1].end].strip(STRIP_CHARS + " ") if a_hi > a_lo else ""
        inserted = edited[b[b_lo].start : b[b_hi - 1].end].strip(STRIP_CHARS + " ") if b_hi > b_lo else ""
        regions.append((removed, inserted))
    return regions


def edit_spans(original: str, edited: str) -> tuple[str, str]:
    """``(original_span, edited_span)``: LANCE's covering spans for one changed region, else the regions joined."""
    regions = changed_regions(original, edited)
    if len(regions) <= 1:
        diff = diff_captions(original, edited)
        return diff.original_span, diff.edited_span
    return SPAN_SEPARATOR.join(r for r, _ in regions), SPAN_SEPARATOR.join(i for _, i in regions)


def canonical_json(value: Any) -> str:
    """Stable JSON text of a trace value (sorted keys, no whitespace variance)."""
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def row_seed(sample_seed: int, *parts: Any) -> int:
    """A generation seed from the sample's seed and the row's identity (stage, keyword, attempt)."""
    text = ":".join(["lance-cf", "dillema", str(int(sample_seed)), *map(str, parts)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def _empty_stats() -> dict[str, Any]:
    stats: dict[str, Any] = {"answers": 0, "attempts": 0, "malformed": 0, "truncated": 0}
    stats.update(dict.fromkeys(PARSE_OUTCOMES, 0))
    stats["dropped"] = {}
    return stats


def _count_outcome(stats: dict[str, Any], outcome: str, truncated: bool) -> None:
    stats["answers"] += 1
    stats[outcome] += 1
    stats["truncated"] += int(truncated)
    if outcome != "json":
        stats["malformed"] += 1


def _count_drops(stats: dict[str, Any], dropped: Counter) -> None:
    for reason, count in dropped.items():
        stats["dropped"][reason] = stats["dropped"].get(reason, 0) + count


# ---------------------------------------------------------------------------------------------- options


@dataclass
class DillemaLLMOptions(Options):
    """The LLM options the three stages share (their backend is ``perturbation.PromptPerturber``).

    Attributes:
        model: Hub id or local directory of a causal LM (default: the perturber's instruction model).
        revision: Hub revision of ``model``.
        adapter, adapter_revision: Optional PEFT LoRA adapter (safetensors) and its revision.
        prompt_style: ``"auto"``, ``"chat"`` or ``"alpaca"`` (see ``PromptPerturber``).
        task: The task named in the keyword prompt (DILLEMA's ImageNet line by default).
        do_sample, temperature, top_p: Seeded sampling (DILLEMA: temperature 0.1, top_p 0.85).
        repetition_penalty, max_new_tokens, batch_size, dtype: Passed to the backend.
        max_attempts: Answers asked per question until one is usable (only with sampling: greedy decoding would
            repeat itself).
    """

    model: str = DEFAULT_PERTURBER
    revision: str | None = DEFAULT_PERTURBER_REVISION
    adapter: str | None = None
    adapter_revision: str | None = None
    prompt_style: Literal["auto", "chat", "alpaca"] = "auto"
    task: Annotated[Phrase, "the classification task, in words"] = DILLEMA_TASK
    do_sample: bool = True
    temperature: float = DILLEMA_TEMPERATURE
    top_p: Probability = DILLEMA_TOP_P
    repetition_penalty: Annotated[float, Interval(gt=0.0)] = 1.0
    max_new_tokens: PositiveInt = 128
    batch_size: PositiveInt = 8
    dtype: TorchDtype = "auto"
    max_attempts: PositiveInt = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.do_sample and self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 when do_sample is on, got {self.temperature}")


@dataclass
class DillemaKeywordOptions(DillemaLLMOptions):
    """Options of ``dillema_keywords`` (see ``DillemaKeywordStage``)."""

    max_new_tokens: PositiveInt = 128
    max_keywords: PositiveInt = 8
    max_keyword_words: PositiveInt = 3
    fallback_to_caption_words: bool = False


@dataclass
class DillemaAlternativesOptions(DillemaLLMOptions):
    """Options of ``dillema_alternatives`` (see ``DillemaAlternativesStage``)."""

    max_new_tokens: PositiveInt = 64
    n_alternatives: PositiveInt = 4
    max_alternative_words: PositiveInt = 5


@dataclass
class DillemaCounterfactualOptions(DillemaLLMOptions):
    """Options of ``dillema_counterfactual`` (see ``DillemaCounterfactualStage``)."""

    max_new_tokens: PositiveInt = 96
    n_counterfactuals: PositiveInt = 1
    max_keywords_per_edit: PositiveInt = DILLEMA_MAX_KEYWORDS_PER_EDIT
    vary_keyword_count: bool = False
    require_alternatives: bool = True
    require_class_kept: bool = True
    max_span_words: PositiveInt = 24
    min_shared_fraction: Fraction = 0.3


# ---------------------------------------------------------------------------------------------- the stages


class _DillemaStage:
    """The LLM backend and the ask-parse-retry loop shared by the three stages (options: ``DillemaLLMOptions``)."""

    name = "dillema"
    step = "base"
    version = "1"
    options_class = DillemaLLMOptions
    model_options = PromptPerturber.model_options

    def __init__(self, options: DillemaLLMOptions | None = None, /, **values: Any) -> None:
        try:
            o = stage_options(type(self), options, values)
        except TypeError as err:
            known = ", ".join(f.name for f in dataclasses.fields(self.options_class))
            raise ValueError(f"{type(self).__name__}: {err}; known options: {known}") from err
        self.options = o
        # The options are read as the stage's attributes (self.max_keywords, ...); the backend gets the LLM ones.
        for f in dataclasses.fields(o):
            setattr(self, f.name, getattr(o, f.name))
        self.backend = PromptPerturber(
            model=o.model,
            revision=o.revision,
            adapter=o.adapter,
            adapter_revision=o.adapter_revision,
            prompt_style=o.prompt_style,
            batch_size=o.batch_size,
            max_new_tokens=o.max_new_tokens,
            do_sample=o.do_sample,
            temperature=o.temperature,
            top_p=o.top_p,
            repetition_penalty=o.repetition_penalty,
            dtype=o.dtype,
        )

    def load(self, device: str) -> None:
        """Load the LLM (shared with every other stage that uses the same model on the same device)."""
        self.backend.load(device)

    def describe(self) -> dict[str, Any]:
        b = self.backend.describe()
        keys = ("model", "revision", "adapter", "adapter_revision", "prompt_style", "max_new_tokens", "do_sample")
        keys += ("temperature", "top_p", "repetition_penalty", "dtype")
        return {
            "method": "DILLEMA (Baresi et al., arXiv 2502.04378)",
            "step": self.step,
            **{k: b[k] for k in keys},
            "max_attempts": self.max_attempts,
            "system_prompt": SYSTEM_PROMPT,
        }

    def _prompt(self, user: str) -> str:
        return self.backend.chat_prompt(SYSTEM_PROMPT, user)

    def _ask(self, prompts: list[str], seeds: list[int], accept) -> tuple[list[Any], list[int]]:
        """Ask each prompt until ``accept(index, text, truncated)`` returns a value, ``max_attempts`` times at most.

        Returns:
            Per prompt the accepted value (``None`` if none was) and the number of answers generated.
        """
        results: list[Any] = [None] * len(prompts)
        attempts = [0] * len(prompts)
        pending = list(range(len(prompts)))
        for attempt in range(self.max_attempts):
            if not pending:
                break
            answers = self.backend.generate(
                [prompts[i] for i in pending], [row_seed(seeds[i], self.step, attempt) for i in pending]
            )
            still = []
            for i, (text, truncated) in zip(pending, answers, strict=True):
                attempts[i] += 1
                value = accept(i, text, truncated)
                if value is None:
                    still.append(i)
                else:
                    results[i] = value
            pending = still
            if not self.backend.do_sample:
                break  # greedy decoding gives the same answer again
        return results, attempts


def parse_keyword_answer(text: str) -> tuple[Any, str]:
    """A keyword answer: the JSON object we ask for, or DILLEMA's own format, a list (read as ``repaired``).

    Whichever bracket opens first decides which is tried first, so a list of objects is not misread as one object.
    """
    body = text if isinstance(text, str) else ""
    brace, bracket = body.find("{"), body.find("[")
    order = (list, dict) if bracket != -1 and (brace == -1 or bracket < brace) else (dict, list)
    value, outcome = parse_json_answer(text, order[0])
    if value:
        return value, outcome if order[0] is dict else ("repaired" if outcome == "json" else outcome)
    second, second_outcome = parse_json_answer(text, order[1])
    if second:
        return second, "repaired" if (second_outcome == "json" and order[1] is list) else second_outcome
    return value, outcome


def _keyword_items(value: Any, caption: str) -> list[tuple[Any, Any]]:
    """(word, aspect) pairs of a parsed keyword answer, unwrapping one level of wrapping."""
    if isinstance(value, dict) and len(value) == 1:
        ((key, inner),) = value.items()
        if isinstance(inner, (dict, list)) and not (isinstance(key, str) and in_caption(key, caption)):
            value = inner
    if isinstance(value, dict):
        return list(value.items())
    items = []
    for item in value or []:
        if isinstance(item, dict):
            word = next((item[k] for k in ("word", "keyword", "term") if k in item), None)
            aspect = next((item[k] for k in ("aspect", "type", "category") if k in item), None)
            items.append((word, aspect))
        else:
            items.append((item, None))
    return items


class DillemaKeywordStage(_DillemaStage):
    """``dillema_keywords``: the caption's words that can change without changing the class, with their aspect.

    Returns ``{"keywords": {word: aspect or None}, "keyword_stats": {...}}``; a sample with no usable keyword is a
    failure naming what the answers held.

    Args:
        max_keywords: Keywords kept per caption (in the answer's order).
        max_keyword_words: Longest keyword phrase, in words.
        fallback_to_caption_words: When no answer yields a keyword, use the caption's words that do not name the
            class (content words first) with no aspect, counted as ``fallback``. Off by default; the offline demo,
            whose random LLM never writes JSON, turns it on.
        LLM options: see ``DillemaLLMOptions``.
    """

    name = "keywords"
    step = "keywords"

    options_class = DillemaKeywordOptions
    consumes = {"caption": "str", "label_name": "str", "seed": "int"}
    produces = {"keywords": "dict", "keyword_stats": "dict"}

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "task": self.task,
            "prompt": KEYWORDS_PROMPT,
            "aspects": list(edit_type_names()),
            "max_keywords": self.max_keywords,
            "max_keyword_words": self.max_keyword_words,
            "fallback_to_caption_words": self.fallback_to_caption_words,
        }

    def user_message(self, caption: str, label_name: str) -> str:
        return KEYWORDS_PROMPT.format(
            task=self.task, label=label_name, caption=caption, aspects=", ".join(edit_type_names())
        )

    def select_keywords(self, value: Any, caption: str, label_name: str) -> tuple[dict[str, str | None], Counter]:
        """The usable keywords of one parsed answer (a dict word -> aspect, or a list of words), and the drops.

        Common wrappings are read too: ``{"keywords": {...}}`` / ``{"words": [...]}`` (one key holding the answer)
        and lists of ``{"word": ..., "aspect": ...}`` objects.
        """
        dropped: Counter = Counter()
        items = _keyword_items(value, caption)
        keywords: dict[str, str | None] = {}
        for word, aspect in items:
            if not isinstance(word, str) or not _clean_item(word):
                dropped["not_a_word"] += 1
                continue
            word = _clean_item(word)
            aspect = aspect.strip().casefold() if isinstance(aspect, str) else None
            if len(word.split()) > self.max_keyword_words:
                dropped["too_long"] += 1
            elif not in_caption(word, caption):
                dropped["not_in_caption"] += 1
            elif names_class(word, label_name):
                dropped["names_class"] += 1
            elif _norm(word) in {_norm(k) for k in keywords}:
                dropped["duplicate"] += 1
            elif len(keywords) >= self.max_keywords:
                dropped["extra"] += 1
            else:
                if aspect not in edit_type_names():
                    dropped["untyped"] += int(aspect is not None or isinstance(value, dict))
                    aspect = None
                keywords[word] = aspect
        return keywords, dropped

    def process(self, records: list[Record]) -> list[Record | SampleFailure]:
        results: list[Record | SampleFailure | None] = [None] * len(records)
        todo = []
        for i, record in enumerate(records):
            if not isinstance(record.get("caption"), str) or not record["caption"].strip():
                results[i] = SampleFailure(f"{self.step}: record has no caption (the caption stage must run first)")
            elif not record.get("label_name"):
                results[i] = SampleFailure(f"{self.step}: record has no label_name")
            else:
                todo.append(i)
        stats = {i: _empty_stats() for i in todo}
        found: dict[int, dict] = {}

        def accept(j: int, text: str, truncated: bool):
            i = todo[j]
            value, outcome = parse_keyword_answer(text)
            _count_outcome(stats[i], outcome, truncated)
            keywords, dropped = self.select_keywords(value, records[i]["caption"], records[i]["label_name"])
            _count_drops(stats[i], dropped)
            if keywords:
                found[i] = keywords
                return keywords
            return None

        prompts = [self._prompt(self.user_message(records[i]["caption"], records[i]["label_name"])) for i in todo]
        _, attempts = self._ask(prompts, [int(records[i].get("seed", 0)) for i in todo], accept)
        for j, i in enumerate(todo):
            stats[i]["attempts"] = attempts[j]
            keywords = found.get(i)
            if keywords is None and self.fallback_to_caption_words:
                words = caption_fallback_words(records[i]["caption"], records[i]["label_name"])
                keywords = dict.fromkeys(words[: self.max_keywords])
                stats[i]["fallback"] = len(keywords)
            if not keywords:
                results[i] = SampleFailure(
                    f"{self.step}: no usable keyword in {attempts[j]} answer(s) ({_describe_stats(stats[i])})"
                )
                continue
            results[i] = {"keywords": keywords, "keyword_stats": stats[i]}
        return results


class DillemaAlternativesStage(_DillemaStage):
    """``dillema_alternatives``: for each keyword, a JSON list of alternative values, one question per keyword.

    Returns ``{"alternatives": {keyword: [alternatives]}, "alternative_stats": {...}}``; keywords without a usable
    alternative are left out, and a sample left with none is a failure.

    Args:
        n_alternatives: Alternatives asked for and kept per keyword.
        max_alternative_words: Longest alternative, in words.
        LLM options: see ``DillemaLLMOptions``.
    """

    name = "alternatives"
    step = "alternatives"

    options_class = DillemaAlternativesOptions
    consumes = {"caption": "str", "label_name": "str", "seed": "int", "keywords": "dict"}
    produces = {"alternatives": "dict", "alternative_stats": "dict"}

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "prompt": ALTERNATIVES_PROMPT,
            "n_alternatives": self.n_alternatives,
            "max_alternative_words": self.max_alternative_words,
        }

    def user_message(self, caption: str, label_name: str, keyword: str, aspect: str | None) -> str:
        return ALTERNATIVES_PROMPT.format(
            label=label_name, caption=caption, keyword=keyword, aspect=aspect or "any aspect", n=self.n_alternatives
        )

    def select_alternatives(self, value: Any, keyword: str, label_name: str) -> tuple[list[str], Counter]:
        """The usable alternatives of one parsed answer (a list of strings), and the drops."""
        dropped: Counter = Counter()
        out: list[str] = []
        for item in value or []:
            if not isinstance(item, (str, int, float)) or isinstance(item, bool) or not _clean_item(str(item)):
                dropped["not_a_word"] += 1
                continue
            item = _clean_item(str(item))
            if len(item.split()) > self.max_alternative_words:
                dropped["too_long"] += 1
            elif _norm(item) == _norm(keyword):
                dropped["same_as_keyword"] += 1
            elif names_class(item, label_name):
                dropped["names_class"] += 1
            elif _norm(item) in {_norm(o) for o in out}:
                dropped["duplicate"] += 1
            elif len(out) >= self.n_alternatives:
                dropped["extra"] += 1
            else:
                out.append(item)
        return out, dropped

    def process(self, records: list[Record]) -> list[Record | SampleFailure]:
        results: list[Record | SampleFailure | None] = [None] * len(records)
        jobs: list[tuple[int, str]] = []
        for i, record in enumerate(records):
            keywords = record.get("keywords")
            if not isinstance(keywords, dict) or not keywords:
                results[i] = SampleFailure(f"{self.step}: record has no keywords (run dillema_keywords first)")
            elif not isinstance(record.get("caption"), str) or not record.get("label_name"):
                results[i] = SampleFailure(f"{self.step}: record has no caption or label_name")
            else:
                jobs.extend((i, keyword) for keyword in keywords)
        stats = {i: _empty_stats() for i, _ in jobs}
        found: dict[tuple[int, str], list[str]] = {}

        def accept(j: int, text: str, truncated: bool):
            i, keyword = jobs[j]
            value, outcome = parse_json_answer(text, list)
            _count_outcome(stats[i], outcome, truncated)
            alternatives, dropped = self.select_alternatives(value, keyword, records[i]["label_name"])
            _count_drops(stats[i], dropped)
            if alternatives:
                found[(i, keyword)] = alternatives
                return alternatives
            return None

        prompts = [
            self._prompt(
                self.user_message(records[i]["caption"], records[i]["label_name"], kw, records[i]["keywords"][kw])
            )
            for i, kw in jobs
        ]
        # Each keyword's question has its own seed: its answer does not depend on the other keywords.
        seeds = [row_seed(int(records[i].get("seed", 0)), "keyword", kw) for i, kw in jobs]
        _, attempts = self._ask(prompts, seeds, accept)
        for (i, _), n in zip(jobs, attempts, strict=True):
            stats[i]["attempts"] += n
        for i in sorted(stats):
            alternatives = {kw: found[(i, kw)] for kw in records[i]["keywords"] if (i, kw) in found}
            missing = len(records[i]["keywords"]) - len(alternatives)
            if missing:
                stats[i]["dropped"]["keyword_without_alternative"] = missing
            if not alternatives:
                results[i] = SampleFailure(
                    f"{self.step}: no usable alternative for any keyword ({_describe_stats(stats[i])})"
                )
                continue
            results[i] = {"alternatives": alternatives, "alternative_stats": stats[i]}
        return results


class DillemaCounterfactualStage(_DillemaStage):
    """``dillema_counterfactual``: seeded picks of keywords and alternatives, and the LLM's rewritten caption.

    Returns ``{"edits": [...], "rewrite_stats": {...}}``: edits in the perturber's shape plus the LLM trace (see the
    module docstring), for ``label_check`` and the editor. A sample with no usable rewrite is a failure.

    Args:
        n_counterfactuals: Counterfactual captions per sample (each its own seeded pick; DILLEMA wrote one).
        max_keywords_per_edit: Keywords replaced per counterfactual; DILLEMA takes ``min(#keywords, 3)``.
        vary_keyword_count: Draw how many keywords to replace uniformly from 1..``max_keywords_per_edit`` instead.
        require_alternatives: Reject a rewrite that does not contain every applied alternative.
        require_class_kept: Reject a rewrite that drops the class name where the caption had it.
        max_span_words, min_shared_fraction: Rewrite sanity limits (see ``parse_perturber_output``).
        LLM options: see ``DillemaLLMOptions``.
    """

    name = "rewrite"
    step = "rewrite"

    options_class = DillemaCounterfactualOptions
    consumes = {"caption": "str", "label_name": "str", "seed": "int", "keywords": "dict", "alternatives": "dict"}
    produces = {"edits": "list", "rewrite_stats": "dict"}

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "prompt": REWRITE_PROMPT,
            "n_counterfactuals": self.n_counterfactuals,
            "max_keywords_per_edit": self.max_keywords_per_edit,
            "vary_keyword_count": self.vary_keyword_count,
            "require_alternatives": self.require_alternatives,
            "require_class_kept": self.require_class_kept,
            "max_span_words": self.max_span_words,
            "min_shared_fraction": self.min_shared_fraction,
            "pick": "random.Random(sha256(seed, pick index)): sample keywords, then one alternative each",
            "edit_type": f"the keyword's aspect when one alternative is applied and the aspect is known, else "
            f"{MULTI_EDIT_TYPE!r}",
        }

    def pick(self, sample_seed: int, index: int, keywords: dict, alternatives: dict) -> dict[str, str]:
        """The ``index``-th seeded choice of keywords and one alternative each (keywords in caption order)."""
        rng = random.Random(row_seed(sample_seed, "pick", index))
        usable = [kw for kw in keywords if alternatives.get(kw)]
        count = min(len(usable), self.max_keywords_per_edit)
        if self.vary_keyword_count and count > 1:
            count = rng.randint(1, count)
        chosen = set(rng.sample(usable, count))
        return {kw: rng.choice(list(alternatives[kw])) for kw in usable if kw in chosen}

    def user_message(self, caption: str, label_name: str, applied: dict[str, str]) -> str:
        return REWRITE_PROMPT.format(caption=caption, label=label_name, applied=json.dumps(applied, ensure_ascii=False))

    def check_rewrite(self, text: str, truncated: bool, caption: str, label_name: str, applied: dict[str, str]):
        """The rewritten caption of one answer, or ``(None, reason)``."""
        parsed = parse_perturber_output(
            _REWRITE_LABEL_RE.sub("", text) if isinstance(text, str) else text,
            caption,
            n=1,
            truncated=truncated,
            max_span_words=self.max_span_words,
            min_shared_fraction=self.min_shared_fraction,
        )
        if not parsed.captions:
            reason = parsed.dropped.most_common(1)[0][0] if parsed.dropped else "empty"
            return None, reason
        rewrite = parsed.captions[0]
        if self.require_alternatives and not all(in_caption(alt, rewrite) for alt in applied.values()):
            return None, "alternative_missing"
        kept_names = [name for name in class_names(label_name) if in_caption(name, caption)]
        if self.require_class_kept and kept_names and not any(in_caption(name, rewrite) for name in kept_names):
            return None, "class_removed"
        return rewrite, None

    def process(self, records: list[Record]) -> list[Record | SampleFailure]:
        results: list[Record | SampleFailure | None] = [None] * len(records)
        jobs: list[tuple[int, dict[str, str]]] = []
        stats: dict[int, dict[str, Any]] = {}
        for i, record in enumerate(records):
            keywords, alternatives = record.get("keywords"), record.get("alternatives")
            if not isinstance(keywords, dict) or not isinstance(alternatives, dict) or not alternatives:
                results[i] = SampleFailure(f"{self.step}: record has no keywords/alternatives (run the DILLEMA stages)")
                continue
            if not isinstance(record.get("caption"), str) or not record.get("label_name"):
                results[i] = SampleFailure(f"{self.step}: record has no caption or label_name")
                continue
            stats[i] = {**_empty_stats(), "picks": 0}
            seen: set[str] = set()
            for index in range(self.n_counterfactuals):
                applied = self.pick(int(record.get("seed", 0)), index, keywords, alternatives)
                key = canonical_json(applied)
                if not applied or key in seen:
                    stats[i]["dropped"]["repeated_pick"] = stats[i]["dropped"].get("repeated_pick", 0) + 1
                    continue
                seen.add(key)
                stats[i]["picks"] += 1
                jobs.append((i, applied))
        rewrites: dict[int, str] = {}

        def accept(j: int, text: str, truncated: bool):
            i, applied = jobs[j]
            stats[i]["answers"] += 1
            stats[i]["truncated"] += int(truncated)
            rewrite, reason = self.check_rewrite(
                text, truncated, records[i]["caption"], records[i]["label_name"], applied
            )
            if rewrite is None:
                stats[i]["malformed"] += 1
                _count_drops(stats[i], Counter({reason: 1}))
                return None
            rewrites[j] = rewrite
            return rewrite

        prompts = [
            self._prompt(self.user_message(records[i]["caption"], records[i]["label_name"], applied))
            for i, applied in jobs
        ]
        seeds = [row_seed(int(records[i].get("seed", 0)), "applied", canonical_json(applied)) for i, applied in jobs]
        _, attempts = self._ask(prompts, seeds, accept)
        edits: dict[int, list[dict]] = {i: [] for i in stats}
        for j, (i, applied) in enumerate(jobs):
            stats[i]["attempts"] += attempts[j]
            if j in rewrites:
                edits[i].append(self._edit(records[i], applied, rewrites[j]))
        for i in stats:
            if not edits[i]:
                results[i] = SampleFailure(f"{self.step}: no usable rewrite ({_describe_stats(stats[i])})")
                continue
            stats[i]["kept"] = len(edits[i])
            results[i] = {"edits": edits[i], "rewrite_stats": stats[i]}
        return results

    @staticmethod
    def _edit(record: Record, applied: dict[str, str], rewrite: str) -> dict[str, Any]:
        keywords = record["keywords"]
        aspect = keywords.get(next(iter(applied))) if len(applied) == 1 else None
        original_span, edited_span = edit_spans(record["caption"], rewrite)
        return {
            "edit_type": aspect if aspect in edit_type_names() else MULTI_EDIT_TYPE,
            "edited_caption": rewrite,
            "original_span": original_span,
            "edited_span": edited_span,
            "llm_keywords": canonical_json(keywords),
            "llm_alternatives": canonical_json(record["alternatives"]),
            "llm_applied_alternatives": canonical_json(applied),
        }


def _describe_stats(stats: dict[str, Any]) -> str:
    parts = [f"{k}={stats[k]}" for k in ("answers", *PARSE_OUTCOMES) if stats.get(k)]
    parts += [f"{k}={v}" for k, v in sorted(stats.get("dropped", {}).items())]
    return ", ".join(parts) or "no answer"


# The names the builder's stage registry uses.
KeywordStage = DillemaKeywordStage
AlternativesStage = DillemaAlternativesStage
CounterfactualStage = DillemaCounterfactualStage
