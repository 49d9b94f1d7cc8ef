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

from lance_pipeline.readers import load_yaml

DATA_FILE = "protected_terms.yaml"


@cache
def load_word_list() -> dict[str, Any]:
    """The parsed ``protected_terms.yaml``, checked for the keys the screen reads.

    Our own package data, shipped with lance_pipeline (pyproject's package-data), read through the one reader of
    structured input like every other YAML (a term listed twice under one key is refused, not silently merged).
    """
    text = resources.files("lance_pipeline.screening").joinpath(DATA_FILE).read_text(encoding="utf-8")
    data = load_yaml(text, f"lance_pipeline/screening/{DATA_FILE}")
    expected = {"source", "attributes", "person_nouns", "descriptor_window", "descriptors", "markers", "anchors"}
    expected |= {"more_person_nouns", "more_descriptors", "more_markers", "things", "nationalities", "skin_words"}
    expected |= {"skin_tones", "skin_tone_descriptors", "body_parts", "body_part_modifiers", "intensifiers"}
    expected |= {"weight_units", "height_units", "number_words", "decades", "origin_words", "linking_words"}
    expected |= {"determiners", "noun_followers"}
    if not isinstance(data, dict) or not expected <= set(data):
        missing = sorted(expected - set(data or {}))
        raise ValueError(f"lance_pipeline/screening/{DATA_FILE} lacks {missing}; reinstall lance-counterfactuals")
    return data


def _merged(*tables: dict[str, dict[str, list[str]]]) -> dict[str, dict[str, tuple[str, ...]]]:
    """attribute -> group -> terms, the terms of every table (in order, without repeats)."""
    out: dict[str, dict[str, list[str]]] = {}
    for table in tables:
        for attribute, groups in table.items():
            for group, words in groups.items():
                kept = out.setdefault(attribute, {}).setdefault(group, [])
                kept += [w for w in words if w not in kept]
    return {attribute: {group: tuple(words) for group, words in groups.items()} for attribute, groups in out.items()}


def plural(noun: str) -> str:
    """The regular English plural of a noun (``man`` -> ``men``, ``lady`` -> ``ladies``, ``coach`` -> ``coaches``)."""
    if noun.endswith("man"):
        return noun[:-3] + "men"
    if noun.endswith("y") and noun[-2:-1] not in tuple("aeiou"):
        return noun[:-1] + "ies"
    if noun.endswith(("s", "x", "ch", "sh")):
        return noun + "es"
    return noun + "s"


_DATA = load_word_list()
ATTRIBUTES: tuple[str, ...] = tuple(_DATA["attributes"])
SOURCE: str = _DATA["source"]
DESCRIPTOR_WINDOW: int = int(_DATA["descriptor_window"])  # words after a descriptor in which a person noun attaches it
# Nationalities and skin-tone words that describe a person are descriptors too: each nationality a group of its own.
DESCRIPTORS: dict[str, dict[str, tuple[str, ...]]] = _merged(
    _DATA["descriptors"],
    _DATA["more_descriptors"],
    {"race_ethnicity": {word: [word] for word in _DATA["nationalities"]}},
    {"race_ethnicity": {f"skin_{tone}": words for tone, words in _DATA["skin_tone_descriptors"].items()}},
)
MARKERS: dict[str, dict[str, tuple[str, ...]]] = _merged(_DATA["markers"], _DATA["more_markers"])
ANCHORS: dict[str, tuple[str, ...]] = {attribute: tuple(p) for attribute, p in _DATA["anchors"].items()}
# The vocabularies of the screen's general rules (sensitive_edits.py, "_Lexicon"): see the comments of the data file.
THINGS: frozenset[str] = frozenset(w for word in _DATA["things"] for w in (word, plural(word)))
SKIN_WORDS: frozenset[str] = frozenset(_DATA["skin_words"])
SKIN_TONES: dict[str, str] = {word: tone for tone, words in _DATA["skin_tones"].items() for word in words}
BODY_PARTS: frozenset[str] = frozenset(_DATA["body_parts"])
BODY_MODIFIERS: dict[str, str] = {w: group for group, words in _DATA["body_part_modifiers"].items() for w in words}
INTENSIFIERS: frozenset[str] = frozenset(_DATA["intensifiers"])
WEIGHT_UNITS: frozenset[str] = frozenset(_DATA["weight_units"])
HEIGHT_UNITS: frozenset[str] = frozenset(_DATA["height_units"])
NUMBER_WORDS: frozenset[str] = frozenset(_DATA["number_words"])
DECADES: dict[str, str] = {word: group for group, words in _DATA["decades"].items() for word in words}
ORIGIN_WORDS: frozenset[str] = frozenset(_DATA["origin_words"])
LINKING_WORDS: frozenset[str] = frozenset(_DATA["linking_words"])
DETERMINERS: frozenset[str] = frozenset(_DATA["determiners"])
NOUN_FOLLOWERS: frozenset[str] = frozenset(_DATA["noun_followers"])


def person_nouns() -> dict[str, dict[str, str]]:
    """Every person noun (singular and plural) with the attribute groups it carries (``{}`` for neutral nouns).

    The HolisticBias nouns list their plurals; the nouns of ours get the regular plural (``plural``) as well.
    """
    nouns: dict[str, dict[str, str]] = {}
    for table, with_plurals in ((_DATA["person_nouns"], False), (_DATA["more_person_nouns"], True)):
        for word in table["neutral"]:
            for form in (word, plural(word)) if with_plurals else (word,):
                nouns.setdefault(form, {})
        for attribute, groups in table.items():
            if attribute == "neutral":
                continue
            for group, words in groups.items():
                for word in words:
                    for form in (word, plural(word)) if with_plurals else (word,):
                        nouns.setdefault(form, {})[attribute] = group
    return nouns
