"""``lance-cf discover``: failure discovery for timm models (Wiles et al.); see ``builder.discovery.run``."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

DEMO_CLASSES = ["tench", "goldfish"]


def register(subparsers) -> None:
    discover = subparsers.add_parser(
        "discover",
        help="find, in words, where a model fails more than it should (Wiles et al.)",
        description="Generate images of each class, cluster a model's failures, caption and describe each cluster, "
        "test each description on new images against the class's base failure rate (one-sided Fisher exact test, "
        "Benjamini-Hochberg), refine what is found, and write discoveries.json and report.html. Resumable: re-run "
        "the same command. --demo runs offline with stand-ins that have a planted failure.",
    )
    discover.add_argument("--model", action="append", metavar="NAME", help="timm model to probe (repeatable)")
    discover.add_argument(
        "--classes", metavar="LIST", help="ImageNet classes: synsets, indices or names, comma-separated"
    )
    discover.add_argument("--output", "-o", required=True, type=Path, help="output directory (created if missing)")
    discover.add_argument("--n-base", type=int, default=100, metavar="N", help="base images per class (default 100)")
    discover.add_argument("--n-test", type=int, default=100, metavar="M", help="images per description (default 100)")
    discover.add_argument("--alpha", type=float, default=0.05, help="false discovery rate level (default 0.05)")
    discover.add_argument("--no-refine", action="store_true", help="do not prune discovered descriptions")
    discover.add_argument("--seed", type=int, default=0, help="seed; each image's seed derives from it and its key")
    discover.add_argument("--batch-size", type=int, default=8, help="images per generation/classification batch")
    discover.add_argument("--generator", default=None, help="Stable Diffusion checkpoint (default: SD 2)")
    discover.add_argument("--generator-revision", default=None, help="Hub revision of --generator")
    discover.add_argument("--steps", type=int, default=50, help="sampling steps (default 50)")
    discover.add_argument("--image-size", type=int, default=None, help="generated image size (default: the model's)")
    discover.add_argument("--captioner", default=None, help="captioner checkpoint (default: BLIP-2 as in LANCE)")
    discover.add_argument("--clip-model", default="ViT-L-14", help="CLIP model for failure embeddings")
    discover.add_argument(
        "--merge-llm",
        metavar="MODEL",
        help="merge each cluster's captions with this instruction-tuned LLM (Hub id, local directory or demo:NAME; "
        "default: keyword-frequency merge)",
    )
    discover.add_argument("--merge-llm-revision", default=None, help="Hub revision of --merge-llm")
    discover.add_argument("--clip-pretrained", default="openai", help="CLIP pretrained tag")
    discover.add_argument("--no-pretrained", action="store_true", help="random classifier weights (tests)")
    discover.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    discover.add_argument("--demo", action="store_true", help="offline stand-ins with a planted failure (red images)")
    discover.add_argument(
        "--release",
        metavar="DIR",
        type=Path,
        help="describe the failing counterfactuals of an existing release instead of generating (no tests)",
    )
    discover.add_argument(
        "--no-release", action="store_true", help="do not build OUTPUT/release (the discovered-failure images)"
    )
    discover.add_argument("--no-progress", action="store_true", help="no progress bar")
    discover.set_defaults(func=run_discover)


@functools.cache
def imagenet_superclasses() -> dict[str, str]:
    """synset -> direct WordNet hypernym (package data; provenance in the file's ``about``)."""
    text = (resources.files("builder") / "imagenet_superclasses.json").read_text(encoding="utf-8")
    return json.loads(text)["superclasses"]


def _targets(classes: list[str]):
    from builder import imagenet
    from builder.discovery.run import ClassTarget

    targets = []
    for spec in classes:
        index = imagenet.resolve_class(spec)
        synset = imagenet.synsets()[index]
        targets.append(ClassTarget(index, imagenet.class_names()[index], imagenet_superclasses()[synset], synset))
    return targets


def _demo_components(targets) -> Any:
    from builder.discovery.run import DiscoveryComponents
    from lance_pipeline.tiny.discovery_components import (
        ColourCaptioner,
        PaletteGenerator,
        colour_histogram_embedder,
        planted_classifier_fn,
    )

    # The stand-in encodes the run's classes as 0..n-1; map its predictions back to ImageNet labels.
    inner = planted_classifier_fn(len(targets), "red")

    def classify(images):
        return [targets[i].label for i in inner(images)]

    return DiscoveryComponents(
        generator=PaletteGenerator([t.name for t in targets]),
        classifiers={"planted_colour_classifier": classify},
        captioner=ColourCaptioner(),
        embedder=colour_histogram_embedder,
        classifier_info={"planted_colour_classifier": {"stand_in": True, "planted": "red"}},
    )


class _Described:
    """A component whose ``describe()`` names models by reference (``demo:NAME``), never by a local path."""

    def __init__(self, inner: Any, references: dict[str, str]) -> None:
        self._inner, self._references = inner, references

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def describe(self) -> dict[str, Any]:
        from builder.model_refs import restore_model_references

        return restore_model_references(self._inner.describe(), self._references)


def _real_components(args: argparse.Namespace, targets, device: str) -> Any:
    import torch

    from builder.discovery.run import DiscoveryComponents
    from builder.model_refs import resolve_model_references
    from lance_pipeline.clip.gates import ClipScorer
    from lance_pipeline.interfaces.generation import GenerationOptions, ShiftGenerator
    from lance_pipeline.text.captioning import LabelConditionedCaptioner

    # demo:/pkg: references resolve to local directories, as in build configs (and are named back in the output).
    given = {"generator": args.generator, "captioner": args.captioner, "clip": args.clip_model}
    resolved, references = resolve_model_references({k: v for k, v in given.items() if v})
    generation: dict[str, Any] = {
        "plain_prompt": True,
        "num_inference_steps": args.steps,
        "batch_size": args.batch_size,
    }
    if args.image_size:
        generation.update(image_size=args.image_size, generation_size=args.image_size)
    if args.generator:
        generation.update(model=resolved["generator"], revision=args.generator_revision)
    generator = ShiftGenerator(GenerationOptions(**generation), device)
    generator.load()
    captioning = {"model": resolved["captioner"], "revision": None} if args.captioner else {}
    captioner = LabelConditionedCaptioner(**captioning)
    captioner.load(device)
    clip_local = resolved["clip"] != args.clip_model
    scorer = ClipScorer(model=resolved["clip"], pretrained=None if clip_local else args.clip_pretrained)
    scorer.load(device)
    classifiers, info = {}, {}
    for name in args.model:
        classifiers[name], info[name] = _timm_classifier(name, not args.no_pretrained, device, torch)
    return DiscoveryComponents(
        generator=_Described(generator, references),
        classifiers=classifiers,
        captioner=_Described(captioner, references),
        embedder=lambda images: scorer.encode_images(images).cpu().numpy(),
        classifier_info=info,
    )


def _timm_classifier(name: str, pretrained: bool, device: str, torch: Any):
    import timm

    model = timm.create_model(name, pretrained=pretrained).eval().to(device)
    config = timm.data.resolve_data_config({}, model=model)
    transform = timm.data.create_transform(**config)

    def classify(images):
        with torch.no_grad():
            batch = torch.stack([transform(im.convert("RGB")) for im in images]).to(device)
            return model(batch).argmax(dim=1).tolist()

    return classify, {"pretrained": pretrained, "data_config": {k: list(v) if isinstance(v, tuple) else v
                                                                for k, v in config.items()}}  # fmt: skip


def _llm_merger(model: str, revision: str | None, device: str) -> Any:
    from builder.model_refs import resolve_model_references
    from lance_pipeline.discovery.method import LLMCaptionMerger
    from lance_pipeline.text.perturbation import PromptPerturber

    resolved, _ = resolve_model_references({"model": model})  # demo:/pkg: references, as in build configs
    perturber = PromptPerturber(model=resolved["model"], revision=revision, max_new_tokens=24)
    perturber.load(device)
    return LLMCaptionMerger(perturber)


def build_discovery_release(output: Path, document: dict[str, Any]) -> Path:
    """Build ``OUTPUT/release``: one config per discovered failure, through the normal builder (``discovery:``)."""
    from builder.config import BuildConfig
    from builder.discovery.source import DiscoverySource
    from builder.engine import build

    spec = f"discovery:{output}"
    configs = DiscoverySource(spec, str(output)).config_names
    models = ", ".join(sorted(document["models"]))
    description = (
        f"Generated images of the failures that lance-cf discover (Wiles et al., arXiv 2208.08831) found for {models}: "
        "one config per discovered failure (model, class, description), each image with the description, the probed "
        "model's prediction and the test's statistics. Evaluate other models on it to see whether the failure "
        "transfers."
    )
    if document["generator"].get("stand_in"):
        description += (
            " Made by the offline demo's stand-ins with a planted failure: it says nothing about real models."
        )
    config = BuildConfig(
        name="discovered-failures", version="1.0.0", description=description, seed=document["settings"]["seed"],
        source=spec, configs=configs, image_size=None, stages=[],
    )  # fmt: skip
    release = output / "release"
    build(config, release, progress=False, device="cpu")
    return release


def run_release_mode(args: argparse.Namespace) -> int:
    """``discover --release DIR``: cluster and describe each model's failing counterfactuals of a release."""
    import torch

    from builder.cli import resolve_device
    from builder.discovery.run import describe_release_failures
    from builder.model_refs import resolve_model_references
    from lance_pipeline.clip.gates import ClipScorer

    if not args.model:
        raise ValueError("give at least one --model NAME (a timm model) to probe the release with")
    if not (args.release / "manifest.json").is_file():
        raise ValueError(f"--release {args.release}: not a release directory (no manifest.json)")
    device = resolve_device(args.device)
    resolved, _ = resolve_model_references({"clip": args.clip_model})
    pretrained = None if resolved["clip"] != args.clip_model else args.clip_pretrained
    scorer = ClipScorer(model=resolved["clip"], pretrained=pretrained)
    scorer.load(device)
    classifiers = {name: _timm_classifier(name, not args.no_pretrained, device, torch)[0] for name in args.model}
    merger = _llm_merger(args.merge_llm, args.merge_llm_revision, device) if args.merge_llm else None
    document = describe_release_failures(
        args.release, classifiers, lambda images: scorer.encode_images(images).cpu().numpy(), merger=merger
    )
    args.output.mkdir(parents=True, exist_ok=True)
    path = args.output / "discoveries.json"
    path.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    clusters = sum(len(e["clusters"]) for r in document["models"].values() for e in r["classes"])
    sys.stdout.write(f"discover: {clusters} failure cluster(s) described in {path}\n")
    return 0


def run_discover(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    if args.release is not None:
        return run_release_mode(args)
    from builder.cli import resolve_device
    from builder.discovery.report import write_discovery_report
    from builder.discovery.run import Discovery, DiscoverySettings, discovered
    from lance_pipeline.discovery.method import ClusteringSettings

    if args.demo:
        if args.model:
            raise ValueError("--demo probes its own planted stand-in model; drop --model")
        classes = args.classes.split(",") if args.classes else DEMO_CLASSES
    else:
        if not args.model:
            raise ValueError("give at least one --model NAME (a timm model), or --demo for the offline stand-ins")
        if not args.classes:
            raise ValueError("give --classes (ImageNet synsets, indices or names, comma-separated)")
        classes = [c.strip() for c in args.classes.split(",") if c.strip()]
    settings = DiscoverySettings(
        n_base=args.n_base, n_test=args.n_test, alpha=args.alpha, refine=not args.no_refine, seed=args.seed,
        batch_size=args.batch_size, clustering=ClusteringSettings(seed=args.seed),
    )  # fmt: skip
    targets = _targets(classes)
    output: Path = args.output
    if output.exists() and not output.is_dir():
        raise ValueError(f"--output {output} is a file; give a directory")
    device = resolve_device(args.device)
    components = _demo_components(targets) if args.demo else _real_components(args, targets, device)
    if args.merge_llm:
        components.merger = _llm_merger(args.merge_llm, args.merge_llm_revision, device)
    bar = tqdm(unit="img", desc="discover", disable=args.no_progress)
    run = Discovery(output, targets, components, settings, progress=bar)
    try:
        document = run.run()
        names = {t.label: t.name for t in targets}
        from builder import imagenet

        def label_name(label: int) -> str:
            return names.get(label) or imagenet.class_names()[label]

        report = write_discovery_report(document, run.ledger.images, run.ledger.predictions, label_name, output)
    finally:
        bar.close()
        run.close()
    path = output / "discoveries.json"
    tmp = path.with_name(".discoveries.json.tmp")
    tmp.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)
    found = discovered(document)
    sys.stdout.write(f"discover: {len(found)} discovered failure(s); wrote {path} and {report}\n")
    for row in found:
        sys.stdout.write(
            f'  {row["model"]} | {row["class_name"]} + "{row["refined_description"]}": '
            f"{100 * row['rate']:.0f}% fail vs {100 * row['base_rate']:.0f}% base (q={row['q_value']:.2g})\n"
        )
    if found and not args.no_release:
        release = build_discovery_release(output, document)
        sys.stdout.write(
            f"release of the discovered-failure images: {release}\n"
            f"  next: lance-cf verify {release}; lance-cf eval --release {release} --model OTHER_MODEL --output OUT\n"
        )
    return 0
