"""``lance-cf discover``: failure discovery for timm models (Wiles et al.); see ``builder.discovery.run``."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from builder import imagenet
from builder.config import BuildConfig, StageConfig
from builder.discovery.report import write_discovery_report
from builder.discovery.run import LEDGER, Discovery, describe_release_failures
from builder.discovery.source import DiscoverySource
from builder.engine import build
from builder.model_refs import resolve_model_references, restore_model_references
from builder.output_paths import output_problem
from builder.registry import DISCOVERY_DEMOS
from builder.release_format import read_manifest_dict
from builder.release_format.lock import declare_output
from lance_pipeline.clip.gates import ClipScorer
from lance_pipeline.discovery.clustering import ClusteringSettings
from lance_pipeline.discovery.descriptions import LLMCaptionMerger
from lance_pipeline.discovery.search import ClassTarget, DiscoveryComponents, DiscoverySettings, discovered
from lance_pipeline.interfaces.generation import GenerationOptions, ShiftGenerator
from lance_pipeline.models.devices import resolve_device
from lance_pipeline.models.needs import SD_PIPELINE_FILES, TRANSFORMERS_FILES, clip_need, reference_need, timm_need
from lance_pipeline.readers import read_json
from lance_pipeline.release_kinds import kind_of_manifest
from lance_pipeline.text.captioning import DEFAULT_CAPTIONER, DEFAULT_CAPTIONER_REVISION, LabelConditionedCaptioner
from lance_pipeline.text.perturbation import PromptPerturber

DEMO_CLASSES = ["tench", "goldfish"]


def register(subparsers) -> None:
    discover = subparsers.add_parser(
        "discover",
        help="find, in words, where a model fails more than it should (Wiles et al.)",
        description="Generate images of each class, cluster a model's failures (all wrong labels together), caption "
        "and describe each cluster, and test each distinct description on new images against the class's base images "
        "twice: the rate of its target label (the wrong label its failures were given most) and the total failure "
        "rate (one-sided Fisher exact tests, one Benjamini-Hochberg family per model). Discoveries are refined by "
        "dropping words (a corrected family of their own); discoveries.json and report.html are written. Resumable: "
        "re-run the same command. --demo [SCENARIO] runs offline with stand-ins that have a planted failure.",
    )
    discover.add_argument("--model", action="append", metavar="NAME", help="timm model to probe (repeatable)")
    discover.add_argument(
        "--classes", metavar="LIST", help="ImageNet classes: synsets, indices or names, comma-separated"
    )
    discover.add_argument("--output", "-o", required=True, type=Path, help="output directory (created if missing)")
    discover.add_argument("--n-base", type=int, default=200, metavar="N", help="base images per class (default 200)")
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
    discover.add_argument(
        "--demo",
        nargs="?",
        const="planted-red",
        metavar="SCENARIO",
        help="offline stand-ins with a planted failure, one of: "
        f"{', '.join(DISCOVERY_DEMOS.in_order())} (default planted-red; docs/discovery.md)",
    )
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
    discover.set_defaults(func=run_discover, models=_declared_models, check=_check_arguments)
    declare_output(discover, "discover", lambda args: args.output)


@functools.cache
def imagenet_superclasses() -> dict[str, str]:
    """synset -> direct WordNet hypernym (package data; provenance in the file's ``about``)."""
    text = (resources.files("builder") / "imagenet_superclasses.json").read_text(encoding="utf-8")
    return json.loads(text)["superclasses"]


def _targets(classes: list[str]):

    targets = []
    for spec in classes:
        index = imagenet.resolve_class(spec)
        synset = imagenet.synsets()[index]
        targets.append(ClassTarget(index, imagenet.class_names()[index], imagenet_superclasses()[synset], synset))
    return targets


def _demo_components(scenario: str, targets) -> Any:
    """The stand-ins of a registered demo scenario (``builder.registry.DISCOVERY_DEMOS``), on the run's classes."""

    DISCOVERY_DEMOS.target(scenario)  # a registered name only (one line with "did you mean" otherwise)
    return DISCOVERY_DEMOS.resolve(scenario)([t.name for t in targets], [t.label for t in targets])


class _Described:
    """A component whose ``describe()`` names models by reference (``demo:NAME``), never by a local path."""

    def __init__(self, inner: Any, references: dict[str, str]) -> None:
        self._inner, self._references = inner, references

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def describe(self) -> dict[str, Any]:

        return restore_model_references(self._inner.describe(), self._references)


def _check_arguments(args: argparse.Namespace) -> None:
    """A bad option or output path, before the models are looked for (builder.cli): it is cheaper to fix first."""
    if args.release is not None:
        check_release_arguments(args)
    else:
        check_generation_arguments(args)


def _declared_models(args: argparse.Namespace) -> list:
    """What ``discover`` will load (checked before it starts; ``--demo`` builds its stand-ins locally): the
    generator, captioner, CLIP, the merging LLM if any, and each classifier's pretrained weights."""
    if args.demo:
        return []  # the stand-ins are built locally
    needs = [clip_need(args.clip_model, args.clip_pretrained, used_by="discover", key="--clip-model")]
    if args.release is None:
        given = {"model": args.generator, "revision": args.generator_revision} if args.generator else {}
        generator = GenerationOptions(plain_prompt=True, **given)
        needs.append(reference_need(generator.model, files=SD_PIPELINE_FILES, revision=generator.revision,
                                    used_by="discover", key="--generator", role="Stable Diffusion"))  # fmt: skip
        captioner = (args.captioner, None) if args.captioner else (DEFAULT_CAPTIONER, DEFAULT_CAPTIONER_REVISION)
        needs.append(reference_need(captioner[0], files=TRANSFORMERS_FILES, revision=captioner[1],
                                    used_by="discover", key="--captioner", role="captioner"))  # fmt: skip
    if args.merge_llm:
        needs.append(reference_need(args.merge_llm, files=TRANSFORMERS_FILES, revision=args.merge_llm_revision,
                                    used_by="discover", key="--merge-llm", role="merging LLM"))  # fmt: skip
    if not args.no_pretrained:
        needs += [timm_need(name, used_by="discover", key="--model") for name in args.model or []]
    return [n for n in needs if n is not None]


def _real_components(args: argparse.Namespace, targets, device: str) -> Any:
    """The real components, constructed but not loaded: ``components.load()`` loads them (after every check)."""

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
    captioning = {"model": resolved["captioner"], "revision": None} if args.captioner else {}
    captioner = LabelConditionedCaptioner(**captioning)
    clip_local = resolved["clip"] != args.clip_model
    scorer = ClipScorer(model=resolved["clip"], pretrained=None if clip_local else args.clip_pretrained)
    classifiers = {name: TimmClassifier(name, not args.no_pretrained, device) for name in args.model}
    return DiscoveryComponents(
        generator=_Described(generator, references),
        classifiers=classifiers,
        captioner=_Described(captioner, references),
        embedder=lambda images: scorer.encode_images(images).cpu().numpy(),
        classifier_info={name: c.info for name, c in classifiers.items()},
        loaders=[generator.load, lambda: captioner.load(device), lambda: scorer.load(device),
                 *(c.load for c in classifiers.values())],
    )  # fmt: skip


class TimmClassifier:
    """A timm model as a callable(list[PIL]) -> predicted labels; ``load()`` creates it (``info`` says how)."""

    def __init__(self, name: str, pretrained: bool, device: str) -> None:
        self.name, self.pretrained, self.device = name, pretrained, device
        self.info: dict[str, Any] = {"pretrained": pretrained}
        self.model = self.transform = None

    def load(self) -> None:
        import timm

        self.model = timm.create_model(self.name, pretrained=self.pretrained).eval().to(self.device)
        config = timm.data.resolve_data_config({}, model=self.model)
        self.transform = timm.data.create_transform(**config)
        self.info["data_config"] = {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}

    def __call__(self, images: list[Any]) -> list[int]:
        import torch

        with torch.no_grad():
            batch = torch.stack([self.transform(im.convert("RGB")) for im in images]).to(self.device)
            return self.model(batch).argmax(dim=1).tolist()


def _llm_merger(model: str, revision: str | None, device: str) -> tuple[Any, Any]:
    """(merger, its loader): the LLM merge is constructed here and loaded with the other models."""
    resolved, _ = resolve_model_references({"model": model})  # demo:/pkg: references, as in build configs
    perturber = PromptPerturber(model=resolved["model"], revision=revision, max_new_tokens=24)
    return LLMCaptionMerger(perturber), lambda: perturber.load(device)


def build_discovery_release(output: Path, document: dict[str, Any]) -> Path:
    """Build ``OUTPUT/release``: one config per discovered failure, through the normal builder (``discovery:``)."""
    # The builder's engine and config (about 1 s of imports) only when there is a release to build.

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
    # Every generated image passes Stable Diffusion's safety checker before a shard is written (the stand-ins of the
    # demo: the tiny random checker, as the demo presets).
    demo = bool(document["generator"].get("stand_in"))
    # (a real run: the stage's default, the pinned CompVis checker, which the build checks before it loads anything)
    checker = {"model": "demo:tiny-safety-checker"} if demo else {}
    safety = StageConfig(name="safety", type="safety_check_discovery", configs=list(configs), options=checker)
    config = BuildConfig(
        name="discovered-failures", version="1.0.0", description=description, seed=document["settings"]["seed"],
        source=spec, configs=configs, image_size=None, stages=[safety],
    )  # fmt: skip
    release = output / "release"
    build(config, release, progress=False, device="cpu")
    return release


def check_output_directory(output: Path) -> None:
    """``--output`` must be a directory or creatable as one: one line otherwise, before anything runs."""
    problem = output_problem(output)
    if problem:
        raise ValueError(problem)


def _check_options(args: argparse.Namespace) -> None:
    """Numeric options that the models would only meet after loading: checked first, one line each."""
    if args.image_size is not None and not (8 <= args.image_size <= 4096 and args.image_size % 8 == 0):
        raise ValueError(f"--image-size {args.image_size}: expected a multiple of 8 from 8 to 4096 (e.g. 512)")
    if not 1 <= args.steps <= 1000:
        raise ValueError(f"--steps {args.steps}: expected 1 to 1000 sampling steps (default 50)")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size {args.batch_size}: expected a positive integer")


def check_release_arguments(args: argparse.Namespace) -> None:
    """``--release`` mode's options and paths, checked before any model is checked or loaded (one line each)."""
    if not args.model:
        raise ValueError("give at least one --model NAME (a timm model) to probe the release with")
    if args.demo:
        raise ValueError("--demo generates its own images; drop --release (or --demo)")
    if not (args.release / "manifest.json").is_file():
        raise ValueError(f"--release {args.release}: not a release directory (no manifest.json)")
    check_output_directory(args.output)
    if (args.output / LEDGER).exists():
        raise ValueError(f"--output {args.output}: holds a generating discovery; give a new --output directory")
    path = args.output / "discoveries.json"
    if path.is_file():
        try:
            previous = read_json(path)
        except (ValueError, OSError):
            previous = {}  # unreadable: not a discovery this command may replace
        same = previous.get("release", {}).get("manifest_sha256") == read_manifest_dict(args.release)[
            "manifest_sha256"] and sorted(previous.get("models", {})) == sorted(args.model)  # fmt: skip
        if not same:
            raise ValueError(
                f"--output {args.output}: holds the discoveries of another release or other models; give a new "
                "--output directory"
            )


def check_generation_arguments(args: argparse.Namespace) -> tuple[list[ClassTarget], DiscoverySettings]:
    """The generating mode's options and paths, checked before any model is checked or loaded (one line each);
    returns the resolved classes and the settings."""
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
    _check_options(args)
    settings = DiscoverySettings(
        n_base=args.n_base, n_test=args.n_test, alpha=args.alpha, refine=not args.no_refine, seed=args.seed,
        batch_size=args.batch_size, clustering=ClusteringSettings(seed=args.seed),
    )  # fmt: skip
    targets = _targets(classes)
    check_output_directory(args.output)
    if (args.output / "discoveries.json").is_file() and not (args.output / LEDGER).exists():
        raise ValueError(f"--output {args.output}: holds the discoveries of a release (--release); give a new --output")
    if args.demo:
        DISCOVERY_DEMOS.target(args.demo)  # a registered name only (one line with "did you mean" otherwise)
    return targets, settings


def run_release_mode(args: argparse.Namespace) -> int:
    """``discover --release DIR``: cluster and describe each model's failing counterfactuals of a release."""

    check_release_arguments(args)  # 1. every option and path, before any model loads
    device = resolve_device(args.device)
    resolved, _ = resolve_model_references({"clip": args.clip_model})
    pretrained = None if resolved["clip"] != args.clip_model else args.clip_pretrained
    scorer = ClipScorer(model=resolved["clip"], pretrained=pretrained)
    classifiers = {name: TimmClassifier(name, not args.no_pretrained, device) for name in args.model}
    merger, load_merger = (
        _llm_merger(args.merge_llm, args.merge_llm_revision, device) if args.merge_llm else (None, None)
    )
    # 2. the models
    scorer.load(device)
    for classifier in classifiers.values():
        classifier.load()
    if load_merger is not None:
        load_merger()
    document = describe_release_failures(
        args.release, classifiers, lambda images: scorer.encode_images(images).cpu().numpy(), merger=merger
    )
    args.output.mkdir(parents=True, exist_ok=True)
    path = args.output / "discoveries.json"
    tmp = path.with_name(".discoveries.json.tmp")
    tmp.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)
    clusters = sum(len(e["clusters"]) for r in document["models"].values() for e in r["classes"])
    sys.stdout.write(f"discover: {clusters} failure cluster(s) described in {path}\n")
    return 0


