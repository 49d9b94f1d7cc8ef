"""Class tokens by textual inversion, as dataset interfaces (ImageNet*) learn them.

Vendrow, Jain, Engstrom, Madry, "Dataset Interfaces: Diagnosing Model Failures Using Controllable Counterfactual
Generation" (arXiv 2302.07865), after Gal et al., "An Image is Worth One Word" (ICLR 2023). One new token per class is
added to Stable Diffusion's text encoder and trained on that class's real images, so that "a photo of a <token> in
the snow" generates the class *as the source dataset shows it*. Only the new token's embedding row trains; the VAE,
the UNet and the rest of the text encoder are frozen. The row starts at the mean embedding of the class name's word
pieces and its norm is held at that initialiser's norm after every step (ImageNet*'s "magnitude target").

Defaults are the paper's / MadryLab code's (``TextualInversionOptions``): Stable Diffusion 2, 3,000 steps, AdamW,
constant lr 5e-4, batch 1, 768 px, centre crop, random horizontal flip, random object templates.

Tokens are saved as safetensors holding ``{token: embedding[1, d]}``, the layout diffusers'
``load_textual_inversion`` reads. The released ImageNet* tokens (``{i}.bin``, a pickled ``{placeholder: tensor}``)
are read with ``torch.load(weights_only=True)``, which refuses any pickled object other than tensors and containers.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

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


@dataclass
class TextualInversionOptions:
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
        weight_decay: AdamW weight decay on the token row (1e-2, the reference script's AdamW default).
        seed: Base seed; each class's training RNG derives from it and the class's token.
    """

    model: str = DEFAULT_MODEL
    revision: str | None = DEFAULT_REVISION
    steps: int = 3000
    learning_rate: float = 5e-4
    batch_size: int = 1
    resolution: int = 768
    center_crop: bool = True
    flip_p: float = 0.5
    templates: tuple[str, ...] = OBJECT_TEMPLATES
    weight_decay: float = 1e-2
    seed: int = 0

    def __post_init__(self) -> None:
        self.templates = tuple(self.templates)
        for name in ("steps", "batch_size", "resolution"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"textual inversion {name} {value!r}: expected a positive integer")
        if self.resolution % 8:
            raise ValueError(f"textual inversion resolution {self.resolution}: must be a multiple of 8")
        if not 0.0 <= self.flip_p <= 1.0:
            raise ValueError(f"textual inversion flip_p {self.flip_p!r}: expected a probability in [0, 1]")
        if not self.templates or any("{}" not in t for t in self.templates):
            raise ValueError("textual inversion templates: each template needs one '{}' for the token")

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

    def _batch(self, images: list[Any], rng: random.Random) -> Any:
        """``batch_size`` training images: crop (centre or random), resize, random flip, to [-1, 1]."""
        import numpy as np
        import torch
        from PIL import Image

        size = self.options.resolution
        tensors = []
        for _ in range(self.options.batch_size):
            image = images[rng.randrange(len(images))].convert("RGB")
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

    def learn(self, images: list[Any], class_name: str, token: str, *, progress: Any = None) -> LearnedToken:
        """Learn ``token`` for ``class_name`` from ``images`` (PIL). Deterministic for a given seed and token.

        Steps (Gal et al., Alg. 1, with ImageNet*'s norm constraint):
        1. add the token, initialised at the mean embedding of the class name's word pieces;
        2. per step: sample images and a template, encode with the frozen VAE, add noise at a random timestep, and
           regress the UNet's target (noise or v) conditioned on the prompt with the token;
        3. AdamW updates the whole embedding matrix but every row except the token's is restored afterwards, and the
           token's row is rescaled to the initialiser's norm.
        """
        import torch
        import torch.nn.functional as F

        if not images:
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
        embedding_layer.weight.requires_grad_(True)
        frozen_rows = embedding_layer.weight.detach().clone()
        keep = torch.ones(frozen_rows.shape[0], dtype=torch.bool, device=frozen_rows.device)
        keep[token_id] = False
        optimizer = torch.optim.AdamW([embedding_layer.weight], lr=opts.learning_rate, weight_decay=opts.weight_decay)
        scaling = self.vae.config.scaling_factor
        prediction_type = self.noise_scheduler.config.prediction_type
        num_timesteps = self.noise_scheduler.config.num_train_timesteps
        losses: list[float] = []
        self.text_encoder.train()  # dropout-free CLIP: train() changes nothing but states the intent
        try:
            for _step in range(opts.steps):
                # 2. one denoising-regression step.
                pixels = self._batch(images, rng)
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
                # 3. only the token's row moves, and its norm stays the initialiser's.
                with torch.no_grad():
                    weight = embedding_layer.weight
                    weight[keep] = frozen_rows[keep]
                    row = weight[token_id]
                    weight[token_id] = row * (target_norm / row.norm().clamp_min(1e-12))
                losses.append(loss.detach().item())
                if progress is not None:
                    progress.update(1)
        finally:
            embedding_layer.weight.requires_grad_(False)
            self.text_encoder.eval()
        learned = embedding_layer.weight[token_id].detach().float().cpu().clone()
        if not math.isfinite(float(learned.norm())):
            raise FloatingPointError(f"class {class_name!r}: token embedding diverged")
        return LearnedToken(token, class_name, learned, target_norm, losses)


# -- token files ------------------------------------------------------------------------------------------------------
def save_token(path: str | Path, learned: LearnedToken, metadata: dict[str, str] | None = None) -> Path:
    """Write ``{token: embedding[1, d]}`` as safetensors (diffusers ``load_textual_inversion`` reads it)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{__import__('os').getpid()}.tmp")
    save_file({learned.token: learned.embedding.reshape(1, -1).contiguous()}, str(tmp), metadata=metadata or {})
    tmp.replace(path)  # a killed run leaves no half-written token behind
    return path


def load_token(path: str | Path) -> tuple[str, Any]:
    """Read a token file: our safetensors, or a released ImageNet* ``.bin`` without unpickling arbitrary objects.

    Returns:
        (placeholder token, embedding [d]).
    """
    import torch

    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        try:
            state = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as err:  # weights_only refuses any non-tensor object: the file is not a plain token file
            raise ValueError(
                f"{path}: not a plain token file ({type(err).__name__}); only tensors and dicts of tensors are read, "
                "never other pickled objects"
            ) from err
    if isinstance(state, dict) and "string_to_param" in state:  # the Automatic1111 layout
        state = state["string_to_param"]
    if not isinstance(state, dict) or len(state) != 1:
        raise ValueError(f"{path}: expected exactly one token -> embedding entry, found {type(state).__name__}")
    ((token, embedding),) = state.items()
    if not isinstance(embedding, torch.Tensor):
        raise ValueError(f"{path}: the value for {token!r} is not a tensor")
    return str(token), embedding.reshape(-1).float()
