"""Edit spans: which words of a caption an edit replaced, and with what.

LANCE (Prabhu et al., NeurIPS 2023, "Stress-testing Visual Models by Generating Language-guided
Counterfactual Images", section 3.1) needs, for every caption edit, the *original span* (the words the
edit removed) and the *edited span* (the words it put in their place). The label-preservation check
compares them with the class name, prompt-to-prompt re-weights the edited words, and the release records
both.

The authors' code (``lance/edit_captions.py::_compute_diff``) ran ``difflib.ndiff`` over words and
classified lines by ``"+" in line``, so ndiff's ``"? ++"`` hint lines and hyphenated words leaked into
the spans (``man -> woman`` gave ``"woman ++\\n"``). Here the diff is a token-level
``difflib.SequenceMatcher`` over normalised words, and the spans are exact substrings of the captions:

* words are whitespace-separated tokens; a hyphenated word ("snow-covered") is one token;
* tokens are compared case-insensitively and without their leading/trailing punctuation, so a change of
  case or punctuation only is *not* an edit;
* the words that the two captions share at the start and at the end are trimmed first, and only the
  middle is diffed. With repeated words ("picture picture picture"), ``SequenceMatcher`` alone may align
  a run of equal words one place off and report an insertion plus a deletion around an unchanged run;
  trimming makes a single-word swap a single-word span wherever the repeats sit;
* when an edit changes several places, the spans cover everything from the first to the last changed
  token (an edit is meant to change one aspect, so the covering span is that aspect);
* a pure insertion has ``original_span == ""``, a pure deletion ``edited_span == ""``.
"""

from __future__ import annotations

import difflib
import logging
import re
import string
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_TOKEN_RE = re.compile(r"\S+")
# Punctuation that is not part of a word (also used by LANCE-R to find the word it masks).
STRIP_CHARS = string.punctuation + "“”‘’«»…–—"


@dataclass(frozen=True)
class Token:
    """One whitespace-separated word of a caption and where it sits in the caption."""

    text: str
    start: int
    end: int

    @property
    def norm(self) -> str:
        """The comparison key: case-folded, outer punctuation removed (empty for pure punctuation)."""
        return self.text.strip(STRIP_CHARS).casefold()


@dataclass(frozen=True)
class SpanDiff:
    """The result of :func:`diff_captions`."""

    original_span: str
    edited_span: str
    # Number of separate changed regions (0 for captions that are equal up to case and punctuation).
    n_regions: int
    # Tokens inside the covering spans, in the original and the edited caption.
    n_original_tokens: int
    n_edited_tokens: int
    # Tokens of the original caption that the edit kept (matched in the diff).
    n_shared_tokens: int


def tokenize_caption(text: str) -> list[Token]:
    """Split a caption into whitespace-separated words, dropping tokens made of punctuation only.

    Args:
        text: The caption.

    Returns:
        The tokens, each with its character offsets in ``text``.
    """
    tokens = [Token(m.group(0), m.start(), m.end()) for m in _TOKEN_RE.finditer(text)]
    return [t for t in tokens if t.norm]


def _span_text(text: str, tokens: list[Token], lo: int, hi: int) -> str:
    """The exact substring of ``text`` covering ``tokens[lo:hi]``, outer punctuation removed."""
    if lo >= hi:
        return ""
    return text[tokens[lo].start : tokens[hi - 1].end].strip(STRIP_CHARS + " ")


def diff_captions(original: str, edited: str) -> SpanDiff:
    """Token-level diff of two captions.

    Args:
        original: The source caption.
        edited: The edited caption.

    Returns:
        A :class:`SpanDiff` with the covering spans and counts that the perturbation parser uses to reject
        edits that change too much.
    """
    if not isinstance(original, str) or not isinstance(edited, str):
        raise ValueError(f"captions must be str, got {type(original).__name__} and {type(edited).__name__}")
    a_tokens, b_tokens = tokenize_caption(original), tokenize_caption(edited)
    a_norms, b_norms = [t.norm for t in a_tokens], [t.norm for t in b_tokens]
    # Trim the shared head and tail (the head first, so an ambiguous insertion or deletion of a repeated word
    # is placed after the equal run). The changed region can only lie between them.
    head = 0
    while head < min(len(a_norms), len(b_norms)) and a_norms[head] == b_norms[head]:
        head += 1
    tail = 0
    while tail < min(len(a_norms), len(b_norms)) - head and a_norms[-1 - tail] == b_norms[-1 - tail]:
        tail += 1
    a_lo, a_hi = head, len(a_norms) - tail
    b_lo, b_hi = head, len(b_norms) - tail
    matcher = difflib.SequenceMatcher(a=a_norms[a_lo:a_hi], b=b_norms[b_lo:b_hi], autojunk=False)
    n_regions = sum(1 for op in matcher.get_opcodes() if op[0] != "equal")
    shared = head + tail + sum(block.size for block in matcher.get_matching_blocks())
    if n_regions == 0:
        return SpanDiff("", "", 0, 0, 0, shared)
    return SpanDiff(
        original_span=_span_text(original, a_tokens, a_lo, a_hi),
        edited_span=_span_text(edited, b_tokens, b_lo, b_hi),
        n_regions=n_regions,
        n_original_tokens=a_hi - a_lo,
        n_edited_tokens=b_hi - b_lo,
        n_shared_tokens=shared,
    )


def compute_edit_spans(original: str, edited: str) -> tuple[str, str]:
    """The words an edit removed from ``original`` and the words it put into ``edited``.

    Args:
        original: The source caption.
        edited: The edited caption.

    Returns:
        ``(original_span, edited_span)``: exact substrings of the two captions (outer punctuation removed);
        ``("", "")`` when the captions differ only in case or punctuation.

    Example:
        >>> compute_edit_spans("a photo of a man in a red jacket", "a photo of a woman in a red jacket")
        ('man', 'woman')
    """
    diff = diff_captions(original, edited)
    return diff.original_span, diff.edited_span
