"""The contract between the builder and the method stages.

A stage is one step of LANCE (Prabhu et al., NeurIPS 2023, Algorithm 1): captioning, caption
perturbation, label-preservation checks, inversion, editing. The builder owns all I/O and bookkeeping
(sources, ledger, shards, manifest); a stage only turns plain records into plain updates, in batches.

Life cycle, driven by the builder:

1. The stage object is created from its options (no weights are touched: ``--help``, config validation
   and listing run anywhere).
2. ``load(device)`` materialises models once per build.
3. ``process(records)`` is called once per batch. ``records`` is a list of dicts holding at least the
   builder's fields (see ``SOURCE_FIELDS``) plus every field earlier stages returned. It returns, in the
   same order, either an *update* (a dict of new fields, merged into the record and persisted in the
   ledger so a resumed build never recomputes it) or a ``SampleFailure`` (recorded with its reason; the
   sample skips the remaining stages but its ``original`` image is still released).
4. ``describe()`` returns what the manifest records about the stage: model ids, revisions, constants.

Values allowed in an update: JSON types (str, int, float, bool, None, lists, dicts with str keys),
``PIL.Image.Image`` and ``torch.Tensor`` (stored losslessly: PNG and safetensors), nested freely.

Seeds: ``record["seed"]`` is derived by the builder from (release seed, source key), never from order or
time. A stage that draws random numbers must derive them from that seed only (e.g.
``torch.Generator().manual_seed(record["seed"])``), so a sample's outputs do not depend on which batch it
landed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

Record = dict[str, Any]

# Fields the builder puts into every record before the first stage runs.
SOURCE_FIELDS = (
    "key",  # source key, only [A-Za-z0-9_-]
    "image",  # PIL.Image.Image, RGB, already centre-cropped/resized to the build's image_size
    "label",  # int, index in the release's label space
    "label_name",  # str, human-readable class name (e.g. "dog sled")
    "seed",  # int, per-sample seed
)

# Fields the builder reads back when it writes the release (all optional; see docs/release-format.md).
#   caption: str
#   reconstruction: PIL image                      -> config "reconstructed"
#   counterfactuals: list[dict]                    -> config "counterfactual" (one sample each)
#   lance_r: list[dict]                            -> config "lance_r" (one sample each)
# Each dict in counterfactuals / lance_r holds "image" plus the metadata fields edit_type, edited_caption,
# original_span, edited_span, self_replace and scores (a dict with any of SCORE_NAMES).
SCORE_NAMES = (
    "label_similarity",
    "span_similarity",
    "clip_directional",
    "clip_image",
    "clip_text_original",
    "clip_text_edited",
)

EDIT_TYPES = ("subject", "object", "background", "weather", "adjective", "domain")


@dataclass(frozen=True)
class SampleFailure:
    """A per-sample failure. Failures are data: the builder records ``reason`` and carries on."""

    reason: str


@runtime_checkable
class Stage(Protocol):
    """What every method stage implements. See the module docstring for the life cycle."""

    name: str

    def load(self, device: str) -> None: ...

    def process(self, records: list[Record]) -> list[Record | SampleFailure]: ...

    def describe(self) -> dict[str, Any]: ...
