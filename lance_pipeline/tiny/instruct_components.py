"""Tiny, randomly initialised instruction editors for tests and the offline ``demo-instruct`` preset.

Each function writes one diffusers pipeline directory (``model_index.json`` and one subfolder per component, weights
in safetensors) of the real classes of a published instruction editor, at the smallest configuration that runs, so
the editor loads it through the very ``from_pretrained`` call that loads the pinned Hub id
(``lance_pipeline.instruct.editing.load_instruct_pipeline``):

* ``create_tiny_instruct_pix2pix``: ``StableDiffusionInstructPix2PixPipeline`` (Brooks, Holynski, Efros, CVPR 2023):
  the tiny Stable Diffusion of ``image_components`` with a UNet of 8 input channels (4 noise + 4 image latents), as
  InstructPix2Pix widens Stable Diffusion's first convolution;
* ``create_tiny_flux2_klein``: ``Flux2KleinPipeline`` (FLUX.2 [klein]): ``Flux2Transformer2DModel``,
  ``AutoencoderKLFlux2``, a ``Qwen3ForCausalLM`` text encoder and a flow-matching Euler scheduler; the text encoder
  has as many layers as the pipeline reads hidden states from by default (9, 18, 27), so the pipeline runs with its
  own defaults.

The configurations follow the sizes diffusers' own fast tests use for these classes (one block per stage, a handful
of channels), written here from the classes' signatures. The Qwen tokenizer is a byte-level BPE without merges
(every byte one token) with the ChatML template the pipeline applies, built with ``tokenizers``: nothing is
downloaded. Weights come from ``torch.manual_seed(0)`` before each model, so two calls write byte-identical files.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

from lance_pipeline.tiny.image_components import _bytes_to_unicode, create_tiny_stable_diffusion

logger = logging.getLogger(__name__)

# ChatML, as Qwen's tokenizers apply it (the pipeline passes enable_thinking=False, which this template ignores).
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2.5-VL's vision markers (the processor expands <|image_pad|> to one token per merged image patch).
QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# FLUX.2 [klein] reads the hidden states of these text-encoder layers by default (Flux2KleinPipeline.__call__).
KLEIN_TEXT_LAYERS = (9, 18, 27)
TINY_TEXT_HIDDEN = 16


def write_byte_level_qwen_tokenizer(directory: str | Path, vision: bool = False):
    """A ``Qwen2TokenizerFast``: byte-level BPE over the 256 byte symbols, no merges, ChatML specials and template
    (and Qwen2.5-VL's vision tokens with ``vision``).

    Returns:
        The tokenizer (also saved to ``directory``).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import Qwen2TokenizerFast

    vocab = {symbol: index for index, symbol in enumerate(_bytes_to_unicode().values())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    specials = QWEN_SPECIAL_TOKENS + (QWEN_VISION_TOKENS if vision else ())
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer = Qwen2TokenizerFast(
        tokenizer_object=backend,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=512,
    )
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return tokenizer


def _model_index(path: Path, class_name: str, components: dict[str, tuple[str, str] | None], **extra) -> None:
    import diffusers

    index = {"_class_name": class_name, "_diffusers_version": diffusers.__version__, **extra}
    index.update({name: list(value) if value else [None, None] for name, value in components.items()})
    (path / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _tiny_note(path: Path, what: str) -> None:
    note = {"what": what, "weights": "random, torch.manual_seed(0)", "purpose": "tests and offline demo"}
    (path / "TINY_MODEL.json").write_text(json.dumps(note) + "\n", encoding="utf-8")


def create_tiny_instruct_pix2pix(path: str | Path) -> Path:
    """Write a tiny ``StableDiffusionInstructPix2PixPipeline`` directory (no safety checker) to ``path``."""
    import torch
    from diffusers import EulerAncestralDiscreteScheduler, UNet2DConditionModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tiny-sd-for-ip2p-") as tmp:
        sd = create_tiny_stable_diffusion(Path(tmp) / "sd")
        for part in ("vae", "text_encoder", "tokenizer"):
            shutil.copytree(sd / part, path / part, dirs_exist_ok=True)
        unet_config = json.loads((sd / "unet" / "config.json").read_text(encoding="utf-8"))
        scheduler_config = json.loads((sd / "scheduler" / "scheduler_config.json").read_text(encoding="utf-8"))
    # InstructPix2Pix: the UNet's input takes the noisy latent and the source image's latent, concatenated.
    unet_config = {k: v for k, v in unet_config.items() if not k.startswith("_")}
    unet_config["in_channels"] = 8
    torch.manual_seed(0)
    UNet2DConditionModel(**unet_config).save_pretrained(path / "unet", safe_serialization=True)
    # timbrooks/instruct-pix2pix ships an Euler ancestral scheduler with Stable Diffusion's betas.
    betas = {k: scheduler_config[k] for k in ("beta_start", "beta_end", "beta_schedule", "num_train_timesteps")}
    EulerAncestralDiscreteScheduler(**betas).save_pretrained(path / "scheduler")
    _model_index(
        path,
        "StableDiffusionInstructPix2PixPipeline",
        {
            "feature_extractor": None,
            "safety_checker": None,
            "image_encoder": None,
            "scheduler": ("diffusers", "EulerAncestralDiscreteScheduler"),
            "text_encoder": ("transformers", "CLIPTextModel"),
            "tokenizer": ("transformers", "CLIPTokenizer"),
            "unet": ("diffusers", "UNet2DConditionModel"),
            "vae": ("diffusers", "AutoencoderKL"),
        },
        requires_safety_checker=False,
    )
    _tiny_note(path, "tiny random StableDiffusionInstructPix2PixPipeline")
    logger.info("wrote tiny InstructPix2Pix to %s", path)
    return path


def create_tiny_flux2_klein(path: str | Path) -> Path:
    """Write a tiny ``Flux2KleinPipeline`` directory (distilled, as FLUX.2 [klein] 4B) to ``path``."""
    import torch
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = write_byte_level_qwen_tokenizer(path / "tokenizer")
    torch.manual_seed(0)
    Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TINY_TEXT_HIDDEN * len(KLEIN_TEXT_LAYERS),
        timestep_guidance_channels=256,
        axes_dims_rope=[4, 4, 4, 4],
        guidance_embeds=False,
    ).save_pretrained(path / "transformer", safe_serialization=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=TINY_TEXT_HIDDEN,
            intermediate_size=16,
            num_hidden_layers=max(KLEIN_TEXT_LAYERS),
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=512,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    ).save_pretrained(path / "text_encoder", safe_serialization=True)
    torch.manual_seed(0)
    AutoencoderKLFlux2(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        block_out_channels=(4,),
        layers_per_block=1,
        latent_channels=1,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).save_pretrained(path / "vae", safe_serialization=True)
    FlowMatchEulerDiscreteScheduler().save_pretrained(path / "scheduler")
    _model_index(
        path,
        "Flux2KleinPipeline",
        {
            "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
            "text_encoder": ("transformers", "Qwen3ForCausalLM"),
            "tokenizer": ("transformers", "Qwen2TokenizerFast"),
            "transformer": ("diffusers", "Flux2Transformer2DModel"),
            "vae": ("diffusers", "AutoencoderKLFlux2"),
        },
        is_distilled=True,
    )
    _tiny_note(path, "tiny random Flux2KleinPipeline")
    logger.info("wrote tiny FLUX.2 [klein] to %s", path)
    return path


def _write_tiny_qwen_vl_text_parts(path: Path, *, processor: str) -> None:
    """The tiny Qwen2.5-VL text side that Qwen-Image-Edit and LongCat-Image-Edit share: ``tokenizer/`` (byte-level, with
    the vision tokens), its ``Qwen2VLProcessor`` in ``path / processor`` (a 14-pixel patch image processor with 2x2
    merging, as Qwen2.5-VL's) and a ``Qwen2_5_VLForConditionalGeneration`` in ``text_encoder/`` whose vision-token ids
    are the tokenizer's."""
    import torch
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    tokenizer = write_byte_level_qwen_tokenizer(path / "tokenizer", vision=True)
    image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 16, patch_size=14, merge_size=2)
    Qwen2VLProcessor(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor()
    ).save_pretrained(path / processor)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_VISION_TOKENS}
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config={
                "vocab_size": len(tokenizer),
                "hidden_size": TINY_TEXT_HIDDEN,
                "intermediate_size": 16,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [1, 1, 2]},
                "bos_token_id": None,
                "pad_token_id": tokenizer.pad_token_id,
                "eos_token_id": tokenizer.eos_token_id,
            },
            vision_config={
                "depth": 2,
                "hidden_size": 16,
                "intermediate_size": 16,
                "num_heads": 2,
                "out_hidden_size": TINY_TEXT_HIDDEN,
            },  # fmt: skip
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
        )
    ).save_pretrained(path / "text_encoder", safe_serialization=True)


