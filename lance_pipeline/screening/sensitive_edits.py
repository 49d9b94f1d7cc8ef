"""The sensitive-edit screen: marks each edit that adds, removes or changes a perceived protected attribute of a person.

Prabhu et al., NeurIPS 2023, "Ethical Issues": in LANCE's human study most objectionable images came from edits that
also changed the perceived gender, race, age, religion or body of a person (woman -> lifeguard made the person male
and muscular; people -> athletes changed their perceived race), and the authors inspected all 781 images by hand and
excluded 8 more. This stage does the first pass of that inspection on every counterfactual a build releases.

An edit is marked for an attribute (``protected_terms.ATTRIBUTES``) when

1. **the word list** (``protected_terms.yaml``, package data: HolisticBias terms, source stated there, and ours)
   finds a different set of that attribute's groups attached to the people of the caption and of the edited caption:
   a person noun that carries the attribute (``woman`` is female; ``girl`` female and a child), a descriptor followed
   within a few words by a person noun (``an elderly man``, not ``an old car``) or after a linking word (``a man who
   is blind``), an ethnicity or religion word used as a noun (``a mexican playing``), a marker worn or used in a
   caption with a person (``hijab``, ``wheelchair``), or a phrase of the general rules (``_Lexicon._phrase_rules``:
   skin tone, body parts, stated weight and height, age by decade). Groups, not words, are compared: ``woman ->
   lady`` changes nothing, ``woman -> man`` changes gender, ``girl -> woman`` age, ``woman -> lifeguard`` removes the
   gender. Precision and recall on hand-written held-out pairs: ``benchmarks/bench_sensitive_edits.py``;
2. or **the sentence-embedding model** of the label check (all-MiniLM-L6-v2) finds a changed span as close as
   ``similarity_threshold`` to one of the attribute's anchor phrases (``protected_terms.ANCHORS``), in a caption
   that mentions a person, for spans without a word of the list: words the list lacks (``a man -> a bodybuilder``).

Each counterfactual sample gets ``sensitive_edit`` (bool), ``sensitive_attributes`` (comma-separated) and
``sensitive_triggers`` (what fired: ``gender: woman -> man``, ``body: bodybuilder~0.60``). ``screen: flag`` (default)
keeps the sample, marked; ``screen: drop`` removes it and records the removal, with its reason, as a failure of this
stage in the manifest. The screen runs on the samples the editor produced (after the label check and the edit), so
it marks exactly what is released; with ``drop`` the dropped edits were rendered for nothing, which is the price of
screening the edit that was actually rendered (the editor may render one caption edit several times).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Literal

from lance_pipeline.editing.strength import STRENGTH_FIELD
from lance_pipeline.option_types import CosineThreshold, Options, PositiveInt
from lance_pipeline.screening import protected_terms as terms
from lance_pipeline.stage import SAMPLE_INDEX, MetadataField, OutputScreen, Record, SampleFailure, stage_options
from lance_pipeline.text.label_checks import (
    DEFAULT_SENTENCE_MODEL,
    DEFAULT_SENTENCE_MODEL_REVISION,
    LabelPreservationCheck,
    load_sentence_model,
)

logger = logging.getLogger(__name__)

# Ours, set on hand-written spans with all-MiniLM-L6-v2 (docs/method.md, "Sensitive-edit screen"): spans that name a
# person's attribute the list lacks reach it ("bodybuilder" 0.60 to body, "church" 0.66 to religion), those of
# ordinary edits stay below ("horse" 0.37, "painting" 0.36, "athlete" 0.53, colours up to 0.45).
SIMILARITY_THRESHOLD = 0.55

SENSITIVE_FIELDS = (
    MetadataField("sensitive_edit", "bool", description="the edit changes a perceived protected attribute of a person"),
    MetadataField("sensitive_attributes", "string", description="which: comma-separated (gender, age, ...)"),
    MetadataField("sensitive_triggers", "string", description="the words (or span~similarity) that marked it"),
)

_WORD = re.compile(r"[a-z0-9]+")
_AGE_NUMBER = re.compile(r"^(\d+)$")
_NUMBER_WORDS = {
    "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10,
    "twelve": 12, "fifteen": 15, "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70,
    "eighty": 80, "ninety": 90,
}  # fmt: skip


def words_of(text: str) -> list[str]:
    """Lower-case word tokens; hyphens and apostrophes split (``middle-aged`` -> ``middle aged``)."""
    return _WORD.findall(str(text or "").lower())


@dataclass(frozen=True)
class Mention:
    """One attribute word attached to a person in a caption."""

    attribute: str
    group: str
    words: str


class _Lexicon:
    """The word list compiled for matching: term token tuples, longest first."""

    def __init__(self) -> None:
        self.nouns = terms.person_nouns()
        self.descriptors = self._compile(terms.DESCRIPTORS)
        self.markers = self._compile(terms.MARKERS)

    @staticmethod
    def _compile(table: dict[str, dict[str, tuple[str, ...]]]) -> dict[str, list[tuple[tuple[str, ...], str, str]]]:
        """The terms by their first word, longest first (a caption's words are looked up, not every term tried)."""
        out: dict[str, list[tuple[tuple[str, ...], str, str]]] = {}
        for attribute, groups in table.items():
            for group, words in groups.items():
                for w in words:
                    tokens = tuple(words_of(w))
                    out.setdefault(tokens[0], []).append((tokens, attribute, group))
        return {first: sorted(terms, key=lambda t: (-len(t[0]), t)) for first, terms in out.items()}

    def persons(self, tokens: list[str]) -> list[bool]:
        """Which tokens name a person: a person noun not directly followed by an animal or a thing (``a baby
        elephant``, ``a mother duck`` name animals), and an ethnicity or religion word used as a noun (``a mexican
        playing a guitar``: after a determiner, before a preposition, a verb in -ing or the end)."""
        # a thing word in -ing after a person noun is a verb ("a man building a sandcastle"), not a compound noun
        out = [
            t in self.nouns
            and not (k + 1 < len(tokens) and tokens[k + 1] in terms.THINGS and not tokens[k + 1].endswith("ing"))
            for k, t in enumerate(tokens)
        ]
        for k in range(1, len(tokens)):
            if out[k] or tokens[k - 1] not in terms.DETERMINERS:
                continue
            match = self._match(tokens, k, self.descriptors)
            if match is None or not any(a in ("race_ethnicity", "religion") for a, _ in match[1]):
                continue
            end = match[0]
            if end == len(tokens) or tokens[end] in terms.NOUN_FOLLOWERS or tokens[end].endswith("ing"):
                out[k] = True
        return out

    def mentions(self, text: str) -> list[Mention]:
        """Every attribute mention of ``text``: person nouns, descriptors attached to a person, markers, and the
        general rules' phrases (skin tone, body parts, stated weight and height, decades of age)."""
        tokens = words_of(text)
        persons = self.persons(tokens)
        has_person = any(persons)
        found: dict[tuple[int, str, str], Mention] = {}  # one mention per (start, attribute, group): no double count

        def add(start: int, end: int, hits: list[tuple[str, str]]) -> None:
            for attribute, group in hits:
                found.setdefault((start, attribute, group), Mention(attribute, group, " ".join(tokens[start:end])))

        for k, token in enumerate(tokens):
            if persons[k]:
                add(k, k + 1, sorted(self.nouns.get(token, {}).items()))
        i = 0
        while i < len(tokens):
            age = self._age(tokens, i)
            if age is not None:
                end, group = age
                if self._attached(tokens, persons, i, end):
                    add(i, end, [("age", group)])
                i = end
                continue
            match = self._match(tokens, i, self.descriptors)
            if match is not None:
                end, hits = match
                origin = end < len(tokens) and tokens[end] in terms.ORIGIN_WORDS and has_person
                if persons[i] or origin or self._attached(tokens, persons, i, end):
                    add(i, end, hits)
                i = end
                continue
            marker = self._match(tokens, i, self.markers)
            if marker is not None:
                end, hits = marker
                if has_person:
                    add(i, end, hits)
                i = end
                continue
            i += 1
        if has_person:
            for k, token in enumerate(tokens):
                for start, attribute, group in self._phrase_rules(tokens, k, token):
                    if not self._of_a_thing(tokens, persons, start):
                        add(start, k + 1, [(attribute, group)])
        return [found[key] for key in sorted(found)]

    def _phrase_rules(self, tokens: list[str], k: int, token: str) -> list[tuple[int, str, str]]:
        """The general rules' mentions ending at token ``k`` (in a caption with a person): (start, attribute, group).

        * skin tone: a tone word among the three words before a skin word (``deep brown skin``, ``fair skinned``, ``a
          light complexion``) or among the three after ``skin is`` (``skin is porcelain white``);
        * body: a size or shape word just before a body part, or before an intensifier before it (``a big belly``,
          ``very large build``);
        * stated weight and height: a number before a unit (``three hundred pounds``, ``seven feet tall``);
        * age by decade: ``in his seventies``, ``in her early twenties``.
        """
        out = []
        if token in terms.SKIN_WORDS:
            before = [
                (j, terms.SKIN_TONES[tokens[j]]) for j in range(max(0, k - 3), k) if tokens[j] in terms.SKIN_TONES
            ]
            after = []
            if k + 1 < len(tokens) and tokens[k + 1] in ("is", "was", "looks"):
                after = [(k, terms.SKIN_TONES[t]) for t in tokens[k + 2 : k + 5] if t in terms.SKIN_TONES]
            out += [(j, "race_ethnicity", f"skin_{tone}") for j, tone in before + after]
        if token in terms.BODY_PARTS and k > 0:
            j = k - 1
            if tokens[j] in terms.INTENSIFIERS and j > 0:
                j -= 1
            if tokens[j] in terms.BODY_MODIFIERS:
                out.append((j, "body", terms.BODY_MODIFIERS[tokens[j]]))
        number = k > 0 and any(self._is_number(t) for t in tokens[max(0, k - 3) : k])
        if token in terms.WEIGHT_UNITS and number:
            out.append((k, "body", "weight_stated"))
        if token in terms.HEIGHT_UNITS and number and k + 1 < len(tokens) and tokens[k + 1] in ("tall", "high"):
            out.append((k, "body", "height_stated"))
        if token in terms.DECADES and k >= 2 and ("in" in tokens[max(0, k - 3) : k - 1]):
            out.append((k, "age", terms.DECADES[token]))
        return out

    @staticmethod
    def _of_a_thing(tokens: list[str], persons: list[bool], start: int) -> bool:
        """Whether the nearest noun before a phrase (five words at most) is an animal or a thing, whose skin or belly
        the phrase then describes (``a banana with brown skin``, ``a pig with a big belly``)."""
        for k in range(start - 1, max(-1, start - 6), -1):
            if persons[k]:
                return False
            if tokens[k] in terms.THINGS:
                return True
        return False

    @staticmethod
    def _is_number(token: str) -> bool:
        return bool(_AGE_NUMBER.match(token)) or token in terms.NUMBER_WORDS

    def _attached(self, tokens: list[str], persons: list[bool], start: int, end: int) -> bool:
        """Whether the descriptor ``tokens[start:end]`` describes a person: a person noun follows within
        ``DESCRIPTOR_WINDOW`` words before any animal or thing does (``a tall man``; not ``a black dog and a man``), or
        it follows a linking word after a person noun (``a man who is blind``)."""
        for k in range(end, min(end + terms.DESCRIPTOR_WINDOW, len(tokens))):
            if persons[k]:
                return True
            if tokens[k] in terms.THINGS:
                return False
        linked = any(t in terms.LINKING_WORDS for t in tokens[max(0, start - 2) : start])
        return linked and any(persons[max(0, start - 6) : start])

    @staticmethod
    def _match(tokens: list[str], i: int, table) -> tuple[int, list[tuple[str, str]]] | None:
        """The longest term of ``table`` starting at token ``i``: (end, [(attribute, group)...]) or None."""
        best_len, hits = 0, []
        for words, attribute, group in table.get(tokens[i], ()):
            n = len(words)
            if n < best_len:
                break
            if tuple(tokens[i : i + n]) == words:
                best_len = n
                if (attribute, group) not in hits:
                    hits.append((attribute, group))
        return (i + best_len, hits) if best_len else None

    @staticmethod
    def _age(tokens: list[str], i: int) -> tuple[int, str] | None:
        """``N year old`` / ``N years old`` at token ``i``: (end, age group)."""
        if i + 2 >= len(tokens) or tokens[i + 1] not in ("year", "years") or tokens[i + 2] != "old":
            return None
        word = tokens[i]
        number = int(word) if _AGE_NUMBER.match(word) else _NUMBER_WORDS.get(word)
        if number is None:
            return None
        group = "child" if number < 13 else "teen" if number < 20 else "young" if number < 45 else "middle_aged"
        return i + 3, (group if number < 65 else "old")

    def has_person(self, text: str) -> bool:
        return any(self.persons(words_of(text)))

    def covers(self, text: str) -> bool:
        """Whether ``text`` holds a word of the list: such a span is the list's to judge, with its attachment rule
        (``black`` of a dog is no person's race), not the embedding's."""
        tokens = words_of(text)
        rules = terms.SKIN_WORDS | terms.BODY_PARTS | terms.WEIGHT_UNITS | terms.DECADES.keys()
        return any(
            t in self.nouns
            or t in rules
            or self._match(tokens, i, self.descriptors)
            or self._match(tokens, i, self.markers)
            for i, t in enumerate(tokens)
        )


_LEXICON: _Lexicon | None = None


def lexicon() -> _Lexicon:
    global _LEXICON
    if _LEXICON is None:
        _LEXICON = _Lexicon()
    return _LEXICON


def list_changes(caption: str, edited_caption: str) -> dict[str, str]:
    """The attributes whose groups differ between the people of two captions, with the words that differ
    (``{"gender": "woman -> man"}``); the word-list part of the screen."""
    before, after = lexicon().mentions(caption), lexicon().mentions(edited_caption)
    changes: dict[str, str] = {}
    for attribute in terms.ATTRIBUTES:
        old = Counter(m.group for m in before if m.attribute == attribute)
        new = Counter(m.group for m in after if m.attribute == attribute)
        if old == new:
            continue
        removed = sorted({m.words for m in before if m.attribute == attribute and (old - new)[m.group] > 0})
        added = sorted({m.words for m in after if m.attribute == attribute and (new - old)[m.group] > 0})
        changes[attribute] = f"{', '.join(removed) or '(none)'} -> {', '.join(added) or '(none)'}"
    return changes


@dataclass
class SensitiveScreenOptions(Options):
    """Options of the sensitive-edit screen.

    Attributes:
        model, revision: the sentence-transformers model (the label check's all-MiniLM-L6-v2 by default).
        similarity_threshold: a changed span this close (cosine) to an attribute's anchor phrases marks the edit, in
            a caption with a person; None: the word list alone.
        screen: ``flag`` keeps marked samples (default); ``drop`` removes them, each recorded as a failure.
        batch_size: phrases per encoder pass.
    """

    model: str = DEFAULT_SENTENCE_MODEL
    revision: str | None = DEFAULT_SENTENCE_MODEL_REVISION
    similarity_threshold: CosineThreshold | None = SIMILARITY_THRESHOLD
    screen: Literal["flag", "drop"] = "flag"
    batch_size: PositiveInt = 64


class SensitiveEditScreen:
    """``sensitive_edit_screen``: marks (or drops) the counterfactuals whose edit changes a protected attribute.

    The screened field is a list of samples (``ReleaseOutput(many=True)``) with ``edited_caption``,
    ``original_span`` and ``edited_span``; the record's ``caption`` is the source caption.
    """

    name = "screen"
    version = "2"  # 2: the phrase rules and the larger word list (docs/method.md, "Sensitive-edit screen")
    field = "counterfactuals"
    consumes = {"caption": "str", "counterfactuals": "list"}
    produces = {"counterfactuals": "list", "counterfactuals_sensitive_removed": "list"}
    screens = (OutputScreen("counterfactuals", SENSITIVE_FIELDS, removed="counterfactuals_sensitive_removed"),)
    options_class = SensitiveScreenOptions
    model_options = (
        replace(LabelPreservationCheck.model_options[0], role="sentence encoder of the sensitive-edit screen"),
    )

    def __init__(self, options: SensitiveScreenOptions | None = None, /, **values: Any) -> None:
        self.options = stage_options(type(self), options, values)
        self.source: str | None = None
        self._model = None
        self._anchor_embeddings = None

    @property
    def removed_field(self) -> str:
        return f"{self.field}_sensitive_removed"

    def load(self, device: str) -> None:
        if self.options.similarity_threshold is None:
            return
        # The label check's copy when it is loaded (same model, revision and device): lance_pipeline.models.shared.
        self._model, self.source = load_sentence_model(self.options.model, self.options.revision, device)

    def describe(self) -> dict[str, Any]:
        o = self.options
        return {
            "model": o.model if o.similarity_threshold is not None else None,
            "revision": o.revision if o.similarity_threshold is not None else None,
            "source": self.source,
            "similarity_threshold": o.similarity_threshold,
            "screen": o.screen,
            "word_list": terms.SOURCE,
            "attributes": list(terms.ATTRIBUTES),
        }

    # -- the screen ------------------------------------------------------------------------------------------------
    def screen_edits(self, edits: list[tuple[str, str, str, str]]) -> list[dict[str, Any]]:
        """Screen ``(caption, edited_caption, original_span, edited_span)`` tuples; one result each with
        ``sensitive_edit``, ``sensitive_attributes`` and ``sensitive_triggers`` (the metadata fields)."""
        found = [list_changes(caption, edited) for caption, edited, _, _ in edits]
        similar = self._similar_spans(edits)
        results = []
        for changes, near in zip(found, similar, strict=True):
            triggers = [f"{a}: {w}" for a, w in changes.items()]
            attributes = set(changes)
            for attribute, span, score in near:
                if attribute not in attributes:
                    attributes.add(attribute)
                    triggers.append(f"{attribute}: {span}~{score:.2f}")
            ordered = [a for a in terms.ATTRIBUTES if a in attributes]
            results.append(
                {
                    "sensitive_edit": bool(ordered),
                    "sensitive_attributes": ",".join(ordered) or None,
                    "sensitive_triggers": "; ".join(triggers) or None,
                }
            )
        return results

    def _similar_spans(self, edits: list[tuple[str, str, str, str]]) -> list[list[tuple[str, str, float]]]:
        """Per edit, (attribute, span, similarity) of changed spans close to an attribute's anchors."""
        threshold = self.options.similarity_threshold
        out: list[list[tuple[str, str, float]]] = [[] for _ in edits]
        if threshold is None:
            return out
        if self._model is None:
            raise RuntimeError("SensitiveEditScreen.load(device) must be called before screening")
        lex = lexicon()
        spans_of = []
        for caption, edited, original_span, edited_span in edits:
            person = lex.has_person(caption) or lex.has_person(edited)
            spans = [s.strip() for s in (original_span, edited_span) if s and s.strip() and not lex.covers(s)]
            spans = spans if person else []
            spans_of.append(spans if (original_span or "") != (edited_span or "") else [])
        phrases = sorted({s for spans in spans_of for s in spans})
        if not phrases:
            return out
        anchors = [(a, phrase) for a in terms.ATTRIBUTES for phrase in terms.ANCHORS[a]]
        if self._anchor_embeddings is None:
            self._anchor_embeddings = self._encode([p for _, p in anchors])
        sims = self._encode(phrases) @ self._anchor_embeddings.T  # unit vectors: cosine similarities
        index = {p: i for i, p in enumerate(phrases)}
        for k, spans in enumerate(spans_of):
            best: dict[str, tuple[float, str]] = {}
            for span in spans:
                row = sims[index[span]]
                for j, (attribute, _) in enumerate(anchors):
                    score = round(float(row[j]), 6)
                    if score >= threshold and score > best.get(attribute, (-2.0, ""))[0]:
                        best[attribute] = (score, span)
            out[k] = [(a, best[a][1], best[a][0]) for a in terms.ATTRIBUTES if a in best]
        return out

    def _encode(self, phrases: list[str]):
        return self._model.encode(
            phrases, batch_size=self.options.batch_size, normalize_embeddings=True, convert_to_tensor=True
        ).cpu()

    def process(self, records: list[Record]) -> list[Record | SampleFailure]:
        """Mark every sample of the screened field; with ``screen: drop`` remove the marked ones, listing each."""
        flat = []
        for r, record in enumerate(records):
            for i, item in enumerate(record.get(self.field) or []):
                flat.append(
                    (
                        r,
                        i,
                        (
                            record.get("caption") or "",
                            item.get("edited_caption") or "",
                            item.get("original_span") or "",
                            item.get("edited_span") or "",
                        ),
                    )
                )
        results = self.screen_edits([edit for _, _, edit in flat])
        by_record: dict[int, dict[int, dict[str, Any]]] = {}
        for (r, i, _), result in zip(flat, results, strict=True):
            by_record.setdefault(r, {})[i] = result
        out: list[Record | SampleFailure] = []
        for r, record in enumerate(records):
            kept, removed = [], []
            for i, item in enumerate(record.get(self.field) or []):
                result = by_record[r][i]
                if result["sensitive_edit"] and self.options.screen == "drop":
                    removed.append(
                        {
                            "index": i,
                            "edit_type": item.get("edit_type"),
                            "attributes": result["sensitive_attributes"],
                            "reason": f"sensitive edit dropped ({result['sensitive_triggers']}): "
                            f"{item.get('edited_caption')!r}",
                        }
                    )
                    continue
                kept.append({**item, **result, SAMPLE_INDEX: item.get(SAMPLE_INDEX, i)})
            out.append({self.field: kept, self.removed_field: removed})
        return out

    @classmethod
    def summarize(cls, updates: list[dict[str, Any]]) -> dict[str, Any]:
        """Counts for the manifest and the card: samples screened, marked (kept and dropped) and by attribute."""
        field, removed_field = cls.field, f"{cls.field}_sensitive_removed"
        checked = marked = dropped = 0
        by_attribute: dict[str, int] = {}
        for update in updates:
            kept = update.get(field) or []
            removed = update.get(removed_field) or []
            checked += len(kept) + len(removed)
            dropped += len(removed)
            marks = [i.get("sensitive_attributes") for i in kept if i.get("sensitive_edit")]
            marks += [r.get("attributes") for r in removed]
            marked += len(marks)
            for attributes in marks:
                for attribute in str(attributes or "").split(","):
                    if attribute:
                        by_attribute[attribute] = by_attribute.get(attribute, 0) + 1
        return {
            "kind": "sensitive_edits",
            "checked": checked,
            "marked": marked,
            "dropped": dropped,
            "by_attribute": dict(sorted(by_attribute.items())),
        }


class LanceRSensitiveEditScreen(SensitiveEditScreen):
    """``sensitive_edit_screen_lance_r``: the same screen on the LANCE-R baseline's random word edits."""

    name = "screen_lance_r"
    field = "lance_r"
    consumes = {"caption": "str", "lance_r": "list"}
    produces = {"lance_r": "list", "lance_r_sensitive_removed": "list"}
    screens = (OutputScreen("lance_r", SENSITIVE_FIELDS, removed="lance_r_sensitive_removed"),)


class StrengthSensitiveEditScreen(SensitiveEditScreen):
    """``sensitive_edit_screen_strength``: the same screen on the strength config's candidates (every candidate of an
    edit has its edit's caption, so a dropped edit leaves no candidate behind)."""

    name = "screen_strength"
    field = STRENGTH_FIELD
    consumes = {"caption": "str", STRENGTH_FIELD: "list"}
    produces = {STRENGTH_FIELD: "list", f"{STRENGTH_FIELD}_sensitive_removed": "list"}
    screens = (OutputScreen(STRENGTH_FIELD, SENSITIVE_FIELDS, removed=f"{STRENGTH_FIELD}_sensitive_removed"),)
