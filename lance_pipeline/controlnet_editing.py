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
   safetensors only, so ``hed`` (and ``depth``, whose annotator is not wired here) are refused with that reason.
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

import dataclasses
import hashlib
import logging
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lance_pipeline.stage import SCORE_NAMES, Record, SampleFailure

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
DTYPES = ("float32", "float16", "bfloat16")

# Conditions this editor can compute, and why the others are refused.
CONDITIONS = ("canny",)
REFUSED_CONDITIONS = {
    "hed": (
        "condition 'hed' needs the HED annotator network (lllyasviel/Annotators ControlNetHED.pth), a pickle "
        "checkpoint; this project loads safetensors only. Use condition 'canny' (no weights needed)"
    ),
    "depth": (
        "condition 'depth' needs a depth annotator (MiDaS/DPT), which this editor does not load yet. Use condition "
        "'canny' (no weights needed)"
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


def candidate_seed(sample_seed: int, image_index: int) -> int:
    """Seed of the initial noise of a sample's ``image_index``-th image: from (sample seed, index) only."""
    digest = hashlib.sha256(f"lance-cf:controlnet:{int(sample_seed)}:{int(image_index)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


# ---------------------------------------------------------------------------------------------- options


@dataclass
class ControlNetEditorOptions:
    """Every option of the ControlNet editor, with DILLEMA's settings as defaults.

    Attributes:
        model: Hub id of a Stable Diffusion 1.x checkpoint in diffusers layout, or a local directory.
        revision: Pinned Hub revision of ``model``.
        controlnet: Hub id or local directory of a ``ControlNetModel`` trained for ``model`` and ``condition``.
        controlnet_revision: Pinned Hub revision of ``controlnet``.
        condition: ``"canny"`` (``"hed"`` and ``"depth"`` are refused, see ``REFUSED_CONDITIONS``).
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
        clip_model, clip_pretrained, clip_revision, clip_batch_size: The CLIP scorer (``clip_gates.ClipScorer``).
        clip_directional_threshold, clip_image_threshold, clip_text_threshold, require_edited_closer: CLIP gates.
        cache_dir: Hugging Face cache directory (default: the hub's own).
    """

    model: str = DEFAULT_MODEL
    revision: str | None = DEFAULT_REVISION
    controlnet: str = DEFAULT_CONTROLNET
    controlnet_revision: str | None = DEFAULT_CONTROLNET_REVISION
    condition: str = "canny"
    canny_low_threshold: int = CANNY_LOW_THRESHOLD
    canny_high_threshold: int = CANNY_HIGH_THRESHOLD
    dtype: str = "float32"
    image_size: int = 512
    num_inference_steps: int = DILLEMA_STEPS
    guidance_scale: float = DILLEMA_GUIDANCE
    negative_prompt: str = DILLEMA_NEGATIVE_PROMPT
    images_per_edit: int = 1
    conditioning_scales: tuple[float, ...] = (1.0,)
    keep_per_edit: int = 1
    batch_size: int = 4
    clip_model: str = "ViT-L-14"
    clip_pretrained: str | None = "openai"
    clip_revision: str | None = None
    clip_batch_size: int = 32
    clip_directional_threshold: float = 0.2
    clip_image_threshold: float = 0.7
    clip_text_threshold: float = 0.2
    require_edited_closer: bool = True
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("model", "controlnet"):
            value = os.fspath(getattr(self, name))
            setattr(self, name, value)
            if value.startswith(("/", ".", "~")) and not os.path.isdir(value):
                raise ValueError(f"{name} directory not found: {value!r} (expected a Hub id or a local directory)")
        if self.condition in REFUSED_CONDITIONS:
            raise ValueError(REFUSED_CONDITIONS[self.condition])
        if self.condition not in CONDITIONS:
            known = ", ".join((*CONDITIONS, *REFUSED_CONDITIONS))
            raise ValueError(f"condition {self.condition!r} is unknown (known: {known})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("image_size", "num_inference_steps", "images_per_edit", "keep_per_edit", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("canny_low_threshold", "canny_high_threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 255 * 8:
                raise ValueError(f"{name} must be an int gradient threshold >= 0, got {value!r}")
        if self.canny_low_threshold > self.canny_high_threshold:
            raise ValueError(
                f"canny_low_threshold ({self.canny_low_threshold}) must not exceed canny_high_threshold "
                f"({self.canny_high_threshold})"
            )
        scales = self.conditioning_scales
        if isinstance(scales, (int, float)) and not isinstance(scales, bool):
            scales = (scales,)
        self.conditioning_scales = tuple(float(s) for s in scales)
        if not self.conditioning_scales or any(not 0.0 <= s <= 4.0 for s in self.conditioning_scales):
            raise ValueError(f"conditioning_scales must be 1+ values in [0, 4], got {self.conditioning_scales!r}")
        if len(set(self.conditioning_scales)) != len(self.conditioning_scales):
            raise ValueError(f"conditioning_scales has duplicates: {self.conditioning_scales!r}")
        if self.guidance_scale < 1.0:
            raise ValueError(f"guidance_scale must be >= 1, got {self.guidance_scale!r}")
        if not isinstance(self.negative_prompt, str):
            raise ValueError(f"negative_prompt must be a string ('' for none), got {self.negative_prompt!r}")

    @property
    def candidates_per_edit(self) -> int:
        return self.images_per_edit * len(self.conditioning_scales)

    def gate_thresholds(self):
        from lance_pipeline.clip_gates import ClipGateThresholds

        return ClipGateThresholds(
            directional=self.clip_directional_threshold,
            image=self.clip_image_threshold,
            text=self.clip_text_threshold,
            require_edited_closer=self.require_edited_closer,
        )

    def condition_image(self, image):
        """The condition image of a source image (the options' condition at the options' thresholds)."""
        return canny_condition(image, self.canny_low_threshold, self.canny_high_threshold)


# ---------------------------------------------------------------------------------------------- the editor


@dataclass
class ControlNetCandidate:
    """One rendered candidate: which edit, which seed and conditioning scale, and the image."""

    request_index: int
    image_index: int
    seed: int
    conditioning_scale: float
    image: Any


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

    Args:
        components: Loaded Stable Diffusion components (``image_editing.StableDiffusionComponents``); never modified.
        controlnet: A loaded ``ControlNetModel`` for the components' UNet.
        options: The editor options.
    """

    def __init__(self, components, controlnet, options: ControlNetEditorOptions, scheduler_config=None) -> None:
        from diffusers import StableDiffusionControlNetPipeline, UniPCMultistepScheduler

        self.components = components
        self.controlnet = controlnet
        self.options = options
        # The pipeline itself requires multiples of 8; the latents must also survive the UNet's downsampling.
        multiple = math.lcm(8, components.latent_multiple)
        if options.image_size % multiple:
            raise ValueError(f"image_size must be a multiple of {multiple} for {components.model}, got {options.image_size}")
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

    def render(self, condition, prompts: list[str], seeds: list[int], conditioning_scale: float) -> list:
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

    def candidates(self, image, prompts: list[str], sample_seed: int) -> tuple[Any, list[ControlNetCandidate]]:
        """The condition of ``image`` and every candidate of every prompt, in (prompt, seed, scale) order."""
        o = self.options
        condition = o.condition_image(image.convert("RGB").resize((o.image_size, o.image_size)))
        jobs = [
            (request, image_index, scale)
            for request in range(len(prompts))
            for image_index in range(o.images_per_edit)
            for scale in o.conditioning_scales
        ]
        rendered: dict[tuple[int, int, float], Any] = {}
        for scale in o.conditioning_scales:
            chunk_jobs = [job for job in jobs if job[2] == scale]
            for start in range(0, len(chunk_jobs), o.batch_size):
                chunk = chunk_jobs[start : start + o.batch_size]
                images = self.render(
                    condition,
                    [prompts[r] for r, _, _ in chunk],
                    [candidate_seed(sample_seed, i) for _, i, _ in chunk],
                    scale,
                )
                rendered.update(zip(chunk, images, strict=True))
        return condition, [
            ControlNetCandidate(r, i, candidate_seed(sample_seed, i), s, rendered[(r, i, s)]) for r, i, s in jobs
        ]


# ---------------------------------------------------------------------------------------------- selection


def _span(edit: dict, key: str) -> str:
    value = edit.get(key)
    return value if isinstance(value, str) else ""


# Fields of a caption edit that are copied onto its counterfactual sample (the DILLEMA trace; absent for LANCE).
TRACE_FIELDS = ("llm_keywords", "llm_alternatives", "llm_applied_alternatives")


def select_controlnet_candidates(
    edits: list[dict],
    candidates: list[ControlNetCandidate],
    clip_scores: list[dict],
    thresholds,
    keep_per_edit: int = 1,
) -> tuple[list[dict], list[dict]]:
    """The CLIP gates and the choice of LANCE, over ControlNet candidates (a seed and a conditioning scale each).

    Per edit, the passing candidates are ranked by CLIP directional similarity (ties keep the earlier candidate) and
    the best ``keep_per_edit`` become counterfactual samples.

    Returns:
        ``(chosen samples with their image, every candidate's record without image)``.
    """
    from lance_pipeline.clip_gates import gate_failures

    records = []
    for candidate, scores in zip(candidates, clip_scores, strict=True):
        edit = edits[candidate.request_index]
        failures = gate_failures(scores, thresholds)
        label_scores = edit.get("scores") or {}
        merged = {**{k: label_scores.get(k) for k in ("label_similarity", "span_similarity")}, **scores}
        records.append(
            {
                "edit_index": candidate.request_index,
                "edit_type": edit.get("edit_type"),
                "edited_caption": edit["edited_caption"],
                "original_span": _span(edit, "original_span"),
                "edited_span": _span(edit, "edited_span"),
                "editor": EDITOR_NAME,
                "seed": candidate.seed,
                "conditioning_scale": candidate.conditioning_scale,
                "scores": merged,
                "passed": not failures,
                "chosen": False,
                "reject_reason": "; ".join(failures) if failures else None,
            }
        )
    chosen_samples = []
    for edit_index, edit in enumerate(edits):
        passing = [k for k, r in enumerate(records) if r["edit_index"] == edit_index and r["passed"]]
        # Stable sort: a tie keeps the earlier candidate, so the choice is deterministic.
        ranked = sorted(passing, key=lambda k: -records[k]["scores"]["clip_directional"])
        kept = ranked[:keep_per_edit]
        for k in kept:
            records[k]["chosen"] = True
        for k in ranked[keep_per_edit:]:
            records[k]["reject_reason"] = (
                f"not selected: clip_directional={records[k]['scores']['clip_directional']:.6f} below the "
                f"{keep_per_edit} best of this edit"
            )
        for k in kept:
            best = records[k]
            sample = {
                "image": candidates[k].image,
                "edit_type": best["edit_type"],
                "edited_caption": best["edited_caption"],
                "original_span": best["original_span"],
                "edited_span": best["edited_span"],
                "self_replace": None,
                "scores": {name: best["scores"].get(name) for name in SCORE_NAMES},
                "editor": EDITOR_NAME,
                "controlnet_seed": best["seed"],
                "controlnet_scale": best["conditioning_scale"],
            }
            sample.update({name: edit.get(name) for name in TRACE_FIELDS})
            chosen_samples.append(sample)
    return chosen_samples, records


# ---------------------------------------------------------------------------------------------- the stage


class ControlNetEditStage:
    """``controlnet_edit``: the kept caption edits regenerated with SD + ControlNet, gated and chosen like LANCE's.

    Returns ``{"counterfactuals": [...], "edit_candidates": [...]}``. A record whose edits all fail the gates gets
    empty lists (not a failure): the rejected candidates with their reasons are the record's data.
    """

    name = "edit"
    edits_field = "edits"
    output_field = "counterfactuals"
    candidates_field = "edit_candidates"

    def __init__(self, scorer=None, **options: Any) -> None:
        try:
            self.options = ControlNetEditorOptions(**options)
        except TypeError as err:
            known = ", ".join(f.name for f in dataclasses.fields(ControlNetEditorOptions))
            raise ValueError(f"{type(self).__name__}: {err}; known options: {known}") from err
        self.scorer = scorer
        self.editor: ControlNetEditor | None = None

    def load(self, device: str) -> None:
        from lance_pipeline.image_editing import load_stable_diffusion_components

        o = self.options
        components = load_stable_diffusion_components(o.model, o.revision, o.dtype, device, o.cache_dir)
        controlnet = load_controlnet(o.controlnet, o.controlnet_revision, o.dtype, device, o.cache_dir)
        self.editor = ControlNetEditor(components, controlnet, o, load_scheduler_config(o.model, o.revision, o.cache_dir))
        if self.scorer is None:
            from lance_pipeline.clip_gates import ClipScorer

            self.scorer = ClipScorer(
                model=o.clip_model,
                pretrained=o.clip_pretrained,
                revision=o.clip_revision,
                batch_size=o.clip_batch_size,
                cache_dir=o.cache_dir,
            )
        self.scorer.load(device)

    def _require_editor(self) -> ControlNetEditor:
        if self.editor is None:
            raise RuntimeError(f"{type(self).__name__}.load(device) must be called before process()")
        return self.editor

    def describe(self) -> dict[str, Any]:
        """Editor, models, revisions, scheduler, condition, candidates and gates for the manifest."""
        o = self.options
        local_model, local_controlnet = os.path.isdir(o.model), os.path.isdir(o.controlnet)
        description: dict[str, Any] = {
            "name": self.name,
            "editor": EDITOR_NAME,
            "model": Path(o.model).name if local_model else o.model,
            "revision": None if local_model else o.revision,
            "controlnet": Path(o.controlnet).name if local_controlnet else o.controlnet,
            "controlnet_revision": None if local_controlnet else o.controlnet_revision,
            "dtype": o.dtype,
            "image_size": o.image_size,
            "num_inference_steps": o.num_inference_steps,
            "guidance_scale": o.guidance_scale,
            "negative_prompt": o.negative_prompt,
            "condition": {
                "name": o.condition,
                "implementation": "cv2.Canny on the RGB image, edges repeated into 3 channels",
                "low_threshold": o.canny_low_threshold,
                "high_threshold": o.canny_high_threshold,
            },
            "candidates": {
                "images_per_edit": o.images_per_edit,
                "conditioning_scales": list(o.conditioning_scales),
                "seed": "sha256(sample seed, image index); CPU generator",
                "keep_per_edit": o.keep_per_edit,
                "batch_size": o.batch_size,
            },
            "selection": "max clip_directional among gate-passing candidates (against the source image)",
            "gates": dataclasses.asdict(o.gate_thresholds()),
            "clip": self.scorer.describe() if self.scorer is not None and hasattr(self.scorer, "describe") else None,
        }
        if self.editor is not None:
            config = self.editor.scheduler.config
            description["scheduler"] = {
                "class": type(self.editor.scheduler).__name__,
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
                    )
                },
            }
            description["vae_scaling_factor"] = self.editor.components.vae.config.scaling_factor
            import diffusers

            description["diffusers"] = diffusers.__version__
        return description

    def _edits(self, record: Record) -> list[dict]:
        return [e for e in record.get(self.edits_field) or [] if e.get("kept")]

    def _refuse_too_long(self, edits: list[dict]) -> tuple[list[int], list[dict]]:
        """Positions of the edits whose caption fits the text encoder, and rejection records for the others."""
        tokenizer = self._require_editor().components.tokenizer
        limit = tokenizer.model_max_length
        positions, rejected = [], []
        for index, edit in enumerate(edits):
            length = len(tokenizer(edit["edited_caption"]).input_ids)
            if length <= limit:
                positions.append(index)
                continue
            label_scores = edit.get("scores") or {}
            rejected.append(
                {
                    "edit_index": index,
                    "edit_type": edit.get("edit_type"),
                    "edited_caption": edit["edited_caption"],
                    "original_span": _span(edit, "original_span"),
                    "edited_span": _span(edit, "edited_span"),
                    "editor": EDITOR_NAME,
                    "seed": None,
                    "conditioning_scale": None,
                    "scores": {k: label_scores.get(k) for k in ("label_similarity", "span_similarity")},
                    "passed": False,
                    "chosen": False,
                    "reject_reason": f"edited caption is {length} tokens, more than the text encoder's {limit}: "
                    "the edit would not reach the image",
                }
            )
        return positions, rejected

    def process(self, records: list[Record]) -> list[Record | SampleFailure]:
        editor = self._require_editor()
        thresholds = self.options.gate_thresholds()
        out: list[Record | SampleFailure] = []
        for record in records:
            caption = record.get("caption")
            if not isinstance(caption, str) or not caption.strip():
                out.append(SampleFailure(f"{self.name}: record has no caption (the caption stage must run first)"))
                continue
            edits = self._edits(record)
            for index, edit in enumerate(edits):
                if not isinstance(edit.get("edited_caption"), str) or not edit["edited_caption"].strip():
                    raise ValueError(f"{self.edits_field}[{index}] of {record.get('key')!r} has no edited_caption")
            positions, too_long = self._refuse_too_long(edits)
            if not positions:
                out.append({self.output_field: [], self.candidates_field: too_long})
                continue
            in_context = [edits[i] for i in positions]
            _, candidates = editor.candidates(
                record["image"], [e["edited_caption"] for e in in_context], int(record["seed"])
            )
            n = len(candidates)
            clip_scores = self.scorer.edit_scores(
                [record["image"]] * n,
                [c.image for c in candidates],
                [caption] * n,
                [in_context[c.request_index]["edited_caption"] for c in candidates],
            )
            chosen, candidate_records = select_controlnet_candidates(
                in_context, candidates, clip_scores, thresholds, self.options.keep_per_edit
            )
            for candidate in candidate_records:  # index into the record's edits, not the in-context subset
                candidate["edit_index"] = positions[candidate["edit_index"]]
            candidate_records = sorted(candidate_records + too_long, key=lambda c: c["edit_index"])
            for sample in chosen:
                sample["condition"] = self.options.condition
            logger.debug("%s %s: %d counterfactuals from %d edits", self.name, record.get("key"), len(chosen), len(edits))
            out.append({self.output_field: chosen, self.candidates_field: candidate_records})
        return out


@dataclass
class BenchResult:
    """What :func:`bench_controlnet_edit` measured for one record."""

    edits: int
    candidates: int
    counts: ForwardCounts = field(default_factory=ForwardCounts)
    seconds: float = 0.0


def bench_controlnet_edit(stage: ControlNetEditStage, record: Record) -> BenchResult:
    """Run the loaded stage on one record and report UNet/ControlNet sample-forwards and wall seconds.

    For ``benchmarks/bench_edit.py``: the counts are machine-independent; the seconds are this machine's.
    """
    import time

    editor = stage._require_editor()
    editor.counts = ForwardCounts()
    start = time.perf_counter()
    result = stage.process([record])[0]
    seconds = time.perf_counter() - start
    if isinstance(result, SampleFailure):
        raise ValueError(f"bench record {record.get('key')!r} failed: {result.reason}")
    edits = len(stage._edits(record))
    return BenchResult(edits, len(result[stage.candidates_field]), editor.counts, seconds)
