"""Failure discovery: find, in words, the situations in which a model fails more than it should.

Wiles, Albuquerque, Gowal, "Discovering Bugs in Vision Models using Off-the-shelf Image Generation and Captioning"
(arXiv 2208.08831). Their pipeline used internal models (Imagen, Flamingo) and reported failure rates without tests;
this is the method with open components and a corrected test. ``FailureSearch.run`` follows the paper's steps:

1. **Baseline.** ``n_base`` images per class from "a realistic photograph of a {class} ({superclass})"; each model's
   predictions give the class's base rates: the total failure rate and the rate of every wrong label.
2. **Cluster** the misclassified images of each (model, class), all predicted labels together
   (``clustering.cluster_failures``); each cluster's most frequent wrong label is its target label.
3. **Describe** each cluster: its members are captioned and the captions merged (``descriptions``). The same
   description from several clusters is *one hypothesis* (members pooled, target label recounted over the pool); at
   most ``max_descriptions_per_class`` hypotheses per (model, class), the largest first.
4. **Test** each hypothesis on ``n_test`` new images from "{base prompt}, {description}", twice, one-sided Fisher
   exact tests against the base images: the rate of its target label (the paper's (true label, predicted label)
   reasoning, Figures 3 and 5: a description can change *which* wrong label is predicted without changing how often
   the model is wrong) and the total failure rate. Both tests of every hypothesis of one model form one
   Benjamini-Hochberg family; a hypothesis is *discovered* when either test's q-value is below ``alpha``.
5. **Refine** each discovery (Wiles et al. prune a description to the words the failure needs, Figure 2): every
   shorter variant of its description (words dropped, ``sub_descriptions``) is tested on the test(s) that
   discovered it twice: against base (is its rate still above base?) and against the full description (is its rate
   significantly *lower*?). All these tests are a second Benjamini-Hochberg family of their own, per model. A variant
   can replace the description only when it is significant against base and not significantly lower than the full
   description on any discovering test: a word the failure needs takes part of the rate with it when dropped. The
   refined description is the shortest such variant (the description itself when none); both are reported.

The store (``DiscoveryStore``) keeps images, predictions and captions: ``builder.discovery`` gives a resumable SQLite
one. Every image's seed derives from (seed, key) and keys are made from names, never from order, so the same inputs
give the same result.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, Protocol

from annotated_types import Predicate

from lance_pipeline.discovery.clustering import ClusteringSettings, cluster_failures
from lance_pipeline.discovery.descriptions import KeywordCaptionMerger, sub_descriptions
from lance_pipeline.discovery.statistics import (
    EventCounts,
    benjamini_hochberg,
    bh_cutoff,
    clopper_pearson,
    rate_decrease_test,
    rate_increase_test,
)
from lance_pipeline.option_types import Interval, Options, PositiveInt

BASE_TEMPLATE = "a realistic photograph of a {class_name} ({superclass})"
DESCRIPTION_TEMPLATE = "{base}, {description}"

# The two tests of a hypothesis: the rate of its target label, and the total failure rate.
TARGET_LABEL_TEST = "target_label"
TOTAL_TEST = "total"
TESTS = (TARGET_LABEL_TEST, TOTAL_TEST)


def has_placeholders(template: str) -> bool:
    """Holds ``{...}`` placeholders (``BASE_TEMPLATE``, ``DESCRIPTION_TEMPLATE``); pydantic names this function."""
    return "{" in template


Template = Annotated[str, Predicate(has_placeholders), "a template with placeholders such as {class_name}"]


@dataclass
class DiscoverySettings(Options):
    """Everything that decides a discovery's result (recorded in discoveries.json); bounds are the annotations."""

    n_base: PositiveInt = 200
    n_test: PositiveInt = 100
    alpha: Annotated[float, Interval(gt=0.0, lt=1.0), "a significance level"] = 0.05
    refine: bool = True
    base_template: Template = BASE_TEMPLATE
    description_template: Template = DESCRIPTION_TEMPLATE
    clustering: ClusteringSettings = field(default_factory=ClusteringSettings)
    max_descriptions_per_class: PositiveInt = 5
    seed: int = 0
    batch_size: PositiveInt = 8

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["clustering"] = self.clustering.to_dict()
        return data


