"""The third editor family: instruction editors, which edit an image from a written instruction.

Instead of inverting the image and steering attention with the edited caption (LANCE, ``lance_pipeline.editing``) or
regenerating it from its edges (DILLEMA, ``lance_pipeline.dillema``), an instruction editor takes the source image and
an instruction ("Change the weather: on a rainy day.") and returns the edited image in one sampling run. Five editors,
each a diffusers pipeline at a pinned Hub revision (``FAMILIES``):

* ``instruct_pix2pix``: ``StableDiffusionInstructPix2PixPipeline``, InstructPix2Pix (Brooks, Holynski, Efros, CVPR
  2023, arXiv 2211.09800): Stable Diffusion 1.5 with the source latent concatenated to the UNet's input; three
  classifier-free-guidance branches per step; its *image guidance* scale grades how far an edit departs from the
  source (lower is stronger), so the candidates of one edit may span several image guidance scales;
* ``flux2_klein``: ``Flux2KleinPipeline``, FLUX.2 [klein] 4B (Black Forest Labs), step-distilled (4 steps, no
  guidance branch), the source image entering the transformer as reference tokens;
* ``longcat_edit`` and ``longcat_edit_turbo``: ``LongCatImageEditPipeline``, LongCat-Image-Edit (Meituan) and its
  8-step Turbo variant;
* ``qwen_image_edit``: ``QwenImageEditPlusPipeline``, Qwen-Image-Edit-2511 (Qwen), 20B, with true classifier-free
  guidance.

What this module does, per record:

1. The instruction of each kept caption edit, from the edit's type by its rule in the edit-type table
   (``lance_pipeline.edit_types.editor_instruction``): the perturber's structured edit (type, original and edited
   span) becomes, e.g., ``Replace man with woman. Keep everything else as it is.``
2. Candidates: every instruction for each of ``images_per_edit`` seeds (and, for InstructPix2Pix, each image guidance
   scale), one pipeline call per chunk of ``batch_size`` candidates of this record. A candidate's seed derives from
   (sample seed, image index) only, so all edits of a sample start from the same noise.
3. Gates and choice: LANCE's CLIP gates against the source image (the edited caption is still what the gates read:
   it says what the image should show), and per edit the ``keep_per_edit`` passing candidates with the highest CLIP
   directional similarity, exactly the rule of the other editors.

The stage (``InstructEditStage``, type ``instruct_edit``) returns ``{"counterfactuals": [...], "edit_candidates":
[...]}`` like the other edit stages; each counterfactual also names its ``editor`` (the family), its ``instruction``,
seed and image guidance scale. Cost: the denoiser's sample-forwards are counted by a forward hook
(``InstructEditor.counts``; a guided step counts one per branch), as for the other editors; ``lance_pipeline.instruct
.cost`` gives a build's planned count.

Licences: each family records its model's licence (``FAMILIES``; ``license`` states it for another model). A model
under a non-commercial licence (``NON_COMMERCIAL_LICENSES``, e.g. FLUX.2 [klein] 9B) is refused unless
``accept_non_commercial_license: true``; the manifest and the card then say so. A model fine-tuned from another
carries that model's terms too: InstructPix2Pix's code is MIT, its weights are fine-tuned from Stable Diffusion v1.5
and carry CreativeML OpenRAIL-M's use-based restrictions (``weights_license``, ``license_note``; commercial use
allowed), and the manifest and the card state both.

Memory: ``offload: model`` moves each component to the GPU only while it runs (diffusers' model CPU offload),
``sequential`` each layer (slowest, least memory); with the build's stage-major schedule the editor is the only model
loaded while it runs. The engine records each stage's peak memory (``--record-memory``).

Determinism: the initial noise comes from CPU ``torch.Generator`` s seeded per candidate (InstructPix2Pix's Euler
ancestral steps draw from them too), and candidates of one sample are batched only with each other.
"""

from __future__ import annotations

