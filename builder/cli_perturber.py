"""``lance-cf perturber``: try the LANCE caption perturber and label check on captions from the command line.

Example::

    lance-cf perturber "a photo of a husky pulling a sled in the snow" --label "dog sled" \\
        --edit-types background,weather --model Qwen/Qwen2.5-7B-Instruct --n 3

Prints one JSON line per proposed edit (edit type, edited caption, spans, label-check scores, kept or
why rejected), then with ``--stats`` one line of parsing statistics per caption.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

logger = logging.getLogger(__name__)

_DESCRIPTION = (
    "Run the LANCE structured caption perturber (an instruction LLM, optionally with a LoRA adapter) on one "
    "or more captions and score each edit with the label-preservation check. Prints JSON lines."
)


def register(subparsers) -> None:
    """Add the ``perturber`` subcommand to ``subparsers``."""
    parser = subparsers.add_parser("perturber", help="try the caption perturber on captions", description=_DESCRIPTION)
    parser.add_argument("captions", nargs="+", metavar="CAPTION", help="caption(s) to perturb")
    parser.add_argument("--label", required=True, help="class name the edits must keep, e.g. 'dog sled'")
    parser.add_argument(
        "--edit-types",
        default="subject,object,background,weather,adjective,domain",
        help="comma-separated edit types (default: all six)",
    )
    parser.add_argument("--model", default=None, help="causal LM id or local directory (default: the stage default)")
    parser.add_argument("--revision", default=None, help="model revision (default: the pinned one for the default)")
    parser.add_argument("--adapter", default=None, help="PEFT LoRA adapter id or directory")
    parser.add_argument("--adapter-revision", default=None, help="adapter revision")
    parser.add_argument("--n", type=int, default=3, help="edits per edit type (the paper's N; default 3)")
    parser.add_argument("--prompt-style", default="auto", choices=("auto", "chat", "alpaca"))
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--do-sample", action="store_true", help="seeded sampling instead of greedy decoding")
    parser.add_argument("--seed", type=int, default=0, help="sample seed (matters with --do-sample)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    parser.add_argument("--label-model", default=None, help="sentence-transformers model for the label check")
    parser.add_argument("--label-threshold", type=float, default=None, help="reject label similarity >= this")
    parser.add_argument("--span-threshold", type=float, default=None, help="reject span similarity >= this")
    parser.add_argument("--no-label-check", action="store_true", help="print edits without scoring them")
    parser.add_argument("--stats", action="store_true", help="also print parsing statistics per caption")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Perturb ``args.captions`` and print JSON lines; returns the exit code."""
    from lance_pipeline.perturbation import DEFAULT_PERTURBER, DEFAULT_PERTURBER_REVISION, PromptPerturber

    captions = [" ".join(c.split()) for c in args.captions]
    if not all(captions):
        raise ValueError("captions must be non-empty text")
    if not args.label.strip():
        raise ValueError("--label must name the class, e.g. --label 'dog sled'")
    if args.n < 1:
        raise ValueError(f"--n must be >= 1, got {args.n}")
    model = args.model or DEFAULT_PERTURBER
    revision = (
        args.revision if args.revision is not None else (DEFAULT_PERTURBER_REVISION if args.model is None else None)
    )
    from builder.cli import resolve_device

    device = resolve_device(args.device)
    perturber = PromptPerturber(
        model=model,
        revision=revision,
        adapter=args.adapter,
        adapter_revision=args.adapter_revision,
        edit_types=args.edit_types,
        n_per_type=args.n,
        prompt_style=args.prompt_style,
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
    )
    checker = None
    if not args.no_label_check:
        from lance_pipeline.label_checks import LabelPreservationCheck

        options = {}
        if args.label_model:
            options.update(model=args.label_model, revision=None)
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
    for caption, item in zip(captions, detailed, strict=True):
        edits = [e.to_dict() for e in item["edits"]]
        if checker is not None:
            edits = checker.check(edits, args.label)
        for edit in edits:
            out.write(json.dumps({"caption": caption, "label_name": args.label, **edit}) + "\n")
        if args.stats:
            out.write(json.dumps({"caption": caption, "perturb_stats": item["perturb_stats"]}) + "\n")
    out.flush()
    return 0
