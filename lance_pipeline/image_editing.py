"""LANCE image stages: null-text inversion, reconstruction, prompt-to-prompt counterfactual edits, LANCE-R edits.

Prabhu, Yenamandra, Chattopadhyay, Hoffman, "LANCE: Stress-testing Visual Models by Generating Language-guided
Counterfactual Images", NeurIPS 2023 (arXiv 2305.19164), section 3.2 and Algorithm 1. The source image is inverted
once with null-text inversion (Mokady et al., CVPR 2023; ``inversion.py``); every edited caption is then rendered
from the inverted latent with prompt-to-prompt attention control (Hertz et al., ICLR 2023;
``attention_control.py``) for each self-attention injection fraction ``f`` of the sweep {0.4, ..., 0.9}; CLIP gates
(``clip_gates.py``) reject bad candidates, and among the candidates that pass, the one with the highest CLIP
directional similarity (paper eq. 2) is kept, with its ``f`` recorded as ``self_replace``.

Stages (``lance_pipeline.stage.Stage``):

* ``InversionStage`` (``invert``): ``{"inversion": {"latent", "null_embeddings", "caption", "inner_steps"}}``.
* ``ReconstructionStage`` (``reconstruct``): ``{"reconstruction": PIL image}``, the inversion regenerated with its
  own caption.
* ``CounterfactualEditStage`` (``edit``): ``{"counterfactuals": [...], "edit_candidates": [...]}``.
* ``LanceREditStage`` (``lance_r_edit``): ``{"lance_r": [...], "lance_r_candidates": [...]}``.

All stages of one build share one set of loaded Stable Diffusion components (a process-wide cache keyed by model,
revision, dtype and device). The components are never modified: attention processors are swapped only for the
duration of a sampling run and restored afterwards, schedulers are fresh copies made from the checkpoint's config,
and no gradient ever lands on a model parameter.

The image stages draw no random numbers: VAE encoding takes the posterior mean, and DDIM sampling with eta = 0 is
deterministic given the inverted latent. ``record["seed"]`` is therefore not needed; the same inputs give the same
images.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lance_pipeline.stage import SCORE_NAMES, Record, SampleFailure

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "CompVis/stable-diffusion-v1-4"
# The commit of CompVis/stable-diffusion-v1-4 that holds the safetensors weights (main as of 2023-2025).
DEFAULT_REVISION = "133a221b8aa7292a167afc5127cb63fb5005638b"
# LANCE's paper sweep (section 3.2); the authors' code sweeps only up to 0.8.
DEFAULT_SELF_REPLACE_SWEEP = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
# The DDIM settings of the prompt-to-prompt/null-text code that LANCE uses; betas come from the checkpoint.
DDIM_OVERRIDES = {"clip_sample": False, "set_alpha_to_one": False}
DTYPES = ("float32", "float16", "bfloat16")
SCORE_FIELDS = SCORE_NAMES  # the release's per-sample scores (lance_pipeline.stage)


@dataclass
class ImageEditorOptions:
    """Every option of the image stages, with the paper's / authors' defaults (sources in docs/method.md).

    Attributes:
        model: Hub id of a Stable Diffusion 1.x/2.x checkpoint in diffusers layout, or a local directory.
        revision: Pinned Hub revision (ignored for a local directory).
        dtype: Weights and compute dtype. float32 as the authors (null-text optimisation needs it).
        image_size: Square size in pixels the image is resized to before encoding (512).
        num_inference_steps: DDIM steps (50).
        guidance_scale: Classifier-free guidance (7.5).
        num_inner_steps: Null-text Adam iterations per step (10).
        early_stop_epsilon: Null-text early-stop base threshold (1e-5).
        cross_replace: Fraction of the steps with cross-attention injection (0.8).
        self_replace_sweep: The self-attention injection fractions swept per edit.
        edit_word_weight: Reweighting factor of the edited tokens' cross-attention (2.0).
        attention_edit: ``"auto"`` (replace for equal-length token swaps, refine otherwise) or ``"refine"``
            (always refine, as the authors' code).
        self_replace_max_tokens: Self-attention is injected only in layers with at most this many query tokens.
        edit_batch_size: Target prompts (edit x sweep value) per sampling run, besides the shared source prompt.
        clip_model, clip_pretrained, clip_revision, clip_batch_size: The CLIP scorer (``clip_gates.ClipScorer``).
        clip_directional_threshold, clip_image_threshold, clip_text_threshold, require_edited_closer: CLIP gates.
        lance_r_word_check: Apply the LANCE-R word check in ``lance_r_edit`` (off only for noise-image demos).
        cache_dir: Hugging Face cache directory (default: the hub's own).
    """

    model: str = DEFAULT_MODEL
    revision: str | None = DEFAULT_REVISION
    dtype: str = "float32"
    image_size: int = 512
    num_inference_steps: int = 50
    guidance_scale: float = 7.5
    num_inner_steps: int = 10
    early_stop_epsilon: float = 1e-5
    cross_replace: float = 0.8
    self_replace_sweep: tuple[float, ...] = DEFAULT_SELF_REPLACE_SWEEP
    edit_word_weight: float = 2.0
    attention_edit: str = "auto"
    self_replace_max_tokens: int = 32**2
    edit_batch_size: int = 6
    clip_model: str = "ViT-L-14"
    clip_pretrained: str | None = "openai"
    clip_revision: str | None = None
    clip_batch_size: int = 32
    clip_directional_threshold: float = 0.2
    clip_image_threshold: float = 0.7
    clip_text_threshold: float = 0.2
    require_edited_closer: bool = True
    lance_r_word_check: bool = True
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        self.model = os.fspath(self.model)
        if self.model.startswith(("/", ".", "~")) and not os.path.isdir(self.model):
            raise ValueError(f"model directory not found: {self.model!r} (expected a Hub id or a local directory)")
        self.self_replace_sweep = tuple(float(f) for f in self.self_replace_sweep)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in (
            "image_size",
            "num_inference_steps",
            "edit_batch_size",
            "clip_batch_size",
            "self_replace_max_tokens",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if (
            isinstance(self.num_inner_steps, bool)
            or not isinstance(self.num_inner_steps, int)
            or self.num_inner_steps < 0
        ):
            raise ValueError(f"num_inner_steps must be an int >= 0, got {self.num_inner_steps!r}")
        if not self.self_replace_sweep:
            raise ValueError("self_replace_sweep must hold at least one fraction")
        for name, values in (("cross_replace", (self.cross_replace,)), ("self_replace_sweep", self.self_replace_sweep)):
            if any(not 0.0 <= v <= 1.0 for v in values):
                raise ValueError(f"{name} must be fraction(s) of the steps in [0, 1], got {getattr(self, name)!r}")
        if len(set(self.self_replace_sweep)) != len(self.self_replace_sweep):
            raise ValueError(f"self_replace_sweep has duplicates: {self.self_replace_sweep!r}")
        if self.attention_edit not in ("auto", "refine"):
            raise ValueError(f"attention_edit must be 'auto' or 'refine', got {self.attention_edit!r}")
        if self.guidance_scale < 1.0:
            raise ValueError(f"guidance_scale must be >= 1, got {self.guidance_scale!r}")

    @property
    def is_local(self) -> bool:
        return os.path.isdir(self.model)

    def gate_thresholds(self):
        from lance_pipeline.clip_gates import ClipGateThresholds

        return ClipGateThresholds(
            directional=self.clip_directional_threshold,
            image=self.clip_image_threshold,
            text=self.clip_text_threshold,
            require_edited_closer=self.require_edited_closer,
        )


def _steps(fraction: float, num_steps: int) -> int:
    """Number of steps a fraction covers (``round``, so 0.7 * 50 is 35 despite float error)."""
    return int(math.floor(fraction * num_steps + 0.5))


# ---------------------------------------------------------------------------------------------- components


@dataclass
class StableDiffusionComponents:
    """Loaded Stable Diffusion components (shared, never modified)."""

    unet: Any
    vae: Any
    text_encoder: Any
    tokenizer: Any
    scheduler_config: dict
    model: str
    revision: str | None

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def latent_multiple(self) -> int:
        """Image sizes must be multiples of this (VAE downsampling times UNet downsampling)."""
        return self.vae_scale_factor * 2 ** (len(self.unet.config.block_out_channels) - 1)


_COMPONENT_CACHE: dict[tuple, StableDiffusionComponents] = {}


def load_stable_diffusion_components(
    model: str = DEFAULT_MODEL,
    revision: str | None = DEFAULT_REVISION,
    dtype: str = "float32",
    device: str = "cpu",
    cache_dir: str | None = None,
) -> StableDiffusionComponents:
    """Load UNet, VAE, CLIP text encoder, tokenizer and the DDIM scheduler config of a diffusers checkpoint.

    The same code loads a Hub id at a pinned revision and a local directory (e.g. the tiny components of
    ``tiny_image_components``). Weights are safetensors only. The scheduler is DDIM with the checkpoint's betas
    and the prompt-to-prompt settings ``clip_sample=False, set_alpha_to_one=False``. The models are frozen
    (``requires_grad_(False)``, eval mode). Results are cached per (model, revision, dtype, device).

    Args:
        model: Hub id or local directory.
        revision: Hub revision (ignored for a local directory).
        dtype: One of ``DTYPES``.
        device: Torch device string.
        cache_dir: Hugging Face cache directory.

    Returns:
        The components.
    """
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    local = os.path.isdir(model)
    revision = None if local else revision
    key = (os.path.abspath(model) if local else model, revision, dtype, str(device))
    if key in _COMPONENT_CACHE:
        return _COMPONENT_CACHE[key]
    torch_dtype = getattr(torch, dtype)
    common = {"revision": revision, "cache_dir": cache_dir}
    unet = UNet2DConditionModel.from_pretrained(
        model, subfolder="unet", torch_dtype=torch_dtype, use_safetensors=True, **common
    )
    vae = AutoencoderKL.from_pretrained(model, subfolder="vae", torch_dtype=torch_dtype, use_safetensors=True, **common)
    text_encoder = CLIPTextModel.from_pretrained(
        model, subfolder="text_encoder", dtype=torch_dtype, use_safetensors=True, **common
    )
    tokenizer = CLIPTokenizer.from_pretrained(model, subfolder="tokenizer", **common)
    scheduler = DDIMScheduler.from_pretrained(model, subfolder="scheduler", **common)
    scheduler_config = dict(DDIMScheduler.from_config(scheduler.config, **DDIM_OVERRIDES).config)
    for module in (unet, vae, text_encoder):
        module.requires_grad_(False).eval().to(device)
    components = StableDiffusionComponents(
        unet=unet,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler_config=scheduler_config,
        model=model,
        revision=revision,
    )
    _COMPONENT_CACHE[key] = components
    logger.info("loaded Stable Diffusion components %s@%s (%s) on %s", model, revision, dtype, device)
    return components


def clear_component_cache() -> None:
    """Forget every cached set of components (frees their memory once nothing else holds them)."""
    _COMPONENT_CACHE.clear()


# ---------------------------------------------------------------------------------------------- the editor


@dataclass
class EditRequest:
    """One edited caption to render, with the span whose tokens are reweighted."""

    edited_caption: str
    edited_span: str = ""


@dataclass
class Candidate:
    """One rendered sweep candidate."""

    request_index: int
    self_replace: float
    image: Any
    reweighted_tokens: int
    attention_edit: str


@dataclass
class SweepResult:
    """The source-branch reconstruction and every candidate of a sweep, in (request, sweep value) order."""

    reconstruction: Any
    candidates: list[Candidate] = field(default_factory=list)


class ImageEditor:
    """Null-text inversion and prompt-to-prompt editing with one set of Stable Diffusion components.

    Args:
        components: Loaded components.
        options: The options (steps, guidance, attention-control settings, batch size).
    """

    def __init__(self, components: StableDiffusionComponents, options: ImageEditorOptions) -> None:
        self.components = components
        self.options = options
        if options.image_size % components.latent_multiple:
            raise ValueError(
                f"image_size must be a multiple of {components.latent_multiple} for {components.model}, "
                f"got {options.image_size}"
            )

    @property
    def device(self):
        return self.components.unet.device

    @property
    def dtype(self):
        return self.components.unet.dtype

    def invert(self, image, caption: str) -> dict[str, Any]:
        """Null-text inversion; returns the ``inversion`` update (tensors on CPU, float32)."""
        from lance_pipeline.inversion import NullTextInversion

        c, o = self.components, self.options
        result = NullTextInversion(
            c.unet,
            c.vae,
            c.text_encoder,
            c.tokenizer,
            c.scheduler_config,
            num_inference_steps=o.num_inference_steps,
            guidance_scale=o.guidance_scale,
            num_inner_steps=o.num_inner_steps,
            early_stop_epsilon=o.early_stop_epsilon,
            image_size=o.image_size,
        ).invert(image, caption)
        return {
            "latent": result.latent.detach().float().cpu(),
            "null_embeddings": result.null_embeddings.detach().float().cpu(),
            "caption": caption,
            "inner_steps": list(result.inner_steps),
        }

    def check_inversion(self, inversion: Any, caption: str) -> str | None:
        """Why a stored inversion cannot be used with these options and caption (None if it can)."""
        if not isinstance(inversion, dict) or not {"latent", "null_embeddings", "caption"} <= set(inversion):
            return "record's 'inversion' lacks latent/null_embeddings/caption"
        steps = inversion["null_embeddings"].shape[0]
        if steps != self.options.num_inference_steps:
            return f"inversion has {steps} null embeddings, the editor runs {self.options.num_inference_steps} steps"
        size = self.options.image_size // self.components.vae_scale_factor
        if tuple(inversion["latent"].shape[-2:]) != (size, size):
            return f"inversion latent is {tuple(inversion['latent'].shape)}, expected spatial size {size}x{size}"
        if inversion["caption"] != caption:
            return f"inversion was made for caption {inversion['caption']!r}, the record's caption is {caption!r}"
        return None

    def _embed(self, prompts: list[str]):
        from lance_pipeline.inversion import encode_prompts

        return encode_prompts(self.components.tokenizer, self.components.text_encoder, prompts).to(self.dtype)

    def reconstruct(self, inversion: dict[str, Any]):
        """Regenerate the inverted image with its own caption (PIL image)."""
        from lance_pipeline.inversion import ddim_sample, decode_latents

        latents = ddim_sample(
            self.components.unet,
            self.components.scheduler_config,
            inversion["latent"].to(self.device, self.dtype),
            self._embed([inversion["caption"]]),
            inversion["null_embeddings"].to(self.device, self.dtype),
            self.options.guidance_scale,
        )
        return decode_latents(self.components.vae, latents)[0]

    def build_target(self, caption: str, request: EditRequest, self_replace: float):
        """The prompt-to-prompt schedule of one (edit, sweep value) target."""
        from lance_pipeline.attention_control import EditTarget, align_tokens, find_span_tokens, make_equalizer
        from lance_pipeline.inversion import prompt_token_ids

        tokenizer = self.components.tokenizer
        max_len = tokenizer.model_max_length
        source_ids = prompt_token_ids(tokenizer, caption)
        target_ids = prompt_token_ids(tokenizer, request.edited_caption)
        alignment = align_tokens(source_ids, target_ids, max_len)
        mode = "replace" if self.options.attention_edit == "auto" and alignment.equal_length else "refine"
        positions: list[int] = []
        if request.edited_span.strip():
            span_ids = tokenizer(request.edited_span, add_special_tokens=False).input_ids
            positions = find_span_tokens(span_ids, target_ids, alignment.new_tokens)
            if not positions:
                # The span is not a token run of the caption (e.g. cut by truncation): reweight the new tokens.
                positions = [j for j in alignment.new_tokens if 0 < j < len(target_ids) - 1]
                logger.debug("edited span %r not found in %r; reweighting new tokens", request.edited_span, target_ids)
        equalizer = make_equalizer(max_len, positions, self.options.edit_word_weight) if positions else None
        steps = self.options.num_inference_steps
        target = EditTarget(
            alignment=alignment,
            mode=mode,
            cross_replace_steps=_steps(self.options.cross_replace, steps),
            self_replace_steps=_steps(self_replace, steps),
            equalizer=equalizer,
        )
        return target, len(positions)

    def sweep(self, inversion: dict[str, Any], requests: list[EditRequest]) -> SweepResult:
        """Render every request at every sweep value; ``edit_batch_size`` targets share each sampling run.

        Every run puts the source caption first, so its output (identical in each run) is the reconstruction the
        gates compare against.
        """
        from lance_pipeline.attention_control import PromptToPromptController
        from lance_pipeline.inversion import ddim_sample, decode_latents

        o = self.options
        caption = inversion["caption"]
        jobs = [(index, f) for index in range(len(requests)) for f in o.self_replace_sweep]
        latent = inversion["latent"].to(self.device, self.dtype)
        nulls = inversion["null_embeddings"].to(self.device, self.dtype)
        result = SweepResult(reconstruction=None)
        for start in range(0, len(jobs), o.edit_batch_size):
            chunk = jobs[start : start + o.edit_batch_size]
            built = [self.build_target(caption, requests[i], f) for i, f in chunk]
            controller = PromptToPromptController(
                [target for target, _ in built], self_replace_max_tokens=o.self_replace_max_tokens
            )
            cond = self._embed([caption] + [requests[i].edited_caption for i, _ in chunk])
            latents = ddim_sample(
                self.components.unet,
                self.components.scheduler_config,
                latent,
                cond,
                nulls,
                o.guidance_scale,
                controller=controller,
            )
            images = decode_latents(self.components.vae, latents)
            if result.reconstruction is None:
                result.reconstruction = images[0]
            for (index, f), image, (target, reweighted) in zip(chunk, images[1:], built, strict=True):
                result.candidates.append(Candidate(index, f, image, reweighted, target.mode))
        return result


# ---------------------------------------------------------------------------------------------- selection


def _span(edit: dict, key: str) -> str:
    value = edit.get(key)
    return value if isinstance(value, str) else ""


def select_candidates(
    edits: list[dict],
    sweep: SweepResult,
    clip_scores: list[dict],
    extra_failures: list[list[str]],
    thresholds,
    edit_type_default: str | None = None,
) -> tuple[list[dict], list[dict]]:
    """Apply the gates and keep, per edit, the passing candidate with the highest CLIP directional similarity.

    Args:
        edits: The edit dicts (edited_caption, original_span, edited_span, edit_type, optional scores).
        sweep: The rendered candidates, in (edit, sweep value) order.
        clip_scores: One ``ClipScorer.edit_scores`` dict per candidate (may hold extra keys, e.g. word check).
        extra_failures: Per candidate, reasons besides the CLIP gates (e.g. the LANCE-R word check).
        thresholds: ``ClipGateThresholds``.
        edit_type_default: ``edit_type`` for edits that carry none.

    Returns:
        ``(chosen samples with their image, every candidate's record without image)``.
    """
    from lance_pipeline.clip_gates import gate_failures

    records = []
    for candidate, scores, extra in zip(sweep.candidates, clip_scores, extra_failures, strict=True):
        edit = edits[candidate.request_index]
        label_scores = edit.get("scores") or {}
        merged = {
            "label_similarity": label_scores.get("label_similarity"),
            "span_similarity": label_scores.get("span_similarity"),
            **scores,
        }
        failures = gate_failures(scores, thresholds) + list(extra)
        records.append(
            {
                "edit_index": candidate.request_index,
                "edit_type": edit.get("edit_type", edit_type_default),
                "edited_caption": edit["edited_caption"],
                "original_span": _span(edit, "original_span"),
                "edited_span": _span(edit, "edited_span"),
                "self_replace": candidate.self_replace,
                "attention_edit": candidate.attention_edit,
                "reweighted_tokens": candidate.reweighted_tokens,
                "scores": merged,
                "passed": not failures,
                "chosen": False,
                "reject_reason": "; ".join(failures) if failures else None,
            }
        )
    chosen_samples = []
    for edit_index in range(len(edits)):
        rows = [(k, r) for k, r in enumerate(records) if r["edit_index"] == edit_index]
        passing = [(k, r) for k, r in rows if r["passed"]]
        if not passing:
            continue
        # Strictly greater: a tie keeps the candidate earlier in the sweep, so the choice is deterministic.
        best_k, best = passing[0]
        for k, r in passing[1:]:
            if r["scores"]["clip_directional"] > best["scores"]["clip_directional"]:
                best_k, best = k, r
        best["chosen"] = True
        for _, r in passing:
            if not r["chosen"]:
                r["reject_reason"] = (
                    f"not selected: clip_directional={r['scores']['clip_directional']:.6f} below "
                    f"{best['scores']['clip_directional']:.6f} of self_replace={best['self_replace']}"
                )
        chosen_samples.append(
            {
                "image": sweep.candidates[best_k].image,
                "edit_type": best["edit_type"],
                "edited_caption": best["edited_caption"],
                "original_span": best["original_span"],
                "edited_span": best["edited_span"],
                "self_replace": best["self_replace"],
                "scores": {name: best["scores"].get(name) for name in SCORE_FIELDS},
            }
        )
    return chosen_samples, records


# ---------------------------------------------------------------------------------------------- stages


class _ImageStage:
    """Shared construction, loading and description of the image stages."""

    name = "image"
    uses_clip = False

    def __init__(self, scorer=None, **options: Any) -> None:
        try:
            self.options = ImageEditorOptions(**options)
        except TypeError as err:
            known = ", ".join(f.name for f in dataclasses.fields(ImageEditorOptions))
            raise ValueError(f"{type(self).__name__}: {err}; known options: {known}") from err
        self.scorer = scorer
        self.editor: ImageEditor | None = None

    def load(self, device: str) -> None:
        components = load_stable_diffusion_components(
            self.options.model, self.options.revision, self.options.dtype, device, self.options.cache_dir
        )
        self.editor = ImageEditor(components, self.options)
        if self.uses_clip:
            if self.scorer is None:
                from lance_pipeline.clip_gates import ClipScorer

                self.scorer = ClipScorer(
                    model=self.options.clip_model,
                    pretrained=self.options.clip_pretrained,
                    revision=self.options.clip_revision,
                    batch_size=self.options.clip_batch_size,
                    cache_dir=self.options.cache_dir,
                )
            self.scorer.load(device)

    def _require_editor(self) -> ImageEditor:
        if self.editor is None:
            raise RuntimeError(f"{type(self).__name__}.load(device) must be called before process()")
        return self.editor

    def describe(self) -> dict[str, Any]:
        o = self.options
        description: dict[str, Any] = {
            "name": self.name,
            "model": Path(o.model).name if o.is_local else o.model,
            "revision": None if o.is_local else o.revision,
            "dtype": o.dtype,
            "image_size": o.image_size,
            "num_inference_steps": o.num_inference_steps,
            "guidance_scale": o.guidance_scale,
            "null_text": {"num_inner_steps": o.num_inner_steps, "early_stop_epsilon": o.early_stop_epsilon},
        }
        if self.editor is not None:
            config = self.editor.components.scheduler_config
            description["scheduler"] = {
                "class": "DDIMScheduler",
                **{
                    k: config.get(k)
                    for k in (
                        "beta_start",
                        "beta_end",
                        "beta_schedule",
                        "num_train_timesteps",
                        "steps_offset",
                        "clip_sample",
                        "set_alpha_to_one",
                        "prediction_type",
                    )
                },
            }
            description["vae_scaling_factor"] = self.editor.components.vae.config.scaling_factor
        return description

    def _prompt_to_prompt_description(self) -> dict[str, Any]:
        o = self.options
        return {
            "cross_replace": o.cross_replace,
            "self_replace_sweep": list(o.self_replace_sweep),
            "edit_word_weight": o.edit_word_weight,
            "attention_edit": o.attention_edit,
            "self_replace_max_tokens": o.self_replace_max_tokens,
            "edit_batch_size": o.edit_batch_size,
            "selection": "max clip_directional among gate-passing candidates",
            "gates": dataclasses.asdict(o.gate_thresholds()),
            "clip": self.scorer.describe() if self.scorer is not None and hasattr(self.scorer, "describe") else None,
        }


class InversionStage(_ImageStage):
    """``invert``: null-text inversion of ``record["image"]`` with ``record["caption"]``."""

    name = "invert"

    def process(self, records: list[Record]) -> list[Record | SampleFailure]:
        import torch

        editor = self._require_editor()
        out: list[Record | SampleFailure] = []
        for record in records:
            caption = record.get("caption")
            if not isinstance(caption, str) or not caption.strip():
                out.append(SampleFailure("invert: record has no caption (the caption stage must run first)"))
                continue
            inversion = editor.invert(record["image"], caption)
            if not (torch.isfinite(inversion["latent"]).all() and torch.isfinite(inversion["null_embeddings"]).all()):
                out.append(SampleFailure("invert: null-text inversion diverged (non-finite latent or embeddings)"))
                continue
            out.append({"inversion": inversion})
        return out


class ReconstructionStage(_ImageStage):
    """``reconstruct``: the inverted image regenerated with its own caption (config ``reconstructed``)."""

    name = "reconstruct"

    def process(self, records: list[Record]) -> list[Record | SampleFailure]:
        editor = self._require_editor()
        out: list[Record | SampleFailure] = []
        for record in records:
            problem = editor.check_inversion(record.get("inversion"), record.get("caption"))
            if problem:
                out.append(SampleFailure(f"reconstruct: {problem}"))
                continue
            out.append({"reconstruction": editor.reconstruct(record["inversion"])})
        return out


class CounterfactualEditStage(_ImageStage):
    """``edit``: prompt-to-prompt counterfactuals for the kept caption edits, swept over ``self_replace``.

    Returns ``{"counterfactuals": [...], "edit_candidates": [...]}``. A record whose edits all fail the gates gets
    empty lists (not a failure): the rejected candidates with their reasons are the record's data.
    """

    name = "edit"
    uses_clip = True
    edits_field = "edits"
    output_field = "counterfactuals"
    candidates_field = "edit_candidates"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "prompt_to_prompt": self._prompt_to_prompt_description()}

    def _edits(self, record: Record) -> list[dict]:
        return [e for e in record.get(self.edits_field) or [] if e.get("kept")]

    def _extra_checks(self, edits: list[dict], sweep: SweepResult) -> tuple[list[dict], list[list[str]]]:
        return [{} for _ in sweep.candidates], [[] for _ in sweep.candidates]

    def _split_by_length(self, edits: list[dict]) -> tuple[list[int], list[dict]]:
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
                    "self_replace": None,
                    "attention_edit": None,
                    "reweighted_tokens": None,
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
            problem = editor.check_inversion(record.get("inversion"), caption)
            if problem:
                out.append(SampleFailure(f"{self.name}: {problem}"))
                continue
            edits = self._edits(record)
            for index, edit in enumerate(edits):
                if not isinstance(edit.get("edited_caption"), str) or not edit["edited_caption"].strip():
                    raise ValueError(f"{self.edits_field}[{index}] of {record.get('key')!r} has no edited_caption")
            # An edit the text encoder cannot read in full would be rendered for nothing: its change lies past the
            # encoder's context (77 tokens for CLIP), so it is refused up front, with that reason.
            positions, too_long = self._split_by_length(edits)
            if not positions:
                out.append({self.output_field: [], self.candidates_field: too_long})
                continue
            edits_in_context = [edits[i] for i in positions]
            requests = [EditRequest(e["edited_caption"], _span(e, "edited_span")) for e in edits_in_context]
            sweep = editor.sweep(record["inversion"], requests)
            n = len(sweep.candidates)
            clip_scores = self.scorer.edit_scores(
                [sweep.reconstruction] * n,
                [c.image for c in sweep.candidates],
                [caption] * n,
                [requests[c.request_index].edited_caption for c in sweep.candidates],
            )
            extra_scores, extra_failures = self._extra_checks(edits_in_context, sweep)
            clip_scores = [{**s, **e} for s, e in zip(clip_scores, extra_scores, strict=True)]
            chosen, candidates = select_candidates(edits_in_context, sweep, clip_scores, extra_failures, thresholds)
            for candidate in candidates:  # index into the record's edits, not the in-context subset
                candidate["edit_index"] = positions[candidate["edit_index"]]
            candidates = sorted(candidates + too_long, key=lambda c: c["edit_index"])
            logger.debug("%s %s: %d of %d edits kept", self.name, record.get("key"), len(chosen), len(edits))
            out.append({self.output_field: chosen, self.candidates_field: candidates})
        return out


class LanceREditStage(CounterfactualEditStage):
    """``lance_r_edit``: the LANCE-R baseline's random word edits rendered like LANCE's.

    Same sweep, gates and selection as ``edit``, plus the LANCE-R check that the edited image matches the new word
    (``edited_span``) better than the replaced word (``original_span``). Every edit in ``record["random_edits"]``
    is rendered (they carry no ``kept`` flag).
    """

    name = "lance_r_edit"
    edits_field = "random_edits"
    output_field = "lance_r"
    candidates_field = "lance_r_candidates"

    def _edits(self, record: Record) -> list[dict]:
        return list(record.get(self.edits_field) or [])

    def describe(self) -> dict[str, Any]:
        description = super().describe()
        description["prompt_to_prompt"]["lance_r_word_check"] = self.options.lance_r_word_check
        return description

    def _extra_checks(self, edits: list[dict], sweep: SweepResult) -> tuple[list[dict], list[list[str]]]:
        scores: list[dict] = [{} for _ in sweep.candidates]
        failures: list[list[str]] = [[] for _ in sweep.candidates]
        if not self.options.lance_r_word_check:
            return scores, failures
        checkable = [
            k
            for k, c in enumerate(sweep.candidates)
            if _span(edits[c.request_index], "original_span").strip()
            and _span(edits[c.request_index], "edited_span").strip()
        ]
        for k in range(len(sweep.candidates)):
            if k not in checkable:
                failures[k].append("word check needs a non-empty original_span and edited_span")
        if checkable:
            checks = self.scorer.word_check(
                [sweep.candidates[k].image for k in checkable],
                [_span(edits[sweep.candidates[k].request_index], "original_span") for k in checkable],
                [_span(edits[sweep.candidates[k].request_index], "edited_span") for k in checkable],
            )
            for k, check in zip(checkable, checks, strict=True):
                scores[k] = {
                    "new_word_similarity": check["new_word_similarity"],
                    "old_word_similarity": check["old_word_similarity"],
                }
                if not check["passes"]:
                    failures[k].append(
                        "word check: image matches the old word at least as well as the new word "
                        f"({check['old_word_similarity']:.6f} >= {check['new_word_similarity']:.6f})"
                    )
        return scores, failures
