"""A tiny, randomly initialised open_clip model for tests and the offline ``demo`` preset.

LANCE (Prabhu et al., NeurIPS 2023, section 3.2) filters its edits with CLIP (Radford et al., ICML 2021)
ViT-L/14 scores, computed here with open_clip (Cherti et al., CVPR 2023). This module writes an open_clip
model of the same class (``open_clip.CLIP``: a vision transformer and a causal text transformer) at a tiny
size, in the directory layout open_clip itself loads through its ``local-dir:`` schema:

* ``open_clip_config.json``: ``{"model_cfg": ..., "preprocess_cfg": ...}``, the layout of open_clip's Hub
  exports (``open_clip.push_to_hf_hub``);
* ``open_clip_model.safetensors``: the weights (safetensors, never pickle).

The tokenizer is the one ViT-L-14/openai uses: ``open_clip.get_tokenizer`` returns the ``SimpleTokenizer``
over the CLIP BPE vocabulary that open_clip ships (``open_clip.tokenizer.default_bpe()``) because the config
names no Hugging Face tokenizer; the text tower's vocabulary size is therefore the real one (49408).
``clip_gates.ClipScorer(model=DIR)`` loads the directory through the same code that loads ViT-L-14/openai
or an ``hf-hub:`` id. Weights are random (``torch.manual_seed(0)``): scores are meaningless but
deterministic, which is all the tests and the demo need.
"""

from __future__ import annotations

import json
import logging
from copy import deepcopy
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CONFIG_NAME = "open_clip_config.json"  # open_clip.constants.HF_CONFIG_NAME
WEIGHTS_NAME = "open_clip_model.safetensors"  # open_clip.constants.HF_SAFE_WEIGHTS_NAME

# Tiny ViT + text tower. vocab_size is the size of the bundled CLIP BPE vocabulary (49152 - 256 - 2 merges +
# 512 byte tokens + 2 special tokens), so the real tokenizer can feed it; everything else is as small as
# open_clip allows. quick_gelu matches the OpenAI ViT-L/14 weights (open_clip's pretrained cfg says so).
TINY_OPEN_CLIP_MODEL_CFG: dict[str, Any] = {
    "embed_dim": 16,
    "quick_gelu": True,
    "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 32, "layers": 2, "head_width": 16, "mlp_ratio": 2.0},
    "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2, "mlp_ratio": 2.0},
}

# OpenAI CLIP preprocessing (open_clip.constants.OPENAI_DATASET_MEAN / _STD, bicubic, shortest-side resize).
TINY_OPEN_CLIP_PREPROCESS_CFG: dict[str, Any] = {
    "mean": [0.48145466, 0.4578275, 0.40821073],
    "std": [0.26862954, 0.26130258, 0.27577711],
    "interpolation": "bicubic",
    "resize_mode": "shortest",
}


def build_tiny_open_clip():
    """Build the tiny ``open_clip.CLIP`` in memory, with random weights drawn after ``torch.manual_seed(0)``.

    The global torch RNG state is left as it was (the seed is applied inside ``torch.random.fork_rng``).

    Returns:
        The model, in eval mode, on CPU, float32.
    """
    import open_clip
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = open_clip.CLIP(**deepcopy(TINY_OPEN_CLIP_MODEL_CFG))
    return model.eval()


def create_tiny_open_clip(path: str | Path) -> Path:
    """Write the tiny open_clip model to ``path`` in open_clip's local-directory layout.

    Args:
        path: Output directory (created if missing).

    Returns:
        The directory, loadable with ``ClipScorer(model=path)`` or ``open_clip.create_model_from_pretrained(
        "local-dir:" + path)``.
    """
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model = build_tiny_open_clip()
    config = {
        "model_cfg": deepcopy(TINY_OPEN_CLIP_MODEL_CFG),
        "preprocess_cfg": deepcopy(TINY_OPEN_CLIP_PREPROCESS_CFG),
    }
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    logger.info("Wrote tiny open_clip model (%d tensors) to %s", len(state), out)
    return out
