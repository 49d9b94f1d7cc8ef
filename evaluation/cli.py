"""``lance-cf eval`` and ``lance-cf leaderboard``: score timm models against a release and compare them.

Top-level imports stay light (argparse and stdlib only) so that ``lance-cf --help`` is fast.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from builder.release_format.lock import declare_output, output_lock
from evaluation.fidelity import (
    add_side_by_side_arguments,
    check_masks,
    load_side_by_side_clip,
    release_labels,
    shared_sources,
    side_by_side,
    table_markdown,
)
from evaluation.leaderboard import summary_lines, write_leaderboard
from evaluation.metric_registry import METRICS, parse_metric_names
from evaluation.models import EVAL_OFFLINE_WAYS, LOCAL_DIR, ModelSpec, expand_model_names, load_class_map
from evaluation.plots import plot_strength_models
from evaluation.release_reader import open_release
from evaluation.results import AMP_DTYPES, MODEL_DTYPES
from evaluation.zero_shot import DEFAULT_TEMPLATES, is_zero_shot, load_template_set, parse_reference
from lance_pipeline.models.devices import resolve_device as shared_rule
from lance_pipeline.models.needs import clip_need, timm_need

logger = logging.getLogger(__name__)

INSIGHTS_ROLE = "CLIP of the insights"  # how eval declares the insights' CLIP model (optional: skipped when missing)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``eval`` and ``leaderboard`` subcommands."""
    p = subparsers.add_parser(
        "eval",
        help="score timm models against a release",
        description=(
            "Evaluate one or more timm models on every config of a release (local directory or Hub dataset "
            "ORG/NAME[@REVISION]): acc@1/5, Delta acc, Delta p(y_GT), flip rate, breakdowns by edit type and "
            "class, bootstrap intervals, class-level insights; writes OUTPUT/<release>/<model>/results.json, "
            "predictions.parquet and report.html. With several --release (the same source images edited by "
            "different editors), each release is evaluated the same way and OUTPUT/side_by_side/ "
            "gets one table and one plot: per edit type and editor, the accuracy drop and the image fidelity."
        ),
    )
    p.add_argument(
        "--release",
        action="append",
        required=True,
        help="release directory, or Hub dataset ORG/NAME[@REVISION]; repeat for releases of the same source images "
        "by different editors (side by side)",
    )
    p.add_argument(
        "--model",
        action="append",
        required=True,
        help="timm model name (resnet50.a1_in1k, hf-hub:ORG/NAME), local-dir:DIR (config.json + model.safetensors: "
        "no Hub needed), wildcard (convnext_*) or file of names; or a zero-shot CLIP classifier: "
        "open_clip:ARCH/PRETRAINED, open_clip:hf-hub:ORG/NAME or open_clip:DIR; repeat",
    )
    p.add_argument(
        "--templates",
        action="append",
        metavar="SET",
        help="prompt templates of the zero-shot (open_clip:) models: openai (OpenAI's 80 ImageNet prompts, the "
        "default), simple ('a photo of a {}.') or a file with one template a line; repeat to score each model with "
        "each set (the template sensitivity)",
    )
    p.add_argument("--output", required=True, type=Path, help="output directory")
    p.add_argument(
        "--device", default=None, help="torch device: cpu, cuda, cuda:1 (default: cuda when available, else cpu)"
    )
    p.add_argument(
        "--devices",
        type=_device_list,
        metavar="LIST",
        help="evaluate different models in parallel, one worker process per device: cuda:0,cuda:1 (or cpu,cpu)",
    )
    p.add_argument("--batch-size", type=int, default=64, help="images per batch (halved on out-of-memory)")
    p.add_argument(
        "--auto-batch-size",
        action="store_true",
        help="grow the batch size from --batch-size while memory allows (doubling, up to --max-batch-size)",
    )
    p.add_argument("--max-batch-size", type=int, default=1024, help="largest batch --auto-batch-size tries")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes (default 2)")
    p.add_argument(
        "--no-channels-last", action="store_true", help="keep NCHW memory layout (channels_last is the default)"
    )
    p.add_argument("--amp", action="store_true", help="mixed precision (torch.autocast), as timm validate.py --amp")
    p.add_argument(
        "--amp-dtype", choices=AMP_DTYPES, default="bfloat16", help="autocast dtype with --amp (default bfloat16)"
    )
    p.add_argument(
        "--model-dtype",
        choices=MODEL_DTYPES,
        default="float32",
        help="dtype of the weights and inputs (default float32)",
    )
    p.add_argument(
        "--torchcompile",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="torch.compile the model (backend default inductor), as timm validate.py --torchcompile",
    )
    p.add_argument("--no-tf32", action="store_true", help="on CUDA, keep float32 matmuls exact (TF32 is the default)")
    p.add_argument(
        "--limit",
        type=int,
        default=None,
        metavar="N",
        help="score only the first N samples of each config (quick runs; never ranked or published as complete)",
    )
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="score shards whose sha256 does not match the manifest (recorded in the results)",
    )
    p.add_argument("--checkpoint", type=Path, help="local weights (.safetensors) for the model(s)")
    p.add_argument("--no-pretrained", action="store_true", help="random weights (offline use, tests)")
    p.add_argument(
        "--class-map",
        type=Path,
        help="model output index for each release label: a text file (one integer a line) or JSON {label: index}",
    )
    p.add_argument(
        "--metrics",
        metavar="LIST",
        help=f"comma-separated registered metrics to compute, of {', '.join(METRICS.in_order())}; 'default' stands "
        "for every default metric (default,NAME adds one); accuracy is always computed; default: every default metric "
        "(docs/evaluation.md describes them)",
    )
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples for 95%% intervals (0: none)")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the bootstrap, K-Means and --no-pretrained weights (default 0)"
    )
    p.add_argument(
        "--min-per-class",
        type=int,
        default=5,
        help="interfaces releases: a class counts in a shift's accuracy when it has at least this many images there "
        "(default 5, the paper's rule)",
    )
    p.add_argument("--clusters", type=int, default=5, help="K-Means clusters per class for the insights (default 5)")
    p.add_argument("--top-clusters", type=int, default=3, help="clusters reported per class (default 3)")
    p.add_argument(
        "--clip-model",
        default="ViT-L-14",
        help="open_clip model for the insights: a name, hf-hub:ORG/NAME or a local directory (default ViT-L-14)",
    )
    p.add_argument("--clip-pretrained", default="openai", help="open_clip pretrained tag for a named model")
    p.add_argument("--no-insights", action="store_true", help="skip the CLIP clustering of edits")
    p.add_argument("--no-report", action="store_true", help="skip the HTML report")
    p.add_argument("--gallery-size", type=int, default=12, help="counterfactuals shown in the report gallery")
    p.add_argument(
        "--force",
        action="store_true",
        help="re-run models whose results already exist, and replace the results of another release that hold "
        "OUTPUT/<release>/ (a rebuild of the same name)",
    )

    add_side_by_side_arguments(p)
    p.set_defaults(func=run_eval, models=declared_models, check=check_eval_arguments, offline_ways=EVAL_OFFLINE_WAYS)
    declare_output(p, "eval", lambda args: args.output)

    lb = subparsers.add_parser(
        "leaderboard",
        help="one table and plots over evaluated models",
        description=(
            "Collect results JSONs of one release from RESULTS_DIR... (searched recursively) into leaderboard.csv, "
            "leaderboard.parquet, leaderboard.md and leaderboard.html ranked by paired Delta acc@1, with effective "
            "robustness (probit fit over the models), agreement with real shifts (Spearman against timm's published "
            "ImageNet-V2/-R/-Sketch/-A drops) and comparison plots."
        ),
    )
    lb.add_argument("results", nargs="+", type=Path, metavar="RESULTS_DIR", help="directories or results JSON files")
    lb.add_argument("--output", required=True, type=Path, help="output directory")
    lb.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples of the shift correlations")
    lb.add_argument("--seed", type=int, default=0, help="seed of the bootstrap (default 0)")
    lb.add_argument(
        "--split-releases",
        action="store_true",
        help="results of several releases: one leaderboard per release in OUTPUT/<name>-v<version>-<hash>/ "
        "(without it, mixed releases are refused)",
    )
    lb.set_defaults(func=run_leaderboard)
    declare_output(lb, "leaderboard", lambda args: args.output)


