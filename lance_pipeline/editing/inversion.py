"""DDIM inversion and null-text optimisation of a real image.

Mokady, Hertz, Aberman, Pritch, Cohen-Or, "Null-text Inversion for Editing Real Images using Guided Diffusion
Models", CVPR 2023 (arXiv 2211.09794), as used by LANCE (Prabhu et al., NeurIPS 2023, section 3.2).

1. The image is encoded with the VAE (posterior mean times ``vae.config.scaling_factor``).
2. DDIM inversion with the caption embedding only (guidance 1) gives the pivot trajectory ``z*_0 .. z*_T``
   (diffusers' ``DDIMInverseScheduler``, configured like the sampling ``DDIMScheduler``).
3. Null-text optimisation: for each sampling step ``i`` a fresh null (unconditional) embedding, initialised from
   the previous step's result, is optimised with Adam (lr ``1e-2 * (1 - i/100)``) for up to ``num_inner_steps``
   iterations so that one guided DDIM step (guidance 7.5) from the current latent lands on the pivot ``z*_{t-1}``;
   it stops early once the loss is below ``early_stop_epsilon + i * 2e-5`` (the notebook's schedule). The current
   latent then advances with the optimised embedding.

Sampling from ``z*_T`` with the per-step null embeddings (``ddim_sample``) reconstructs the image; editing runs
the same sampler with prompt-to-prompt attention control (``attention_control``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from PIL import Image

from lance_pipeline.editing.attention_control import PromptToPromptController, attention_control
from lance_pipeline.registry import INVERSIONS

logger = logging.getLogger(__name__)

# Schedule of the null-text notebook's early stop: the threshold grows by this much per step.
EARLY_STOP_GROWTH_PER_STEP = 2e-5
# Adam learning rate of step i is NULL_TEXT_LR * (1 - i / NULL_TEXT_LR_DECAY_STEPS) (Mokady et al. notebook).
NULL_TEXT_LR = 1e-2
NULL_TEXT_LR_DECAY_STEPS = 100.0


@dataclass
class InversionResult:
    """What null-text inversion produces for one image.

    Attributes:
        latent: ``x_T``, ``[1, C, h, w]``.
        null_embeddings: ``[steps, tokens, dim]``, one optimised null embedding per sampling step.
        pivot_latents: The DDIM-inversion trajectory ``[z*_0, ..., z*_T]`` (``z*_0`` is the encoded image).
        inner_steps: Adam iterations used at each step (the early stop's effect).
    """

    latent: torch.Tensor
    null_embeddings: torch.Tensor
    pivot_latents: list[torch.Tensor]
    inner_steps: list[int]


def progress(iterable, desc: str, total: int | None = None):
    """A progress bar over a long loop inside a stage (a GPU build never sits silent for minutes).

    Shown under the build's own bar and removed when done; off when stderr is not a terminal (tests, logs).
    """
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, leave=False, disable=None, unit="step")


def encode_prompts(tokenizer, text_encoder, prompts: list[str]) -> torch.Tensor:
    """Text embeddings ``[n, model_max_length, dim]`` (padded to ``model_max_length``, truncated beyond)."""
    tokens = tokenizer(
        prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True, return_tensors="pt"
    )
    with torch.no_grad():
        return text_encoder(tokens.input_ids.to(text_encoder.device))[0]


def prompt_token_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of ``prompt`` with BOS and EOS, no padding, truncated to ``model_max_length``."""
    return tokenizer(prompt, truncation=True, max_length=tokenizer.model_max_length).input_ids


def encode_image(vae, image: Image.Image, size: int) -> torch.Tensor:
    """VAE latent of an RGB image (posterior mean, scaled by ``vae.config.scaling_factor``)."""
    if image.size != (size, size):
        image = image.convert("RGB").resize((size, size), Image.Resampling.BICUBIC)
    array = np.asarray(image.convert("RGB"), dtype=np.float32) / 127.5 - 1.0
    pixels = torch.from_numpy(array).permute(2, 0, 1)[None].to(vae.device, vae.dtype)
    with torch.no_grad():
        latent = vae.encode(pixels).latent_dist.mean
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    return (latent - shift) * vae.config.scaling_factor


def decode_latents(vae, latents: torch.Tensor) -> list[Image.Image]:
    """Decode scaled latents to RGB images."""
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    with torch.no_grad():
        pixels = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor + shift).sample
    arrays = ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(a) for a in arrays]


