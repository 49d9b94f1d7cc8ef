"""``lance-cf review``: the review page, and what to do with its judgements.

- ``lance-cf review RELEASE [study options]``: serve the page (127.0.0.1, a random port and access token).
- ``lance-cf review apply RELEASE --output NEW``: the next version of the release with the review in it.
- ``lance-cf review export RELEASE --output FILE.csv|FILE.parquet``: every judgement, history included.
- ``lance-cf review agreement RELEASE``: verdict counts and agreement of a study, printed; with judge scores and a
  ``still_class`` question, the judge's agreement with people beside the people's with each other.
- ``lance-cf review calibrate RELEASE --output NEW``: the next version with the judge's threshold chosen on the human
  labels by cross-validation (every shard copied byte for byte).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from builder import release_format as rf
from builder.cli_types import port_number
from builder.release_format.lock import declare_output, file_folder, output_lock
from builder.review.apply import apply_review, choose_study
from builder.review.calibrate import RECORD, calibrate_release
from builder.review.calibration import (
    DEFAULT_FOLDS,
    DEFAULT_RESAMPLES,
    JUDGE_CLASS_FIELD,
    QUESTION,
    UNCALIBRATED_THRESHOLD,
    has_judge_scores,
    judge_agreement,
    labelled_items,
    seed_of,
)
from builder.review.index import ReleaseIndex
from builder.review.server import open_session, serve
from builder.review.store import JudgementStore, store_path
from builder.review.study import QUESTIONS, Study, aggregate, agreement, select

ACTIONS = ("apply", "export", "agreement", "calibrate")


def register(subparsers) -> None:
    review = subparsers.add_parser(
        "review",
        help="review a release in the browser; apply, export or measure the judgements",
        description="lance-cf review RELEASE serves a page (127.0.0.1, random port, an access token in the printed "
        "URL) that shows one sample at a time beside its original, to judge with the keyboard; judgements are stored "
        "in RELEASE/.lance-cf/review.sqlite. lance-cf review apply RELEASE --output NEW writes the next version with "
        "every sample's review; export writes the judgements as CSV or Parquet; agreement prints kappas (and the judge's "
        "agreement with people); calibrate writes the next version with the judge's threshold chosen on the human labels.",
    )
    review.add_argument("target", metavar="[apply|export|agreement|calibrate] RELEASE", help="the release directory")
    review.add_argument("release", nargs="?", type=Path, help=argparse.SUPPRESS)
    review.add_argument(
        "--output", "-o", type=Path, help="apply, calibrate: the new release directory; export: a .csv/.parquet"
    )
    review.add_argument("--version", dest="release_version", metavar="SEMVER", help="apply, calibrate: the new version")
    judge = review.add_argument_group('the judge (agreement, calibrate; docs/review.md, "The judge against people")')
    judge.add_argument(
        "--threshold",
        type=float,
        metavar="P",
        help=f"agreement: the judge's threshold (default: the release's calibrated one, else {UNCALIBRATED_THRESHOLD})",
    )
    judge.add_argument(
        "--resamples",
        type=int,
        default=DEFAULT_RESAMPLES,
        metavar="N",
        help="bootstrap resamples (default %(default)s)",
    )
    judge.add_argument(
        "--folds",
        type=int,
        default=DEFAULT_FOLDS,
        metavar="K",
        help="calibrate: cross-validation folds (default %(default)s)",
    )
    study = review.add_argument_group("study (the page; a study keeps its settings, continue it by --study-name)")
    study.add_argument("--study-name", metavar="NAME", help="the study to start, continue or apply (default: review)")
    study.add_argument("--study", type=Path, metavar="FILE.yaml", help="the study's settings as YAML (docs/review.md)")
    study.add_argument(
        "--questions",
        metavar="LIST",
        help="questions to ask, built in: still_class, shows_edit, realistic (comma-separated; default none)",
    )
    study.add_argument("--configs", metavar="LIST", help="configs to review (default: the release kind's edits)")
    study.add_argument("--per-group", type=int, metavar="N", help="review N samples per group (default: all)")
    study.add_argument(
        "--group-by", choices=("edit_type", "shift", "config", JUDGE_CLASS_FIELD), help="groups of --per-group"
    )
    study.add_argument(
        "--judge-bins",
        type=int,
        metavar="N",
        help=f"--group-by {JUDGE_CLASS_FIELD}: equal-width score bins (default 5)",
    )
    study.add_argument("--seed", type=int, help="seed of the selection and of each reviewer's order (default 0)")
    study.add_argument("--blind", action="store_true", help="hide filter scores, screens, configs and keys; shuffle")
    study.add_argument("--hide-originals", action="store_true", help="show the counterfactual alone")
    review.add_argument("--reviewer", metavar="NAME", help="the page's reviewer (else the page asks)")
    review.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine)")
    review.add_argument("--port", type=port_number, default=0, help="port (default: a free one)")
    review.set_defaults(func=run_review)
    declare_output(review, "review", _review_output)


def _study_from_args(args: argparse.Namespace):
    flags = {
        "questions": args.questions,
        "configs": args.configs,
        "per_group": args.per_group,
        "group_by": args.group_by,
        "judge_bins": args.judge_bins,
        "seed": args.seed,
    }
    given = {k: v for k, v in flags.items() if v is not None}
    if args.blind:
        given.update(blind=True, shuffle=True)
    if args.hide_originals:
        given["show_original"] = False
    if args.study is not None:
        if given:
            raise ValueError(f"give the study as --study {args.study} or as options, not both ({', '.join(given)})")
        study = Study.from_file(args.study)
        return Study.from_dict({**study.to_dict(), "name": args.study_name}) if args.study_name else study
    if not given:
        return None  # continue a stored study, or the default review
    if "questions" in given:
        names = [q.strip() for q in given["questions"].split(",") if q.strip()]
        unknown = [q for q in names if q not in QUESTIONS]
        if unknown:
            raise ValueError(f"unknown question(s) {unknown}; built in: {', '.join(QUESTIONS)} (others: --study FILE)")
        given["questions"] = names
    if "configs" in given:
        given["configs"] = [c.strip() for c in given["configs"].split(",") if c.strip()]
    return Study.from_dict({"name": args.study_name or "review", **given}, where="the study options")


def run_review(args: argparse.Namespace) -> int:
    action, release = (args.target, args.release) if args.target in ACTIONS else (None, Path(args.target))
    if args.release is not None and action is None:
        raise ValueError(
            f"unknown action {args.target!r}: lance-cf review RELEASE, or review {'|'.join(ACTIONS)} RELEASE"
        )
    if release is None:
        raise ValueError(f"lance-cf review {action} needs the release directory")
    if not (release / "manifest.json").is_file():
        raise ValueError(f"{release} is not a release directory (no manifest.json)")
    if action == "apply":
        return _apply(args, release)
    if action == "export":
        return _export(args, release)
    if action == "agreement":
        return _agreement(args, release)
    if action == "calibrate":
        return _calibrate(args, release)
    return _serve(args, release)


def _review_output(args: argparse.Namespace) -> Path | None:
    """What a review command writes (its lock is held by lance-cf): apply's new release, export's file's folder; the
    page and agreement write nothing but the release's judgements (the page holds the release shared)."""
    action = args.target if args.target in ACTIONS else None
    if args.output is None:
        return None
    if action in ("apply", "calibrate"):
        return args.output
    return file_folder(args.output) if action == "export" else None


