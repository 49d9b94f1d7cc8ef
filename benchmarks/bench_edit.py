"""The image editor against the reference algorithm, on the same inputs, in one run.

Stable Diffusion 1.x components are built from their configs with random weights (timing does not depend on weight
values; no download): ``--size full`` is the SD 1.x UNet / VAE / text encoder at 512x512 (859.5 M UNet parameters),
``--size small`` the same architecture families scaled down so a 2-core CPU finishes in minutes. Both algorithms run
the paper's method on the same images and edits:

* **reference**: as the authors ran it: fp32, null-text inversion one image at a time (torch Adam, ``loss.item()``
  each iteration), a separate reconstruction pass, and one prompt-to-prompt run of ``[caption, edited caption]``
  per (edit, sweep value), each run decoding both images;
* **ours**: ``lance_pipeline``'s editor: null-text batched over the images, the reconstruction taken from the
  optimisation's source branch, the sweep sharing its trajectory prefix and one source branch per run.

Reported per method: UNet sample-forward-equivalents per counterfactual (counted by a hook on the UNet: exact and
machine-independent; a backward w.r.t. the null embedding counts 1.08 forwards), seconds of inversion per source
image, seconds per counterfactual (everything, inversion included, divided by the rendered edits), peak GPU memory,
reconstruction error (MSE in [0, 1] pixels against the input), and how far our candidates are from the reference's
(max and mean pixel difference: for null-text fp32 the savings are exact, so this is rounding; for the other
inversion methods and bf16 it is the change they make). Extra rows: ours with each inversion method (``--methods``)
and precision (``--precisions``), with ``--compile MODE`` the null-text/method rows again on a copy of the components
whose UNet blocks are compiled (``sd_components.compile_unet``; one untimed warm-up run per row compiles every shape
first, its wall time printed, with the pixel difference from the eager row and ``compiled_vs_eager``), and the second
editor (``--no-controlnet`` leaves it out):

* **controlnet**: DILLEMA's ControlNet regeneration (``lance_pipeline.dillema.controlnet_editing.ControlNetEditor``) with the
  ``hardimagenet-controlnet`` preset's settings (UniPC steps, images per edit, conditioning scales, negative prompt),
  on the same images and edited captions: nothing per image, each edit rendered ``images_per_edit`` times. Its
  ControlNet (``ControlNetModel.from_unet`` of the same UNet, the SD 1.5 ControlNet's architecture at ``--size
  full``) is counted separately by the editor's own hook (``ControlNet fwd / cf``); the UNet by the same hook as
  the other rows. It inverts and reconstructs nothing and renders other images, so its reconstruction and
  pixel-difference columns are ``n/a``.

A *counterfactual* here is one rendered edit (all its sweep values, or all its ControlNet candidates). CLIP gating is
not in any row (both editors gate alike). Last line, both at the same method (null-text, fp32, eager):
``speedup_vs_reference=X fwd_eq_ratio=Y``; the line before it compares the ControlNet row with ours.

    python benchmarks/bench_edit.py --device cpu --size small          # minutes on a 2-core CPU
    python benchmarks/bench_edit.py --device cuda --size full --precisions fp32,bf16   # GPU, 512x512, 50 steps
    python benchmarks/bench_edit.py --device cuda --size full --precisions fp32,bf16 --compile default
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

CAPTIONS = [
    "a photo of a dog sitting on the grass",
    "a photo of a red car parked on a street",
    "a photo of a man riding a horse on a beach",
    "a photo of a bird on a branch in a forest",
]
EDIT_PATTERNS = [  # (old words, new words): swaps, insertions, a multi-word replacement
    ("a photo", "a painting"),
    ("on the", "on the snowy"),
    ("a photo of", "a blurry photo of"),
    ("sitting", "sleeping"),
]

SIZES = {
    # name: (image size, UNet block widths, cross-attention width, text layers, VAE widths, steps, null-text steps)
    "full": (512, (320, 640, 1280, 1280), 768, 12, (128, 256, 512, 512), 50, 10),
    "small": (64, (32, 64, 64, 64), 64, 2, (16, 32, 32, 32), 10, 3),
    # The test suite's tiny SD (lance_pipeline.tiny.image_components): for counts only, in seconds.
    "tiny": (32, None, None, None, None, 10, 3),
}


def build_components(size: str, device: str, seed: int = 0):
    """SD 1.x-architecture UNet, VAE, CLIP text encoder and the real CLIP tokenizer, random weights."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    from lance_pipeline.editing.sd_components import DDIM_OVERRIDES, StableDiffusionComponents
    from lance_pipeline.tiny.image_components import PAPER_DDIM_CONFIG, write_clip_tokenizer_files

    image_size, unet_widths, text_width, text_layers, vae_widths, _, _ = SIZES[size]
    if size == "tiny":
        from lance_pipeline.editing.sd_components import load_stable_diffusion_components
        from lance_pipeline.tiny.image_components import create_tiny_stable_diffusion

        # the weights are read into memory: the folder is not needed once they are loaded
        with tempfile.TemporaryDirectory(prefix="bench-edit-tiny-sd-") as folder:
            return load_stable_diffusion_components(str(create_tiny_stable_diffusion(folder)), device=device)
    with tempfile.TemporaryDirectory(prefix="bench-edit-tokenizer-") as folder:
        vocab_path, merges_path = write_clip_tokenizer_files(Path(folder))
        vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
        merges = [tuple(line.split()) for line in merges_path.read_text(encoding="utf-8").splitlines()[1:] if line]
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77, pad_token="<|endoftext|>")
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=image_size // 8,
        block_out_channels=unet_widths,
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        cross_attention_dim=text_width,
        attention_head_dim=8,
        layers_per_block=2,
        norm_num_groups=32 if size == "full" else 16,
    )
    vae = AutoencoderKL(
        block_out_channels=vae_widths,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=4,
        layers_per_block=2,
        norm_num_groups=32 if size == "full" else 16,
        sample_size=image_size,
    )
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=text_width,
            intermediate_size=4 * text_width,
            num_hidden_layers=text_layers,
            num_attention_heads=12 if size == "full" else 4,
            max_position_embeddings=77,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    # Random weights make the VAE's latents and the UNet's outputs huge; scale the UNet's output projection so that
    # sampling stays finite (timing and counts do not depend on weight values).
    with torch.no_grad():
        unet.conv_out.weight.mul_(0.01)
    scheduler_config = dict(DDIMScheduler.from_config(PAPER_DDIM_CONFIG, **DDIM_OVERRIDES).config)
    for module in (unet, vae, text_encoder):
        module.requires_grad_(False).eval().to(device)
    return StableDiffusionComponents(
        unet=unet,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler_config=scheduler_config,
        model=f"random-sd1-{size}",
        revision=None,
    )


