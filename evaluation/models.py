"""Model selection and construction for evaluation: timm names, wildcards, name files, local weights, class maps.

Names are what timm accepts (``resnet50.a1_in1k``, ``hf-hub:org/repo``); a wildcard (``convnext_*``) expands through
``timm.list_models`` as in timm's validate.py; a path to a text file lists names one a line (``#`` comments).
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lance_pipeline.readers import expect_int, expect_mapping, load_json, read_text

logger = logging.getLogger(__name__)

_WILDCARD_CHARS = ("*", "?", "[")
MAX_SLUG_CHARS = 120


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
        path = Path(spec).expanduser()
        if not spec.startswith("hf-hub:") and path.is_file():
            lines = [ln.split("#", 1)[0].strip() for ln in path.read_text(encoding="utf-8").splitlines()]
            listed = [ln for ln in lines if ln]
            if not listed:
                raise ValueError(f"model list file {spec!r} names no models (expected one timm model name a line)")
            names.extend(expand_model_names(listed, pretrained=pretrained))
        elif not spec.startswith("hf-hub:") and any(c in spec for c in _WILDCARD_CHARS):
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


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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
    checkpoint_sha256: str | None = field(default=None, init=False)
    class_map_sha256: str | None = field(default=None, init=False)

    def __post_init__(self) -> None:
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

    @property
    def weights_id(self) -> str:
        """A string that changes whenever the weights do: used to skip models already evaluated."""
        if self.checkpoint is not None:
            return f"checkpoint:sha256:{self.checkpoint_sha256}"
        return "pretrained" if self.pretrained else f"random:seed={self.seed}"

    @property
    def slug(self) -> str:
        """File-system name of this model's results (distinct for distinct weights).

        timm names stay readable (``resnet50.a1_in1k``; ``hf-hub:org/name`` becomes ``hf-hub--org--name``); any other
        character becomes ``_`` and a short hash of the name is appended so that two names never share a folder.
        """
        readable = self.name.replace("/", "--").replace(":", "--")
        base = re.sub(r"[^A-Za-z0-9_.-]", "_", readable)
        if base != readable or not base or base.startswith("."):
            base = f"{base.lstrip('.')}-{hashlib.sha256(self.name.encode()).hexdigest()[:8]}"
        if len(base) > MAX_SLUG_CHARS:  # file names are bounded (255 bytes on most file systems)
            digest = hashlib.sha256(self.name.encode()).hexdigest()[:12]
            base = f"{base[: MAX_SLUG_CHARS - 13]}-{digest}"
        if self.checkpoint is not None:
            return f"{base}__ckpt-{self.checkpoint_sha256[:12]}"
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


def create_eval_model(spec: ModelSpec) -> Any:
    """Build the timm model for ``spec`` in eval mode, with its weights loaded.

    ``--checkpoint`` weights are loaded with safetensors (strict); when the checkpoint's classifier has another number
    of outputs than the architecture's default, the classifier is reset to that size first.
    """
    import timm
    import torch

    # Random weights come from the seeded generator (and the caller's generator is left as it was): two runs with
    # --no-pretrained score the same model.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = timm.create_model(spec.name, pretrained=spec.pretrained and spec.checkpoint is None)
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
    cfg = dict(getattr(model, "pretrained_cfg", {}) or {})
    return {
        "id": spec.weights_id,
        "source": "checkpoint" if spec.checkpoint is not None else ("pretrained" if spec.pretrained else "random"),
        "pretrained_tag": cfg.get("tag") if spec.pretrained and spec.checkpoint is None else None,
        "hf_hub_id": cfg.get("hf_hub_id") if spec.pretrained and spec.checkpoint is None else None,
        # the file's name only: results are published, and the sha256 identifies the weights
        "checkpoint": spec.checkpoint.name if spec.checkpoint is not None else None,
        "checkpoint_sha256": spec.checkpoint_sha256,
        "seed": spec.seed if spec.checkpoint is None and not spec.pretrained else None,
    }


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
