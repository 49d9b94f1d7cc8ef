"""Build throughput against the number of workers, on CPU, with the demo preset's real (tiny) stages.

The same build (the demo preset's stages, ``--torch-threads 1`` per worker, batches of one image) over a generated
image folder is run with the local engine and with the ``devices`` engine on 1..N CPU worker processes (and, with
``--ray``, the Ray engine on 1..N actors). Reported per run: wall seconds (worker start-up and model loading
included, as a user sees it), images/s, speed-up over the local engine, efficiency per worker (speed-up / workers),
and whether the release is byte-identical to the local one (it must be). The machine's CPU count and load average
are printed: on a shared machine the efficiencies say more about the neighbours than about the engine.

With ``--pools LAYOUT`` (a ``--stage-workers`` value, e.g. ``invert+reconstruct+edit+lance_r_edit=1``: those stages
in a pool of their own, the rest in a pool of one) the devices engine also runs with per-stage pools (a pipeline: the
workers column counts every process); ``--stage-major`` adds the stage-major schedule on each worker count.

    python benchmarks/bench_scale.py                     # local, devices x1, x2 on 8 images
    python benchmarks/bench_scale.py --images 16 --workers 1 2 4 --ray
    python benchmarks/bench_scale.py --workers 1 2 --pools invert+reconstruct+edit+lance_r_edit=1 --stage-major
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CLASSES = ["dog", "cat", "car", "bird"]


def make_images(root: Path, count: int) -> Path:
    import numpy as np
    from PIL import Image

    for i in range(count):
        folder = root / CLASSES[i % len(CLASSES)]
        folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(i)
        y, x = np.mgrid[0:96, 0:96]
        base = np.stack([x * 2 + i * 7, y * 2 + i * 3, (x + y) + i * 11], -1) % 256
        pixels = np.clip(base + rng.integers(0, 60, size=(96, 96, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"img_{i:03d}.png")
    return root


def release_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and not rel.startswith(".lance-cf/"):
            digest.update(rel.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def run(config, output: Path, **kwargs) -> float:
    from builder.engine import build

    start = time.perf_counter()
    build(config, output, device="cpu", progress=False, torch_threads=1, **kwargs)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--ray", action="store_true", help="also the Ray engine (local Ray, started here)")
    parser.add_argument("--pools", action="append", default=[], metavar="LAYOUT", help="a --stage-workers layout")
    parser.add_argument("--stage-major", action="store_true", help="also the stage-major schedule (devices engine)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("LANCE_CF_CACHE", str(Path(tempfile.gettempdir()) / "lance-cf-bench-cache"))

    from builder.config import apply_overrides, load_config
    from builder.dispatch import parse_stage_settings, plan_pools

    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        root = Path(tmp)
        source = make_images(root / "images", args.images)
        config = apply_overrides(load_config("demo"), source=f"imagefolder:{source}", batch_size=1)
        # Warm-up: the demo components are built into the cache once, outside any timing.
        run(apply_overrides(config, limit=1), root / "warm")
        rows = []
        local_s = run(config, root / "local")
        local_digest = release_digest(root / "local")
        rows.append(("local", 1, local_s, True))
        for workers in args.workers:
            out = root / f"devices-{workers}"
            seconds = run(config, out, engine="devices", engine_options={"devices": ["cpu"] * workers})
            rows.append(("devices", workers, seconds, release_digest(out) == local_digest))
            if args.stage_major:
                out = root / f"stage-major-{workers}"
                options = {"devices": ["cpu"] * workers}
                seconds = run(config, out, engine="devices", engine_options=options, schedule="stage-major")
                rows.append(("devices, stage-major", workers, seconds, release_digest(out) == local_digest))
        for layout in args.pools:
            stage_workers = parse_stage_settings(layout, "--pools")
            active = [s.name for s in config.active_stages()]
            processes = sum(p.workers for p in plan_pools(active, stage_workers, None, 1, None))
            out = root / f"pools-{len(rows)}"
            options = {"devices": ["cpu"], "stage_workers": stage_workers}
            seconds = run(config, out, engine="devices", engine_options=options)
            rows.append((f"devices, pools {layout} + rest=1", processes, seconds, release_digest(out) == local_digest))
        if args.ray:
            import ray

            ray.init(num_cpus=max(args.workers), include_dashboard=False, log_to_driver=False)
            try:
                for workers in args.workers:
                    out = root / f"ray-{workers}"
                    seconds = run(config, out, engine="ray", workers=workers)
                    rows.append(("ray", workers, seconds, release_digest(out) == local_digest))
            finally:
                ray.shutdown()
    print(f"# {args.images} images, demo preset stages, batch 1, torch threads 1 per worker; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end")  # fmt: skip
    print("| engine | workers | wall s | img/s | speed-up vs local | efficiency per worker | same bytes as local |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for engine, workers, seconds, same in rows:
        speedup = local_s / seconds
        print(
            f"| {engine} | {workers} | {seconds:.1f} | {args.images / seconds:.3f} | {speedup:.2f} | "
            f"{speedup / workers:.2f} | {'yes' if same else 'NO'} |"
        )
    if not all(same for *_, same in rows):
        raise SystemExit("a multi-worker release differs from the local one")


if __name__ == "__main__":
    main()
