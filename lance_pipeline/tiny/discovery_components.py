"""Deterministic STAND-INS with PLANTED failures, for the offline discovery demo and its tests.

Failure discovery needs images whose content matters (a model that fails on red things, a captioner that says "red"),
which tiny random-weight diffusion models and captioners cannot give. These stand-ins are small, honest and
deterministic; none of them is a real generative model, captioner or classifier, and nothing they produce says
anything about a real classifier:

* ``PaletteGenerator``: "generates" an image for a prompt: a seeded texture tinted with the first palette colour named
  in the prompt, or, when none is named, with a colour drawn from the seed (so about one baseline image in
  ``len(PALETTE)`` shows each colour). The class named in the prompt is written into the image's top row as a grey
  level (``CLASS_ROW_HEIGHT``), the "object" a classifier can see.
* ``planted_colour_classifier``: a timm-registered model (``timm.create_model("planted_colour_classifier",
  num_classes=N, failures="red=1>+1")``) that reads the class from the top row and predicts it, except on the
  images its *failure rules* select: ``COLOUR=RATE>TARGET`` (``*`` for every colour no other rule names) makes a
  fraction RATE of the images of that dominant colour wrong, predicted as the true label + k (``+k``, modulo N) or
  as a label spread over every other label (``scatter``). Which images fail, and where a scattered one goes, is a
  hash of the image's pixels: the same image always gets the same answer, independent of colour within a rule.
* ``ColourCaptioner``: names the dominant palette colour, the class and a scene every image shares ("a red photo of
  a tench in a pond"), so merged descriptions carry a word ("pond") that says nothing about the failure.
* ``colour_histogram_embedder``: the mean colour, the stand-in's image embedding.

A scenario may also paint **attributes** besides the colour (``ATTRIBUTES``: column stripes, row ripples), each named
in the prompt or drawn from the seed, each with two values, written as a zero-mean pattern (so the mean colour, the
embedding and the colour decisions stay those of the colour alone); the captioner names them and a failure rule can
need several together (``red+striped=0.8>+1``: only red images that are striped), the case refinement must keep
every needed word of.

``DEMO_SCENARIOS`` are the planted cases the demo and the tests run (``lance-cf discover --demo NAME``; registered in
``builder.registry.DISCOVERY_DEMOS``): each is a failure rule and what a correct discovery reports for it; calling
one with the run's class names gives its components.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from lance_pipeline.discovery.search import DiscoveryComponents

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 180, 40),
    "blue": (30, 60, 220),
    "yellow": (230, 210, 30),
    "purple": (140, 40, 170),
}

# Attributes a scenario can paint besides the colour: axis -> (the value that shows a pattern, the one that does not).
# "pattern" alternates columns, "ripple" alternates rows, each by +-ATTRIBUTE_AMPLITUDE grey levels: a zero-mean
# pattern, so the image's mean colour (the dominant colour, the embedding) does not depend on it.
ATTRIBUTES: dict[str, tuple[str, str]] = {"pattern": ("striped", "plain"), "ripple": ("rippled", "calm")}
ATTRIBUTE_AMPLITUDE = 12.0
ATTRIBUTE_WORDS = {value: axis for axis, values in ATTRIBUTES.items() for value in values}

# The stand-in classifier's label space in the demo: the run's classes first, then other labels a wrong prediction
# can go to (so that scattered errors have somewhere to scatter).
DEMO_NUM_LABELS = 12


def _seeded_rng(seed: int):
    import numpy as np

    return np.random.default_rng(int(seed) & 0xFFFFFFFF)


def _class_level(label: int) -> int:
    """Grey level that encodes a class in the top row (up to 12 classes)."""
    return 10 + 20 * label


class PaletteGenerator:
    """Stand-in text-to-image generator: colour named in the prompt (or drawn from the seed) + seeded texture."""

    def __init__(self, class_names: list[str], size: int = 32, attributes: tuple[str, ...] = ()) -> None:
        if len(class_names) > 12:
            raise ValueError("the palette stand-in encodes at most 12 classes")
        unknown = [a for a in attributes if a not in ATTRIBUTES]
        if unknown:
            raise ValueError(f"attributes {unknown}: expected axes of {sorted(ATTRIBUTES)}")
        self.class_names = list(class_names)
        self.size = size
        self.attributes = tuple(attributes)

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

    def attribute_for(self, prompt: str, seed: int, axis: str) -> str:
        """The value of ``axis`` the prompt names, or one drawn from the seed (each about half the time)."""
        for word in prompt.lower().replace(",", " ").split():
            if word in ATTRIBUTES[axis]:
                return word
        digest = hashlib.sha256(f"attribute:{axis}:{seed}".encode()).digest()
        return ATTRIBUTES[axis][digest[0] % 2]

    def generate(self, prompts: list[str], seeds: list[int]) -> list[Any]:
        import numpy as np
        from PIL import Image

        images = []
        for prompt, seed in zip(prompts, seeds, strict=True):
            colour = np.array(PALETTE[self.colour_for(prompt, seed)], dtype=np.float32)
            noise = _seeded_rng(seed + 1).normal(0.0, 18.0, size=(self.size, self.size, 3))
            for axis in self.attributes:
                if self.attribute_for(prompt, seed, axis) == ATTRIBUTES[axis][0]:
                    noise = noise + _attribute_pattern(axis, self.size)
            pixels = np.clip(colour + noise, 0, 255).astype(np.uint8)
            pixels[:CLASS_ROW_HEIGHT] = _class_level(self.class_in(prompt))
            images.append(Image.fromarray(pixels))
        return images

    def describe(self) -> dict[str, Any]:
        described = {"model": "demo:palette-generator", "stand_in": True, "palette": sorted(PALETTE)}
        if self.attributes:
            described["attributes"] = {axis: list(ATTRIBUTES[axis]) for axis in self.attributes}
        return described


CLASS_ROW_HEIGHT = 2


def _attribute_pattern(axis: str, size: int) -> Any:
    """The zero-mean pattern that shows an attribute: alternating columns (pattern) or rows (ripple)."""
    import numpy as np

    signs = np.where(np.arange(size) % 2 == 0, ATTRIBUTE_AMPLITUDE, -ATTRIBUTE_AMPLITUDE)
    if axis == "pattern":
        return np.broadcast_to(signs[None, :, None], (size, size, 3))
    return np.broadcast_to(signs[:, None, None], (size, size, 3))


def image_attributes(pixels: Any) -> set[str]:
    """The attribute values an image shows, from its pixels (H x W x 3, 0-255; below the class row): a column
    (row) alternation of more than half the amplitude is ``striped`` (``rippled``)."""
    import numpy as np

    body = np.asarray(pixels, dtype=np.float32)[CLASS_ROW_HEIGHT:]
    found = set()
    columns = body.mean(axis=(0, 2))
    rows = body.mean(axis=(1, 2))
    if columns[0::2].mean() - columns[1::2].mean() > ATTRIBUTE_AMPLITUDE:
        found.add(ATTRIBUTES["pattern"][0])
    else:
        found.add(ATTRIBUTES["pattern"][1])
    # rows below the class row start at an even row (CLASS_ROW_HEIGHT is even), so even rows are the raised ones
    if rows[0::2].mean() - rows[1::2].mean() > ATTRIBUTE_AMPLITUDE:
        found.add(ATTRIBUTES["ripple"][0])
    else:
        found.add(ATTRIBUTES["ripple"][1])
    return found


def dominant_colour(image: Any) -> str:
    """The palette colour nearest to the image's mean colour (below the class row)."""
    import numpy as np

    mean = np.asarray(image.convert("RGB"), dtype=np.float32)[CLASS_ROW_HEIGHT:].reshape(-1, 3).mean(0)
    return min(PALETTE, key=lambda name: float(((np.array(PALETTE[name]) - mean) ** 2).sum()))


