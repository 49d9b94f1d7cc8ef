"""Random-weight local copies of a preset's models, and the build config that points the preset at them.

The GPU suite measures each stage's peak memory in a real build (``lance-cf build --record-memory``) on a machine
that can fetch nothing. So every model a LANCE preset names is written here with random weights (timing and memory
do not depend on weight values) at the published architecture of its pinned checkpoint (``--size full``: BLIP-2
OPT-2.7b, Qwen2.5-7B, all-MiniLM-L6-v2, BERT base, Stable Diffusion 1.x at 512 px, CLIP ViT-L/14) or scaled down
(``--size small``, for the suite's CPU dry run), in the layout each stage loads through its own ``from_pretrained``
path, and the preset's config is rewritten to name those directories.

Random models produce gibberish captions and edits, so the config also opens every filter as the demo preset does
(label check and CLIP thresholds off, lenient perturber parsing): without that, nothing would reach the image stages
and their memory would go unmeasured. The counts (images, edits per image) are set by the caller and recorded.

    python benchmarks/random_models.py --preset hardimagenet --size full --output /tmp/models --device cuda
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# all-MiniLM-L6-v2 and BERT base (published configs; the tokenizer is a local WordPiece one).
MINILM = {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12, "intermediate_size": 1536}
BERT_BASE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072}
SMALL_BERT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}


def write_stable_diffusion(path: Path, size: str, device: str) -> Path:
    """Stable Diffusion 1.x (UNet, VAE, CLIP text encoder, the real CLIP BPE tokenizer, the paper's DDIM config) in
    diffusers' folder layout: the published architecture at full size, the demo's tiny one at small size."""
    import diffusers
    from bench_edit import build_components
    from diffusers import DDIMScheduler

    from lance_pipeline.tiny.image_components import PAPER_DDIM_CONFIG

    components = build_components("full" if size == "full" else "tiny", device)  # tiny: the demo's own SD
    for name in ("unet", "vae", "text_encoder"):
        getattr(components, name).save_pretrained(path / name, safe_serialization=True)
    components.tokenizer.save_pretrained(path / "tokenizer")
    DDIMScheduler(**PAPER_DDIM_CONFIG).save_pretrained(path / "scheduler")
    index = {
        "_class_name": "StableDiffusionPipeline",
        "_diffusers_version": diffusers.__version__,
        "scheduler": ["diffusers", "DDIMScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "unet": ["diffusers", "UNet2DConditionModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    (path / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def write_open_clip(path: Path, size: str, device: str = "cpu") -> Path:
    """open_clip's local-directory layout: ViT-L/14 with QuickGELU (the OpenAI weights' architecture) or the tiny
    test CLIP."""
    import open_clip
    import torch
    from safetensors.torch import save_file

    from lance_pipeline.tiny import clip_components as tiny

    if size == "small":
        return tiny.create_tiny_open_clip(path)
    model_cfg = {**open_clip.get_model_config("ViT-L-14"), "quick_gelu": True}
    torch.manual_seed(0)
    model = open_clip.CLIP(**model_cfg)
    path.mkdir(parents=True, exist_ok=True)
    config = {"model_cfg": model_cfg, "preprocess_cfg": tiny.TINY_OPEN_CLIP_PREPROCESS_CFG}
    (path / tiny.CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / tiny.WEIGHTS_NAME))
    return path


def write_masked_lm(path: Path, size: str, device: str = "cpu") -> Path:
    """BERT base (LANCE-R's word proposer) or a small BERT, with a local WordPiece tokenizer."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    from lance_pipeline.tiny.text_components import _word_piece_tokenizer

    tokenizer = _word_piece_tokenizer()
    dims = BERT_BASE if size == "full" else SMALL_BERT
    vocab = 30522 if size == "full" else len(tokenizer)
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(vocab_size=vocab, pad_token_id=tokenizer.pad_token_id, **dims)).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def write_sentence_encoder(path: Path, size: str, device: str = "cpu") -> Path:
    """all-MiniLM-L6-v2's architecture (mean pooling, normalised) as a sentence-transformers directory."""
    from sentence_transformers import SentenceTransformer, models

    encoder_dir = write_masked_lm(path.with_name(path.name + "-bert"), size)
    if size == "full":  # MiniLM's own widths (the masked-LM head above is dropped when loaded as a BertModel)
        import torch
        from transformers import BertConfig, BertModel

        torch.manual_seed(0)
        BertModel(BertConfig(vocab_size=30522, **MINILM)).save_pretrained(encoder_dir, safe_serialization=True)
    transformer = models.Transformer(str(encoder_dir))
    pooling = models.Pooling(transformer.get_word_embedding_dimension(), pooling_mode="mean")
    SentenceTransformer(modules=[transformer, pooling, models.Normalize()], device="cpu").save(str(path))
    return path


# The safety checker's CLIP ViT-L/14 vision tower (CompVis/stable-diffusion-safety-checker's published config).
SAFETY_VISION = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "image_size": 224,
    "patch_size": 14,
}


def write_safety_checker(path: Path, size: str, device: str = "cpu") -> Path:
    """Stable Diffusion's safety checker (its CLIP ViT-L/14 vision tower, 768-wide projection) or the demo's tiny one;
    its concept thresholds are set so that no image is flagged (random embeddings would flag at random)."""
    from lance_pipeline.tiny import safety_components as tiny

    if size == "small":
        return tiny.create_tiny_safety_checker(path)
    import torch
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
    from transformers import CLIPConfig, CLIPImageProcessor

    config = CLIPConfig(vision_config=SAFETY_VISION, projection_dim=768)
    torch.manual_seed(0)
    with torch.device(device):
        checker = StableDiffusionSafetyChecker(config).eval()
    checker.concept_embeds_weights.fill_(1.0)  # a cosine never exceeds 1: nothing is flagged
    checker.special_care_embeds_weights.fill_(1.0)
    checker.save_pretrained(path, safe_serialization=True)
    side = SAFETY_VISION["image_size"]
    CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side}).save_pretrained(path)
    return path


