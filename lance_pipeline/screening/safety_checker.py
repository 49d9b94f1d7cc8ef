"""Stable Diffusion's safety checker on every image a build generates; flagged images are never released.

Rombach et al., CVPR 2022 (Stable Diffusion) ship a safety checker with their v1 models
(``CompVis/stable-diffusion-safety-checker``, loaded through diffusers' ``StableDiffusionSafetyChecker``, as the
Stable Diffusion pipelines load it): CLIP ViT-L/14 image embeddings compared with 17 concept embeddings (and 3
"special care" ones that tighten the others by 0.01), each with its threshold. The editors and generators of this
project run Stable Diffusion without its pipeline's checker (prompt-to-prompt and ControlNet editing need the
latents, dataset interfaces used SD 2, which has none), so these stages run it on what they produced.

The decision is ``StableDiffusionSafetyChecker.forward``'s, the path the Stable Diffusion pipelines run (not
``forward_onnx``, the exported-model path): each special-care score ``cosine - threshold`` is rounded to 3 decimals
and one above 0 adds 0.01 to every concept score; each concept score ``cosine - threshold + adjustment`` is rounded
to 3 decimals, and the image is flagged when one is above 0. ``forward_onnx`` compares the unrounded scores, so a
score in (0, 0.0005] flags there and not in ``forward`` (and a special-care score in that range tightens there only).
A flagged image is removed and recorded as a failure of the stage with its score in the manifest.

Each screened image gets ``safety_nsfw`` (False on every released image) and ``safety_score``: the largest unrounded
``cosine(image, concept) - threshold + adjustment`` over the concepts (6 decimals), with forward's adjustment. A
released image's score can be at most 0.0005 (rounded to 0.000 by ``forward``, so not flagged). One stage per kind of generated image (the stage contract declares its
fields per class): ``safety_check`` (counterfactuals), ``safety_check_lance_r``, ``safety_check_reconstruction`` and
``safety_check_generated`` (dataset-interfaces images), ``safety_check_discovery`` (the generated images of a
discovery release, ``lance-cf discover``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from lance_pipeline.editing.strength import STRENGTH_FIELD, without_lost_edits
from lance_pipeline.models.needs import ModelOption
from lance_pipeline.models.shared import shared_model
from lance_pipeline.option_types import Options, PositiveInt
from lance_pipeline.stage import SAMPLE_INDEX, MetadataField, OutputScreen, Record, SampleFailure, stage_options

logger = logging.getLogger(__name__)

DEFAULT_SAFETY_CHECKER = "CompVis/stable-diffusion-safety-checker"
# The commit of CompVis/stable-diffusion-safety-checker that public projects pin (e.g. sdkit's safety checker loader,
# and Hub cache snapshot paths models--CompVis--stable-diffusion-safety-checker/snapshots/cb41f3a...); not re-checked
# against the Hub from this offline environment.
DEFAULT_SAFETY_CHECKER_REVISION = "cb41f3a270d63d454d385fc2e4f571c487c253c5"

# What the checker's loaders read (StableDiffusionSafetyChecker and CLIPImageProcessor.from_pretrained): its config,
# the image processor's, and its weights: safetensors where the revision has them, else the PyTorch file the pinned
# revision ships (read as tensors only, see load_safety_checker).
SAFETY_CHECKER_FILES = ("config.json", "preprocessor_config.json", "model.safetensors", "pytorch_model.bin")

SAFETY_FIELDS = (
    MetadataField("safety_nsfw", "bool", description="flagged by Stable Diffusion's safety checker (never released)"),
    MetadataField(
        "safety_score",
        "float64",
        description="the checker's largest concept score (flagged when above 0 at 3 decimals, as diffusers' forward)",
    ),
)


@dataclass
class SafetyCheckOptions(Options):
    """Options of the safety-checker stages.

    Attributes:
        model, revision: the checker (Hub id at a pinned revision, or a local directory with the checker's
            ``config.json`` and weights and its ``preprocessor_config.json``).
        batch_size: images per forward pass.
        cache_dir: Hugging Face cache directory (default: the library's).
    """

    model: str = DEFAULT_SAFETY_CHECKER
    revision: str | None = DEFAULT_SAFETY_CHECKER_REVISION
    batch_size: PositiveInt = 16
    cache_dir: str | None = None

    @property
    def is_local(self) -> bool:
        return os.path.isdir(self.model)


class SafetyChecker:
    """The loaded checker and its image processor; ``score(images)`` gives ``(flagged, score)`` per image."""

    def __init__(self, model: Any, processor: Any, device: str, weights_file: str | None) -> None:
        self.model, self.processor, self.device, self.weights_file = model, processor, device, weights_file

    def embed_scores(self, clip_input: Any) -> list[tuple[bool, float]]:
        """Per image: ``StableDiffusionSafetyChecker.forward``'s decision, and the largest unrounded concept score
        with the same special-care adjustment."""
        import torch
        from diffusers.pipelines.stable_diffusion.safety_checker import cosine_distance
        from torch.nn.functional import normalize

        model = self.model
        with torch.no_grad():
            projected = model.visual_projection(model.vision_model(clip_input)[1])
            # 1. forward's inputs, computed as forward computes them (float32 numpy, thresholds as Python floats)
            special_cos = cosine_distance(projected, model.special_care_embeds).cpu().float().numpy()
            concept_cos = cosine_distance(projected, model.concept_embeds).cpu().float().numpy()
            special_thresholds = [w.item() for w in model.special_care_embeds_weights]
            concept_thresholds = [w.item() for w in model.concept_embeds_weights]
            # 2. the recorded score: the largest unrounded concept score (float32 torch, as recorded before)
            embeds = normalize(projected.float())
            concept = embeds @ normalize(model.concept_embeds.float()).T - model.concept_embeds_weights
        out = []
        for i in range(concept_cos.shape[0]):
            flagged, adjusted = forward_decision(special_cos[i], special_thresholds, concept_cos[i], concept_thresholds)
            score = (concept[i] + (0.01 if adjusted else 0.0)).max().item()
            out.append((flagged, score))
        return out

    def score(self, images: list[Any], batch_size: int) -> list[tuple[bool, float]]:
        out: list[tuple[bool, float]] = []
        for start in range(0, len(images), batch_size):
            chunk = [image.convert("RGB") for image in images[start : start + batch_size]]
            pixels = self.processor(images=chunk, return_tensors="pt").pixel_values
            pixels = pixels.to(self.device, dtype=self.model.dtype)
            for flagged, value in self.embed_scores(pixels):
                out.append((flagged, round(float(value), 6)))
        return out


def forward_decision(
    special_cos: Any, special_thresholds: list[float], concept_cos: Any, concept_thresholds: list[float]
) -> tuple[bool, bool]:
    """``StableDiffusionSafetyChecker.forward``'s rule for one image: (flagged, special-care adjustment applied).

    The same expressions in the same order as diffusers' loop (float32 cosines minus Python-float thresholds,
    Python's ``round`` to 3 decimals, ``> 0``), so the decision is forward's to the last bit: the adjustment becomes
    0.01 at the first special-care concept whose rounded score is above 0 (it is added to the later special-care
    scores too, which cannot change the outcome), and the image is flagged when a rounded concept score is above 0.
    """
    adjustment = 0.0
    for index in range(len(special_cos)):
        if round(special_cos[index] - special_thresholds[index] + adjustment, 3) > 0:
            adjustment = 0.01
    flagged = any(
        round(concept_cos[index] - concept_thresholds[index] + adjustment, 3) > 0 for index in range(len(concept_cos))
    )
    return flagged, adjustment > 0


def load_safety_checker(options: SafetyCheckOptions, device: str) -> SafetyChecker:
    """Load the checker through diffusers: one copy per (model, revision, device), shared by the safety stages of
    the process and freed with the last of them (``lance_pipeline.models.shared``)."""
    revision = None if options.is_local else options.revision
    key = (
        "safety-checker",
        os.path.abspath(options.model) if options.is_local else options.model,
        revision,
        str(device),
    )

    def load() -> SafetyChecker:
        from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
        from transformers import CLIPImageProcessor

        common = {"revision": revision, "cache_dir": options.cache_dir}
        # safetensors where the revision has them; the checker's pinned revision ships a PyTorch .bin, which
        # transformers reads with torch.load(weights_only=True): tensors only, no code (recorded in describe()).
        model = StableDiffusionSafetyChecker.from_pretrained(options.model, **common).to(device).eval()
        processor = CLIPImageProcessor.from_pretrained(options.model, **common)
        weights_file = _weights_file(options)
        logger.info("loaded the safety checker %s@%s on %s (%s)", options.model, revision, device, weights_file)
        return SafetyChecker(model, processor, str(device), weights_file)

    return shared_model(key, load)


def _weights_file(options: SafetyCheckOptions) -> str | None:
    if options.is_local:
        for name in ("model.safetensors", "pytorch_model.bin"):
            if os.path.isfile(os.path.join(options.model, name)):
                return name
    return None  # a Hub revision: transformers chose (safetensors first)


class SafetyCheckStage:
    """``safety_check``: the checker on every counterfactual; flagged ones removed, each recorded with its score."""

    name = "safety"
    version = "1"
    field = "counterfactuals"
    what = "counterfactual"
    many = True
    consumes = {"counterfactuals": "list"}
    produces = {"counterfactuals": "list", "counterfactuals_safety_removed": "list"}
    screens = (OutputScreen("counterfactuals", SAFETY_FIELDS, removed="counterfactuals_safety_removed"),)
    options_class = SafetyCheckOptions
    model_options = (
        ModelOption(
            "model",
            SAFETY_CHECKER_FILES,
            ("config.json", "preprocessor_config.json"),
            cache_dir="cache_dir",
            role="Stable Diffusion's safety checker",
        ),
    )

    def __init__(self, options: SafetyCheckOptions | None = None, /, **values: Any) -> None:
        self.options = stage_options(type(self), options, values)
        self.checker: SafetyChecker | None = None

    @property
    def removed_field(self) -> str:
        return f"{self.field}_safety_removed"

    def load(self, device: str) -> None:
        self.checker = load_safety_checker(self.options, device)

    def describe(self) -> dict[str, Any]:
        o = self.options
        return {
            "model": o.model,
            "revision": None if o.is_local else o.revision,
            "weights": self.checker.weights_file if self.checker is not None else None,
            "rule": "flagged when a concept's cos(image, concept) - threshold (+0.01 when a special-care concept's "
            "rounded score is above 0), rounded to 3 decimals, is above 0 (diffusers "
            "StableDiffusionSafetyChecker.forward)",
        }

    def _images(self, record: Record) -> list[Any]:
        value = record.get(self.field)
        if value is None:
            return []
        return [item["image"] for item in value] if self.many else [value]

    def process(self, records: list[Record]) -> list[Record | SampleFailure]:
        if self.checker is None:
            raise RuntimeError(f"{type(self).__name__}.load(device) must be called before process()")
        images = [self._images(record) for record in records]
        scores = iter(self.checker.score([i for batch in images for i in batch], self.options.batch_size))
        out: list[Record | SampleFailure] = []
        for record, batch in zip(records, images, strict=True):
            results = [next(scores) for _ in batch]
            out.append(self._update(record, results))
        return out

    def _update(self, record: Record, results: list[tuple[bool, float]]) -> Record:
        kept, removed = [], []
        for index, (item, (flagged, score)) in enumerate(zip(record.get(self.field) or [], results, strict=True)):
            if flagged:
                removed.append(
                    {
                        "index": index,
                        "score": score,
                        "reason": f"flagged by the safety checker (score {score:.6f}): {self.what} of "
                        f"{item.get('edited_caption')!r}",
                    }
                )
            else:
                kept.append(
                    {**item, "safety_nsfw": False, "safety_score": score, SAMPLE_INDEX: item.get(SAMPLE_INDEX, index)}
                )
        return {self.field: kept, self.removed_field: removed}

    @classmethod
    def summarize(cls, updates: list[dict[str, Any]]) -> dict[str, Any]:
        removed_field = f"{cls.field}_safety_removed"
        checked = flagged = 0
        for update in updates:
            removed = update.get(removed_field) or []
            flagged += len(removed)
            if cls.many:
                checked += len(update.get(cls.field) or []) + len(removed)
            else:
                checked += 1 if (update.get(cls.field) is not None or removed) else 0
        return {"kind": "safety_checker", "checked": checked, "flagged": flagged}


class LanceRSafetyCheckStage(SafetyCheckStage):
    """``safety_check_lance_r``: the checker on the LANCE-R baseline's images."""

    name = "safety_lance_r"
    field = "lance_r"
    what = "LANCE-R sample"
    consumes = {"lance_r": "list"}
    produces = {"lance_r": "list", "lance_r_safety_removed": "list"}
    screens = (OutputScreen("lance_r", SAFETY_FIELDS, removed="lance_r_safety_removed"),)


class StrengthSafetyCheckStage(SafetyCheckStage):
    """``safety_check_strength``: the checker on the strength config's candidates (the selected one is the
    counterfactual's image, so a flagged counterfactual is not released through this config either)."""

    name = "safety_strength"
    field = STRENGTH_FIELD
    what = "strength candidate"
    consumes = {STRENGTH_FIELD: "list"}
    produces = {STRENGTH_FIELD: "list", f"{STRENGTH_FIELD}_safety_removed": "list"}
    screens = (OutputScreen(STRENGTH_FIELD, SAFETY_FIELDS, removed=f"{STRENGTH_FIELD}_safety_removed"),)

    def _update(self, record: Record, results: list[tuple[bool, float]]) -> Record:
        # A flagged selected candidate is the counterfactual's image: its edit's other candidates go with it.
        update = super()._update(record, results)
        items = record.get(self.field) or []
        flagged = [items[r["index"]] for r in update[self.removed_field]]
        lost = {item.get("counterfactual_key") for item in flagged if item.get("selected")} - {None}
        if not lost:
            return update
        update[self.field], removed = without_lost_edits(
            update[self.field],
            lost,
            lambda item: {
                "index": item[SAMPLE_INDEX],
                "score": item["safety_score"],
                "reason": "its edit's selected candidate (the counterfactual) was flagged by the safety checker: "
                f"{self.what} of {item.get('edited_caption')!r}",
            },
        )
        update[self.removed_field] += removed
        return update


class _SingleImageSafetyCheck(SafetyCheckStage):
    """A stage whose screened field is one image per record: fields on the record, a flagged image set to None."""

    many = False

    def _what(self, record: Record) -> str:
        return self.what

    def _update(self, record: Record, results: list[tuple[bool, float]]) -> Record:
        if not results:  # nothing generated for this record (an earlier stage left the field empty)
            return {self.field: None, self.removed_field: [], "safety_nsfw": None, "safety_score": None}
        flagged, score = results[0]
        if not flagged:
            return {self.field: record[self.field], self.removed_field: [], "safety_nsfw": False, "safety_score": score}
        reason = f"flagged by the safety checker (score {score:.6f}): {self._what(record)}"
        return {
            self.field: None,
            self.removed_field: [{"index": 0, "score": score, "reason": reason}],
            "safety_nsfw": True,
            "safety_score": score,
        }


class ReconstructionSafetyCheckStage(_SingleImageSafetyCheck):
    """``safety_check_reconstruction``: the checker on each reconstruction (the control image)."""

    name = "safety_reconstruction"
    field = "reconstruction"
    what = "reconstruction"
    consumes = {"reconstruction": "image"}
    produces = {
        "reconstruction": "image",
        "reconstruction_safety_removed": "list",
        "safety_nsfw": "bool",
        "safety_score": "float",
    }
    screens = (OutputScreen("reconstruction", SAFETY_FIELDS, removed="reconstruction_safety_removed"),)


class GeneratedSafetyCheckStage(_SingleImageSafetyCheck):
    """``safety_check_generated``: the checker on each dataset-interfaces image; a flagged one is routed to no
    config (``build.routing`` counts it under ``not_released``) and recorded as a failure."""

    name = "safety"
    field = "generated"
    consumes = {"generated": "image", "release_config": "any", "prompt": "str"}
    produces = {
        "generated": "image",
        "release_config": "any",
        "generated_safety_removed": "list",
        "safety_nsfw": "bool",
        "safety_score": "float",
    }
    screens = (OutputScreen("generated", SAFETY_FIELDS, removed="generated_safety_removed"),)

    def _what(self, record: Record) -> str:
        return f"generated image of {record.get('prompt')!r}"

    def _update(self, record: Record, results: list[tuple[bool, float]]) -> Record:
        update = super()._update(record, results)
        update["release_config"] = record.get("release_config") if update[self.field] is not None else None
        return update


class DiscoverySafetyCheckStage(_SingleImageSafetyCheck):
    """``safety_check_discovery``: the checker on each image of a discovery release (``discovery:`` source, whose
    images are generated); a flagged one is routed to no config and recorded as a failure."""

    name = "safety"
    field = "image"
    consumes = {"image": "image", "discovery_config": "str", "prompt": "str"}
    produces = {
        "image": "image",
        "discovery_config": "any",
        "image_safety_removed": "list",
        "safety_nsfw": "bool",
        "safety_score": "float",
    }
    screens = (OutputScreen("image", SAFETY_FIELDS, removed="image_safety_removed"),)

    def _what(self, record: Record) -> str:
        return f"generated image of {record.get('prompt')!r}"

    def _update(self, record: Record, results: list[tuple[bool, float]]) -> Record:
        update = super()._update(record, results)
        update["discovery_config"] = record.get("discovery_config") if update[self.field] is not None else None
        return update
