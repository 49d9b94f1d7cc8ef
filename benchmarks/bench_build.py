"""Builder overhead: a full `original` build (ledger, shards, manifest, card) vs the bare decode+encode loop.

The bare loop does only the unavoidable work (read, decode, crop/resize, PNG-encode every image) in one thread; the
ratio shows what the engine's bookkeeping costs (or saves, with decoding overlapped on a thread). Not a timed test.

    .venv/bin/python benchmarks/bench_build.py [--images 200] [--size 500x375]

Last line: ``images_per_s_build=X images_per_s_bare=Y ratio_build_vs_bare=Z``.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from builder.config import BuildConfig  # noqa: E402
from builder.engine import build  # noqa: E402
from builder.images import decode_image, encode_image  # noqa: E402


def make_source(root: Path, n: int, size: tuple[int, int]) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        folder = root / f"class_{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        # Smooth images compress like photos; pure noise would make PNG encoding unrealistically slow.
        small = rng.integers(0, 255, size=(size[1] // 16, size[0] // 16, 3), dtype=np.uint8)
        img = Image.fromarray(small).resize(size, Image.Resampling.BICUBIC)
        path = folder / f"img_{i:05d}.jpg"
        img.save(path, quality=90)
        paths.append(path)
    return paths


def bare_loop(paths: list[Path], image_size: int) -> float:
    start = time.perf_counter()
    out = io.BytesIO()
    for path in paths:
        img = decode_image(path.read_bytes(), image_size=image_size)
        out.write(encode_image(img, "png"))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--size", default="500x375")
    parser.add_argument("--image-size", type=int, default=512)
    args = parser.parse_args()
    size = tuple(int(v) for v in args.size.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = make_source(root / "src", args.images, size)
        bare = bare_loop(paths, args.image_size)
        config = BuildConfig(
            name="bench", source=f"imagefolder:{root / 'src'}", configs=["original"], image_size=args.image_size
        )
        start = time.perf_counter()
        build(config, root / "release", progress=False)
        built = time.perf_counter() - start
    n = args.images
    print(f"images={n} size={args.size} image_size={args.image_size}")
    print(f"bare loop: {bare:.2f}s  build: {built:.2f}s")
    print(f"images_per_s_build={n / built:.1f} images_per_s_bare={n / bare:.1f} ratio_build_vs_bare={bare / built:.2f}")


if __name__ == "__main__":
    main()
