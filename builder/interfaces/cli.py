"""``lance-cf interfaces learn-tokens``: learn one textual-inversion token per class (dataset interfaces).

Reads the class's images from any source this tool reads (``imagefolder:``, ``imagenet:``, ``hf:``, ``wds:``), trains
``lance_pipeline.interfaces.textual_inversion`` once per class and writes ``{label}.safetensors`` (diffusers'
``load_textual_inversion`` layout) plus ``tokens.json`` (settings, classes, final losses). Resumable per class: a
finished class's file is never redone, so a killed run redoes at most the class in flight. ``--push-to-hub`` uploads
the directory as a model repository with a card.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TOKENS_INDEX = "tokens.json"


def register(subparsers) -> None:
    interfaces = subparsers.add_parser(
        "interfaces",
        help="dataset interfaces (ImageNet*): learn class tokens",
        description="Dataset interfaces (Vendrow et al., arXiv 2302.07865): learn a textual-inversion token per class "
        "from that class's real images, then build per-shift releases with the imagenet-star or demo-star preset.",
    )
    commands = interfaces.add_subparsers(dest="interfaces_command", metavar="COMMAND")
    learn = commands.add_parser(
        "learn-tokens",
        help="learn one token per class (resumable per class)",
        description="Learn one textual-inversion token per class; a finished class is never redone.",
    )
    learn.add_argument(
        "--source", required=True, metavar="SPEC", help="imagefolder:PATH | imagenet:PATH | hf:... | wds:..."
    )
    learn.add_argument("--classes", metavar="LIST", help="imagenet source: class subset (synsets, indices or names)")
    learn.add_argument("--output", "-o", required=True, type=Path, help="token directory (created if missing)")
    learn.add_argument("--model", help="Stable Diffusion checkpoint: Hub id or local directory (default: SD 2)")
    learn.add_argument("--revision", help="Hub revision of --model")
    learn.add_argument("--steps", type=int, help="optimisation steps per class (default 3000)")
    learn.add_argument("--learning-rate", type=float, help="AdamW learning rate (default 5e-4)")
    learn.add_argument("--resolution", type=int, help="training resolution in pixels (default 768)")
    learn.add_argument("--images-per-class", type=int, metavar="N", help="use at most N images of each class")
    learn.add_argument("--seed", type=int, default=0, help="base seed (each class's RNG derives from it and its token)")
    learn.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    learn.add_argument("--push-to-hub", metavar="REPO_ID", help="upload the tokens as a model repository with a card")
    learn.add_argument("--no-progress", action="store_true", help="no progress bar")
    learn.set_defaults(func=run_learn_tokens, models=_declared_models)
    interfaces.set_defaults(func=lambda args: interfaces.print_help() or 2)


def _declared_models(args: argparse.Namespace) -> list:
    """learn-tokens loads one Stable Diffusion checkpoint (checked before it starts)."""
    from lance_pipeline.model_needs import SD_COMPONENT_FILES, reference_need

    options = _options(args)
    need = reference_need(options.model, files=SD_COMPONENT_FILES, revision=options.revision, used_by="learn-tokens",
                          key="--model", revision_key="--revision", role="Stable Diffusion")  # fmt: skip
    return [need] if need is not None else []


def _options(args: argparse.Namespace):
    from lance_pipeline.interfaces.textual_inversion import TextualInversionOptions

    given: dict[str, Any] = {
        "steps": args.steps,
        "learning_rate": args.learning_rate,
        "resolution": args.resolution,
        "seed": args.seed,
    }
    if args.model is not None:  # a model named on the command line is pinned by --revision, or not at all
        given.update(model=args.model, revision=args.revision)
    elif args.revision is not None:
        given["revision"] = args.revision
    return TextualInversionOptions(**{k: v for k, v in given.items() if v is not None or k == "revision"})


def _class_images(source, per_class: int | None) -> dict[int, list[Any]]:
    """Decoded RGB images per label, in key order; unreadable images are logged and skipped (counted)."""
    from builder import images

    by_label: dict[int, list[Any]] = {}
    skipped = 0
    for sample in source.samples:
        if sample.problem:
            skipped += 1
            continue
        bucket = by_label.setdefault(sample.label, [])
        if per_class is not None and len(bucket) >= per_class:
            continue
        try:
            bucket.append(images.decode_image(source.read(sample), image_size=None, min_side=16))
        except (OSError, ValueError, images.ImageDecodeError) as err:
            skipped += 1
            logger.warning("skipping %s: %s", sample.key, err)
    if skipped:
        logger.warning("%d image(s) could not be used", skipped)
    return {label: imgs for label, imgs in by_label.items() if imgs}


def run_learn_tokens(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from builder.cli import resolve_device
    from builder.sources import create_source
    from lance_pipeline.interfaces.textual_inversion import TextualInversionTrainer, save_token, token_for_class

    options = _options(args)  # bad settings fail here, before any image is read or model loaded
    if args.push_to_hub:
        from builder.publish import check_repo_id

        try:  # a bad repo id must not wait for hours of training
            check_repo_id(args.push_to_hub)
        except ValueError:
            raise ValueError(f"--push-to-hub {args.push_to_hub!r} is not a Hub repo id; expected ORG/NAME") from None
    if args.images_per_class is not None and args.images_per_class < 1:
        raise ValueError(f"--images-per-class {args.images_per_class}: expected a positive integer")
    source_options = {"classes": [c.strip() for c in args.classes.split(",")]} if args.classes else {}
    source = create_source(args.source, source_options)
    per_class = _class_images(source, args.images_per_class)
    if not per_class:
        raise ValueError(f"source {args.source!r}: no readable images")
    output: Path = args.output
    if output.exists() and not output.is_dir():
        raise ValueError(f"--output {output} is a file; give a directory")
    output.mkdir(parents=True, exist_ok=True)
    index_path = output / TOKENS_INDEX
    index = json.loads(index_path.read_text()) if index_path.exists() else {}
    if index and index.get("options") != options.to_dict():
        raise ValueError(
            f"{output} holds tokens learned with other settings; use another --output or the same settings"
        )
    index["options"] = options.to_dict()
    index.setdefault("classes", {})
    names = source.label_space.names
    todo = [label for label in sorted(per_class) if not (output / f"{label}.safetensors").exists()]
    done = len(per_class) - len(todo)
    if done:
        sys.stderr.write(f"interfaces: {done} class(es) already learned in {output}; resuming with {len(todo)}\n")
    trainer = TextualInversionTrainer(options, device=resolve_device(args.device))
    bar = tqdm(total=len(todo) * options.steps, unit="step", desc="learn tokens", disable=args.no_progress)
    for label in todo:
        name = names[label] if label < len(names) else str(label)
        token = token_for_class(name, label)
        bar.set_postfix_str(name[:30])
        learned = trainer.learn(per_class[label], name, token, progress=bar)
        save_token(output / f"{label}.safetensors", learned, metadata={"class_name": name, "label": str(label)})
        index["classes"][str(label)] = {
            "class_name": name,
            "token": token,
            "images": len(per_class[label]),
            "initializer_norm": learned.initializer_norm,
            "first_loss": learned.losses[0],
            "last_loss": learned.losses[-1],
        }
        tmp = index_path.with_name(f".{TOKENS_INDEX}.tmp")
        tmp.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        tmp.replace(index_path)
    bar.close()
    sys.stdout.write(f"learned {len(todo)} token(s) into {output} ({len(per_class)} class(es) in all)\n")
    if args.push_to_hub:
        return push_tokens(output, args.push_to_hub, index)
    return 0


def push_tokens(directory: Path, repo_id: str, index: dict[str, Any]) -> int:
    """Upload the tokens as a model repository in one commit: every ``LABEL.safetensors``, ``tokens.json`` and a card.

    A model given as a local directory is published by its last component only (no machine path in ``tokens.json``
    or the card); the local ``tokens.json`` is left as it is, so that resuming still compares the real settings.
    Hub errors become one line (exit code 1); the learned tokens stay on disk, so a re-run only pushes.
    """
    import os

    from huggingface_hub import CommitOperationAdd, ModelCard

    from builder.cli_publish import _talk_to_hub
    from builder.publish import check_repo_id, create_api, refuse_token

    opts = dict(index["options"])
    if isinstance(opts.get("model"), str) and os.path.isdir(opts["model"]):
        opts["model"] = Path(opts["model"]).name
    public_index = {**index, "options": opts}
    rows = "\n".join(
        f"| {label} | {info['class_name']} | `{info['token']}` | {info['images']} |"
        for label, info in sorted(index["classes"].items(), key=lambda kv: int(kv[0]))
    )
    card = ModelCard(
        f"---\nlibrary_name: diffusers\ntags: [textual-inversion, dataset-interfaces, lance-cf]\n"
        f"base_model: {opts['model']}\n---\n\n# Class tokens for dataset interfaces\n\n"
        f"Textual-inversion tokens (Vendrow et al., arXiv 2302.07865), one per class, learned with `lance-cf interfaces "
        f"learn-tokens` on `{opts['model']}` (revision `{opts['revision']}`): {opts['steps']} steps, AdamW lr "
        f"{opts['learning_rate']}, batch {opts['batch_size']}, {opts['resolution']} px. Load one with diffusers' "
        f'`pipe.load_textual_inversion("{repo_id}", weight_name="LABEL.safetensors")`.\n\n'
        f"| label | class | token | images |\n|---|---|---|---|\n{rows}\n"
    )
    operations = [
        CommitOperationAdd(path_in_repo=f"{label}.safetensors", path_or_fileobj=str(directory / f"{label}.safetensors"))
        for label in sorted(index["classes"], key=int)
    ]
    index_bytes = (json.dumps(public_index, indent=2, sort_keys=True) + "\n").encode()
    operations.append(CommitOperationAdd(path_in_repo=TOKENS_INDEX, path_or_fileobj=index_bytes))
    operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=str(card).encode()))
    check_repo_id(repo_id)

    def push():
        refuse_token({TOKENS_INDEX: index_bytes, "README.md": str(card).encode()})
        api = create_api()
        api.create_repo(repo_id, repo_type="model", exist_ok=True)
        return api.create_commit(repo_id=repo_id, operations=operations, commit_message="lance-cf class tokens")

    if _talk_to_hub("interfaces learn-tokens", push) is None:
        return 1
    sys.stdout.write(f"pushed {len(index['classes'])} token(s) to {repo_id}\n")
    return 0


def create_demo_star_tokens(path: Path) -> Path:
    """The offline demo's class tokens: learned for a few steps on the bundled photos with the tiny Stable Diffusion.

    A ``demo:`` component (``demo:tiny-star-tokens``): deterministic, built once into the cache. Learned from noise-
    level models in 4 steps, the tokens mean nothing; they exist so that the demo runs the whole dataset-interfaces
    path (learn tokens, generate with them, filter, release) offline.
    """
    from builder import images
    from builder.model_refs import materialize_demo_component
    from builder.sources import DemoSource
    from lance_pipeline.interfaces.textual_inversion import (
        TextualInversionOptions,
        TextualInversionTrainer,
        save_token,
        token_for_class,
    )

    sd = materialize_demo_component("tiny-stable-diffusion")
    source = DemoSource()
    per_class: dict[int, list[Any]] = {}
    for sample in source.samples:
        image = images.decode_image(source.read(sample), image_size=None, min_side=16)
        per_class.setdefault(sample.label, []).append(image)
    trainer = TextualInversionTrainer(TextualInversionOptions(model=str(sd), revision=None, steps=4, resolution=32))
    path = Path(path)
    for label in sorted(per_class):
        name = source.label_space.names[label]
        learned = trainer.learn(per_class[label], name, token_for_class(name, label))
        save_token(path / f"{label}.safetensors", learned, metadata={"class_name": name, "label": str(label)})
    return path
