"""The judge: an open vision-language model's P(yes) that each released image still shows its class, and that the
requested change is visible.

VQAScore (Lin et al., ECCV 2024, "Evaluating Text-to-Visual Generation with Image-to-Text Generation"; t2v_metrics)
scores an image against a text by asking a vision-language model "Does this figure show '{text}'? Please answer yes
or no." and reading the probability of the answer token "Yes" at the first answer position (softmax over the whole
vocabulary), with no generation. This stage asks two such questions of every image a build edits or generates:

- ``judge_class_p``: P(yes) for ``CLASS_QUESTION`` ("Does this image show a {label}? ..."), with the sample's class
  name: does the counterfactual still show its class (LANCE's label preservation, judged on the image itself rather
  than through CLIP similarities);
- ``judge_edit_p``: P(yes) for ``EDIT_QUESTION`` with the caption the image was edited towards: is the requested
  change visible. Null for images that are not edits of a requested change (dataset-interfaces and discovery images
  are generated from a prompt; their shift is scored by the CLIP ``shift_score`` already).

The judge is Qwen2.5-VL-7B-Instruct (Apache-2.0, one GPU: 16.6 GB of bf16 weights) at a pinned revision, loaded
through transformers' ``Qwen2_5_VLForConditionalGeneration`` and ``AutoProcessor`` (a local directory of the same
classes loads through the same code: the tests' tiny random model, ``lance_pipeline.tiny.judge_components``). One copy
per process (``lance_pipeline.models.shared``), batched (left-padded prompts, one forward pass per batch).

It filters nothing unless ``filter_below`` is set: then a sample whose ``judge_class_p`` is below it is removed and
recorded as a failure of the stage (with its score), and the manifest's ``screening`` entry counts the removals per
config. One stage per kind of released image (the stage contract declares its fields per class): ``judge``
(counterfactuals, LANCE's or ControlNet's), ``judge_lance_r``, ``judge_strength``, ``judge_generated`` (dataset
interfaces), ``judge_discovery``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from lance_pipeline.editing.stages import CounterfactualEditStage
from lance_pipeline.editing.strength import STRENGTH_FIELD, without_lost_edits
from lance_pipeline.models.needs import TRANSFORMERS_FILES, ModelOption
from lance_pipeline.models.shared import shared_model
from lance_pipeline.option_types import Fraction, Interval, Options, PositiveInt
from lance_pipeline.stage import SAMPLE_INDEX, MetadataField, OutputScreen, Record, SampleFailure, stage_options

logger = logging.getLogger(__name__)

# The counterfactual config's output: the keys the strength candidates' counterfactual_key names.
COUNTERFACTUAL_OUTPUT = next(o for o in CounterfactualEditStage.outputs if o.config == "counterfactual")

# -- what a release declares and records (the contract the card, eval and the calibration read) ------------------------
JUDGE_CLASS_FIELD = MetadataField(
    "judge_class_p",
    "float64",
    description="the judge's P(yes) for 'Does this image show a {class}?' (answer-token probability, VQAScore-style)",
    minimum=0.0,
    maximum=1.0,
)
JUDGE_EDIT_FIELD = MetadataField(
    "judge_edit_p",
    "float64",
    description="the judge's P(yes) that the requested change is visible; null where the image is not an edit",
    minimum=0.0,
    maximum=1.0,
)
JUDGE_FIELDS = (JUDGE_CLASS_FIELD, JUDGE_EDIT_FIELD)

DEFAULT_JUDGE = "Qwen/Qwen2.5-VL-7B-Instruct"
# A commit of Qwen/Qwen2.5-VL-7B-Instruct that public code pins (snapshot_download(..., revision=...) in an
# EditScore evaluation script); not re-checked against the Hub from this offline environment.
DEFAULT_JUDGE_REVISION = "cc594898137f460bfe9f0759e9844b3ce807cfb5"
# Licences of the judges this project pins (the card names the judge's licence from here; the Hub's answer is what
# ``lance-cf models list`` shows).
JUDGE_LICENSES = {DEFAULT_JUDGE: "apache-2.0"}

# VQAScore's question (t2v_metrics: 'Does this figure show "{}"? Please answer yes or no.'), with "image".
CLASS_QUESTION = "Does this image show a {label}? Please answer yes or no."
EDIT_QUESTION = 'Does this image show "{edited_caption}"? Please answer yes or no.'
# The answer tokens: Qwen2.5-VL-Instruct answers such questions with a capitalised "Yes" / "No", one token each.
YES_TOKEN = "Yes"
NO_TOKEN = "No"
MIN_PIXELS = 56 * 56
SCORE_RULE = (
    "P(yes) = softmax over the vocabulary of the model's next-token logits after the chat prompt (image, question, "
    "assistant turn opened), taken at the yes token; rounded to 6 decimals (VQAScore)"
)


def class_question(label_name: str) -> str:
    return CLASS_QUESTION.format(label=label_name)


def edit_question(edited_caption: str) -> str:
    return EDIT_QUESTION.format(edited_caption=edited_caption)


def judge_record(options: JudgeOptions, yes_token_id: int | None = None, no_token_id: int | None = None) -> dict:
    """What the manifest records of the judge (``stages.<name>``): the card names the judge from this."""
    return {
        "role": "judge",
        "model": options.model,
        "revision": None if options.is_local else options.revision,
        "license": JUDGE_LICENSES.get(options.model, "not stated (not a judge this project pins)"),
        "class_question": CLASS_QUESTION,
        "edit_question": EDIT_QUESTION,
        "answer_tokens": {"yes": YES_TOKEN, "no": NO_TOKEN, "yes_id": yes_token_id, "no_id": no_token_id},
        "rule": SCORE_RULE,
        "dtype": options.dtype,
        "max_pixels": options.max_pixels,
        "filter_below": options.filter_below,
        "fields": [f.name for f in JUDGE_FIELDS],
    }


@dataclass
class JudgeOptions(Options):
    """Options of the judge stages.

    Attributes:
        model, revision: the judge (Hub id at a pinned revision, or a local directory of a Qwen2.5-VL model with its
            processor).
        dtype: weights' dtype (``auto``: bfloat16 on CUDA, float32 on the CPU).
        batch_size: questions per forward pass.
        max_pixels: the image processor's pixel budget per image (Qwen2.5-VL's ``max_pixels``; 448x448 = 256
            visual tokens after the 2x2 merge).
        filter_below: remove a sample whose ``judge_class_p`` is below this (default: none, nothing removed).
        cache_dir: Hugging Face cache directory (default: the library's).
    """

    model: str = DEFAULT_JUDGE
    revision: str | None = DEFAULT_JUDGE_REVISION
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    batch_size: PositiveInt = 8
    max_pixels: Annotated[int, Interval(ge=MIN_PIXELS, le=4096 * 4096)] = 448 * 448
    filter_below: Fraction | None = None
    cache_dir: str | None = None

    @property
    def is_local(self) -> bool:
        return os.path.isdir(self.model)


# -- the model ---------------------------------------------------------------------------------------------------------
class VlmJudge:
    """The loaded judge; ``p_yes(images, questions)`` gives P(yes) per (image, question) pair."""

    def __init__(self, model: Any, processor: Any, device: str, max_pixels: int) -> None:
        self.model, self.processor, self.device = model, processor, device
        # Qwen2.5-VL's pixel budget, given with every call: a repository's preprocessor_config.json (min_pixels,
        # max_pixels) takes precedence over a size given to from_pretrained, never over one given to the call.
        self.size = {"shortest_edge": MIN_PIXELS, "longest_edge": max_pixels}
        tokenizer = processor.tokenizer
        ids = {t: tokenizer.encode(t, add_special_tokens=False) for t in (YES_TOKEN, NO_TOKEN)}
        for token, found in ids.items():
            if len(found) != 1:
                raise ValueError(f"judge {model.name_or_path}: answer {token!r} is {len(found)} tokens, expected one")
        self.yes_id, self.no_id = ids[YES_TOKEN][0], ids[NO_TOKEN][0]

    def prompt(self, question: str) -> str:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def inputs(self, images: list[Any], questions: list[str]) -> Any:
        """The model's inputs for one batch: chat prompts (left-padded), image patches and their grids."""
        texts = [self.prompt(q) for q in questions]
        chunk = [image.convert("RGB") for image in images]
        inputs = self.processor(text=texts, images=chunk, size=self.size, padding=True, return_tensors="pt")
        return inputs.to(self.device)

    def p_yes(self, images: list[Any], questions: list[str], batch_size: int) -> list[float]:
        import torch

        out: list[float] = []
        for start in range(0, len(images), batch_size):
            inputs = self.inputs(images[start : start + batch_size], questions[start : start + batch_size])
            with torch.inference_mode():
                logits = self.model(**inputs).logits[:, -1, :].float()  # left padding: the last position answers
            probs = torch.softmax(logits, dim=-1)[:, self.yes_id]
            out += [round(float(p), 6) for p in probs.cpu()]
        return out


def _torch_dtype(name: str, device: str) -> Any:
    import torch

    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return getattr(torch, name)


def load_judge(options: JudgeOptions, device: str) -> VlmJudge:
    """Load the judge through transformers: one copy per (model, revision, device, dtype, pixels), shared by the judge
    stages of the process and freed with the last of them (``lance_pipeline.models.shared``)."""
    revision = None if options.is_local else options.revision
    model_ref = os.path.abspath(options.model) if options.is_local else options.model
    key = ("judge", model_ref, revision, str(device), options.dtype, options.max_pixels)

    def load() -> VlmJudge:
        from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

        common = {"revision": revision, "cache_dir": options.cache_dir}
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            options.model, dtype=_torch_dtype(options.dtype, device), use_safetensors=True, **common
        )
        model = model.to(device).eval()
        processor = AutoProcessor.from_pretrained(options.model, **common)
        processor.tokenizer.padding_side = "left"
        logger.info("loaded the judge %s@%s on %s", options.model, revision, device)
        return VlmJudge(model, processor, str(device), options.max_pixels)

    return shared_model(key, load)