def _device_list(value: str) -> list[str]:
    devices = [v.strip() for v in value.split(",") if v.strip()]
    if not devices:
        raise argparse.ArgumentTypeError("expected a comma-separated list of devices, e.g. cuda:0,cuda:1")
    return devices


def resolve_device(device: str | None) -> str:
    """The device rule every command shares (``lance_pipeline.models.devices``): auto picks cuda when available."""
    return shared_rule(device)


def _check_positive(name: str, value: int, minimum: int = 1) -> None:
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")


def declared_models(args: argparse.Namespace) -> list:
    """The models ``eval`` will load (checked before it starts: ``lance-cf models list eval ...``): each classifier's
    pretrained weights, the insights' CLIP (optional: without it the insights are skipped) and, for several
    releases, the side by side's CLIP."""
    needs = []
    if not args.no_pretrained and args.checkpoint is None:
        for name in expand_model_names(args.model):
            if is_zero_shot(name):
                model, tag = parse_reference(name)
                needs.append(clip_need(model, tag, used_by="eval", key="--model", role=f"zero-shot classifier {name}"))
            else:
                needs.append(timm_need(name, used_by="eval", key="--model"))
    if not args.no_insights:
        needs.append(clip_need(args.clip_model, args.clip_pretrained, used_by="eval insights", key="--clip-model",
                               optional=True, role=INSIGHTS_ROLE))  # fmt: skip
    if len(args.release) > 1 and not args.no_clip_similarity:
        needs.append(clip_need(args.clip_model, args.clip_pretrained, used_by="eval side by side", key="--clip-model",
                               role="CLIP of the side by side"))  # fmt: skip
    return [n for n in needs if n is not None]


