"""``lance-cf interfaces``: the commands of dataset interfaces (Vendrow et al., arXiv 2302.07865).

- ``shifts`` lists the shifts a build can name: the paper's Table 1 (prompt, shift caption, CLIP threshold, yield) and
  the separately named corrected variants.
- ``calibrate`` computes the per-class object-presence thresholds of Appendix A.3 from real images of each class (any
  source this tool reads), one class at a time, into a JSON file the build's filter reads.
- ``learn-tokens`` learns one textual-inversion token per class from its real images (any source), one class at a
  time, decoding an image only when a training step draws it: memory does not grow with the images per class. It
  writes ``{label}.safetensors`` (diffusers' ``load_textual_inversion`` layout, with everything the index records in
  its metadata) and then ``tokens.json``, the index, rebuilt from the token files on every run: a run killed between
  the two writes loses nothing. The output folder is locked for the run. ``--push-to-hub`` uploads the folder as a
  model repository with a card, and refuses to publish fewer tokens than the folder holds.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

from builder import imagenet, images
from builder.model_refs import materialize_demo_component
from builder.release_format.hub_client import check_repo_id, create_api, refuse_token, talk_to_hub
from builder.release_format.lock import declare_output, file_folder, output_lock
from builder.sources import DemoSource, create_source
from lance_pipeline.clip.gates import ClipScorer
from lance_pipeline.interfaces.object_thresholds import (
    DEFAULT_PERCENTILE,
    ClassThreshold,
    ObjectThresholds,
    check_percentile,
    class_similarities,
    percentile_threshold,
)
from lance_pipeline.interfaces.shifts import CORRECTED_VARIANTS, IMAGENET_STAR_SHIFTS, object_caption
from lance_pipeline.interfaces.textual_inversion import (
    TextualInversionOptions,
    TextualInversionTrainer,
    save_token,
    token_for_class,
    token_metadata,
)
from lance_pipeline.models.devices import resolve_device
from lance_pipeline.models.needs import SD_COMPONENT_FILES, clip_need, reference_need
from lance_pipeline.readers import read_json

logger = logging.getLogger(__name__)

TOKENS_INDEX = "tokens.json"
INDEX_FIELDS = ("class_name", "token", "images", "initializer_norm", "first_loss", "last_loss")


def register(subparsers) -> None:
    interfaces = subparsers.add_parser(
        "interfaces",
        help="dataset interfaces (ImageNet*): shifts, object thresholds, class tokens",
        description="Dataset interfaces (Vendrow et al., arXiv 2302.07865): list the shifts, calibrate the per-class "
        "object thresholds and learn a textual-inversion token per class from that class's real images, then build "
        "per-shift releases with the imagenet-star or demo-star preset.",
    )
    commands = interfaces.add_subparsers(dest="interfaces_command", metavar="COMMAND")

    shifts = commands.add_parser(
        "shifts",
        help="list the shifts: prompt, shift caption, CLIP threshold, provenance, the paper's yield",
        description="The shifts a generation build can name: ImageNet*'s 23 and base, as the paper's Table 1 gives "
        "them (the default), then the corrected wordings, which are built only when named.",
    )
    shifts.add_argument("--format", choices=("text", "json"), default="text", help="output format (default: text)")
    shifts.set_defaults(func=run_shifts)
    declare_output(shifts, "interfaces shifts", None)

    calibrate = commands.add_parser(
        "calibrate",
        help="per-class object thresholds: a percentile of CLIP similarity on each class's real images",
        description='For each class, the CLIP similarity between "a photo of a <class>" (and "a <class>", for art '
        "styles) and every real image of the class, and its --percentile-th percentile: the object-presence "
        "threshold of the paper's Appendix A.3 (they used ImageNet's validation images). Written as JSON with the "
        "CLIP model, the percentile and the image counts; set the filter's object_thresholds to the file.",
    )
    calibrate.add_argument("--source", required=True, metavar="SPEC", help="imagefolder:PATH | imagenet:PATH | hf:...")
    calibrate.add_argument("--classes", metavar="LIST", help="class subset (synsets, indices or names)")
    calibrate.add_argument("--output", "-o", required=True, type=Path, help="thresholds file to write (JSON)")
    calibrate.add_argument(
        "--percentile",
        type=float,
        help="percentile of each class's similarities (default 5: ours, the paper's value is not in our copy)",
    )
    calibrate.add_argument("--clip-model", default="ViT-H-14", help="CLIP model, as the filter names it (ViT-H-14)")
    calibrate.add_argument(
        "--clip-pretrained", default="laion2b_s32b_b79k", help="its pretrained tag ('none' for a local directory)"
    )
    calibrate.add_argument("--clip-revision", help="Hub revision of an hf-hub: CLIP model")
    calibrate.add_argument("--images-per-class", type=int, metavar="N", help="use at most N images of each class")
    calibrate.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    calibrate.add_argument("--force", action="store_true", help="replace an existing --output file")
    calibrate.set_defaults(func=run_calibrate, models=_calibrate_models)
    declare_output(calibrate, "interfaces calibrate", lambda args: file_folder(args.output))

    learn = commands.add_parser(
        "learn-tokens",
        help="learn one token per class (resumable per class)",
        description="Learn one textual-inversion token per class; a finished class is never redone.",
    )
    learn.add_argument(
        "--source", required=True, metavar="SPEC", help="imagefolder:PATH | imagenet:PATH | hf:... | wds:..."
    )
    learn.add_argument("--classes", metavar="LIST", help="class subset (synsets, indices or names)")
    learn.add_argument("--output", "-o", required=True, type=Path, help="token directory (created if missing)")
    learn.add_argument("--model", help="Stable Diffusion checkpoint: Hub id or local directory (default: SD 2)")
    learn.add_argument("--revision", help="Hub revision of --model")
    learn.add_argument("--steps", type=int, help="optimisation steps per class (default 3000)")
    learn.add_argument("--learning-rate", type=float, help="AdamW learning rate (default 5e-4)")
    learn.add_argument("--resolution", type=int, help="training resolution in pixels (default 768)")
    learn.add_argument(
        "--norm-constraint",
        choices=("reparameterize", "rescale", "none"),
        help="how the token keeps its initialiser's norm (default reparameterize: MadryLab's)",
    )
    learn.add_argument("--images-per-class", type=int, metavar="N", help="use at most N images of each class")
    learn.add_argument("--seed", type=int, default=0, help="base seed (each class's RNG derives from it and its token)")
    learn.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    learn.add_argument("--push-to-hub", metavar="REPO_ID", help="upload the tokens as a model repository with a card")
    learn.add_argument("--no-progress", action="store_true", help="no progress bar")
    learn.set_defaults(func=run_learn_tokens, models=_declared_models, check=_check_learn_arguments)
    declare_output(learn, "interfaces learn-tokens", lambda args: args.output)
    interfaces.set_defaults(func=lambda args: interfaces.print_help() or 2)


def _declared_models(args: argparse.Namespace) -> list:
    """learn-tokens loads one Stable Diffusion checkpoint (checked before it starts)."""
    options = _options(args)
    need = reference_need(options.model, files=SD_COMPONENT_FILES, revision=options.revision, used_by="learn-tokens",
                          key="--model", revision_key="--revision", role="Stable Diffusion")  # fmt: skip
    return [need] if need is not None else []


def _calibrate_models(args: argparse.Namespace) -> list:
    """calibrate loads one CLIP model (checked before it starts)."""
    need = clip_need(args.clip_model, args.clip_pretrained, used_by="interfaces calibrate", key="--clip-model",
                     revision=args.clip_revision, role="CLIP of the object thresholds")  # fmt: skip
    return [need] if need is not None else []


# -- shifts -----------------------------------------------------------------------------------------------------------
def shift_rows() -> list[dict[str, Any]]:
    rows = []
    for default, shifts in ((True, IMAGENET_STAR_SHIFTS), (False, CORRECTED_VARIANTS)):
        for shift in shifts:
            rows.append({
                **shift.to_dict(),
                "object_caption": object_caption("<class>", shift.style),
                "default": default,
            })  # fmt: skip
    return rows


def run_shifts(args: argparse.Namespace) -> int:
    rows = shift_rows()
    if args.format == "json":
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return 0
    header = ("shift", "prompt", "shift caption", "threshold", "paper's yield", "provenance")

    def cells(row: dict[str, Any]) -> tuple[str, ...]:
        return (
            row["name"],
            row["prompt"],
            row["shift_caption"] or "-",
            "-" if row["threshold"] is None else f"{row['threshold']:.3f}",
            "-" if row["paper_yield"] is None else f"{100 * row['paper_yield']:.1f}%",
            row["provenance"],
        )

    table = [header, *(cells(r) for r in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(header) - 1)]

    def line(values: tuple[str, ...]) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(values, widths, strict=False)) + "  " + values[-1]

    out = [line(header)]
    out += [line(cells(r)) for r in rows if r["default"]]
    out += ["", "Corrected wordings (built only when named in the source's shifts):"]
    out += [line(cells(r)) for r in rows if not r["default"]]
    out += [
        "",
        '<TOKEN> is the class\'s learned token. Object presence is scored against "a photo of a <class>" ("a <class>" '
        "for oil_painting, pencil_sketch and embroidery), per class: `lance-cf interfaces calibrate`.",
    ]
    sys.stdout.write("\n".join(out) + "\n")
    return 0


# -- reading one class at a time ----------------------------------------------------------------------------------------
def _source(spec: str, classes: str | None):
    """The source, and the labels ``classes`` selects (None: all). An ``imagenet:`` source lists only those; any
    other is listed whole and the classes are picked from its label space (synset, index or name)."""
    wanted = [c.strip() for c in classes.split(",") if c.strip()] if classes else []
    if spec.partition(":")[0] == "imagenet" and wanted:
        return create_source(spec, {"classes": wanted}), None
    source = create_source(spec, {})
    if not wanted:
        return source, None
    names = source.label_space.names
    labels = set()
    for item in wanted:
        if source.label_space.name == "imagenet-1k":
            labels.add(imagenet.resolve_class(item))
        elif item.isdigit() and int(item) < len(names):
            labels.add(int(item))
        elif item in names:
            labels.add(names.index(item))
        else:
            raise ValueError(f"--classes {item!r}: not a class of source {spec!r} (its classes: {names[:5]}...)")
    return source, labels


def _samples_by_label(source, labels: set[int] | None = None) -> dict[int, list[Any]]:
    """Each class's samples in key order (listing only: nothing is decoded), only ``labels`` when given; samples the
    source could not label are counted and logged."""
    by_label: dict[int, list[Any]] = {}
    problems = 0
    for sample in source.samples:
        if sample.problem or sample.label < 0:
            problems += 1
            continue
        if labels is None or sample.label in labels:
            by_label.setdefault(sample.label, []).append(sample)
    if problems:
        logger.warning("%d sample(s) of the source have no usable image or label", problems)
    return dict(sorted(by_label.items()))


def _decode(source, sample) -> Any:
    return images.decode_image(source.read(sample), image_size=None, min_side=16)


def _readable(source, samples: list[Any], limit: int | None) -> list[Any]:
    """The first ``limit`` samples (all without one) that decode, in key order; each is decoded once and dropped."""
    kept = []
    for sample in samples:
        if limit is not None and len(kept) >= limit:
            break
        try:
            _decode(source, sample)
        except (OSError, ValueError, images.ImageDecodeError) as err:
            logger.warning("skipping %s: %s", sample.key, err)
            continue
        kept.append(sample)
    return kept


class ClassImages:
    """One class's training images as a sequence that decodes an image each time it is indexed (and keeps none)."""

    def __init__(self, source, samples: list[Any]) -> None:
        self.source = source
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Any:
        return _decode(self.source, self.samples[index])


