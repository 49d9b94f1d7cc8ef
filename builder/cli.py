"""``lance-cf``: build, verify, publish and evaluate LANCE counterfactual releases.

Each subcommand lives in a module with ``register(subparsers)``; modules are imported when the parser is built, so
their top-level imports stay light (heavy libraries are imported inside ``run``).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import shlex
import sys
import textwrap
from importlib import resources
from pathlib import Path

from builder.cli_types import bound_numeric_options
from builder.config import apply_overrides, list_presets, load_config, preset_path
from builder.config_docs import commented_yaml
from builder.dispatch import parse_stage_settings
from builder.engine import StageNotWorking, build
from builder.model_check import ModelsMissing, models_ready, resolve_models
from builder.multi_device import parse_devices
from builder.registry import ENGINES
from builder.release_format import WORK_DIR
from builder.release_format.lock import declare_output, declared_output_lock, output_lock
from builder.release_format.verify import verify_release
from builder.sources import create_source
from builder.validation import allow_code_from_env, check_stages_against_source, describe_validation, validate_build
from lance_pipeline.models.devices import resolve_device as _resolve_device
from lance_pipeline.models.hub_cache import offline_by_user
from lance_pipeline.release_kinds import kind_of_manifest

ENGINE_NAMES = tuple(ENGINES.names())

# Modules that add subcommands, in the order `--help` lists them. A module that is not installed is skipped.
SUBCOMMAND_MODULES = (
    "builder.cli",  # build, validate, verify, presets
    "builder.cli_models",  # models list, models download
    "builder.cli_class_map",  # class-map
    "builder.perturber.cli",  # perturber
    "builder.interfaces.cli",  # interfaces learn-tokens
    "evaluation.cli",  # eval, leaderboard
    "evaluation.clip_benchmark_export",  # export clip-benchmark
    "evaluation.fidelity",  # compare-editors
    "builder.review.comparison",  # add-comparison (compare-editors' table onto a release's card)
    "builder.discovery.cli",  # discover
    "builder.cli_publish",  # publish
    "evaluation.cli_publish",  # publish-results
    "builder.review.cli",  # review (the review page), review apply / export / agreement
)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``lance-cf build: error: ...`` and exit status 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {message}\n")


def _comma_list(value: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list, e.g. original,counterfactual")
    return items


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return number


def register(subparsers) -> None:
    build = subparsers.add_parser(
        "build",
        help="build (or resume) a release from a source dataset",
        description=textwrap.fill(
            "Build a versioned counterfactual release into --output. Re-running the same command resumes an "
            "interrupted build without redoing finished samples; the result is byte-identical to an uninterrupted "
            "build. Every model it needs is checked first (lance-cf models list|download PRESET_OR_CONFIG).",
            100,
        )
        + "\n\npresets (lance-cf presets --show NAME prints one):"
        + _preset_lines(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    build.add_argument(
        "config", metavar="PRESET_OR_CONFIG", help=f"a preset ({', '.join(_preset_names())}) or a YAML file"
    )
    build.add_argument("--output", "-o", required=True, type=Path, help="release directory (created if missing)")
    build.add_argument(
        "--source",
        metavar="SPEC",
        help="imagefolder:PATH | imagenet:PATH | hf:NAME_OR_PATH[:SPLIT] | wds:PATTERN | demo (overrides the preset)",
    )
    build.add_argument(
        "--configs",
        type=_comma_list,
        metavar="LIST",
        help="comma-separated configs to build: original,reconstructed,counterfactual,lance_r (default: the preset's)",
    )
    build.add_argument(
        "--limit", type=_positive_int, metavar="N", help="use only the first N source images (key order)"
    )
    build.add_argument(
        "--classes", type=_comma_list, metavar="LIST", help="imagenet source: class subset (synsets, indices or names)"
    )
    build.add_argument("--name", help="release name (default: the preset's)")
    build.add_argument("--version", dest="release_version", metavar="SEMVER", help="release version, e.g. 1.1.0")
    build.add_argument(
        "--release-date",
        metavar="YYYY-MM-DD",
        help="the release's date (Croissant's datePublished; part of the config, so the bytes never depend on the day)",
    )
    build.add_argument("--description", help="paragraph at the top of the dataset card (default: the preset's)")
    build.add_argument("--license", help="licence note on the card, e.g. cc-by-4.0 (default: the source's)")
    build.add_argument("--seed", type=int, help="release seed; per-sample seeds derive from it and the sample key")
    build.add_argument("--shard-size", type=_positive_int, metavar="N", help="maximum samples per shard")
    build.add_argument("--batch-size", type=_positive_int, metavar="N", help="source images per stage batch")
    build.add_argument(
        "--device", default=None, help="torch device for the model stages: cpu, cuda, cuda:N, auto (default: auto)"
    )
    build.add_argument(
        "--engine",
        choices=ENGINE_NAMES,
        default="local",
        help="local (default); devices: one worker process per --devices entry; ray: stages of several batches at "
        "once on Ray actors (extra: [ray]). Same bytes on each (docs/scaling.md)",
    )
    build.add_argument(
        "--workers",
        type=_positive_int,
        default=1,
        metavar="N",
        help="Ray actors (one GPU each on cuda) of the pool of stages --stage-workers does not name (all, by default)",
    )
    build.add_argument(
        "--devices",
        metavar="LIST",
        help="one worker process per device on this machine, no Ray: e.g. cuda:0,cuda:1,cuda:2,cuda:3 (cpu,cpu: two "
        "CPU workers); implies --engine devices",
    )
    build.add_argument(
        "--ray-address", metavar="ADDRESS", help="Ray cluster to join (e.g. ray://head:10001 or auto); --engine ray"
    )
    build.add_argument(
        "--gpus-per-worker",
        type=float,
        metavar="G",
        help="GPUs each Ray actor reserves (default 1 on cuda; 0.5 puts two actors on a GPU); --engine ray",
    )
    build.add_argument(
        "--stage-workers",
        metavar="STAGE=N,...",
        help="per-stage worker pools (devices, ray): e.g. edit=6,caption=1 (invert+edit=6: one pool for both); the "
        "stages not named share one pool of --workers (devices: one per --devices entry); same bytes",
    )
    build.add_argument(
        "--stage-gpus",
        metavar="STAGE=G,...",
        help="GPUs each actor of a stage's pool reserves, e.g. caption=0.5,edit=1 (default --gpus-per-worker); "
        "--engine ray",
    )
    build.add_argument(
        "--torch-threads",
        type=_positive_int,
        default=1,
        metavar="N",
        help="torch intra-op threads per worker (default 1: fast on shared machines; bytes depend on it, so it is "
        "recorded and a resume must use the same)",
    )
    build.add_argument(
        "--schedule",
        choices=("batch-major", "stage-major"),
        default="batch-major",
        help="batch-major (default): each batch through every stage; stage-major: every sample through one stage, "
        "its models freed, then the next (fits smaller GPUs; same bytes; on devices/ray one stage's pool at a time)",
    )
    build.add_argument(
        "--retry-failures",
        action="store_true",
        help="also re-run the stages of samples with final failures (errors, i.e. exceptions, are always retried)",
    )
    build.add_argument(
        "--allow-empty",
        action="store_true",
        help="exit 0 even when a selected config ends with no samples (such a config cannot be loaded or published)",
    )
    build.add_argument(
        "--allow-version-change",
        action="store_true",
        help="resume although the tool, torch, diffusers, transformers, open_clip, timm or --torch-threads changed "
        "since the build started (both recorded in the manifest)",
    )
    build.add_argument(
        "--keep-inversions",
        choices=("yes", "no"),
        default="yes",
        help="no: drop each batch's stored inversions (~12 MB per 512 px image) from the ledger once the batch is "
        "done; the release is the same, a batch retried later inverts again (docs/scaling.md)",
    )
    build.add_argument(
        "--record-memory",
        action="store_true",
        help="write each stage's peak memory per device (CUDA: max allocated; CPU: peak resident-set growth) into "
        "the manifest's build.stage_memory; it is always logged. Off by default: it differs between identical builds",
    )
    build.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_allow_code(build)
    build.set_defaults(func=run_build)
    declare_output(build, "build", lambda args: args.output)

    validate = subparsers.add_parser(
        "validate",
        help="check a config or preset without loading any model",
        description="Construct every stage from its options and check the stage graph (every field a stage consumes "
        "is produced by an earlier stage; every release config has a stage that writes it), the source spec and the "
        "config's values, in seconds and without loading a model. `build` runs the same checks first.",
    )
    validate.add_argument("config", metavar="PRESET_OR_CONFIG", help="a preset name or a YAML file")
    validate.add_argument("--source", metavar="SPEC", help="the source spec the build would use (lists it)")
    validate.add_argument(
        "--configs", type=_comma_list, metavar="LIST", help="configs to build (default: the config's)"
    )
    _add_allow_code(validate)
    validate.set_defaults(func=run_validate)
    declare_output(validate, "validate", None)

    verify = subparsers.add_parser(
        "verify",
        help="check a release's hashes, counts and metadata",
        description="Recompute every hash and count of a release and validate every sample's metadata against the "
        "schema. Exits 1 naming the first problem found.",
    )
    verify.add_argument("release", metavar="DIR", type=Path, help="release directory")
    verify.add_argument("--skip-images", action="store_true", help="do not decode every image (faster)")
    verify.set_defaults(func=run_verify)
    declare_output(verify, "verify", None)  # reads: holds the release shared (run_verify)

    presets = subparsers.add_parser(
        "presets",
        help="list the build presets, or show one resolved and commented",
        description="List the build presets (name, release name, configs, file), or print one as resolved, commented "
        "YAML that can be copied into a file and edited (every key: docs/config.md).",
    )
    presets.add_argument("--show", metavar="NAME", help="print this preset (or YAML file) resolved, with comments")
    presets.set_defaults(func=run_presets)
    declare_output(presets, "presets", None)


def _preset_names() -> list[str]:
    return list_presets()


def _preset_lines() -> str:
    """One line per preset: its name and the first sentence of its file's own opening comment."""
    lines = []
    for name in _preset_names():
        header = []
        for line in (resources.files("builder") / "presets" / f"{name}.yaml").read_text().splitlines():
            if not line.startswith("#"):
                break
            header.append(line.lstrip("# ").strip())
        about = " ".join(header).split(". ")[0].rstrip(".")
        about = about if len(about) <= 90 else about[:89].rstrip() + "…"
        lines.append(f"\n  {name:<24} {about}")
    return "".join(lines)


