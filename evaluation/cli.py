"""``lance-cf eval`` and ``lance-cf leaderboard``: score timm models against a release and compare them.

Top-level imports stay light (argparse and stdlib only) so that ``lance-cf --help`` is fast.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``eval`` and ``leaderboard`` subcommands."""
    p = subparsers.add_parser(
        "eval",
        help="score timm models against a release",
        description=(
            "Evaluate one or more timm models on every config of a release (local directory or Hub dataset "
            "ORG/NAME[@REVISION]): acc@1/5, Delta acc, Delta p(y_GT), flip rate, breakdowns by edit type and "
            "class, bootstrap intervals, class-level insights; writes OUTPUT/<model>/results.json, "
            "predictions.parquet and report.html."
        ),
    )
    p.add_argument("--release", required=True, help="release directory, or Hub dataset ORG/NAME[@REVISION]")
    p.add_argument(
        "--model",
        action="append",
        required=True,
        help="timm model name (resnet50.a1_in1k, hf-hub:ORG/NAME), wildcard (convnext_*) or file of names; repeat",
    )
    p.add_argument("--output", required=True, type=Path, help="output directory")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1 (default cpu)")
    p.add_argument("--batch-size", type=int, default=64, help="images per batch (halved on out-of-memory)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes (default 2)")
    p.add_argument(
        "--no-channels-last", action="store_true", help="keep NCHW memory layout (channels_last is the default)"
    )
    p.add_argument("--checkpoint", type=Path, help="local weights (.safetensors) for the model(s)")
    p.add_argument("--no-pretrained", action="store_true", help="random weights (offline use, tests)")
    p.add_argument(
        "--class-map",
        type=Path,
        help="model output index for each release label: a text file (one integer a line) or JSON {label: index}",
    )
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples for 95%% intervals (0: none)")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the bootstrap, K-Means and --no-pretrained weights (default 0)"
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
    p.add_argument("--force", action="store_true", help="re-run models whose results already exist")
    p.set_defaults(func=run_eval)

    lb = subparsers.add_parser(
        "leaderboard",
        help="one table and plots over evaluated models",
        description=(
            "Collect results JSONs from RESULTS_DIR... (searched recursively) into leaderboard.csv, "
            "leaderboard.parquet and leaderboard.md sorted by counterfactual top-1, with comparison plots."
        ),
    )
    lb.add_argument("results", nargs="+", type=Path, metavar="RESULTS_DIR", help="directories or results JSON files")
    lb.add_argument("--output", required=True, type=Path, help="output directory")
    lb.set_defaults(func=run_leaderboard)


def _check_positive(name: str, value: int, minimum: int = 1) -> None:
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")


def run_eval(args: argparse.Namespace) -> int:
    """Run ``lance-cf eval``; exit code 0 when every model succeeded (or was skipped), 1 when any failed."""
    _check_positive("--batch-size", args.batch_size)
    _check_positive("--workers", args.workers, 0)
    _check_positive("--bootstrap", args.bootstrap, 0)
    _check_positive("--clusters", args.clusters)
    if args.checkpoint is not None and args.no_pretrained:
        raise ValueError("--checkpoint and --no-pretrained exclude each other (a checkpoint already sets the weights)")
    if args.class_map is not None and not args.class_map.is_file():
        raise ValueError(f"--class-map {str(args.class_map)!r} does not exist")

    from .harness import EvalOptions, run_evaluation
    from .models import ModelSpec, expand_model_names
    from .release_reader import open_release

    pretrained = not args.no_pretrained and args.checkpoint is None
    names = expand_model_names(args.model, pretrained=pretrained)
    if args.checkpoint is not None and len(names) != 1:
        raise ValueError(f"--checkpoint applies to exactly one model; {len(names)} were given: {', '.join(names)}")
    specs = [
        ModelSpec(name=n, pretrained=pretrained, checkpoint=args.checkpoint, class_map=args.class_map, seed=args.seed)
        for n in names
    ]
    release = open_release(args.release)
    options = EvalOptions(
        device=args.device,
        batch_size=args.batch_size,
        workers=args.workers,
        channels_last=not args.no_channels_last,
        bootstrap=args.bootstrap,
        seed=args.seed,
        insights=not args.no_insights,
        insight_k=args.clusters,
        insight_top=args.top_clusters,
        clip_model=args.clip_model,
        clip_pretrained=args.clip_pretrained,
        report=not args.no_report,
        gallery_size=args.gallery_size,
        force=args.force,
    )
    summaries = run_evaluation(release, specs, args.output, options)
    failed = [s for s in summaries if s["status"] == "error"]
    for s in failed:
        logger.error("%s failed: %s", s["model"], s.get("error"))
    return 1 if failed else 0


def run_leaderboard(args: argparse.Namespace) -> int:
    from .leaderboard import write_leaderboard

    written = write_leaderboard(args.results, args.output)
    logger.info("wrote %s", ", ".join(str(p) for p in written.values()))
    return 0
