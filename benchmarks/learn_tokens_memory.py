"""Peak memory of ``lance-cf interfaces learn-tokens`` against the number of images per class.

``learn-tokens`` learns one class at a time and decodes a training image only when a step draws it, so its memory
should not grow with the images per class. This script measures that: for each N it writes one class of N photos
(``--size`` pixels, PNG) into an image folder, runs ``learn-tokens --images-per-class N`` on the tiny Stable Diffusion
(``lance_pipeline.tiny``; the models' memory is a constant, so the slope is what matters) in a fresh process, and
reports that process's peak resident set (``ru_maxrss`` of the child, Linux). ``--compare GIT_DIR`` runs a second
checkout (e.g. the commit before streaming, which decoded every image of every class first) the same way.

    python benchmarks/learn_tokens_memory.py --images 8 64 256 --size 1024 768 [--compare /path/to/old/checkout]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PEAK = """
import resource, subprocess, sys
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
if proc.returncode:
    sys.stderr.write(proc.stderr[-2000:])
    sys.exit(proc.returncode)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def write_class(root: Path, count: int, size: tuple[int, int]) -> Path:
    import numpy as np
    from PIL import Image

    folder = root / "n01440764"  # tench
    folder.mkdir(parents=True, exist_ok=True)
    w, h = size
    y, x = np.mgrid[0:h, 0:w]
    for i in range(count):
        rng = np.random.default_rng(i)
        base = np.stack([(x * 255) // w, (y * 255) // h, ((x + y + 7 * i) * 127) // (w + h)], -1)
        pixels = np.clip(base + rng.integers(0, 24, size=(h, w, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"img_{i:04d}.png")
    return root


def peak_mib(checkout: Path, photos: Path, out: Path, sd: Path, count: int) -> float:
    command = [sys.executable, "-m", "builder.cli", "interfaces", "learn-tokens", "--source", f"imagefolder:{photos}",
               "--output", str(out), "--model", str(sd), "--steps", "2", "--resolution", "32", "--images-per-class",
               str(count), "--no-progress", "--device", "cpu"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    # cwd is the checkout: `python -m` puts the working directory first on the import path
    proc = subprocess.run(
        [sys.executable, "-c", PEAK, *command], env=env, cwd=checkout, capture_output=True, text=True, check=True
    )
    return int(proc.stdout.strip().splitlines()[-1]) / 1024  # ru_maxrss is in KiB on Linux


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, nargs="+", default=[8, 64, 256], help="images per class")
    parser.add_argument("--size", type=int, nargs=2, default=[1024, 768], metavar=("W", "H"), help="photo size")
    parser.add_argument("--compare", type=Path, help="another checkout to measure the same way")
    args = parser.parse_args(argv)

    from lance_pipeline.tiny.image_components import create_tiny_stable_diffusion

    with tempfile.TemporaryDirectory(prefix="learn-tokens-memory-") as tmp:
        root = Path(tmp)
        sd = create_tiny_stable_diffusion(root / "tiny-sd")
        photos = write_class(root / "photos", max(args.images), tuple(args.size))
        checkouts = {"this checkout": REPO, **({"compared": args.compare.resolve()} if args.compare else {})}
        results = {}
        for label, checkout in checkouts.items():
            for count in args.images:
                out = root / f"tokens-{len(results)}"
                results[f"{label}, {count} images"] = round(peak_mib(checkout, photos, out, sd, count), 1)
                print(f"{label}: {count} images of {args.size[0]}x{args.size[1]} -> peak RSS "
                      f"{results[f'{label}, {count} images']} MiB", flush=True)  # fmt: skip
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
