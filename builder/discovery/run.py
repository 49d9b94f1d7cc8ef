"""``lance-cf discover``: find, in words, the situations in which a model fails more than it should (Wiles et al.).

The method is ``lance_pipeline.discovery.method``; this module owns the I/O and bookkeeping around it:

1. baseline: for each class, ``n_base`` images from "a realistic photograph of a {class} ({superclass})", classified
   by every target model: base failure rate and confusions per (model, class);
2. per (model, class): the failing images clustered (predicted label, then CLIP embedding), each cluster captioned
   (the LANCE captioner, or a stand-in) and its captions merged into one description;
3. every description tested with ``n_test`` new images from base prompt + description (Fisher exact, one-sided);
   Benjamini-Hochberg over all descriptions of one model; a description whose q-value is below ``alpha`` and whose
   failure rate is above base is a *discovered failure*;
4. discovered descriptions refined word by word (variants significant at the BH cut-off of step 3);
5. ``discoveries.json``, ``report.html`` with galleries and a plot, and the images of each discovery.

Every image's seed is derived from (seed, key) and keys are made from names, never from order. Progress is stored in
a SQLite ledger in ``OUTPUT/.lance-cf/discovery.sqlite`` (one transaction per generated or classified batch, images
as PNG through the ledger's pickle-free codec), so a killed discovery resumes without regenerating or re-classifying
finished images and ends with the same ``discoveries.json``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lance_pipeline.discovery.method import (
    BASE_TEMPLATE,
    DESCRIPTION_TEMPLATE,
    ClusteringSettings,
    FailureCounts,
    benjamini_hochberg,
    clopper_pearson,
    cluster_failures,
    refine_description,
    test_description,
)

logger = logging.getLogger(__name__)

DISCOVERIES_SCHEMA = "lance-cf/discoveries"
DISCOVERIES_SCHEMA_VERSION = 1
LEDGER = ".lance-cf/discovery.sqlite"


@dataclass
class DiscoverySettings:
    """Everything that decides a discovery's result (recorded in discoveries.json)."""

    n_base: int = 100
    n_test: int = 100
    alpha: float = 0.05
    refine: bool = True
    base_template: str = BASE_TEMPLATE
    description_template: str = DESCRIPTION_TEMPLATE
    clustering: ClusteringSettings = field(default_factory=ClusteringSettings)
    max_descriptions_per_class: int = 5
    seed: int = 0
    batch_size: int = 8

    def __post_init__(self) -> None:
        for name in ("n_base", "n_test", "max_descriptions_per_class", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} {value!r}: expected a positive integer")
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha {self.alpha!r}: expected a level in (0, 1)")
        for name in ("base_template", "description_template"):
            if "{" not in getattr(self, name):
                raise ValueError(f"{name}: needs placeholders ({BASE_TEMPLATE!r}, {DESCRIPTION_TEMPLATE!r})")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["clustering"] = self.clustering.to_dict()
        return data


@dataclass
class DiscoveryComponents:
    """The models a discovery uses; real ones for a real run, stand-ins for the offline demo (``describe`` says)."""

    generator: Any  # .generate(prompts, seeds) -> PIL images; .describe()
    classifiers: dict[str, Any]  # model name -> callable(list[PIL]) -> list[int] predicted labels
    captioner: Any  # .caption(images, class_names) -> list[str]; .describe()
    embedder: Any  # callable(list[PIL]) -> array [n, d]
    classifier_info: dict[str, Any] = field(default_factory=dict)
    merger: Any = None  # .merge(captions, class_name, superclass) -> str; None: the keyword-frequency merge


