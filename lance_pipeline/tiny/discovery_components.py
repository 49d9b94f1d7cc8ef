"""Deterministic stand-ins with a PLANTED failure, for the offline discovery demo and its tests.

Failure discovery needs images whose content matters (a model that fails on red things, a captioner that says "red"),
which tiny random-weight diffusion models and captioners cannot give. These stand-ins are small, honest and
deterministic; none of them is a real generative model or captioner, and nothing they produce says anything about a
real classifier:

* ``PaletteGenerator``: "generates" an image for a prompt: a seeded texture tinted with the first palette colour named
  in the prompt, or, when none is named, with a colour drawn from the seed (so about one baseline image in
  ``len(PALETTE)`` shows each colour). The class named in the prompt is written into the image's top row as a grey
  level (``CLASS_ROW``), the "object" a classifier can see.
* ``planted_colour_classifier``: a timm-registered model (``timm.create_model("planted_colour_classifier",
  num_classes=N, planted_colour="red")``) that reads the class from the top row and predicts it, unless the image's
  dominant colour is the planted one, in which case it predicts the next class. ``planted_colour="none"`` gives a null
  model whose errors do not depend on colour (``null_error_rate`` of images, chosen by a hash of their pixels).
* ``ColourCaptioner``: names the dominant palette colour and the class ("a red photo of a tench").
"""

from __future__ import annotations

import hashlib
from typing import Any

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 180, 40),
    "blue": (30, 60, 220),
    "yellow": (230, 210, 30),
    "purple": (140, 40, 170),
}


def _seeded_rng(seed: int):
    import numpy as np

    return np.random.default_rng(int(seed) & 0xFFFFFFFF)


def _class_level(label: int) -> int:
    """Grey level that encodes a class in the top row (up to 12 classes)."""
    return 10 + 20 * label


class PaletteGenerator:
    """Stand-in text-to-image generator: colour named in the prompt (or drawn from the seed) + seeded texture."""

    def __init__(self, class_names: list[str], size: int = 32) -> None:
        if len(class_names) > 12:
            raise ValueError("the palette stand-in encodes at most 12 classes")
        self.class_names = list(class_names)
        self.size = size

    def class_in(self, prompt: str) -> int:
        """The class whose name the prompt contains (the longest match)."""
        lowered = prompt.lower()
        matches = [i for i, name in enumerate(self.class_names) if name.lower() in lowered]
        if not matches:
            raise ValueError(f"prompt {prompt!r} names none of the classes {self.class_names}")
        return max(matches, key=lambda i: len(self.class_names[i]))

    def load(self) -> None:  # nothing to load; same interface as ``generation.ShiftGenerator``
        return None

    def colour_for(self, prompt: str, seed: int) -> str:
        words = prompt.lower().replace(",", " ").split()
        for word in words:
            if word in PALETTE:
                return word
        names = sorted(PALETTE)
        return names[int(_seeded_rng(seed).integers(len(names)))]

    def generate(self, prompts: list[str], seeds: list[int]) -> list[Any]:
        import numpy as np
        from PIL import Image

        images = []
        for prompt, seed in zip(prompts, seeds, strict=True):
            colour = np.array(PALETTE[self.colour_for(prompt, seed)], dtype=np.float32)
            noise = _seeded_rng(seed + 1).normal(0.0, 18.0, size=(self.size, self.size, 3))
            pixels = np.clip(colour + noise, 0, 255).astype(np.uint8)
            pixels[:CLASS_ROW_HEIGHT] = _class_level(self.class_in(prompt))
            images.append(Image.fromarray(pixels))
        return images

    def describe(self) -> dict[str, Any]:
        return {"model": "demo:palette-generator", "stand_in": True, "palette": sorted(PALETTE)}


CLASS_ROW_HEIGHT = 2


def dominant_colour(image: Any) -> str:
    """The palette colour nearest to the image's mean colour (below the class row)."""
    import numpy as np

    mean = np.asarray(image.convert("RGB"), dtype=np.float32)[CLASS_ROW_HEIGHT:].reshape(-1, 3).mean(0)
    return min(PALETTE, key=lambda name: float(((np.array(PALETTE[name]) - mean) ** 2).sum()))


