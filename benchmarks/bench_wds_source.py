"""WebDataset source: listing and reading every sample of one compressed shard, plain tar as the reference.

A compressed shard is decompressed once (at listing); reading a sample never decompresses it again. The ratio of
the compressed shard's time to the plain tar's shows what decompression costs; before, every sample re-scanned the
archive, so the time grew with samples x shard size. Not a timed test.

    .venv/bin/python benchmarks/bench_wds_source.py [--samples 1000]

Last line: ``samples=N gz_list_s=A gz_read_s=B tar_list_s=C tar_read_s=D ratio_gz_vs_tar=R``.
"""

from __future__ import annotations

import argparse
import gzip
import io
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from builder.sources import create_source  # noqa: E402


def write_shard(path: Path, samples: int) -> None:
    rng = np.random.default_rng(0)
    with tarfile.open(path, "w") as tar:
        for i in range(samples):
            image = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(image, format="PNG")
            for ext, data in (("png", image.getvalue()), ("cls", str(i % 1000).encode())):
                info = tarfile.TarInfo(f"k{i:06d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def list_and_read(spec: str) -> tuple[float, float, int]:
    start = time.perf_counter()
    source = create_source(spec)
    listed = time.perf_counter()
    total = sum(len(source.read(s)) for s in source.samples)
    return listed - start, time.perf_counter() - listed, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "shard.tar"
        write_shard(plain, args.samples)
        packed = Path(tmp) / "shard.tar.gz"
        packed.write_bytes(gzip.compress(plain.read_bytes()))
        gz_list, gz_read, gz_bytes = list_and_read(f"wds:{packed}")
        tar_list, tar_read, tar_bytes = list_and_read(f"wds:{plain}")
    assert gz_bytes == tar_bytes
    ratio = (gz_list + gz_read) / max(tar_list + tar_read, 1e-9)
    print(
        f"samples={args.samples} gz_list_s={gz_list:.3f} gz_read_s={gz_read:.3f} "
        f"tar_list_s={tar_list:.3f} tar_read_s={tar_read:.3f} ratio_gz_vs_tar={ratio:.2f}"
    )


if __name__ == "__main__":
    main()