def make_schedulers(scheduler_config: dict, num_inference_steps: int, device):
    """Fresh sampling and inverse DDIM schedulers (never the shared component, whose state ``set_timesteps`` changes)."""
    from diffusers import DDIMInverseScheduler, DDIMScheduler

    sampler = DDIMScheduler.from_config(scheduler_config)
    sampler.set_timesteps(num_inference_steps, device=device)
    inverse = DDIMInverseScheduler.from_config(scheduler_config)
    inverse.set_timesteps(num_inference_steps, device=device)
    return sampler, inverse


def ddim_inversion(
    unet, scheduler_config: dict, latent: torch.Tensor, cond: torch.Tensor, num_steps: int
) -> list[torch.Tensor]:
    """DDIM inversion with the conditional embedding only; returns ``[z_0, z_1, ..., z_T]``."""
    _, inverse = make_schedulers(scheduler_config, num_steps, latent.device)
    latents = [latent]
    current = latent
    with torch.no_grad():
        for t in progress(inverse.timesteps, f"DDIM inversion x{latent.shape[0]}"):
            noise = unet(current, t, encoder_hidden_states=cond).sample
            current = inverse.step(noise, t, current).prev_sample
            latents.append(current)
    return latents


def null_text_optimization(
    unet,
    scheduler_config: dict,
    pivot_latents: list[torch.Tensor],
    cond: torch.Tensor,
    null_init: torch.Tensor,
    guidance_scale: float,
    num_inner_steps: int,
    early_stop_epsilon: float,
) -> tuple[torch.Tensor, list[int]]:
    """Optimise one null embedding per step along the pivot trajectory (Mokady et al., Algorithm 1).

    Args:
        unet: The UNet (its parameters are not updated; gradients are taken w.r.t. the embedding only).
        scheduler_config: The DDIM scheduler config.
        pivot_latents: ``[z*_0, ..., z*_T]`` from ``ddim_inversion``.
        cond: Caption embedding ``[1, tokens, dim]``.
        null_init: Embedding of the empty prompt ``[1, tokens, dim]``.
        guidance_scale: Classifier-free guidance scale (7.5).
        num_inner_steps: Maximum Adam iterations per step (10).
        early_stop_epsilon: Base early-stop threshold (1e-5).

    Returns:
        ``([steps, tokens, dim] null embeddings, inner steps used per step)``.
    """
    num_steps = len(pivot_latents) - 1
    sampler, _ = make_schedulers(scheduler_config, num_steps, cond.device)
    null = null_init.detach().clone()
    current = pivot_latents[-1]
    nulls, used = [], []
    for i, t in enumerate(sampler.timesteps):
        target = pivot_latents[num_steps - i - 1]
        null = null.detach().clone().requires_grad_(True)
        optimizer = torch.optim.Adam([null], lr=NULL_TEXT_LR * (1.0 - i / NULL_TEXT_LR_DECAY_STEPS))
        with torch.no_grad():
            noise_cond = unet(current, t, encoder_hidden_states=cond).sample
        steps_here = 0
        for _ in range(num_inner_steps):
            noise_uncond = unet(current, t, encoder_hidden_states=null).sample
            noise = noise_uncond + guidance_scale * (noise_cond - noise_uncond)
            previous = sampler.step(noise, t, current).prev_sample
            loss = torch.nn.functional.mse_loss(previous, target)
            # autograd.grad instead of backward(): no gradient ever lands on the (shared) UNet's parameters.
            (null.grad,) = torch.autograd.grad(loss, [null])
            optimizer.step()
            steps_here += 1
            if loss.item() < early_stop_epsilon + i * EARLY_STOP_GROWTH_PER_STEP:
                break
        null = null.detach()
        nulls.append(null[0])
        used.append(steps_here)
        with torch.no_grad():
            batch = torch.cat([current, current])
            noise_uncond, noise_cond = unet(batch, t, encoder_hidden_states=torch.cat([null, cond])).sample.chunk(2)
            noise = noise_uncond + guidance_scale * (noise_cond - noise_uncond)
            current = sampler.step(noise, t, current).prev_sample
    return torch.stack(nulls), used