import hashlib
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from lance_pipeline.edit_types import editor_instruction
from lance_pipeline.editing.candidate_selection import Candidate, CandidateSelector, EditRequest, SweepResult, span_of
from lance_pipeline.editing.options import EditorOptions
from lance_pipeline.editing.stages import CounterfactualEditStage
from lance_pipeline.models.needs import ModelOption, clip_option
from lance_pipeline.option_types import DiffusionSteps, Interval, MinLen, PositiveInt
from lance_pipeline.stage import SCORE_NAMES, MetadataField, Record, ReleaseOutput

logger = logging.getLogger(__name__)

STAGE_TYPE = "instruct_edit"

# Licences under which a model may not be used commercially: refused unless the config accepts them.
NON_COMMERCIAL_LICENSES = (
    "flux-non-commercial-license",
    "flux-1-dev-non-commercial-license",
    "cc-by-nc-2.0",
    "cc-by-nc-4.0",
    "cc-by-nc-sa-4.0",
    "cc-by-nc-nd-4.0",
    "non-commercial",
)


@dataclass(frozen=True)
class InstructFamily:
    """One instruction editor: its diffusers pipeline, the pinned model, its licence and its published sampling.

    Attributes:
        name: The editor's name (``EDITORS``, the samples' ``editor`` field).
        pipeline: The diffusers pipeline class.
        model, revision: The Hub id and the commit it is pinned to.
        license: The model's licence (the Hub card's ``license``).
        weights_license: The licence the weights inherit where it differs from ``license`` ("": none): a model
            fine-tuned from another model carries that model's terms too.
        license_note: One sentence saying what ``license`` and ``weights_license`` cover, for the card ("": none).
        steps, guidance: The published number of steps and guidance scale.
        guidance_argument: The pipeline's argument for ``guidance`` (Qwen-Image-Edit: ``true_cfg_scale``).
        image_guidance: The default image guidance scales (InstructPix2Pix only; empty: the editor has none).
        denoiser: The pipeline's denoising network (``unet`` or ``transformer``): the hooked one.
        sized_output: Whether the pipeline takes the output's height and width (LongCat follows its input).
        batched: Whether one call edits several prompts (LongCat encodes only its first prompt; Qwen-Image-Edit's
            processor wants one image per prompt): if not, each candidate is its own call.
        components: The model's subfolders the pipeline loads (what ``lance-cf models`` lists).
        title: The editor in a few words, for the card.
    """

    name: str
    pipeline: str
    model: str
    revision: str
    license: str
    steps: int
    guidance: float
    guidance_argument: str = "guidance_scale"
    image_guidance: tuple[float, ...] = ()
    denoiser: str = "transformer"
    sized_output: bool = True
    batched: bool = True
    components: tuple[str, ...] = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
    title: str = ""
    weights_license: str = ""
    license_note: str = ""