class ColourCaptioner:
    """Stand-in captioner: "a {colour} photo of a {class} {scene}", colour from the image's dominant palette colour.

    ``scene`` is a phrase every caption shares (e.g. "in a pond"), as real captions share context that has nothing
    to do with a failure: the merged description then carries a word that refinement must drop.
    """

    def __init__(self, scene: str = "", attributes: tuple[str, ...] = ()) -> None:
        self.scene = scene
        self.attributes = tuple(attributes)

    def caption(self, images: list[Any], class_names: list[str]) -> list[str]:
        tail = f" {self.scene}" if self.scene else ""
        out = []
        for im, name in zip(images, class_names, strict=True):
            words = [dominant_colour(im)]
            if self.attributes:
                shown = image_attributes(im.convert("RGB"))
                words += [value for axis in self.attributes for value in ATTRIBUTES[axis] if value in shown]
            out.append(f"a {' '.join(words)} photo of a {name}{tail}")
        return out

    def describe(self) -> dict[str, Any]:
        described = {"model": "demo:colour-captioner", "stand_in": True, "scene": self.scene}
        if self.attributes:
            described["attributes"] = list(self.attributes)
        return described


@dataclass(frozen=True)
class FailureRule:
    """A fraction ``rate`` of the images of one dominant colour (showing every attribute value of ``attributes``) is
    misclassified, towards ``target``."""

    colour: str  # a PALETTE name, or "*" for every colour no other rule names
    rate: float
    target: str  # "+k" (true label + k, modulo the number of labels) or "scatter"
    attributes: tuple[str, ...] = ()  # attribute values (ATTRIBUTES) the image must also show


