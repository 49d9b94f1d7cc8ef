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

import logging
import numbers
import os
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from lance_pipeline.clip.loader import DEFAULT_MODEL, DEFAULT_PRETRAINED, ClipModelRef

if TYPE_CHECKING:
    import torch
    from PIL import Image

    from lance_pipeline.clip.loader import LoadedClip

logger = logging.getLogger(__name__)


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

    The model is named and loaded by the project's one CLIP loader (``clip_loader.ClipModelRef``: built-in name
    with a pretrained tag, ``hf-hub:ORG/NAME`` or a local directory; the QuickGELU rule lives there). Scorers of the
    same model on the same device share one loaded copy (the edit and LANCE-R stages both gate with CLIP; the
    authors' code held two ViT-L/14 copies). Nothing is loaded until ``load(device)``.

    Args:
        model: Model name, ``hf-hub:`` id or local directory.
        pretrained: Pretrained tag (or a ``.safetensors`` file) for a built-in name.
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
        self.ref = ClipModelRef(model, pretrained, revision, cache_dir)
        self.model = self.ref.model
        self.batch_size = batch_size
        self._loaded: LoadedClip | None = None

    def load(self, device: str) -> None:
        """Load the model (or share an already loaded copy) on ``device``."""
        self._loaded = self.ref.load(device)

    @property
    def _model(self):
        return None if self._loaded is None else self._loaded.model

    @property
    def _info(self) -> dict[str, Any]:
        return {} if self._loaded is None else self._loaded.info

    def describe(self) -> dict[str, Any]:
        """Model id, pretrained tag, revision and weights hash for the manifest (hash and revision after load)."""
        return {"name": self.name, **self.ref.describe(self._loaded)}

    # ----------------------------------------------------------------- encoding

    def _require_loaded(self) -> None:
        if self._loaded is None:
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
                    [self._loaded.preprocess(im.convert("RGB")) for im in images[start : start + self.batch_size]]
                )
                features = self._loaded.model.encode_image(batch.to(self._loaded.device))
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
                tokens = self._loaded.tokenizer(list(texts[start : start + self.batch_size]))
                features = self._loaded.model.encode_text(tokens.to(self._loaded.device))
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
