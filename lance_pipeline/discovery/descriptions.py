"""Describing a cluster of failures in words, and the shorter variants of a description (refinement).

``merge_captions`` (the default) keeps the words most of a cluster's captions share, without stop words and the
class's own words; ``LLMCaptionMerger`` asks an instruction-tuned LLM (the perturber backend) instead.
``sub_descriptions`` lists the variants that refinement tests: every description left when some of its words are
dropped (word order kept), shortest first; Wiles et al. prune a description word by word to find which words matter.
"""

from __future__ import annotations

import re
from collections import Counter
from itertools import combinations
from typing import Any

_STOP_WORDS: frozenset[str] | None = None


def _stop_words() -> frozenset[str]:
    global _STOP_WORDS
    if _STOP_WORDS is None:
        from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS

        _STOP_WORDS = frozenset(ENGLISH_STOP_WORDS | {"photo", "photograph", "picture", "image", "realistic"})
    return _STOP_WORDS


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def merge_captions(captions: list[str], class_name: str, superclass: str | None = None, max_words: int = 3) -> str:
    """The keyword-frequency merge: the words most captions share, without stop words or the class's own words.

    Words are ranked by how many captions contain them (ties: first appearance); at most ``max_words`` are kept,
    and only words found in at least half the captions (at least one word is always kept when any remains).
    """
    banned = set(_words(class_name)) | set(_words(superclass or "")) | _stop_words()
    document_frequency: Counter[str] = Counter()
    first_seen: dict[str, int] = {}
    for caption in captions:
        for word in dict.fromkeys(_words(caption)):
            if word in banned or len(word) < 3:
                continue
            document_frequency[word] += 1
            first_seen.setdefault(word, len(first_seen))
    ranked = sorted(document_frequency, key=lambda w: (-document_frequency[w], first_seen[w]))
    majority = [w for w in ranked if document_frequency[w] * 2 >= len(captions)]
    chosen = (majority or ranked[:1])[:max_words]
    return " ".join(chosen)


def sub_descriptions(description: str) -> list[str]:
    """Every shorter description made by dropping words (order kept, at least one word), shortest first.

    ``"red sandy beach"`` gives ``red, sandy, beach, red sandy, red beach, sandy beach``. The list is fixed by the
    description alone, before anything is tested, so refinement tests a pre-specified family (2^n - 2 variants of an
    n-word description).
    """
    words = description.split()
    variants: list[str] = []
    for size in range(1, len(words)):
        for chosen in combinations(range(len(words)), size):
            variant = " ".join(words[i] for i in chosen)
            if variant not in variants and variant != description:
                variants.append(variant)
    return variants


MERGE_SYSTEM = (
    "You summarise what several image captions have in common. Answer with one short phrase of at most {max_words} "
    "words that describes the shared situation, context or appearance. Do not name the object class."
)


class LLMCaptionMerger:
    """Merge a cluster's captions with an instruction-tuned LLM (the perturber backend, ``PromptPerturber``).

    The answer's first line is reduced to at most ``max_words`` content words, without the class's own words; when
    nothing is left (an empty or off-task answer), the keyword merge is used instead and counted in ``fallbacks``.
    Seeded per cluster: the same captions give the same description.
    """

    def __init__(self, perturber: Any, max_words: int = 4) -> None:
        self.perturber = perturber
        self.max_words = max_words
        self.fallbacks = 0

    def describe(self) -> dict[str, Any]:
        return {"kind": "llm", "model": getattr(self.perturber, "model_id", None), "max_words": self.max_words,
                "fallbacks": self.fallbacks}  # fmt: skip

    def merge(self, captions: list[str], class_name: str, superclass: str | None = None) -> str:
        import hashlib

        user = f"Object class: {class_name}\nCaptions:\n" + "\n".join(f"- {c}" for c in captions)
        prompt = self.perturber.chat_prompt(MERGE_SYSTEM.format(max_words=self.max_words), user)
        seed = int.from_bytes(hashlib.sha256("\n".join(captions).encode()).digest()[:4], "big") & 0x7FFFFFFF
        text, _ = self.perturber.generate([prompt], [seed])[0]
        banned = set(_words(class_name)) | set(_words(superclass or "")) | _stop_words()
        first_line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
        words = [w for w in _words(first_line) if w not in banned and len(w) >= 3][: self.max_words]
        if not words:
            self.fallbacks += 1
            return merge_captions(captions, class_name, superclass)
        return " ".join(words)


class KeywordCaptionMerger:
    """The keyword-frequency merge (``merge_captions``) behind the same interface as ``LLMCaptionMerger``."""

    def describe(self) -> dict[str, Any]:
        return {"kind": "keyword_frequency", "max_words": 3, "min_document_fraction": 0.5}

    def merge(self, captions: list[str], class_name: str, superclass: str | None = None) -> str:
        return merge_captions(captions, class_name, superclass)
