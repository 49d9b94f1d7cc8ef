"""A random-weight VGG16 backbone for LPIPS (``lance_pipeline.preservation``), for tests and the offline demos.

The real backbone is torchvision's ImageNet VGG16 as timm publishes it (``timm/vgg16.tv_in1k``: ``config.json`` and
``model.safetensors``, the convolutional layers under ``features.N``). LPIPS reads only those layers, and its linear
weights fix their widths (64, 128, 256, 512, 512 channels), so the stand-in is VGG16's ``features`` at full size
(14.7 M parameters, 59 MB) with torchvision's random initialisation after ``torch.manual_seed(0)``, written in the
same layout; ``lance_pipeline.preservation`` loads it through the code that loads the Hub copy.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def create_tiny_lpips_backbone(path: str | Path) -> Path:
    """Write the random VGG16 features (``model.safetensors``) and a timm-style ``config.json`` to ``path``."""
    import torch
    from safetensors.torch import save_file
    from torchvision.models.vgg import cfgs, make_layers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        features = make_layers(cfgs["D"], batch_norm=False)
    tensors = {f"features.{name}": t.contiguous() for name, t in features.state_dict().items()}
    save_file(tensors, str(path / "model.safetensors"))
    config = {"architecture": "vgg16", "num_features": 512, "note": "random weights (lance-cf demo stand-in)"}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    logger.info("wrote a random VGG16 backbone for LPIPS to %s", path)
    return path