# -- the stages --------------------------------------------------------------------------------------------------------
class JudgeStage:
    """``judge``: the judge on every counterfactual (LANCE's or ControlNet's); ``filter_below`` removes low ones."""

    name = "judge"
    version = "1"
    field = "counterfactuals"
    config = "counterfactual"
    many = True
    edits = True  # the images are edits of a requested change: judge_edit_p is asked
    consumes = {"counterfactuals": "list", "label_name": "str"}
    produces = {
        "counterfactuals": "list",
        "counterfactuals_judge_removed": "list",
        "counterfactuals_judge_questions": "int",
    }
    screens = (OutputScreen("counterfactuals", JUDGE_FIELDS, removed="counterfactuals_judge_removed"),)
    options_class = JudgeOptions
    model_options = (
        ModelOption(
            "model",
            TRANSFORMERS_FILES,
            ("config.json", "tokenizer.json", "model*.safetensors"),
            cache_dir="cache_dir",
            role="the judge (vision-language model)",
        ),
    )

    def __init__(self, options: JudgeOptions | None = None, /, **values: Any) -> None:
        self.options = stage_options(type(self), options, values)
        self.judge: Any = None

    @property
    def removed_field(self) -> str:
        return f"{self.field}_judge_removed"

    @property
    def questions_field(self) -> str:
        """How many questions the judge was asked for the record (its cost: one prefill per question)."""
        return f"{self.field}_judge_questions"

    def load(self, device: str) -> None:
        self.judge = load_judge(self.options, device)

    def describe(self) -> dict[str, Any]:
        return judge_record(self.options, getattr(self.judge, "yes_id", None), getattr(self.judge, "no_id", None))

    # 1. the images and their questions
    def _items(self, record: Record) -> list[dict[str, Any]]:
        value = record.get(self.field)
        if value is None:
            return []
        return list(value) if self.many else [{"image": value}]

    def _questions(self, record: Record, item: dict[str, Any]) -> list[str]:
        questions = [class_question(record["label_name"])]
        if self.edits and item.get("edited_caption"):
            questions.append(edit_question(item["edited_caption"]))
        return questions

    def _known(self, record: Record, item: dict[str, Any]) -> tuple[float, float | None] | None:
        """Scores an item already has (the strength config's selected candidate: its counterfactual's), or None."""
        return None

    def process(self, records: list[Record]) -> list[Record | SampleFailure]:
        if self.judge is None:
            raise RuntimeError(f"{type(self).__name__}.load(device) must be called before process()")
        # 2. every question of the batch's images in one list, scored in batches of batch_size
        images, questions = [], []
        for record in records:
            for item in self._items(record):
                if self._known(record, item) is None:
                    for question in self._questions(record, item):
                        images.append(item["image"])
                        questions.append(question)
        scores = iter(self.judge.p_yes(images, questions, self.options.batch_size) if images else ())
        # 3. back to their samples: (class p, edit p or None) per item, and the questions asked per record
        out: list[Record | SampleFailure] = []
        for record in records:
            results, asked = [], 0
            for item in self._items(record):
                known = self._known(record, item)
                if known is not None:
                    results.append(known)
                    continue
                got = [next(scores) for _ in self._questions(record, item)]
                asked += len(got)
                results.append((got[0], got[1] if len(got) > 1 else None))
            out.append({**self._update(record, results), self.questions_field: asked})
        return out

    def _below(self, p: float) -> bool:
        return self.options.filter_below is not None and p < self.options.filter_below

    def _removal(self, index: int, p: float, what: str, config: str | None) -> dict[str, Any]:
        return {
            "index": index,
            "judge_class_p": p,
            "config": config,
            "reason": f"judged not to show its class: judge_class_p {p:.6f} < filter_below "
            f"{self.options.filter_below}: {what}",
        }

    # 4. scores onto the samples; with filter_below, the samples below it removed (recorded with their score)
    def _update(self, record: Record, results: list[tuple[float, float | None]]) -> Record:
        kept, removed = [], []
        for index, (item, (class_p, edit_p)) in enumerate(zip(record.get(self.field) or [], results, strict=True)):
            if self._below(class_p):
                what = f"{self.config} sample of {item.get('edited_caption')!r}"
                removed.append(self._removal(index, class_p, what, self.config))
            else:
                kept.append(
                    {
                        **item,
                        "judge_class_p": class_p,
                        "judge_edit_p": edit_p,
                        SAMPLE_INDEX: item.get(SAMPLE_INDEX, index),
                    }
                )
        return {self.field: kept, self.removed_field: removed}

    @classmethod
    def summarize(cls, updates: list[dict[str, Any]]) -> dict[str, Any]:
        """The manifest's ``screening.<stage>``: images judged, questions asked (the judge's cost: one prefill each),
        and removals per config (none without filter_below)."""
        removed_field = f"{cls.field}_judge_removed"
        judged = questions = 0
        removed_by_config: dict[str, int] = {}
        for update in updates:
            removed = update.get(removed_field) or []
            for entry in removed:
                config = str(entry.get("config"))
                removed_by_config[config] = removed_by_config.get(config, 0) + 1
            questions += int(update.get(f"{cls.field}_judge_questions") or 0)
            if cls.many:
                judged += len(update.get(cls.field) or []) + len(removed)
            else:
                judged += 1 if (update.get(cls.field) is not None or removed) else 0
        return {
            "kind": "judge",
            "checked": judged,
            "questions": questions,
            "removed_by_config": dict(sorted(removed_by_config.items())),
        }