def check_eval_arguments(args: argparse.Namespace) -> None:
    """What ``eval`` can check without a model, before the model check (builder.cli) and again by ``run_eval``: a bad
    option, or releases that share no source image, is one line before anything is fetched, loaded or written."""
    _check_positive("--batch-size", args.batch_size)
    _check_positive("--max-batch-size", args.max_batch_size, args.batch_size)
    _check_positive("--workers", args.workers, 0)
    _check_positive("--bootstrap", args.bootstrap, 0)
    _check_positive("--min-per-class", args.min_per_class, 1)
    _check_positive("--clusters", args.clusters)
    if args.limit is not None:
        _check_positive("--limit", args.limit)
    if args.metrics is not None:
        parse_metric_names(args.metrics)
    for templates in args.templates or []:
        load_template_set(templates)
    if args.checkpoint is not None and args.no_pretrained:
        raise ValueError("--checkpoint and --no-pretrained exclude each other (a checkpoint already sets the weights)")
    if args.class_map is not None and not args.class_map.is_file():
        raise ValueError(f"--class-map {str(args.class_map)!r} does not exist")
    if args.output.exists() and not args.output.is_dir():
        raise ValueError(f"--output {str(args.output)!r} is a file; give a directory")
    release_specs = args.release if isinstance(args.release, list) else [args.release]
    local = [Path(spec).expanduser() for spec in release_specs if Path(spec).expanduser().is_dir()]
    if args.class_map is not None and local:  # an unfinished class map (CHOOSE lines) before any model is looked up
        for folder in local:
            classes = open_release(folder).num_classes
            if classes is not None:
                load_class_map(args.class_map, classes)
    for name in args.model:  # a local model folder's files, before the model check looks for the rest
        if name.startswith(LOCAL_DIR):
            ModelSpec(name=name, pretrained=not args.no_pretrained and args.checkpoint is None,
                      checkpoint=args.checkpoint)  # fmt: skip
    check_masks(args.masks)
    if len(release_specs) == 1 and (args.masks is not None or args.no_clip_similarity):
        raise ValueError(
            "--masks and --no-clip-similarity apply to the side by side of several --release (the same source "
            "images, different editors); with one release leave them out"
        )
    if len(release_specs) > 1:  # metadata only: no image is decoded, no model loaded
        releases = [open_release(spec) for spec in release_specs]
        shared_sources(releases, release_labels(releases))


