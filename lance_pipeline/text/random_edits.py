"""LANCE-R: the random caption-edit baseline of LANCE (text part).

Prabhu et al., NeurIPS 2023, "Stress-testing Visual Models by Generating Language-guided Counterfactual
Images" (arXiv 2305.19164), Baselines paragraph: LANCE-R replaces the structured LLM
perturbation with a random one. A random word of the caption that is not a stop word is masked and
filled in by a masked language model; the image is then edited exactly as for LANCE, and the result is
kept only if CLIP says the new word matches the edited image better than the old one (that check lives
with the image stages). The authors' released code has no LANCE-R; this follows the paper's text.

Choices made here (see docs/method.md):

* the word is drawn uniformly, with ``random.Random`` seeded from the sample's seed, among caption words
  that are not stop words (scikit-learn's English list), contain a letter, and (with
  ``protect_label=True``, default) are not part of the class name, so the baseline does not trivially
  change the class;
* the fill is the masked LM's most probable whole-word token that differs from the masked word (case-
  insensitively and up to a plural), is not a stop word and, with ``protect_label``, is not a word of the
  class name, so for a given masked word the result is deterministic;
* ``n_edits`` distinct positions per caption (default 1).

The masked LM is any transformers fill-mask checkpoint (default ``google-bert/bert-base-uncased``).
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
from dataclasses import dataclass
from typing import Annotated, Any

from lance_pipeline.models.needs import ModelOption
from lance_pipeline.option_types import Interval, Options, PositiveInt
from lance_pipeline.stage import Record, SampleFailure, stage_options
from lance_pipeline.text.edit_spans import STRIP_CHARS, tokenize_caption

logger = logging.getLogger(__name__)

DEFAULT_MASKED_LM = "google-bert/bert-base-uncased"
# A commit of google-bert/bert-base-uncased: public code holds it as the Hub cache's snapshot directory
# (models--google-bert--bert-base-uncased/snapshots/<this hash>), so the Hub served it (see docs/method.md).
DEFAULT_MASKED_LM_REVISION = "86b5e0934494bd15c9632b12f734a8a67f723594"

_WORD_RE = re.compile(r"^[A-Za-z][A-Za-z'-]*$")


def _stop_words() -> frozenset[str]:
    from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS

    return frozenset(ENGLISH_STOP_WORDS)


def _singular(word: str) -> str:
    """A rough English singular ("huskies" -> "husky", "glasses" -> "glass", "dogs" -> "dog")."""
    word = word.casefold()
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    if word.endswith(("ses", "xes", "zes", "ches", "shes")):
        return word[:-2]
    if word.endswith("s") and not word.endswith("ss"):
        return word[:-1]
    return word


def _same_word(a: str, b: str) -> bool:
    """Whether a fill is only the masked word again, up to case and plural (no edit at all)."""
    return a.casefold() == b.casefold() or _singular(a) == _singular(b)


def _label_words(label_name: str | None) -> set[str]:
    """The class name's words, singular, so "sleds" counts as a word of "dog sled"."""
    return {_singular(w.strip(",.")) for w in re.split(r"[\s,]+", str(label_name or "")) if w.strip(",.")}


def candidate_positions(caption: str, label_name: str | None = None, protect_label: bool = True) -> list[int]:
    """Indices (into :func:`~lance_pipeline.text.edit_spans.tokenize_caption`) of the words LANCE-R may mask."""
    stop = _stop_words()
    protected = _label_words(label_name) if protect_label else set()
    positions = []
    for i, token in enumerate(tokenize_caption(caption)):
        word = token.norm
        if word in stop or _singular(word) in protected or not re.search(r"[a-z]", word):
            continue
        positions.append(i)
    return positions


