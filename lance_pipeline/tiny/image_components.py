"""Tiny, randomly initialised Stable Diffusion components for tests and the offline ``demo`` preset.

The components are the real diffusers/transformers classes that Stable Diffusion uses (Rombach et al.,
CVPR 2022): ``UNet2DConditionModel``, ``AutoencoderKL``, ``CLIPTextModel`` with a ``CLIPTokenizer`` and a
``DDIMScheduler`` with the betas of LANCE (Prabhu et al., NeurIPS 2023) and prompt-to-prompt (Hertz et al.,
ICLR 2023). They are written as a diffusers-loadable directory, so the product loads them through exactly the
code that loads ``CompVis/stable-diffusion-v1-4`` (``sd_components.load_stable_diffusion_components``).

The tokenizer is the real CLIP BPE tokenizer: its vocabulary and merges are derived from the BPE file that
open_clip ships (``open_clip.tokenizer.default_bpe()``), the same construction as OpenAI's ``SimpleTokenizer``,
so nothing is downloaded. Weights are random (``torch.manual_seed(0)``): images generated with these
components are noise, which is all the tests and the demo need.
"""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# Scheduler settings of the prompt-to-prompt / null-text notebooks, used unchanged by the LANCE code.
PAPER_DDIM_CONFIG = {
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "clip_sample": False,
    "set_alpha_to_one": False,
    "steps_offset": 1,
    "num_train_timesteps": 1000,
}

TEXT_HIDDEN_SIZE = 32
MAX_TEXT_TOKENS = 77


def _bytes_to_unicode() -> dict[int, str]:
    """The reversible byte -> printable-unicode table of GPT-2/CLIP BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs], strict=True))


def write_clip_tokenizer_files(directory: str | Path) -> tuple[Path, Path]:
    """Write ``vocab.json`` and ``merges.txt`` of the CLIP BPE tokenizer from open_clip's bundled vocabulary.

    Args:
        directory: Where to write the two files (created if missing).

    Returns:
        The paths of ``vocab.json`` and ``merges.txt``.
    """
    import open_clip

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with gzip.open(open_clip.tokenizer.default_bpe(), "rt", encoding="utf-8") as handle:
        lines = handle.read().split("\n")
    # Same slice as OpenAI's SimpleTokenizer: 49152 - 256 - 2 merges after the version header.
    merges = [tuple(line.split()) for line in lines[1 : 49152 - 256 - 2 + 1]]
    vocab = list(_bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab]
    vocab.extend("".join(merge) for merge in merges)
    vocab.extend(["<|startoftext|>", "<|endoftext|>"])
    vocab_path = directory / "vocab.json"
    merges_path = directory / "merges.txt"
    vocab_path.write_text(json.dumps({token: index for index, token in enumerate(vocab)}), encoding="utf-8")
    merges_path.write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n", encoding="utf-8")
    return vocab_path, merges_path


def create_tiny_stable_diffusion(path: str | Path, sample_size: int = 16) -> Path:
    """Write a tiny, deterministic, diffusers-loadable Stable Diffusion directory.

    Layout: ``unet/``, ``vae/``, ``text_encoder/``, ``tokenizer/``, ``scheduler/`` and ``model_index.json``,
    weights in safetensors. Two calls produce byte-identical weights.

    Args:
        path: Output directory (created if missing).
        sample_size: The UNet's nominal latent size (informational; image sizes must be multiples of 8).

    Returns:
        ``path`` as a ``Path``.
    """
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    # 1. Tokenizer: the real CLIP BPE, written from open_clip's vocabulary.
    tokenizer_dir = path / "tokenizer"
    vocab_path, merges_path = write_clip_tokenizer_files(tokenizer_dir)
    vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
    merges = [tuple(line.split()) for line in merges_path.read_text(encoding="utf-8").splitlines()[1:] if line]
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=MAX_TEXT_TOKENS, pad_token="<|endoftext|>")
    tokenizer.save_pretrained(tokenizer_dir)

    # 2. Models, each after a fresh seed so each is deterministic on its own.
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=sample_size,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(8, 16),
        # Attention only below full latent resolution keeps CPU runs fast (few query tokens).
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=TEXT_HIDDEN_SIZE,
        attention_head_dim=4,
        norm_num_groups=4,
    )
    torch.manual_seed(0)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        # Three blocks: 4x spatial downsampling, so a 64-pixel image has a 16x16 latent.
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 16, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=sample_size * 4,
    )
    torch.manual_seed(0)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=TEXT_HIDDEN_SIZE,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=MAX_TEXT_TOKENS,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    unet.save_pretrained(path / "unet", safe_serialization=True)
    vae.save_pretrained(path / "vae", safe_serialization=True)
    text_encoder.save_pretrained(path / "text_encoder", safe_serialization=True)
    DDIMScheduler(**PAPER_DDIM_CONFIG).save_pretrained(path / "scheduler")

    # 3. model_index.json, so DiffusionPipeline-style tools recognise the directory too.
    import diffusers

    model_index = {
        "_class_name": "StableDiffusionPipeline",
        "_diffusers_version": diffusers.__version__,
        "feature_extractor": [None, None],
        "requires_safety_checker": False,
        "safety_checker": [None, None],
        "scheduler": ["diffusers", "DDIMScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "unet": ["diffusers", "UNet2DConditionModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    (path / "model_index.json").write_text(json.dumps(model_index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    logger.info("wrote tiny Stable Diffusion components to %s", path)
    return path
