"""Text-to-image generation of class instances under named shifts, and their CLIP filter (dataset interfaces).

Vendrow et al., "Dataset Interfaces" (arXiv 2302.07865), §3-4: each image is generated from "a photo of a <token>
<shift>" with Stable Diffusion 2 (Euler, 50 steps, guidance 7.5), where <token> is the class's textual-inversion token
(``textual_inversion.py``) or, for the paper's baseline, the plain class name. CLIP then scores object presence
("a photo of a <class>", "a <class>" for style shifts) and shift presence ("a photo in the snow"); an image is kept
only when both pass. Every score, threshold and verdict is kept with the image; nothing is dropped silently.

Seeds: each image's initial noise comes from its own ``torch.Generator`` seeded with ``record["seed"]`` (derived by
the builder from the release seed and the sample key), so an image does not depend on its batch neighbours' seeds.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from lance_pipeline.clip.gates import ClipScorer
from lance_pipeline.clip.loader import ClipModelRef
from lance_pipeline.interfaces.object_thresholds import ObjectThresholds
from lance_pipeline.interfaces.shifts import TOKEN_PLACEHOLDER, object_caption
from lance_pipeline.interfaces.textual_inversion import check_tokens_for_encoder, read_token_dir
from lance_pipeline.models.needs import SD_PIPELINE_FILES, ModelOption, clip_option
from lance_pipeline.option_types import CosineThreshold, DiffusionSteps, ImageSide, Options, PositiveInt
from lance_pipeline.stage import MetadataField, ReleaseOutput, SampleFailure, stage_options

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "stabilityai/stable-diffusion-2"
DEFAULT_REVISION = "fp16"  # the branch MadryLab's code loads; see textual_inversion.DEFAULT_REVISION
SCHEDULERS = {"euler": "EulerDiscreteScheduler", "ddim": "DDIMScheduler", "unipc": "UniPCMultistepScheduler"}


@dataclass
class GenerationOptions(Options):
    """Text-to-image settings (ImageNet*'s as defaults).

    Attributes:
        model, revision: Stable Diffusion checkpoint (Hub id at a pinned revision, or a local directory).
        tokens: Directory of learned class tokens (``{label}.safetensors`` or ImageNet*'s ``{label}.bin``); None with
            ``plain_prompt`` only.
        plain_prompt: Generate with the class name instead of the token (the paper's baseline).
        scheduler: ``euler`` (ImageNet*), ``ddim`` or ``unipc``; built from the checkpoint's scheduler config.
        num_inference_steps, guidance_scale: 50 and 7.5.
        generation_size: Pixel size generated (None: the UNet's native size, 768 for SD 2).
        image_size: Size of the released image (512 in ImageNet*).
        batch_size: Images per pipeline call.
        dtype: ``float32``, ``float16`` or ``bfloat16``.
    """

    model: str = DEFAULT_MODEL
    revision: str | None = DEFAULT_REVISION
    tokens: str | None = field(default=None, metadata={"local_path": True})
    plain_prompt: bool = False
    scheduler: Literal["euler", "ddim", "unipc"] = "euler"  # the keys of SCHEDULERS
    num_inference_steps: DiffusionSteps = 50
    guidance_scale: float = 7.5
    generation_size: ImageSide | None = None
    image_size: ImageSide = 512
    batch_size: PositiveInt = 4
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tokens is None and not self.plain_prompt:
            raise ValueError("tokens: give the directory of learned class tokens, or set plain_prompt: true")


class ShiftGenerator:
    """A Stable Diffusion text-to-image pipeline with the class tokens loaded, generating seeded images."""

    def __init__(self, options: GenerationOptions, device: str = "cpu") -> None:
        self.options = options
        self.device = device
        self.pipe = None
        self.tokens: dict[int, str] = {}
        self.tokens_sha256: str | None = None

    def load(self) -> None:
        import diffusers
        import torch

        opts = self.options
        revision = None if os.path.isdir(opts.model) else opts.revision
        scheduler_cls = getattr(diffusers, SCHEDULERS[opts.scheduler])
        scheduler = scheduler_cls.from_pretrained(opts.model, subfolder="scheduler", revision=revision)
        self.pipe = diffusers.StableDiffusionPipeline.from_pretrained(
            opts.model,
            revision=revision,
            scheduler=scheduler,
            dtype=getattr(torch, opts.dtype),
            use_safetensors=True,
            safety_checker=None,  # SD 2 ships none; recorded in describe()
            requires_safety_checker=False,
        ).to(self.device)
        self.pipe.set_progress_bar_config(disable=True)
        if opts.tokens is not None and not opts.plain_prompt:
            self.tokens = self._load_tokens(Path(opts.tokens))

    def _load_tokens(self, directory: Path) -> dict[int, str]:
        """Load every ``{label}.safetensors`` / ``{label}.bin`` token into the pipeline's text encoder, each checked
        first (``textual_inversion.read_token_dir`` and ``check_tokens_for_encoder``: errors name the file)."""
        files = read_token_dir(directory)
        check_tokens_for_encoder(files, self.pipe.tokenizer, self.pipe.text_encoder.get_input_embeddings().weight)
        tokens: dict[int, str] = {}
        for label, entry in sorted(files.items()):
            self.pipe.load_textual_inversion({entry.token: entry.embedding}, token=entry.token)
            tokens[label] = entry.token
        self.tokens_sha256 = _tokens_digest(files)
        return tokens

    def class_word(self, label: int, label_name: str) -> str:
        """What replaces ``<TOKEN>``: the class's learned token, or its name for plain prompts."""
        if self.options.plain_prompt:
            return label_name
        if label not in self.tokens:
            raise KeyError(label)
        return self.tokens[label]

    def generate(self, prompts: list[str], seeds: list[int]) -> list[Any]:
        """One image per (prompt, seed), each from its own seeded generator, resized to ``image_size``."""
        import torch
        from PIL import Image

        opts = self.options
        size = opts.generation_size
        generators = [torch.Generator(device="cpu").manual_seed(int(s)) for s in seeds]
        with torch.inference_mode():
            images = self.pipe(
                prompts,
                num_inference_steps=opts.num_inference_steps,
                guidance_scale=opts.guidance_scale,
                height=size,
                width=size,
                generator=generators,
                output_type="pil",
            ).images
        return [im.convert("RGB").resize((opts.image_size, opts.image_size), Image.Resampling.BICUBIC) for im in images]

    def describe(self) -> dict[str, Any]:
        return {
            **public_options(self.options),
            "safety_checker": None,
            "tokens_loaded": len(self.tokens),
            "tokens_sha256": self.tokens_sha256,
        }


def public_options(options: GenerationOptions) -> dict[str, Any]:
    """The options as a release records them: the tokens folder by its name, never a machine path."""
    data = asdict(options)
    if data["tokens"] and not data["tokens"].startswith(("demo:", "pkg:")):
        data["tokens"] = Path(data["tokens"]).name
    return data


def _tokens_digest(files: dict[int, Any]) -> str:
    """sha256 over (label, token, embedding bytes) of every loaded token, in label order: what was generated with."""
    import hashlib

    digest = hashlib.sha256()
    for label, entry in sorted(files.items()):
        digest.update(f"{label}\0{entry.token}\0".encode())
        digest.update(entry.embedding.contiguous().numpy().tobytes())
    return "sha256:" + digest.hexdigest()


def clip_presence_scores(scorer: Any, images: list[Any], object_captions: list[str], shift_captions: list[str | None]):
    """(object presence, shift presence) cosine similarities per image; shift presence None where no caption.

    ``scorer`` is a loaded ``clip_gates.ClipScorer`` (``encode_images`` / ``encode_texts`` return L2-normalised
    embeddings).
    """
    image_emb = scorer.encode_images(images)
    object_emb = scorer.encode_texts(object_captions)
    object_scores = (image_emb * object_emb).sum(-1).tolist()
    with_shift = [i for i, c in enumerate(shift_captions) if c is not None]
    shift_scores: list[float | None] = [None] * len(images)
    if with_shift:
        shift_emb = scorer.encode_texts([shift_captions[i] for i in with_shift])
        values = (image_emb[with_shift] * shift_emb).sum(-1).tolist()
        for i, value in zip(with_shift, values, strict=True):
            shift_scores[i] = value
    return object_scores, shift_scores


# -- stages ----------------------------------------------------------------------------------------------------------
REJECTED_CONFIG = "rejected"


class ShiftGenerationStage:
    """``generate``: one image per record from its shift's prompt, the class token (or name) and the record's seed.

    Records come from a ``generate:`` source (``builder.interfaces.source``): ``prompt_template`` holds ``<TOKEN>``.
    """

    name = "generate"
    version = "1"
    consumes = {"label": "int", "label_name": "str", "seed": "int", "prompt_template": "str"}
    produces = {"generated": "image", "prompt": "str", "token": "any"}
    # Each image goes to the config the filter stage routes it to (its shift, `rejected`, or none); the metadata
    # fields come from the source (shift, captions, threshold), this stage (prompt, token) and the filter (scores).
    outputs = (
        ReleaseOutput(
            config="shift",
            field="generated",
            key_suffix="gen",
            config_field="release_config",
            description="images generated under this shift that pass the CLIP filter (dataset interfaces)",
            fields=(
                MetadataField("shift", "string", description="the shift's name"),
                MetadataField("prompt", "string", description="the prompt the image was generated from"),
                MetadataField("token", "string", description="the class token (null for plain prompts)"),
                MetadataField("object_caption", "string", description="CLIP text for object presence"),
                MetadataField("shift_caption", "string", description="CLIP text for shift presence"),
                MetadataField("object_score", "float64", description="CLIP cosine: image vs object caption"),
                MetadataField("shift_score", "float64", description="CLIP cosine: image vs shift caption"),
                MetadataField("object_threshold", "float64", description="object threshold (null: none)"),
                MetadataField("shift_threshold", "float64", description="shift threshold (null: unknown)"),
                MetadataField("passed", "bool", description="both CLIP criteria passed"),
            ),
        ),
    )
    options_class = GenerationOptions
    model_options = (ModelOption("model", SD_PIPELINE_FILES, role="Stable Diffusion 2 (generation)"),)

    def __init__(self, options: GenerationOptions | None = None, /, **values: Any) -> None:
        self.options = stage_options(type(self), options, values)
        self.generator: ShiftGenerator | None = None

    def load(self, device: str) -> None:
        self.generator = ShiftGenerator(self.options, device)
        self.generator.load()

    def process(self, records: list[dict[str, Any]]) -> list[Any]:
        assert self.generator is not None, "load() first"
        results: list[Any] = [None] * len(records)
        todo: list[tuple[int, str, str | None]] = []
        for i, record in enumerate(records):
            try:
                word = self.generator.class_word(record["label"], record["label_name"])
            except KeyError:
                results[i] = SampleFailure(f"no learned token for class {record['label']} ({record['label_name']})")
                continue
            token = None if self.options.plain_prompt else word
            todo.append((i, record["prompt_template"].replace(TOKEN_PLACEHOLDER, word), token))
        size = self.options.batch_size
        for start in range(0, len(todo), size):
            chunk = todo[start : start + size]
            images = self.generator.generate([p for _, p, _ in chunk], [records[i]["seed"] for i, _, _ in chunk])
            for (i, prompt, token), image in zip(chunk, images, strict=True):
                results[i] = {"generated": image, "prompt": prompt, "token": token}
        return results

    def check_classes(self, classes: dict[int, str]) -> None:
        """Before any model runs: the token folder is readable and sound, and has a token for every class the build
        generates (a missing class would otherwise fail image by image, after hours of generation)."""
        tokens = self.options.tokens
        if self.options.plain_prompt or tokens is None or tokens.startswith(("demo:", "pkg:")):
            return
        files = read_token_dir(tokens)
        missing = [label for label in sorted(classes) if label not in files]
        if not missing:
            return
        shown = ", ".join(f"{label} ({classes[label]})" for label in missing[:3]) + (" ..." if len(missing) > 3 else "")
        covered = len(classes) - len(missing)
        raise ValueError(
            f"tokens {tokens}: {covered} of the build's {len(classes)} class(es) have a token; missing {shown}. Learn "
            "them with `lance-cf interfaces learn-tokens`, or build only the classes the folder covers (--classes)"
        )

    def describe(self) -> dict[str, Any]:
        if self.generator:
            return self.generator.describe()
        return {**public_options(self.options), "safety_checker": None}


@dataclass
class ShiftFilterOptions(Options):
    """The CLIP filter of dataset interfaces (§3.1, Appendix A.3).

    Object presence is judged per class, as in the paper: ``object_thresholds`` names a file of per-class thresholds
    (``lance-cf interfaces calibrate``: a percentile of the class's real images' similarities). Without one the filter
    refuses to run, unless the config says explicitly what to do instead: ``object_threshold`` (one threshold for
    every class) or ``object_filter: false`` (no object criterion). Either choice is stated on the card.

    Attributes:
        clip_model, clip_pretrained, clip_revision: The CLIP scorer (ImageNet* used open_clip ViT-H-14 laion2b).
        object_thresholds: Per-class thresholds file (recorded in a release by its name, and its content).
        object_threshold: One object threshold for every class, instead of per-class ones (not the paper's rule).
        object_filter: False: no object-presence criterion at all (not the paper's rule).
        keep_rejected: Release rejected images in a ``rejected`` config (they are always counted; never scored).
    """

    clip_model: str = "ViT-H-14"
    clip_pretrained: str | None = "laion2b_s32b_b79k"
    clip_revision: str | None = None
    object_thresholds: str | None = field(default=None, metadata={"local_path": True})
    object_threshold: CosineThreshold | None = None
    object_filter: bool = True
    keep_rejected: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.object_filter:
            if self.object_thresholds is not None or self.object_threshold is not None:
                raise ValueError("object_filter is false: leave object_thresholds and object_threshold unset")
            return
        if self.object_thresholds is not None and self.object_threshold is not None:
            raise ValueError("give object_thresholds (per class, the paper's rule) or object_threshold, not both")
        if self.object_thresholds is None and self.object_threshold is None:
            raise ValueError(
                "the object-presence filter needs per-class thresholds: run `lance-cf interfaces calibrate --source "
                "SPEC --classes ... --output thresholds.json` and set object_thresholds: thresholds.json, or say "
                "explicitly object_threshold: X (one for every class) or object_filter: false"
            )

    @property
    def object_rule(self) -> str:
        if not self.object_filter:
            return "off"
        return "per_class" if self.object_thresholds is not None else "global"


class ShiftFilterStage:
    """``filter``: CLIP object and shift presence for each generated image, the thresholds, and the verdict.

    Every image gets its scores; ``release_config`` routes it to its shift's config when it passes, to ``rejected``
    when it does not and ``keep_rejected`` is on, and to no config otherwise. The engine counts where every image
    went, per shift and class, in the manifest (``build.routing``): nothing is dropped silently.
    """

    name = "filter"
    version = "2"
    consumes = {"generated": "image", "label": "int", "label_name": "str", "shift": "str", "object_caption": "str",
                "shift_caption": "any", "shift_threshold": "any"}  # fmt: skip
    produces = {"object_score": "float", "shift_score": "any", "object_threshold": "any", "passed": "bool",
                "release_config": "any"}  # fmt: skip
    options_class = ShiftFilterOptions
    model_options = (clip_option("CLIP of the shift filter"),)

    def __init__(self, options: ShiftFilterOptions | None = None, /, **values: Any) -> None:
        self.options = stage_options(type(self), options, values)
        self.scorer = None
        self.thresholds = None
        if self.options.object_thresholds is not None:
            self.thresholds = ObjectThresholds.read(self.options.object_thresholds)

    def check_classes(self, classes: dict[int, str]) -> None:
        """Before any model runs: per-class thresholds exist for every class the build generates."""
        if self.thresholds is None:
            return
        missing = [name for label, name in sorted(classes.items()) if label not in self.thresholds.classes]
        if missing:
            shown = ", ".join(repr(n) for n in missing[:3]) + (" ..." if len(missing) > 3 else "")
            raise ValueError(
                f"object thresholds {self.options.object_thresholds}: no threshold for {len(missing)} of the build's "
                f"{len(classes)} class(es) ({shown}); calibrate them with `lance-cf interfaces calibrate --classes "
                "...`, or build only the classes it has"
            )
        mismatched = self.thresholds.mismatched_names(classes)
        if mismatched:
            label, ours, theirs = mismatched[0]
            raise ValueError(
                f"object thresholds {self.options.object_thresholds}: class {label} is {ours!r} in this build but "
                f"{theirs!r} in the file ({len(mismatched)} such class(es)); calibrate on the build's label space"
            )
        self._check_clip_names()

    def _check_clip_names(self) -> None:
        """The file's CLIP model must be this filter's (names here; weights hashes once loaded)."""
        o = self.options
        if o.clip_model.startswith(("demo:", "pkg:")):
            return  # resolved by the builder; compared by weights hash at load
        mine = ClipModelRef(o.clip_model, o.clip_pretrained, o.clip_revision).describe()
        theirs = self.thresholds.clip
        if (mine["model"], mine["pretrained"]) != (theirs.get("model"), theirs.get("pretrained")):
            raise ValueError(
                f"object thresholds {o.object_thresholds}: computed with CLIP {theirs.get('model')} "
                f"({theirs.get('pretrained')}), but this filter scores with {mine['model']} ({mine['pretrained']}); "
                "calibrate with the filter's CLIP model"
            )

    def load(self, device: str) -> None:
        o = self.options
        self.scorer = ClipScorer(model=o.clip_model, pretrained=o.clip_pretrained, revision=o.clip_revision)
        self.scorer.load(device)
        if self.thresholds is not None:
            expected = self.thresholds.clip.get("weights_sha256")
            loaded = self.scorer.describe().get("weights_sha256")
            if expected and loaded and expected != loaded:
                raise ValueError(
                    f"object thresholds {o.object_thresholds}: computed with CLIP weights sha256 {expected[:12]}..., "
                    f"but this filter loaded {loaded[:12]}...; calibrate with the filter's CLIP model"
                )

    def _object_threshold(self, record: dict[str, Any]) -> float | None:
        if self.options.object_rule == "off":
            return None
        if self.options.object_rule == "global":
            return float(self.options.object_threshold)
        name = record["label_name"]
        if record["object_caption"] == object_caption(name, style=False):
            style = False
        elif record["object_caption"] == object_caption(name, style=True):
            style = True
        else:
            raise ValueError(f"object caption {record['object_caption']!r} is not a caption the thresholds cover")
        threshold = self.thresholds.threshold(record["label"], style)
        if threshold is None:
            raise ValueError(
                f"no object threshold for class {record['label']} ({name!r}) in {self.options.object_thresholds}"
            )
        return threshold

    def process(self, records: list[dict[str, Any]]) -> list[Any]:
        assert self.scorer is not None, "load() first"
        objects, shifts = clip_presence_scores(
            self.scorer,
            [r["generated"] for r in records],
            [r["object_caption"] for r in records],
            [r["shift_caption"] for r in records],
        )
        out = []
        for record, object_score, shift_score in zip(records, objects, shifts, strict=True):
            threshold = self._object_threshold(record)
            verdict = shift_verdict(object_score, shift_score, threshold, record["shift_threshold"])
            if verdict["passed"]:
                config = record["shift"]
            else:
                config = REJECTED_CONFIG if self.options.keep_rejected else None
            out.append({
                "object_score": verdict["object_score"],
                "shift_score": verdict["shift_score"],
                "object_threshold": verdict["object_threshold"],
                "passed": verdict["passed"],
                "release_config": config,
            })  # fmt: skip
        return out

    def describe(self) -> dict[str, Any]:
        from pathlib import Path

        info = self.scorer.describe() if self.scorer is not None else {}
        options = asdict(self.options)
        if options["object_thresholds"] is not None:
            options["object_thresholds"] = Path(options["object_thresholds"]).name  # a name, never a machine path
        described = {**info, **options, "object_rule": self.options.object_rule}
        if self.thresholds is not None:
            described["object_thresholds_data"] = self.thresholds.to_dict()
        return described


def shift_verdict(
    object_score: float, shift_score: float | None, object_threshold: float | None, shift_threshold: float | None
) -> dict[str, Any]:
    """Both CLIP criteria of dataset interfaces; a criterion without a threshold (none chosen) passes and says so."""
    object_ok = object_threshold is None or object_score >= object_threshold
    shift_ok = shift_threshold is None or shift_score is None or shift_score >= shift_threshold
    return {
        "object_score": float(object_score),
        "shift_score": None if shift_score is None else float(shift_score),
        "object_threshold": object_threshold,
        "shift_threshold": shift_threshold,
        "passed": bool(object_ok and shift_ok),
    }