def write_captioner(path: Path, size: str, device: str = "cpu") -> Path:
    from bench_text_stages import write_captioner as write

    return write(path, size, device)


def write_perturber(path: Path, size: str, device: str = "cpu") -> Path:
    from bench_text_stages import write_perturber as write

    return write(path, size, device)


def write_lpips_backbone(path: Path, size: str, device: str = "cpu") -> Path:
    """LPIPS's VGG16 backbone in timm's layout. LPIPS's linear layers fix its widths, so the random stand-in is the
    published architecture at either size."""
    from lance_pipeline.tiny.preservation_components import create_tiny_lpips_backbone

    return create_tiny_lpips_backbone(path)


# Stage type -> {option key: writer} for the models each stage loads.
WRITERS = {
    "blip2_captioner": {"model": write_captioner},
    "llm_perturber": {"model": write_perturber},
    "label_check": {"model": write_sentence_encoder},
    "random_word_edit": {"model": write_masked_lm},
    "null_text_inversion": {"model": write_stable_diffusion},
    "reconstruction": {"model": write_stable_diffusion},
    "prompt_to_prompt_edit": {"model": write_stable_diffusion, "clip_model": write_open_clip},
    "lance_r_edit": {"model": write_stable_diffusion, "clip_model": write_open_clip},
    **dict.fromkeys(
        ("sensitive_edit_screen", "sensitive_edit_screen_lance_r", "sensitive_edit_screen_strength"),
        {"model": write_sentence_encoder},
    ),
    **dict.fromkeys(
        (
            "safety_check",
            "safety_check_lance_r",
            "safety_check_strength",
            "safety_check_reconstruction",
            "safety_check_generated",
        ),
        {"model": write_safety_checker},
    ),
    "preservation": {"lpips_backbone": write_lpips_backbone},
}
# Options that make random models' outputs reach the image stages (the demo preset's settings).
OPEN_FILTERS = {
    # Random captioners never stop by themselves: a short caption keeps every edited caption within CLIP's 77 tokens.
    "blip2_captioner": {"min_new_tokens": 3, "max_new_tokens": 20},
    "llm_perturber": {"min_shared_fraction": 0.0, "max_span_words": 100, "do_sample": True},
    "label_check": {"label_threshold": None, "span_threshold": None},
    "prompt_to_prompt_edit": {
        "clip_directional_threshold": -1.0,
        "clip_image_threshold": -1.0,
        "clip_text_threshold": -1.0,
        "require_edited_closer": False,
    },
}
OPEN_FILTERS["lance_r_edit"] = {**OPEN_FILTERS["prompt_to_prompt_edit"], "lance_r_word_check": False}
# The demo preset's image size, with half its DDIM steps and 2 null-text iterations instead of 3: the small size only
# has to reach every stage (the suite's dry run), and the image stages were most of its build's CPU time.
SMALL_IMAGE = {"image_size": 64, "num_inference_steps": 5, "num_inner_steps": 2}
IMAGE_STAGES = ("null_text_inversion", "reconstruction", "prompt_to_prompt_edit", "lance_r_edit")


def write_preset_models(
    preset: str, size: str, root: Path, device: str = "cpu", n_per_type: int = 1, edit_types: list | None = None
) -> dict[str, Any]:
    """Write every model ``preset`` names (each distinct reference once) under ``root`` and return the preset's
    config (a dict) rewritten to load them, with filters opened and the given edit counts."""
    import torch

    from builder.config import load_config

    config = load_config(preset).to_dict()
    written: dict[str, str] = {}
    for stage in config["stages"]:
        writers = WRITERS.get(stage["type"])
        if writers is None:
            raise ValueError(f"stage type {stage['type']!r} of preset {preset!r} has no random-model writer")
        options = dict(stage.get("options") or {})
        for key, writer in writers.items():
            reference = f"{options.get(key)}@{options.get('revision')}:{writer.__name__}"
            if reference not in written:
                target = root / f"{len(written):02d}-{writer.__name__.removeprefix('write_')}"
                with torch.no_grad():
                    written[reference] = str(writer(target, size, device))
            options[key] = written[reference]
        options["revision"] = None
        if "clip_model" in writers:
            options["clip_pretrained"] = None
        options.update(OPEN_FILTERS.get(stage["type"], {}))
        if stage["type"] == "llm_perturber":
            options["n_per_type"] = n_per_type
            if edit_types:
                options["edit_types"] = list(edit_types)
        if size == "small" and stage["type"] in IMAGE_STAGES:
            options.update(SMALL_IMAGE)
        stage["options"] = options
    config.update(source="demo", source_options={}, source_hint=None)
    if size == "small":
        config["image_size"] = SMALL_IMAGE["image_size"]
    return config


def main(argv: list[str] | None = None) -> None:
    import yaml

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="hardimagenet")
    parser.add_argument("--size", choices=("full", "small"), default="small")
    parser.add_argument("--output", required=True, help="folder for the models and config.yaml")
    parser.add_argument("--device", default="cpu", help="where random weights are drawn (cuda is much faster)")
    parser.add_argument("--n-per-type", type=int, default=1)
    args = parser.parse_args(argv)
    root = Path(args.output)
    config = write_preset_models(args.preset, args.size, root, args.device, args.n_per_type)
    (root / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    print(root / "config.yaml")


if __name__ == "__main__":
    main()