class LanceRJudgeStage(JudgeStage):
    """``judge_lance_r``: the judge on the LANCE-R baseline's images (its edit question asks for the random edit)."""

    name = "judge_lance_r"
    field = "lance_r"
    config = "lance_r"
    consumes = {"lance_r": "list", "label_name": "str"}
    produces = {"lance_r": "list", "lance_r_judge_removed": "list", "lance_r_judge_questions": "int"}
    screens = (OutputScreen("lance_r", JUDGE_FIELDS, removed="lance_r_judge_removed"),)


class StrengthJudgeStage(JudgeStage):
    """``judge_strength``: the judge on the strength config's candidates. With ``filter_below``, an edit whose
    selected candidate (the counterfactual's image) is removed loses its other candidates too: they link to a sample
    that is not released (the release's declared invariants refuse that), as with the safety checker."""

    name = "judge_strength"
    field = STRENGTH_FIELD
    config = "strength"
    consumes = {STRENGTH_FIELD: "list", "counterfactuals": "list", "key": "str", "label_name": "str"}
    produces = {
        STRENGTH_FIELD: "list",
        f"{STRENGTH_FIELD}_judge_removed": "list",
        f"{STRENGTH_FIELD}_judge_questions": "int",
    }
    screens = (OutputScreen(STRENGTH_FIELD, JUDGE_FIELDS, removed=f"{STRENGTH_FIELD}_judge_removed"),)

    def _counterfactual_keys(self, record: Record) -> dict[str, dict[str, Any]]:
        """The record's released counterfactual samples by key (after the ``judge`` stage, when it ran first)."""
        out = {}
        for index, item in enumerate(record.get("counterfactuals") or []):
            out[COUNTERFACTUAL_OUTPUT.sample_key(record["key"], item.get(SAMPLE_INDEX, index))] = item
        return out

    def _known(self, record: Record, item: dict[str, Any]) -> tuple[float, float | None] | None:
        # The selected candidate is the counterfactual's image: it takes the counterfactual's scores when the judge
        # scored them, so that the two configs can never disagree about one image (a batch's padding changes the
        # last bits of a forward pass).
        if not item.get("selected"):
            return None
        linked = self._counterfactual_keys(record).get(item.get("counterfactual_key"))
        if linked is None or linked.get("judge_class_p") is None:
            return None
        return linked["judge_class_p"], linked.get("judge_edit_p")

    def _update(self, record: Record, results: list[tuple[float, float | None]]) -> Record:
        update = super()._update(record, results)
        items = record.get(self.field) or []
        released = self._counterfactual_keys(record)
        lost = {items[r["index"]].get("counterfactual_key") for r in update[self.removed_field]
                if items[r["index"]].get("selected")}  # fmt: skip
        if self.options.filter_below is not None:  # the counterfactual itself removed by the judge stage before
            lost |= {i.get("counterfactual_key") for i in items if i.get("selected")} - set(released)
        lost.discard(None)
        if not lost:
            return update
        update[self.field], removed = without_lost_edits(
            update[self.field],
            lost,
            lambda item: {
                "index": item[SAMPLE_INDEX],
                "judge_class_p": item["judge_class_p"],
                "config": self.config,
                "reason": "its edit's selected candidate (the counterfactual) was judged not to show its class: "
                f"strength candidate of {item.get('edited_caption')!r}",
            },
        )
        update[self.removed_field] += removed
        return update


