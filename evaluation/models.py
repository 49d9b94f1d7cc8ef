"""Model selection and construction for evaluation: timm names, wildcards, name files, local weights, class maps, and
zero-shot CLIP classifiers (``open_clip:...``, built by ``evaluation.zero_shot``).

Names are what timm accepts (``resnet50.a1_in1k``, ``hf-hub:org/repo``, ``local-dir:DIR``); a wildcard
(``convnext_*``) expands through ``timm.list_models`` as in timm's validate.py; a path to a text file lists names one a
line (``#`` comments). A local directory (timm's ``local-dir:`` schema: ``config.json`` and ``model.safetensors``, as
``timm.models.save_for_hf(model, DIR, safe_serialization=True)`` writes them) is the way to score a model without the
Hub; in every output it is named by its folder name and the digest of its files, never by its path on this machine.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lance_pipeline.models.hub_cache import file_sha256
from lance_pipeline.readers import expect_int, expect_mapping, load_json, read_text

logger = logging.getLogger(__name__)

_WILDCARD_CHARS = ("*", "?", "[")
MAX_SLUG_CHARS = 120
LOCAL_DIR = "local-dir:"  # timm's (and open_clip's) schema for a model in a local directory
LOCAL_DIR_FILES = ("config.json", "model.safetensors")  # what timm reads of one (safetensors only: no pickle)

# What works without the Hub for `lance-cf eval`: said by every offline failure of its models (builder.model_check).
EVAL_OFFLINE_WAYS = (
    "without the Hub: --model local-dir:DIR (a folder with config.json and model.safetensors, e.g. saved where the "
    "Hub answers by timm.models.save_for_hf(model, DIR, safe_serialization=True)), --model ARCH --checkpoint "
    "FILE.safetensors (your own weights), or --model ARCH --no-pretrained (random weights: the path works, the "
    "scores mean nothing)"
)


def expand_model_names(specs: list[str], pretrained: bool = True) -> list[str]:
    """Expand model specs into timm model names, in order and without duplicates.

    Args:
        specs: model names, wildcards or paths to text files listing names.
        pretrained: when true, wildcards match only names with pretrained weights (timm validate.py behaviour);
            with ``--no-pretrained`` every architecture matches.

    Raises:
        ValueError: for an empty spec list, or a wildcard or file that yields no names.
    """
    import timm

    if not specs:
        raise ValueError("no --model given; expected at least one timm model name, wildcard or file of names")
    names: list[str] = []
    for spec in specs:
        spec = spec.strip()
        if spec.startswith("open_clip:"):  # a zero-shot CLIP reference (evaluation.zero_shot), never a timm name
            names.append(spec)
            continue
        path = Path(spec).expanduser()
        if not spec.startswith("hf-hub:") and path.is_file():
            lines = [ln.split("#", 1)[0].strip() for ln in path.read_text(encoding="utf-8").splitlines()]
            listed = [ln for ln in lines if ln]
            if not listed:
                raise ValueError(f"model list file {spec!r} names no models (expected one timm model name a line)")
            names.extend(expand_model_names(listed, pretrained=pretrained))
        elif not spec.startswith(("hf-hub:", LOCAL_DIR)) and any(c in spec for c in _WILDCARD_CHARS):
            matched = timm.list_models(spec, pretrained=pretrained)
            if not matched:
                raise ValueError(
                    f"model wildcard {spec!r} matches no timm model"
                    + (" with pretrained weights (add --no-pretrained to match architectures)" if pretrained else "")
                )
            names.extend(matched)
        elif spec:
            names.append(spec)
    return list(dict.fromkeys(names))


def local_dir_digest(folder: Path, names: tuple[str, ...]) -> str:
    """sha256 over the named files of a model folder (each file's name and sha256, in order): the same weights and
    config give the same digest wherever the folder lies."""
    digest = hashlib.sha256()
    for name in names:
        digest.update(f"{name}\0{file_sha256(folder / name)}\n".encode())
    return digest.hexdigest()


def public_model_name(reference: str) -> str:
    """A model reference as outputs show it: a local directory (``local-dir:DIR`` or a path) by its folder name only,
    so no results file, report or folder name carries a path of this machine; names pass through."""
    path = reference[len(LOCAL_DIR) :] if reference.startswith(LOCAL_DIR) else None
    if path is None and (reference.startswith(("/", ".", "~")) or Path(reference).expanduser().is_dir()):
        path = reference
    if path is None:
        return reference
    return LOCAL_DIR + (Path(path).expanduser().resolve().name or "model")


@dataclass
class ModelSpec:
    """One model to evaluate: its name and where its weights come from."""

    name: str
    pretrained: bool = True
    checkpoint: Path | None = None
    class_map: Path | None = None
    # Seeds the initialisation of random weights (--no-pretrained), so that a run is reproducible and a re-run that
    # skips existing results skips the same weights.
    seed: int = 0
    # zero-shot models (``open_clip:...``): the prompt template set (evaluation.zero_shot.TemplateSet)
    templates: Any = None
    checkpoint_sha256: str | None = field(default=None, init=False)
    class_map_sha256: str | None = field(default=None, init=False)
    # A ``local-dir:DIR`` model: ``name`` becomes ``local-dir:FOLDER`` (what outputs show); timm gets the path
    local_dir: Path | None = field(default=None, init=False)
    local_dir_sha256: str | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.name.startswith(LOCAL_DIR):
            self._check_local_dir()
        if self.zero_shot:
            from evaluation.zero_shot import DEFAULT_TEMPLATES, load_template_set, parse_reference

            model, tag = parse_reference(self.name)  # a malformed reference is one line before anything runs
            if tag is None and not model.startswith("hf-hub:"):
                self._digest_open_clip_dir(Path(model.removeprefix(LOCAL_DIR)))
            if self.checkpoint is not None or self.class_map is not None:
                raise ValueError(
                    f"--model {self.name!r} is a zero-shot classifier over the release's own classes: --checkpoint "
                    "and --class-map do not apply (open_clip:DIR loads local weights)"
                )
            if self.templates is None:
                self.templates = load_template_set(DEFAULT_TEMPLATES)
        elif self.templates is not None:
            raise ValueError(f"--templates applies to zero-shot models (open_clip:...), not to {self.name!r}")
        if self.checkpoint is not None:
            self.checkpoint = Path(self.checkpoint)
            if self.checkpoint.suffix != ".safetensors":
                raise ValueError(
                    f"--checkpoint {str(self.checkpoint)!r} is not a .safetensors file; only safetensors weights are "
                    "loaded (no pickle)"
                )
            if not self.checkpoint.is_file():
                raise ValueError(f"--checkpoint {str(self.checkpoint)!r} does not exist")
            self.checkpoint_sha256 = file_sha256(self.checkpoint)
        if self.class_map is not None:
            self.class_map = Path(self.class_map)
            if not self.class_map.is_file():
                raise ValueError(f"--class-map {str(self.class_map)!r} does not exist")
            self.class_map_sha256 = file_sha256(self.class_map)

    def _check_local_dir(self) -> None:
        given = self.name[len(LOCAL_DIR) :]
        folder = Path(given).expanduser()
        if not folder.is_dir():
            raise ValueError(
                f"--model {self.name!r}: {given!r} is not a directory (local-dir:DIR names a model folder)"
            )
        missing = [n for n in LOCAL_DIR_FILES if not (folder / n).is_file()]
        if missing:
            pickle = any(folder.glob("*.bin")) or any(folder.glob("*.pth"))
            raise ValueError(
                f"--model {self.name!r} has no {' or '.join(missing)}"
                + (" (its weights are pickle files, which are never loaded)" if pickle else "")
                + "; save the model with timm.models.save_for_hf(model, DIR, safe_serialization=True)"
            )
        if self.checkpoint is not None or not self.pretrained:
            raise ValueError(
                f"--model {self.name!r} brings its own weights; leave out --checkpoint and --no-pretrained"
            )
        self.local_dir = folder.resolve()
        self.local_dir_sha256 = local_dir_digest(self.local_dir, LOCAL_DIR_FILES)
        self.name = public_model_name(self.name)

    def _digest_open_clip_dir(self, folder: Path) -> None:
        """An ``open_clip:DIR`` model is identified by its files' digest (config and safetensors weights), so new
        weights in the same folder are a new result, never skipped as already evaluated."""
        from lance_pipeline.clip.loader import CONFIG_NAME

        weights = sorted(p.name for p in folder.glob("*.safetensors") if p.is_file())
        if not (folder / CONFIG_NAME).is_file() or not weights:
            raise ValueError(
                f"--model {self.name!r}: {str(folder)!r} needs {CONFIG_NAME} and .safetensors weights (open_clip's "
                "local layout; pickle checkpoints are never loaded)"
            )
        self.local_dir_sha256 = local_dir_digest(folder, (CONFIG_NAME, *weights))

    @property
    def timm_name(self) -> str:
        """The name ``timm.create_model`` gets (a local directory's path; ``name`` has only its folder name)."""
        return f"{LOCAL_DIR}{self.local_dir}" if self.local_dir is not None else self.name

    @property
    def zero_shot(self) -> bool:
        return self.name.startswith("open_clip:")

    @property
    def result_name(self) -> str:
        """The name results record (a local directory reduced to its last component)."""
        if self.zero_shot:
            from evaluation.zero_shot import display_name

            return display_name(self.name)
        return self.name

    @property
    def weights_id(self) -> str:
        """A string that changes whenever the weights do: used to skip models already evaluated."""
        if self.local_dir_sha256 is not None:  # local-dir:DIR, or open_clip:DIR
            return f"local-dir:sha256:{self.local_dir_sha256}"
        if self.checkpoint is not None:
            return f"checkpoint:sha256:{self.checkpoint_sha256}"
        return "pretrained" if self.pretrained else f"random:seed={self.seed}"

    @property
    def slug(self) -> str:
        """File-system name of this model's results (distinct for distinct weights).

        timm names stay readable (``resnet50.a1_in1k``; ``hf-hub:org/name`` becomes ``hf-hub--org--name``); any other
        character becomes ``_`` and a short hash of the name is appended so that two names never share a folder.
        """
        name = self.result_name
        readable = name.replace("/", "--").replace(":", "--")
        base = re.sub(r"[^A-Za-z0-9_.-]", "_", readable)
        if base != readable or not base or base.startswith(".") or name != self.name:
            base = f"{base.lstrip('.')}-{hashlib.sha256(self.name.encode()).hexdigest()[:8]}"
        if self.templates is not None:  # one folder per template set: the same model with two sets is two results
            base = f"{base}__tpl-{self.templates.slug}"
        if len(base) > MAX_SLUG_CHARS:  # file names are bounded (255 bytes on most file systems)
            digest = hashlib.sha256(self.name.encode()).hexdigest()[:12]
            base = f"{base[: MAX_SLUG_CHARS - 13]}-{digest}"
        if self.checkpoint is not None:
            return f"{base}__ckpt-{self.checkpoint_sha256[:12]}"
        if self.local_dir_sha256 is not None:
            return f"{base}__sha-{self.local_dir_sha256[:12]}"
        return base if self.pretrained else f"{base}__random"


def load_class_map(path: Path, num_release_classes: int) -> list[int]:
    """Read a class map: for each release label (in order), the model output index that scores it.

    Formats: a text file with one integer a line (line ``i`` is the model index of release label ``i``), or a JSON
    object ``{"<release label>": <model index>, ...}`` covering every release label.
    """
    where = f"class map {str(path)!r}"
    text = read_text(path, what=where)
    if Path(path).suffix == ".json":
        raw = expect_mapping(load_json(text, where), where)
        mapping = {}
        for label, index in raw.items():
            # "1" and "01" would name one label twice; 1.0 and true are not indices (no coercion)
            if not re.fullmatch(r"0|[1-9][0-9]*", label) or int(label) >= num_release_classes:
                raise ValueError(
                    f"{where}: key {label!r} is not a release label (0 to {num_release_classes - 1}, written plainly)"
                )
            mapping[int(label)] = expect_int(index, f"{where}: label {label}", minimum=0)
        missing = [i for i in range(num_release_classes) if i not in mapping]
        if missing:
            raise ValueError(f"{where} has no model index for release labels {missing[:10]}")
        return [mapping[i] for i in range(num_release_classes)]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    if len(lines) != num_release_classes:
        raise ValueError(
            f"class map {str(path)!r} has {len(lines)} lines; expected one model index for each of the "
            f"{num_release_classes} release labels"
        )
    bad = [(i, ln) for i, ln in enumerate(lines) if not re.fullmatch(r"[0-9]+", ln)]
    if bad:
        raise ValueError(
            f"class map {str(path)!r}: entry {bad[0][0]} ({bad[0][1]!r}) is not a model output index (a non-negative "
            "integer); line i holds the model index of release label i"
        )
    return [int(ln) for ln in lines]


def create_eval_model(spec: ModelSpec, release: Any = None) -> Any:
    """Build the timm model for ``spec`` in eval mode, with its weights loaded.

    A zero-shot reference (``open_clip:...``) becomes a logits module over ``release``'s classes
    (``evaluation.zero_shot``); everything downstream treats it like a timm model. ``--checkpoint`` weights are loaded with safetensors (strict); when the checkpoint's classifier has another number
    of outputs than the architecture's default, the classifier is reset to that size first.
    """
    import timm
    import torch

    if spec.zero_shot:
        from evaluation.zero_shot import create_zero_shot_model

        if release is None:
            raise ValueError(f"{spec.name}: a zero-shot classifier needs the release's class names")
        space = (release.manifest.get("label_space") or {}).get("name")
        return create_zero_shot_model(
            spec.name, spec.templates, release.label_names, space, pretrained=spec.pretrained, seed=spec.seed
        )
    # Random weights come from the seeded generator (and the caller's generator is left as it was): two runs with
    # --no-pretrained score the same model.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = timm.create_model(spec.timm_name, pretrained=spec.pretrained and spec.checkpoint is None)
    if spec.checkpoint is not None:
        from safetensors.torch import load_file

        state = load_file(str(spec.checkpoint))
        classifier = model.pretrained_cfg.get("classifier")
        if isinstance(classifier, (list, tuple)):
            classifier = classifier[0]
        weight = state.get(f"{classifier}.weight") if classifier else None
        if weight is not None and weight.shape[0] != model.num_classes:
            logger.info("%s: checkpoint classifier has %d outputs; resetting the head", spec.name, weight.shape[0])
            model.reset_classifier(weight.shape[0])
        model.load_state_dict(state, strict=True)
    return model.eval()


def describe_weights(spec: ModelSpec, model: Any) -> dict[str, Any]:
    if spec.zero_shot:
        clip = model.zero_shot_info["clip"]
        return {
            "id": spec.weights_id,
            "source": "pretrained" if spec.pretrained else "random",
            "pretrained_tag": clip.get("pretrained"),
            "hf_hub_id": clip["model"][len("hf-hub:") :] if str(clip.get("model")).startswith("hf-hub:") else None,
            "checkpoint": None,
            "checkpoint_sha256": clip.get("weights_sha256"),
            "seed": None if spec.pretrained else spec.seed,
        }
    cfg = dict(getattr(model, "pretrained_cfg", {}) or {})
    hub = spec.pretrained and spec.checkpoint is None and spec.local_dir is None
    if spec.local_dir is not None:
        source = "local-dir"
    else:
        source = "checkpoint" if spec.checkpoint is not None else ("pretrained" if spec.pretrained else "random")
    described = {
        "id": spec.weights_id,
        "source": source,
        "pretrained_tag": cfg.get("tag") if hub else None,
        "hf_hub_id": cfg.get("hf_hub_id") if hub else None,
        # the file's name only: results are published, and the sha256 identifies the weights
        "checkpoint": spec.checkpoint.name if spec.checkpoint is not None else None,
        "checkpoint_sha256": spec.checkpoint_sha256,
        "seed": spec.seed if spec.checkpoint is None and not spec.pretrained else None,
    }
    if spec.local_dir is not None:  # the folder's name only, as for a checkpoint; the digest identifies it
        described["local_dir"] = spec.local_dir.name
        described["local_dir_sha256"] = spec.local_dir_sha256
    return described


def resolve_label_indices(spec: ModelSpec, model_num_classes: int, release_num_classes: int | None) -> list[int] | None:
    """The model output indices that score the release labels, or ``None`` when the label spaces already agree.

    Raises:
        ValueError: when the model's label space is not the release's and no class map was given.
    """
    if spec.class_map is not None:
        if release_num_classes is None:
            raise ValueError("the release manifest declares no label_space; a --class-map cannot be applied")
        indices = load_class_map(spec.class_map, release_num_classes)
        bad = [i for i in indices if not 0 <= i < model_num_classes]
        if bad:
            raise ValueError(
                f"class map {str(spec.class_map)!r} names model indices {bad[:10]} outside the model's "
                f"{model_num_classes} outputs"
            )
        return indices
    if release_num_classes is not None and model_num_classes != release_num_classes:
        raise ValueError(
            f"model {spec.name!r} has {model_num_classes} output classes but the release's label space has "
            f"{release_num_classes}; pass --class-map FILE (one model output index per release label) to score it"
        )
    return None
