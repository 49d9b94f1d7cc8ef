"""Candidate counterfactuals, the editor interface, and gating + selection with a shared CLIP scorer.

An *editor* renders candidate counterfactuals of one source image for a list of edited captions (prompt-to-prompt
over a sweep of self-attention injection fractions today; a ControlNet regeneration editor can be another). The
*selector* scores every candidate with CLIP (``clip_gates.ClipScorer``, shared by the stages of a build), applies
the gates of LANCE section 3.2, and keeps at most one candidate per edit:

* ``best_directional`` (default): the passing candidate with the highest CLIP directional similarity (paper
  eq. 2). Ties keep the candidate earlier in the sweep, so the choice is deterministic.
* ``largest_passing``: the passing candidate with the largest ``self_replace``, the most conservative edit; what
  the authors' code did in effect (its ``best_sim_dir`` is reset inside the sweep loop, so the last passing value
  overwrote the others).

Every candidate's scores are kept, chosen or not, as a *candidate record* (``CANDIDATE_RECORD_FIELDS``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from lance_pipeline.clip.gates import gate_failures
from lance_pipeline.stage import SCORE_NAMES, Record

logger = logging.getLogger(__name__)

SELECTIONS = ("best_directional", "largest_passing")

# Keys of every candidate record (the release's ``edit_candidates`` / ``lance_r_candidates`` entries).
CANDIDATE_RECORD_FIELDS = (
    "edit_index",  # position in the record's edit list
    "edit_type",
    "edited_caption",
    "original_span",
    "edited_span",
    "self_replace",  # the candidate's sweep value (None: refused before rendering)
    "attention_edit",  # "replace" | "refine" (None: refused before rendering)
    "reweighted_tokens",  # number of tokens whose cross-attention was reweighted
    "scores",  # label_similarity, span_similarity, the CLIP scores, and any extra check's scores
    "passed",  # every gate passed
    "chosen",  # the selected candidate of its edit
    "reject_reason",  # why not (None for the chosen one)
)


@dataclass
class EditRequest:
    """One edited caption to render, with the span whose tokens are reweighted."""

    edited_caption: str
    edited_span: str = ""


@dataclass
class Candidate:
    """One rendered candidate.

    Attributes:
        request_index: Index of its ``EditRequest``.
        self_replace: The sweep value (prompt-to-prompt) or the editor's own variant knob, as a float.
        image: The PIL image.
        reweighted_tokens: Tokens whose attention was reweighted (None where the editor has no such notion).
        attention_edit: ``"replace"`` / ``"refine"`` for prompt-to-prompt (None otherwise).
    """

    request_index: int
    self_replace: float | None
    image: Any
    reweighted_tokens: int | None = None
    attention_edit: str | None = None


@dataclass
class SweepResult:
    """The source-branch reconstruction and every candidate, in (request, variant) order."""

    reconstruction: Any
    candidates: list[Candidate] = field(default_factory=list)


@runtime_checkable
class Editor(Protocol):
    """What an editor registered in ``lance_pipeline.registry.EDITORS`` implements (see docs/architecture.md).

    Built by its edit stage in ``load(device)`` as ``EditorClass.load(options, device)``.
    """

    max_prompt_tokens: int  # longer edited captions are refused before rendering

    def count_tokens(self, text: str) -> int: ...

    def check_source(self, record: Record) -> str | None:
        """Why this record cannot be edited (e.g. a missing or mismatched inversion), or None."""
        ...

    def render(self, record: Record, requests: list[EditRequest]) -> SweepResult:
        """Render every request's candidates; ``reconstruction`` is the image the gates compare against."""
        ...

    def describe(self) -> dict[str, Any]: ...


def span_of(edit: dict, key: str) -> str:
    value = edit.get(key)
    return value if isinstance(value, str) else ""