def workload(n_images: int, n_edits: int, image_size: int):
    """Deterministic images (smooth noise) with captions, and per image ``n_edits`` edited captions."""
    rng = np.random.default_rng(0)
    images, captions, edits = [], [], []
    for k in range(n_images):
        coarse = rng.random((8, 8, 3))
        array = np.asarray(
            Image.fromarray((coarse * 255).astype("uint8")).resize((image_size, image_size), Image.Resampling.BICUBIC)
        )
        images.append(Image.fromarray(array))
        caption = CAPTIONS[k % len(CAPTIONS)]
        captions.append(caption)
        mine = []
        for old, new in EDIT_PATTERNS:
            if old in caption and len(mine) < n_edits:
                mine.append(caption.replace(old, new, 1))
        while len(mine) < n_edits:
            mine.append(f"{caption} at night {len(mine)}")
        edits.append(mine)
    return images, captions, edits


def reconstruction_error(image: Image.Image, reconstruction: Image.Image) -> float:
    a = np.asarray(image.convert("RGB"), dtype=np.float64) / 255
    b = np.asarray(reconstruction.convert("RGB").resize(image.size), dtype=np.float64) / 255
    return float(((a - b) ** 2).mean())


class Clock:
    """Time of a block, with a device sync at both ends on CUDA.

    ``seconds`` is wall time on CUDA and this process's CPU time on the CPU: the CPU figures come from a shared
    machine, where wall time mostly measures the other jobs (run with ``--threads 1`` so the two agree when quiet).
    """

    def __init__(self, device: str) -> None:
        self.device = device

    def sync(self) -> None:
        import torch

        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def now(self) -> float:
        return time.perf_counter() if self.device.startswith("cuda") else time.process_time()

    def __enter__(self):
        self.sync()
        self.start = self.now()
        self.wall_start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.sync()
        self.seconds = self.now() - self.start
        self.wall_seconds = time.perf_counter() - self.wall_start


