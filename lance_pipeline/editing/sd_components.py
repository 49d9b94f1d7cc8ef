"""Stable Diffusion components (UNet, VAE, text encoder, tokenizer, DDIM config) as the image editors load them.

An editor owns the components it loads. Editors of one process that ask for the same checkpoint, revision, dtype
and device share one loaded copy through a weak-value map: it holds nothing alive, so the weights are freed once
the last editor that uses them is gone (no module-global cache to clear). The components are never modified:
attention processors are swapped only for the duration of a sampling run and restored afterwards, schedulers are
fresh copies made from the checkpoint's config, and no gradient ever lands on a model parameter.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "CompVis/stable-diffusion-v1-4"
# The commit of CompVis/stable-diffusion-v1-4 that holds the safetensors weights (main as of 2023-2025).
DEFAULT_REVISION = "133a221b8aa7292a167afc5127cb63fb5005638b"
# The DDIM settings of the prompt-to-prompt/null-text code that LANCE uses; betas come from the checkpoint.
DDIM_OVERRIDES = {"clip_sample": False, "set_alpha_to_one": False}
DTYPES = ("float32", "float16", "bfloat16")
# torch.compile modes offered for the UNet (compile_unet). "reduce-overhead" is left out: its CUDA graphs reuse output
# buffers between calls, while the sampler keeps earlier outputs (trunk rows forked into branches).
COMPILE_MODES = ("none", "default", "max-autotune-no-cudagraphs")
# Dynamo compiles one graph per block class and distinct shape: the SD 1.x UNet has 22 residual blocks of 12 distinct
# parameter shapes and 16 feed-forward layers of 3, plus recompiles when a batch size or resolution turns dynamic and
# separate graphs with gradients (null-text). The default limit (8 per class) would silently leave most blocks eager,
# so compile_unet raises it to at least this.
COMPILE_RECOMPILE_LIMIT = 256


@dataclass(eq=False)
class StableDiffusionComponents:
    """Loaded Stable Diffusion components (shared between editors, never modified)."""

    unet: Any
    vae: Any
    text_encoder: Any
    tokenizer: Any
    scheduler_config: dict
    model: str
    revision: str | None
    compile: str = "none"  # COMPILE_MODES: how the UNet's blocks were compiled (compile_unet)
    compiled_modules: int = 0

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def latent_multiple(self) -> int:
        """Image sizes must be multiples of this (VAE downsampling times UNet downsampling)."""
        return self.vae_scale_factor * 2 ** (len(self.unet.config.block_out_channels) - 1)


_SHARED: weakref.WeakValueDictionary[tuple, StableDiffusionComponents] = weakref.WeakValueDictionary()
_SHARED_LOCK = threading.Lock()


def load_stable_diffusion_components(
    model: str = DEFAULT_MODEL,
    revision: str | None = DEFAULT_REVISION,
    dtype: str = "float32",
    device: str = "cpu",
    cache_dir: str | None = None,
    compile: str = "none",
) -> StableDiffusionComponents:
    """Load UNet, VAE, CLIP text encoder, tokenizer and the DDIM scheduler config of a diffusers checkpoint.

    The same code loads a Hub id at a pinned revision and a local directory (e.g. the tiny components of
    ``tiny_image_components``). Weights are safetensors only. The scheduler is DDIM with the checkpoint's betas
    and the prompt-to-prompt settings ``clip_sample=False, set_alpha_to_one=False``. The models are frozen
    (``requires_grad_(False)``, eval mode). A copy already loaded by another live editor with the same
    (model, revision, dtype, device, compile) is shared instead of loaded again (so the UNet is compiled once per
    loaded copy, and a compiled copy is never handed to an editor that asked for eager components).

    Args:
        model: Hub id or local directory.
        revision: Hub revision (ignored for a local directory).
        dtype: One of ``DTYPES``.
        device: Torch device string.
        cache_dir: Hugging Face cache directory.
        compile: One of ``COMPILE_MODES``; not ``"none"``: ``compile_unet`` with that mode.

    Returns:
        The components.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {compile!r}")
    local = os.path.isdir(model)
    revision = None if local else revision
    key = (os.path.abspath(model) if local else model, revision, dtype, str(device), compile)
    with _SHARED_LOCK:
        components = _SHARED.get(key)
        if components is None:
            components = _load(model, revision, dtype, device, cache_dir)
            if compile != "none":
                components.compiled_modules = compile_unet(components.unet, compile)
                components.compile = compile
            _SHARED[key] = components
    return components


def compile_unet(unet, mode: str = "default", backend: str = "inductor") -> int:
    """``torch.compile`` the UNet's residual blocks and feed-forward layers in place; returns how many.

    Regional, not whole-model: prompt-to-prompt swaps the attention processors for each sampling run and its
    controller decides per step in Python which layers to edit, so a compiled whole UNet would recompile at every
    step (and fall back to eager). The residual blocks (convolutions, group norms, SiLU: most of the UNet's FLOPs at
    high resolution) and the transformer blocks' GEGLU feed-forward layers hold no controlled attention; the
    attention layers stay eager (SDPA where uncontrolled, as before). Compilation is lazy: each block compiles at its
    first call (minutes for the SD 1.x UNet), then runs compiled for the life of the loaded components. Gradients
    (null-text optimisation) flow through the compiled blocks. The VAE is not compiled: an SD 1.x decode at 512 px
    is 2.5 TFLOP (counted with ``FlopCounterMode``), six per edit (one per sweep value) against ~310 UNet
    sample-forward-equivalents x 0.803 TFLOP, so about 6 % of an edit, of which compiling could save a fraction.

    Args:
        unet: A diffusers ``UNet2DConditionModel`` (modified in place: ``nn.Module.compile`` on its blocks; the
            parameters and state dict are unchanged).
        mode: ``"default"`` or another torch.compile mode of ``COMPILE_MODES``.
        backend: The torch.compile backend (``"inductor"``; another backend such as ``"eager"`` for debugging).
    """
    import torch
    from diffusers.models.attention import FeedForward
    from diffusers.models.resnet import ResnetBlock2D

    if mode not in COMPILE_MODES or mode == "none":
        raise ValueError(f"compile mode must be one of {COMPILE_MODES[1:]}, got {mode!r}")
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, COMPILE_RECOMPILE_LIMIT)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * COMPILE_RECOMPILE_LIMIT)
    blocks = [m for m in unet.modules() if isinstance(m, (ResnetBlock2D, FeedForward))]
    for block in blocks:
        block.compile(mode=None if mode == "default" else mode, backend=backend)
    logger.info("torch.compile (%s, mode %s): %d UNet blocks, compiled at first use", backend, mode, len(blocks))
    return len(blocks)


def _load(model: str, revision: str | None, dtype: str, device: str, cache_dir: str | None):
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

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
    logger.info("loaded Stable Diffusion components %s@%s (%s) on %s", model, revision, dtype, device)
    return StableDiffusionComponents(
        unet=unet,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler_config=scheduler_config,
        model=model,
        revision=revision,
    )