def null_text_optimization_batched(
    unet,
    scheduler_config: dict,
    pivot_latents: list[torch.Tensor],
    cond: torch.Tensor,
    null_init: torch.Tensor,
    guidance_scale: float,
    num_inner_steps: int,
    early_stop_epsilon: float,
) -> tuple[torch.Tensor, list[list[int]], torch.Tensor]:
    """``null_text_optimization`` for a batch of images at once, with no host sync inside the inner loop.

    Each image has its own null embedding and its own Adam state (Adam is element-wise, and the summed loss gives
    each embedding the gradient of its own loss), so every image follows the schedule it would follow alone: the
    same learning rate, the same early stop. An image that has stopped keeps its embedding while the others go on
    (its row still rides along in the batch). Adam is written out (torch.optim.Adam's update with a per-image step
    count), and the "has every image stopped?" check on CUDA reads a flag copied asynchronously one iteration
    earlier, so the inner loop never waits for the device; an extra iteration changes nothing (stopped rows are
    masked). Per-step iteration counts are read once per sampling step.

    Args:
        pivot_latents: ``[z*_0, ..., z*_T]``, each ``[n, C, h, w]``.
        cond: Caption embeddings ``[n, tokens, dim]``.
        null_init: Empty-prompt embedding ``[1 or n, tokens, dim]``.
        (other arguments as ``null_text_optimization``)

    Returns:
        ``(null embeddings [n, steps, tokens, dim], inner steps per image per step, final latents [n, C, h, w])``;
        the final latents are the reconstruction's: the guided step with the optimised embedding is the
        reconstruction sampler's step.
    """
    beta1, beta2, eps = 0.9, 0.999, 1e-8  # torch.optim.Adam defaults
    num_steps = len(pivot_latents) - 1
    n = cond.shape[0]
    device = cond.device
    sampler, _ = make_schedulers(scheduler_config, num_steps, device)
    null = null_init.detach().expand(n, -1, -1).clone()
    current = pivot_latents[-1]
    nulls, used = [], [[] for _ in range(n)]
    shape = (n,) + (1,) * (null.ndim - 1)
    use_event = device.type == "cuda"
    for i, t in enumerate(progress(sampler.timesteps, f"null-text x{n}")):
        target = pivot_latents[num_steps - i - 1]
        lr = NULL_TEXT_LR * (1.0 - i / NULL_TEXT_LR_DECAY_STEPS)
        threshold = early_stop_epsilon + i * EARLY_STOP_GROWTH_PER_STEP
        with torch.no_grad():
            noise_cond = unet(current, t, encoder_hidden_states=cond).sample
        exp_avg = torch.zeros_like(null, dtype=torch.float32)
        exp_avg_sq = torch.zeros_like(null, dtype=torch.float32)
        adam_steps = torch.zeros(shape, device=device)
        active = torch.ones(n, dtype=torch.bool, device=device)
        flag, event = None, None
        for _ in range(num_inner_steps):
            if flag is not None and (not use_event or event.query()) and not bool(flag):
                break  # every image stopped (flag copied one iteration ago; stopped rows would not move anyway)
            variable = null.detach().requires_grad_(True)
            noise_uncond = unet(current, t, encoder_hidden_states=variable).sample
            noise = noise_uncond + guidance_scale * (noise_cond - noise_uncond)
            previous = sampler.step(noise, t, current).prev_sample
            # Per image exactly as the one-image code computes it (same reduction), so a batch of one matches it.
            loss = torch.stack([torch.nn.functional.mse_loss(previous[k], target[k]) for k in range(n)])
            (grad,) = torch.autograd.grad(loss.sum(), [variable])
            grad = grad.float()
            mask = active.view(shape)
            adam_steps = adam_steps + mask
            exp_avg = torch.where(mask, exp_avg.lerp(grad, 1 - beta1), exp_avg)
            exp_avg_sq = torch.where(mask, exp_avg_sq * beta2 + (1 - beta2) * grad * grad, exp_avg_sq)
            # Bias corrections in float64, as torch.optim.Adam computes them from Python floats.
            count = adam_steps.clamp(min=1).double()
            step_size = (lr / (1 - beta1**count)).float()
            correction = (1 - beta2**count).sqrt().float()
            denom = exp_avg_sq.sqrt() / correction + eps
            null = torch.where(mask, (null.float() - step_size * (exp_avg / denom)).to(null.dtype), null)
            active = active & ~(loss.detach() < threshold)
            if use_event:
                flag = torch.empty((), dtype=torch.bool, pin_memory=True)
                flag.copy_(active.any(), non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            else:
                flag = active.any()
        nulls.append(null.detach())
        for k, value in enumerate(adam_steps.flatten().tolist()):  # one read per sampling step
            used[k].append(int(value))
        with torch.no_grad():
            batch = torch.cat([current, current])
            noise_uncond, noise_cond = unet(batch, t, encoder_hidden_states=torch.cat([null, cond])).sample.chunk(2)
            noise = noise_uncond + guidance_scale * (noise_cond - noise_uncond)
            current = sampler.step(noise, t, current).prev_sample
    return torch.stack(nulls, dim=1), used, current


def ddim_sample(
    unet,
    scheduler_config: dict,
    latent: torch.Tensor,
    cond: torch.Tensor,
    null_embeddings: torch.Tensor,
    guidance_scale: float,
    controller: PromptToPromptController | None = None,
    source_trajectory: torch.Tensor | None = None,
) -> torch.Tensor:
    """Guided DDIM sampling from ``x_T`` with per-step null embeddings, optionally under prompt-to-prompt control.

    Args:
        unet: The UNet.
        scheduler_config: The DDIM scheduler config.
        latent: ``x_T`` ``[1, C, h, w]``, shared by every prompt of the batch.
        cond: Prompt embeddings ``[n, tokens, dim]`` (with a controller: source first, then the targets).
        null_embeddings: ``[steps, tokens, dim]``; the number of steps is taken from here.
        guidance_scale: Classifier-free guidance scale.
        controller: Prompt-to-prompt controller, or None for plain sampling.
        source_trajectory: ``[steps, C, h, w]``: row 0 is put back onto it after every step (direct inversion).

    Returns:
        Final latents ``[n, C, h, w]``.
    """
    num_steps = null_embeddings.shape[0]
    sampler, _ = make_schedulers(scheduler_config, num_steps, latent.device)
    n = cond.shape[0]
    latents = latent.expand(n, *latent.shape[1:]).clone()
    with torch.no_grad(), attention_control(unet, controller):
        for i, t in enumerate(sampler.timesteps):
            if controller is not None:
                controller.cur_step = i
            context = torch.cat([null_embeddings[i : i + 1].expand(n, -1, -1).to(cond.dtype), cond])
            noise_uncond, noise_cond = (
                unet(torch.cat([latents, latents]), t, encoder_hidden_states=context).sample.to(latents.dtype).chunk(2)
            )
            noise = noise_uncond + guidance_scale * (noise_cond - noise_uncond)
            latents = sampler.step(noise, t, latents).prev_sample
            if source_trajectory is not None:
                latents[0] = source_trajectory[i]
    return latents


class NullTextInversion:
    """Null-text inversion of real images with a set of Stable Diffusion components.

    Args:
        unet, vae, text_encoder, tokenizer: Loaded components (not modified).
        scheduler_config: The DDIM scheduler config (betas etc. from the checkpoint).
        num_inference_steps: DDIM steps (50).
        guidance_scale: Classifier-free guidance (7.5).
        num_inner_steps: Adam iterations per step (10).
        early_stop_epsilon: Early-stop base threshold (1e-5).
        image_size: Square input size in pixels (512).
    """

    def __init__(
        self,
        unet,
        vae,
        text_encoder,
        tokenizer,
        scheduler_config: dict,
        num_inference_steps: int = 50,
        guidance_scale: float = 7.5,
        num_inner_steps: int = 10,
        early_stop_epsilon: float = 1e-5,
        image_size: int = 512,
    ) -> None:
        self.unet, self.vae, self.text_encoder, self.tokenizer = unet, vae, text_encoder, tokenizer
        self.scheduler_config = dict(scheduler_config)
        self.num_inference_steps = num_inference_steps
        self.guidance_scale = guidance_scale
        self.num_inner_steps = num_inner_steps
        self.early_stop_epsilon = early_stop_epsilon
        self.image_size = image_size

    def invert(self, image: Image.Image, prompt: str) -> InversionResult:
        """Invert ``image`` described by ``prompt``."""
        latent = encode_image(self.vae, image, self.image_size).to(self.unet.dtype)
        cond = encode_prompts(self.tokenizer, self.text_encoder, [prompt]).to(self.unet.dtype)
        null_init = encode_prompts(self.tokenizer, self.text_encoder, [""]).to(self.unet.dtype)
        pivots = ddim_inversion(self.unet, self.scheduler_config, latent, cond, self.num_inference_steps)
        nulls, used = null_text_optimization(
            self.unet,
            self.scheduler_config,
            pivots,
            cond,
            null_init,
            self.guidance_scale,
            self.num_inner_steps,
            self.early_stop_epsilon,
        )
        logger.debug("null-text inversion: %d Adam steps over %d steps", sum(used), len(used))
        return InversionResult(latent=pivots[-1], null_embeddings=nulls, pivot_latents=pivots, inner_steps=used)


# ---------------------------------------------------------------------------------------------- inversion methods


@runtime_checkable
class InversionMethod(Protocol):
    """What an inversion method registered in ``lance_pipeline.registry.INVERSIONS`` implements.

    Constructed as ``Method(components, options)`` (``sd_components.StableDiffusionComponents``,
    ``editing_options.ImageEditorOptions``); never loads weights itself.

    ``invert(images, captions)`` returns one ``inversion`` record per image: a dict with

    * ``latent``: ``x_T``, ``[1, C, h, w]`` float32 on CPU;
    * ``null_embeddings``: ``[steps, tokens, dim]`` float32 on CPU, the unconditional embedding of each sampling
      step (every branch of the sampler uses it as its classifier-free-guidance negative);
    * ``caption``: the caption inverted with;
    * ``method``: the registry name;
    * ``inner_steps``: optimisation iterations per step (``[]`` for methods without optimisation);
    * optionally ``source_trajectory``: ``[steps, C, h, w]``, the latent the source branch must hold after each
      sampling step (the sampler pins branch 0 to it; direct inversion);
    * optionally ``reconstruction_latent``: ``[1, C, h, w]``, the final latent of the source branch (guided sampling
      from ``latent`` with the caption and ``null_embeddings``) when the method computed it anyway; the
      reconstruction stage then only decodes it.

    ``describe()`` returns the method's settings for the manifest.
    """

    name: str

    def invert(self, images: list[Image.Image], captions: list[str]) -> list[dict[str, Any]]: ...

    def describe(self) -> dict[str, Any]: ...


class _DDIMPivotMethod:
    """What every inversion method shares: the components and options, and DDIM inversion of the encoded batch."""

    def __init__(self, components, options) -> None:
        self.components = components
        self.options = options

    def _pivots(self, images: list[Image.Image], captions: list[str]):
        """(latent x_0, caption embeddings, DDIM inversion pivots) of a batch, in the UNet's dtype."""
        c, o = self.components, self.options
        latent, cond = _encode_batch(c, o, images, captions)
        return latent, cond, ddim_inversion(c.unet, c.scheduler_config, latent, cond, o.num_inference_steps)


class NullTextMethod(_DDIMPivotMethod):
    """``null_text``: DDIM inversion plus null-text optimisation (Mokady et al. 2023), as the paper (default)."""

    name = "null_text"

    def invert(self, images: list[Image.Image], captions: list[str]) -> list[dict[str, Any]]:
        """Invert a batch of images together (``null_text_optimization_batched``)."""
        c, o = self.components, self.options
        if not images:
            return []
        latent, cond, pivots = self._pivots(images, captions)
        null_init = encode_prompts(c.tokenizer, c.text_encoder, [""]).to(c.unet.dtype)
        nulls, used, final = null_text_optimization_batched(
            c.unet,
            c.scheduler_config,
            pivots,
            cond,
            null_init,
            o.guidance_scale,
            o.num_inner_steps,
            o.early_stop_epsilon,
        )
        logger.debug("null-text inversion of %d images: %d Adam steps", len(images), sum(map(sum, used)))
        return [
            {
                "latent": pivots[-1][k : k + 1].detach().float().cpu(),
                "null_embeddings": nulls[k].detach().float().cpu(),
                "caption": caption,
                "method": self.name,
                "inner_steps": used[k],
                "reconstruction_latent": final[k : k + 1].detach().float().cpu(),
            }
            for k, caption in enumerate(captions)
        ]

    def describe(self) -> dict[str, Any]:
        o = self.options
        return {
            "method": self.name,
            "num_inner_steps": o.num_inner_steps,
            "early_stop_epsilon": o.early_stop_epsilon,
            "learning_rate": f"{NULL_TEXT_LR} * (1 - i / {NULL_TEXT_LR_DECAY_STEPS:g})",
        }


def _encode_batch(components, options, images, captions):
    dtype = components.unet.dtype
    latent = torch.cat([encode_image(components.vae, image, options.image_size) for image in images]).to(dtype)
    cond = encode_prompts(components.tokenizer, components.text_encoder, list(captions)).to(dtype)
    return latent, cond


class NegativePromptMethod(_DDIMPivotMethod):
    """``negative_prompt``: negative-prompt inversion (Miyake et al. 2023, arXiv 2305.16807).

    DDIM inversion as null-text's first phase, then no optimisation: the caption embedding itself takes the place of
    the optimised null embedding at every step, in every branch (so the source branch's guidance term vanishes and
    its sampling is the plain DDIM inverse of the inversion). Forward-only: about 100 UNet sample-forwards per image
    (inversion and the source branch the reconstruction comes from) instead of null-text's ~1,300.
    """

    name = "negative_prompt"

    def invert(self, images: list[Image.Image], captions: list[str]) -> list[dict[str, Any]]:
        c, o = self.components, self.options
        if not images:
            return []
        latent, cond, pivots = self._pivots(images, captions)
        # The reconstruction's source branch: with the caption as negative prompt, guidance cancels out and each step
        # is one conditional prediction, so it is computed here once at batch n (not twice per step with CFG).
        sampler, _ = make_schedulers(c.scheduler_config, o.num_inference_steps, latent.device)
        current = pivots[-1]
        with torch.no_grad():
            for t in sampler.timesteps:
                noise = c.unet(current, t, encoder_hidden_states=cond).sample
                current = sampler.step(noise, t, current).prev_sample
        return [
            {
                "latent": pivots[-1][k : k + 1].detach().float().cpu(),
                "null_embeddings": cond[k].detach().float().cpu().expand(o.num_inference_steps, -1, -1).clone(),
                "caption": caption,
                "method": self.name,
                "inner_steps": [],
                "reconstruction_latent": current[k : k + 1].detach().float().cpu(),
            }
            for k, caption in enumerate(captions)
        ]

    def describe(self) -> dict[str, Any]:
        return {"method": self.name, "reference": "Miyake et al. 2023, arXiv 2305.16807"}


class DirectInversionMethod(_DDIMPivotMethod):
    """``direct``: direct inversion ("PnP Inversion", Ju et al., ICLR 2024, arXiv 2310.01506), from the paper.

    DDIM inversion gives the trajectory ``z*_0 .. z*_T``. Editing starts every branch from ``z*_T`` with the plain
    empty-prompt null embedding and full guidance, and after every sampling step puts the *source* branch back onto
    the inversion trajectory (adding the offset ``z*_{t-1} - z_{t-1}``); the target branches are not corrected and
    take the source's attention maps as usual. No optimisation: 50 UNet sample-forwards per image. The source branch
    ends exactly at ``z*_0``, the encoded image, so the reconstruction is the VAE round trip.

    Implemented from the paper's description (the authors' code has no licence and was not used).
    """

    name = "direct"

    def invert(self, images: list[Image.Image], captions: list[str]) -> list[dict[str, Any]]:
        c, o = self.components, self.options
        if not images:
            return []
        latent, cond, pivots = self._pivots(images, captions)
        null = encode_prompts(c.tokenizer, c.text_encoder, [""])[0].float().cpu()
        steps = o.num_inference_steps
        # After sampling step i the source must hold z*_{T-i-1}: the trajectory in sampling order.
        trajectory = torch.stack([pivots[steps - i - 1] for i in range(steps)], dim=1)  # [n, steps, C, h, w]
        return [
            {
                "latent": pivots[-1][k : k + 1].detach().float().cpu(),
                "null_embeddings": null.expand(steps, -1, -1).clone(),
                "caption": caption,
                "method": self.name,
                "inner_steps": [],
                "source_trajectory": trajectory[k].detach().float().cpu(),
                "reconstruction_latent": pivots[0][k : k + 1].detach().float().cpu(),
            }
            for k, caption in enumerate(captions)
        ]

    def describe(self) -> dict[str, Any]:
        return {"method": self.name, "reference": "Ju et al., ICLR 2024, arXiv 2310.01506 (implemented from the paper)"}


def make_inversion_method(name: str, components, options) -> InversionMethod:
    """The registered inversion method ``name`` (``lance_pipeline.registry.INVERSIONS``) for these components."""
    return INVERSIONS.resolve(name)(components, options)