def _sample_seed(seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{int(seed)}:lance_r".encode()).digest()[:8], "little")


@dataclass
class RandomEditOptions(Options):
    """LANCE-R's options (documented on ``RandomWordEditor``); bounds are their annotations."""

    model: str = DEFAULT_MASKED_LM
    revision: str | None = DEFAULT_MASKED_LM_REVISION
    n_edits: PositiveInt = 1
    top_k: Annotated[int, Interval(ge=2), "candidates per mask (the first may be the masked word)"] = 20
    protect_label: bool = True
    batch_size: PositiveInt = 32


class RandomWordEditor:
    """The ``random_edit`` stage (LANCE-R text part): mask one random non-stop word, fill it with a masked LM.

    Args:
        model: Hub id or local directory of a fill-mask checkpoint.
        revision: Hub revision of ``model``.
        n_edits: Random edits per caption (distinct masked positions).
        top_k: Masked-LM candidates considered per mask before giving up on a position.
        protect_label: Never mask a word of the class name.
        batch_size: Masked captions per forward pass.
    """

    name = "random_edit"
    version = "1"
    consumes = {"caption": "str", "label_name": "str", "seed": "int"}
    produces = {"random_edits": "list"}
    model_options = (ModelOption("model", role="masked language model of LANCE-R"),)

    options_class = RandomEditOptions

    def __init__(self, options: RandomEditOptions | None = None, /, **values: Any) -> None:
        o = stage_options(type(self), options, values)
        self.options = o
        self.model_id = str(o.model)
        self.revision = o.revision
        self.n_edits = o.n_edits
        self.top_k = o.top_k
        self.protect_label = o.protect_label
        self.batch_size = o.batch_size
        self._fill = None

    def load(self, device: str) -> None:
        """Load the masked LM as a transformers ``fill-mask`` pipeline on ``device``."""
        from transformers import AutoModelForMaskedLM, AutoTokenizer, pipeline

        logger.info("loading masked LM %s (revision %s) on %s", self.model_id, self.revision, device)
        tokenizer = AutoTokenizer.from_pretrained(self.model_id, revision=self.revision)
        if tokenizer.mask_token is None:
            raise ValueError(f"{self.model_id!r} has no mask token; LANCE-R needs a fill-mask (masked LM) checkpoint")
        model = AutoModelForMaskedLM.from_pretrained(self.model_id, revision=self.revision, use_safetensors=True)
        self._fill = pipeline("fill-mask", model=model.eval(), tokenizer=tokenizer, device=device)

    def describe(self) -> dict[str, Any]:
        """Model, revision and constants for the manifest."""
        return {
            "model": self.model_id,
            "revision": self.revision,
            "n_edits": self.n_edits,
            "top_k": self.top_k,
            "protect_label": self.protect_label,
            "stop_words": "sklearn ENGLISH_STOP_WORDS",
            "fill": "most probable whole word different from the masked word",
        }

    def choose_positions(self, caption: str, label_name: str | None, seed: int) -> list[int]:
        """The seeded random choice of word positions to mask (at most ``n_edits``, in draw order)."""
        positions = candidate_positions(caption, label_name, self.protect_label)
        rng = random.Random(_sample_seed(seed))
        return rng.sample(positions, k=min(self.n_edits, len(positions)))

    def edit(self, captions: list[str], label_names: list[str | None], seeds: list[int]) -> list[list[dict[str, Any]]]:
        """LANCE-R edits for each caption.

        Returns:
            Per caption, up to ``n_edits`` dicts with ``edit_type`` (``None``), ``edited_caption``,
            ``original_span`` and ``edited_span``.
        """
        if self._fill is None:
            raise RuntimeError("RandomWordEditor.load(device) must be called before edit()")
        if not len(captions) == len(label_names) == len(seeds):
            raise ValueError(f"got {len(captions)} captions, {len(label_names)} label names and {len(seeds)} seeds")
        mask = self._fill.tokenizer.mask_token
        jobs: list[tuple[int, str, str, tuple[int, int]]] = []  # (sample, masked text, word, (start, end))
        for i, (caption, label_name, seed) in enumerate(zip(captions, label_names, seeds, strict=True)):
            tokens = tokenize_caption(caption)
            for position in self.choose_positions(caption, label_name, seed):
                token = tokens[position]
                # The word without the punctuation glued to it (same rule as the span diff), so "snow." masks
                # "snow" and keeps the full stop.
                core = token.text.strip(STRIP_CHARS)
                start = token.start + token.text.index(core)
                end = start + len(core)
                jobs.append((i, caption[:start] + mask + caption[end:], core, (start, end)))
        results: list[list[dict[str, Any]]] = [[] for _ in captions]
        if not jobs:
            return results
        predictions = self._fill([job[1] for job in jobs], top_k=self.top_k, batch_size=self.batch_size)
        if len(jobs) == 1 and predictions and isinstance(predictions[0], dict):
            predictions = [predictions]
        stop = _stop_words()
        for (i, _, word, (start, end)), candidates in zip(jobs, predictions, strict=True):
            protected = _label_words(label_names[i]) if self.protect_label else set()
            # A stop word is no fill: the masked word was a content word, and "a photo of a the" edits nothing.
            fill = next(
                (
                    c["token_str"].strip()
                    for c in candidates
                    if _WORD_RE.match(c["token_str"].strip())
                    and not _same_word(c["token_str"].strip(), word)
                    and _singular(c["token_str"].strip()) not in protected
                    and c["token_str"].strip().casefold() not in stop
                ),
                None,
            )
            if fill is None:
                logger.debug("LANCE-R: no usable fill for %r in %r", word, captions[i])
                continue
            edited = captions[i][:start] + fill + captions[i][end:]
            # The replaced word and its fill are known exactly; a diff could place the change elsewhere in a run
            # of repeated words, so it is not asked.
            results[i].append(
                {
                    "edit_type": None,
                    "edited_caption": edited,
                    "original_span": word,
                    "edited_span": fill,
                }
            )
        return results

    def process(self, records: list[Record]) -> list[Record | SampleFailure]:
        """LANCE-R edits of each record's ``caption``; returns ``{"random_edits": [...]}``."""
        results: list[Record | SampleFailure] = [SampleFailure("random_edit: record has no caption")] * len(records)
        todo = [i for i, r in enumerate(records) if isinstance(r.get("caption"), str) and r["caption"].strip()]
        if todo:
            edits = self.edit(
                [records[i]["caption"] for i in todo],
                [records[i].get("label_name") for i in todo],
                [int(records[i].get("seed", 0)) for i in todo],
            )
            for i, sample_edits in zip(todo, edits, strict=True):
                results[i] = {"random_edits": sample_edits}
        return results


# The name the builder's stage registry uses.
RandomEditStage = RandomWordEditor