def derive_seed(seed: int, key: str) -> int:
    digest = hashlib.sha256(f"lance-cf:discover:{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def description_key(description: str) -> str:
    return hashlib.sha256(description.encode()).hexdigest()[:10]


class DiscoveryLedger:
    """Generated images, predictions and captions, one transaction per batch."""

    def __init__(self, path: Path, *, shared_across_threads: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # A reader used from the builder's decode thread (builder.discovery.source) serialises its calls itself.
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=not shared_across_threads)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(
            """
            CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
            CREATE TABLE IF NOT EXISTS images (key TEXT PRIMARY KEY, prompt TEXT NOT NULL, seed INTEGER NOT NULL,
                                               label INTEGER NOT NULL, payload BLOB NOT NULL);
            CREATE TABLE IF NOT EXISTS predictions (model TEXT NOT NULL, key TEXT NOT NULL, predicted INTEGER NOT NULL,
                                                    PRIMARY KEY (model, key));
            CREATE TABLE IF NOT EXISTS captions (key TEXT PRIMARY KEY, caption TEXT NOT NULL);
            """
        )

    def close(self) -> None:
        self.db.close()

    def check_settings(self, fingerprint: str) -> None:
        row = self.db.execute("SELECT value FROM meta WHERE name='settings'").fetchone()
        if row is None:
            self.db.execute("INSERT INTO meta VALUES ('settings', ?)", (fingerprint,))
        elif row[0] != fingerprint:
            raise ValueError("this --output holds a discovery with other settings; use a new --output directory")

    def have_images(self, keys: list[str]) -> set[str]:
        found: set[str] = set()
        for start in range(0, len(keys), 500):
            chunk = keys[start : start + 500]
            marks = ",".join("?" * len(chunk))
            found |= {r[0] for r in self.db.execute(f"SELECT key FROM images WHERE key IN ({marks})", chunk)}
        return found

    def add_images(self, rows: list[tuple[str, str, int, int, Any]]) -> None:
        from builder.ledger import encode_payload

        self.db.execute("BEGIN")
        self.db.executemany(
            "INSERT OR REPLACE INTO images VALUES (?, ?, ?, ?, ?)",
            [(k, p, s, label, encode_payload({"image": im})) for k, p, s, label, im in rows],
        )
        self.db.execute("COMMIT")

    def images(self, keys: list[str]) -> list[Any]:
        from builder.ledger import decode_payload

        out = []
        for key in keys:
            row = self.db.execute("SELECT payload FROM images WHERE key=?", (key,)).fetchone()
            if row is None:
                raise KeyError(key)
            out.append(decode_payload(row[0])["image"])
        return out

    def predictions(self, model: str, keys: list[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        for key in keys:
            row = self.db.execute("SELECT predicted FROM predictions WHERE model=? AND key=?", (model, key)).fetchone()
            if row is not None:
                out[key] = row[0]
        return out

    def add_predictions(self, model: str, predicted: dict[str, int]) -> None:
        self.db.execute("BEGIN")
        self.db.executemany(
            "INSERT OR REPLACE INTO predictions VALUES (?, ?, ?)", [(model, k, int(v)) for k, v in predicted.items()]
        )
        self.db.execute("COMMIT")

    def captions(self, keys: list[str]) -> dict[str, str]:
        out = {}
        for key in keys:
            row = self.db.execute("SELECT caption FROM captions WHERE key=?", (key,)).fetchone()
            if row is not None:
                out[key] = row[0]
        return out

    def add_captions(self, captions: dict[str, str]) -> None:
        self.db.execute("BEGIN")
        self.db.executemany("INSERT OR REPLACE INTO captions VALUES (?, ?)", list(captions.items()))
        self.db.execute("COMMIT")


@dataclass
class ClassTarget:
    label: int
    name: str
    superclass: str
    key: str  # name-derived, [A-Za-z0-9_-]

    def base_prompt(self, template: str) -> str:
        return template.format(class_name=self.name, superclass=self.superclass)


class Discovery:
    """One discovery run over classes and models; ``run()`` returns the discoveries document."""

    def __init__(
        self,
        output: Path,
        classes: list[ClassTarget],
        components: DiscoveryComponents,
        settings: DiscoverySettings,
        progress: Any = None,
    ) -> None:
        self.output = Path(output)
        self.classes = classes
        self.c = components
        self.settings = settings
        self.progress = progress
        if components.merger is None:
            from lance_pipeline.discovery.method import KeywordCaptionMerger

            components.merger = KeywordCaptionMerger()
        self.ledger = DiscoveryLedger(self.output / LEDGER)
        fingerprint = json.dumps(
            {"settings": settings.to_dict(), "classes": [asdict(t) for t in classes], "models": sorted(components.classifiers),
             "generator": components.generator.describe(), "captioner": components.captioner.describe(),
             "merger": components.merger.describe().get("kind")},
            sort_keys=True,
        )  # fmt: skip
        self.ledger.check_settings(fingerprint)

    # -- images and predictions (resumable) ----------------------------------------------------------------------
    def _ensure_images(self, target: ClassTarget, prompt: str, tag: str, n: int) -> list[str]:
        keys = [f"{target.key}_{tag}_{i:03d}" for i in range(n)]
        have = self.ledger.have_images(keys)
        missing = [k for k in keys if k not in have]
        size = self.settings.batch_size
        for start in range(0, len(missing), size):
            chunk = missing[start : start + size]
            seeds = [derive_seed(self.settings.seed, k) for k in chunk]
            images = self.c.generator.generate([prompt] * len(chunk), seeds)
            self.ledger.add_images(
                [(k, prompt, s, target.label, im) for k, s, im in zip(chunk, seeds, images, strict=True)]
            )
            if self.progress is not None:
                self.progress.update(len(chunk))
        return keys

    def _predict(self, model: str, keys: list[str]) -> dict[str, int]:
        known = self.ledger.predictions(model, keys)
        missing = [k for k in keys if k not in known]
        size = self.settings.batch_size
        for start in range(0, len(missing), size):
            chunk = missing[start : start + size]
            predicted = dict(zip(chunk, self.c.classifiers[model](self.ledger.images(chunk)), strict=True))
            self.ledger.add_predictions(model, predicted)
            known.update(predicted)
        return known

    def _counts(self, model: str, target: ClassTarget, keys: list[str]) -> tuple[FailureCounts, dict[int, int]]:
        predicted = self._predict(model, keys)
        wrong = [predicted[k] for k in keys if predicted[k] != target.label]
        confusions: dict[int, int] = {}
        for label in wrong:
            confusions[label] = confusions.get(label, 0) + 1
        return FailureCounts(len(wrong), len(keys)), confusions

    def _test(self, model: str, target: ClassTarget, description: str, base: FailureCounts) -> dict[str, Any]:
        base_prompt = target.base_prompt(self.settings.base_template)
        prompt = self.settings.description_template.format(base=base_prompt, description=description)
        keys = self._ensure_images(target, prompt, f"d{description_key(description)}", self.settings.n_test)
        counts, confusions = self._counts(model, target, keys)
        return {**test_description(counts, base), "prompt": prompt, "keys": keys, "confusions": confusions}

    # -- the method ----------------------------------------------------------------------------------------------
    def _describe_clusters(self, model: str, target: ClassTarget, base_keys: list[str]) -> list[dict[str, Any]]:
        predicted = self._predict(model, base_keys)
        failing = [k for k in base_keys if predicted[k] != target.label]
        if not failing:
            return []
        embeddings = self.c.embedder(self.ledger.images(failing))
        clusters = cluster_failures(failing, [predicted[k] for k in failing], embeddings, self.settings.clustering)
        described = []
        for cluster in clusters[: self.settings.max_descriptions_per_class]:
            cached = self.ledger.captions(cluster.members)
            todo = [k for k in cluster.members if k not in cached]
            if todo:
                new = self.c.captioner.caption(self.ledger.images(todo), [target.name] * len(todo))
                self.ledger.add_captions(dict(zip(todo, new, strict=True)))
                cached.update(zip(todo, new, strict=True))
            captions = [cached[k] for k in cluster.members]
            description = self.c.merger.merge(captions, target.name, target.superclass)
            described.append({
                "predicted_label": cluster.predicted_label,
                "members": cluster.members,
                "captions": captions,
                "description": description,
            })  # fmt: skip
        return described

    def run(self) -> dict[str, Any]:
        s = self.settings
        base_keys = {
            t.key: self._ensure_images(t, t.base_prompt(s.base_template), "base", s.n_base) for t in self.classes
        }
        results: dict[str, Any] = {}
        for model in sorted(self.c.classifiers):
            per_class: list[dict[str, Any]] = []
            tests: list[dict[str, Any]] = []  # every description tested for this model (BH family)
            for target in self.classes:
                base, confusions = self._counts(model, target, base_keys[target.key])
                entry = {
                    "label": target.label,
                    "class_name": target.name,
                    "superclass": target.superclass,
                    "base": {"failures": base.failures, "n": base.n, "rate": base.rate,
                             "interval": clopper_pearson(base.failures, base.n), "confusions": confusions},
                    "clusters": [],
                }  # fmt: skip
                for cluster in self._describe_clusters(model, target, base_keys[target.key]):
                    if cluster["description"]:
                        cluster["test"] = self._test(model, target, cluster["description"], base)
                        tests.append(cluster)
                    else:
                        cluster["test"] = None  # nothing shared by the captions: nothing to test
                    entry["clusters"].append(cluster)
                per_class.append(entry)
            q_values = benjamini_hochberg([c["test"]["p_value"] for c in tests])
            significant_p = [c["test"]["p_value"] for c, q in zip(tests, q_values, strict=True) if q < s.alpha]
            cutoff = max(significant_p) if significant_p else 0.0  # the BH cut-off on raw p-values
            for cluster, q in zip(tests, q_values, strict=True):
                test = cluster["test"]
                test["q_value"] = q
                cluster["discovered"] = bool(q < s.alpha and test["rate"] > test["base_rate"])
            for entry, target in zip(per_class, self.classes, strict=True):
                base = FailureCounts(entry["base"]["failures"], entry["base"]["n"])
                for cluster in entry["clusters"]:
                    if cluster.get("discovered") and s.refine:
                        refinement = refine_description(
                            cluster["description"],
                            lambda d, t=target, b=base, m=model: self._test(m, t, d, b),
                            alpha=cutoff,
                        )
                        cluster["refined_description"] = refinement.description
                        cluster["refinement"] = [
                            {"description": st.description, "significant": st.significant,
                             **{k: st.result[k] for k in ("failures", "n", "rate", "p_value", "interval")}}
                            for st in refinement.steps
                        ]  # fmt: skip
                    elif cluster.get("discovered"):
                        cluster["refined_description"] = cluster["description"]
            results[model] = {"classes": per_class, "bh_cutoff_p": cutoff, "descriptions_tested": len(tests)}
        document = {
            "schema": DISCOVERIES_SCHEMA,
            "schema_version": DISCOVERIES_SCHEMA_VERSION,
            "settings": s.to_dict(),
            "generator": self.c.generator.describe(),
            "captioner": self.c.captioner.describe(),
            "merger": self.c.merger.describe(),
            "classifiers": self.c.classifier_info,
            "models": results,
        }
        return document

    def close(self) -> None:
        self.ledger.close()


def discovered(document: dict[str, Any]) -> list[dict[str, Any]]:
    """Flat list of discovered failures: model, class, description, refined description, statistics."""
    rows = []
    for model, result in document["models"].items():
        for entry in result["classes"]:
            for cluster in entry["clusters"]:
                if cluster.get("discovered"):
                    test = cluster["test"]
                    rows.append({
                        "model": model, "label": entry["label"], "class_name": entry["class_name"],
                        "description": cluster["description"], "refined_description": cluster["refined_description"],
                        "rate": test["rate"], "base_rate": test["base_rate"], "interval": test["interval"],
                        "p_value": test["p_value"], "q_value": test["q_value"], "n": test["n"],
                        "predicted_label": cluster["predicted_label"], "keys": test["keys"],
                    })  # fmt: skip
    return rows


def describe_release_failures(
    release_dir: Path,
    classifiers: dict[str, Any],
    embedder: Any,
    *,
    config: str = "counterfactual",
    settings: ClusteringSettings | None = None,
    merger: Any = None,
    batch_size: int = 32,
) -> dict[str, Any]:
    """Discovery on an existing release: cluster each model's failing samples of ``config`` and describe them.

    Nothing is generated, so nothing is tested: per (model, class), the samples of ``config`` the model gets wrong are
    clustered (predicted label, then embedding) and each cluster is described by merging its samples' edited captions
    (LANCE writes one per counterfactual), with the edit types and how many of those samples' originals the model
    got right (failures the edit caused). Complements ``lance-cf eval``'s per-class insights. The release is read
    through the release-format unit (local directory; ``verify`` it first for integrity).

    Args:
        release_dir: A release directory.
        classifiers: model name -> callable(list[PIL]) -> predicted labels.
        embedder: callable(list[PIL]) -> array [n, d].
    """
    import io

    from PIL import Image

    from builder import release_format as rf
    from lance_pipeline.discovery.method import KeywordCaptionMerger

    manifest = rf.load_manifest(release_dir)
    if config not in manifest.configs:
        raise ValueError(f"release {release_dir}: has no config {config!r} (configs: {', '.join(manifest.configs)})")
    settings = settings or ClusteringSettings()
    merger = merger or KeywordCaptionMerger()
    ext = manifest.image_format
    names = list(manifest.label_space.get("names") or [])

    def load(config_name: str) -> dict[str, tuple[dict[str, Any], Any]]:
        paths = [Path(release_dir) / s.path for s in manifest.shards if s.config == config_name]
        out = {}
        for key, members in rf.read_samples(paths).items():
            meta = json.loads(members["json"])
            out[key] = (meta, Image.open(io.BytesIO(members[ext])).convert("RGB"))
        return out

    def label_name(label: int) -> str:
        return names[label] if 0 <= label < len(names) else str(label)

    samples = load(config)
    originals = load("original") if "original" in manifest.configs else {}
    keys = sorted(samples)
    results: dict[str, Any] = {}
    for model, classify in sorted(classifiers.items()):
        predicted: dict[str, int] = {}
        for start in range(0, len(keys), batch_size):
            chunk = keys[start : start + batch_size]
            predicted.update(zip(chunk, classify([samples[k][1] for k in chunk]), strict=True))
        original_ok: dict[str, bool] = {}
        okeys = sorted(originals)
        for start in range(0, len(okeys), batch_size):
            chunk = okeys[start : start + batch_size]
            labels = classify([originals[k][1] for k in chunk])
            original_ok.update({k: p == originals[k][0]["label"] for k, p in zip(chunk, labels, strict=True)})
        per_class = []
        for label in sorted({samples[k][0]["label"] for k in keys}):
            in_class = [k for k in keys if samples[k][0]["label"] == label]
            failing = [k for k in in_class if predicted[k] != label]
            entry: dict[str, Any] = {
                "label": label, "class_name": label_name(label), "n": len(in_class), "failures": len(failing),
                "clusters": [],
            }  # fmt: skip
            if failing:
                embeddings = embedder([samples[k][1] for k in failing])
                for cluster in cluster_failures(failing, [predicted[k] for k in failing], embeddings, settings):
                    metas = [samples[k][0] for k in cluster.members]
                    captions = [m.get("edited_caption") or m.get("caption") or "" for m in metas]
                    edit_types: dict[str, int] = {}
                    for m in metas:
                        edit_types[str(m.get("edit_type"))] = edit_types.get(str(m.get("edit_type")), 0) + 1
                    entry["clusters"].append({
                        "predicted_label": cluster.predicted_label,
                        "predicted_name": label_name(cluster.predicted_label),
                        "members": cluster.members,
                        "description": merger.merge(captions, label_name(label)),
                        "edit_types": edit_types,
                        "caused_by_edit": sum(1 for m in metas if original_ok.get(m["source_key"]) is True),
                    })  # fmt: skip
            per_class.append(entry)
        results[model] = {"classes": per_class}
    return {
        "schema": DISCOVERIES_SCHEMA,
        "schema_version": DISCOVERIES_SCHEMA_VERSION,
        "mode": "release",
        "release": {
            "name": manifest.name,
            "version": manifest.version,
            "config": config,
            "manifest_sha256": rf.read_manifest_dict(release_dir)["manifest_sha256"],
        },
        "settings": {"clustering": settings.to_dict()},
        "merger": merger.describe(),
        "models": results,
    }
