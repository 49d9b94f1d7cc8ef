"""Options of the image stages (inversion, reconstruction, prompt-to-prompt edits, LANCE-R edits).

Weight-free: constructing the options validates them without importing torch or loading any model, so a typo
fails at config validation, naming the option.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from lance_pipeline.clip.gates import ClipGateThresholds
from lance_pipeline.editing.sd_components import DEFAULT_MODEL, DEFAULT_REVISION
from lance_pipeline.option_types import (
    CosineThreshold,
    DiffusionSteps,
    Fraction,
    ImageSide,
    Interval,
    MinLen,
    NonNegativeInt,
    Options,
    PositiveInt,
)
from lance_pipeline.registry import INVERSIONS

# LANCE's paper sweep (section 3.2); the authors' code sweeps only up to 0.8.
DEFAULT_SELF_REPLACE_SWEEP = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
ATTENTION_EDITS = ("auto", "refine")
REFINE_PADDINGS = ("source_order", "same_position")  # attention_control.REFINE_PADDINGS
SELECTIONS = ("best_directional", "largest_passing")  # candidate_selection.SELECTIONS
# Inversion methods that optimise by gradient descent: Adam's eps (1e-8) is 0 in float16, so the update divides by
# zero and the embeddings become inf/NaN; these run with float32 weights only.
OPTIMISING_INVERSIONS = ("null_text",)
PRECISIONS = ("fp32", "bf16")
# Classifier-free guidance: 1 is none (the conditional prediction alone); below 1 would push away from the prompt.
GuidanceScale = Annotated[float, Interval(ge=1.0)]


def steps_of(fraction: float, num_steps: int) -> int:
    """Number of steps a fraction covers (``round``, so 0.7 * 50 is 35 despite float error)."""
    return int(math.floor(fraction * num_steps + 0.5))


def check_model_reference(name: str, value) -> str:
    """A model option as a string; a path-shaped value must be an existing directory (a Hub id otherwise)."""
    value = os.fspath(value)
    if value.startswith(("/", ".", "~")) and not os.path.isdir(value):
        raise ValueError(f"{name} directory not found: {value!r} (expected a Hub id or a local directory)")
    return value


@dataclass
class ClipGateOptions(Options):
    """The CLIP scorer and LANCE's quality gates (section 3.2): one part that every editor's options include.

    Attributes:
        clip_model, clip_pretrained, clip_revision, clip_batch_size: The CLIP scorer (``clip_gates.ClipScorer``).
        clip_directional_threshold, clip_image_threshold, clip_text_threshold, require_edited_closer: CLIP gates
            (``clip_gates.ClipGateThresholds``; -1 and ``false`` switch a gate off).
    """

    clip_model: str = "ViT-L-14"
    clip_pretrained: str | None = "openai"
    clip_revision: str | None = None
    clip_batch_size: PositiveInt = 32
    clip_directional_threshold: CosineThreshold = 0.2
    clip_image_threshold: CosineThreshold = 0.7
    clip_text_threshold: CosineThreshold = 0.2
    require_edited_closer: bool = True

    def gate_thresholds(self):
        return ClipGateThresholds(
            directional=self.clip_directional_threshold,
            image=self.clip_image_threshold,
            text=self.clip_text_threshold,
            require_edited_closer=self.require_edited_closer,
        )


@dataclass
class EditorOptions(ClipGateOptions):
    """What every editor's options hold: the model it renders with, its dtype and image size, the CLIP scorer and gates
    (``ClipGateOptions``) and the Hugging Face cache. An editor's own options subclass this and add only their fields
    (redeclaring a shared field changes its default, not its place; its annotation says its bounds and choices, which
    are checked on construction: ``Options``); ``describe`` gives what the manifest records of them, and the image
    stage describes itself from it, whatever the editor renders with.

    Attributes:
        model: Hub id or local directory of the editor's model.
        revision: Pinned Hub revision of ``model`` (ignored for a local directory).
        dtype: Weights and compute dtype, one of ``dtypes``.
        image_size: Square size in pixels of the images the editor renders.
        cache_dir: Hugging Face cache directory (default: the hub's own).
        keep_candidates: Release every gate-passing candidate of each edit as a sample of the ``strength`` config
            (``lance_pipeline.editing.strength``), not only the selected one; off by default. Only an editor whose
            candidates are one edit rendered at graded strengths accepts it (``candidates_are_strength_series``).
    """

    model: str = ""
    revision: str | None = None
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    image_size: ImageSide = 512
    cache_dir: str | None = None
    keep_candidates: bool = False

    # Class attributes, not options (ClassVar): whether the editor's candidates of one edit are that edit at graded
    # strengths, each with a ``self_replace`` fraction (strength = 1 - self_replace); if not, why not (the refusal of
    # ``keep_candidates: true`` says it).
    candidates_are_strength_series: ClassVar[bool] = False
    not_a_strength_series: ClassVar[str] = "this editor's candidates are not one edit at graded strengths"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.model = check_model_reference("model", self.model)
        if self.keep_candidates and not self.candidates_are_strength_series:
            raise ValueError(
                f"keep_candidates: {self.not_a_strength_series}, so they have no place on the strength axis; "
                "set keep_candidates: false"
            )

    @property
    def is_local(self) -> bool:
        return os.path.isdir(self.model)

    def describe(self) -> dict[str, Any]:
        """What the manifest records of these options: the model as published (a local directory by its name only),
        its revision, dtype and image size. Subclasses add their own constants."""
        return {
            "model": Path(self.model).name if self.is_local else self.model,
            "revision": None if self.is_local else self.revision,
            "dtype": self.dtype,
            "image_size": self.image_size,
        }


@dataclass
class ImageEditorOptions(EditorOptions):
    """Every option of the image stages, with the paper's / authors' defaults (sources in docs/method.md).

    Attributes:
        model: Hub id of a Stable Diffusion 1.x/2.x checkpoint in diffusers layout, or a local directory.
        revision: Pinned Hub revision (ignored for a local directory).
        dtype: Weights and compute dtype. float32 as the authors (null-text optimisation needs it).
        precision: ``"fp32"`` or ``"bf16"``: bfloat16 autocast for the forward-only sampling (sweep and
            reconstruction passes); inversion runs at ``dtype``.
        allow_tf32: On CUDA, TF32 matmuls and convolutions (the authors' code enabled TF32 too).
        cudnn_benchmark: On CUDA, let cuDNN pick convolution algorithms by timing (faster; bytes may differ between
            runs, so off by default).
        compile: ``"none"`` (default), ``"default"`` or ``"max-autotune-no-cudagraphs"``: ``torch.compile`` (inductor,
            that mode) of the UNet's residual blocks and feed-forward layers, once per loaded set of components
            (``sd_components.compile_unet``). Outputs equal eager ones within float tolerance, not bit for bit.
        image_size: Square size in pixels the image is resized to before encoding (512).
        num_inference_steps: DDIM steps (50).
        guidance_scale: Classifier-free guidance (7.5).
        inversion: Inversion method, a name of ``lance_pipeline.registry.INVERSIONS`` (``null_text`` as the paper).
        num_inner_steps: Null-text Adam iterations per step (10).
        early_stop_epsilon: Null-text early-stop base threshold (1e-5).
        cross_replace: Fraction of the steps with cross-attention injection (0.8).
        self_replace_sweep: The self-attention injection fractions swept per edit.
        edit_word_weight: Reweighting factor of the edited tokens' cross-attention (2.0).
        attention_edit: ``"auto"`` (replace where the token alignment maps every unchanged token to its own
            position, i.e. in-place swaps; refine otherwise) or ``"refine"`` (always refine, as the authors' code).
        refine_padding: How refine maps the target's padding positions: ``"source_order"`` (ours: padding copies
            the source's padding in order) or ``"same_position"`` (prompt-to-prompt's and the authors' rule).
        self_replace_max_tokens: Self-attention is injected only in layers with at most this many query tokens.
        edit_batch_size: Target rows (edit x distinct sweep value) per sampling run, besides the shared source;
            ``None`` (default): as many as half the free memory of the device holds (estimated per row).
        selection: Which gate-passing candidate of an edit is kept: ``"best_directional"`` (highest CLIP
            directional similarity) or ``"largest_passing"`` (largest self_replace, the authors' code in effect).
        lance_r_word_check: Apply the LANCE-R word check in ``lance_r_edit`` (off only for noise-image demos).
        keep_candidates: In ``edit``, also release every gate-passing candidate of the sweep as the ``strength``
            config, strength = 1 - self_replace (``lance_pipeline.editing.strength``).
        clip_*, require_edited_closer, cache_dir: shared by every editor (``EditorOptions``, ``ClipGateOptions``).
    """

    model: str = DEFAULT_MODEL
    revision: str | None = DEFAULT_REVISION
    precision: Literal["fp32", "bf16"] = "fp32"  # PRECISIONS
    allow_tf32: bool = True
    cudnn_benchmark: bool = False
    compile: Literal["none", "default", "max-autotune-no-cudagraphs"] = "none"  # sd_components.COMPILE_MODES
    num_inference_steps: DiffusionSteps = 50
    guidance_scale: GuidanceScale = 7.5
    inversion: str = "null_text"
    num_inner_steps: NonNegativeInt = 10
    early_stop_epsilon: float = 1e-5
    cross_replace: Annotated[Fraction, "a fraction of the steps"] = 0.8
    self_replace_sweep: Annotated[tuple[Fraction, ...], MinLen(1), "fractions of the steps"] = (
        DEFAULT_SELF_REPLACE_SWEEP
    )
    edit_word_weight: float = 2.0
    attention_edit: Literal["auto", "refine"] = "auto"  # ATTENTION_EDITS
    refine_padding: Literal["source_order", "same_position"] = "source_order"  # REFINE_PADDINGS
    self_replace_max_tokens: PositiveInt = 32**2
    edit_batch_size: Annotated[PositiveInt | None, "rows per run, or null (by memory)"] = None
    selection: Literal["best_directional", "largest_passing"] = "best_directional"  # SELECTIONS
    lance_r_word_check: bool = True

    candidates_are_strength_series = True  # one edit rendered at every self_replace fraction of the sweep

    def __post_init__(self) -> None:
        super().__post_init__()
        self.self_replace_sweep = tuple(float(f) for f in self.self_replace_sweep)
        # Relations and registries, which no annotation of one option can say.
        if len(set(self.self_replace_sweep)) != len(self.self_replace_sweep):
            raise ValueError(f"self_replace_sweep has duplicates: {self.self_replace_sweep!r}")
        if ":" not in self.inversion:  # "package.module:attr" names a custom method directly
            INVERSIONS.target(self.inversion)  # an unknown name fails here, with "did you mean"
        if self.inversion in OPTIMISING_INVERSIONS and self.dtype != "float32":
            raise ValueError(
                f"dtype {self.dtype!r} cannot run inversion {self.inversion!r}: its optimisation needs float32 "
                "(in float16 Adam's eps is 0 and every null embedding becomes inf/NaN); use dtype float32"
            )

    def describe(self) -> dict[str, Any]:
        """The shared part, plus the sampling and inversion constants every prompt-to-prompt stage records."""
        return {
            **super().describe(),
            "num_inference_steps": self.num_inference_steps,
            "guidance_scale": self.guidance_scale,
            "inversion": self.inversion,
            "compile": self.compile,
            "null_text": {"num_inner_steps": self.num_inner_steps, "early_stop_epsilon": self.early_stop_epsilon},
        }