def parse_failure_rules(spec: str) -> dict[str, FailureRule]:
    """``"red=0.5>+1,*=0.05>+1"`` (or ``"red+striped=1>+1"``) -> {condition: rule}; one line naming the bad part
    otherwise."""
    rules: dict[str, FailureRule] = {}
    for part in (p.strip() for p in spec.split(",")):
        condition, _, rest = part.partition("=")
        rate, _, target = rest.partition(">")
        colour, *attributes = condition.strip().split("+")
        try:
            value = float(rate)
        except ValueError:
            value = -1.0
        ok_target = target == "scatter" or (target[:1] == "+" and target[1:].isdigit() and int(target[1:]) > 0)
        axes = [ATTRIBUTE_WORDS.get(a) for a in attributes]
        ok_attributes = None not in axes and len(set(axes)) == len(axes) and (not attributes or colour != "*")
        key = "+".join([colour, *sorted(attributes)])
        if (
            colour not in (*PALETTE, "*")
            or not ok_attributes
            or not 0.0 <= value <= 1.0
            or not ok_target
            or key in rules
        ):
            raise ValueError(
                f"failure rule {part!r}: expected COLOUR[+ATTRIBUTE...]=RATE>TARGET, COLOUR one of {sorted(PALETTE)} "
                f"or '*' (once each), ATTRIBUTE one value per axis of {sorted(ATTRIBUTE_WORDS)}, RATE in [0, 1], "
                "TARGET +k or scatter"
            )
        rules[key] = FailureRule(colour, value, target, tuple(sorted(attributes)))
    return rules


def matching_rule(rules: dict[str, FailureRule], colour: str, attributes: set[str]) -> FailureRule | None:
    """The rule of an image: the colour's rule that needs the most attributes, all of which the image shows; else
    the ``*`` rule."""
    candidates = [r for r in rules.values() if r.colour == colour and set(r.attributes) <= attributes]
    if candidates:
        return max(candidates, key=lambda r: len(r.attributes))
    return rules.get("*")


def _unit(digest: bytes, offset: int) -> float:
    return int.from_bytes(digest[offset : offset + 4], "big") / 2**32


def _make_planted_module(num_classes: int, failures: str):
    import torch
    from torch import nn

    rules = parse_failure_rules(failures)
    needs_attributes = any(rule.attributes for rule in rules.values())
    names = sorted(PALETTE)
    palette = torch.tensor([PALETTE[name] for name in names], dtype=torch.float32) / 255.0

    class PlantedColourClassifier(nn.Module):
        """Logits: a one-hot vote for the class in the top row, or for a wrong label where a failure rule says."""

        def __init__(self) -> None:
            super().__init__()
            self.num_classes = num_classes
            self.failures = failures
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
            predicted = true_label.clone()
            for i in range(x.shape[0]):
                shown = (
                    image_attributes((pixels[i] * 255.0).permute(1, 2, 0).cpu().numpy()) if needs_attributes else set()
                )
                rule = matching_rule(rules, names[int(nearest[i])], shown)
                if rule is None or rule.rate == 0.0:
                    continue
                # the same image always gets the same answer: a hash of its pixels decides
                digest = hashlib.sha256(x[i].detach().cpu().numpy().tobytes()).digest()
                if _unit(digest, 0) >= rule.rate:
                    continue
                truth = int(true_label[i])
                if rule.target == "scatter":  # uniform over every other label
                    shift = 1 + int(_unit(digest, 4) * (num_classes - 1))
                else:
                    shift = int(rule.target[1:])
                predicted[i] = (truth + shift) % num_classes
            return nn.functional.one_hot(predicted, num_classes).float() * 10.0

    return PlantedColourClassifier()