class _SingleImageJudge(JudgeStage):
    """A stage whose judged field is one image per record: fields on the record, a removed image set to None."""

    many = False
    edits = False

    def _what(self, record: Record) -> str:
        return f"generated image of {record.get('prompt')!r}"

    def _config_of(self, record: Record) -> str | None:
        return None

    def _update(self, record: Record, results: list[tuple[float, float | None]]) -> Record:
        if not results:  # nothing generated for this record (an earlier stage left the field empty)
            return {self.field: None, self.removed_field: [], "judge_class_p": None, "judge_edit_p": None}
        class_p, edit_p = results[0]
        if not self._below(class_p):
            return {self.field: record[self.field], self.removed_field: [], "judge_class_p": class_p,
                    "judge_edit_p": edit_p}  # fmt: skip
        removal = self._removal(0, class_p, self._what(record), self._config_of(record))
        return {self.field: None, self.removed_field: [removal], "judge_class_p": class_p, "judge_edit_p": edit_p}


class GeneratedJudgeStage(_SingleImageJudge):
    """``judge_generated``: the judge on each dataset-interfaces image (class question only: the image is generated,
    not an edit); a removed one is routed to no config (``build.routing`` counts it under ``not_released``)."""

    name = "judge_generated"
    field = "generated"
    consumes = {"generated": "image", "release_config": "any", "prompt": "str", "label_name": "str"}
    produces = {
        "generated": "image",
        "release_config": "any",
        "generated_judge_removed": "list",
        "generated_judge_questions": "int",
        "judge_class_p": "float",
        "judge_edit_p": "float",
    }
    screens = (OutputScreen("generated", JUDGE_FIELDS, removed="generated_judge_removed"),)

    def _config_of(self, record: Record) -> str | None:
        return record.get("release_config")

    def _update(self, record: Record, results: list[tuple[float, float | None]]) -> Record:
        update = super()._update(record, results)
        update["release_config"] = record.get("release_config") if update[self.field] is not None else None
        return update


class DiscoveryJudgeStage(_SingleImageJudge):
    """``judge_discovery``: the judge on each image of a discovery release (``discovery:`` source, whose images are
    generated; class question only); a removed one is routed to no config."""

    name = "judge_discovery"
    field = "image"
    consumes = {"image": "image", "discovery_config": "str", "prompt": "str", "label_name": "str"}
    produces = {
        "image": "image",
        "discovery_config": "any",
        "image_judge_removed": "list",
        "image_judge_questions": "int",
        "judge_class_p": "float",
        "judge_edit_p": "float",
    }
    screens = (OutputScreen("image", JUDGE_FIELDS, removed="image_judge_removed"),)

    def _config_of(self, record: Record) -> str | None:
        return record.get("discovery_config")

    def _update(self, record: Record, results: list[tuple[float, float | None]]) -> Record:
        update = super()._update(record, results)
        update["discovery_config"] = record.get("discovery_config") if update[self.field] is not None else None
        return update