def create_tiny_qwen_image_edit(path: str | Path) -> Path:
    """Write a tiny ``QwenImageEditPlusPipeline`` directory (Qwen-Image-Edit-2511's classes) to ``path``.

    ``QwenImageTransformer2DModel`` at the size of diffusers' fast test of this pipeline, ``AutoencoderKLQwenImage``
    narrower than the test's and with the published model's three downsamplings (the test's has two), a tiny
    ``Qwen2_5_VLForConditionalGeneration`` text encoder whose vision-token ids are the local tokenizer's, and its
    ``Qwen2VLProcessor`` (a 14-pixel patch image processor with 2x2 merging, as Qwen2.5-VL's).
    """
    import torch
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _write_tiny_qwen_vl_text_parts(path, processor="processor")
    torch.manual_seed(0)
    QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=3,
        joint_attention_dim=TINY_TEXT_HIDDEN,
        guidance_embeds=False,
        axes_dims_rope=(8, 4, 4),
    ).save_pretrained(path / "transformer", safe_serialization=True)
    z_dim = 4
    torch.manual_seed(0)
    # The pipeline encodes the reference image at a megapixel whatever the output size, so the VAE's cost is what the
    # tiny pipeline costs on a CPU. Three downsamplings (8x), as the published VAE (diffusers' fast test has two): its
    # middle attention runs over 128^2 latent positions, not 256^2 (16x cheaper), and the reference gives the
    # transformer 4x fewer tokens. Base width 8, not the test's 24: its full-resolution convolutions are 3.5x faster
    # (measured: one 1024 px encode of the 8x VAE, 32 s at width 24, 9 s at width 8, load 17, the 2-core machine).
    AutoencoderKLQwenImage(
        base_dim=z_dim * 2,
        z_dim=z_dim,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * z_dim,
        latents_std=[1.0] * z_dim,
    ).save_pretrained(path / "vae", safe_serialization=True)
    FlowMatchEulerDiscreteScheduler().save_pretrained(path / "scheduler")
    _model_index(
        path,
        "QwenImageEditPlusPipeline",
        {
            "processor": ("transformers", "Qwen2VLProcessor"),
            "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
            "text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration"),
            "tokenizer": ("transformers", "Qwen2TokenizerFast"),
            "transformer": ("diffusers", "QwenImageTransformer2DModel"),
            "vae": ("diffusers", "AutoencoderKLQwenImage"),
        },
    )
    _tiny_note(path, "tiny random QwenImageEditPlusPipeline")
    logger.info("wrote tiny Qwen-Image-Edit to %s", path)
    return path


