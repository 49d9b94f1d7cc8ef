"""Label-conditioned image captioning with BLIP-2, the first step of LANCE.

Prabhu et al., NeurIPS 2023, "Stress-testing Visual Models by Generating Language-guided Counterfactual
Images" (arXiv 2305.19164), section 3.1 and Algorithm 1: each source image is captioned with BLIP-2
(Li et al., 2023, arXiv 2301.12597) using beam search (5 beams), a minimum caption length of 20 and a
maximum of 100 tokens; the caption starts with a domain phrase ("a photo of ...") so that a *domain* edit
has words to change.

How this implementation conditions on the label: the decoder is prompted with the domain phrase followed
by the true class name, ``"a photo of a dog sled"``, and the caption is that prompt plus BLIP-2's
continuation. The class name is therefore always in the caption, which is what the perturber must keep
and the label-preservation check protects. With ``label_conditioned=False`` the prompt is only the domain
phrase.

Differences from the authors' code (``lance/generate_captions.py``), on purpose:

* the authors' code runs BLIP-1 (LAVIS ``blip_caption`` / ``large_coco``, 3 beams) although the paper and
  README say BLIP-2; we follow the paper (BLIP-2 through transformers, 5 beams);
* LAVIS's ``min_length``/``max_length`` count the whole decoder sequence including its prompt; with a
  per-sample label prompt and padding that would make the bound batch-dependent, so we bound the
  *generated* tokens (``min_new_tokens``/``max_new_tokens``) instead;
* the authors prepend ``"a photo of "`` after captioning; we make it the decoder prompt.

Decoding is deterministic (beam search, no sampling), batched with left padding.

DILLEMA's form (Baresi et al., arXiv 2502.04378, code ``captioning/DILLEMA_captioning_imagenet.py``): two captions per
image drawn with nucleus sampling and joined with ``". "``. ``num_captions: 2`` with ``do_sample: true`` and
``num_beams: 1`` gives it; each caption draws its own noise from (sample seed, caption index) only, so the captions do
not depend on the batch. Without sampling, ``num_captions`` returns the best beams. DILLEMA's captions are LAVIS's
``Blip2OPT.generate`` with its defaults (``max_length=30``, passed to ``generate`` as ``max_new_tokens``; ``min_length=1``,
which counts the prompt, so no minimum of new tokens) and its decoding from the prompt's length on, so the model's
prompt "a photo of" (``blip2_caption_opt6.7b.yaml``) is not part of the caption: ``max_new_tokens: 30``,
``min_new_tokens: 0`` and ``keep_prompt: false`` give that.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from typing import Annotated, Any

from lance_pipeline.models.needs import ModelOption
from lance_pipeline.option_types import (
    Interval,
    NonNegativeInt,
    Options,
    Phrase,
    PositiveInt,
    Probability,
    TorchDtype,
)
from lance_pipeline.stage import Record, SampleFailure, stage_options
from lance_pipeline.text.perturbation import SeededGumbelSampler

logger = logging.getLogger(__name__)

DEFAULT_CAPTIONER = "Salesforce/blip2-opt-2.7b"
# A commit of Salesforce/blip2-opt-2.7b: public code holds it as the Hub cache's snapshot directory
# (models--Salesforce--blip2-opt-2.7b/snapshots/<this hash>), so the Hub served it (see docs/method.md).
DEFAULT_CAPTIONER_REVISION = "51572668da0eb669e01a189dc22abe6088589a24"
DOMAIN_PHRASE = "a photo of"
# Paper section 3.1 (captioning): beam search with 5 beams, caption length 20-100.
NUM_BEAMS = 5
MIN_NEW_TOKENS = 20
MAX_NEW_TOKENS = 100


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def caption_prompt(label_name: str | None, domain_phrase: str = DOMAIN_PHRASE, label_conditioned: bool = True) -> str:
    """The decoder prompt for one image: the domain phrase, then (if conditioned) the class name.

    Args:
        label_name: Human-readable class name, e.g. ``"dog sled"``.
        domain_phrase: The phrase every caption starts with.
        label_conditioned: Whether to put the class name into the prompt.

    Returns:
        E.g. ``"a photo of a dog sled"``.
    """
    if not label_conditioned or not label_name:
        return domain_phrase
    label = " ".join(str(label_name).split())
    return f"{domain_phrase} {_article(label)} {label}"


def join_caption(prompt: str, continuation: str) -> str:
    """Join the prompt and the decoded continuation into one clean single-line caption."""
    text = " ".join(continuation.split())
    if not text:
        return prompt
    if text[0] in ",.;:!?":
        return f"{prompt}{text}"
    return f"{prompt} {text}"


@dataclass
class CaptionOptions(Options):
    """The captioner's options (documented on ``LabelConditionedCaptioner``); bounds and choices are their annotations."""

    model: str = DEFAULT_CAPTIONER
    revision: str | None = DEFAULT_CAPTIONER_REVISION
    batch_size: PositiveInt = 8
    num_beams: PositiveInt = NUM_BEAMS
    min_new_tokens: NonNegativeInt = MIN_NEW_TOKENS
    max_new_tokens: NonNegativeInt = MAX_NEW_TOKENS
    repetition_penalty: Annotated[float, Interval(gt=0.0)] = 1.0
    label_conditioned: bool = True
    domain_phrase: Annotated[Phrase, "a phrase such as 'a photo of'"] = DOMAIN_PHRASE
    dtype: TorchDtype = "auto"
    num_captions: PositiveInt = 1
    do_sample: bool = False
    top_p: Probability = 0.9
    temperature: Annotated[float, Interval(gt=0.0)] = 1.0
    caption_separator: str = ". "
    keep_prompt: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        # Relations between options, which no annotation of one option can say.
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"need min_new_tokens <= max_new_tokens, got min_new_tokens={self.min_new_tokens}, "
                f"max_new_tokens={self.max_new_tokens}"
            )
        if self.do_sample and self.num_beams != 1:
            raise ValueError(
                "do_sample draws each caption from its own seed, one sequence each: set num_beams: 1 "
                f"(got {self.num_beams})"
            )
        if not self.do_sample and self.num_captions > self.num_beams:
            raise ValueError(
                f"num_captions ({self.num_captions}) must not exceed num_beams ({self.num_beams}): the best beams"
            )