def _serve(args: argparse.Namespace, release: Path) -> int:
    study = _study_from_args(args)
    with output_lock(release, "review", shared=True):  # never beside a build of the same directory
        session, _ = open_session(release, study, args.study_name, args.reviewer)
        try:
            serve(session, host=args.host, port=args.port)
        except KeyboardInterrupt:
            pass
    sys.stdout.write("lance-cf review: stopped; the judgements are in the release's .lance-cf/review.sqlite\n")
    return 0


def _apply(args: argparse.Namespace, release: Path) -> int:
    if args.output is None:
        raise ValueError("lance-cf review apply needs --output NEW (a new directory for the next version)")
    with output_lock(release, "review apply", shared=True):
        manifest = apply_review(release, args.output, study_name=args.study_name, version=args.release_version)
    review = manifest["review"]
    counts = ", ".join(f"{k}: {v}" for k, v in review["verdicts"].items())
    sys.stdout.write(
        f"wrote {args.output}: {manifest['name']} {manifest['version']} with the review of study "
        f"{review['study']['name']!r} ({counts}; {review['raters']} reviewer(s))\n"
        f"next:\n  lance-cf verify {args.output}\n  lance-cf publish {args.output} --repo-id ORG/NAME\n"
    )
    return 0


def _export(args: argparse.Namespace, release: Path) -> int:
    if args.output is None:
        raise ValueError("lance-cf review export needs --output FILE.csv or FILE.parquet")
    if not store_path(release).is_file():
        raise ValueError(f"{release} has no judgements yet (review it first: lance-cf review {release})")
    store = JudgementStore(release, rf.load_manifest(release).manifest_sha256)
    names = [args.study_name] if args.study_name else store.studies()
    studies = {name: choose_study(store, name) for name in names}  # every exported row is checked against its study
    rows = store.export(args.output, args.study_name, studies)
    sys.stdout.write(f"wrote {rows} judgement row(s) to {args.output}\n")
    return 0