# The commits are those public projects pin for these repositories (each found in a project's source); like the
# other editors' pins they were NOT checked against the Hub from this offline environment.
FAMILIES: dict[str, InstructFamily] = {
    f.name: f
    for f in (
        InstructFamily(
            "instruct_pix2pix",
            "StableDiffusionInstructPix2PixPipeline",
            "timbrooks/instruct-pix2pix",
            "31519b5cb02a7fd89b906d88731cd4d6a7bbf88d",
            "mit",
            100,  # the paper's and the pipeline's defaults: 100 steps, text guidance 7.5, image guidance 1.5
            7.5,
            image_guidance=(1.5,),
            denoiser="unet",
            components=("unet", "vae", "text_encoder", "tokenizer", "scheduler"),
            title="InstructPix2Pix (Brooks et al., CVPR 2023; Stable Diffusion 1.5, about 1B parameters)",
            # The repository's LICENSE is MIT for the code and says of the checkpoints: fine-tuned from Stable
            # Diffusion checkpoints, "Further restrictions may apply. Please consult the Stable Diffusion license".
            weights_license="creativeml-openrail-m",
            license_note=(
                "MIT covers the code; the weights are fine-tuned from Stable Diffusion v1.5 and carry the CreativeML "
                "OpenRAIL-M licence's use-based restrictions (commercial use allowed)"
            ),
        ),
        InstructFamily(
            "flux2_klein",
            "Flux2KleinPipeline",
            "black-forest-labs/FLUX.2-klein-4B",
            "e7b7dc27f91deacad38e78976d1f2b499d76a294",
            "apache-2.0",
            4,  # step-distilled: 4 steps, no guidance (diffusers' integration test of this checkpoint)
            1.0,
            title="FLUX.2 [klein] 4B (Black Forest Labs; step-distilled, 4 steps)",
        ),
        InstructFamily(
            "longcat_edit",
            "LongCatImageEditPipeline",
            "meituan-longcat/LongCat-Image-Edit",
            "7b54ef423aa7854be7861600024be5c56ab7875a",
            "apache-2.0",
            50,  # the pipeline's defaults
            4.5,
            sized_output=False,
            batched=False,
            components=("transformer", "vae", "text_encoder", "tokenizer", "text_processor", "scheduler"),
            title="LongCat-Image-Edit (Meituan, 6B)",
        ),
        InstructFamily(
            "longcat_edit_turbo",
            "LongCatImageEditPipeline",
            "meituan-longcat/LongCat-Image-Edit-Turbo",
            "6a7262de5549f0bf0ec54c08ef7d283ef41f3214",
            "apache-2.0",
            8,  # the Turbo variant: 8 steps, guidance 1
            1.0,
            sized_output=False,
            batched=False,
            components=("transformer", "vae", "text_encoder", "tokenizer", "text_processor", "scheduler"),
            title="LongCat-Image-Edit-Turbo (Meituan, 6B, 8 steps)",
        ),
        InstructFamily(
            "qwen_image_edit",
            "QwenImageEditPlusPipeline",
            "Qwen/Qwen-Image-Edit-2511",
            "6f3ccc0b56e431dc6a0c2b2039706d7d26f22cb9",
            "apache-2.0",
            40,  # 40 steps, true_cfg_scale 4.0 (the model card's example)
            4.0,
            guidance_argument="true_cfg_scale",
            batched=False,
            components=("transformer", "vae", "text_encoder", "tokenizer", "processor", "scheduler"),
            title="Qwen-Image-Edit-2511 (Qwen, 20B MMDiT with a Qwen2.5-VL 7B encoder)",
        ),
    )
}
EDITOR_NAMES = tuple(FAMILIES)
# Licences of other Hub models a user may point a family at (a model neither here nor a family's must state its own).
KNOWN_LICENSES = {
    "black-forest-labs/FLUX.2-klein-9B": "flux-non-commercial-license",
    "black-forest-labs/FLUX.2-klein-base-4B": "apache-2.0",
    "black-forest-labs/FLUX.2-klein-base-9B": "flux-non-commercial-license",
}
# Every file a family's pipeline loads: each component's config and safetensors weights (one file or shards with
# their index), tokenizers and processors whole, the scheduler's config, and the pipeline's index. The safety checker
# and feature extractor of the InstructPix2Pix repository are not loaded (no safety checker, as for the other editors:
# the build's own screen stage runs Stable Diffusion's).
INSTRUCT_PIPELINE_FILES = (
    "model_index.json",
    *(
        pattern
        for part in ("unet", "transformer", "vae", "text_encoder")
        for pattern in (
            f"{part}/config.json",
            f"{part}/*.safetensors",
            f"{part}/*.safetensors.index.json",
            f"{part}/generation_config.json",
        )
    ),
    "tokenizer/*",
    "processor/*",
    "text_processor/*",
    "scheduler/scheduler_config.json",
)
ImageGuidance = Annotated[float, Interval(ge=1.0, le=10.0)]


