"""The word list of the sensitive-edit screen, read from its package data file ``protected_terms.yaml``.

The list (person nouns with the attribute groups they carry, descriptors, markers worn or used, and the anchor phrases
of the sentence-model step) lives beside this module as data; its provenance (HolisticBias v1.1, CC BY-SA 4.0, and
which terms are ours) is stated at the top of the file and in ``SOURCE``. This module reads it once and exposes it
as the constants the screen uses (``lance_pipeline.screening.sensitive_edits``).
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

DATA_FILE = "protected_terms.yaml"


@cache
def load_word_list() -> dict[str, Any]:
    """The parsed ``protected_terms.yaml``, checked for the keys the screen reads.

    This is our own package data, shipped with lance_pipeline (pyproject's package-data), never user input: it is read
    with PyYAML's safe loader here rather than through the release format's reader of user files, which
    lance_pipeline may not import.
    """
    import yaml

    text = resources.files("lance_pipeline.screening").joinpath(DATA_FILE).read_text(encoding="utf-8")
    data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    expected = {"source", "attributes", "person_nouns", "descriptor_window", "descriptors", "markers", "anchors"}
    if not isinstance(data, dict) or not expected <= set(data):
        missing = sorted(expected - set(data or {}))
        raise ValueError(f"lance_pipeline/screening/{DATA_FILE} lacks {missing}; reinstall lance-counterfactuals")
    return data


def _tuples(table: dict[str, dict[str, list[str]]]) -> dict[str, dict[str, tuple[str, ...]]]:
    return {attribute: {group: tuple(words) for group, words in groups.items()} for attribute, groups in table.items()}


_DATA = load_word_list()
ATTRIBUTES: tuple[str, ...] = tuple(_DATA["attributes"])
SOURCE: str = _DATA["source"]
DESCRIPTOR_WINDOW: int = int(_DATA["descriptor_window"])  # words after a descriptor in which a person noun attaches it
DESCRIPTORS: dict[str, dict[str, tuple[str, ...]]] = _tuples(_DATA["descriptors"])
MARKERS: dict[str, dict[str, tuple[str, ...]]] = _tuples(_DATA["markers"])
ANCHORS: dict[str, tuple[str, ...]] = {attribute: tuple(p) for attribute, p in _DATA["anchors"].items()}


def person_nouns() -> dict[str, dict[str, str]]:
    """Every person noun (singular and plural) with the attribute groups it carries (``{}`` for neutral nouns)."""
    table = _DATA["person_nouns"]
    nouns: dict[str, dict[str, str]] = {word: {} for word in table["neutral"]}
    for attribute in ("gender", "age", "religion"):
        for group, words in table[attribute].items():
            for word in words:
                nouns.setdefault(word, {})[attribute] = group
    return nouns