def _add_allow_code(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-code",
        action="store_true",
        default=None,
        help="let the config name Python code as a stage type (module:attr); configs are data otherwise. Also "
        "LANCE_CF_ALLOW_CODE=1. Recorded in the manifest",
    )


def _allow_code(args: argparse.Namespace) -> bool:
    return bool(args.allow_code) or allow_code_from_env()


def run_validate(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    config = apply_overrides(config, source=args.source, configs=args.configs)
    if config.source is None:  # validate the stages anyway; the source and its options are checked when one is given
        config = apply_overrides(config, source="demo", source_options={})
        source_line = "source: none given (pass --source SPEC to check it)"
    else:
        source_line = None
    validated = validate_build(config, allow_code=_allow_code(args))
    if source_line is None:
        source = create_source(config.source, validated.source_options)
        check_stages_against_source(validated, source)
        source_line = (
            f"source: {config.source} ({len(source.samples)} images, {source.label_space.num_classes} classes)"
        )
    sys.stdout.write(f"valid: {config.name} {config.version}, configs {','.join(config.configs)}\n")
    for line in describe_validation(validated):
        sys.stdout.write(line + "\n")
    sys.stdout.write(source_line + "\n")
    return 0


def run_build(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    source_options = dict(config.source_options)
    if args.classes:
        source_options["classes"] = args.classes
    config = apply_overrides(
        config,
        source=args.source,
        configs=args.configs,
        limit=args.limit,
        name=args.name,
        version=args.release_version,
        release_date=args.release_date,
        description=args.description,
        license=args.license,
        seed=args.seed,
        shard_max_samples=args.shard_size,
        batch_size=args.batch_size,
        source_options=source_options,
    )
    engine, device, engine_options = _engine_choice(args)
    try:
        manifest = build(
            config,
            args.output,
            device=device,
            progress=not args.no_progress,
            engine=engine,
            engine_options=engine_options,
            keep_inversions=args.keep_inversions == "yes",
            record_memory=args.record_memory,
            workers=args.workers,
            allow_code=_allow_code(args),
            torch_threads=args.torch_threads,
            retry_failures=args.retry_failures,
            allow_version_change=args.allow_version_change,
            schedule=args.schedule,
        )
    except ModelsMissing as err:  # the command that fetches them names this config
        configs = f" --configs {','.join(args.configs)}" if args.configs else ""
        err.command = f"lance-cf models download {shlex.quote(args.config)}{configs}"
        raise
    return _summarize_build(args.output, manifest, allow_empty=args.allow_empty)


def _engine_choice(args: argparse.Namespace) -> tuple[str, str | None, dict]:
    """(engine, device, engine options) from --engine, --devices, --ray-address, --gpus-per-worker, --stage-workers,
    --stage-gpus."""
    engine, device, options = args.engine, args.device, {}
    if args.devices:
        if engine not in ("local", "devices"):
            raise ValueError(f"--devices runs the devices engine, not {engine}; with Ray use --workers")

        engine, options["devices"] = "devices", parse_devices(args.devices)
        device = device or options["devices"][0]  # the driver records the determinism of the workers' device kind
    for flag, key in (("ray_address", "address"), ("gpus_per_worker", "gpus_per_worker")):
        value = getattr(args, flag)
        if value is not None:
            if engine != "ray":
                raise ValueError(f"--{flag.replace('_', '-')} is for --engine ray")
            options[key] = value
    if args.stage_workers is not None or args.stage_gpus is not None:
        if args.stage_workers is not None:
            if engine not in ("ray", "devices"):
                raise ValueError("--stage-workers is for --engine ray or --devices (worker pools)")
            options["stage_workers"] = parse_stage_settings(args.stage_workers, "--stage-workers", int)
        if args.stage_gpus is not None:
            if engine != "ray":
                raise ValueError("--stage-gpus is for --engine ray")
            options["stage_gpus"] = parse_stage_settings(args.stage_gpus, "--stage-gpus", float)
    return engine, device, options


def _summarize_build(output: Path, manifest: dict, allow_empty: bool = False) -> int:
    """What was written, what went wrong, and, after a success only, what to run next (the release kind's commands).
    Exit 1 while errors (retryable) remain, or when a selected config has no sample (it could not be loaded: never
    report success over an empty release)."""
    write = sys.stdout.write
    counts = ", ".join(f"{c}: {manifest['counts'][c]['total']}" for c in manifest["configs"]) or "no samples"
    failures = manifest["failures"]
    errors = manifest.get("build", {}).get("errors", [])
    write(f"built {output} ({counts}; {len(failures)} failure(s), {len(errors)} error(s))\n")
    for failure in failures[:10]:
        write(f"  failed {failure['source_key']} [{failure['stage']}]: {failure['reason']}\n")
    if len(failures) > 10:
        write(f"  ... and {len(failures) - 10} more failure(s) (see manifest.json)\n")
    for error in errors[:10]:
        write(f"  error  {error['source_key']} [{error['stage']}]: {error['message']}\n")
    if len(errors) > 10:
        write(f"  ... and {len(errors) - 10} more error(s) (see manifest.json, build.errors)\n")
    shards = len(manifest.get("shards", []))
    write(f"wrote {shards} shard(s) under {output}/data, manifest.json, _info.json and README.md (the dataset card)\n")
    if errors:
        write("errors are exceptions, not data: fix their cause and re-run the same command to retry them\n")
    empty = list(manifest.get("empty_configs") or [])
    if empty and not allow_empty:
        sys.stderr.write(
            f"lance-cf build: error: config(s) {', '.join(empty)} ended with no samples (see the failures "
            "above and manifest.json); such a config cannot be loaded or published: fix the source or the stages and "
            "re-run the same command, or pass --allow-empty to accept it\n"
        )
        return 1
    if errors:
        return 1
    lines = kind_of_manifest(manifest).next_lines(str(output), manifest) if manifest["configs"] else []
    if lines:
        write("next:\n" + "".join(f"  {line}\n" for line in lines))
        if any("--class-map CLASS_MAP" in line for line in lines):
            write(
                f"  (the labels are not ImageNet-1k's ({manifest['label_space'].get('name')}): CLASS_MAP is a file "
                "giving the model's output index of each label, one integer a line; docs/evaluation.md)\n"
            )
    return 0


# One device rule for every subcommand (eval included): lance_pipeline.models.devices.
resolve_device = _resolve_device


def run_verify(args: argparse.Namespace) -> int:
    if not args.release.is_dir():
        raise ValueError(f"{args.release} is not a directory")
    # The lock first: a build still running holds it, and is named (with its pid) rather than called unfinished.
    with output_lock(args.release, "verify", shared=True):  # never beside a build or a publish of it
        if not (args.release / "manifest.json").exists() and (args.release / WORK_DIR).is_dir():
            sys.stderr.write(
                f"verify: FAILED: {args.release}: this build has not finished (it has no manifest.json yet): re-run "
                "the lance-cf build command that started it; it resumes where it stopped\n"
            )
            return 1
        problems = verify_release(args.release, check_images=not args.skip_images)
    if problems:
        sys.stderr.write(f"verify: FAILED: {problems[0]}\n")
        if len(problems) > 1:
            sys.stderr.write(f"verify: {len(problems) - 1} more problem(s):\n")
            for problem in problems[1:]:
                sys.stderr.write(f"  {problem}\n")
        return 1
    sys.stdout.write(f"verify: OK {args.release}\n")
    return 0


def run_presets(args: argparse.Namespace) -> int:
    if args.show:
        config = load_config(args.show)
        origin = f"preset {args.show}" if args.show in list_presets() else args.show
        sys.stdout.write(commented_yaml(config.to_dict(), origin=origin))
        return 0
    for name in list_presets():
        config = load_config(name)
        sys.stdout.write(
            f"{name}: {config.name} {config.version}, configs {','.join(config.configs)} ({preset_path(name)})\n"
        )
    sys.stdout.write("show one resolved and commented: lance-cf presets --show NAME\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="lance-cf",
        description="Build, verify, publish and evaluate LANCE counterfactual stress-test datasets "
        "(Prabhu et al., NeurIPS 2023) for image classifiers.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for module_name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name and module_name.startswith(err.name):
                continue  # that part of the tool is not there
            raise
        module.register(subparsers)
    # A subcommand that parses another command's arguments (``models list COMMAND ...``) reads the whole parser
    # from here instead of importing this module back (the subcommand modules import nothing of the CLI's root).
    parser.set_defaults(root_parser=parser)
    bound_numeric_options(parser)  # every number option of every command: bounded integers, finite floats
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    # Our packages log at INFO; third-party libraries (some log to the root logger) only warnings, unless -v.
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for package in ("builder", "lance_pipeline", "dataset_cards", "evaluation"):
        logging.getLogger(package).setLevel(logging.DEBUG if args.verbose else logging.INFO)
    previous = _stop_on_sigterm()
    try:
        return _run_with_models(args, argv)
    except ValueError as err:  # bad input: one line, no traceback
        sys.stderr.write(f"lance-cf {args.command}: error: {err}\n")
        return 2
    except ImportError as err:  # a missing optional extra: the message carries the install command
        if "pip install" not in str(err):
            return report_unexpected(args.command, err)
        sys.stderr.write(f"lance-cf {args.command}: error: {err}\n")
        return 2
    except RuntimeError as err:
        if not isinstance(err, StageNotWorking):
            return report_unexpected(args.command, err)
        sys.stderr.write(
            f"lance-cf {args.command}: error: {err}\n"
            "  nothing was recorded against the data: fix the stage or its environment, then re-run the same command\n"
        )
        return 1
    except OSError as err:
        if not _is_model_download_error(err):
            return report_unexpected(args.command, err)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        connect = "unset HF_HUB_OFFLINE and connect to the Hub once" if offline_by_user() else "connect to the Hub once"
        sys.stderr.write(
            f"lance-cf {args.command}: error: a model could not be loaded ({first}); {connect} to cache it, or give "
            "a local model directory instead of the Hub id\n"
        )
        return 2
    except KeyboardInterrupt as stop:  # what was kept is said by the command (a build: its finished images)
        how = getattr(stop, "signal_name", None) or "interrupted"
        sys.stderr.write(f"lance-cf {args.command}: stopped ({how}); re-run the same command to resume\n")
        return 143 if how == "SIGTERM" else 130
    except Exception as err:  # noqa: BLE001 - anything else is a bug: one line here, the traceback in a file
        return report_unexpected(args.command, err)
    finally:
        if previous is not None:  # main() called in-process (tests, embedding): the caller's handler again
            import signal

            signal.signal(signal.SIGTERM, previous)


def traceback_dir() -> Path:
    """Where unexpected errors' tracebacks are written: ``$LANCE_CF_TRACEBACK_DIR``, else the user's cache
    (``$XDG_CACHE_HOME/lance-cf/tracebacks``, by default ``~/.cache/lance-cf/tracebacks``)."""
    if os.environ.get("LANCE_CF_TRACEBACK_DIR"):
        return Path(os.environ["LANCE_CF_TRACEBACK_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "lance-cf" / "tracebacks"


def report_unexpected(command: str, err: BaseException) -> int:
    """An exception no command expected: one line naming it and the file its full traceback went to; exit 1."""
    import datetime
    import tempfile
    import traceback

    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    name = f"{stamp}-{command}-{os.getpid()}.txt"
    where = None
    for folder in (traceback_dir(), Path(tempfile.gettempdir()) / "lance-cf-tracebacks"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(f"lance-cf {shlex.join(sys.argv[1:])}\n\n{text}", encoding="utf-8")
            where = folder / name
            break
        except OSError:
            continue
    # The exception's notes say where it was raised (a build names the stage and the sample): kept in the one line.
    said = " ".join([str(err), *(str(n) for n in getattr(err, "__notes__", ()))])
    first = " ".join(said.split())[:400] or "no message"
    shown = f"the full traceback is in {where}" if where else "the traceback could not be written to a file"
    sys.stderr.write(
        f"lance-cf {command}: error: unexpected {type(err).__name__} ({first}); {shown}; this is a bug, please "
        "report it with that file\n"
    )
    return 1


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is, so that it stops as Ctrl-C does: locks released, what was kept said."""

    signal_name = "SIGTERM"


def _stop_on_sigterm():
    """Turn SIGTERM into ``Terminated`` for the command's life; returns the handler it replaced (None off the main
    thread, where handlers cannot be set)."""
    import signal
    import threading

    def stop(signum, frame):  # noqa: ARG001 - signal handler signature
        raise Terminated()

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, stop)


def _run_with_models(args: argparse.Namespace, argv: list[str]) -> int:
    """Run the command; its parser's ``check`` default (checks that need no model) runs first, then, for a command
    that declares its models (its parser's ``models`` default), the model check: a model neither cached nor
    reachable stops it in seconds with the ``models download`` command (builds check theirs in
    ``builder.engine.build``)."""
    check = getattr(args, "check", None)  # the command's own one-line checks come before any model is looked up
    if check is not None:
        check(args)
    # One writer per directory: the one its parser declares (declare_output) is held for the command's whole life.
    with declared_output_lock(args):
        declare = getattr(args, "models", None)
        if declare is None or args.command == "models":
            return int(args.func(args) or 0)

        states = resolve_models(
            declare(args),
            command=f"lance-cf models download {shlex.join(argv)}",
            offline_ways=getattr(args, "offline_ways", None),  # what the command can use instead of the Hub
        )
        # optional models the check found missing: the command skips what needs them (saying so) instead of trying
        args.skipped_models = [s for s in states if s.problem and s.need.optional and not s.stand_in]
        with models_ready(states, progress=not getattr(args, "no_progress", False)):
            return int(args.func(args) or 0)


def _is_model_download_error(err: BaseException) -> bool:
    """A model or file that the Hub client could not fetch (offline, unreachable, not cached): the one environment
    fault every model-loading command shares, so it is reported here once instead of as a library traceback."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    chain: BaseException | None = err
    while chain is not None:
        if isinstance(chain, LocalEntryNotFoundError) or "huggingface.co" in str(chain):
            return True
        chain = chain.__cause__ or chain.__context__
    return False


if __name__ == "__main__":
    sys.exit(main())