def create_tiny_longcat_edit(path: str | Path) -> Path:
    """Write a tiny ``LongCatImageEditPipeline`` directory (LongCat-Image-Edit's classes) to ``path``.

    ``LongCatImageTransformer2DModel`` (one double and one single block, heads of 16), a four-level ``AutoencoderKL``
    with LongCat's 16 latent channels (8x downsampling, as the pipeline assumes), and the tiny Qwen2.5-VL text side of
    ``create_tiny_qwen_image_edit`` (the same files), its ``Qwen2VLProcessor`` as ``text_processor``.
    """
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, LongCatImageTransformer2DModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _write_tiny_qwen_vl_text_parts(path, processor="text_processor")
    torch.manual_seed(0)
    LongCatImageTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TINY_TEXT_HIDDEN,
        pooled_projection_dim=TINY_TEXT_HIDDEN,
        axes_dims_rope=[4, 6, 6],
    ).save_pretrained(path / "transformer", safe_serialization=True)
    torch.manual_seed(0)
    AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(4, 4, 4, 4),
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=2,
        shift_factor=0.0,  # the pipeline shifts and scales latents as FLUX's VAE (whose config sets both)
        scaling_factor=1.0,
    ).save_pretrained(path / "vae", safe_serialization=True)
    FlowMatchEulerDiscreteScheduler().save_pretrained(path / "scheduler")
    _model_index(
        path,
        "LongCatImageEditPipeline",
        {
            "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
            "text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration"),
            "text_processor": ("transformers", "Qwen2VLProcessor"),
            "tokenizer": ("transformers", "Qwen2TokenizerFast"),
            "transformer": ("diffusers", "LongCatImageTransformer2DModel"),
            "vae": ("diffusers", "AutoencoderKL"),
        },
    )
    _tiny_note(path, "tiny random LongCatImageEditPipeline")
    logger.info("wrote tiny LongCat-Image-Edit to %s", path)
    return path
