"""A tiny, randomly initialised ControlNet for tests and the offline ``demo-controlnet`` preset.

ControlNet (Zhang, Rao, Agrawala, ICCV 2023, "Adding Conditional Control to Text-to-Image Diffusion Models") is a
trainable copy of the Stable Diffusion UNet's encoder whose outputs enter the UNet through zero-initialised
convolutions. This module builds the real diffusers class, ``ControlNetModel``, from the tiny UNet of
``tiny_image_components`` with ``ControlNetModel.from_unet`` (the way ControlNets are initialised for training), and
writes it with ``save_pretrained`` (safetensors), so the editor loads it through the same ``from_pretrained`` call as
``lllyasviel/sd-controlnet-canny``.

A freshly initialised ControlNet's zero convolutions make it a no-op: the condition would not reach the image and a
test could not tell a wired condition from an ignored one. The zero convolutions are therefore re-drawn as small
seeded random weights (as if after a little training), so the tiny ControlNet's output depends on its condition.
Weights come from ``torch.manual_seed(0)``: two calls write byte-identical files.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from lance_pipeline.tiny.image_components import create_tiny_stable_diffusion

logger = logging.getLogger(__name__)

# The tiny VAE downsamples 4x (three blocks), so the condition encoder must too: three stages, two stride-2 convs.
TINY_CONDITIONING_CHANNELS = (8, 16, 16)
# Scale of the re-drawn zero convolutions: large enough to change the output, small enough to keep it finite.
ZERO_CONV_STD = 0.05


def create_tiny_controlnet(path: str | Path) -> Path:
    """Write a tiny ``ControlNetModel`` (config.json + safetensors) matching the tiny Stable Diffusion UNet.

    Args:
        path: Output directory (created if missing).

    Returns:
        ``path`` as a ``Path``, loadable with ``ControlNetModel.from_pretrained(path)``.
    """
    import torch
    from diffusers import ControlNetModel, UNet2DConditionModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tiny-sd-for-controlnet-") as tmp:
        sd_dir = create_tiny_stable_diffusion(Path(tmp) / "sd")
        unet = UNet2DConditionModel.from_pretrained(sd_dir, subfolder="unet", use_safetensors=True)
    torch.manual_seed(0)
    controlnet = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=TINY_CONDITIONING_CHANNELS)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        zero_convs = [*controlnet.controlnet_down_blocks, controlnet.controlnet_mid_block]
        zero_convs.append(controlnet.controlnet_cond_embedding.conv_out)
        for conv in zero_convs:
            conv.weight.copy_(torch.randn(conv.weight.shape, generator=generator) * ZERO_CONV_STD)
            conv.bias.zero_()
    controlnet.save_pretrained(path, safe_serialization=True)
    logger.info("wrote tiny ControlNet to %s", path)
    return path


def create_tiny_depth_estimator(path: str | Path) -> Path:
    """Write a tiny random ``DPTForDepthEstimation`` with its image processor (32x32 input) to ``path``.

    The real transformers class of MiDaS/DPT depth estimators (Ranftl et al., ICCV 2021), at a tiny configuration
    after ``torch.manual_seed(0)``, loadable with ``AutoModelForDepthEstimation`` / ``AutoImageProcessor``.
    """
    import torch
    from transformers import DPTConfig, DPTForDepthEstimation, DPTImageProcessor

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = DPTConfig(
        image_size=32,
        patch_size=16,
        hidden_size=32,
        num_hidden_layers=4,
        backbone_out_indices=[0, 1, 2, 3],
        num_attention_heads=4,
        intermediate_size=37,
        neck_hidden_sizes=[16, 16, 32, 32],
        reassemble_factors=[4, 2, 1, 0.5],
        fusion_hidden_size=16,
        is_hybrid=False,
    )
    torch.manual_seed(0)
    DPTForDepthEstimation(config).eval().save_pretrained(path, safe_serialization=True)
    DPTImageProcessor(size={"height": 32, "width": 32}, keep_aspect_ratio=False, ensure_multiple_of=1).save_pretrained(
        path
    )
    logger.info("wrote tiny depth estimator to %s", path)
    return path
