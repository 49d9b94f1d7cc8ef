"""Projection of release builds to ImageNet scale from machine-independent counts (docs/scaling.md).

Time: source images x UNet sample-forward-equivalents per image (counted by benchmarks/bench_edit.py with hooks) x
FLOPs per UNet sample-forward at 512^2, divided by (GPUs x peak FLOP/s x a stated utilisation). Storage: the bytes
the ledger and the release hold per source image, computed from tensor shapes and PNG sizes (stated below).

    python benchmarks/project_scale.py                                  # the defaults below
    python benchmarks/project_scale.py --forwards-per-image 7400 --utilisation 0.35 --gpu h100-bf16

Nothing here is measured on a GPU: every figure is a projection from the inputs it prints, and says so.
"""

from __future__ import annotations

import argparse

# FLOPs of one SD 1.x UNet sample-forward at 512x512 (64x64 latent), classifier-free guidance counted as two samples
# by the forward-equivalent counter. Figure given in the editor issue (0.803 TFLOP).
UNET_TFLOP_PER_FORWARD = 0.803
# Dense peak TFLOP/s of common accelerators (vendor datasheets, no sparsity).
PEAKS = {
    "a100-fp32": 19.5,
    "a100-tf32": 156.0,
    "a100-bf16": 312.0,
    "h100-tf32": 494.7,
    "h100-bf16": 989.4,
}
DATASETS = {"hardimagenet": 750, "imagenet-val": 50_000}
GPUS = (1, 8, 64)

# Per source image, HardImageNet settings (50 DDIM steps, SD 1.x text encoder 77 x 768, 512^2 images):
NULL_TEXT_BYTES = 50 * 77 * 768 * 4  # null embeddings per step, fp32 (11.8 MB)
LATENT_BYTES = 4 * 64 * 64 * 4  # x_T, fp32
# Mean size of the five bundled demo photos centre-cropped to 512^2 and encoded as the builder encodes PNG
# (measured: 291,855 / 339,114 / 129,818 / 295,662 / 298,955 bytes). Real datasets vary with content.
PNG_512_BYTES = 271_081


def project(forwards_per_image: float, utilisation: float, peak_tflops: float, images: int, gpus: int) -> float:
    """Wall-clock hours for ``images`` source images on ``gpus`` GPUs (perfect scaling across GPUs assumed)."""
    tflop = images * forwards_per_image * UNET_TFLOP_PER_FORWARD
    return tflop / (gpus * peak_tflops * utilisation) / 3600.0


def storage_per_image(counterfactuals_per_image: float, candidates_per_image: float, keep_inversions: bool) -> dict:
    inversion = NULL_TEXT_BYTES + LATENT_BYTES if keep_inversions else 0
    release = PNG_512_BYTES * (2 + counterfactuals_per_image + 1)  # original, reconstruction, counterfactuals, LANCE-R
    ledger = inversion + PNG_512_BYTES * (candidates_per_image + 2 + counterfactuals_per_image + 1)
    return {"inversion": inversion, "release": release, "ledger": ledger}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--forwards-per-image",
        type=float,
        default=15_100,
        help="UNet sample-forward-equivalents per source image (default: main before editor v2)",
    )
    parser.add_argument("--utilisation", type=float, default=0.4, help="fraction of peak FLOP/s reached (stated)")
    parser.add_argument("--gpu", choices=sorted(PEAKS), default="a100-bf16")
    parser.add_argument("--counterfactuals-per-image", type=float, default=10.0, help="kept edits per image")
    parser.add_argument(
        "--candidates-per-image",
        type=float,
        default=0.0,
        help="sweep candidate images kept in the ledger per image (0: scores only)",
    )
    parser.add_argument("--keep-inversions", choices=("yes", "no"), default="yes")
    args = parser.parse_args()  # fmt: skip

    peak = PEAKS[args.gpu]
    print(f"inputs: {args.forwards_per_image:,.0f} UNet forwards/image x {UNET_TFLOP_PER_FORWARD} TFLOP, "
          f"{args.gpu} peak {peak} TFLOP/s at {args.utilisation:.0%} utilisation (assumed, not measured)")  # fmt: skip
    print("| dataset | images | " + " | ".join(f"{g} GPU(s), hours" for g in GPUS) + " | GPU-hours |")
    print("|---|---|" + "---|" * (len(GPUS) + 1))
    for name, images in DATASETS.items():
        hours = [project(args.forwards_per_image, args.utilisation, peak, images, g) for g in GPUS]
        print(f"| {name} | {images:,} | " + " | ".join(f"{h:,.1f}" for h in hours) + f" | {hours[0]:,.0f} |")
    sizes = storage_per_image(args.counterfactuals_per_image, args.candidates_per_image, args.keep_inversions == "yes")
    print()
    print("| dataset | ledger (GB) | release (GB) |")
    print("|---|---|---|")
    for name, images in DATASETS.items():
        print(f"| {name} | {images * sizes['ledger'] / 1e9:,.1f} | {images * sizes['release'] / 1e9:,.1f} |")
    print(f"per image: inversion {sizes['inversion'] / 1e6:.1f} MB, release {sizes['release'] / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
