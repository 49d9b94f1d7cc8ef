"""Throughput of ``lance-cf eval`` against a bare forward pass and against timm's validate.py loop, in one run.

Three measurements on the same images (a synthetic release written with ``tests/release_fixture.py``) and the same
model, batch size, workers and device, each after one warm-up forward of the model:

1. harness: :func:`evaluation.harness.predict_release`, i.e. streaming the WebDataset shards of every config through
   the DataLoader (decode + the model's timm eval transform in workers), forward, softmax, p(y_GT) and top-5 bookkeeping.
2. forward: the model alone on the same images pre-decoded and pre-transformed into memory, same batch size.
3. timm validate: timm's validate.py is not shipped in the timm wheel (nor its sdist), so its evaluation loop is
   reproduced here faithfully: ``timm.data.create_dataset`` on an ImageFolder of the same images (PNG files),
   ``timm.data.create_loader`` with the prefetcher and the model's resolved data config, and validate.py's loop
   (inference_mode, ``amp_autocast()`` around model(input), CrossEntropyLoss, ``timm.utils.accuracy`` top-1/5,
   AverageMeters), with validate.py's CUDA settings (``torch.backends.cuda.matmul.allow_tf32 = True``,
   ``torch.backends.cudnn.benchmark = True``).

The headline is like for like: validate.py run with the harness's memory layout (channels_last unless
``--no-channels-last``, as validate.py ``--channels-last``) and the same precision (``--amp``/``--amp-dtype`` on both
sides). validate.py's defaults (NCHW, and no AMP) are timed too, for information. The last line printed is
``ratio_like_for_like=X ratio_vs_forward=Y ratio_vs_validate_defaults=Z`` (harness images/s divided by the other's).
Not a test: run it by hand, ``python benchmarks/bench_eval.py --model resnet18 --originals 48``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def write_imagefolder(release_root: Path, target: Path) -> int:
    """The release's images as ``target/<label>/<key>.png`` (every config), for timm's folder dataset."""
    from builder import release_format as rf
    from evaluation.release_reader import open_release

    release = open_release(release_root)
    count = 0
    for config in release.configs:
        for shard in release.shards[config]:
            for _, sample in rf.iter_shard(shard):
                label = sample["cls"].decode().strip()
                key = sample["json"].split(b'"key":"', 1)[1].split(b'"', 1)[0].decode()
                (target / f"{int(label):04d}").mkdir(parents=True, exist_ok=True)
                (target / f"{int(label):04d}" / f"{key}.png").write_bytes(sample["png"])
                count += 1
    return count


def timm_validate_loop(
    model, folder: Path, batch_size: int, workers: int, device, channels_last: bool = False, amp_dtype=None
) -> tuple[int, float, float]:
    """validate.py's dataset, loader and loop (``--channels-last`` and ``--amp --amp-dtype`` optional, off as in
    validate.py's defaults); returns (images, seconds, top1)."""
    import contextlib
    import functools

    import torch
    from timm.data import create_dataset, create_loader, resolve_data_config
    from timm.utils import AverageMeter, accuracy

    if device.type == "cuda":  # validate.py sets these unconditionally
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    amp_autocast = (
        functools.partial(torch.autocast, device_type=device.type, dtype=amp_dtype)
        if amp_dtype is not None
        else contextlib.nullcontext
    )
    data_config = resolve_data_config({}, model=model, use_test_size=True)
    dataset = create_dataset(root=str(folder), name="", split="validation")
    criterion = torch.nn.CrossEntropyLoss().to(device)
    start = time.perf_counter()
    loader = create_loader(
        dataset,
        input_size=data_config["input_size"],
        batch_size=batch_size,
        use_prefetcher=True,
        interpolation=data_config["interpolation"],
        mean=data_config["mean"],
        std=data_config["std"],
        num_workers=workers,
        crop_pct=data_config["crop_pct"],
        crop_mode=data_config["crop_mode"],
        crop_border_pixels=None,
        pin_memory=device.type == "cuda",
        device=device,
        tf_preprocessing=False,
    )
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=memory_format)
    losses, top1, top5 = AverageMeter(), AverageMeter(), AverageMeter()
    images = 0
    with torch.inference_mode():
        for inputs, target in loader:
            if channels_last:
                inputs = inputs.contiguous(memory_format=torch.channels_last)
            with amp_autocast():
                output = model(inputs)
            loss = criterion(output, target)
            acc1, acc5 = accuracy(output.detach(), target, topk=(1, 5))
            losses.update(loss.item(), inputs.size(0))
            top1.update(acc1.item(), inputs.size(0))
            top5.update(acc5.item(), inputs.size(0))
            images += inputs.size(0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    # validate.py's validate() returns here and its loader (persistent workers) is torn down with it; the harness's
    # timing likewise includes its loader's start and shutdown, so both are timed to the same point.
    del loader
    return images, time.perf_counter() - start, top1.avg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--originals", type=int, default=48, help="original images (x6 images over all configs)")
    parser.add_argument("--image-size", type=int, default=512, help="side of the stored images (LANCE: 512)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--no-channels-last", action="store_true", help="harness, forward and the like-for-like validate.py in NCHW"
    )
    parser.add_argument("--amp", action="store_true", help="autocast on both sides (validate.py --amp)")
    parser.add_argument("--amp-dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the best of each measurement is kept")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args()

    import io

    import timm
    import torch
    from PIL import Image
    from release_fixture import write_release
    from timm.data import create_transform, resolve_data_config

    from builder import release_format as rf
    from evaluation.harness import EvalOptions, predict_release
    from evaluation.release_reader import open_release

    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        classes = (1, 207, 281, 340)
        per_class = max(1, args.originals // len(classes))
        root = write_release(
            tmp / "release",
            labels=classes,
            originals_per_class=per_class,
            edits_per_original=3,
            image_size=args.image_size,
            shard_size=64,
        )
        n_folder = write_imagefolder(root, tmp / "folder")
        torch.manual_seed(0)
        model = timm.create_model(args.model, pretrained=False).eval().to(device)
        data_config = resolve_data_config({}, model=model, use_test_size=True)
        with torch.inference_mode():
            model(torch.randn((args.batch_size, *data_config["input_size"]), device=device))
        release = open_release(root)
        options = EvalOptions(
            device=args.device,
            batch_size=args.batch_size,
            workers=args.workers,
            channels_last=not args.no_channels_last,
            amp=args.amp,
            amp_dtype=args.amp_dtype,
            insights=False,
            report=False,
            verify=True,  # the sha256 of every shard is checked as it streams, as in a real run
        )
        amp_dtype = getattr(torch, args.amp_dtype) if args.amp else None

        transform = create_transform(**data_config)
        tensors = []
        for config in release.configs:
            for shard in release.shards[config]:
                for _, sample in rf.iter_shard(shard):
                    tensors.append(transform(Image.open(io.BytesIO(sample["png"])).convert("RGB")))
        n = len(tensors)
        assert n == n_folder, (n, n_folder)
        batches = [torch.stack(tensors[i : i + args.batch_size]) for i in range(0, n, args.batch_size)]

        def run_forward() -> float:
            # the same model, memory layout and precision as the harness
            import contextlib

            start = time.perf_counter()
            fmt = torch.contiguous_format if args.no_channels_last else torch.channels_last
            net = model.to(memory_format=fmt)
            autocast = (
                torch.autocast(device_type=device.type, dtype=amp_dtype) if args.amp else contextlib.nullcontext()
            )
            with torch.inference_mode(), autocast:
                for batch in batches:
                    x = batch.to(device, non_blocking=True).contiguous(memory_format=fmt)
                    net(x).float().softmax(dim=1).cpu()
            if device.type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - start

        def run_harness() -> float:
            start = time.perf_counter()
            rows, _ = predict_release(model, release, data_config, options)
            assert len(rows) == n
            return time.perf_counter() - start

        def run_validate(channels_last: bool, amp) -> float:
            images, seconds, _ = timm_validate_loop(
                model, tmp / "folder", args.batch_size, args.workers, device, channels_last=channels_last, amp_dtype=amp
            )
            assert images == n
            return seconds

        # Rounds interleave the measurements so that load from other processes hits them alike; best of N.
        best = dict.fromkeys(("harness", "forward", "validate_like", "validate_defaults"), float("inf"))
        for _ in range(args.repeats):
            best["harness"] = min(best["harness"], run_harness())
            best["forward"] = min(best["forward"], run_forward())
            best["validate_like"] = min(best["validate_like"], run_validate(not args.no_channels_last, amp_dtype))
            best["validate_defaults"] = min(best["validate_defaults"], run_validate(False, None))

    ips = {k: n / v for k, v in best.items()}
    layout = "NCHW" if args.no_channels_last else "channels_last"
    precision = f"amp {args.amp_dtype}" if args.amp else "float32"
    print(
        f"model={args.model} device={args.device} images={n} image_size={args.image_size} "
        f"input_size={tuple(data_config['input_size'])} batch_size={args.batch_size} workers={args.workers} "
        f"torch_threads={torch.get_num_threads()} layout={layout} precision={precision}"
    )
    print(f"harness: {ips['harness']:.2f} images/s ({best['harness']:.2f}s)")
    print(f"forward on pre-decoded tensors: {ips['forward']:.2f} images/s ({best['forward']:.2f}s)")
    print(
        f"timm validate.py loop, {layout}, {precision}: {ips['validate_like']:.2f} images/s ({best['validate_like']:.2f}s)"
    )
    print(
        f"timm validate.py loop, defaults (NCHW, float32): {ips['validate_defaults']:.2f} images/s "
        f"({best['validate_defaults']:.2f}s)"
    )
    from bench_json import write_json

    write_json(
        args.json,
        {
            "benchmark": "bench_eval",
            "model": args.model,
            "device": args.device,
            "images": n,
            "input_size": list(data_config["input_size"]),
            "batch_size": args.batch_size,
            "workers": args.workers,
            "layout": layout,
            "precision": precision,
            "images_per_second": ips,
            "seconds_best": best,
            "ratio_like_for_like": ips["harness"] / ips["validate_like"],
            "ratio_vs_forward": ips["harness"] / ips["forward"],
            "ratio_vs_validate_defaults": ips["harness"] / ips["validate_defaults"],
        },
    )
    print(
        f"ratio_like_for_like={ips['harness'] / ips['validate_like']:.3f} "
        f"ratio_vs_forward={ips['harness'] / ips['forward']:.3f} "
        f"ratio_vs_validate_defaults={ips['harness'] / ips['validate_defaults']:.3f}"
    )


if __name__ == "__main__":
    main()
