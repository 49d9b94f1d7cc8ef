"""``discovery:DIR``: the images of a discovery's discovered failures, as a source for a normal release build.

``lance-cf discover`` writes ``DIR/discoveries.json`` and keeps every generated image in its ledger; this source lists
the test images of each discovered failure (model x class x description) so that ``build`` releases them, one config
per discovery, with the description, the probed model's prediction and the statistics in each sample's metadata. The
release is like every other (verify, publish, ``lance-cf eval`` on other models: the paper's transfer experiment).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder.discovery.run import LEDGER, DiscoveryLedger
from builder.sources import Source, SourceSample, imagenet_label_space
from lance_pipeline.discovery.search import discovered
from lance_pipeline.option_types import Options
from lance_pipeline.readers import read_json
from lance_pipeline.stage import MetadataField, ReleaseOutput, stage_options

DISCOVERY_FIELDS = {
    "discovery_config": "str",
    "discovery": "str",
    "refined_description": "str",
    "probe_model": "str",
    "probe_prediction": "int",
    "discovered_by": "str",
    "target_label": "int",
    "target_rate": "float",
    "target_base_rate": "float",
    "target_q_value": "float",
    "failure_rate": "float",
    "base_rate": "float",
    "q_value": "float",
    "prompt": "str",
}


def discovery_config_name(model: str, class_name: str, description: str, taken: set[str]) -> str:
    """A release config name for one discovery: ``[a-z0-9_]+``, bounded, unique within the release."""
    words = re.sub(r"[^a-z0-9]+", "_", f"{model} {class_name} {description}".lower()).strip("_")[:60].strip("_")
    name, n = words or "discovery", 2
    while name in taken:
        name = f"{words}_{n}"
        n += 1
    taken.add(name)
    return name


@dataclass
class DiscoverySourceOptions(Options):
    """A discovery's output directory takes no options: what it releases is what the discovery found."""


class DiscoverySource(Source):
    """Discovered-failure images from a ``lance-cf discover`` output directory (PNG bytes from its ledger)."""

    fields = DISCOVERY_FIELDS
    # Its images are generated: a build releases them only through a safety-checker stage (or says `safety: off`).
    generated_images = True
    outputs = (
        ReleaseOutput(
            config="discovery",
            field="image",
            key_suffix=None,
            config_field="discovery_config",
            description="generated images of a failure discovered by lance-cf discover (Wiles et al.)",
            fields=(
                MetadataField("discovery", "string", description="the description that was tested"),
                MetadataField(
                    "refined_description",
                    "string",
                    description="the shortest word-dropped variant still significant and not significantly less "
                    "often failed than the description (the description itself when none is)",
                ),
                MetadataField("probe_model", "string", description="the model the failure was discovered for"),
                MetadataField("probe_prediction", "int64", description="that model's prediction for this image"),
                MetadataField(
                    "discovered_by",
                    "string",
                    description="the test(s) that found it: target_label, total, or both (comma-separated)",
                ),
                MetadataField("target_label", "int64", description="the wrong label the description's test counts"),
                MetadataField("target_rate", "float64", description="rate of the target label under the description"),
                MetadataField("target_base_rate", "float64", description="rate of the target label at base"),
                MetadataField("target_q_value", "float64", description="Benjamini-Hochberg q-value, target-label test"),
                MetadataField("failure_rate", "float64", description="the description's total failure rate"),
                MetadataField("base_rate", "float64", description="the class's base failure rate"),
                MetadataField("q_value", "float64", description="Benjamini-Hochberg q-value, total-failure test"),
                MetadataField("prompt", "string", description="the generation prompt"),
            ),
        ),
    )

    options_class = DiscoverySourceOptions

    def __init__(self, spec: str, path: str, options: DiscoverySourceOptions | None = None, /, **values: Any):
        super().__init__(spec=spec, kind="discovery", options=stage_options(type(self), options, values))
        root = Path(path)
        document_path = root / "discoveries.json"
        if not document_path.is_file() or not (root / LEDGER).is_file():
            raise ValueError(f"source {spec!r}: {path} is not a lance-cf discover output (no discoveries.json)")
        document = read_json(document_path)
        self.label_space = imagenet_label_space()
        self.license = "Generated images; the generator's licence applies."
        import threading

        self._ledger = DiscoveryLedger(root / LEDGER, shared_across_threads=True)
        self._lock = threading.Lock()  # the builder reads on its decode thread
        self._fields: dict[str, dict[str, Any]] = {}
        self._image_key: dict[str, str] = {}
        self.config_names: list[str] = []
        self.summaries: list[dict[str, Any]] = []
        taken: set[str] = set()
        samples = []
        for row in discovered(document):
            config = discovery_config_name(row["model"], row["class_name"], row["description"], taken)
            self.config_names.append(config)
            self.summaries.append({  # one row of the card's table of discovered failures
                "config": config, "model": row["model"], "label": int(row["label"]), "class_name": row["class_name"],
                "description": row["description"], "refined_description": row["refined_description"],
                "discovered_by": list(row["discovered_by"]), "target_label": int(row["target_label"]),
                "target_rate": row["target_rate"], "target_base_rate": row["target_base_rate"],
                "target_q_value": row["target_q_value"], "rate": row["rate"], "base_rate": row["base_rate"],
                "q_value": row["q_value"], "n": row["n"], "refined": row.get("refined"),
            })  # fmt: skip
            predictions = self._ledger.predictions(row["model"], row["keys"])
            prompts = dict(
                self._ledger.db.execute(
                    f"SELECT key, prompt FROM images WHERE key IN ({','.join('?' * len(row['keys']))})", row["keys"]
                ).fetchall()
            )
            for image_key in row["keys"]:
                key = f"{image_key}_{config}"[:200]
                samples.append(SourceSample(key, int(row["label"]), f"{config} / {image_key}"))
                self._image_key[key] = image_key
                self._fields[key] = {
                    "discovery_config": config,
                    "discovery": row["description"],
                    "refined_description": row["refined_description"],
                    "probe_model": row["model"],
                    "probe_prediction": int(predictions[image_key]),
                    "discovered_by": ",".join(row["discovered_by"]),
                    "target_label": int(row["target_label"]),
                    "target_rate": float(row["target_rate"]),
                    "target_base_rate": float(row["target_base_rate"]),
                    "target_q_value": float(row["target_q_value"]),
                    "failure_rate": float(row["rate"]),
                    "base_rate": float(row["base_rate"]),
                    "q_value": float(row["q_value"]),
                    "prompt": prompts[image_key],
                }
        if not samples:
            raise ValueError(f"source {spec!r}: the discovery found no failure; there is nothing to release")
        self.samples = sorted(samples, key=lambda s: s.key)
        settings = document["settings"]
        self.discovery = {  # how the failures were found: the card's deviations from the paper are decided from it
            **{k: settings[k] for k in ("n_base", "n_test", "alpha", "refine", "max_descriptions_per_class")},
            "clustering": settings["clustering"]["method"],
            "merger": document["merger"].get("kind"),
            "stand_in": bool(document["generator"].get("stand_in") or document["captioner"].get("stand_in")),
            "schema_version": document.get("schema_version"),
            "discoveries": self.summaries,
        }

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "discovery": self.discovery}

    def read(self, sample: SourceSample) -> bytes:
        import io

        with self._lock:
            image = self._ledger.images([self._image_key[sample.key]])[0]
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return buffer.getvalue()

    def record_fields(self, sample: SourceSample) -> dict[str, Any]:
        return dict(self._fields[sample.key])
