"""CLIP quality gates for LANCE counterfactuals (Prabhu et al., NeurIPS 2023, section 3.2 and eq. 2).

LANCE keeps an edited image only if CLIP (Radford et al., ICML 2021; ViT-L/14 with OpenAI weights in the
authors' code, loaded here through open_clip, Cherti et al., CVPR 2023) says that the edit

1. moved the image in the direction the caption moved: the directional similarity of InstructPix2Pix
   (Brooks et al., CVPR 2023; Gal et al., StyleGAN-NADA, 2021), paper eq. 2,
   ``cos(E_I(x') - E_I(x), E_T(t') - E_T(t)) >= 0.2``;
2. kept the image recognisable: ``cos(E_I(x), E_I(x')) >= 0.7``;
3. left both images matching their captions: ``cos(E_I(x), E_T(t)) >= 0.2`` and ``cos(E_I(x'), E_T(t')) >= 0.2``;
4. made the edited image closer to the edited caption than to the original one:
   ``cos(E_I(x'), E_T(t')) > cos(E_I(x'), E_T(t))``.

For LANCE-R (random word replacements) the check is that the edited image matches the new word better than
the old word (``word_check``; the authors' "predictive consistency" check compares the raw edit words).

Thresholds and their sources are in ``ClipGateThresholds`` and docs/method.md. Unlike the authors' code,
every score is returned as a plain float so the caller can record it for every candidate, kept or not.
All similarities are cosines of L2-normalised embeddings, as in InstructPix2Pix's ``ClipSimilarity``.

Which image is the "original" is the caller's choice: the authors compared against the prompt-to-prompt
reconstruction of the source caption (``images[0]`` of their batch), not the real photo.
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import numbers
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from PIL import Image

logger = logging.getLogger(__name__)

# Loaded CLIP models shared by every scorer in the process: (name, tag, quick_gelu, revision, cache, device) -> parts.
_LOADED: dict[tuple, tuple] = {}

DEFAULT_MODEL = "ViT-L-14"
DEFAULT_PRETRAINED = "openai"
LOCAL_DIR_PREFIX = "local-dir:"  # open_clip.factory.LOCAL_DIR_PREFIX
HF_HUB_PREFIX = "hf-hub:"  # open_clip.factory.HF_HUB_PREFIX
CONFIG_NAME = "open_clip_config.json"  # open_clip.constants.HF_CONFIG_NAME
# What a Hub snapshot needs for open_clip's local-dir loader: config, safetensors weights, and the files of an
# optional Hugging Face tokenizer. Pickle checkpoints (*.bin, *.pth) are never fetched.
HUB_ALLOW_PATTERNS = [
    CONFIG_NAME,
    "*.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
]

SCORE_KEYS = ("clip_directional", "clip_image", "clip_text_original", "clip_text_edited")


@dataclass
class ClipGateThresholds:
    """Acceptance thresholds of the CLIP gates. Defaults are those of the authors' code (``edit_images.py``).

    Attributes:
        directional: ``clip_directional`` must be ``>=`` this (authors' ``clip_dir_thresh = 0.2``).
        image: ``clip_image``, the original/edited image cosine, must be ``>=`` this (``clip_img_thresh = 0.7``).
        text: ``clip_text_original`` = cos(original image, caption) and ``clip_text_edited`` = cos(edited image,
            edited caption) must both be ``>=`` this (``clip_thresh = 0.2``).
        require_edited_closer: Require cos(edited image, edited caption) > cos(edited image, original caption),
            i.e. ``edited_vs_original_caption > 0``.
    """

    directional: float = 0.2
    image: float = 0.7
    text: float = 0.2
    require_edited_closer: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "require_edited_closer":
                if not isinstance(value, bool):
                    raise ValueError(f"ClipGateThresholds.require_edited_closer must be a bool, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not -1.0 <= float(value) <= 1.0:
                raise ValueError(
                    f"ClipGateThresholds.{f.name} must be a number in [-1, 1] (a cosine similarity), got {value!r}"
                )


def _score_value(scores: dict[str, Any], key: str) -> float:
    if key not in scores:
        raise ValueError(f"scores is missing {key!r}; expected the keys returned by ClipScorer.edit_scores")
    value = scores[key]
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"scores[{key!r}] must be a float, got {value!r}")
    return float(value)


def gate_failures(scores: dict[str, Any], thresholds: ClipGateThresholds) -> list[str]:
    """Why a candidate fails the CLIP gates.

    A score passes when it is ``>=`` its threshold (a score exactly at the threshold passes); NaN never passes.

    Args:
        scores: One dict from ``ClipScorer.edit_scores`` (extra keys are ignored).
        thresholds: The gate thresholds.

    Returns:
        Human-readable reasons, one per failed gate, in a fixed order; ``[]`` means the candidate passes.

    Raises:
        ValueError: A required score is missing or not a number.
    """
    checks = (
        ("clip_directional", thresholds.directional, "directional similarity"),
        ("clip_image", thresholds.image, "original/edited image similarity"),
        ("clip_text_original", thresholds.text, "original image/caption similarity"),
        ("clip_text_edited", thresholds.text, "edited image/edited caption similarity"),
    )
    reasons = []
    for key, threshold, what in checks:
        value = _score_value(scores, key)
        if not value >= threshold:  # written this way so that NaN fails
            reasons.append(f"{what} too low: {key}={value:.6f} < {threshold:g}")
    if thresholds.require_edited_closer:
        margin = _score_value(scores, "edited_vs_original_caption")
        if not margin > 0.0:
            reasons.append(
                "edited image not closer to the edited caption than to the original caption: "
                f"edited_vs_original_caption={margin:.6f} <= 0"
            )
    return reasons


def _check_embeddings(**named: torch.Tensor) -> None:
    import torch

    shape = None
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise ValueError(f"{name} must be a floating-point torch.Tensor of embeddings, got {type(tensor).__name__}")
        if tensor.ndim == 0:
            raise ValueError(f"{name} must have shape (D,) or (N, D), got a scalar")
        if shape is None:
            shape = tensor.shape
        elif tensor.shape != shape:
            raise ValueError(
                f"embeddings must share one shape; {name} has {tuple(tensor.shape)}, expected {tuple(shape)}"
            )


def clip_directional_similarity(
    image_a: torch.Tensor, image_b: torch.Tensor, text_a: torch.Tensor, text_b: torch.Tensor
) -> torch.Tensor:
    """CLIP directional similarity, paper eq. 2 (InstructPix2Pix's ``sim_direction``).

    ``cos(E_I(b) - E_I(a), E_T(b) - E_T(a))`` with every embedding L2-normalised first (a no-op for the
    output of ``ClipScorer.encode_*``). A zero direction (identical images or identical captions) gives 0.

    Args:
        image_a: Embeddings of the original images, shape ``(D,)`` or ``(N, D)``.
        image_b: Embeddings of the edited images, same shape.
        text_a: Embeddings of the original captions, same shape.
        text_b: Embeddings of the edited captions, same shape.

    Returns:
        The similarities, shape ``()`` or ``(N,)``.
    """
    import torch.nn.functional as F

    _check_embeddings(image_a=image_a, image_b=image_b, text_a=text_a, text_b=text_b)
    ia, ib, ta, tb = (F.normalize(t, dim=-1) for t in (image_a, image_b, text_a, text_b))
    return F.cosine_similarity(ib - ia, tb - ta, dim=-1)


def edit_scores_from_embeddings(
    original_images: torch.Tensor,
    edited_images: torch.Tensor,
    captions: torch.Tensor,
    edited_captions: torch.Tensor,
) -> list[dict[str, float]]:
    """The gate scores of ``ClipScorer.edit_scores`` from embeddings (I1, I2, T1, T2), each ``(N, D)``.

    Returns:
        Per pair: ``clip_directional`` (eq. 2), ``clip_image`` = cos(I1, I2), ``clip_text_original`` =
        cos(I1, T1), ``clip_text_edited`` = cos(I2, T2) and ``edited_vs_original_caption`` = cos(I2, T2) -
        cos(I2, T1), as plain floats.
    """
    import torch.nn.functional as F

    _check_embeddings(
        original_images=original_images, edited_images=edited_images, captions=captions, edited_captions=edited_captions
    )
    if original_images.ndim != 2:
        raise ValueError(f"embeddings must have shape (N, D), got {tuple(original_images.shape)}")
    i1, i2, t1, t2 = (
        F.normalize(t.float(), dim=-1) for t in (original_images, edited_images, captions, edited_captions)
    )
    directional = clip_directional_similarity(i1, i2, t1, t2)
    image = (i1 * i2).sum(-1)
    text_original = (i1 * t1).sum(-1)
    text_edited = (i2 * t2).sum(-1)
    margin = text_edited - (i2 * t1).sum(-1)
    return [
        {
            "clip_directional": float(directional[n]),
            "clip_image": float(image[n]),
            "clip_text_original": float(text_original[n]),
            "clip_text_edited": float(text_edited[n]),
            "edited_vs_original_caption": float(margin[n]),
        }
        for n in range(i1.shape[0])
    ]


def word_check_from_embeddings(
    edited_images: torch.Tensor, old_words: torch.Tensor, new_words: torch.Tensor
) -> list[dict[str, float | bool]]:
    """The LANCE-R word check from embeddings, each ``(N, D)``: does the image match the new word better?

    Returns:
        Per image: ``new_word_similarity`` = cos(image, new word), ``old_word_similarity`` = cos(image, old
        word), and ``passes`` = new > old (strict: a tie fails).
    """
    import torch.nn.functional as F

    _check_embeddings(edited_images=edited_images, old_words=old_words, new_words=new_words)
    if edited_images.ndim != 2:
        raise ValueError(f"embeddings must have shape (N, D), got {tuple(edited_images.shape)}")
    image, old, new = (F.normalize(t.float(), dim=-1) for t in (edited_images, old_words, new_words))
    new_sim = (image * new).sum(-1)
    old_sim = (image * old).sum(-1)
    return [
        {
            "new_word_similarity": float(new_sim[n]),
            "old_word_similarity": float(old_sim[n]),
            "passes": bool(new_sim[n] > old_sim[n]),
        }
        for n in range(image.shape[0])
    ]


def _check_same_length(**named: list) -> int:
    lengths = {}
    for name, value in named.items():
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name} must be a list, got {type(value).__name__}")
        lengths[name] = len(value)
    if len(set(lengths.values())) > 1:
        listing = ", ".join(f"{name}={n}" for name, n in lengths.items())
        raise ValueError(f"input lists must have the same length, got {listing}")
    return next(iter(lengths.values()))


def _unique_indices(keys: list) -> tuple[list[int], list[int]]:
    """Positions of the first occurrence of each key, and for every item the index of its key among those."""
    first: dict[Any, int] = {}
    unique_positions: list[int] = []
    inverse: list[int] = []
    for position, key in enumerate(keys):
        if key not in first:
            first[key] = len(unique_positions)
            unique_positions.append(position)
        inverse.append(first[key])
    return unique_positions, inverse


class ClipScorer:
    """Scores edits with an open_clip model: image/text embeddings, the gate scores, the LANCE-R word check.

    ``model`` selects the weights; every form ends in the same call, ``open_clip.create_model_from_pretrained``
    (safetensors, or ``torch.load(weights_only=True)`` for built-in tags whose Hub file is not safetensors):

    * a built-in open_clip architecture name with a pretrained tag (default ``"ViT-L-14"`` + ``"openai"``,
      as the authors' code). QuickGELU is switched on when the tag's config says the weights were trained
      with it: open_clip 3.x only warns about the mismatch and would otherwise build ``ViT-L-14`` with plain
      GELU under the OpenAI weights;
    * ``"hf-hub:ORG/NAME"`` with an optional pinned ``revision``: the snapshot (config, safetensors, tokenizer
      files only) is fetched with ``huggingface_hub.snapshot_download`` and loaded as a local directory;
    * a local directory (or ``"local-dir:DIR"``) holding ``open_clip_config.json`` and safetensors weights,
      e.g. the one written by ``tiny_clip_components.create_tiny_open_clip``.

    Nothing is loaded until ``load(device)``.

    Args:
        model: Model name, ``hf-hub:`` id or local directory (see above).
        pretrained: Pretrained tag (or a ``.safetensors`` file) for a built-in name. Not used for ``hf-hub:``
            ids and directories, whose weights come from the repository/directory itself.
        revision: Hub revision (branch, tag or commit) for an ``hf-hub:`` id.
        batch_size: Images or texts per forward pass.
        cache_dir: Hugging Face cache directory (default: the hub's own).
    """

    name = "clip_gates"

    def __init__(
        self,
        model: str | os.PathLike = DEFAULT_MODEL,
        pretrained: str | None = DEFAULT_PRETRAINED,
        revision: str | None = None,
        batch_size: int = 32,
        cache_dir: str | None = None,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if not isinstance(model, (str, os.PathLike)) or not str(model).strip():
            raise ValueError(f"model must be an open_clip model name, an 'hf-hub:' id or a directory, got {model!r}")
        model = os.fspath(model)
        self.model = model
        self.batch_size = batch_size
        self.cache_dir = cache_dir
        self.revision = revision
        self.pretrained: str | None = None
        if model.startswith(LOCAL_DIR_PREFIX) or os.path.isdir(model):
            self.source = "local-dir"
            self._location = model[len(LOCAL_DIR_PREFIX) :] if model.startswith(LOCAL_DIR_PREFIX) else model
            self._check_no_tag(pretrained)
            self._check_no_revision(revision)
        elif model.startswith(HF_HUB_PREFIX):
            self.source = "hf-hub"
            self._location = model[len(HF_HUB_PREFIX) :]
            if self._location.count("/") != 1 or not all(self._location.split("/")):
                raise ValueError(f"model {model!r}: expected 'hf-hub:ORG/NAME'")
            self._check_no_tag(pretrained)
        else:
            self.source = "builtin"
            self._location = self._check_builtin(model, pretrained)
            self._check_no_revision(revision)
            self.pretrained = pretrained
        self._model = None
        self._preprocess = None
        self._tokenizer = None
        self._device: str | None = None
        self._info: dict[str, Any] = {}

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

    # ------------------------------------------------------------------ loading

    def _resolve(self) -> tuple[str, str | None, bool, str | None]:
        """(open_clip model name, pretrained, force_quick_gelu, resolved revision) for ``create_model*``."""
        import open_clip

        if self.source == "builtin":
            tag_cfg = open_clip.get_pretrained_cfg(self._location, self.pretrained) or {}
            model_cfg = open_clip.get_model_config(self._location) or {}
            force_quick_gelu = bool(tag_cfg.get("quick_gelu", False)) and not model_cfg.get("quick_gelu", False)
            return self._location, self.pretrained, force_quick_gelu, None
        revision = None
        if self.source == "hf-hub":
            from huggingface_hub import snapshot_download

            directory = Path(
                snapshot_download(
                    self._location,
                    revision=self.revision,
                    allow_patterns=HUB_ALLOW_PATTERNS,
                    cache_dir=self.cache_dir,
                )
            )
            revision = directory.name  # snapshots/<commit sha>
        else:
            directory = Path(self._location)
        if not directory.is_dir():
            raise ValueError(f"model directory not found: {str(directory)!r}")
        if not (directory / CONFIG_NAME).is_file():
            raise ValueError(f"model directory {str(directory)!r} has no {CONFIG_NAME} (open_clip's local layout)")
        if not any(directory.glob("*.safetensors")):
            raise ValueError(
                f"model directory {str(directory)!r} has no .safetensors weights (pickle checkpoints are not loaded)"
            )
        return LOCAL_DIR_PREFIX + str(directory), None, False, revision

    def load(self, device: str) -> None:
        """Load the model, its preprocessing and tokenizer, and move the model to ``device`` in eval mode.

        Scorers with the same model on the same device share one loaded copy (the counterfactual and LANCE-R edit
        stages both gate with CLIP; the authors' code held two ViT-L/14 copies).
        """
        name, pretrained, force_quick_gelu, revision = self._resolve()
        key = (name, pretrained, force_quick_gelu, revision, self.cache_dir, str(device))
        if key not in _LOADED:
            _LOADED[key] = self._load_uncached(name, pretrained, force_quick_gelu, revision, device)
        self._info, self._model, self._preprocess, self._tokenizer = _LOADED[key]
        self._device = device
        logger.info("Loaded CLIP %s (%s) on %s", self.model, self.source, device)

    def _load_uncached(self, name, pretrained, force_quick_gelu, revision, device):
        import open_clip
        import torch

        model, preprocess = open_clip.create_model_from_pretrained(
            name,
            pretrained=pretrained,
            device="cpu",
            force_quick_gelu=force_quick_gelu,
            cache_dir=self.cache_dir,
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
        return info, model.to(device).eval(), preprocess, open_clip.get_tokenizer(name)

    def describe(self) -> dict[str, Any]:
        """Model id, pretrained tag, revision and weights hash for the manifest (hash and revision after load).

        Local paths are reduced to their last component, so no machine-specific path reaches a release.
        """
        import open_clip

        model = Path(self._location).name if self.source == "local-dir" else self.model
        pretrained = self.pretrained
        if pretrained is not None and pretrained.endswith(".safetensors"):
            pretrained = Path(pretrained).name
        return {
            "name": self.name,
            "model": model,
            "source": self.source,
            "pretrained": pretrained,
            "requested_revision": self.revision,
            "revision": self._info.get("revision"),
            "weights_sha256": self._info.get("weights_sha256"),
            "quick_gelu": self._info.get("quick_gelu"),
            "embed_dim": self._info.get("embed_dim"),
            "image_size": self._info.get("image_size"),
            "context_length": self._info.get("context_length"),
            "open_clip": open_clip.__version__,
        }

    # ----------------------------------------------------------------- encoding

    def _require_loaded(self) -> None:
        if self._model is None:
            raise RuntimeError("ClipScorer.load(device) must be called before encoding")

    def _empty(self) -> torch.Tensor:
        import torch

        return torch.empty((0, self._info.get("embed_dim") or 0), dtype=torch.float32)

    def encode_images(self, images: list[Image.Image]) -> torch.Tensor:
        """L2-normalised image embeddings, ``(N, D)`` float32 on CPU, computed ``batch_size`` images at a time."""
        import torch
        from PIL import Image

        self._require_loaded()
        if not isinstance(images, (list, tuple)):
            raise ValueError(f"images must be a list of PIL images, got {type(images).__name__}")
        for index, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise ValueError(f"images[{index}] must be a PIL.Image.Image, got {type(image).__name__}")
        if not images:
            return self._empty()
        out = []
        with torch.inference_mode():
            for start in range(0, len(images), self.batch_size):
                batch = torch.stack(
                    [self._preprocess(im.convert("RGB")) for im in images[start : start + self.batch_size]]
                )
                features = self._model.encode_image(batch.to(self._device))
                out.append(torch.nn.functional.normalize(features.float(), dim=-1).cpu())
        return torch.cat(out)

    def encode_texts(self, texts: list[str]) -> torch.Tensor:
        """L2-normalised text embeddings, ``(N, D)`` float32 on CPU (texts past the context length are cut)."""
        import torch

        self._require_loaded()
        if not isinstance(texts, (list, tuple)):
            raise ValueError(f"texts must be a list of str, got {type(texts).__name__}")
        for index, text in enumerate(texts):
            if not isinstance(text, str):
                raise ValueError(f"texts[{index}] must be a str, got {type(text).__name__}")
        if not texts:
            return self._empty()
        out = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                tokens = self._tokenizer(list(texts[start : start + self.batch_size]))
                features = self._model.encode_text(tokens.to(self._device))
                out.append(torch.nn.functional.normalize(features.float(), dim=-1).cpu())
        return torch.cat(out)

    def _encode_images_once(self, images: list[Image.Image]) -> torch.Tensor:
        # A sweep scores many candidates against the same original image object: encode each object once.
        unique, inverse = _unique_indices([id(image) for image in images])
        return self.encode_images([images[i] for i in unique])[inverse]

    def _encode_texts_once(self, texts: list[str]) -> torch.Tensor:
        unique, inverse = _unique_indices(list(texts))
        return self.encode_texts([texts[i] for i in unique])[inverse]

    # ------------------------------------------------------------------ scoring

    def edit_scores(
        self,
        original_images: list[Image.Image],
        edited_images: list[Image.Image],
        captions: list[str],
        edited_captions: list[str],
    ) -> list[dict[str, float]]:
        """Gate scores for each (original image, edited image, caption, edited caption).

        Returns:
            Per pair: ``clip_directional``, ``clip_image``, ``clip_text_original``, ``clip_text_edited`` and
            ``edited_vs_original_caption``, plain floats (see ``edit_scores_from_embeddings``).

        Raises:
            ValueError: The four lists differ in length or hold the wrong types.
        """
        n = _check_same_length(
            original_images=original_images,
            edited_images=edited_images,
            captions=captions,
            edited_captions=edited_captions,
        )
        if n == 0:
            return []
        return edit_scores_from_embeddings(
            self._encode_images_once(list(original_images)),
            self._encode_images_once(list(edited_images)),
            self._encode_texts_once(list(captions)),
            self._encode_texts_once(list(edited_captions)),
        )

    def word_check(
        self, edited_images: list[Image.Image], old_words: list[str], new_words: list[str]
    ) -> list[dict[str, float | bool]]:
        """LANCE-R check: each edited image must match its new word better than the word it replaced.

        The words are encoded as they are (no prompt template), like the authors' consistency check.

        Returns:
            Per image: ``new_word_similarity``, ``old_word_similarity`` and ``passes`` (new > old).

        Raises:
            ValueError: The lists differ in length, or a word is empty.
        """
        n = _check_same_length(edited_images=edited_images, old_words=old_words, new_words=new_words)
        for name, words in (("old_words", old_words), ("new_words", new_words)):
            for index, word in enumerate(words):
                if not isinstance(word, str) or not word.strip():
                    raise ValueError(f"{name}[{index}] must be a non-empty str, got {word!r}")
        if n == 0:
            return []
        return word_check_from_embeddings(
            self._encode_images_once(list(edited_images)),
            self._encode_texts_once(list(old_words)),
            self._encode_texts_once(list(new_words)),
        )
