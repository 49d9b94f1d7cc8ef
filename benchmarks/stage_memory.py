"""Weight memory of each stage of the ``hardimagenet`` preset on a GPU, from parameter counts and dtypes.

No GPU and no weights are needed: every model is instantiated on torch's ``meta`` device (shapes only) from the
published architecture hyperparameters of the pinned checkpoints (written out below), its parameters counted, and
multiplied by the bytes of the dtype the stage loads it in on CUDA (captioner: float16; perturber: bfloat16; label
check / random edit: float32; Stable Diffusion and CLIP in the image stages: float32, the editor's default, which
null-text optimisation needs). Activations are NOT included (they depend on batch size and sequence lengths; measure
them on a GPU with the command in docs/scaling.md).

    python benchmarks/stage_memory.py            # Markdown tables: per model, per stage, per schedule

Prints, per schedule, the peak *weights* resident on the GPU: batch-major keeps every stage's models loaded for the
whole build (the sum), stage-major loads one stage at a time (the largest stage).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GIB = 1024**3
BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def blip2_opt_2_7b() -> int:
    from transformers import Blip2Config, Blip2ForConditionalGeneration, OPTConfig

    # Salesforce/blip2-opt-2.7b: ViT-g/14 (the Blip2VisionConfig defaults), Q-Former defaults, OPT-2.7b.
    text = OPTConfig(
        vocab_size=50272,
        hidden_size=2560,
        num_hidden_layers=32,
        ffn_dim=10240,
        num_attention_heads=32,
        max_position_embeddings=2048,
        word_embed_proj_dim=2560,
    )
    config = Blip2Config(text_config=text.to_dict(), num_query_tokens=32)
    return _count(Blip2ForConditionalGeneration(config))


def qwen2_5_7b() -> int:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    )
    return _count(Qwen2ForCausalLM(config))


def minilm_l6() -> int:
    from transformers import BertConfig, BertModel

    config = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
    return _count(BertModel(config, add_pooling_layer=True))


def bert_base_uncased() -> int:
    from transformers import BertConfig, BertForMaskedLM

    return _count(BertForMaskedLM(BertConfig()))


def stable_diffusion_1_4() -> int:
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    unet = UNet2DConditionModel(sample_size=64, cross_attention_dim=768)  # the SD 1.x UNet (859.5 M)
    vae = AutoencoderKL(
        block_out_channels=(128, 256, 512, 512),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=4,
        layers_per_block=2,
        sample_size=512,
    )
    text = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=49408,
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            max_position_embeddings=77,
            hidden_act="quick_gelu",
        )
    )
    return _count(unet) + _count(vae) + _count(text)


def clip_vit_l_14() -> int:
    import open_clip

    model = open_clip.create_model("ViT-L-14", pretrained=None, force_quick_gelu=True, device="meta")
    return _count(model)


# (name, counter, dtype on CUDA)
MODELS = {
    "BLIP-2 OPT-2.7b": (blip2_opt_2_7b, "float16"),
    "Qwen2.5-7B-Instruct": (qwen2_5_7b, "bfloat16"),
    "all-MiniLM-L6-v2": (minilm_l6, "float32"),
    "bert-base-uncased": (bert_base_uncased, "float32"),
    "Stable Diffusion 1.4 (UNet+VAE+text)": (stable_diffusion_1_4, "float32"),
    "CLIP ViT-L/14 (OpenAI)": (clip_vit_l_14, "float32"),
}
# The hardimagenet preset's stages and the models each holds (the edit stages share one SD copy in a process).
STAGES = {
    "caption": ["BLIP-2 OPT-2.7b"],
    "perturb": ["Qwen2.5-7B-Instruct"],
    "label_check": ["all-MiniLM-L6-v2"],
    "random_edit": ["bert-base-uncased"],
    "invert": ["Stable Diffusion 1.4 (UNet+VAE+text)"],
    "reconstruct": ["Stable Diffusion 1.4 (UNet+VAE+text)"],
    "edit": ["Stable Diffusion 1.4 (UNet+VAE+text)", "CLIP ViT-L/14 (OpenAI)"],
    "lance_r_edit": ["Stable Diffusion 1.4 (UNet+VAE+text)", "CLIP ViT-L/14 (OpenAI)"],
}


def main() -> None:
    import torch

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    sizes: dict[str, tuple[int, str, float]] = {}
    for name, (counter, dtype) in MODELS.items():
        with torch.device("meta"), contextlib.redirect_stderr(None):
            params = counter()
        sizes[name] = (params, dtype, params * BYTES[dtype] / GIB)
    print("| model | parameters | dtype on CUDA | weights (GiB) |")
    print("|---|---:|---|---:|")
    for name, (params, dtype, gib) in sizes.items():
        print(f"| {name} | {params / 1e6:,.1f} M | {dtype} | {gib:.2f} |")
    print()
    print("| stage | models | weights resident (GiB) |")
    print("|---|---|---:|")
    per_stage = {}
    for stage, models in STAGES.items():
        per_stage[stage] = sum(sizes[m][2] for m in models)
        print(f"| {stage} | {', '.join(models)} | {per_stage[stage]:.2f} |")
    every_model = sum(size[2] for size in sizes.values())
    largest = max(per_stage, key=per_stage.get)
    print()
    print(f"batch-major (every stage loaded all build long): {every_model:.2f} GiB of weights")
    print(f"stage-major (one stage at a time): {per_stage[largest]:.2f} GiB of weights (largest stage: {largest})")


if __name__ == "__main__":
    main()