@dataclass
class DiscoveryComponents:
    """The models a discovery uses; real ones for a real run, stand-ins for the offline demo (``describe`` says).

    ``loaders`` are called once by ``load()``, after every option and output path was checked, so that a bad option
    never costs a model load.
    """

    generator: Any  # .generate(prompts, seeds) -> PIL images; .describe()
    classifiers: dict[str, Any]  # model name -> callable(list[PIL]) -> list[int] predicted labels
    captioner: Any  # .caption(images, class_names) -> list[str]; .describe()
    embedder: Any  # callable(list[PIL]) -> array [n, d]
    classifier_info: dict[str, Any] = field(default_factory=dict)
    merger: Any = None  # .merge(captions, class_name, superclass) -> str; .describe(); None: keyword frequency
    loaders: list[Callable[[], None]] = field(default_factory=list)

    def load(self) -> None:
        for loader in self.loaders:
            loader()
        self.loaders = []


@dataclass
class ClassTarget:
    label: int
    name: str
    superclass: str
    key: str  # name-derived, [A-Za-z0-9_-]

    def base_prompt(self, template: str) -> str:
        return template.format(class_name=self.name, superclass=self.superclass)


class DiscoveryStore(Protocol):
    """Where a discovery keeps its generated images, predictions and captions (``builder.discovery.run``'s ledger)."""

    def have_images(self, keys: list[str]) -> set[str]: ...
    def add_images(self, rows: list[tuple[str, str, int, int, Any]]) -> None: ...  # key, prompt, seed, label, image
    def images(self, keys: list[str]) -> list[Any]: ...
    def predictions(self, model: str, keys: list[str]) -> dict[str, int]: ...
    def add_predictions(self, model: str, predicted: dict[str, int]) -> None: ...
    def captions(self, keys: list[str]) -> dict[str, str]: ...
    def add_captions(self, captions: dict[str, str]) -> None: ...