def peak_memory_reset(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gib(device: str) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def run_reference(components, options, images, captions, edits, device):
    """The authors' algorithm: one image at a time, a reconstruction pass, one P2P run per (edit, sweep value)."""
    from lance_pipeline.editing.candidate_selection import EditRequest
    from lance_pipeline.editing.cost import count_unet_evaluations, reference_reconstruction, reference_sweep
    from lance_pipeline.editing.inversion import NullTextInversion, decode_latents
    from lance_pipeline.editing.prompt_to_prompt import PromptToPromptEditor

    editor = PromptToPromptEditor(components, options)
    inverter = NullTextInversion(
        components.unet,
        components.vae,
        components.text_encoder,
        components.tokenizer,
        components.scheduler_config,
        num_inference_steps=options.num_inference_steps,
        guidance_scale=options.guidance_scale,
        num_inner_steps=options.num_inner_steps,
        early_stop_epsilon=options.early_stop_epsilon,
        image_size=options.image_size,
    )
    peak_memory_reset(device)
    out = {"images": {}, "reconstruction_error": []}
    with count_unet_evaluations(components.unet) as inversion_count:
        with Clock(device) as inversion_clock:
            inversions = []
            for image, caption in zip(images, captions, strict=True):
                result = inverter.invert(image, caption)
                inversions.append(
                    {"latent": result.latent, "null_embeddings": result.null_embeddings, "caption": caption}
                )
    with count_unet_evaluations(components.unet) as edit_count:
        with Clock(device) as edit_clock:
            for k, inversion in enumerate(inversions):
                reconstruction = reference_reconstruction(editor, inversion)
                out["reconstruction_error"].append(reconstruction_error(images[k], reconstruction))
                requests = [EditRequest(e, "") for e in edits[k]]
                latents = reference_sweep(editor, inversion, requests)
                for (index, f), run_latents in latents.items():
                    # The authors decode the whole batch of each run: the source and the target.
                    out["images"][(k, index, f)] = decode_latents(components.vae, run_latents)[1]
    out.update(
        inversion_count=inversion_count,
        edit_count=edit_count,
        inversion_s=inversion_clock.seconds,
        edit_s=edit_clock.seconds,
        peak=peak_memory_gib(device),
    )
    return out


def run_ours(components, options, images, captions, edits, device):
    from lance_pipeline.editing.candidate_selection import EditRequest
    from lance_pipeline.editing.cost import count_unet_evaluations
    from lance_pipeline.editing.prompt_to_prompt import PromptToPromptEditor

    editor = PromptToPromptEditor(components, options)
    peak_memory_reset(device)
    out = {"images": {}, "reconstruction_error": []}
    with count_unet_evaluations(components.unet) as inversion_count:
        with Clock(device) as inversion_clock:
            inversions = editor.invert_batch(images, captions)
    with count_unet_evaluations(components.unet) as edit_count:
        with Clock(device) as edit_clock:
            for k, inversion in enumerate(inversions):
                reconstruction = editor.reconstruct(inversion)
                out["reconstruction_error"].append(reconstruction_error(images[k], reconstruction))
                sweep = editor.sweep(inversion, [EditRequest(e, "") for e in edits[k]])
                for candidate in sweep.candidates:
                    out["images"][(k, candidate.request_index, candidate.self_replace)] = candidate.image
    out.update(
        inversion_count=inversion_count,
        edit_count=edit_count,
        inversion_s=inversion_clock.seconds,
        edit_s=edit_clock.seconds,
        peak=peak_memory_gib(device),
    )
    out["edit_batch_size"] = editor.edit_batch_size
    return out


CONTROLNET_PRESET = "hardimagenet-controlnet"
CONTROLNET_PRESET_OPTIONS = (
    "num_inference_steps",
    "guidance_scale",
    "negative_prompt",
    "images_per_edit",
    "conditioning_scales",
    "batch_size",
)


def controlnet_options(image_size: int, preset: str = CONTROLNET_PRESET):
    """``ControlNetEditorOptions`` with the preset's sampling and candidate settings (the editor's defaults where the
    preset leaves them), for the benchmark's random components (no model is named or loaded)."""
    from builder.config import load_config
    from lance_pipeline.dillema.controlnet_editing import ControlNetEditorOptions

    stage = next(s for s in load_config(preset).stages if s.type == "controlnet_edit")
    chosen = {k: v for k, v in (stage.options or {}).items() if k in CONTROLNET_PRESET_OPTIONS}
    return ControlNetEditorOptions(model="random-sd1", controlnet="random-controlnet", image_size=image_size, **chosen)


def build_controlnet(components, seed: int = 0):
    """A ControlNet for ``components``' UNet, as ControlNets are initialised (``ControlNetModel.from_unet``): the
    SD 1.5 ControlNet's architecture for the full-size UNet. Its condition encoder downsamples as the VAE does."""
    import math

    import torch
    from diffusers import ControlNetModel

    stages = int(math.log2(components.vae_scale_factor))
    torch.manual_seed(seed)
    controlnet = ControlNetModel.from_unet(
        components.unet, conditioning_embedding_out_channels=(16, 32, 96, 256)[: stages + 1]
    )
    device = next(components.unet.parameters()).device
    return controlnet.requires_grad_(False).eval().to(device)


def run_controlnet(components, controlnet, options, images, captions, edits, device):
    """The ControlNet editor on the same images and edited captions: every edit rendered, nothing per image."""
    from lance_pipeline.dillema.controlnet_editing import ControlNetEditor
    from lance_pipeline.editing.candidate_selection import EditRequest
    from lance_pipeline.editing.cost import count_unet_evaluations

    editor = ControlNetEditor(components, controlnet, options)
    peak_memory_reset(device)
    out = {"images": {}, "reconstruction_error": []}
    with count_unet_evaluations(components.unet) as inversion_count:
        with Clock(device) as inversion_clock:
            pass  # nothing is inverted: the condition (Canny edges) is computed inside each render
    with count_unet_evaluations(components.unet) as edit_count:
        with Clock(device) as edit_clock:
            for k, (image, caption) in enumerate(zip(images, captions, strict=True)):
                record = {"image": image, "caption": caption, "seed": k}
                sweep = editor.render(record, [EditRequest(e, "") for e in edits[k]])
                for candidate, variant in zip(sweep.candidates, sweep.variants, strict=True):
                    out["images"][(k, candidate.request_index, variant.seed, variant.conditioning_scale)] = (
                        candidate.image
                    )
    out.update(
        inversion_count=inversion_count,
        edit_count=edit_count,
        inversion_s=inversion_clock.seconds,
        edit_s=edit_clock.seconds,
        peak=peak_memory_gib(device),
        controlnet_forwards=editor.counts.controlnet_samples,
        other_editor=True,
    )
    return out


def unet_flops_per_sample_forward(components, image_size: int, device: str) -> float:
    """FLOPs of one UNet sample-forward (one latent, one text context) at ``image_size``, counted by torch's
    ``FlopCounterMode`` on a batch of two (the count is per sample): what a forward-equivalent costs, so that
    counted forward-equivalents times this over seconds is the UNet's achieved FLOP rate (VAE and text encoder
    not included)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    unet = components.unet
    dtype = next(unet.parameters()).dtype
    latent = torch.zeros(2, unet.config.in_channels, image_size // 8, image_size // 8, device=device, dtype=dtype)
    context = torch.zeros(2, 77, unet.config.cross_attention_dim, device=device, dtype=dtype)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        unet(latent, 10, encoder_hidden_states=context)
    return counter.get_total_flops() / 2


class JsonResults(dict):
    """The rows of this run as they finish: a dict of result name -> raw result, mirrored to ``--json`` (one
    snapshot after every row, so a run stopped by a time budget keeps what it finished)."""

    def __init__(self, path, header, n_images: int, n_cf: int, flops_per_forward: float) -> None:
        super().__init__()
        self.path, self.header = path, header
        self.n_images, self.n_cf, self.flops_per_forward = n_images, n_cf, flops_per_forward
        self.summary: dict = {}
        self._write()

    def __setitem__(self, name, result) -> None:
        super().__setitem__(name, result)
        self._write()

    def finish(self, **summary) -> None:
        self.summary = summary
        self._write()

    def row(self, name: str, r: dict) -> dict:
        fwd_eq = r["inversion_count"].forward_equivalents + r["edit_count"].forward_equivalents
        seconds = r["inversion_s"] + r["edit_s"]
        row = {
            "name": name,
            "unet_fwd_eq_per_cf": fwd_eq / self.n_cf,
            "inversion_fwd_eq_per_image": r["inversion_count"].forward_equivalents / self.n_images,
            "editing_fwd_eq_per_cf": r["edit_count"].forward_equivalents / self.n_cf,
            "s_inversion_per_image": r["inversion_s"] / self.n_images,
            "s_editing_per_cf": r["edit_s"] / self.n_cf,
            "s_per_cf": seconds / self.n_cf,
            "s_per_image": seconds / self.n_images,
            "peak_gib": r["peak"],
            "unet_tflops_achieved": fwd_eq * self.flops_per_forward / seconds / 1e12 if seconds > 0 else None,
            "controlnet_fwd_per_cf": r.get("controlnet_forwards", 0) / self.n_cf,
        }
        if not r.get("other_editor"):
            row["reconstruction_mse"] = float(np.mean(r["reconstruction_error"]))
        return row

    def _write(self) -> None:
        from bench_json import write_json

        rows = [self.row(name, r) for name, r in self.items()]
        write_json(self.path, {"benchmark": "bench_edit", **self.header, "rows": rows, "summary": self.summary})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--images", type=int, default=2, help="source images (inverted together by ours)")
    parser.add_argument("--edits", type=int, default=6, help="edited captions per image (one per edit type)")
    parser.add_argument("--steps", type=int, default=None, help="DDIM steps (default: 50 full, 10 small)")
    parser.add_argument("--inner-steps", type=int, default=None, help="null-text iterations (10 full, 3 small)")
    parser.add_argument("--edit-batch-size", type=int, default=None, help="target rows per run (default: by memory)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads on CPU")
    parser.add_argument(
        "--methods",
        type=lambda v: v.split(","),
        default=["null_text", "negative_prompt", "direct"],
        help="inversion methods of the extra 'ours' rows (comma-separated)",
    )
    parser.add_argument(
        "--precisions", type=lambda v: v.split(","), default=["fp32"], help="fp32,bf16 (bf16: autocast sampling)"
    )
    parser.add_argument(
        "--no-controlnet", action="store_true", help=f"leave out the ControlNet editor's row ({CONTROLNET_PRESET})"
    )
    parser.add_argument("--json", default=None, help="also write every row to this JSON file (after each row)")
    parser.add_argument(
        "--compile",
        default="none",
        help="torch.compile mode of the UNet blocks for extra rows (default, max-autotune-no-cudagraphs; none: off)",
    )
    args = parser.parse_args(argv)

    import torch

    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    from lance_pipeline.editing.options import ImageEditorOptions

    image_size, *_, steps, inner = SIZES[args.size]
    steps = args.steps or steps
    inner = args.inner_steps if args.inner_steps is not None else inner
    components = build_components(args.size, args.device)
    options = ImageEditorOptions(
        model="random-sd1",
        image_size=image_size,
        num_inference_steps=steps,
        num_inner_steps=inner,
        early_stop_epsilon=0.0,  # random weights: run every iteration in both (the worst case, as the issue counts)
        edit_batch_size=args.edit_batch_size,
    )
    images, captions, edits = workload(args.images, args.edits, image_size)
    n_cf = args.images * args.edits
    print(
        f"# bench_edit: size={args.size} ({image_size}px) device={args.device} images={args.images} "
        f"edits/image={args.edits} steps={steps} null-text iterations={inner} sweep={list(options.self_replace_sweep)} "
        f"torch={torch.__version__} threads={torch.get_num_threads()} "
        f"seconds={'wall' if args.device.startswith('cuda') else 'process CPU time'}"
    )
    cn_options = None if args.no_controlnet else controlnet_options(image_size)
    if cn_options is not None:
        print(
            f"# controlnet ({CONTROLNET_PRESET} preset): {cn_options.num_inference_steps} UniPC steps, guidance "
            f"{cn_options.guidance_scale}, images_per_edit={cn_options.images_per_edit}, "
            f"conditioning_scales={list(cn_options.conditioning_scales)}, batch_size={cn_options.batch_size}"
        )
    flops_per_forward = unet_flops_per_sample_forward(components, image_size, args.device)
    header = {
        "size": args.size,
        "image_size": image_size,
        "device": args.device,
        "images": args.images,
        "edits_per_image": args.edits,
        "steps": steps,
        "null_text_iterations": inner,
        "sweep": list(options.self_replace_sweep),
        "unet_flops_per_sample_forward": flops_per_forward,
        "seconds": "wall" if args.device.startswith("cuda") else "process CPU time",
    }
    results = JsonResults(args.json, header, n_images=args.images, n_cf=n_cf, flops_per_forward=flops_per_forward)
    for name, runner in (("reference fp32", run_reference), ("ours null_text fp32", run_ours)):
        results[name] = runner(components, options, images, captions, edits, args.device)
    reference, ours = results["reference fp32"], results["ours null_text fp32"]
    for method in args.methods:
        for precision in args.precisions:
            name = f"ours {method} {precision}"
            if name not in results:
                variant = dataclasses.replace(options, inversion=method, precision=precision)
                results[name] = run_ours(components, variant, images, captions, edits, args.device)
    if cn_options is not None:
        controlnet = build_controlnet(components)
        results["controlnet fp32"] = run_controlnet(
            components, controlnet, cn_options, images, captions, edits, args.device
        )

    compiled_rows = {}
    if args.compile != "none":
        from lance_pipeline.editing.sd_components import compile_unet

        compiled = dataclasses.replace(components, unet=copy.deepcopy(components.unet), compile=args.compile)
        compiled.compiled_modules = compile_unet(compiled.unet, args.compile)
        for method in args.methods:
            for precision in args.precisions:
                eager_name = f"ours {method} {precision}"
                variant = dataclasses.replace(options, inversion=method, precision=precision, compile=args.compile)
                warm_start = time.perf_counter()  # compiles every block at every shape this workload meets
                run_ours(compiled, variant, images, captions, edits, args.device)
                warm_seconds = time.perf_counter() - warm_start
                name = f"{eager_name} compile={args.compile}"
                results[name] = run_ours(compiled, variant, images, captions, edits, args.device)
                compiled_rows[name] = (eager_name, warm_seconds)
        import torch._dynamo

        stats = torch._dynamo.utils.counters["stats"]
        print(f"# torch.compile: {compiled.compiled_modules} UNet blocks, {stats['unique_graphs']} graphs compiled")

    def mean_diff(result, against=None) -> float:
        against = against or reference
        return float(
            np.mean(
                [
                    np.abs(np.asarray(result["images"][key], np.float64) - np.asarray(image, np.float64)).mean()
                    for key, image in against["images"].items()
                ]
            )
        )

    def max_diff(result, against=None) -> int:
        against = against or reference
        return max(
            int(np.abs(np.asarray(result["images"][key], np.int16) - np.asarray(image, np.int16)).max())
            for key, image in against["images"].items()
        )

    print(
        "| method | UNet fwd-eq / cf | inversion fwd-eq / image | editing fwd-eq / cf | s inversion / image | "
        "s editing / cf | s / cf (all) | peak GPU GiB | recon. MSE | max px diff vs reference | mean px diff | "
        "ControlNet fwd / cf |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        total = r["inversion_count"].forward_equivalents + r["edit_count"].forward_equivalents
        total_s = r["inversion_s"] + r["edit_s"]
        peak = f"{r['peak']:.2f}" if r["peak"] is not None else "n/a (CPU)"
        if r.get("other_editor"):  # nothing reconstructed, other images: no distance to the reference's
            quality = "n/a (no inversion) | n/a (other editor) | n/a"
        else:
            quality = f"{np.mean(r['reconstruction_error']):.5f} | {max_diff(r)} | {mean_diff(r):.2f}"
        print(
            f"| {name} | {total / n_cf:.0f} | {r['inversion_count'].forward_equivalents / args.images:.0f} | "
            f"{r['edit_count'].forward_equivalents / n_cf:.0f} | {r['inversion_s'] / args.images:.2f} | "
            f"{r['edit_s'] / n_cf:.2f} | {total_s / n_cf:.2f} | {peak} | {quality} | "
            f"{r.get('controlnet_forwards', 0) / n_cf:.0f} |"
        )
    print(f"# ours: edit_batch_size={ours['edit_batch_size']} target rows per run")
    for name, (eager_name, warm_seconds) in compiled_rows.items():
        r, eager = results[name], results[eager_name]
        print(
            f"# {name}: compiled_vs_eager={(eager['inversion_s'] + eager['edit_s']) / (r['inversion_s'] + r['edit_s']):.2f} "
            f"max px diff vs eager={max_diff(r, eager)} mean={mean_diff(r, eager):.3f} "
            f"recon. MSE diff={abs(np.mean(r['reconstruction_error']) - np.mean(eager['reconstruction_error'])):.2e} "
            f"warm-up (compilation + one run)={warm_seconds:.0f} s wall"
        )
    reference_total = reference["inversion_s"] + reference["edit_s"]
    for name, r in results.items():
        if r is not reference and r is not ours and not r.get("other_editor"):
            print(f"# {name}: speedup_vs_reference={reference_total / (r['inversion_s'] + r['edit_s']):.2f}")
    if "controlnet fp32" in results:
        cn = results["controlnet fp32"]
        ours_fwd = ours["inversion_count"].forward_equivalents + ours["edit_count"].forward_equivalents
        cn_fwd = cn["inversion_count"].forward_equivalents + cn["edit_count"].forward_equivalents
        cn_s = cn["inversion_s"] + cn["edit_s"]
        print(
            f"# controlnet vs ours null_text fp32: unet_fwd_eq_ratio={ours_fwd / cn_fwd:.2f} "
            f"seconds_ratio={(ours['inversion_s'] + ours['edit_s']) / cn_s:.2f} "
            f"(controlnet_unet_fwd_per_cf={cn_fwd / n_cf:.0f} controlnet_s_per_cf={cn_s / n_cf:.3f}; the ControlNet's "
            f"own {cn['controlnet_forwards'] / n_cf:.0f} forwards per cf not counted in the ratio)"
        )
    speedup = (reference["inversion_s"] + reference["edit_s"]) / (ours["inversion_s"] + ours["edit_s"])
    ratio = sum(reference[k].forward_equivalents for k in ("inversion_count", "edit_count")) / sum(
        ours[k].forward_equivalents for k in ("inversion_count", "edit_count")
    )
    print(f"speedup_vs_reference={speedup:.2f} fwd_eq_ratio={ratio:.2f}")
    results.finish(speedup_vs_reference=speedup, fwd_eq_ratio=ratio)


if __name__ == "__main__":
    main()