def _check_count(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or value < 1):
        raise ValueError(f"{name} {value}: expected a positive integer")


# -- calibrate --------------------------------------------------------------------------------------------------------
def run_calibrate(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    percentile = check_percentile(DEFAULT_PERCENTILE if args.percentile is None else args.percentile)
    _check_count("--images-per-class", args.images_per_class)
    output: Path = args.output
    if output.is_dir():
        raise ValueError(f"--output {output} is a directory; give a file name (e.g. thresholds.json)")
    if output.exists() and not args.force:
        raise ValueError(f"--output {output} exists; pass --force to replace it, or give another file")
    pretrained = None if str(args.clip_pretrained).lower() in ("none", "") else args.clip_pretrained
    scorer = ClipScorer(model=args.clip_model, pretrained=pretrained, revision=args.clip_revision)
    source, labels = _source(args.source, args.classes)
    by_label = _samples_by_label(source, labels)
    if not by_label:
        raise ValueError(f"source {args.source!r}: no labelled images")
    scorer.load(resolve_device(args.device))
    names = source.label_space.names
    classes: dict[int, ClassThreshold] = {}
    for label, samples in tqdm(by_label.items(), unit="class", desc="calibrate", disable=not sys.stderr.isatty()):
        name = names[label] if label < len(names) else str(label)
        usable = _readable(source, samples, args.images_per_class)
        if not usable:
            logger.warning("class %s (%s): no readable image; no threshold", label, name)
            continue
        photo, style = class_similarities(scorer, (_decode(source, s) for s in usable), name)
        classes[label] = ClassThreshold(
            label, len(usable), percentile_threshold(photo, percentile), percentile_threshold(style, percentile), name
        )
    if not classes:
        raise ValueError(f"source {args.source!r}: no class has a readable image")
    thresholds = ObjectThresholds(
        clip=scorer.describe(),
        percentile=percentile,
        percentile_is_default=args.percentile is None,
        source=source.public_spec,
        classes=classes,
    )
    thresholds.write(output)
    counts = [c.images for c in classes.values()]
    sys.stdout.write(
        f"wrote {output}: object thresholds for {len(classes)} class(es) at percentile {percentile:g} "
        f"({min(counts)} to {max(counts)} images per class); set the filter's object_thresholds to it\n"
    )
    return 0


# -- learn-tokens -----------------------------------------------------------------------------------------------------
def _options(args: argparse.Namespace):
    given: dict[str, Any] = {
        "steps": args.steps,
        "learning_rate": args.learning_rate,
        "resolution": args.resolution,
        "norm_constraint": args.norm_constraint,
        "seed": args.seed,
    }
    if args.model is not None:  # a model named on the command line is pinned by --revision, or not at all
        given.update(model=args.model, revision=args.revision)
    elif args.revision is not None:
        given["revision"] = args.revision
    return TextualInversionOptions(**{k: v for k, v in given.items() if v is not None or k == "revision"})


def _settings_digest(settings: dict[str, Any]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


_TOKEN_FILE = re.compile(r"([0-9]+)\.safetensors", flags=re.ASCII)


def rebuild_index(output: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The index from the token files themselves: each ``{label}.safetensors`` carries its entry and the digest of
    the settings it was learned with in its metadata. A file learned with other settings, or one without that
    metadata, is refused in one line naming it."""
    from safetensors import SafetensorError

    digest = _settings_digest(settings)
    classes: dict[str, Any] = {}
    for path in sorted(output.iterdir()):
        match = _TOKEN_FILE.fullmatch(path.name)
        if match is None:
            continue
        try:
            meta = token_metadata(path)
        except (SafetensorError, OSError, ValueError) as err:
            raise ValueError(
                f"{path}: not a readable token file ({err}); remove it to learn that class again"
            ) from None
        entry = meta.get("entry")
        if not isinstance(entry, dict) or any(k not in entry for k in INDEX_FIELDS):
            raise ValueError(f"{path}: no index entry in its metadata; remove it to learn that class again")
        if meta.get("settings_sha256") != digest:
            raise ValueError(
                f"{path}: learned with other settings than this run's; use another --output or the same settings"
            )
        classes[str(int(match.group(1)))] = {k: entry[k] for k in INDEX_FIELDS}
    return {"settings": settings, "options": settings["options"], "classes": classes}


def _read_index(output: Path) -> dict[str, Any] | None:
    try:
        return read_json(output / TOKENS_INDEX)
    except (OSError, ValueError):
        return None


def _write_index(output: Path, index: dict[str, Any]) -> None:
    """Atomically, after the token files it lists (the output folder is locked: one writer)."""
    tmp = output / f".{TOKENS_INDEX}.tmp"
    tmp.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    tmp.replace(output / TOKENS_INDEX)


def _check_learn_arguments(args: argparse.Namespace) -> None:
    """Bad settings, repo id or output, before the model check (builder.cli) and before any image is read."""
    _options(args)
    if args.push_to_hub:
        try:  # a bad repo id must not wait for hours of training
            check_repo_id(args.push_to_hub)
        except ValueError:
            raise ValueError(f"--push-to-hub {args.push_to_hub!r} is not a Hub repo id; expected ORG/NAME") from None
    _check_count("--images-per-class", args.images_per_class)
    output: Path = args.output
    if output.exists() and not output.is_dir():
        raise ValueError(f"--output {output} is a file; give a directory")


def run_learn_tokens(args: argparse.Namespace) -> int:
    _check_learn_arguments(args)
    options = _options(args)
    output: Path = args.output
    source, labels = _source(args.source, args.classes)
    by_label = _samples_by_label(source, labels)
    if not by_label:
        raise ValueError(f"source {args.source!r}: no labelled images")
    output.mkdir(parents=True, exist_ok=True)
    with output_lock(output, "interfaces learn-tokens"):
        return _learn_locked(args, options, source, by_label, output)


def _learn_locked(args, options, source, by_label: dict[int, list[Any]], output: Path) -> int:
    from tqdm.auto import tqdm

    settings = {"options": options.to_dict(), "images_per_class": args.images_per_class}
    index = rebuild_index(output, settings)  # the files are the truth; the index is derived from them
    if index["classes"] and _read_index(output) != index:  # repaired: a kill between a token file and the index
        _write_index(output, index)
    names = source.label_space.names
    todo = [label for label in by_label if str(label) not in index["classes"]]
    done = len(by_label) - len(todo)
    if done:
        sys.stderr.write(f"interfaces: {done} class(es) already learned in {output}; resuming with {len(todo)}\n")
    trainer = TextualInversionTrainer(options, device=resolve_device(args.device))
    bar = tqdm(total=len(todo) * options.steps, unit="step", desc="learn tokens", disable=args.no_progress)
    learned_now = 0
    for label in todo:
        name = names[label] if label < len(names) else str(label)
        samples = _readable(source, by_label[label], args.images_per_class)
        if not samples:
            logger.warning("class %s (%s): no readable image; no token", label, name)
            continue
        token = token_for_class(name, label)
        bar.set_postfix_str(name[:30])
        learned = trainer.learn(ClassImages(source, samples), name, token, progress=bar)
        entry = {
            "class_name": name,
            "token": token,
            "images": len(samples),
            "initializer_norm": learned.initializer_norm,
            "first_loss": learned.losses[0],
            "last_loss": learned.losses[-1],
        }
        metadata = {"label": label, "entry": entry, "settings_sha256": _settings_digest(settings)}
        # 1. the token file (atomic), which holds its own index entry; 2. the index, rebuilt from it (atomic).
        save_token(output / f"{label}.safetensors", learned, metadata=metadata)
        index["classes"][str(label)] = entry
        _write_index(output, index)
        learned_now += 1
    bar.close()
    sys.stdout.write(f"learned {learned_now} token(s) into {output} ({len(index['classes'])} class(es) in all)\n")
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

    on_disk = sorted(int(m.group(1)) for p in directory.iterdir() if (m := _TOKEN_FILE.fullmatch(p.name)))
    indexed = sorted(int(label) for label in index["classes"])
    if on_disk != indexed:
        left_out = sorted(set(on_disk) - set(indexed))
        raise ValueError(
            f"--push-to-hub: {directory} holds {len(on_disk)} learned token(s) but the push would publish "
            f"{len(indexed)} (left out: {', '.join(map(str, left_out[:5])) or 'none'}"
            f"{', ...' if len(left_out) > 5 else ''}); re-run learn-tokens on it to rebuild its index, then push"
        )
    opts = dict(index["options"])
    if isinstance(opts.get("model"), str) and os.path.isdir(opts["model"]):
        opts["model"] = Path(opts["model"]).name
    public_index = {**index, "options": opts}
    if "settings" in index:
        public_index["settings"] = {**index["settings"], "options": opts}
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

    if talk_to_hub("interfaces learn-tokens", push) is None:
        return 1
    sys.stdout.write(f"pushed {len(index['classes'])} token(s) to {repo_id}\n")
    return 0


def create_demo_star_tokens(path: Path) -> Path:
    """The offline demo's class tokens: learned for a few steps on the bundled photos with the tiny Stable Diffusion.

    A ``demo:`` component (``demo:tiny-star-tokens``): deterministic, built once into the cache. Learned from noise-
    level models in 4 steps, the tokens mean nothing; they exist so that the demo runs the whole dataset-interfaces
    path (learn tokens, generate with them, filter, release) offline.
    """
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
