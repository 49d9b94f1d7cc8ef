"""``lance-cf discover``'s I/O and bookkeeping around the method (``lance_pipeline.discovery.search``, Wiles et al.).

The method finds the failures; this module keeps its work and writes its results:

- ``DiscoveryLedger``: generated images (PNG through the ledger's pickle-free codec), predictions and captions in
  ``OUTPUT/.lance-cf/discovery.sqlite``, one transaction per batch, so a killed discovery resumes without
  regenerating or re-classifying anything finished and ends with the same ``discoveries.json``;
- ``Discovery``: the ledger, a check that the output holds no discovery with other settings, then the search;
- ``describe_release_failures``: discovery over an existing release (its samples read through the release format).
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from builder import release_format as rf
from builder.ledger import decode_payload, encode_payload
from lance_pipeline.discovery.clustering import ClusteringSettings
from lance_pipeline.discovery.descriptions import KeywordCaptionMerger
from lance_pipeline.discovery.search import (
    ClassTarget,
    DiscoveryComponents,
    DiscoverySettings,
    FailureSearch,
    describe_failures,
)
from lance_pipeline.readers import load_json

DISCOVERIES_SCHEMA = "lance-cf/discoveries"
# 2: hypotheses (one per distinct description) with a target-label and a total-failure test, clustering over all
# failures of a class, refinements in their own corrected family.
# 3: each refinement variant also tested against the full description (``versus_full``, ``lower_than_full``,
# ``keeps_failure``); the hypothesis's ``refined`` reports the chosen variant's rates and q-values.
DISCOVERIES_SCHEMA_VERSION = 3
LEDGER = ".lance-cf/discovery.sqlite"


def settings_fingerprint(
    classes: list[ClassTarget], components: DiscoveryComponents, settings: DiscoverySettings
) -> str:
    """What a resume must share with the run it continues. Computed before any model is loaded (so from what the
    components say of themselves unloaded: a timm classifier's name and ``pretrained``, a stand-in's planted rule)."""
    return json.dumps(
        {"settings": settings.to_dict(), "classes": [asdict(t) for t in classes],
         "models": {name: components.classifier_info.get(name) for name in sorted(components.classifiers)},
         "generator": components.generator.describe(), "captioner": components.captioner.describe(),
         "merger": (components.merger.describe().get("kind") if components.merger is not None
                    else "keyword_frequency")},
        sort_keys=True,
    )  # fmt: skip


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
        self.db.execute("BEGIN")
        self.db.executemany(
            "INSERT OR REPLACE INTO images VALUES (?, ?, ?, ?, ?)",
            [(k, p, s, label, encode_payload({"image": im})) for k, p, s, label, im in rows],
        )
        self.db.execute("COMMIT")

    def images(self, keys: list[str]) -> list[Any]:
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


class Discovery:
    """One discovery run into ``output``: the resumable ledger around ``FailureSearch``.

    The output's settings are checked before ``components.load()`` runs, so a wrong ``--output`` costs no model load.
    """

    def __init__(
        self,
        output: Path,
        classes: list[ClassTarget],
        components: DiscoveryComponents,
        settings: DiscoverySettings,
        progress: Any = None,
    ) -> None:
        self.output = Path(output)
        self.settings = settings
        self.components = components
        self.ledger = DiscoveryLedger(self.output / LEDGER)
        try:
            self.ledger.check_settings(settings_fingerprint(classes, components, settings))
            components.load()
        except BaseException:
            self.ledger.close()
            raise
        self.search = FailureSearch(classes, components, settings, self.ledger, progress)

    def run(self) -> dict[str, Any]:
        results = self.search.run()
        c = self.components
        return {
            "schema": DISCOVERIES_SCHEMA,
            "schema_version": DISCOVERIES_SCHEMA_VERSION,
            "settings": self.settings.to_dict(),
            "generator": c.generator.describe(),
            "captioner": c.captioner.describe(),
            "merger": c.merger.describe(),
            "classifiers": c.classifier_info,
            **results,
        }

    def close(self) -> None:
        self.ledger.close()


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
    clustered (all predicted labels together, by embedding) and each cluster is described by merging its samples'
    edited captions (LANCE writes one per counterfactual), with the edit types and how many of those samples'
    originals the model got right (failures the edit caused). Complements ``lance-cf eval``'s per-class insights. The
    release is read through the release-format unit (local directory; ``verify`` it first for integrity).

    Args:
        release_dir: A release directory.
        classifiers: model name -> callable(list[PIL]) -> predicted labels.
        embedder: callable(list[PIL]) -> array [n, d].
    """
    import io

    from PIL import Image

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
            meta = load_json(members["json"], f"{config_name}/{key}.json")
            out[key] = (meta, Image.open(io.BytesIO(members[ext])).convert("RGB"))
        return out

    def label_name(label: int) -> str:
        return names[label] if 0 <= label < len(names) else str(label)

    samples = load(config)
    originals = load("original") if "original" in manifest.configs else {}
    keys = sorted(samples)
    captioned = {k: (meta["label"], meta.get("edited_caption") or meta.get("caption") or "") for k, (meta, _) in
                 samples.items()}  # fmt: skip
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
        per_class = describe_failures(
            captioned, predicted, lambda ks: embedder([samples[k][1] for k in ks]), label_name, merger, settings
        )
        for entry in per_class:
            for cluster in entry["clusters"]:
                metas = [samples[k][0] for k in cluster["members"]]
                cluster["edit_types"] = dict(sorted(Counter(str(m.get("edit_type")) for m in metas).items()))
                cluster["caused_by_edit"] = sum(1 for m in metas if original_ok.get(m["source_key"]) is True)
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