def _agreement(args: argparse.Namespace, release: Path) -> int:
    if not store_path(release).is_file():
        raise ValueError(f"{release} has no judgements yet (review it first: lance-cf review {release})")
    index = ReleaseIndex(release)
    store = JudgementStore(release, index.manifest_sha)
    study = choose_study(store, args.study_name)
    items = select(study, index)
    latest = store.latest(study)
    verdicts: dict[str, int] = {}
    for review in aggregate(latest, items).values():
        verdicts[review.verdict] = verdicts.get(review.verdict, 0) + 1
    out = {
        "study": study.name,
        "items": len(items),
        "verdicts": verdicts,
        "agreement": agreement(latest, [q.id for q in study.questions], items),
    }
    if has_judge_scores(index.manifest.release_spec, list(study.configs) or None) and QUESTION in [
        q.id for q in study.questions
    ]:
        calibration = (index.manifest.extra.get(RECORD) or {}).get("threshold")
        threshold = args.threshold if args.threshold is not None else calibration
        if threshold is None:
            threshold = UNCALIBRATED_THRESHOLD
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"--threshold {threshold}: the judge's threshold is a probability in [0, 1]")
        if args.resamples < 100:
            raise ValueError(f"--resamples {args.resamples}: a 95% bootstrap interval needs at least 100 resamples")
        out["judge"] = judge_agreement(
            labelled_items(index, latest, items),
            threshold,
            calibrated=args.threshold is None and calibration is not None,
            resamples=args.resamples,
            seed=seed_of(study.seed, study.name, "agreement"),
        )
    sys.stdout.write(json.dumps(out, indent=2, sort_keys=True) + "\n")
    return 0


def _calibrate(args: argparse.Namespace, release: Path) -> int:
    if args.output is None:
        raise ValueError("lance-cf review calibrate needs --output NEW (a new directory for the next version)")
    if not store_path(release).is_file():
        raise ValueError(f"{release} has no judgements yet (review it first: lance-cf review {release})")
    with output_lock(release, "review calibrate", shared=True):
        manifest = calibrate_release(
            release,
            args.output,
            study_name=args.study_name,
            version=args.release_version,
            folds=args.folds,
            resamples=args.resamples,
        )
    record = manifest[RECORD]
    judge, kept = record["judge_human"], record["kept"]
    sys.stdout.write(
        f"wrote {args.output}: {manifest['name']} {manifest['version']} with the judge calibrated on study "
        f"{record['study']['name']!r}: threshold {record['threshold']}, {judge['folds']}-fold cross-validated kappa "
        f"{judge['cv_kappa']} on {judge['items']} item(s); the judge keeps {kept['kept']} of {kept['scored']} "
        f"scored sample(s)\nnext:\n  lance-cf verify {args.output}\n  lance-cf publish {args.output} --repo-id ORG/NAME\n"
    )
    return 0