class CandidateSelector:
    """Scores candidates with a shared CLIP scorer, gates them and selects one per edit.

    Args:
        scorer: A loaded ``clip_gates.ClipScorer`` (or anything with ``edit_scores`` and ``word_check``).
        thresholds: ``clip_gates.ClipGateThresholds``.
        selection: One of ``SELECTIONS``.
        word_check: Also require the LANCE-R word check (edited image closer to the new word than to the old).
    """

    def __init__(self, scorer, thresholds, selection: str = "best_directional", word_check: bool = False) -> None:
        if selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
        self.scorer = scorer
        self.thresholds = thresholds
        self.selection = selection
        self.word_check = word_check

    def describe(self) -> str:
        if self.selection == "largest_passing":
            return "largest self_replace among gate-passing candidates"
        return "max clip_directional among gate-passing candidates"

    def _word_checks(self, edits: list[dict], sweep: SweepResult) -> tuple[list[dict], list[list[str]]]:
        scores: list[dict] = [{} for _ in sweep.candidates]
        failures: list[list[str]] = [[] for _ in sweep.candidates]
        if not self.word_check:
            return scores, failures
        checkable = [
            k
            for k, c in enumerate(sweep.candidates)
            if span_of(edits[c.request_index], "original_span").strip()
            and span_of(edits[c.request_index], "edited_span").strip()
        ]
        for k in range(len(sweep.candidates)):
            if k not in checkable:
                failures[k].append("word check needs a non-empty original_span and edited_span")
        if checkable:
            checks = self.scorer.word_check(
                [sweep.candidates[k].image for k in checkable],
                [span_of(edits[sweep.candidates[k].request_index], "original_span") for k in checkable],
                [span_of(edits[sweep.candidates[k].request_index], "edited_span") for k in checkable],
            )
            for k, check in zip(checkable, checks, strict=True):
                scores[k] = {
                    "new_word_similarity": check["new_word_similarity"],
                    "old_word_similarity": check["old_word_similarity"],
                }
                if not check["passes"]:
                    failures[k].append(
                        "word check: image matches the old word at least as well as the new word "
                        f"({check['old_word_similarity']:.6f} >= {check['new_word_similarity']:.6f})"
                    )
        return scores, failures

    def select(self, caption: str, edits: list[dict], sweep: SweepResult) -> tuple[list[dict], list[dict]]:
        """Score, gate and select.

        Args:
            caption: The source caption.
            edits: The edit dicts the candidates render (edited_caption, original_span, edited_span, edit_type,
                optional label ``scores``), indexed by ``Candidate.request_index``.
            sweep: The rendered candidates.

        Returns:
            ``(chosen samples with their image, every candidate's record without image)``.
        """
        n = len(sweep.candidates)
        clip_scores = self.scorer.edit_scores(
            [sweep.reconstruction] * n,
            [c.image for c in sweep.candidates],
            [caption] * n,
            [edits[c.request_index]["edited_caption"] for c in sweep.candidates],
        )
        extra_scores, extra_failures = self._word_checks(edits, sweep)
        clip_scores = [{**s, **e} for s, e in zip(clip_scores, extra_scores, strict=True)]
        return select_candidates(edits, sweep, clip_scores, extra_failures, self.thresholds, self.selection)


def _better(selection: str, challenger: dict, best: dict) -> bool:
    if selection == "largest_passing":
        return challenger["self_replace"] > best["self_replace"]
    # Strictly greater: a tie keeps the candidate earlier in the sweep, so the choice is deterministic.
    return challenger["scores"]["clip_directional"] > best["scores"]["clip_directional"]


def select_candidates(
    edits: list[dict],
    sweep: SweepResult,
    clip_scores: list[dict],
    extra_failures: list[list[str]],
    thresholds,
    selection: str = "best_directional",
    edit_type_default: str | None = None,
) -> tuple[list[dict], list[dict]]:
    """Apply the gates and keep, per edit, the passing candidate the selection rule prefers.

    Args:
        edits: The edit dicts (edited_caption, original_span, edited_span, edit_type, optional scores).
        sweep: The rendered candidates, in (edit, sweep value) order.
        clip_scores: One ``ClipScorer.edit_scores`` dict per candidate (may hold extra keys, e.g. word check).
        extra_failures: Per candidate, reasons besides the CLIP gates (e.g. the LANCE-R word check).
        thresholds: ``ClipGateThresholds``.
        selection: One of ``SELECTIONS``.
        edit_type_default: ``edit_type`` for edits that carry none.

    Returns:
        ``(chosen samples with their image, every candidate's record without image)``.
    """
    if selection not in SELECTIONS:
        raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
    records = []
    for candidate, scores, extra in zip(sweep.candidates, clip_scores, extra_failures, strict=True):
        edit = edits[candidate.request_index]
        label_scores = edit.get("scores") or {}
        merged = {
            "label_similarity": label_scores.get("label_similarity"),
            "span_similarity": label_scores.get("span_similarity"),
            **scores,
        }
        failures = gate_failures(scores, thresholds) + list(extra)
        records.append(
            {
                "edit_index": candidate.request_index,
                "edit_type": edit.get("edit_type", edit_type_default),
                "edited_caption": edit["edited_caption"],
                "original_span": span_of(edit, "original_span"),
                "edited_span": span_of(edit, "edited_span"),
                "self_replace": candidate.self_replace,
                "attention_edit": candidate.attention_edit,
                "reweighted_tokens": candidate.reweighted_tokens,
                "scores": merged,
                "passed": not failures,
                "chosen": False,
                "reject_reason": "; ".join(failures) if failures else None,
            }
        )
    chosen_samples = []
    for edit_index in range(len(edits)):
        rows = [(k, r) for k, r in enumerate(records) if r["edit_index"] == edit_index]
        passing = [(k, r) for k, r in rows if r["passed"]]
        if not passing:
            continue
        best_k, best = passing[0]
        for k, r in passing[1:]:
            if _better(selection, r, best):
                best_k, best = k, r
        best["chosen"] = True
        for _, r in passing:
            if r["chosen"]:
                continue
            if selection == "largest_passing":
                r["reject_reason"] = (
                    f"not selected: self_replace={r['self_replace']} below the largest passing {best['self_replace']}"
                )
            else:
                r["reject_reason"] = (
                    f"not selected: clip_directional={r['scores']['clip_directional']:.6f} below "
                    f"{best['scores']['clip_directional']:.6f} of self_replace={best['self_replace']}"
                )
        chosen_samples.append(
            {
                "image": sweep.candidates[best_k].image,
                "edit_type": best["edit_type"],
                "edited_caption": best["edited_caption"],
                "original_span": best["original_span"],
                "edited_span": best["edited_span"],
                "self_replace": best["self_replace"],
                "scores": {name: best["scores"].get(name) for name in SCORE_NAMES},
            }
        )
    return chosen_samples, records
