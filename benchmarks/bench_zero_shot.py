"""Zero-shot scoring of ``lance-cf eval`` against CLIP_benchmark's own zero-shot loop, like for like, in one run.

Same model (the tiny random-weight open_clip export of ``lance_pipeline.tiny``, or ``--clip-dir``), same images (a
synthetic release written with ``tests/release_fixture.py``, every config), same templates (``--templates``, default
OpenAI's 80), same batch size, DataLoader workers and device, float32 on both sides, each timed from a cold text
classifier (nothing cached) to the last image scored:

1. ours: ``evaluation.zero_shot.create_zero_shot_model`` (text classifier) then ``evaluation.harness.predict_release``
   (shards streamed, decoded and transformed in workers, forward, softmax, p(y_GT) and top-5 bookkeeping).
2. CLIP_benchmark: the release exported by ``lance-cf export clip-benchmark``, each config read by
   ``clip_benchmark.datasets.builder.build_wds_dataset`` with the model's open_clip preprocess, and
   the two steps of ``clip_benchmark.metrics.zeroshot_classification.evaluate``: ``zero_shot_classifier`` and
   ``run_classification`` (then top-1), ``amp=False``, once per config (CLIP_benchmark scores one split per run, so
   its classifier is rebuilt per config); ``--one-classifier`` builds it once. ``evaluate`` itself is not called: its
   ``accuracy`` does ``float()`` of a one-element array, which the installed NumPy refuses (TypeError).

Each side runs ``--repeats`` times (default 5), interleaved with the order alternating, so that the load of a shared
machine falls on both alike; the medians are compared and every pair's ratio is printed. The last line is
``ratio=X`` (our images/s divided by CLIP_benchmark's, from the medians). Not a test: run it by hand,
``python benchmarks/bench_zero_shot.py --originals 8``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--originals", type=int, default=8, help="originals per class")
    parser.add_argument("--edits", type=int, default=3, help="counterfactuals per original")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--templates", default="openai")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clip-dir", type=Path, help="an open_clip directory (default: --size's random-weight model)")
    parser.add_argument(
        "--size", choices=("tiny", "full"), default="tiny",
        help="without --clip-dir: the tiny open_clip export, or ViT-L/14 (QuickGELU, 224 px) with random weights",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the figures here (the GPU suite reads them)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved runs of each side (medians reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on both sides")
    parser.add_argument("--one-classifier", action="store_true", help="CLIP_benchmark: build the classifier once")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-zero-shot-") as work:
        return compare(args, Path(work))


def compare(args: argparse.Namespace, work: Path) -> int:
    """Both sides, ``args.repeats`` times each, on a release, a model and caches written under ``work``."""
    import torch

    torch.set_num_threads(args.threads)
    from clip_benchmark.datasets.builder import build_wds_dataset
    from clip_benchmark.metrics import zeroshot_classification as zsc
    from release_fixture import write_release
    from timm.data import resolve_data_config

    from evaluation.clip_benchmark_export import export_clip_benchmark
    from evaluation.harness import EvalOptions, predict_release
    from evaluation.release_reader import open_release
    from evaluation.zero_shot import create_zero_shot_model, load_template_set
    from lance_pipeline.clip.loader import load_clip
    from lance_pipeline.tiny.clip_components import create_tiny_open_clip

    names = [f"class {i}" for i in range(args.classes)]
    root = write_release(work / "rel", labels=tuple(range(args.classes)), label_names=names,
                         originals_per_class=args.originals, edits_per_original=args.edits,
                         image_size=args.image_size, shard_size=64)  # fmt: skip
    if args.clip_dir is not None:
        clip_dir = args.clip_dir
    elif args.size == "full":
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from random_models import write_open_clip

        clip_dir = write_open_clip(work / "clip", "full")
    else:
        clip_dir = create_tiny_open_clip(work / "tinyclip")
    templates = load_template_set(args.templates)
    release = open_release(root)
    options = EvalOptions(device=args.device, batch_size=args.batch_size, workers=args.workers, channels_last=False)
    # warm-up: load both once (file system, allocator), outside the timings
    loaded = load_clip(str(clip_dir), None, device=args.device)
    export = work / "cb"
    configs = export_clip_benchmark(str(root), export, args.templates)
    cb_templates = [t.replace("{}", "{c}") for t in templates.templates]
    clip_model = loaded.model

    def ours(run: int) -> tuple[int, float, float]:
        os.environ["LANCE_CF_CACHE"] = str(work / f"cache-{run}")  # a cold classifier: nothing cached
        start = time.perf_counter()
        model = create_zero_shot_model(f"open_clip:{clip_dir}", templates, names, "custom")
        text_seconds = time.perf_counter() - start
        rows, _ = predict_release(model, release, resolve_data_config({}, model=model, use_test_size=True), options)
        return len(rows), time.perf_counter() - start, text_seconds

    def clip_benchmark() -> tuple[int, float]:
        images = 0
        start = time.perf_counter()
        classifier = None
        for config in configs:
            dataset = build_wds_dataset("wds/bench", transform=loaded.preprocess, split=config, data_dir=str(export))
            loader = torch.utils.data.DataLoader(dataset.batched(args.batch_size), batch_size=None,
                                                 num_workers=args.workers)  # fmt: skip
            if classifier is None or not args.one_classifier:
                classifier = zsc.zero_shot_classifier(clip_model, loaded.tokenizer, names, cb_templates, args.device,
                                                      amp=False)  # fmt: skip
            logits, target = zsc.run_classification(clip_model, classifier, loader, args.device, amp=False)
            images += len(target)
            (logits.argmax(1) == target).float().mean()  # its top-1, as evaluate() computes it
        return images, time.perf_counter() - start

    # Interleaved, the order alternating, so that a shared machine's load falls on both sides alike; the medians
    # and every pair's ratio are reported.
    ours_runs, cb_runs = [], []
    for run in range(args.repeats):
        if run % 2 == 0:
            ours_runs.append(ours(run))
            cb_runs.append(clip_benchmark())
        else:
            cb_runs.append(clip_benchmark())
            ours_runs.append(ours(run))
    ours_images, cb_images = ours_runs[0][0], cb_runs[0][0]
    ours_seconds = statistics.median(r[1] for r in ours_runs)
    cb_seconds = statistics.median(r[1] for r in cb_runs)
    pair_ratios = [c[1] / o[1] for o, c in zip(ours_runs, cb_runs, strict=True)]
    ours_rate, cb_rate = ours_images / ours_seconds, cb_images / cb_seconds
    load = os.getloadavg()
    print(f"images: ours {ours_images}, clip_benchmark {cb_images}; templates {templates.name} ({len(cb_templates)}), "
          f"classes {len(names)}, batch {args.batch_size}, workers {args.workers}, device {args.device}, "
          f"classifier built {'once' if args.one_classifier else 'per config'} by clip_benchmark")  # fmt: skip
    print(f"ours: median {ours_seconds:.2f}s of {args.repeats} ({ours_rate:.1f} img/s; text classifier "
          f"{statistics.median(r[2] for r in ours_runs):.2f}s)")  # fmt: skip
    print(f"clip_benchmark: median {cb_seconds:.2f}s of {args.repeats} ({cb_rate:.1f} img/s)")
    print("ratio per interleaved pair: " + " ".join(f"{r:.2f}" for r in pair_ratios))
    print(f"load average (1/5/15 min): {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; cpus {os.cpu_count()}")
    print(f"ratio={ours_rate / cb_rate:.3f}")
    if args.json is not None:
        figures = {
            "model": "tiny open_clip" if args.clip_dir is None and args.size == "tiny" else clip_dir.name,
            "device": args.device, "batch_size": args.batch_size, "workers": args.workers, "repeats": args.repeats,
            "templates": len(cb_templates), "classes": len(names), "images": ours_images,
            "one_classifier": args.one_classifier,
            "ours_seconds_median": ours_seconds, "clip_benchmark_seconds_median": cb_seconds,
            "images_per_second": {"ours": ours_rate, "clip_benchmark": cb_rate},
            "ratio": ours_rate / cb_rate, "pair_ratios": pair_ratios,
        }  # fmt: skip
        args.json.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
