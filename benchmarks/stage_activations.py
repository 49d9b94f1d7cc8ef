"""Activation memory of the image stages at full size, measured on the CPU (the part stage_memory.py leaves out).

``benchmarks/stage_memory.py`` computes each stage's weights; what the image stages need on top of them depends on
the batch: null-text optimisation backpropagates through the UNet for every image of a batch, and each sweep run
pushes ``2 x (1 + targets)`` rows (source and targets, with classifier-free guidance) through a UNet whose
controlled attention layers materialise their probabilities. This script runs the real editor
(``lance_pipeline.editing.prompt_to_prompt.PromptToPromptEditor``) on full-size SD 1.x components at 512x512 with random
weights (memory does not depend on weight values) for a few DDIM steps (the peak is per UNet call, so the step
count does not change it) and reports how far the process's resident set rose above the loaded weights
(``builder.stage_memory.measure_peak``: peak RSS growth, Linux).

This is a CPU measurement used as a proxy for a CUDA fp32 build: CUDA kernels (flash/memory-efficient SDPA in the
uncontrolled layers, cuDNN workspaces) and the caching allocator differ, so read the figures as the order of
magnitude, not as the GPU's peak; `lance-cf build ... --record-memory` on a GPU measures the real one.

    python benchmarks/stage_activations.py --images 1 2 --targets 1 3 --threads 2   # ~10 min on a 2-core CPU
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, nargs="+", default=[1, 2], help="images inverted together")
    parser.add_argument("--targets", type=int, nargs="+", default=[1, 3], help="target rows per sweep run")
    parser.add_argument("--steps", type=int, default=2, help="DDIM steps (the peak is per UNet call)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import torch
    from bench_edit import build_components, workload

    from builder.stage_memory import format_bytes, measure_peak, unmeasured_reason
    from lance_pipeline.editing.candidate_selection import EditRequest
    from lance_pipeline.editing.options import ImageEditorOptions
    from lance_pipeline.editing.prompt_to_prompt import PromptToPromptEditor

    logging.basicConfig(level=logging.WARNING)
    reason = unmeasured_reason("cpu")
    if reason:
        raise SystemExit(f"stage_activations: cannot measure here: {reason}")
    torch.set_num_threads(args.threads)
    components = build_components("full", "cpu")
    print(
        f"# stage_activations: full-size SD 1.x, 512x512, fp32, CPU, torch={torch.__version__} threads={args.threads}"
    )
    print("| phase | batch | peak RSS growth above the loaded weights |")
    print("|---|---|---:|")
    for n_images in args.images:
        options = ImageEditorOptions(
            model="random-sd1",
            image_size=512,
            num_inference_steps=args.steps,
            num_inner_steps=1,
            early_stop_epsilon=0.0,
        )
        editor = PromptToPromptEditor(components, options)
        images, captions, edits = workload(n_images, max(args.targets), 512)
        with measure_peak("cpu") as peak:
            inversions = editor.invert_batch(images, captions)
        print(f"| null-text inversion | {n_images} image(s) | {format_bytes(peak['peak_bytes'])} |", flush=True)
    for targets in args.targets:
        options = ImageEditorOptions(
            model="random-sd1",
            image_size=512,
            num_inference_steps=args.steps,
            num_inner_steps=1,
            early_stop_epsilon=0.0,
            edit_batch_size=targets,
            self_replace_sweep=(0.4,),
        )
        editor = PromptToPromptEditor(components, options)
        requests = [EditRequest(e, "") for e in edits[0][:targets]]
        with measure_peak("cpu") as peak:
            editor.sweep(inversions[0], requests)
        rows = 2 * (1 + targets)
        print(
            f"| sweep run | {targets} target(s) = {rows} UNet rows | {format_bytes(peak['peak_bytes'])} |", flush=True
        )


if __name__ == "__main__":
    main()
