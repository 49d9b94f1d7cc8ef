"""What keeping the strength series (the edit stage's ``keep_candidates``) costs, in one run.

1. **Network evaluations and stage time** (tiny Stable Diffusion and tiny CLIP, built locally with random weights):
   the ``edit`` stage on the same record and edits with the option off and on, alternately ``--repeats`` times. UNet
   sample-forwards and backwards are counted with ``lance_pipeline.editing.cost.count_unet_evaluations`` (exact,
   machine-independent); wall seconds of ``process()`` are this machine's, reported as medians and their ratio.
2. **What each kept candidate adds downstream**: the builder stores the stage's output in the ledger (PNG,
   compression level 1, ``builder.ledger``) and encodes every release sample's image for the shard
   (``builder.images.encode_image``, PNG level 6). Measured on the bundled photos (``builder/demo_images``) resized to
   ``--size`` (512: the ``hardimagenet`` image size): bytes and seconds per image, for both encodings.
3. With ``--demo OUT``: the ``demo`` preset built twice into ``OUT`` (with the strength config, and with
   ``--configs original,reconstructed,counterfactual,lance_r``, which switches ``keep_candidates`` off), reporting
   bytes per config, of the whole release and of the ledger, and the build's wall seconds.

    python benchmarks/bench_strength.py --repeats 5 --size 512 [--demo /tmp/bench-strength]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
CAPTION = "a photo of a dog sitting on the grass"
EDITS = [
    ("subject", "a photo of a cat sitting on the grass", "cat"),
    ("weather", "a photo of a dog sitting on the grass in the snow", "in the snow"),
    ("background", "a photo of a dog sitting on the beach", "beach"),
]


def edit_stage_cost(repeats: int, work: Path) -> dict:
    import numpy as np
    import torch
    from PIL import Image

    from lance_pipeline.editing.cost import count_unet_evaluations
    from lance_pipeline.editing.stages import CounterfactualEditStage, InversionStage
    from lance_pipeline.tiny.clip_components import create_tiny_open_clip
    from lance_pipeline.tiny.image_components import create_tiny_stable_diffusion

    torch.set_num_threads(1)
    sd = str(create_tiny_stable_diffusion(work / "sd"))
    clip = str(create_tiny_open_clip(work / "clip"))
    size, steps = 64, 10  # the demo's image size and steps
    image = Image.fromarray((np.random.RandomState(0).rand(size, size, 3) * 255).astype("uint8"))
    record = {"key": "img0", "image": image, "label": 3, "label_name": "dog", "seed": 11, "caption": CAPTION}
    common = {"model": sd, "image_size": size, "num_inference_steps": steps}
    invert = InversionStage(num_inner_steps=3, **common)
    invert.load("cpu")
    (update,) = invert.process([record])
    record |= update
    record["edits"] = [
        {"edit_type": t, "edited_caption": c, "original_span": "", "edited_span": s, "scores": {}, "kept": True}
        for t, c, s in EDITS
    ]
    # every gate open: all six candidates of every edit pass, the largest series (and cost) the option can keep
    gates = {"clip_directional_threshold": -1.0, "clip_image_threshold": -1.0, "clip_text_threshold": -1.0}
    stages = {}
    for keep in (False, True):
        stage = CounterfactualEditStage(
            keep_candidates=keep, clip_model=clip, clip_pretrained=None, require_edited_closer=False, **gates, **common
        )
        stage.load("cpu")
        stages[keep] = stage
    seconds: dict[bool, list[float]] = {False: [], True: []}
    counts, kept = {}, {}
    for repeat in range(repeats):
        for keep in (False, True) if repeat % 2 == 0 else (True, False):  # alternate which runs first
            stage = stages[keep]
            with count_unet_evaluations(stage.editor.components.unet) as count:
                start = time.perf_counter()
                (out,) = stage.process([dict(record)])
                seconds[keep].append(time.perf_counter() - start)
            counts[keep] = (count.forwards, count.backwards)
            kept[keep] = (len(out["counterfactuals"]), len(out.get("strength_samples") or []))
    off, on = statistics.median(seconds[False]), statistics.median(seconds[True])
    return {
        "unet_forwards_backwards": {"off": counts[False], "on": counts[True]},
        "samples_counterfactual_strength": {"off": kept[False], "on": kept[True]},
        "process_seconds_median": {"off": round(off, 4), "on": round(on, 4)},
        "process_seconds_all": {
            "off": [round(s, 4) for s in seconds[False]],
            "on": [round(s, 4) for s in seconds[True]],
        },
        "ratio_on_off": round(on / off, 4),
    }


def encode_cost(size: int) -> dict:
    from PIL import Image

    from builder.images import encode_image

    photos = sorted(p for p in (ROOT / "builder" / "demo_images").rglob("*") if p.suffix.lower() in (".jpg", ".png"))
    sizes, seconds, ledger_sizes, ledger_seconds = [], [], [], []
    for path in photos:
        with Image.open(path) as img:
            img = img.convert("RGB").resize((size, size))
        start = time.perf_counter()
        data = encode_image(img, "png")  # the release sample (shard)
        seconds.append(time.perf_counter() - start)
        sizes.append(len(data))
        buffer = io.BytesIO()
        start = time.perf_counter()
        img.save(buffer, format="PNG", compress_level=1)  # the stage output in the ledger (builder.ledger's codec)
        ledger_seconds.append(time.perf_counter() - start)
        ledger_sizes.append(buffer.tell())
    return {
        "photos": len(photos),
        "size": size,
        "release_png_bytes_mean": round(statistics.mean(sizes)),
        "release_png_bytes_min_max": [min(sizes), max(sizes)],
        "release_encode_seconds_mean": round(statistics.mean(seconds), 4),
        "ledger_png_bytes_mean": round(statistics.mean(ledger_sizes)),
        "ledger_encode_seconds_mean": round(statistics.mean(ledger_seconds), 4),
    }


def demo_bytes(out: Path) -> dict:
    def size(path: Path) -> int:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0

    result = {}
    for name, extra in (("with", []), ("without", ["--configs", "original,reconstructed,counterfactual,lance_r"])):
        target = out / name
        command = [sys.executable, "-m", "builder.cli", "build", "demo", "--output", str(target), "--device", "cpu"]
        start = time.perf_counter()
        subprocess.run([*command, "--no-progress", *extra], check=True, capture_output=True, cwd=ROOT)
        seconds = time.perf_counter() - start
        ledger = size(target / ".lance-cf")
        manifest = json.loads((target / "manifest.json").read_text())
        result[name] = {
            "build_seconds": round(seconds, 1),
            "release_bytes": size(target) - ledger,
            "ledger_bytes": ledger,
            "data_bytes_by_config": {c: size(target / "data" / c) for c in manifest["configs"]},
            "samples_by_config": {c: v["total"] for c, v in manifest["counts"].items()},
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", type=int, default=512, help="image side for the encoding figures")
    parser.add_argument("--demo", type=Path, help="also build the demo with and without the strength config here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        report = {"edit_stage": edit_stage_cost(args.repeats, Path(work)), "encode": encode_cost(args.size)}
    if args.demo:
        report["demo"] = demo_bytes(args.demo)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