def derive_seed(seed: int, key: str) -> int:
    digest = hashlib.sha256(f"lance-cf:discover:{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def description_key(description: str) -> str:
    return hashlib.sha256(description.encode()).hexdigest()[:10]


class FailureSearch:
    """One discovery over classes and models; ``run()`` returns ``{"models": {...}}`` (see docs/discovery.md)."""

    def __init__(
        self,
        classes: list[ClassTarget],
        components: DiscoveryComponents,
        settings: DiscoverySettings,
        store: DiscoveryStore,
        progress: Any = None,
    ) -> None:
        self.classes = classes
        self.c = components
        self.settings = settings
        self.store = store
        self.progress = progress
        if components.merger is None:
            components.merger = KeywordCaptionMerger()

    # -- images, predictions, captions (kept by the store) ------------------------------------------------------
    def _ensure_images(self, target: ClassTarget, prompt: str, tag: str, n: int) -> list[str]:
        keys = [f"{target.key}_{tag}_{i:03d}" for i in range(n)]
        have = self.store.have_images(keys)
        missing = [k for k in keys if k not in have]
        size = self.settings.batch_size
        for start in range(0, len(missing), size):
            chunk = missing[start : start + size]
            seeds = [derive_seed(self.settings.seed, k) for k in chunk]
            images = self.c.generator.generate([prompt] * len(chunk), seeds)
            self.store.add_images(
                [(k, prompt, s, target.label, im) for k, s, im in zip(chunk, seeds, images, strict=True)]
            )
            if self.progress is not None:
                self.progress.update(len(chunk))
        return keys

    def _predict(self, model: str, keys: list[str]) -> dict[str, int]:
        known = self.store.predictions(model, keys)
        missing = [k for k in keys if k not in known]
        size = self.settings.batch_size
        for start in range(0, len(missing), size):
            chunk = missing[start : start + size]
            predicted = dict(
                zip(chunk, (int(p) for p in self.c.classifiers[model](self.store.images(chunk))), strict=True)
            )
            self.store.add_predictions(model, predicted)
            known.update(predicted)
        return known

    def _captions(self, keys: list[str], class_name: str) -> list[str]:
        cached = self.store.captions(keys)
        todo = [k for k in keys if k not in cached]
        if todo:
            new = self.c.captioner.caption(self.store.images(todo), [class_name] * len(todo))
            self.store.add_captions(dict(zip(todo, new, strict=True)))
            cached.update(zip(todo, new, strict=True))
        return [cached[k] for k in keys]

    # -- the method ----------------------------------------------------------------------------------------------
    def _hypotheses(self, model: str, target: ClassTarget, base: dict[str, int]) -> tuple[list, list]:
        """Steps 2-3: the clusters of this (model, class)'s failures and the hypotheses (distinct descriptions)."""
        failing = [k for k in sorted(base) if base[k] != target.label]
        if not failing:
            return [], []
        embeddings = self.c.embedder(self.store.images(failing))
        clusters = []
        for cluster in cluster_failures(failing, [base[k] for k in failing], embeddings, self.settings.clustering):
            captions = self._captions(cluster.members, target.name)
            description = self.c.merger.merge(captions, target.name, target.superclass)
            clusters.append({
                "members": cluster.members,
                "predicted": {str(label): n for label, n in cluster.predicted.items()},
                "captions": captions,
                "description": description,
                "hypothesis": None,
            })  # fmt: skip
        by_description: dict[str, list[int]] = {}
        for index, cluster in enumerate(clusters):
            if cluster["description"]:  # nothing shared by the captions: nothing to test
                by_description.setdefault(cluster["description"], []).append(index)
        pooled = []
        for description, indices in by_description.items():
            members = sorted(k for i in indices for k in clusters[i]["members"])
            predicted = Counter(base[k] for k in members)
            target_label = min(predicted, key=lambda label: (-predicted[label], label))
            pooled.append((description, indices, members, target_label))
        pooled.sort(key=lambda h: (-len(h[2]), h[1][0]))  # the largest first; ties: the first cluster's rank
        hypotheses = []
        for description, indices, members, target_label in pooled[: self.settings.max_descriptions_per_class]:
            for i in indices:
                clusters[i]["hypothesis"] = len(hypotheses)
            hypotheses.append(
                {"description": description, "clusters": indices, "members": members, "target_label": target_label}
            )
        return clusters, hypotheses

    def _test(
        self, model: str, target: ClassTarget, description: str, target_label: int, base: dict[str, int], kinds=TESTS
    ) -> dict[str, Any]:
        """Step 4 for one description: images from base prompt + description, and the tests of ``kinds``."""
        base_prompt = target.base_prompt(self.settings.base_template)
        prompt = self.settings.description_template.format(base=base_prompt, description=description)
        keys = self._ensure_images(target, prompt, f"d{description_key(description)}", self.settings.n_test)
        predicted = self._predict(model, keys)
        labels = [predicted[k] for k in keys]
        base_labels = list(base.values())
        events = {
            TARGET_LABEL_TEST: lambda labels: sum(1 for p in labels if p == target_label),
            TOTAL_TEST: lambda labels: sum(1 for p in labels if p != target.label),
        }
        tests = {}
        for kind in kinds:
            counts = EventCounts(events[kind](labels), len(labels))
            tests[kind] = {**rate_increase_test(counts, EventCounts(events[kind](base_labels), len(base_labels)))}
            if kind == TARGET_LABEL_TEST:
                tests[kind]["label"] = target_label
        confusions = Counter(p for p in labels if p != target.label)
        return {
            "prompt": prompt,
            "keys": keys,
            "confusions": {str(label): n for label, n in sorted(confusions.items())},
            "tests": tests,
        }

    def _refine(self, model: str, found: list[tuple[ClassTarget, dict[str, int], dict[str, Any]]]) -> dict[str, Any]:
        """Step 5: the refinement family of one model: every variant of every discovery on its discovering tests,
        against base and against the full description."""
        s = self.settings
        family: dict[tuple, dict[str, Any]] = {}  # one test per (class, variant, kind[, target label][, full])
        for target, base, hypothesis in found:
            hypothesis["refinement"] = []
            kinds = hypothesis["discovered_by"]
            for variant in sub_descriptions(hypothesis["description"]):
                result = self._test(model, target, variant, hypothesis["target_label"], base, kinds)
                entry: dict[str, Any] = {"description": variant, "tests": {}, "versus_full": {}}
                for kind in kinds:
                    label = hypothesis["target_label"] if kind == TARGET_LABEL_TEST else None
                    key = (target.label, variant, kind, label)
                    family.setdefault(key, result["tests"][kind])
                    entry["tests"][kind] = family[key]
                    full = hypothesis["tests"][kind]
                    lower = rate_decrease_test(
                        EventCounts(result["tests"][kind]["count"], result["tests"][kind]["n"]),
                        EventCounts(full["count"], full["n"]),
                    )
                    family.setdefault((*key, hypothesis["description"]), lower)
                    entry["versus_full"][kind] = family[(*key, hypothesis["description"])]
                hypothesis["refinement"].append(entry)
        tests = list(family.values())
        q_values = benjamini_hochberg([t["p_value"] for t in tests])
        for test, q in zip(tests, q_values, strict=True):
            test["q_value"] = q
        for _, _, hypothesis in found:
            best: tuple[int, float, int] | None = None
            for position, entry in enumerate(hypothesis["refinement"]):
                passed = [t for t in entry["tests"].values() if t["q_value"] < s.alpha and t["rate"] > t["base_rate"]]
                lower = [
                    t for t in entry["versus_full"].values() if t["q_value"] < s.alpha and t["rate"] < t["full_rate"]
                ]
                entry["significant"] = bool(passed)
                entry["lower_than_full"] = bool(lower)
                entry["keeps_failure"] = bool(passed) and not lower
                if entry["keeps_failure"]:
                    candidate = (len(entry["description"].split()), min(t["q_value"] for t in passed), position)
                    if best is None or candidate < best:
                        best = candidate
            chosen = hypothesis["refinement"][best[2]] if best else None
            hypothesis["refined_description"] = chosen["description"] if chosen else hypothesis["description"]
            hypothesis["refined"] = {
                "description": hypothesis["refined_description"],
                "shortened": chosen is not None,
                "tests": {kind: _rate_summary(chosen["tests"][kind] if chosen else hypothesis["tests"][kind])
                          for kind in hypothesis["discovered_by"]},
                "versus_full": {kind: _rate_summary(chosen["versus_full"][kind]) for kind in hypothesis["discovered_by"]}
                if chosen else {},
            }  # fmt: skip
        return {
            "tests": len(tests),
            "bh_cutoff_p": bh_cutoff([t["p_value"] for t in tests], q_values, s.alpha),
        }

    def run(self) -> dict[str, Any]:
        s = self.settings
        base_keys = {
            t.key: self._ensure_images(t, t.base_prompt(s.base_template), "base", s.n_base) for t in self.classes
        }
        results: dict[str, Any] = {}
        for model in sorted(self.c.classifiers):
            per_class: list[dict[str, Any]] = []
            family: list[dict[str, Any]] = []  # both tests of every hypothesis of this model
            bases: dict[int, dict[str, int]] = {}
            for target in self.classes:
                base = self._predict(model, base_keys[target.key])
                bases[target.label] = base
                wrong = Counter(p for p in base.values() if p != target.label)
                failures = sum(wrong.values())
                clusters, hypotheses = self._hypotheses(model, target, base)
                for hypothesis in hypotheses:
                    hypothesis.update(
                        self._test(model, target, hypothesis["description"], hypothesis["target_label"], base)
                    )
                    family += [hypothesis["tests"][kind] for kind in TESTS]
                per_class.append({
                    "label": target.label,
                    "class_name": target.name,
                    "superclass": target.superclass,
                    "base": {"failures": failures, "n": len(base), "rate": failures / len(base),
                             "interval": clopper_pearson(failures, len(base)),
                             "confusions": {str(label): n for label, n in sorted(wrong.items())}},
                    "clusters": clusters,
                    "hypotheses": hypotheses,
                })  # fmt: skip
            q_values = benjamini_hochberg([t["p_value"] for t in family])
            for test, q in zip(family, q_values, strict=True):
                test["q_value"] = q
            found = []
            for entry, target in zip(per_class, self.classes, strict=True):
                for hypothesis in entry["hypotheses"]:
                    hypothesis["discovered_by"] = [
                        kind for kind in TESTS
                        if hypothesis["tests"][kind]["q_value"] < s.alpha
                        and hypothesis["tests"][kind]["rate"] > hypothesis["tests"][kind]["base_rate"]
                    ]  # fmt: skip
                    hypothesis["discovered"] = bool(hypothesis["discovered_by"])
                    if hypothesis["discovered"]:
                        found.append((target, bases[target.label], hypothesis))
            if s.refine:
                refinements = self._refine(model, found)
            else:
                refinements = {"tests": 0, "bh_cutoff_p": 0.0}
                for _, _, hypothesis in found:
                    hypothesis["refined_description"] = hypothesis["description"]
                    hypothesis["refined"] = {
                        "description": hypothesis["description"], "shortened": False, "versus_full": {},
                        "tests": {kind: _rate_summary(hypothesis["tests"][kind]) for kind in hypothesis["discovered_by"]},
                    }  # fmt: skip
            results[model] = {
                "classes": per_class,
                "families": {
                    "descriptions": {"tests": len(family), "bh_cutoff_p": bh_cutoff(
                        [t["p_value"] for t in family], q_values, s.alpha)},
                    "refinements": refinements,
                },
            }  # fmt: skip
        return {"models": results}


def _rate_summary(test: dict[str, Any]) -> dict[str, Any]:
    """The figures of one test that a summary reports (rate, the rate it is compared with, p and q)."""
    compared = "full_rate" if "full_rate" in test else "base_rate"
    return {"rate": test["rate"], compared: test[compared], "p_value": test["p_value"], "q_value": test["q_value"]}


def discovered(document: dict[str, Any]) -> list[dict[str, Any]]:
    """Flat list of discovered failures (one per model, class and distinct description) with their statistics."""
    rows = []
    for model, result in document["models"].items():
        for entry in result["classes"]:
            for hypothesis in entry.get("hypotheses", []):
                if not hypothesis.get("discovered"):
                    continue
                target, total = hypothesis["tests"][TARGET_LABEL_TEST], hypothesis["tests"][TOTAL_TEST]
                rows.append({
                    "model": model, "label": entry["label"], "class_name": entry["class_name"],
                    "description": hypothesis["description"], "refined_description": hypothesis["refined_description"],
                    "discovered_by": hypothesis["discovered_by"], "target_label": hypothesis["target_label"],
                    "target_rate": target["rate"], "target_base_rate": target["base_rate"],
                    "target_q_value": target["q_value"], "target_p_value": target["p_value"],
                    "rate": total["rate"], "base_rate": total["base_rate"], "interval": total["interval"],
                    "q_value": total["q_value"], "p_value": total["p_value"], "n": total["n"],
                    "refined": hypothesis.get("refined"), "keys": hypothesis["keys"],
                })  # fmt: skip
    return rows


def describe_failures(
    samples: dict[str, tuple[int, str]],
    predicted: dict[str, int],
    embedder: Callable[[list[str]], Any],
    label_name: Callable[[int], str],
    merger: Any = None,
    settings: ClusteringSettings | None = None,
) -> list[dict[str, Any]]:
    """Failures of already existing samples, clustered and described per class (no generation, so no test).

    Args:
        samples: key -> (true label, caption) of every sample.
        predicted: key -> the model's predicted label.
        embedder: callable(keys) -> array [n, d] of the samples' image embeddings.
        label_name: label -> class name.

    Returns:
        Per class: ``{label, class_name, n, failures, clusters: [{members, predicted, target_label, description}]}``.
    """
    settings = settings or ClusteringSettings()
    merger = merger or KeywordCaptionMerger()
    per_class = []
    for label in sorted({true for true, _ in samples.values()}):
        in_class = sorted(k for k, (true, _) in samples.items() if true == label)
        failing = [k for k in in_class if predicted[k] != label]
        entry: dict[str, Any] = {
            "label": label, "class_name": label_name(label), "n": len(in_class), "failures": len(failing),
            "clusters": [],
        }  # fmt: skip
        if failing:
            for cluster in cluster_failures(failing, [predicted[k] for k in failing], embedder(failing), settings):
                entry["clusters"].append({
                    "members": cluster.members,
                    "predicted": {str(k): v for k, v in cluster.predicted.items()},
                    "target_label": cluster.target_label,
                    "target_name": label_name(cluster.target_label),
                    "description": merger.merge([samples[k][1] for k in cluster.members], label_name(label)),
                })  # fmt: skip
        per_class.append(entry)
    return per_class