def run_eval(args: argparse.Namespace) -> int:
    """Run ``lance-cf eval``; exit code 0 when every model succeeded (or was skipped), 1 when any failed."""
    check_eval_arguments(args)
    metrics = parse_metric_names(args.metrics) if args.metrics is not None else None

    # lazy: imports torch
    from evaluation.harness import EvalOptions, run_evaluation, warn_insights_skipped

    release_specs = args.release if isinstance(args.release, list) else [args.release]

    devices = [resolve_device(d) for d in args.devices] if args.devices else None
    device = devices[0] if devices else resolve_device(args.device)
    for name in devices or [device]:
        _check_device(name)
    pretrained = not args.no_pretrained and args.checkpoint is None
    names = expand_model_names(args.model, pretrained=pretrained)
    if args.checkpoint is not None and len(names) != 1:
        raise ValueError(f"--checkpoint applies to exactly one model; {len(names)} were given: {', '.join(names)}")
    zero_shot = any(is_zero_shot(n) for n in names)
    if args.templates and not zero_shot:
        raise ValueError("--templates applies to zero-shot models (--model open_clip:...); none was given")
    # Only zero-shot models use templates (the default set, openai's, imports open_clip: seconds)
    template_sets = (
        [load_template_set(t) for t in dict.fromkeys(args.templates or [DEFAULT_TEMPLATES])] if zero_shot else []
    )
    specs = [
        ModelSpec(
            name=n,
            pretrained=pretrained,
            checkpoint=args.checkpoint,
            class_map=args.class_map,
            seed=args.seed,
            templates=templates,
        )
        for n in names
        for templates in (template_sets if is_zero_shot(n) else [None])
    ]
    releases = [open_release(spec) for spec in release_specs]
    side_by_side = _prepare_side_by_side(releases, args, device) if len(releases) > 1 else None
    # the model check before the command (builder.cli) found the insights' CLIP missing: skip them, saying so once
    insights_clip = next((s for s in getattr(args, "skipped_models", []) if s.need.role == INSIGHTS_ROLE), None)
    options = EvalOptions(
        device=device,
        devices=devices,
        batch_size=args.batch_size,
        auto_batch_size=args.auto_batch_size,
        max_batch_size=args.max_batch_size,
        workers=args.workers,
        channels_last=not args.no_channels_last,
        amp=args.amp,
        amp_dtype=args.amp_dtype,
        model_dtype=args.model_dtype,
        torchcompile=args.torchcompile,
        tf32=not args.no_tf32,
        limit=args.limit,
        verify=not args.no_verify,
        bootstrap=args.bootstrap,
        seed=args.seed,
        min_per_class=args.min_per_class,
        insights=not args.no_insights and insights_clip is None,
        insight_k=args.clusters,
        insight_top=args.top_clusters,
        clip_model=args.clip_model,
        clip_pretrained=args.clip_pretrained,
        report=not args.no_report,
        gallery_size=args.gallery_size,
        force=args.force,
        metrics=metrics,
    )
    if insights_clip is not None and not args.no_insights:  # found missing by the model check: not tried again
        warn_insights_skipped(options, f"is not available ({insights_clip.need.label}: {insights_clip.problem})")
    where = ", ".join(devices) if devices else device
    # Each release's results go to OUTPUT/<release>/ (never over another release's); one eval at a time per --output.
    labels = side_by_side["labels"] if side_by_side else release_labels(releases)
    args.output.mkdir(parents=True, exist_ok=True)
    all_summaries: dict[str, list[dict]] = {}
    with output_lock(args.output, "eval"):
        for release, label in zip(releases, labels, strict=True):
            sys.stdout.write(
                f"evaluating {len(specs)} model(s) on {release.name} {release.version} ({', '.join(release.configs)}) "
                f"on {where}{f', first {args.limit} samples per config' if args.limit else ''} into "
                f"{args.output / label}:\n"
            )
            for spec in specs:
                tpl = f" [templates {spec.templates.name}]" if spec.templates is not None else ""
                weights = "" if spec.weights_id == "pretrained" else f" [{spec.weights_id[:40]}]"
                sys.stdout.write(f"  {spec.result_name}{weights}{tpl}\n")
            sys.stdout.flush()
            all_summaries[label] = run_evaluation(
                release, specs, args.output / label, options, on_result=_print_summary
            )
        summaries = [s for group in all_summaries.values() for s in group]
        failed = [s for s in summaries if s["status"] == "error"]
        done = sum(s["status"] == "ok" for s in summaries)
        skipped = sum(s["status"] == "skipped" for s in summaries)
        sys.stdout.write(
            f"done: {done} evaluated, {skipped} skipped (results exist; --force re-runs), {len(failed)} failed; "
            f"results in {args.output}\n"
        )
        for label, group in all_summaries.items():
            _write_strength_plot(group, args.output / label)
            _write_timm_csvs(group, args.output / label)
        if not failed and done + skipped:  # a next step only after a success, and only one that has results to read
            target = args.output if side_by_side else args.output / labels[0]
            sys.stdout.write(
                f"next: lance-cf leaderboard {target} --output LEADERBOARD_DIR"
                f"{' --split-releases' if side_by_side else ''}\n"
            )
        if side_by_side:
            _write_side_by_side(releases, all_summaries, args, side_by_side)
    return 1 if failed else 0