class LabelConditionedCaptioner:
    """The ``caption`` stage: BLIP-2 (or any image-to-text checkpoint) prompted with the class name.

    Args:
        model: Hub id or local directory of an image-text-to-text checkpoint (BLIP-2 by default).
        revision: Hub revision; a 40-hex commit for reproducible releases. Ignored for local directories.
        batch_size: Images per forward pass.
        num_beams: Beam width (paper: 5).
        min_new_tokens: Minimum generated tokens after the prompt (paper's minimum caption length, 20).
        max_new_tokens: Maximum generated tokens after the prompt (paper's maximum, 100).
        repetition_penalty: Passed to ``generate`` (1.0 = none, the authors' value).
        label_conditioned: Put the class name into the prompt (see the module docstring).
        domain_phrase: The phrase every caption starts with.
        dtype: ``"auto"`` (float16 on CUDA, float32 elsewhere) or a torch dtype name.
        num_captions: Captions per image, joined with ``caption_separator`` into the record's caption (DILLEMA: 2).
        do_sample: Nucleus sampling with per-(sample, caption) seeded noise instead of beam search (needs
            ``num_beams: 1``; DILLEMA samples).
        top_p, temperature: Sampling's nucleus mass and temperature (LAVIS's defaults, DILLEMA's: 0.9 and 1.0).
        caption_separator: What joins several captions (DILLEMA: ``". "``).
        keep_prompt: Start each caption with the decoder prompt (LANCE); ``False`` keeps the continuation alone,
            as LAVIS decodes it for DILLEMA.
    """

    name = "caption"
    version = "1"
    consumes = {"image": "image", "label_name": "str", "seed": "int"}
    produces = {"caption": "str"}
    model_options = (ModelOption("model", role="captioner (BLIP-2)"),)

    options_class = CaptionOptions

    def __init__(self, options: CaptionOptions | None = None, /, **values: Any) -> None:
        o = stage_options(type(self), options, values)
        self.options = o
        self.model_id = str(o.model)
        self.revision = o.revision
        self.batch_size = o.batch_size
        self.num_beams = o.num_beams
        self.min_new_tokens = o.min_new_tokens
        self.max_new_tokens = o.max_new_tokens
        self.repetition_penalty = o.repetition_penalty
        self.label_conditioned = o.label_conditioned
        self.domain_phrase = " ".join(o.domain_phrase.split())
        self.dtype = o.dtype
        self.num_captions = o.num_captions
        self.do_sample = o.do_sample
        self.top_p = o.top_p
        self.temperature = o.temperature
        self.caption_separator = o.caption_separator
        self.keep_prompt = o.keep_prompt
        self.device: str | None = None
        self._model = None
        self._processor = None

    # -- life cycle ---------------------------------------------------------------------------------
    def load(self, device: str) -> None:
        """Load the processor and model onto ``device``."""
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        dtype = self.dtype
        if dtype == "auto":
            dtype = "float16" if str(device).startswith("cuda") else "float32"
        logger.info("loading captioner %s (revision %s) on %s", self.model_id, self.revision, device)
        self._processor = AutoProcessor.from_pretrained(self.model_id, revision=self.revision)
        self._processor.tokenizer.padding_side = "left"  # decoder-only LMs need left padding for batching
        self._model = AutoModelForImageTextToText.from_pretrained(
            self.model_id, revision=self.revision, dtype=getattr(torch, dtype), use_safetensors=True
        )
        self._model.to(device).eval()
        self.device = str(device)

    def describe(self) -> dict[str, Any]:
        """Model id, revision and decoding constants for the manifest."""
        return {
            "model": self.model_id,
            "revision": self.revision,
            "num_beams": self.num_beams,
            "min_new_tokens": self.min_new_tokens,
            "max_new_tokens": self.max_new_tokens,
            "repetition_penalty": self.repetition_penalty,
            "do_sample": self.do_sample,
            "label_conditioned": self.label_conditioned,
            "domain_phrase": self.domain_phrase,
            "dtype": self.dtype,
            # DILLEMA's form only: a release of the default form keeps the description it always had.
            **(
                {"num_captions": self.num_captions, "caption_separator": self.caption_separator}
                if self.num_captions > 1 or self.do_sample
                else {}
            ),
            **(
                {"top_p": self.top_p, "temperature": self.temperature, "seed": "sha256(sample seed, caption index)"}
                if self.do_sample
                else {}
            ),
            # only when off: a release that keeps the prompt keeps the description it always had
            **({"keep_prompt": False} if not self.keep_prompt else {}),
        }

    # -- work ---------------------------------------------------------------------------------------
    def caption(self, images: list, label_names: list[str | None], seeds: list[int] | None = None) -> list[str]:
        """Caption a list of PIL images, batched.

        Args:
            images: PIL images (converted to RGB).
            label_names: Class name per image (ignored when ``label_conditioned`` is off).
            seeds: Per-image seeds (used only when sampling).

        Returns:
            One caption per image, each starting with the domain phrase unless ``keep_prompt`` is off
            (``num_captions`` of them joined).
        """
        if self._model is None:
            raise RuntimeError("LabelConditionedCaptioner.load(device) must be called before caption()")
        if len(images) != len(label_names):
            raise ValueError(f"got {len(images)} images but {len(label_names)} label names")
        seeds = [0] * len(images) if seeds is None else [int(s) for s in seeds]
        captions: list[str] = []
        for start in range(0, len(images), self.batch_size):
            batch_images = [im.convert("RGB") for im in images[start : start + self.batch_size]]
            prompts = [
                caption_prompt(n, self.domain_phrase, self.label_conditioned)
                for n in label_names[start : start + self.batch_size]
            ]
            captions.extend(self._caption_batch(batch_images, prompts, seeds[start : start + self.batch_size]))
        return captions

    def _caption_batch(self, images: list, prompts: list[str], seeds: list[int]) -> list[str]:
        import torch

        n = self.num_captions
        processors = None
        if self.do_sample:
            # One row per (image, caption), each drawing its own noise: the caption depends on its seed only.
            from transformers import LogitsProcessorList

            images = [im for im in images for _ in range(n)]
            prompts_in = [p for p in prompts for _ in range(n)]
            row_seeds = [caption_seed(seed, k) for seed in seeds for k in range(n)]
            processors = LogitsProcessorList([SeededGumbelSampler(row_seeds, self.temperature, self.top_p)])
        else:
            prompts_in = prompts
        inputs = self._processor(images=images, text=prompts_in, return_tensors="pt", padding=True)
        inputs = inputs.to(self.device)
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self._model.dtype)
        with torch.inference_mode():
            out = self._model.generate(
                **inputs,
                do_sample=False,
                num_beams=self.num_beams,
                num_return_sequences=1 if self.do_sample else n,
                min_new_tokens=self.min_new_tokens,
                max_new_tokens=self.max_new_tokens,
                repetition_penalty=self.repetition_penalty,
                logits_processor=processors,
            )
        input_ids = inputs.get("input_ids")
        # Decoder-only LMs return prompt + continuation; encoder-decoders only the continuation.
        if (
            input_ids is not None
            and out.shape[1] >= input_ids.shape[1]
            and torch.equal(out[:, : input_ids.shape[1]], input_ids)
        ):
            out = out[:, input_ids.shape[1] :]
        texts = self._processor.batch_decode(out, skip_special_tokens=True)
        # Rows come image by image, ``n`` per image (the sampled copies, or the best beams in order).
        row_prompts = [p for p in prompts for _ in range(n)]
        if self.keep_prompt:
            rows = [join_caption(p, _drop_echo(p, text)) for p, text in zip(row_prompts, texts, strict=True)]
        else:  # the continuation alone (LAVIS decodes from the prompt's length on)
            rows = [" ".join(_drop_echo(p, text).split()) for p, text in zip(row_prompts, texts, strict=True)]
        return [self.caption_separator.join(rows[i * n : (i + 1) * n]) for i in range(len(prompts))]

    def process(self, records: list[Record]) -> list[Record | SampleFailure]:
        """Caption each record's ``image`` conditioned on its ``label_name``; returns ``{"caption": str}``."""
        results: list[Record | SampleFailure] = [SampleFailure("caption: record has no image")] * len(records)
        todo = [i for i, r in enumerate(records) if r.get("image") is not None]
        if todo:
            captions = self.caption(
                [records[i]["image"] for i in todo],
                [records[i].get("label_name") for i in todo],
                [int(records[i].get("seed", 0)) for i in todo],
            )
            for i, caption in zip(todo, captions, strict=True):
                results[i] = {"caption": caption}
        return results


def caption_seed(sample_seed: int, index: int) -> int:
    """The noise seed of a sample's ``index``-th sampled caption: from (sample seed, index) only."""
    digest = hashlib.sha256(f"lance-cf:caption:{int(sample_seed)}:{int(index)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def _drop_echo(prompt: str, text: str) -> str:
    """Remove the prompt if a model echoed it at the start of its continuation (some image-to-text heads do)."""
    stripped = text.strip()
    if re.match(re.escape(prompt) + r"\b", stripped, flags=re.IGNORECASE):
        return stripped[len(prompt) :]
    return stripped


# The name the builder's stage registry uses.
CaptionStage = LabelConditionedCaptioner