class ColourCaptioner:
    """Stand-in captioner: "a {colour} photo of a {class}", colour from the image's dominant palette colour."""

    def caption(self, images: list[Any], class_names: list[str]) -> list[str]:
        return [f"a {dominant_colour(im)} photo of a {name}" for im, name in zip(images, class_names, strict=True)]

    def describe(self) -> dict[str, Any]:
        return {"model": "demo:colour-captioner", "stand_in": True}


def _make_planted_module(num_classes: int, planted_colour: str | None, null_error_rate: float):
    import torch
    from torch import nn

    palette = torch.tensor([PALETTE[name] for name in sorted(PALETTE)], dtype=torch.float32) / 255.0
    names = sorted(PALETTE)

    class PlantedColourClassifier(nn.Module):
        """Logits: a one-hot vote for the class in the top row, moved to the next class on the planted colour."""

        def __init__(self) -> None:
            super().__init__()
            self.num_classes = num_classes
            self.register_buffer("palette", palette)
            self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
            self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))
            self.default_cfg = self.pretrained_cfg = {
                "input_size": (3, 32, 32), "mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225),
                "crop_pct": 1.0, "interpolation": "bilinear", "num_classes": num_classes,
            }  # fmt: skip

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            pixels = x * self.std + self.mean  # back to [0, 1]
            level = pixels[:, :, :CLASS_ROW_HEIGHT].mean(dim=(1, 2, 3)) * 255.0
            true_label = ((level - 10.0) / 20.0).round().long().clamp(0, num_classes - 1)
            rgb = pixels[:, :, CLASS_ROW_HEIGHT:].mean(dim=(2, 3))
            nearest = torch.cdist(rgb, self.palette).argmin(dim=1)
            wrong = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
            if planted_colour is not None:
                wrong = nearest == names.index(planted_colour)
            elif null_error_rate > 0:
                # errors independent of colour: a hash of the pixels, so the same image always gets the same answer
                for i in range(x.shape[0]):
                    digest = hashlib.sha256(x[i].detach().cpu().numpy().tobytes()).digest()
                    wrong[i] = int.from_bytes(digest[:4], "big") / 2**32 < null_error_rate
            predicted = torch.where(wrong, (true_label + 1) % num_classes, true_label)
            return nn.functional.one_hot(predicted, num_classes).float() * 10.0

    return PlantedColourClassifier()


def register_planted_classifier() -> None:
    """Register ``planted_colour_classifier`` with timm (idempotent), so ``timm.create_model`` builds it."""
    import timm
    from timm.models import register_model

    if "planted_colour_classifier" in timm.list_models("planted_colour_classifier"):
        return

    @register_model
    def planted_colour_classifier(
        pretrained: bool = False,
        num_classes: int = 1000,
        planted_colour: str | None = "red",
        null_error_rate: float = 0.0,
        **kwargs: Any,
    ):
        if pretrained:
            raise ValueError("planted_colour_classifier has no pretrained weights (it is a stand-in)")
        # timm's create_model drops keyword arguments whose value is None, so "none" spells the null model.
        planted = None if planted_colour in (None, "none") else planted_colour
        if planted is not None and planted not in PALETTE:
            raise ValueError(f"planted_colour {planted_colour!r}: expected one of {sorted(PALETTE)} or 'none'")
        return _make_planted_module(num_classes, planted, null_error_rate)


def planted_classifier_fn(num_classes: int, planted_colour: str | None, null_error_rate: float = 0.0):
    """A callable(list[PIL]) -> predicted labels around the timm-registered planted model (timm's own transforms)."""
    import timm
    import torch

    register_planted_classifier()
    model = timm.create_model(
        "planted_colour_classifier", num_classes=num_classes, planted_colour=planted_colour or "none",
        null_error_rate=null_error_rate,
    ).eval()  # fmt: skip
    config = timm.data.resolve_data_config({}, model=model)
    transform = timm.data.create_transform(**config)

    def classify(images: list[Any]) -> list[int]:
        with torch.no_grad():
            logits = model(torch.stack([transform(im.convert("RGB")) for im in images]))
        return logits.argmax(dim=1).tolist()

    return classify


def colour_histogram_embedder(images: list[Any]) -> Any:
    """Stand-in image embedding: the mean RGB below the class row (what the stand-in images differ in)."""
    import numpy as np

    return np.stack(
        [np.asarray(im.convert("RGB"), dtype=np.float32)[CLASS_ROW_HEIGHT:].reshape(-1, 3).mean(0) for im in images]
    )
