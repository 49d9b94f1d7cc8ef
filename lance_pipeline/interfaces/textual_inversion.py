"""Class tokens by textual inversion, as dataset interfaces (ImageNet*) learn them.

Vendrow, Jain, Engstrom, Madry, "Dataset Interfaces: Diagnosing Model Failures Using Controllable Counterfactual
Generation" (arXiv 2302.07865), after Gal et al., "An Image is Worth One Word" (ICLR 2023). One new token per class is
added to Stable Diffusion's text encoder and trained on that class's real images, so that "a photo of a <token> in
the snow" generates the class *as the source dataset shows it*. Only the new token's embedding row trains; the VAE,
the UNet and the rest of the text encoder are frozen. The row starts at the mean embedding of the class name's word
pieces and its norm is held at that initialiser's norm (ImageNet*'s "magnitude target").

The norm constraint is MadryLab's by default (``norm_constraint="reparameterize"``, their ``SplitEmbedding`` with
``magnitude_targets``): the optimiser holds a free vector ``v`` and the text encoder sees ``v * |init| / |v|``, so the
gradient flows through the normalisation and AdamW's weight decay acts on ``v``. ``"rescale"`` instead lets AdamW move
the row itself and projects it back onto the sphere after every step (a different dynamic, under which weight decay
does nothing); it is kept as a named alternative.

Defaults are the paper's (Appendix A.1) and MadryLab code's (``TextualInversionOptions``): Stable Diffusion 2, 3,000
steps, AdamW (betas 0.9 / 0.999, eps 1e-8, weight decay 1e-2), constant lr 5e-4, batch 1, 768 px, centre crop, random
horizontal flip, random object templates, images drawn in a fresh random order each epoch (their data loader's
``shuffle=True``). Their fp16 mixed precision is not copied: training runs in the model's dtype (float32).

Tokens are saved as safetensors holding ``{token: embedding[1, d]}``, the layout diffusers'
``load_textual_inversion`` reads. The released ImageNet* tokens (``{i}.bin``, a pickled ``{placeholder: tensor}``)
are read with ``torch.load(weights_only=True)``, which refuses any pickled object other than tensors and containers.
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from annotated_types import Predicate

from lance_pipeline.option_types import Fraction, Interval, MinLen, MultipleOf, Options, PositiveInt
from lance_pipeline.readers import load_json

logger = logging.getLogger(__name__)

# Stable Diffusion 2 (768 px, v-prediction), the base model of ImageNet*. MadryLab's code loads the `fp16` branch;
# no commit of that branch could be checked from this offline machine, so the branch is named, not a commit: set
# `revision` to a commit hash for a release you will publish.
DEFAULT_MODEL = "stabilityai/stable-diffusion-2"
DEFAULT_REVISION = "fp16"

# The object templates of the textual-inversion reference training script (Gal et al.), which ImageNet* uses.
OBJECT_TEMPLATES = (
    "a photo of a {}",
    "a rendering of a {}",
    "a cropped photo of the {}",
    "the photo of a {}",
    "a photo of a clean {}",
    "a photo of a dirty {}",
    "a dark photo of the {}",
    "a photo of my {}",
    "a photo of the cool {}",
    "a close-up photo of a {}",
    "a bright photo of the {}",
    "a cropped photo of a {}",
    "a photo of the {}",
    "a good photo of the {}",
    "a photo of one {}",
    "a close-up photo of the {}",
    "a rendition of the {}",
    "a photo of the clean {}",
    "a rendition of a {}",
    "a photo of a nice {}",
    "a good photo of a {}",
    "a photo of the nice {}",
    "a photo of the small {}",
    "a photo of the weird {}",
    "a photo of the large {}",
    "a photo of a cool {}",
    "a photo of a small {}",
)


NORM_CONSTRAINTS = ("reparameterize", "rescale", "none")


def has_token_slot(template: str) -> bool:
    """Holds the ``{}`` the token goes into (pydantic names this function when it fails)."""
    return "{}" in template


TokenTemplate = Annotated[str, Predicate(has_token_slot), "a prompt template with one '{}' for the token"]


@dataclass
class TextualInversionOptions(Options):
    """Training settings; every one is recorded with the learned token.

    Attributes:
        model, revision: Stable Diffusion checkpoint (Hub id at a pinned revision, or a local directory).
        steps: Optimisation steps per class (3,000 in ImageNet*).
        learning_rate: AdamW learning rate, constant schedule (5e-4).
        batch_size: Images per step (1).
        resolution: Training crop size in pixels (768 for SD 2).
        center_crop: Centre crop (True) or random crop.
        flip_p: Probability of a horizontal flip (0.5).
        templates: Prompt templates; ``{}`` is replaced by the token.
        weight_decay: AdamW weight decay (1e-2, MadryLab's and the reference script's).
        norm_constraint: ``reparameterize`` (MadryLab's: the row is ``v * |init| / |v|`` of a free ``v``),
            ``rescale`` (the row is projected back to ``|init|`` after each step) or ``none``.
        seed: Base seed; each class's training RNG derives from it and the class's token.
    """

    model: str = DEFAULT_MODEL
    revision: str | None = DEFAULT_REVISION
    steps: PositiveInt = 3000
    learning_rate: float = 5e-4
    batch_size: PositiveInt = 1
    resolution: Annotated[int, Interval(ge=8), MultipleOf(8), "a training crop side"] = 768
    center_crop: bool = True
    flip_p: Fraction = 0.5
    templates: Annotated[tuple[TokenTemplate, ...], MinLen(1)] = OBJECT_TEMPLATES
    weight_decay: float = 1e-2
    norm_constraint: Literal["reparameterize", "rescale", "none"] = "reparameterize"  # NORM_CONSTRAINTS
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.templates = tuple(self.templates)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["templates"] = list(self.templates)
        return data


@dataclass
class LearnedToken:
    """One class's learned token: its placeholder string, its embedding row and the training trace."""

    token: str
    class_name: str
    embedding: Any  # torch.Tensor [d], float32, on the CPU
    initializer_norm: float
    losses: list[float] = field(default_factory=list)


def token_for_class(class_name: str, index: int) -> str:
    """The placeholder for a class, ImageNet*'s naming: ``<{class name}-{index}>`` with spaces as underscores."""
    return f"<{class_name.strip().replace(' ', '_')}-{index}>"


def _seed_for(base_seed: int, token: str) -> int:
    import hashlib

    digest = hashlib.sha256(f"lance-cf:textual-inversion:{base_seed}:{token}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


class TextualInversionTrainer:
    """Loads a Stable Diffusion checkpoint once and learns one token per class with it."""

    def __init__(self, options: TextualInversionOptions | None = None, device: str = "cpu") -> None:
        self.options = options or TextualInversionOptions()
        self.device = device
        self._loaded = False

    def load(self) -> None:
        """Materialise the components: frozen VAE and UNet, a text encoder whose embedding matrix will grow."""
        import os

        from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTokenizer

        opts = self.options
        revision = None if os.path.isdir(opts.model) else opts.revision
        common = {"revision": revision}
        self.tokenizer = CLIPTokenizer.from_pretrained(opts.model, subfolder="tokenizer", **common)
        self.text_encoder = CLIPTextModel.from_pretrained(
            opts.model, subfolder="text_encoder", use_safetensors=True, **common
        )
        self.vae = AutoencoderKL.from_pretrained(opts.model, subfolder="vae", use_safetensors=True, **common)
        self.unet = UNet2DConditionModel.from_pretrained(opts.model, subfolder="unet", use_safetensors=True, **common)
        # Training noise schedule: the checkpoint's betas and prediction type (epsilon for SD 1.x, v for SD 2).
        self.noise_scheduler = DDPMScheduler.from_pretrained(opts.model, subfolder="scheduler", **common)
        for module in (self.vae, self.unet, self.text_encoder):
            module.requires_grad_(False).eval().to(self.device)
        self._loaded = True

    # -- one class -------------------------------------------------------------------------------------------------
    def _add_token(self, token: str, class_name: str) -> tuple[int, Any]:
        """Add ``token`` to the tokenizer and embedding matrix, initialised at the class name's mean word piece."""
        import torch

        if self.tokenizer.add_tokens(token) != 1:
            raise ValueError(f"token {token!r} is already in the tokenizer; use another placeholder")
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        pieces = self.tokenizer(class_name, add_special_tokens=False).input_ids
        if not pieces:
            raise ValueError(f"class name {class_name!r} has no word pieces to initialise its token from")
        # mean_resizing=False: no random draw for the new row (it is set to the initialiser just below)
        self.text_encoder.resize_token_embeddings(len(self.tokenizer), mean_resizing=False)
        embeddings = self.text_encoder.get_input_embeddings().weight
        with torch.no_grad():
            init = embeddings[pieces].mean(dim=0)
            embeddings[token_id] = init
        return token_id, init.clone()

    def _batch(self, images: Any, indices: list[int], rng: random.Random) -> Any:
        """The training images ``indices``: crop (centre or random), resize, random flip, to [-1, 1]."""
        import numpy as np
        import torch
        from PIL import Image

        size = self.options.resolution
        tensors = []
        for index in indices:
            image = images[index].convert("RGB")
            w, h = image.size
            side = min(w, h)
            if self.options.center_crop:
                left, top = (w - side) // 2, (h - side) // 2
            else:
                left, top = rng.randint(0, w - side), rng.randint(0, h - side)
            image = image.crop((left, top, left + side, top + side)).resize((size, size), Image.Resampling.BICUBIC)
            if rng.random() < self.options.flip_p:
                image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
            tensors.append(torch.from_numpy(array).permute(2, 0, 1))
        return torch.stack(tensors).to(self.device)

    def _epoch_batches(self, count: int, rng: random.Random):
        """Batches of image indices as a shuffling data loader gives them: each epoch a new random order, the last
        batch of an epoch possibly smaller; endless."""
        size = self.options.batch_size
        while True:
            order = list(range(count))
            rng.shuffle(order)
            for start in range(0, count, size):
                yield order[start : start + size]

    def learn(self, images: Any, class_name: str, token: str, *, progress: Any = None) -> LearnedToken:
        """Learn ``token`` for ``class_name`` from ``images``: a sequence of PIL images (``len`` and indexing; it may
        decode each image when indexed, so that a class's images need not all be in memory). Deterministic for a
        given seed and token.

        Steps (Gal et al., Alg. 1, with ImageNet*'s norm constraint):
        1. add the token, initialised at the mean embedding of the class name's word pieces;
        2. per step: a batch of images and a template, encoded with the frozen VAE, noise at a random timestep, and
           the regression of the UNet's target (noise or v) conditioned on the prompt with the token;
        3. AdamW moves only the token's row, under the norm constraint (module docstring).
        """
        import torch
        import torch.nn.functional as F

        if len(images) == 0:
            raise ValueError(f"class {class_name!r}: no training images")
        if not self._loaded:
            self.load()
        opts = self.options
        seed = _seed_for(opts.seed, token)
        rng = random.Random(seed)
        generator = torch.Generator(device="cpu").manual_seed(seed)

        # 1. the new row.
        token_id, init = self._add_token(token, class_name)
        target_norm = init.norm().item()
        embedding_layer = self.text_encoder.get_input_embeddings()
        row = _token_row_embedding(
            embedding_layer.weight.detach().clone(), token_id, init, target_norm, opts.norm_constraint
        )
        optimizer = torch.optim.AdamW(
            [row.free], lr=opts.learning_rate, betas=(0.9, 0.999), eps=1e-8, weight_decay=opts.weight_decay
        )
        scaling = self.vae.config.scaling_factor
        prediction_type = self.noise_scheduler.config.prediction_type
        num_timesteps = self.noise_scheduler.config.num_train_timesteps
        batches = self._epoch_batches(len(images), rng)
        losses: list[float] = []
        self.text_encoder.set_input_embeddings(row)
        self.text_encoder.train()  # dropout-free CLIP: train() changes nothing but states the intent
        try:
            for _step in range(opts.steps):
                # 2. one denoising-regression step.
                pixels = self._batch(images, next(batches), rng)
                prompts = [rng.choice(opts.templates).format(token) for _ in range(pixels.shape[0])]
                with torch.no_grad():
                    posterior = self.vae.encode(pixels).latent_dist
                    noise_for_latent = torch.randn(posterior.mean.shape, generator=generator).to(self.device)
                    latents = (posterior.mean + posterior.std * noise_for_latent) * scaling
                noise = torch.randn(latents.shape, generator=generator).to(self.device)
                timesteps = torch.randint(0, num_timesteps, (latents.shape[0],), generator=generator).to(self.device)
                noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
                ids = self.tokenizer(
                    prompts, padding="max_length", max_length=self.tokenizer.model_max_length, truncation=True,
                    return_tensors="pt",
                ).input_ids.to(self.device)  # fmt: skip
                hidden = self.text_encoder(ids)[0]
                predicted = self.unet(noisy, timesteps, hidden).sample
                if prediction_type == "epsilon":
                    target = noise
                elif prediction_type == "v_prediction":
                    target = self.noise_scheduler.get_velocity(latents, noise, timesteps)
                else:
                    raise ValueError(f"scheduler prediction_type {prediction_type!r} is not supported")
                loss = F.mse_loss(predicted.float(), target.float())
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                # 3. the rescale variant projects the row back onto the initialiser's sphere after the step.
                row.after_step()
                losses.append(loss.detach().item())
                if progress is not None:
                    progress.update(1)
        finally:
            self.text_encoder.train(False)
            learned = row.value().detach().float().cpu().clone()
            with torch.no_grad():  # the plain embedding again, with the learned row in place
                embedding_layer.weight[token_id] = learned.to(embedding_layer.weight.dtype)
            self.text_encoder.set_input_embeddings(embedding_layer)
        if not math.isfinite(float(learned.norm())):
            raise FloatingPointError(f"class {class_name!r}: token embedding diverged")
        return LearnedToken(token, class_name, learned, target_norm, losses)


def _token_row_embedding(frozen: Any, token_id: int, init: Any, target_norm: float, constraint: str) -> Any:
    """The text encoder's token embedding during training: every row frozen but the new token's, which is
    ``free * |init| / |free|`` (``reparameterize``: MadryLab's ``SplitEmbedding`` with a magnitude target), ``free``
    projected back to ``|init|`` after each step (``rescale``), or ``free`` as it is (``none``). ``free`` is the only
    parameter."""
    import torch

    class TokenRowEmbedding(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("frozen", frozen, persistent=False)
            self.free = torch.nn.Parameter(init.detach().clone().to(frozen.dtype))

        def value(self) -> Any:
            if constraint == "reparameterize":
                return self.free * (target_norm / self.free.norm())
            return self.free

        def after_step(self) -> None:
            if constraint == "rescale":
                with torch.no_grad():
                    self.free.mul_(target_norm / self.free.norm().clamp_min(1e-12))

        def forward(self, input_ids: Any) -> Any:
            weight = torch.cat([self.frozen[:token_id], self.value()[None], self.frozen[token_id + 1 :]])
            return torch.nn.functional.embedding(input_ids, weight)

    return TokenRowEmbedding()


# -- token files ------------------------------------------------------------------------------------------------------
TOKEN_METADATA_KEY = "lance_cf"


def token_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata ``save_token`` wrote into a token file (``{}`` for a file without it)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        raw = (handle.metadata() or {}).get(TOKEN_METADATA_KEY)
    return load_json(raw, f"{path}: metadata {TOKEN_METADATA_KEY!r}") if raw else {}


def save_token(path: str | Path, learned: LearnedToken, metadata: dict[str, Any] | None = None) -> Path:
    """Write ``{token: embedding[1, d]}`` as safetensors (diffusers ``load_textual_inversion`` reads it)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{__import__('os').getpid()}.tmp")
    # One metadata key holding canonical JSON: safetensors writes a metadata map in no fixed order, and the same
    # token must give the same bytes.
    header = {TOKEN_METADATA_KEY: json.dumps(metadata, sort_keys=True, separators=(",", ":"))} if metadata else {}
    save_file({learned.token: learned.embedding.reshape(1, -1).contiguous()}, str(tmp), metadata=header)
    tmp.replace(path)  # a killed run leaves no half-written token behind
    return path


def load_token(path: str | Path) -> tuple[str, Any]:
    """Read and check a token file: our safetensors, or a released ImageNet* ``.bin`` without unpickling arbitrary
    objects. The embedding must be one finite floating-point vector; every problem is one ``ValueError`` line naming
    the file.

    Returns:
        (placeholder token, embedding [d], float32).
    """
    import torch

    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            state = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as err:
            raise ValueError(f"{path}: not a readable safetensors token file ({err})") from None
    else:
        try:
            state = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as err:  # weights_only refuses any non-tensor object: the file is not a plain token file
            raise ValueError(
                f"{path}: not a plain token file ({type(err).__name__}); only tensors and dicts of tensors are read, "
                "never other pickled objects"
            ) from None
    if isinstance(state, dict) and "string_to_param" in state:  # the Automatic1111 layout
        state = state["string_to_param"]
    if not isinstance(state, dict) or len(state) != 1:
        raise ValueError(f"{path}: expected exactly one token -> embedding entry, found {type(state).__name__}")
    ((token, embedding),) = state.items()
    if not isinstance(token, str) or not token.strip():
        raise ValueError(f"{path}: the token must be a non-empty string, got {token!r:.60}")
    if not isinstance(embedding, torch.Tensor):
        raise ValueError(f"{path}: the value for {token!r} is not a tensor")
    if not embedding.is_floating_point():  # complex is not floating point: its imaginary part would be dropped
        raise ValueError(f"{path}: the embedding of {token!r} is {embedding.dtype}, expected a floating-point vector")
    if embedding.dim() == 2 and embedding.shape[0] == 1:
        embedding = embedding[0]
    if embedding.dim() != 1 or embedding.numel() == 0:
        raise ValueError(
            f"{path}: the embedding of {token!r} has shape {tuple(embedding.shape)}, expected one vector [d] or [1, d]"
        )
    embedding = embedding.float()
    if not bool(torch.isfinite(embedding).all()):
        raise ValueError(f"{path}: the embedding of {token!r} holds NaN or infinite values")
    return str(token), embedding


TOKEN_FILE_SUFFIXES = (".safetensors", ".bin")


@dataclass
class TokenFile:
    label: int
    path: Path
    token: str
    embedding: Any  # [d] float32


def read_token_dir(directory: str | Path) -> dict[int, TokenFile]:
    """Every class token of a folder, checked: ``LABEL.safetensors`` or ``LABEL.bin`` (LABEL in ASCII digits), one file
    per label (``0.bin`` and ``00.bin`` are the same label), each one finite floating-point vector, one width for all,
    no token string twice. Other files (``tokens.json``, hidden temporaries) are ignored. Errors name the file."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"tokens {directory}: not a directory of learned class tokens")
    by_label: dict[int, TokenFile] = {}
    by_token: dict[str, Path] = {}
    width: tuple[int, Path] | None = None
    for path in sorted(directory.iterdir()):
        if path.name.startswith(".") or path.suffix not in TOKEN_FILE_SUFFIXES:
            continue
        stem = path.name[: -len(path.suffix)]
        if not re.fullmatch(r"[0-9]+", stem, flags=re.ASCII):
            raise ValueError(
                f"{path}: a token file is named LABEL{path.suffix} with LABEL the class index in ASCII digits "
                "(0-9); rename or remove it"
            )
        label = int(stem)
        if label in by_label:
            raise ValueError(f"{path}: label {label} already has a token file, {by_label[label].path.name}; keep one")
        if not path.is_file():
            raise ValueError(f"{path}: not a regular file")
        token, embedding = load_token(path)
        if token in by_token:
            raise ValueError(f"{path}: token {token!r} is also in {by_token[token].name}; each class needs its own")
        if width is not None and embedding.numel() != width[0]:
            raise ValueError(
                f"{path}: embedding width {embedding.numel()}, but {width[1].name} has {width[0]}; the tokens of one "
                "folder are for one text encoder"
            )
        width = width or (embedding.numel(), path)
        by_label[label] = TokenFile(label, path, token, embedding)
        by_token[token] = path
    if not by_label:
        raise ValueError(f"tokens {directory}: no LABEL.safetensors or LABEL.bin token files")
    return by_label


def check_tokens_for_encoder(tokens: dict[int, TokenFile], tokenizer: Any, embeddings: Any) -> None:
    """Before loading the tokens into a text encoder: each has the encoder's width, is not already a word of its
    vocabulary, and has a norm within ``MAX_NORM_RATIO`` times the largest of the vocabulary's rows."""
    width = embeddings.shape[1]
    largest = float(embeddings.detach().float().norm(dim=1).max())
    vocabulary = tokenizer.get_vocab()
    for entry in tokens.values():
        if entry.embedding.numel() != width:
            raise ValueError(
                f"{entry.path}: embedding width {entry.embedding.numel()}, but the text encoder's is {width}: these "
                "tokens were learned for another model"
            )
        if entry.token in vocabulary:
            raise ValueError(
                f"{entry.path}: token {entry.token!r} is already a word of the text encoder's vocabulary; a class "
                "token needs a new string (e.g. <name-LABEL>)"
            )
        norm = float(entry.embedding.norm())
        if norm > MAX_NORM_RATIO * largest:
            raise ValueError(
                f"{entry.path}: embedding norm {norm:.3g} is more than {MAX_NORM_RATIO:g} times the largest word's "
                f"({largest:.3g}); this is not a learned token of this model"
            )


# A learned token stays near the word embeddings' scale (ImageNet*'s training even pins it to its initialiser's norm);
# one far beyond every word's norm is a broken or foreign file, and would swamp the prompt.
MAX_NORM_RATIO = 10.0
