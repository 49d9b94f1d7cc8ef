"""One instruction editor at its published architecture with random weights: seconds per image, peak memory,
denoiser forward-equivalents and FLOPs (the GPU suite's ``instruct`` section).

FLUX.2 [klein] 4B (``Flux2KleinPipeline``, the presets' default instruction editor): its transformer as diffusers'
conversion script configures the 4B checkpoint (5 double and 20 single blocks, 24 heads of 128, joint attention 7680),
a Qwen3-4B text encoder (hidden 2560, 36 layers, 32 heads, 8 key-value heads, MLP 9728, vocabulary 151,936) and
diffusers' default FLUX.2 VAE, every weight random (timing and memory do not depend on their values). The rendering
is the product's: ``lance_pipeline.instruct.editing.InstructEditor.generate`` with the preset's settings (4 steps,
no guidance), so its forward hook counts the denoiser's sample-forwards. FLOPs are counted with torch's
``FlopCounterMode`` over one whole edit (text encoder, transformer steps, VAE encode and decode). ``--size tiny``
runs the same on the tiny random pipeline (``lance_pipeline/tiny/instruct_components.py``) on the CPU, for the dry run.

    python benchmarks/bench_instruct.py --device cuda --size full --json instruct.json
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

from bench_json import write_json

KLEIN_4B_TRANSFORMER = {
    "patch_size": 1,
    "in_channels": 128,
    "num_layers": 5,
    "num_single_layers": 20,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 7680,
    "timestep_guidance_channels": 256,
    "mlp_ratio": 3.0,
    "axes_dims_rope": (32, 32, 32, 32),
    "rope_theta": 2000,
    "eps": 1e-6,
    "guidance_embeds": False,
}
QWEN3_4B = {
    "hidden_size": 2560,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 9728,
    "vocab_size": 151936,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
}


def full_pipeline(device: str, tokenizer_dir: Path):
    """The klein 4B pipeline with random bf16 weights, on ``device``."""
    import torch
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from lance_pipeline.tiny.instruct_components import write_byte_level_qwen_tokenizer

    tokenizer = write_byte_level_qwen_tokenizer(tokenizer_dir)  # ids < 259: inside the real vocabulary
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            transformer = Flux2Transformer2DModel(**KLEIN_4B_TRANSFORMER)
            text_encoder = Qwen3ForCausalLM(Qwen3Config(**QWEN3_4B, pad_token_id=tokenizer.pad_token_id))
            vae = AutoencoderKLFlux2()
    finally:
        torch.set_default_dtype(previous)
    pipeline = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae.to(torch.bfloat16),
        text_encoder=text_encoder.to(torch.bfloat16),
        tokenizer=tokenizer,
        transformer=transformer.to(torch.bfloat16),
        is_distilled=True,
    )
    pipeline.set_progress_bar_config(disable=True)
    for module in (transformer, text_encoder, vae):
        module.requires_grad_(False).eval()
    return pipeline


def parameters(module) -> int:
    return sum(p.numel() for p in module.parameters())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", choices=("tiny", "full"), default="full")
    parser.add_argument("--image-size", type=int, default=None, help="default: 512 (full), 64 (tiny)")
    parser.add_argument("--images", type=int, default=2, help="timed edits, after one warm-up")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)

    import numpy as np
    import torch
    from PIL import Image
    from torch.utils.flop_counter import FlopCounterMode

    from lance_pipeline.instruct.editing import (
        ForwardCounts,
        InstructEditor,
        InstructEditorOptions,
        load_instruct_pipeline,
    )

    if args.threads:
        torch.set_num_threads(args.threads)
    size = args.image_size or (512 if args.size == "full" else 64)
    cuda = args.device.startswith("cuda")
    with tempfile.TemporaryDirectory(prefix="bench-instruct-") as tmp:
        if args.size == "full":
            options = InstructEditorOptions(editor="flux2_klein", dtype="bfloat16", image_size=size)
            pipeline = full_pipeline(args.device, Path(tmp) / "tokenizer")
        else:
            from lance_pipeline.tiny.instruct_components import create_tiny_flux2_klein

            directory = create_tiny_flux2_klein(Path(tmp) / "klein")
            options = InstructEditorOptions(editor="flux2_klein", model=str(directory), image_size=size)
            pipeline = load_instruct_pipeline(options, args.device)
        editor = InstructEditor(pipeline, options)
        rng = np.random.default_rng(0)
        photo = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
        instruction = "Change the weather: in the snow. Keep everything else as it is."

        def edit(seed: int):
            return editor.generate(photo, [instruction], [seed], None)

        edit(0)  # warm-up (kernels, allocator)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        editor.counts = ForwardCounts()
        start = time.perf_counter()
        for seed in range(1, args.images + 1):
            edit(seed)
        if cuda:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / args.images
        counts = dataclasses.replace(editor.counts)  # a copy: the FLOP-counted edit below adds to the counter
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        with FlopCounterMode(display=False) as counter:
            edit(args.images + 1)
        flops = float(counter.get_total_flops())
    report = {
        "editor": "flux2_klein",
        "architecture": "FLUX.2 [klein] 4B (random weights)" if args.size == "full" else "tiny random FLUX.2 [klein]",
        "device": args.device,
        "size": args.size,
        "image_size": size,
        "steps": options.num_inference_steps,
        "guidance_scale": options.guidance_scale,
        "images": args.images,
        "parameters": {
            "transformer": parameters(pipeline.transformer),
            "text_encoder": parameters(pipeline.text_encoder),
            "vae": parameters(pipeline.vae),
        },
        "s_per_image": seconds,
        "denoiser_fwd_eq_per_image": counts.denoiser_samples / args.images,
        "text_encoder_prompts_per_image": counts.text_encoder_samples / args.images,
        "flops_per_image": flops,
        "achieved_tflops": flops / seconds / 1e12,
        "peak_gib": peak,
    }
    write_json(args.json, report)
    print(
        f"{report['architecture']} at {size} px, {options.num_inference_steps} steps: {seconds:.3f} s/image, "
        f"{report['denoiser_fwd_eq_per_image']:.0f} denoiser sample-forwards, {flops / 1e12:.3f} TFLOP/image, "
        f"peak {peak if peak is None else round(peak, 2)} GiB"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