def _summary_line(row: dict[str, Any], label_name: Any) -> str:
    by = " and ".join({"target_label": "target label", "total": "total"}[k] for k in row["discovered_by"])
    return (
        f'  {row["model"]} | {row["class_name"]} + "{row["refined_description"]}" (by the {by} test): '
        f"-> {label_name(row['target_label'])} {100 * row['target_rate']:.0f}% vs {100 * row['target_base_rate']:.0f}% "
        f"base (q={row['target_q_value']:.2g}); all wrong {100 * row['rate']:.0f}% vs {100 * row['base_rate']:.0f}% "
        f"base (q={row['q_value']:.2g})\n"
    )


def run_discover(args: argparse.Namespace) -> int:
    if args.release is not None:
        return run_release_mode(args)
    from tqdm.auto import tqdm

    # 1. every option and path, before any model loads (Discovery then checks the output's settings, then loads)
    targets, settings = check_generation_arguments(args)
    output: Path = args.output
    device = resolve_device(args.device)
    components = _demo_components(args.demo, targets) if args.demo else _real_components(args, targets, device)
    if args.merge_llm:
        components.merger, load_merger = _llm_merger(args.merge_llm, args.merge_llm_revision, device)
        components.loaders.append(load_merger)
    bar = tqdm(unit="img", desc="discover", disable=args.no_progress)
    try:
        run = Discovery(output, targets, components, settings, progress=bar)  # 2. the models load here
    except BaseException:
        bar.close()
        raise
    try:
        document = run.run()
        names = {t.label: t.name for t in targets}

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
        sys.stdout.write(_summary_line(row, label_name))
    if found and not args.no_release:
        release = build_discovery_release(output, document)
        manifest = read_manifest_dict(release)
        lines = kind_of_manifest(manifest).next_lines(str(release), manifest)
        sys.stdout.write(
            f"release of the discovered-failure images: {release}\nnext:\n" + "".join(f"  {line}\n" for line in lines)
        )
    return 0
