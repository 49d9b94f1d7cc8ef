"""The two editors' cost per counterfactual: UNet sample-forwards (machine-independent) and seconds (this machine).

Prompt-to-prompt (LANCE: null-text inversion of the image, then a sweep of self-attention fractions per edit) and
ControlNet regeneration (DILLEMA: UniPC, 5 steps per candidate, nothing per image) render the same caption edits of
the same image with the same settings as the presets (50 DDIM steps, 10 null-text iterations, the 6-value sweep;
5 UniPC steps, one seed). A forward pre-hook on the UNet (and the ControlNet) counts the samples each forward sees:
with classifier-free guidance one denoising step of one image is 2 samples. Null-text optimisation stops early per
step, so its count depends on the image; the rest does not. The seconds of the tiny models say nothing about a GPU,
only the ratio on one machine in one run does, roughly.

    .venv/bin/python benchmarks/bench_controlnet.py [--edits 3] [--device cpu] [--threads 1]
    # real models, on a GPU (downloads SD 1.4, SD 1.5, the Canny ControlNet and CLIP ViT-L/14 at pinned revisions):
    .venv/bin/python benchmarks/bench_controlnet.py --real --device cuda --image-size 512

Last line: ``p2p_unet_samples_per_cf=X controlnet_unet_samples_per_cf=Y ratio=Z p2p_s_per_cf=A controlnet_s_per_cf=B``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OPEN_GATES = {
    "clip_directional_threshold": -1.0,
    "clip_image_threshold": -1.0,
    "clip_text_threshold": -1.0,
    "require_edited_closer": False,
}
CAPTION = "a photo of a man riding a horse on a beach"
EDITS = [
    ("subject", "a photo of a woman riding a horse on a beach", "man", "woman"),
    ("background", "a photo of a man riding a horse in a forest", "on a beach", "in a forest"),
    ("weather", "a photo of a man riding a horse on a beach in the snow", "", "in the snow"),
    ("adjective", "a photo of a man riding a brown horse on a beach", "", "brown"),
    ("domain", "a painting of a man riding a horse on a beach", "photo", "painting"),
]


class SampleCounter:
    """Counts the samples (batch rows) that pass through a module's forward."""

    def __init__(self, module) -> None:
        self.samples = 0
        self.handle = module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs) -> None:
        sample = args[0] if args else kwargs["sample"]
        self.samples += int(sample.shape[0])


def _photo(size: int) -> Image.Image:
    rng = np.random.default_rng(0)
    small = rng.integers(0, 255, size=(size // 8, size // 8, 3), dtype=np.uint8)
    return Image.fromarray(small).resize((size, size), Image.Resampling.BICUBIC)


def _record(size: int, n_edits: int) -> dict:
    edits = [
        {"edit_type": t, "edited_caption": c, "original_span": o, "edited_span": e, "kept": True}
        for t, c, o, e in EDITS[:n_edits]
    ]
    return {
        "key": "bench",
        "image": _photo(size),
        "label": 0,
        "label_name": "horse",
        "seed": 1,
        "caption": CAPTION,
        "edits": edits,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edits", type=int, default=3, help=f"caption edits rendered (1..{len(EDITS)})")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--real", action="store_true", help="the presets' real models (GPU, downloads)")
    args = parser.parse_args()
    import torch

    from lance_pipeline.controlnet_editing import ControlNetEditStage
    from lance_pipeline.image_editing import CounterfactualEditStage, InversionStage

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.real:
            sd, cn_sd, controlnet, clip = {}, {}, {}, {}
        else:
            from lance_pipeline.tiny_clip_components import create_tiny_open_clip
            from lance_pipeline.tiny_controlnet_components import create_tiny_controlnet
            from lance_pipeline.tiny_image_components import create_tiny_stable_diffusion

            sd_dir = str(create_tiny_stable_diffusion(Path(tmp) / "sd"))
            sd = {"model": sd_dir, "revision": None}
            cn_sd = {"model": sd_dir, "revision": None}
            controlnet = {"controlnet": str(create_tiny_controlnet(Path(tmp) / "cn")), "controlnet_revision": None}
            clip = {"clip_model": str(create_tiny_open_clip(Path(tmp) / "clip")), "clip_pretrained": None}
        record = _record(args.image_size, args.edits)

        # 1. Prompt-to-prompt: null-text inversion, then the sweep (the presets' settings).
        p2p_options = {**sd, **clip, **OPEN_GATES, "image_size": args.image_size}
        invert = InversionStage(**p2p_options)
        edit = CounterfactualEditStage(**p2p_options)
        invert.load(args.device)
        edit.load(args.device)
        unet = invert.editor.components.unet
        counter = SampleCounter(unet)
        start = time.perf_counter()
        inverted = invert.process([record])[0]
        invert_samples, invert_s = counter.samples, time.perf_counter() - start
        start = time.perf_counter()
        p2p = edit.process([{**record, **inverted}])[0]
        sweep_samples, sweep_s = counter.samples - invert_samples, time.perf_counter() - start
        counter.handle.remove()

        # 2. ControlNet: 5 UniPC steps per candidate, one seed, nothing per image.
        cn = ControlNetEditStage(**cn_sd, **controlnet, **clip, **OPEN_GATES, image_size=args.image_size)
        cn.load(args.device)
        counter = SampleCounter(cn.editor.components.unet)
        cn_counter = SampleCounter(cn.editor.controlnet)
        start = time.perf_counter()
        result = cn.process([record])[0]
        cn_s = time.perf_counter() - start
        cn_samples, cn_net_samples = counter.samples, cn_counter.samples

    n = args.edits
    p2p_per_cf = (invert_samples + sweep_samples) / n
    cn_per_cf = cn_samples / n
    print(f"edits: {n}; image size {args.image_size}; device {args.device}; torch threads {args.threads}")
    print(
        f"prompt-to-prompt: inversion {invert_samples} UNet samples ({invert_s:.2f} s), sweep {sweep_samples} "
        f"({sweep_s:.2f} s), {len(p2p['edit_candidates'])} candidates"
    )
    print(
        f"controlnet: {cn_samples} UNet samples + {cn_net_samples} ControlNet samples ({cn_s:.2f} s), "
        f"{len(result['edit_candidates'])} candidates"
    )
    print(
        f"p2p_unet_samples_per_cf={p2p_per_cf:.1f} controlnet_unet_samples_per_cf={cn_per_cf:.1f} "
        f"ratio={p2p_per_cf / cn_per_cf:.1f} p2p_s_per_cf={(invert_s + sweep_s) / n:.3f} "
        f"controlnet_s_per_cf={cn_s / n:.3f}"
    )


if __name__ == "__main__":
    main()