def _write_strength_plot(summaries: list[dict], output: Path) -> None:
    """One plot of every model of the run against edit strength, when the release has a strength config."""
    results = [s["results"] for s in summaries if s["status"] in ("ok", "skipped") and (s.get("results") or {})]
    if not any(r.get("strength") for r in results):
        return
    path = plot_strength_models(results, output / "strength.png")
    sys.stdout.write(f"accuracy against edit strength, every model: {path} (each model's: <model>/strength.png)\n")
    sys.stdout.flush()


def _write_timm_csvs(summaries: list[dict], output: Path) -> None:
    """``results-<release>-<config>.csv`` in timm's results format (``evaluation.timm_format``), this run's models."""
    from evaluation.timm_format import write_timm_csvs

    results = [s["results"] for s in summaries if s["status"] in ("ok", "skipped") and (s.get("results") or {})]
    written = write_timm_csvs(results, output)
    if written:
        sys.stdout.write(f"timm-format results (one CSV per config): {output / 'results-*.csv'}\n")
        sys.stdout.flush()


def _prepare_side_by_side(releases: list, args: argparse.Namespace, device: str) -> dict:
    """Before any model runs: release labels (output folders), the shared-source check and the CLIP scorer, so that a
    problem is one line with nothing written."""
    labels = release_labels(releases)
    common = shared_sources(releases, labels)
    clip = None
    if not args.no_clip_similarity:
        clip = load_side_by_side_clip(args.clip_model, args.clip_pretrained, device)
    return {"labels": labels, "shared": common, "clip": clip}


def _write_side_by_side(releases: list, summaries: dict, args: argparse.Namespace, prepared: dict) -> None:
    """The side-by-side table and plot (``evaluation.fidelity.side_by_side``) from this run's results."""
    results = {
        label: [s["results"] for s in group if s["status"] in ("ok", "skipped") and s.get("results")]
        for label, group in summaries.items()
    }
    output = args.output / "side_by_side"
    table = side_by_side(
        releases,
        output,
        results_by_release=results,
        labels=prepared["labels"],
        clip=prepared["clip"],
        masks_dir=args.masks,
    )
    sys.stdout.write(
        f"side by side ({len(prepared['shared'])} source images in every release; paired Δ acc@1 in points, "
        "negative = the edits cost accuracy):\n"
    )
    sys.stdout.write(table_markdown(table))
    sys.stdout.write(f"side by side written to {output}: fidelity.md, fidelity.png, fidelity.html, fidelity.json\n")
    sys.stdout.flush()


def _check_device(name: str) -> None:
    """Refuse a device this machine does not have before anything is written."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ValueError(f"--device {name!r} is not a torch device ({error}); use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name!r}: CUDA is not available on this machine; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def _print_summary(summary: dict) -> None:
    """One line per model and config as it finishes, as timm's validate.py prints its ``* Acc@1 ...`` line."""
    if summary["status"] == "error":
        sys.stdout.write(f"{summary['model']}: FAILED: {summary.get('error')}\n")
    else:
        suffix = " (skipped: results exist)" if summary["status"] == "skipped" else ""
        for line in summary_lines(summary["results"]):
            sys.stdout.write(line + suffix + "\n")
    sys.stdout.flush()


def run_leaderboard(args: argparse.Namespace) -> int:
    _check_positive("--bootstrap", args.bootstrap, 0)
    written = write_leaderboard(
        args.results, args.output, n_boot=args.bootstrap, seed=args.seed, split_releases=args.split_releases
    )
    if "index" in written:
        sys.stdout.write(f"one leaderboard per release written under {args.output} (index: {written['index']})\n")
    else:
        sys.stdout.write(f"leaderboard written to {args.output}: {written['markdown'].name}, {written['html'].name}\n")
    logger.debug("wrote %s", ", ".join(str(p) for p in written.values()))
    return 0