def register_planted_classifier() -> None:
    """Register ``planted_colour_classifier`` with timm (idempotent), so ``timm.create_model`` builds it."""
    import timm
    from timm.models import register_model

    if "planted_colour_classifier" in timm.list_models("planted_colour_classifier"):
        return

    @register_model
    def planted_colour_classifier(pretrained: bool = False, num_classes: int = 1000, failures: str = "red=1>+1",
                                  **kwargs: Any):  # fmt: skip
        if pretrained:
            raise ValueError("planted_colour_classifier has no pretrained weights (it is a stand-in)")
        return _make_planted_module(num_classes, failures)


def planted_classifier_fn(num_classes: int, failures: str):
    """A callable(list[PIL]) -> predicted labels around the timm-registered planted model (timm's own transforms)."""
    import timm
    import torch

    register_planted_classifier()
    model = timm.create_model("planted_colour_classifier", num_classes=num_classes, failures=failures).eval()
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


@dataclass(frozen=True)
class DemoScenario:
    """A planted case: the stand-in classifier's failure rule and what discovery should report for it. Calling it
    with the run's class names (and labels) gives its components (``create_demo_components``)."""

    name: str
    failures: str
    expect: str
    scene: str = "in a pond"
    attributes: tuple[str, ...] = ()  # axes of ATTRIBUTES the generator paints and the captioner names

    def __call__(self, class_names: list[str], labels: list[int] | None = None):
        return create_demo_components(self, class_names, labels)


PLANTED_RED = DemoScenario("planted-red", "red=1>+1", "every red image fails (to the next class): finds 'red'")
PARTIAL_RED = DemoScenario(
    "partial-red", "red=0.5>+1,*=0.05>+1", "half the red images fail, 5% of the others: finds 'red'"
)
TARGET_SHIFT = DemoScenario(
    "target-shift",
    "green=0.2>+2,*=0.2>+1",
    "20% of every colour fails, but green errors go to the class after next: finds 'green' on the target-label test "
    "(the total failure rate does not change)",
)
SCATTERED_BLUE = DemoScenario(
    "scattered-blue",
    "blue=0.7>scatter,*=0.1>+1",
    "70% of blue images fail, their wrong labels spread over every other label: finds 'blue' on the total test",
)
NULL = DemoScenario("null", "*=0.25>+1", "25% of every colour fails the same way: a correct discovery finds nothing")
RED_AND_STRIPED = DemoScenario(
    "red-and-striped",
    "red+striped=0.8>+1",
    "80% of the images that are red and striped fail (red alone: about 40%): finds 'red striped', which refinement "
    "keeps whole",
    attributes=("pattern", "ripple"),
)
RED_STRIPED_RIPPLED = DemoScenario(
    "red-striped-rippled",
    "red+striped+rippled=0.8>+1",
    "80% of the images that are red, striped and rippled fail: finds all three words, which refinement keeps",
    attributes=("pattern", "ripple"),
)
DEMO_SCENARIOS = {
    s.name: s
    for s in (PLANTED_RED, PARTIAL_RED, TARGET_SHIFT, SCATTERED_BLUE, NULL, RED_AND_STRIPED, RED_STRIPED_RIPPLED)
}


def create_demo_components(scenario: DemoScenario, class_names: list[str], labels: list[int] | None = None):
    """The stand-in components of one demo scenario for classes ``class_names`` (true labels ``labels``).

    The stand-in classifier works on indices (0..n-1: the run's classes, then other labels up to
    ``DEMO_NUM_LABELS``); its predictions are mapped back to ``labels`` and to the smallest labels not among them.
    """
    labels = list(range(len(class_names))) if labels is None else list(labels)
    if len(labels) != len(class_names) or len(set(labels)) != len(labels):
        raise ValueError("the demo needs one distinct label per class")
    if len(class_names) > DEMO_NUM_LABELS - 2:
        raise ValueError(f"the discovery demo's stand-ins take at most {DEMO_NUM_LABELS - 2} classes")
    others = [label for label in range(DEMO_NUM_LABELS + len(labels)) if label not in labels]
    index_to_label = labels + others[: DEMO_NUM_LABELS - len(labels)]
    inner = planted_classifier_fn(DEMO_NUM_LABELS, scenario.failures)

    def classify(images: list[Any]) -> list[int]:
        return [index_to_label[i] for i in inner(images)]

    return DiscoveryComponents(
        generator=PaletteGenerator(class_names, attributes=scenario.attributes),
        classifiers={"planted_colour_classifier": classify},
        captioner=ColourCaptioner(scenario.scene, attributes=scenario.attributes),
        embedder=colour_histogram_embedder,
        classifier_info={"planted_colour_classifier": {"stand_in": True, "scenario": scenario.name,
                                                       "failures": scenario.failures}},
    )  # fmt: skip
