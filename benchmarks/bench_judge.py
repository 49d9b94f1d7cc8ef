"""The judge's throughput: Qwen2.5-VL at its published architecture, random weights, images judged per second.

The judge stage (``lance_pipeline/screening/judge.py``) asks one or two yes/no questions per released image with one
forward pass per batch of questions (no generation): the cost is the prefill of (visual tokens + question) per
question. This script builds ``Qwen2_5_VLForConditionalGeneration`` from the published configuration of
Qwen/Qwen2.5-VL-7B-Instruct (typed in below: nothing is downloaded; weights random, which does not change time or
memory) and times that forward pass on prompts of the stage's shape: one image at the stage's default ``max_pixels``
(448 x 448: 32 x 32 patches of 14 px, 256 visual tokens after the 2x2 merge) between ``<|vision_start|>`` and
``<|vision_end|>``, then ``--text-tokens`` tokens of question and chat template. Input ids and patches are made
directly (the real tokenizer cannot be fetched here), so the processor's CPU work (resizing, patching) is not counted.

Per batch size: questions per second (mean of ``--repeats`` timed passes after one warm-up), peak memory, and
images per second for the counterfactual stage's two questions per image. ``--size tiny`` runs the tiny test model's
configuration (``lance_pipeline.tiny.judge_components``) on the CPU: the GPU suite's dry run.

    python benchmarks/bench_judge.py --device cuda --size full --json judge.json
    python benchmarks/bench_judge.py --device cpu --size tiny --threads 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_json import write_json  # noqa: E402

# Qwen/Qwen2.5-VL-7B-Instruct's config.json (the published architecture; its token ids are the tokenizer's).
FULL_CONFIG = {
    "text_config": {
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 128000,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "vision_config": {
        "depth": 32,
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
    },
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "tie_word_embeddings": False,
}


def config_for(size: str) -> dict:
    if size == "full":
        return FULL_CONFIG
    from lance_pipeline.tiny.judge_components import SPECIAL_TOKENS, tiny_judge_config

    # special tokens above the random question ids (0..99) that make_batch draws
    return tiny_judge_config(128, {t: 100 + i for i, t in enumerate(SPECIAL_TOKENS)})


def make_batch(config, batch: int, grid: int, text_tokens: int, device: str, dtype):
    """Input ids, attention mask, patches and grid of ``batch`` prompts, one ``grid x grid``-patch image each."""
    import torch

    vision = config.vision_config
    merged = grid * grid // vision.spatial_merge_size**2
    generator = torch.Generator().manual_seed(0)
    text = torch.randint(0, 100, (batch, text_tokens), generator=generator)
    image = torch.full((batch, merged), config.image_token_id)
    ids = torch.cat(
        [
            torch.full((batch, 1), config.vision_start_token_id),
            image,
            torch.full((batch, 1), config.vision_end_token_id),
            text,
        ],
        dim=1,
    )
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(batch * grid * grid, patch_dim, generator=generator)
    return {
        "input_ids": ids.to(device),
        "attention_mask": torch.ones_like(ids).to(device),
        "pixel_values": pixels.to(device, dtype),
        "image_grid_thw": torch.tensor([[1, grid, grid]] * batch).to(device),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", choices=("full", "tiny"), default="full")
    parser.add_argument("--batch-sizes", default=None, help="comma-separated (default: 1,8,32 full; 1,2 tiny)")
    parser.add_argument("--image-px", type=int, default=448, help="image side in pixels (multiple of 28)")
    parser.add_argument("--text-tokens", type=int, default=30, help="question and chat-template tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    if args.threads:
        torch.set_num_threads(args.threads)
    full = args.size == "full"
    dtype = torch.bfloat16 if full else torch.float32
    config = Qwen2_5_VLConfig(**config_for(args.size))
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build the 8.3B parameters in bf16 on the device directly
    try:
        with torch.device(args.device):
            model = Qwen2_5_VLForConditionalGeneration(config).eval()
    finally:
        torch.set_default_dtype(previous)
    parameters = sum(p.numel() for p in model.parameters())
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    grid = (args.image_px if full else 56) // config.vision_config.patch_size
    sizes = [int(b) for b in (args.batch_sizes or ("1,8,32" if full else "1,2")).split(",")]
    rows = []
    payload = {
        "model": "Qwen/Qwen2.5-VL-7B-Instruct architecture" if full else "tiny test configuration",
        "size": args.size,
        "device": args.device,
        "dtype": str(dtype).replace("torch.", ""),
        "parameters": parameters,
        "image_px": grid * config.vision_config.patch_size,
        "visual_tokens": grid * grid // config.vision_config.spatial_merge_size**2,
        "text_tokens": args.text_tokens,
        "rows": rows,
    }
    for batch in sizes:
        inputs = make_batch(config, batch, grid, args.text_tokens, args.device, dtype)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            model(**inputs)  # warm-up
            sync()
            start = time.perf_counter()
            for _ in range(args.repeats):
                model(**inputs).logits[:, -1].float().softmax(-1)
            sync()
        seconds = (time.perf_counter() - start) / args.repeats
        rows.append(
            {
                "batch": batch,
                "seconds_per_batch": seconds,
                "questions_per_second": batch / seconds,
                "images_per_second_two_questions": batch / seconds / 2,
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            }
        )
        write_json(args.json, payload)  # what was measured so far survives a stop
        print(f"batch {batch}: {batch / seconds:.1f} questions/s ({seconds:.3f} s per batch)", flush=True)
    write_json(args.json, payload)
    best = max(rows, key=lambda r: r["questions_per_second"])
    print(f"judge_questions_per_second={best['questions_per_second']:.2f} batch={best['batch']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
