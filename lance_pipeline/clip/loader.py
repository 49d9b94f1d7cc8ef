"""The one CLIP loader of the project: quality gates, LANCE-R's word check and the evaluation insights use it.

CLIP (Radford et al., ICML 2021) is loaded through open_clip (Cherti et al., CVPR 2023). A model reference is one of

* a built-in open_clip architecture name with a pretrained tag (default ``"ViT-L-14"`` + ``"openai"``, the
  authors' model; OpenAI's ``"ViT-L/14"`` spelling is accepted);
* ``"hf-hub:ORG/NAME"`` with an optional pinned ``revision``: the snapshot (config, safetensors and tokenizer files
  only, never pickle) is fetched with ``huggingface_hub.snapshot_download`` and loaded as a local directory;
* a local directory (or ``"local-dir:DIR"``) holding ``open_clip_config.json`` and safetensors weights, e.g. the
  one written by ``tiny_clip_components.create_tiny_open_clip``.

Every form ends in the same call, ``open_clip.create_model_from_pretrained`` (safetensors, or
``torch.load(weights_only=True)`` for built-in tags whose Hub file is not safetensors).

**The QuickGELU rule lives here and only here** (``needs_forced_quick_gelu``): OpenAI's weights were trained with
QuickGELU, but open_clip 3.x builds e.g. ``ViT-L-14`` with plain GELU and only warns ("QuickGELU mismatch"); the
loader switches QuickGELU on whenever the pretrained tag's config says the weights need it and the architecture's
config does not already have it. Directories and Hub snapshots carry their own config, which says ``quick_gelu``.

Loaded copies are shared: references to the same weights on the same device get the same ``LoadedClip`` while any
holder keeps it alive (a weak-value map, so nothing stays in memory once the last stage lets go).
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import os
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lance_pipeline.models.needs import OPEN_CLIP_HUB_FILES

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "ViT-L-14"
DEFAULT_PRETRAINED = "openai"
LOCAL_DIR_PREFIX = "local-dir:"  # open_clip.factory.LOCAL_DIR_PREFIX
HF_HUB_PREFIX = "hf-hub:"  # open_clip.factory.HF_HUB_PREFIX
CONFIG_NAME = "open_clip_config.json"  # open_clip.constants.HF_CONFIG_NAME
# What a Hub snapshot needs for open_clip's local-dir loader (declared once, with the models' other needs): config,
# safetensors weights, and the files of an optional Hugging Face tokenizer. Pickle checkpoints are never fetched.
HUB_ALLOW_PATTERNS = list(OPEN_CLIP_HUB_FILES)


def needs_forced_quick_gelu(name: str, pretrained: str | None) -> bool:
    """Whether open_clip must be told ``force_quick_gelu=True`` for built-in ``name`` with tag ``pretrained``.

    True when the tag's weights were trained with QuickGELU (OpenAI's) and the architecture's own config does not
    already say so (``ViT-L-14`` does not; ``ViT-L-14-quickgelu`` does).
    """
    import open_clip

    if not pretrained:
        return False
    tag_cfg = open_clip.get_pretrained_cfg(name, pretrained) or {}
    model_cfg = open_clip.get_model_config(name) or {}
    return bool(tag_cfg.get("quick_gelu", False)) and not model_cfg.get("quick_gelu", False)


@dataclass(eq=False)
class LoadedClip:
    """A loaded open_clip model (eval mode, on ``device``), its image preprocessing and tokenizer.

    Attributes:
        model: The ``open_clip`` model.
        preprocess: PIL image -> normalised tensor.
        tokenizer: list of str -> token tensor.
        device: Where the model lives.
        info: ``weights_sha256``, ``revision``, ``quick_gelu`` (whether the built model has QuickGELU activations),
            ``embed_dim``, ``image_size``, ``context_length``.
    """

    model: Any
    preprocess: Any
    tokenizer: Any
    device: str
    info: dict[str, Any] = field(default_factory=dict)


_SHARED: weakref.WeakValueDictionary[tuple, LoadedClip] = weakref.WeakValueDictionary()
_SHARED_LOCK = threading.Lock()


class ClipModelRef:
    """A validated CLIP model reference (see the module docstring); nothing is loaded until ``load(device)``.

    Args:
        model: Built-in name, ``hf-hub:`` id or local directory.
        pretrained: Pretrained tag (or a ``.safetensors`` file) for a built-in name. Not used for ``hf-hub:`` ids and
            directories, whose weights come from the repository/directory itself (the default tag is tolerated).
        revision: Hub revision (branch, tag or commit) for an ``hf-hub:`` id.
        cache_dir: Hugging Face cache directory (default: the hub's own).

    Raises:
        ValueError: A reference that cannot name a model, with the fix (e.g. "did you mean").
    """

    def __init__(
        self,
        model: str | os.PathLike = DEFAULT_MODEL,
        pretrained: str | None = DEFAULT_PRETRAINED,
        revision: str | None = None,
        cache_dir: str | None = None,
    ) -> None:
        if not isinstance(model, (str, os.PathLike)) or not str(model).strip():
            raise ValueError(f"model must be an open_clip model name, an 'hf-hub:' id or a directory, got {model!r}")
        model = os.fspath(model)
        self.model = model
        self.revision = revision
        self.cache_dir = cache_dir
        self.pretrained: str | None = None
        if model.startswith(LOCAL_DIR_PREFIX) or os.path.isdir(model):
            self.source = "local-dir"
            self.location = model[len(LOCAL_DIR_PREFIX) :] if model.startswith(LOCAL_DIR_PREFIX) else model
            self._check_no_tag(pretrained)
            self._check_no_revision(revision)
        elif model.startswith(HF_HUB_PREFIX):
            self.source = "hf-hub"
            self.location = model[len(HF_HUB_PREFIX) :]
            if self.location.count("/") != 1 or not all(self.location.split("/")):
                raise ValueError(f"model {model!r}: expected 'hf-hub:ORG/NAME'")
            self._check_no_tag(pretrained)
        else:
            self.source = "builtin"
            self.location = self._check_builtin(model, pretrained)
            self._check_no_revision(revision)
            self.pretrained = pretrained

    def _check_no_tag(self, pretrained: str | None) -> None:
        # The default tag belongs to the default model; any other tag with a directory/hub id is a mistake.
        if pretrained not in (None, DEFAULT_PRETRAINED):
            raise ValueError(
                f"pretrained={pretrained!r} cannot be used with model {self.model!r}: directories and 'hf-hub:' "
                "ids carry their own weights; pass pretrained=None"
            )

    def _check_no_revision(self, revision: str | None) -> None:
        if revision is not None:
            raise ValueError(
                f"revision={revision!r} only applies to 'hf-hub:' ids, not to model {self.model!r} "
                "(open_clip resolves built-in pretrained tags itself)"
            )

    @staticmethod
    def _check_builtin(model: str, pretrained: str | None) -> str:
        """Validate a built-in name and its tag; returns open_clip's spelling ("ViT-L/14" -> "ViT-L-14")."""
        import open_clip

        known = open_clip.list_models()
        if model.replace("/", "-") in known:
            model = model.replace("/", "-")
        elif os.sep in model or "/" in model or model.startswith("."):
            raise ValueError(
                f"model directory not found: {model!r} (expected an existing directory, an 'hf-hub:ORG/NAME' id "
                "or a built-in open_clip name)"
            )
        else:
            close = difflib.get_close_matches(model, known, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(
                f"unknown open_clip model {model!r}: expected a built-in name (open_clip.list_models()), "
                f"an 'hf-hub:ORG/NAME' id or an existing directory{hint}"
            )
        if pretrained is None:
            raise ValueError(f"model {model!r} needs a pretrained tag (e.g. {DEFAULT_PRETRAINED!r}); got None")
        tags = open_clip.list_pretrained_tags_by_model(model)
        if pretrained in tags or (pretrained.endswith(".safetensors") and os.path.isfile(pretrained)):
            return model
        close = difflib.get_close_matches(pretrained, tags, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(
            f"unknown pretrained tag {pretrained!r} for open_clip model {model!r}: expected one of {tags} "
            f"or a .safetensors file{hint}"
        )

    def resolve(self) -> tuple[str, str | None, bool, str | None]:
        """``(open_clip model name, pretrained, force_quick_gelu, resolved revision)`` for ``create_model*``.

        For an ``hf-hub:`` id this downloads the snapshot (allowed files only).
        """
        if self.source == "builtin":
            return self.location, self.pretrained, needs_forced_quick_gelu(self.location, self.pretrained), None
        revision = None
        if self.source == "hf-hub":
            from huggingface_hub import snapshot_download

            directory = Path(
                snapshot_download(
                    self.location,
                    revision=self.revision,
                    allow_patterns=HUB_ALLOW_PATTERNS,
                    cache_dir=self.cache_dir,
                )
            )
            revision = directory.name  # snapshots/<commit sha>
        else:
            directory = Path(self.location)
        if not directory.is_dir():
            raise ValueError(f"model directory not found: {str(directory)!r}")
        if not (directory / CONFIG_NAME).is_file():
            raise ValueError(f"model directory {str(directory)!r} has no {CONFIG_NAME} (open_clip's local layout)")
        if not any(directory.glob("*.safetensors")):
            raise ValueError(
                f"model directory {str(directory)!r} has no .safetensors weights (pickle checkpoints are not loaded)"
            )
        return LOCAL_DIR_PREFIX + str(directory), None, False, revision

    def load(self, device: str) -> LoadedClip:
        """Load (or share an already loaded copy of) the model on ``device``, in eval mode."""
        name, pretrained, force_quick_gelu, revision = self.resolve()
        key = (name, pretrained, force_quick_gelu, revision, self.cache_dir, str(device))
        with _SHARED_LOCK:
            loaded = _SHARED.get(key)
            if loaded is None:
                loaded = _load(name, pretrained, force_quick_gelu, revision, device, self.cache_dir)
                _SHARED[key] = loaded
                logger.info("Loaded CLIP %s (%s) on %s", self.model, self.source, device)
        return loaded

    def describe(self, loaded: LoadedClip | None = None) -> dict[str, Any]:
        """Model id, source, tag, revision and (once loaded) weights hash, for a manifest.

        Local paths are reduced to their last component, so no machine-specific path reaches a release.
        """
        import open_clip

        info = loaded.info if loaded is not None else {}
        model = Path(self.location).name if self.source == "local-dir" else self.model
        pretrained = self.pretrained
        if pretrained is not None and pretrained.endswith(".safetensors"):
            pretrained = Path(pretrained).name
        return {
            "model": model,
            "source": self.source,
            "pretrained": pretrained,
            "requested_revision": self.revision,
            "revision": info.get("revision"),
            "weights_sha256": info.get("weights_sha256"),
            "quick_gelu": info.get("quick_gelu"),
            "embed_dim": info.get("embed_dim"),
            "image_size": info.get("image_size"),
            "context_length": info.get("context_length"),
            "open_clip": open_clip.__version__,
        }


def _load(name: str, pretrained: str | None, force_quick_gelu: bool, revision, device: str, cache_dir) -> LoadedClip:
    import open_clip
    import torch

    model, preprocess = open_clip.create_model_from_pretrained(
        name,
        pretrained=pretrained,
        device="cpu",
        force_quick_gelu=force_quick_gelu,
        cache_dir=cache_dir,
        weights_only=True,
    )
    digest = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        digest.update(f"{key}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    config = open_clip.get_model_config(name) or {}
    activations = {type(m).__name__ for m in model.modules()}
    info = {
        "weights_sha256": digest.hexdigest(),
        "revision": revision,
        "quick_gelu": "QuickGELU" in activations,
        "embed_dim": config.get("embed_dim"),
        "image_size": config.get("vision_cfg", {}).get("image_size"),
        "context_length": config.get("text_cfg", {}).get("context_length"),
    }
    return LoadedClip(
        model=model.to(device).eval(),
        preprocess=preprocess,
        tokenizer=open_clip.get_tokenizer(name),
        device=str(device),
        info=info,
    )


def load_clip(
    model: str | os.PathLike = DEFAULT_MODEL,
    pretrained: str | None = DEFAULT_PRETRAINED,
    device: str = "cpu",
    revision: str | None = None,
    cache_dir: str | None = None,
) -> LoadedClip:
    """Validate a reference and load it: ``ClipModelRef(model, pretrained, revision, cache_dir).load(device)``."""
    return ClipModelRef(model, pretrained, revision, cache_dir).load(device)
