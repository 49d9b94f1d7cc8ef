"""The second editor: structure-conditioned regeneration with ControlNet, as DILLEMA does it.

Baresi, Hu, Mas'udi, Quattrocchi, "DILLEMA: Diffusion and Large Language Models for Multi-Modal Augmentation"
(arXiv 2502.04378, 2025; code ``irfanmasoudi/DILLEMA``, ``imagegen/DILLEMA_imagegen_imagenet.py``). Instead of
inverting the image and steering attention (LANCE, ``image_editing.py``), DILLEMA keeps the image's structure as a
condition (an edge map) and regenerates the image from the counterfactual caption with Stable Diffusion 1.5 and
ControlNet (Zhang, Rao, Agrawala, ICCV 2023), with the UniPC scheduler (Zhao et al., NeurIPS 2023) and only 5 steps.
It is cheaper than null-text inversion plus a prompt-to-prompt sweep, but the appearance drifts more.

What this module does, per record:

1. The condition: a Canny edge map of the source image (``cv2.Canny`` with ControlNet's thresholds 100/200, the
   annotator ``lllyasviel/sd-controlnet-canny`` was trained with; no model weights). DILLEMA used HED edges, whose
   annotator network is a pickle checkpoint (``lllyasviel/Annotators`` ``ControlNetHED.pth``): this project loads
   safetensors only, so ``hed`` is refused with that reason. ``depth`` takes the depth map of a transformers
   depth-estimation model (safetensors; formatted as transformers' ``depth-estimation`` pipeline does) with a depth
   ControlNet.
2. Candidates: every kept caption edit is rendered with ``StableDiffusionControlNetPipeline`` (diffusers) for each of
   ``images_per_edit`` seeds and each ``conditioning_scales`` value, with DILLEMA's negative prompt. A candidate's
   seed derives from (sample seed, image index) only, so all edits of a sample start from the same noise, as all of
   LANCE's edits of a sample start from the same inverted latent.
3. Gates and choice: the CLIP gates of LANCE (``clip_gates.py``) against the source image, and per edit the
   ``keep_per_edit`` passing candidates with the highest CLIP directional similarity (paper eq. 2 of LANCE), exactly
   the rule of the prompt-to-prompt editor. Every candidate is recorded with its scores and reason.

The stage (``ControlNetEditStage``, type ``controlnet_edit``) returns ``{"counterfactuals": [...],
"edit_candidates": [...]}`` like the prompt-to-prompt ``edit`` stage; each counterfactual also names its ``editor``
("controlnet"), its seed, conditioning scale and condition, and carries the LLM trace of the edit it renders (DILLEMA
keywords, alternatives, applied alternatives; ``dillema_text.py``) where there is one.

Determinism: the initial noise comes from a CPU ``torch.Generator`` seeded per candidate, UniPC draws no noise, and
candidates of one sample are batched only with each other, so a sample's images do not depend on its batch.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from lance_pipeline.editing.candidate_selection import Candidate, CandidateSelector, EditRequest, SweepResult
from lance_pipeline.editing.options import EditorOptions, GuidanceScale, check_model_reference
from lance_pipeline.editing.sd_components import load_stable_diffusion_components
from lance_pipeline.editing.stages import CounterfactualEditStage
from lance_pipeline.models.needs import DIFFUSERS_MODEL_FILES, SD_COMPONENT_FILES, ModelOption, clip_option
from lance_pipeline.option_types import DiffusionSteps, Interval, MinLen, PositiveInt
from lance_pipeline.stage import SCORE_NAMES, MetadataField, Record, ReleaseOutput

logger = logging.getLogger(__name__)

EDITOR_NAME = "controlnet"

# Stable Diffusion 1.5, the base model of DILLEMA and of the lllyasviel ControlNets. runwayml/stable-diffusion-v1-5 is
# gone from the Hub; this is its mirror. The commit is the one several public projects pin; it was NOT checked
# against the Hub from this offline environment.
DEFAULT_MODEL = "stable-diffusion-v1-5/stable-diffusion-v1-5"
DEFAULT_REVISION = "451f4fe16113bff5a5d2269ed5ad43b0592e9a14"
# The Canny ControlNet for SD 1.5 (Zhang et al.); commit pinned in a public project, NOT checked from here.
DEFAULT_CONTROLNET = "lllyasviel/sd-controlnet-canny"
DEFAULT_CONTROLNET_REVISION = "7f2f69197050967007f6bbd23ab5e52f0384162a"
# DILLEMA's fixed negative prompt, verbatim (imagegen/DILLEMA_imagegen_imagenet.py). The "(…: 1.9)" weight syntax is
# not parsed by diffusers; it is kept as the authors wrote it.
DILLEMA_NEGATIVE_PROMPT = "low quality, painting, cartoon, greyscale image, (saturated color: 1.9), bright colors"
# DILLEMA: UniPC with 5 steps and the pipeline's default guidance 7.5.
DILLEMA_STEPS = 5
DILLEMA_GUIDANCE = 7.5
# The thresholds of ControlNet's Canny annotator and of the diffusers ControlNet examples.
CANNY_LOW_THRESHOLD = 100
CANNY_HIGH_THRESHOLD = 200
CannyThreshold = Annotated[int, Interval(ge=0, le=255 * 8), "a gradient threshold"]  # Sobel magnitudes reach 8 x 255
ConditioningScale = Annotated[float, Interval(ge=0.0, le=4.0)]
DTYPES = ("float32", "float16", "bfloat16")

# Conditions this editor can compute, and why the others are refused.
CONDITIONS = ("canny", "depth")
REFUSED_CONDITIONS = {
    "hed": (
        "condition 'hed' needs the HED annotator network (lllyasviel/Annotators ControlNetHED.pth), a pickle "
        "checkpoint; this project loads safetensors only. Use condition 'canny' (no weights needed) or 'depth' (a "
        "transformers depth-estimation model with safetensors weights)"
    ),
}


# ---------------------------------------------------------------------------------------------- conditions


def canny_condition(image, low_threshold: int = CANNY_LOW_THRESHOLD, high_threshold: int = CANNY_HIGH_THRESHOLD):
    """The Canny edge map of ``image`` as ControlNet's Canny annotator computes it.

    ``cv2.Canny`` on the RGB uint8 array (OpenCV takes the strongest gradient over the channels), 3x3 Sobel, L1
    gradient norm, hysteresis between the two thresholds; the single-channel map (0 or 255) is repeated into RGB.

    Args:
        image: A PIL image (converted to RGB).
        low_threshold: Hysteresis low threshold (100).
        high_threshold: Hysteresis high threshold (200).

    Returns:
        An RGB PIL image of the edges, the size of ``image``.
    """
    import numpy as np
    from PIL import Image

    try:
        import cv2
    except ImportError as error:  # pragma: no cover - a project dependency
        raise ImportError("the Canny condition needs OpenCV: pip install opencv-python-headless") from error
    if not 0 <= low_threshold <= high_threshold:
        raise ValueError(f"Canny thresholds must satisfy 0 <= low <= high, got {low_threshold}, {high_threshold}")
    array = np.ascontiguousarray(np.asarray(image.convert("RGB"), dtype=np.uint8))
    edges = cv2.Canny(array, low_threshold, high_threshold)
    return Image.fromarray(np.repeat(edges[:, :, None], 3, axis=2))


def depth_condition(image, processor, model):
    """The depth map of ``image`` as transformers' ``depth-estimation`` pipeline formats it, in 3 channels.

    The model's ``predicted_depth`` is resized to the image (bicubic, ``post_process_depth_estimation``), scaled to
    [0, 255] by its minimum and maximum and cast to uint8 (the pipeline's ``"depth"`` image, which is what the
    diffusers depth-ControlNet examples feed), then repeated into RGB.

    Args:
        image: A PIL image (converted to RGB).
        processor: The model's image processor (``AutoImageProcessor``).
        model: A loaded ``AutoModelForDepthEstimation``.
    """
    import numpy as np
    import torch
    from PIL import Image

    image = image.convert("RGB")
    inputs = processor(images=image, return_tensors="pt").to(model.device)
    with torch.inference_mode():
        outputs = model(**inputs)
    depth = processor.post_process_depth_estimation(outputs, [image.size[::-1]])[0]["predicted_depth"]
    depth = depth.detach().float().cpu().numpy()
    span = depth.max() - depth.min()
    depth = (depth - depth.min()) / span if span > 0 else np.zeros_like(depth)
    return Image.fromarray(np.repeat((depth * 255).astype("uint8")[:, :, None], 3, axis=2))


def candidate_seed(sample_seed: int, image_index: int) -> int:
    """Seed of the initial noise of a sample's ``image_index``-th image: from (sample seed, index) only."""
    digest = hashlib.sha256(f"lance-cf:controlnet:{int(sample_seed)}:{int(image_index)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


# ---------------------------------------------------------------------------------------------- options


@dataclass
class ControlNetEditorOptions(EditorOptions):
    """Every option of the ControlNet editor, with DILLEMA's settings as defaults.

    Attributes:
        model: Hub id of a Stable Diffusion 1.x checkpoint in diffusers layout, or a local directory.
        revision: Pinned Hub revision of ``model``.
        controlnet: Hub id or local directory of a ``ControlNetModel`` trained for ``model`` and ``condition``.
        controlnet_revision: Pinned Hub revision of ``controlnet``.
        condition: ``"canny"`` or ``"depth"`` (``"hed"`` is refused, see ``REFUSED_CONDITIONS``).
        depth_model, depth_revision: The depth estimator of ``condition: depth`` (a transformers
            depth-estimation model with safetensors weights, e.g. a DPT/MiDaS checkpoint, as the depth ControlNet
            was trained with MiDaS depth) and its pinned revision.
        canny_low_threshold, canny_high_threshold: Canny hysteresis thresholds (100, 200).
        dtype: Weights and compute dtype.
        image_size: Square output size in pixels (the build's image size).
        num_inference_steps: UniPC steps (DILLEMA: 5).
        guidance_scale: Classifier-free guidance (7.5).
        negative_prompt: DILLEMA's negative prompt by default; ``""`` for none.
        images_per_edit: Seeds rendered per counterfactual caption (DILLEMA made 5 images per counterfactual).
        conditioning_scales: ControlNet conditioning scales rendered per seed (each is one more candidate).
        keep_per_edit: Passing candidates kept per edit, best CLIP directional similarity first.
        batch_size: Candidates per pipeline call (candidates of one sample only).
        long_captions: An edited caption longer than the text encoder's context (77 tokens): ``"refuse"`` it before
            rendering (as the LANCE editor does: its change may lie past the cut), or ``"truncate"``: render it,
            cut at 77 tokens by diffusers' pipeline, as DILLEMA's script does (preset ``hardimagenet-dillema``).
        clip_*, require_edited_closer, cache_dir: shared by every editor (``EditorOptions``, ``ClipGateOptions``).
    """

    model: str = DEFAULT_MODEL
    revision: str | None = DEFAULT_REVISION
    controlnet: str = DEFAULT_CONTROLNET
    controlnet_revision: str | None = DEFAULT_CONTROLNET_REVISION
    condition: str = "canny"
    canny_low_threshold: CannyThreshold = CANNY_LOW_THRESHOLD
    canny_high_threshold: CannyThreshold = CANNY_HIGH_THRESHOLD
    depth_model: str | None = None
    depth_revision: str | None = None
    num_inference_steps: DiffusionSteps = DILLEMA_STEPS
    guidance_scale: GuidanceScale = DILLEMA_GUIDANCE
    negative_prompt: str = DILLEMA_NEGATIVE_PROMPT
    images_per_edit: PositiveInt = 1
    # One scale may be written as a number; the options hold a tuple of floats.
    conditioning_scales: ConditioningScale | Annotated[tuple[ConditioningScale, ...], MinLen(1)] = (1.0,)
    keep_per_edit: PositiveInt = 1
    batch_size: PositiveInt = 4
    # An edited caption over the text encoder's 77 tokens: refuse it before rendering, or render it cut at 77 tokens
    # (diffusers' StableDiffusionControlNetPipeline.encode_prompt truncates and logs the cut words: what DILLEMA's
    # imagegen script gets).
    long_captions: Literal["refuse", "truncate"] = "refuse"
    # Why the conditioning scale is not mapped onto LANCE's strength axis (lance_pipeline.editing.strength).
    not_a_strength_series = (
        "the ControlNet editor's candidates are separate regenerations from noise (one per seed and conditioning "
        "scale): the conditioning scale sets how closely the source's edges are followed, not how much of the source "
        "image is kept, no scale gives the source back, and seeds vary the image as much as the scale does"
    )

    def __post_init__(self) -> None:
        super().__post_init__()  # each option against its annotation, the model reference
        self.controlnet = check_model_reference("controlnet", self.controlnet)
        # A condition refused for a reason says it (a Literal could only list the known ones).
        if self.condition in REFUSED_CONDITIONS:
            raise ValueError(REFUSED_CONDITIONS[self.condition])
        if self.condition not in CONDITIONS:
            known = ", ".join((*CONDITIONS, *REFUSED_CONDITIONS))
            raise ValueError(f"condition {self.condition!r} is unknown (known: {known})")
        if self.condition == "depth":
            if not self.depth_model:
                raise ValueError(
                    "condition 'depth' needs depth_model: a transformers depth-estimation model with safetensors "
                    "weights (Hub id at a pinned depth_revision, or a local directory)"
                )
            if self.controlnet == DEFAULT_CONTROLNET:
                raise ValueError(
                    f"condition 'depth' needs a depth ControlNet; controlnet is still the Canny one "
                    f"({DEFAULT_CONTROLNET}): set controlnet (e.g. lllyasviel/sd-controlnet-depth) and its revision"
                )
        elif self.depth_model is not None:
            raise ValueError(f"depth_model is only used with condition 'depth', not {self.condition!r}")
        if self.canny_low_threshold > self.canny_high_threshold:
            raise ValueError(
                f"canny_low_threshold ({self.canny_low_threshold}) must not exceed canny_high_threshold "
                f"({self.canny_high_threshold})"
            )
        scales = self.conditioning_scales
        self.conditioning_scales = tuple(float(s) for s in (scales if isinstance(scales, tuple | list) else (scales,)))
        if len(set(self.conditioning_scales)) != len(self.conditioning_scales):
            raise ValueError(f"conditioning_scales has duplicates: {self.conditioning_scales!r}")

    @property
    def candidates_per_edit(self) -> int:
        return self.images_per_edit * len(self.conditioning_scales)

    def describe(self) -> dict[str, Any]:
        """The shared part, plus the ControlNet (its sampling constants are in the editor's own section)."""
        local = os.path.isdir(self.controlnet)
        shared = super().describe()
        # In the order manifests and cards have always listed them.
        return {
            "editor": EDITOR_NAME,
            "model": shared.pop("model"),
            "revision": shared.pop("revision"),
            "controlnet": Path(self.controlnet).name if local else self.controlnet,
            "controlnet_revision": None if local else self.controlnet_revision,
            **shared,
            "long_captions": self.long_captions,
        }

    def describe_condition(self) -> dict[str, Any]:
        if self.condition == "depth":
            local = os.path.isdir(self.depth_model)
            return {
                "name": "depth",
                "implementation": "transformers depth estimation, min-max scaled to uint8, repeated into 3 channels",
                "depth_model": Path(self.depth_model).name if local else self.depth_model,
                "depth_revision": None if local else self.depth_revision,
            }
        return {
            "name": "canny",
            "implementation": "cv2.Canny on the RGB image, edges repeated into 3 channels",
            "low_threshold": self.canny_low_threshold,
            "high_threshold": self.canny_high_threshold,
        }


# ---------------------------------------------------------------------------------------------- the editor


@dataclass(frozen=True)
class ControlNetVariant:
    """What distinguishes the candidates of one edit: the image index (hence the seed) and the conditioning scale."""

    image_index: int
    seed: int
    conditioning_scale: float


@dataclass
class ControlNetSweep(SweepResult):
    """A ``SweepResult`` whose candidates also carry their variant (``variants[k]`` belongs to ``candidates[k]``)."""

    variants: list[ControlNetVariant] = field(default_factory=list)
    condition: Any = None


@dataclass
class ForwardCounts:
    """Samples that went through the UNet and the ControlNet (a CFG step counts 2 per image)."""

    unet_samples: int = 0
    controlnet_samples: int = 0
    unet_calls: int = 0


def load_controlnet(controlnet: str, revision: str | None, dtype: str, device: str, cache_dir: str | None = None):
    """Load a ``ControlNetModel`` (safetensors only), frozen, in eval mode, on ``device``."""
    import torch
    from diffusers import ControlNetModel

    local = os.path.isdir(controlnet)
    model = ControlNetModel.from_pretrained(
        controlnet,
        revision=None if local else revision,
        torch_dtype=getattr(torch, dtype),
        use_safetensors=True,
        cache_dir=cache_dir,
    )
    return model.requires_grad_(False).eval().to(device)


def load_depth_estimator(model: str, revision: str | None, device: str, cache_dir: str | None = None):
    """``(image processor, depth model)`` of a transformers depth-estimation checkpoint (safetensors only)."""
    from transformers import AutoImageProcessor, AutoModelForDepthEstimation

    local = os.path.isdir(model)
    revision = None if local else revision
    processor = AutoImageProcessor.from_pretrained(model, revision=revision, cache_dir=cache_dir)
    estimator = AutoModelForDepthEstimation.from_pretrained(
        model, revision=revision, cache_dir=cache_dir, use_safetensors=True
    )
    return processor, estimator.requires_grad_(False).eval().to(device)


def load_scheduler_config(model: str, revision: str | None, cache_dir: str | None = None) -> dict:
    """The checkpoint's own scheduler config (``scheduler/scheduler_config.json``), UniPC's starting point."""
    from diffusers import UniPCMultistepScheduler

    local = os.path.isdir(model)
    return dict(
        UniPCMultistepScheduler.load_config(
            model, subfolder="scheduler", revision=None if local else revision, cache_dir=cache_dir
        )
    )


class ControlNetEditor:
    """Renders caption edits of one image with SD + ControlNet through ``StableDiffusionControlNetPipeline``.

    Implements ``candidate_selection.Editor`` (registered as ``EDITORS["controlnet"]``): ``render`` returns every
    (edit, seed, conditioning scale) candidate, and the source image itself as the image the CLIP gates compare
    against (there is no reconstruction: nothing is inverted).

    Args:
        components: Loaded Stable Diffusion components (``sd_components.StableDiffusionComponents``); never modified.
        controlnet: A loaded ``ControlNetModel`` for the components' UNet.
        options: The editor options.
        scheduler_config: The checkpoint's scheduler config (default: the components' DDIM config).
        depth_estimator: ``(image processor, depth model)`` for ``condition: depth``.
    """

    name = EDITOR_NAME

    def __init__(
        self, components, controlnet, options: ControlNetEditorOptions, scheduler_config=None, depth_estimator=None
    ) -> None:
        from diffusers import StableDiffusionControlNetPipeline, UniPCMultistepScheduler

        self.components = components
        self.controlnet = controlnet
        self.options = options
        # The pipeline itself requires multiples of 8; the latents must also survive the UNet's downsampling.
        multiple = math.lcm(8, components.latent_multiple)
        if options.image_size % multiple:
            raise ValueError(
                f"image_size must be a multiple of {multiple} for {components.model}, got {options.image_size}"
            )
        # A fresh scheduler from the checkpoint's own scheduler config (as DILLEMA: ``from_config(pipe.scheduler
        # .config)``); the shared components stay untouched.
        self.scheduler = UniPCMultistepScheduler.from_config(scheduler_config or components.scheduler_config)
        self.pipeline = StableDiffusionControlNetPipeline(
            vae=components.vae,
            text_encoder=components.text_encoder,
            tokenizer=components.tokenizer,
            unet=components.unet,
            controlnet=controlnet,
            scheduler=self.scheduler,
            safety_checker=None,
            feature_extractor=None,
            image_encoder=None,
            requires_safety_checker=False,
        )
        self.pipeline.set_progress_bar_config(disable=True)
        self.counts = ForwardCounts()
        self.depth_estimator = depth_estimator

    def condition_image(self, image):
        """The condition of a source image: its Canny edges, or its depth map."""
        o = self.options
        if o.condition == "depth":
            if self.depth_estimator is None:
                raise RuntimeError("condition 'depth' needs the depth estimator: build the editor with load()")
            return depth_condition(image, *self.depth_estimator)
        return canny_condition(image, o.canny_low_threshold, o.canny_high_threshold)

    @classmethod
    def load(cls, options: ControlNetEditorOptions, device: str) -> ControlNetEditor:
        """Load (or share) the SD components, load the ControlNet and the scheduler config, build the editor."""
        o = options
        components = load_stable_diffusion_components(o.model, o.revision, o.dtype, device, o.cache_dir)
        controlnet = load_controlnet(o.controlnet, o.controlnet_revision, o.dtype, device, o.cache_dir)
        depth = None
        if o.condition == "depth":
            depth = load_depth_estimator(o.depth_model, o.depth_revision, device, o.cache_dir)
        return cls(components, controlnet, o, load_scheduler_config(o.model, o.revision, o.cache_dir), depth)

    # ------------------------------------------------------------------------------------------ Editor interface

    @property
    def max_prompt_tokens(self) -> int:
        return self.components.tokenizer.model_max_length

    def count_tokens(self, text: str) -> int:
        return len(self.components.tokenizer(text).input_ids)

    def check_source(self, record: Record) -> str | None:
        from PIL import Image

        if not isinstance(record.get("image"), Image.Image):
            return "record has no source image to take the condition from"
        if not isinstance(record.get("caption"), str) or not record["caption"].strip():
            return "record has no caption (the caption stage must run first)"
        seed = record.get("seed")
        if isinstance(seed, bool) or not isinstance(seed, int):
            return f"record has no integer seed (got {seed!r})"
        return None

    def render(self, record: Record, requests: list[EditRequest]) -> ControlNetSweep:
        """Every request at every (seed, conditioning scale); the gates compare against the source image."""
        o = self.options
        image = record["image"].convert("RGB")
        if image.size != (o.image_size, o.image_size):
            image = image.resize((o.image_size, o.image_size))
        condition = self.condition_image(image)
        variants = [
            ControlNetVariant(i, candidate_seed(record["seed"], i), scale)
            for i in range(o.images_per_edit)
            for scale in o.conditioning_scales
        ]
        jobs = [(r, v) for r in range(len(requests)) for v in variants]
        rendered: dict[tuple[int, ControlNetVariant], Any] = {}
        for scale in o.conditioning_scales:  # one conditioning scale per pipeline call
            scale_jobs = [job for job in jobs if job[1].conditioning_scale == scale]
            for start in range(0, len(scale_jobs), o.batch_size):
                chunk = scale_jobs[start : start + o.batch_size]
                images = self.generate(
                    condition, [requests[r].edited_caption for r, _ in chunk], [v.seed for _, v in chunk], scale
                )
                rendered.update(zip(chunk, images, strict=True))
        sweep = ControlNetSweep(reconstruction=image, condition=condition)
        for r, v in jobs:
            sweep.candidates.append(Candidate(request_index=r, self_replace=None, image=rendered[(r, v)]))
            sweep.variants.append(v)
        return sweep

    def describe(self) -> dict[str, Any]:
        o = self.options
        config = self.scheduler.config
        return {
            "editor": self.name,
            "pipeline": "diffusers StableDiffusionControlNetPipeline (safety checker off, as DILLEMA)",
            "scheduler": {
                "class": type(self.scheduler).__name__,
                **{
                    k: config.get(k)
                    for k in (
                        "beta_start",
                        "beta_end",
                        "beta_schedule",
                        "num_train_timesteps",
                        "prediction_type",
                        "solver_order",
                        "solver_type",
                        "predict_x0",
                        "timestep_spacing",
                        "steps_offset",
                    )
                },
            },
            "num_inference_steps": o.num_inference_steps,
            "guidance_scale": o.guidance_scale,
            "negative_prompt": o.negative_prompt,
            "condition": o.describe_condition(),
            "candidates": {
                "images_per_edit": o.images_per_edit,
                "conditioning_scales": list(o.conditioning_scales),
                "seed": "sha256(sample seed, image index), CPU generator: all edits of a sample share their noise",
                "keep_per_edit": o.keep_per_edit,
                "batch_size": o.batch_size,
            },
            "gates_compare_against": "the source image",
            "vae_scaling_factor": self.components.vae.config.scaling_factor,
        }

    # ------------------------------------------------------------------------------------------ sampling

    @contextmanager
    def _counting(self):
        """Count the samples the UNet and the ControlNet see while rendering (for the benchmark)."""

        def unet_hook(module, args, kwargs):
            sample = args[0] if args else kwargs["sample"]
            self.counts.unet_samples += int(sample.shape[0])
            self.counts.unet_calls += 1

        def controlnet_hook(module, args, kwargs):
            sample = args[0] if args else kwargs["sample"]
            self.counts.controlnet_samples += int(sample.shape[0])

        handles = [
            self.components.unet.register_forward_pre_hook(unet_hook, with_kwargs=True),
            self.controlnet.register_forward_pre_hook(controlnet_hook, with_kwargs=True),
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def generate(self, condition, prompts: list[str], seeds: list[int], conditioning_scale: float) -> list:
        """One image per (prompt, seed), all with the same condition and conditioning scale (one pipeline call).

        Returns:
            PIL images, in the order of ``prompts``.
        """
        import torch

        if len(prompts) != len(seeds):
            raise ValueError(f"got {len(prompts)} prompts but {len(seeds)} seeds")
        if not prompts:
            return []
        o = self.options
        # CPU generators: the same noise on any device (diffusers draws on the generator's device, then moves it).
        generators = [torch.Generator("cpu").manual_seed(int(seed)) for seed in seeds]
        with self._counting(), torch.inference_mode():
            output = self.pipeline(
                prompt=list(prompts),
                image=condition,
                height=o.image_size,
                width=o.image_size,
                num_inference_steps=o.num_inference_steps,
                guidance_scale=o.guidance_scale,
                negative_prompt=[o.negative_prompt] * len(prompts) if o.negative_prompt else None,
                generator=generators,
                controlnet_conditioning_scale=float(conditioning_scale),
                output_type="pil",
            )
        return list(output.images)


# ---------------------------------------------------------------------------------------------- selection

# Fields of a caption edit that are copied onto its counterfactual sample (the DILLEMA trace; absent for LANCE).
TRACE_FIELDS = ("llm_keywords", "llm_alternatives", "llm_applied_alternatives")
# The extra metadata fields of this editor's counterfactual samples (release format v2 declared fields).
METADATA_FIELDS = (
    MetadataField("editor", "string", description="the editor that rendered the sample"),
    MetadataField("controlnet_seed", "int64", description="seed of the sample's initial noise"),
    MetadataField("controlnet_scale", "float64", description="ControlNet conditioning scale"),
    MetadataField("condition", "string", enum=CONDITIONS, description="the structure condition"),
    MetadataField("llm_keywords", "string", description="DILLEMA keywords: JSON object word -> aspect"),
    MetadataField("llm_alternatives", "string", description="DILLEMA alternatives: JSON object word -> [values]"),
    MetadataField("llm_applied_alternatives", "string", description="alternatives applied: JSON object word -> value"),
)


class ControlNetSelector(CandidateSelector):
    """LANCE's gates and choice (``CandidateSelector``), plus what a ControlNet candidate is and the LLM trace.

    Candidate records gain ``editor``, ``seed`` and ``conditioning_scale``; chosen samples gain ``editor``,
    ``controlnet_seed``, ``controlnet_scale``, ``condition`` and the edit's trace fields. With ``keep_per_edit`` > 1
    the next-best passing candidates of an edit (by CLIP directional similarity, ties to the earlier) become
    samples too (DILLEMA kept 5 images per counterfactual).
    """

    def __init__(self, scorer, thresholds, keep_per_edit: int = 1, condition: str = "canny") -> None:
        super().__init__(scorer, thresholds, selection="best_directional")
        self.keep_per_edit = keep_per_edit
        self.condition = condition

    def describe(self) -> str:
        best = super().describe()
        return best if self.keep_per_edit == 1 else f"{best}; the {self.keep_per_edit} best per edit"

    def select(self, caption: str, edits: list[dict], sweep: ControlNetSweep) -> tuple[list[dict], list[dict]]:
        _, records = super().select(caption, edits, sweep)
        for record, variant in zip(records, sweep.variants, strict=True):
            record.update(editor=EDITOR_NAME, seed=variant.seed, conditioning_scale=variant.conditioning_scale)
        chosen_samples = []
        for edit_index, edit in enumerate(edits):
            passing = [k for k, r in enumerate(records) if r["edit_index"] == edit_index and r["passed"]]
            ranked = sorted(passing, key=lambda k: -records[k]["scores"]["clip_directional"])  # stable: ties keep order
            kept = ranked[: self.keep_per_edit]
            for k in ranked:
                records[k]["chosen"] = k in kept
                records[k]["reject_reason"] = (
                    None
                    if k in kept
                    else f"not selected: clip_directional={records[k]['scores']['clip_directional']:.6f} below the "
                    f"{self.keep_per_edit} best of this edit"
                )
            for k in kept:
                record, variant = records[k], sweep.variants[k]
                sample = {
                    "image": sweep.candidates[k].image,
                    "edit_type": record["edit_type"],
                    "edited_caption": record["edited_caption"],
                    "original_span": record["original_span"],
                    "edited_span": record["edited_span"],
                    "self_replace": None,
                    "scores": {name: record["scores"].get(name) for name in SCORE_NAMES},
                    "editor": EDITOR_NAME,
                    "controlnet_seed": variant.seed,
                    "controlnet_scale": variant.conditioning_scale,
                    "condition": self.condition,
                }
                sample.update({name: edit.get(name) for name in TRACE_FIELDS})
                chosen_samples.append(sample)
        return chosen_samples, records


# ---------------------------------------------------------------------------------------------- the stage


class ControlNetEditStage(CounterfactualEditStage):
    """``controlnet_edit``: the kept caption edits regenerated with SD + ControlNet, gated and chosen like LANCE's.

    Returns ``{"counterfactuals": [...], "edit_candidates": [...]}`` like ``edit`` (``prompt_to_prompt_edit``); the
    length check, rendering, gates and candidate records are the inherited stage's. A record whose edits all fail
    the gates gets empty lists (not a failure).
    """

    editor_name = EDITOR_NAME
    options_class = ControlNetEditorOptions
    version = "1"
    model_options = (
        ModelOption("model", SD_COMPONENT_FILES, cache_dir="cache_dir", role="Stable Diffusion 1.x"),
        ModelOption("controlnet", DIFFUSERS_MODEL_FILES, revision="controlnet_revision", cache_dir="cache_dir",
                    role="ControlNet"),
        ModelOption("depth_model", revision="depth_revision", cache_dir="cache_dir", role="depth estimator"),
        clip_option(),
    )  # fmt: skip
    consumes = {"key": "str", "image": "image", "caption": "str", "seed": "int", "edits": "list"}
    produces = {"counterfactuals": "list", "edit_candidates": "list", "edit_cost": "dict"}
    outputs = (ReleaseOutput("counterfactual", "counterfactuals", "cf", many=True, fields=METADATA_FIELDS),)
    strength_field = None  # its candidates are no strength series (ControlNetEditorOptions.not_a_strength_series)

    def _selector(self) -> ControlNetSelector:
        o = self.options
        return ControlNetSelector(self.scorer, o.gate_thresholds(), o.keep_per_edit, o.condition)

    def _split_by_length(self, edits: list[dict]) -> tuple[list[int], list[dict]]:
        """``long_captions: truncate``: every edit is rendered, a long one cut at the encoder's context by the
        pipeline (DILLEMA's behaviour); ``refuse``: the inherited check."""
        if self.options.long_captions == "truncate":
            return list(range(len(edits))), []
        return super()._split_by_length(edits)

    editing_section = "controlnet_editing"

    def _editing_description(self) -> dict[str, Any]:
        """The editor's record (scheduler, condition, candidates), the selection rule, the gates and the CLIP model."""
        return {**self._editor_and_gates(), "selection": self._selector().describe()}