def candidate_seed(sample_seed: int, image_index: int) -> int:
    """Seed of the initial noise of a sample's ``image_index``-th image: from (sample seed, index) only."""
    digest = hashlib.sha256(f"lance-cf:instruct:{int(sample_seed)}:{int(image_index)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


# ---------------------------------------------------------------------------------------------- options


@dataclass
class InstructEditorOptions(EditorOptions):
    """Every option of the instruction editors; ``editor`` chooses the family and with it every default.

    Attributes:
        editor: One of ``FAMILIES`` (``instruct_pix2pix``, ``flux2_klein``, ``longcat_edit``,
            ``longcat_edit_turbo``, ``qwen_image_edit``).
        model, revision: Default: the family's pinned Hub id and commit; or another Hub id (with its revision) or a
            local directory in the family's diffusers layout.
        license: The model's licence; default: the family's (or ``KNOWN_LICENSES``'), which a Hub id that is neither
            must state.
        accept_non_commercial_license: Build with a model under a non-commercial licence (refused otherwise).
        num_inference_steps, guidance_scale: Default: the family's published ones.
        image_guidance_scales: InstructPix2Pix's image guidance scales, one candidate each (default 1.5); the other
            editors have no such knob and refuse it.
        images_per_edit: Seeds rendered per edit.
        keep_per_edit: Passing candidates kept per edit, best CLIP directional similarity first.
        batch_size: Candidates per pipeline call (candidates of one sample only).
        offload: ``none``, ``model`` (each component on the GPU only while it runs) or ``sequential`` (each layer):
            diffusers' CPU offload, for editors larger than the GPU; on a CPU device it is refused.
        dtype: Weights and compute dtype (``bfloat16`` for the large editors on a GPU).
        clip_*, require_edited_closer, cache_dir: shared by every editor (``EditorOptions``, ``ClipGateOptions``).
    """

    editor: Literal["instruct_pix2pix", "flux2_klein", "longcat_edit", "longcat_edit_turbo", "qwen_image_edit"] = (
        "instruct_pix2pix"
    )
    license: str | None = None
    accept_non_commercial_license: bool = False
    num_inference_steps: Annotated[DiffusionSteps | None, "steps, or null (the editor's published number)"] = None
    guidance_scale: Annotated[float | None, Interval(ge=1.0), "a scale >= 1, or null (the editor's)"] = None
    image_guidance_scales: Annotated[tuple[ImageGuidance, ...] | None, MinLen(1), "scales, or null"] = None
    images_per_edit: PositiveInt = 1
    keep_per_edit: PositiveInt = 1
    batch_size: PositiveInt = 4
    offload: Literal["none", "model", "sequential"] = "none"

    not_a_strength_series = (
        "an instruction editor's candidates are separate samplings from noise (one per seed, and for InstructPix2Pix "
        "per image guidance scale); InstructPix2Pix's image guidance grades an edit, but on a scale of its own, not "
        "LANCE's self-attention fraction, so it is recorded per sample (image_guidance_scale), not as strength"
    )

    def __post_init__(self) -> None:
        family = FAMILIES.get(self.editor)
        defaulted = not self.model
        if family is not None and defaulted:
            self.model = family.model
            self.revision = family.revision if self.revision is None else self.revision
        super().__post_init__()  # each option against its annotation, the model reference
        family = FAMILIES[self.editor]
        if self.num_inference_steps is None:
            self.num_inference_steps = family.steps
        if self.guidance_scale is None:
            self.guidance_scale = family.guidance
        if self.image_guidance_scales is None:
            self.image_guidance_scales = family.image_guidance
        elif not family.image_guidance:
            raise ValueError(
                f"image_guidance_scales: editor {self.editor!r} has no image guidance (only instruct_pix2pix has); "
                "remove the option"
            )
        self.image_guidance_scales = tuple(float(s) for s in self.image_guidance_scales)
        if len(set(self.image_guidance_scales)) != len(self.image_guidance_scales):
            raise ValueError(f"image_guidance_scales has duplicates: {self.image_guidance_scales!r}")
        if self.license is None:
            self.license = self.model_license()
        if self.license is None:
            raise ValueError(
                f"license: model {self.model!r} is not one of the pinned editors; state its licence (the Hub card's "
                "'license', e.g. license: apache-2.0) so that the release can say under which terms it was made"
            )
        if self.is_non_commercial and not self.accept_non_commercial_license:
            raise ValueError(
                f"model {self.model!r} is under a non-commercial licence ({self.license}); set "
                "accept_non_commercial_license: true to build with it (the card then says so), or use a model under a "
                "permissive licence"
            )

    @property
    def family(self) -> InstructFamily:
        return FAMILIES[self.editor]

    def model_license(self) -> str | None:
        """The licence known for ``model``: the family's for its own model, ``KNOWN_LICENSES``', or for a local
        directory ``"not stated (local directory)"``; None for an unknown Hub id."""
        if self.model == self.family.model:
            return self.family.license
        if self.model in KNOWN_LICENSES:
            return KNOWN_LICENSES[self.model]
        if self.is_local:
            return "not stated (local directory)"
        return None

    @property
    def weights_license(self) -> str:
        """The licence the weights inherit beyond ``license`` (the family's, for its own model; else "")."""
        return self.family.weights_license if self.model == self.family.model else ""

    @property
    def license_note(self) -> str:
        return self.family.license_note if self.model == self.family.model else ""

    @property
    def is_non_commercial(self) -> bool:
        return any(str(name).lower() in NON_COMMERCIAL_LICENSES for name in (self.license, self.weights_license))

    def license_terms(self) -> dict[str, Any]:
        """The licence as the manifest records it: ``license``, and where the weights inherit more terms their
        ``weights_license`` and a ``license_note`` saying what each covers."""
        terms: dict[str, Any] = {"license": self.license}
        if self.weights_license:
            terms.update(weights_license=self.weights_license, license_note=self.license_note)
        return terms

    @property
    def candidates_per_edit(self) -> int:
        return self.images_per_edit * max(1, len(self.image_guidance_scales))

    def describe(self) -> dict[str, Any]:
        """The shared part, plus the family, the licence and the sampling the editor ran with."""
        return {
            "editor": self.editor,
            **super().describe(),
            **self.license_terms(),
            "non_commercial": self.is_non_commercial,
            "num_inference_steps": self.num_inference_steps,
            "guidance_scale": self.guidance_scale,
            "image_guidance_scales": list(self.image_guidance_scales),
            "offload": self.offload,
        }


# ---------------------------------------------------------------------------------------------- the editor


@dataclass(frozen=True)
class InstructVariant:
    """What distinguishes the candidates of one edit: the image index (hence the seed) and the image guidance."""

    image_index: int
    seed: int
    image_guidance_scale: float | None


@dataclass
class InstructRequest(EditRequest):
    """An ``EditRequest`` that also carries the instruction the editor is given."""

    instruction: str = ""


@dataclass
class InstructSweep(SweepResult):
    """A ``SweepResult`` whose candidates also carry their variant and instruction (aligned with ``candidates``)."""

    variants: list[InstructVariant] = field(default_factory=list)
    instructions: list[str] = field(default_factory=list)


@dataclass
class ForwardCounts:
    """Sample-forwards of the denoiser (a guided step counts one per branch and image) and of the text encoder."""

    denoiser_samples: int = 0
    denoiser_calls: int = 0
    text_encoder_samples: int = 0


def load_instruct_pipeline(options: InstructEditorOptions, device: str):
    """The family's diffusers pipeline from ``options.model`` (Hub id at its revision, or a local directory).

    The same ``from_pretrained`` call serves the pinned Hub ids and the tiny local copies (safetensors only, no
    safety checker). With ``offload`` the components stay on the CPU and move to ``device`` while they run.
    """
    import diffusers
    import torch

    family = options.family
    pipeline_class = getattr(diffusers, family.pipeline)
    local = os.path.isdir(options.model)
    extra: dict[str, Any] = {}
    if family.name == "instruct_pix2pix":
        extra = {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}
    pipeline = pipeline_class.from_pretrained(
        options.model,
        revision=None if local else options.revision,
        torch_dtype=getattr(torch, options.dtype),
        use_safetensors=True,
        cache_dir=options.cache_dir,
        **extra,
    )
    if options.offload != "none":
        if not str(device).startswith("cuda"):
            raise ValueError(f"offload: {options.offload!r} moves components to a GPU; on {device} use offload: none")
        if options.offload == "model":
            pipeline.enable_model_cpu_offload(device=device)
        else:
            pipeline.enable_sequential_cpu_offload(device=device)
    else:
        pipeline.to(device)
    pipeline.set_progress_bar_config(disable=True)
    for part in family.components:
        module = getattr(pipeline, part, None)
        if isinstance(module, torch.nn.Module):
            module.requires_grad_(False).eval()
    return pipeline


class InstructEditor:
    """Renders the instructions of one image's edits with a diffusers instruction-editing pipeline.

    Implements ``candidate_selection.Editor`` (registered in ``EDITORS`` under each family's name): ``render``
    returns every (edit, seed, image guidance) candidate, and the source image as the image the CLIP gates compare
    against (nothing is inverted).

    Args:
        pipeline: The loaded pipeline (``load_instruct_pipeline``).
        options: The editor options.
    """

    def __init__(self, pipeline, options: InstructEditorOptions) -> None:
        self.pipeline = pipeline
        self.options = options
        self.name = options.editor
        self.family = options.family
        multiple = self.size_multiple
        if options.image_size % multiple:
            raise ValueError(f"image_size must be a multiple of {multiple} for {self.family.pipeline}, got "
                             f"{options.image_size}")  # fmt: skip
        self.counts = ForwardCounts()

    @classmethod
    def load(cls, options: InstructEditorOptions, device: str) -> InstructEditor:
        return cls(load_instruct_pipeline(options, device), options)

    @property
    def size_multiple(self) -> int:
        """Sizes the pipeline renders exactly: its VAE's downsampling (times 2 where latents are packed in 2x2)."""
        factor = int(getattr(self.pipeline, "vae_scale_factor", 8))
        return factor if self.family.denoiser == "unet" else factor * 2

    @property
    def denoiser(self):
        return getattr(self.pipeline, self.family.denoiser)

    # ------------------------------------------------------------------------------------------ Editor interface

    @property
    def max_prompt_tokens(self) -> int:
        """What the text encoder reads of an instruction: CLIP's context, or the pipeline's sequence limit."""
        if self.family.denoiser == "unet":
            return int(self.pipeline.tokenizer.model_max_length)
        return int(getattr(self.pipeline, "tokenizer_max_length", 512))

    def count_tokens(self, text: str) -> int:
        return len(self.pipeline.tokenizer(text).input_ids)

    def check_source(self, record: Record) -> str | None:
        from PIL import Image

        if not isinstance(record.get("image"), Image.Image):
            return "record has no source image to edit"
        seed = record.get("seed")
        if isinstance(seed, bool) or not isinstance(seed, int):
            return f"record has no integer seed (got {seed!r})"
        return None

    def render(self, record: Record, requests: list[EditRequest]) -> InstructSweep:
        """Every request's instruction at every (seed, image guidance); the gates compare against the source."""
        o = self.options
        image = record["image"].convert("RGB")
        if image.size != (o.image_size, o.image_size):
            image = image.resize((o.image_size, o.image_size))
        scales = o.image_guidance_scales or (None,)
        variants = [
            InstructVariant(i, candidate_seed(record["seed"], i), scale)
            for i in range(o.images_per_edit)
            for scale in scales
        ]
        instructions = [getattr(r, "instruction", "") or r.edited_caption for r in requests]
        jobs = [(r, v) for r in range(len(requests)) for v in variants]
        rendered: dict[tuple[int, InstructVariant], Any] = {}
        for scale in scales:  # one image guidance scale per pipeline call
            scale_jobs = [job for job in jobs if job[1].image_guidance_scale == scale]
            for start in range(0, len(scale_jobs), o.batch_size):
                chunk = scale_jobs[start : start + o.batch_size]
                images = self.generate(image, [instructions[r] for r, _ in chunk], [v.seed for _, v in chunk], scale)
                rendered.update(zip(chunk, images, strict=True))
        sweep = InstructSweep(reconstruction=image)
        for r, v in jobs:
            candidate = rendered[(r, v)]
            if candidate.size != image.size:  # LongCat renders at its own resolution of the input
                candidate = candidate.resize(image.size)
            sweep.candidates.append(Candidate(request_index=r, self_replace=None, image=candidate))
            sweep.variants.append(v)
            sweep.instructions.append(instructions[r])
        return sweep

    def describe(self) -> dict[str, Any]:
        o = self.options
        config = self.pipeline.scheduler.config
        return {
            "editor": self.name,
            "pipeline": f"diffusers {self.family.pipeline} (no safety checker; the build's screens run after it)",
            "title": self.family.title,
            **o.license_terms(),
            "non_commercial": o.is_non_commercial,
            "scheduler": {
                "class": type(self.pipeline.scheduler).__name__,
                **{
                    k: config.get(k)
                    for k in (
                        "num_train_timesteps",
                        "beta_schedule",
                        "shift",
                        "use_dynamic_shifting",
                        "prediction_type",
                        "timestep_spacing",
                    )
                    if k in config
                },
            },  # fmt: skip
            "num_inference_steps": o.num_inference_steps,
            "guidance_scale": o.guidance_scale,
            "guidance_argument": self.family.guidance_argument,
            "image_guidance_scales": list(o.image_guidance_scales),
            "strength": (
                "image_guidance_scale (InstructPix2Pix: lower departs further from the source), recorded per sample"
                if self.family.image_guidance
                else "none: this editor has no knob that grades an edit"
            ),
            "instruction": "the edit type's rule in the edit-type table (lance_pipeline.edit_types.editor_instruction)",
            "candidates": {
                "images_per_edit": o.images_per_edit,
                "seed": "sha256(sample seed, image index), CPU generator: all edits of a sample share their noise",
                "keep_per_edit": o.keep_per_edit,
                "batch_size": o.batch_size,
            },
            "offload": o.offload,
            "gates_compare_against": "the source image",
        }

    # ------------------------------------------------------------------------------------------ sampling

    @contextmanager
    def _counting(self):
        """Count the samples the denoiser and the text encoder see while rendering (the editor's cost)."""

        def denoiser_hook(module, args, kwargs):
            sample = args[0] if args else kwargs.get("sample", kwargs.get("hidden_states"))
            self.counts.denoiser_samples += int(sample.shape[0])
            self.counts.denoiser_calls += 1

        def text_hook(module, args, kwargs):
            ids = args[0] if args else kwargs.get("input_ids")
            if ids is not None:
                self.counts.text_encoder_samples += int(ids.shape[0])

        handles = [self.denoiser.register_forward_pre_hook(denoiser_hook, with_kwargs=True)]
        text_encoder = getattr(self.pipeline, "text_encoder", None)
        if text_encoder is not None:
            handles.append(text_encoder.register_forward_pre_hook(text_hook, with_kwargs=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def generate(self, image, instructions: list[str], seeds: list[int], image_guidance_scale: float | None) -> list:
        """One image per (instruction, seed), all from the same source image (one pipeline call).

        Returns:
            PIL images, in the order of ``instructions``.
        """
        import torch

        if len(instructions) != len(seeds):
            raise ValueError(f"got {len(instructions)} instructions but {len(seeds)} seeds")
        if not instructions:
            return []
        o, family = self.options, self.family
        if not family.batched and len(instructions) > 1:
            return [
                edited
                for instruction, seed in zip(instructions, seeds, strict=True)
                for edited in self.generate(image, [instruction], [seed], image_guidance_scale)
            ]
        # CPU generators: the same noise on any device (diffusers draws on the generator's device, then moves it).
        generators = [torch.Generator("cpu").manual_seed(int(seed)) for seed in seeds]
        arguments: dict[str, Any] = {
            "prompt": list(instructions),
            "num_inference_steps": o.num_inference_steps,
            family.guidance_argument: o.guidance_scale,
            "generator": generators,
            "output_type": "pil",
        }
        if family.sized_output:
            arguments.update(height=o.image_size, width=o.image_size)
        if family.name == "instruct_pix2pix":
            # One source image per prompt; its image guidance grades the edit.
            arguments.update(image=[image] * len(instructions), image_guidance_scale=image_guidance_scale)
        else:
            arguments["image"] = image  # one reference image for every prompt (a list would be several references)
        if family.guidance_argument == "true_cfg_scale" and o.guidance_scale > 1:
            arguments["negative_prompt"] = [" "] * len(instructions)  # true CFG needs a negative prompt
        with self._counting(), torch.inference_mode():
            output = self.pipeline(**arguments)
        return list(output.images)


# ---------------------------------------------------------------------------------------------- selection

METADATA_FIELDS = (
    MetadataField("editor", "string", enum=EDITOR_NAMES, description="the editor that rendered the sample"),
    MetadataField("instruction", "string", description="the instruction the editor was given"),
    MetadataField("instruct_seed", "int64", description="seed of the sample's initial noise"),
    MetadataField(
        "image_guidance_scale",
        "float64",
        minimum=1.0,
        description="InstructPix2Pix's image guidance (lower departs further from the source); null for the others",
    ),
)


class InstructSelector(CandidateSelector):
    """LANCE's gates and choice (``CandidateSelector``), plus what an instruction candidate is.

    Candidate records gain ``editor``, ``instruction``, ``seed`` and ``image_guidance_scale``; chosen samples gain
    ``editor``, ``instruction``, ``instruct_seed`` and ``image_guidance_scale``. With ``keep_per_edit`` > 1 the
    next-best passing candidates of an edit (by CLIP directional similarity, ties to the earlier) become samples too.
    """

    def __init__(self, scorer, thresholds, editor: str, keep_per_edit: int = 1) -> None:
        super().__init__(scorer, thresholds, selection="best_directional")
        self.editor = editor
        self.keep_per_edit = keep_per_edit

    def describe(self) -> str:
        best = super().describe()
        return best if self.keep_per_edit == 1 else f"{best}; the {self.keep_per_edit} best per edit"

    def select(self, caption: str, edits: list[dict], sweep: InstructSweep) -> tuple[list[dict], list[dict]]:
        _, records = super().select(caption, edits, sweep)
        for record, variant, instruction in zip(records, sweep.variants, sweep.instructions, strict=True):
            record.update(editor=self.editor, instruction=instruction, seed=variant.seed,
                          image_guidance_scale=variant.image_guidance_scale)  # fmt: skip
        chosen_samples = []
        for edit_index in range(len(edits)):
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
                chosen_samples.append(
                    {
                        "image": sweep.candidates[k].image,
                        "edit_type": record["edit_type"],
                        "edited_caption": record["edited_caption"],
                        "original_span": record["original_span"],
                        "edited_span": record["edited_span"],
                        "self_replace": None,
                        "scores": {name: record["scores"].get(name) for name in SCORE_NAMES},
                        "editor": self.editor,
                        "instruction": sweep.instructions[k],
                        "instruct_seed": variant.seed,
                        "image_guidance_scale": variant.image_guidance_scale,
                    }
                )
        return chosen_samples, records


# ---------------------------------------------------------------------------------------------- the stage


class InstructEditStage(CounterfactualEditStage):
    """``instruct_edit``: the kept caption edits as instructions to an instruction editor, gated and chosen as LANCE.

    Returns ``{"counterfactuals": [...], "edit_candidates": [...]}`` like ``prompt_to_prompt_edit``; the length check
    (on the instruction), rendering, gates and candidate records are the inherited stage's. A record whose edits all
    fail the gates gets empty lists (not a failure).
    """

    options_class = InstructEditorOptions
    version = "1"
    model_options = (
        ModelOption("model", INSTRUCT_PIPELINE_FILES, required=("model_index.json",), cache_dir="cache_dir",
                    role="instruction editor"),
        clip_option(),
    )  # fmt: skip
    consumes = {"key": "str", "image": "image", "caption": "str", "seed": "int", "edits": "list"}
    produces = {"counterfactuals": "list", "edit_candidates": "list", "edit_cost": "dict"}
    outputs = (ReleaseOutput("counterfactual", "counterfactuals", "cf", many=True, fields=METADATA_FIELDS),)
    strength_field = None  # InstructEditorOptions.not_a_strength_series
    editing_section = "instruct_editing"
    rendered_text_name = "instruction"

    @property
    def editor_name(self) -> str:  # type: ignore[override]
        """The family the options chose: each is its own editor (``EDITORS``, the samples' ``editor``)."""
        return self.options.editor

    def _rendered_text(self, edit: dict) -> str:
        return editor_instruction(edit)

    def _request(self, edit: dict) -> InstructRequest:
        return InstructRequest(edit["edited_caption"], span_of(edit, "edited_span"), editor_instruction(edit))

    def _selector(self) -> InstructSelector:
        o = self.options
        return InstructSelector(self.scorer, o.gate_thresholds(), o.editor, o.keep_per_edit)

    def _editing_description(self) -> dict[str, Any]:
        """The editor's record (pipeline, licence, sampling), the selection rule, the gates and the CLIP model."""
        return {**self._editor_and_gates(), "selection": self._selector().describe()}
