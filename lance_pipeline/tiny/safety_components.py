"""A tiny, randomly initialised Stable Diffusion safety checker for tests and the offline demo presets.

The real checker (``CompVis/stable-diffusion-safety-checker``, Rombach et al., CVPR 2022; the diffusers class
``StableDiffusionSafetyChecker``) is a CLIP ViT-L/14 vision tower and projection plus 17 concept and 3 special-care
embeddings, each with its threshold: an image is flagged when its projected embedding is more cosine-similar to a
concept than that concept's threshold. This module writes the same class at a tiny size (``save_pretrained``:
``config.json`` and ``model.safetensors``) beside a ``CLIPImageProcessor`` (``preprocessor_config.json``), the layout
of the real repository, so ``lance_pipeline.screening.safety_checker`` loads both through the code that loads the real
one. Weights are random (``torch.manual_seed(0)``); the thresholds are 1.0, which no cosine similarity exceeds, so
the stand-in flags nothing. ``flag_everything=True`` writes thresholds of -1.0 instead (a test of the drop path).
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

TINY_VISION = {
    "hidden_size": 32,
    "intermediate_size": 37,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 32,
    "patch_size": 8,
}
TINY_TEXT = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 2}
PROJECTION_DIM = 16


def create_tiny_safety_checker(path: str | Path, flag_everything: bool = False) -> Path:
    """Write the tiny checker and its image processor to ``path`` (created if missing); return ``path``."""
    import torch
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
    from transformers import CLIPConfig, CLIPImageProcessor

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = CLIPConfig(text_config=TINY_TEXT, vision_config=TINY_VISION, projection_dim=PROJECTION_DIM)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        checker = StableDiffusionSafetyChecker(config).eval()
        with torch.no_grad():
            checker.concept_embeds.copy_(torch.randn(17, PROJECTION_DIM))
            checker.special_care_embeds.copy_(torch.randn(3, PROJECTION_DIM))
            threshold = -1.0 if flag_everything else 1.0
            checker.concept_embeds_weights.fill_(threshold)
            checker.special_care_embeds_weights.fill_(threshold)
    checker.save_pretrained(path, safe_serialization=True)
    processor = CLIPImageProcessor(
        size={"shortest_edge": TINY_VISION["image_size"]},
        crop_size={"height": TINY_VISION["image_size"], "width": TINY_VISION["image_size"]},
    )
    processor.save_pretrained(path)
    logger.info("wrote a tiny safety checker to %s", path)
    return path
