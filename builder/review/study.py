"""What a review asks and of which samples, in which order per reviewer, and how reviewers agreed.

The questions are those of the field's human studies: LANCE's (Prabhu et al. 2023, Table 4: label consistency, edit
success, realism; its failure modes, Appendix E, are the reject reasons), ImageNet*'s label and shift checks (Vendrow
et al. 2023), DILLEMA's raters. A study selects N samples per group (edit type, shift or config) with a seed, may hide
the originals and everything an automatic filter said (``blind``), and gives each reviewer the same samples in an
order of their own (``shuffle``), reproducible from the seed and the reviewer's name.

Agreement is Fleiss' kappa (statsmodels) over the items every rater of a question answered, and Cohen's kappa
(scikit-learn) when exactly two raters did, each with its numbers of items and raters.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from builder import release_format as rf
from builder.review.calibration import JUDGE_CLASS_FIELD, has_judge_scores
from builder.review.index import ReleaseIndex, ReviewSample
from builder.review.store import VERDICT, VERDICTS, Judgement, check_reviewer
from lance_pipeline.readers import expect_bool, expect_int, expect_list, expect_str, read_yaml

GROUP_BY = ("edit_type", "shift", "config", "judge_class_p")  # judge_class_p: bins of the judge's class score
MAX_STUDY_BYTES = 1 << 20  # a study is a few hundred bytes of settings
MAX_TEXT = 500  # a question's text, an answer


@dataclass(frozen=True)
class Question:
    """One question with its answers; ``text`` may hold ``{class}`` (the label) and ``{edit}`` (what was changed)."""

    id: str
    text: str
    answers: tuple[str, ...] = ("yes", "no", "unsure")

    def __post_init__(self) -> None:
        object.__setattr__(self, "answers", tuple(self.answers))
        if not self.id.isidentifier() or self.id == VERDICT:
            raise ValueError(f"question id {self.id!r}: use letters, digits and '_' (and not {VERDICT!r})")
        if not 2 <= len(self.answers) <= 9 or len(set(self.answers)) != len(self.answers):
            raise ValueError(f"question {self.id!r}: give 2 to 9 distinct answers (keys 1-9), got {self.answers}")


# The studies' questions (one answer each; LANCE rated realism and edit success 1-5, here yes / no / unsure).
QUESTIONS = {
    "still_class": Question("still_class", "Is it still a {class}?"),
    "shows_edit": Question("shows_edit", "Does the image show the edit ({edit})?"),
    "realistic": Question("realistic", "Is it realistic?"),
}
# Reasons to reject, after LANCE's failure modes (Appendix E) and its ethics section; free text is always possible.
REJECT_REASONS = (
    "the class changed",
    "the edit is not visible",
    "unrealistic or artefacts",
    "it changes more than the edit",
    "meaningless edit",
    "ethical concern (stereotype, a person's perceived attributes)",
)


@dataclass(frozen=True)
class Study:
    """A review's settings (stored with its judgements; a study keeps them for life).

    Attributes:
        name: the study's name (judgements are kept per study).
        questions: asked of every sample, in order, one answer each (none: only the verdict).
        configs: the configs reviewed (empty: the release kind's counterfactual configs, see ``default_configs``).
        per_group: review N samples per group (None: every sample).
        group_by: ``edit_type``, ``shift``, ``config`` or ``judge_class_p`` (``judge_bins`` equal-width bins of the
            judge's class score, and one group of the samples it did not score: a study to calibrate the judge
            against, which finds the samples it doubts as well as those it is sure of).
        judge_bins: the number of bins of ``group_by: judge_class_p``.
        seed: the selection's and the orders' seed.
        blind: hide what the filters said (scores, screens, config and key) and the other reviewers.
        shuffle: each reviewer sees the samples in an order of their own (from the seed and their name).
        show_original: show the original beside the counterfactual.
        reviewers: who may judge (empty: anyone who opens the page, under a name of their choice); judgements of
            anyone else are refused by the page and, found in the database, refused on load.
    """

    name: str = "review"
    questions: tuple[Question, ...] = ()
    configs: tuple[str, ...] = ()
    per_group: int | None = None
    group_by: str = "edit_type"
    judge_bins: int = 5
    seed: int = 0
    blind: bool = False
    shuffle: bool = False
    show_original: bool = True
    reviewers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "questions", tuple(self.questions))
        object.__setattr__(self, "configs", tuple(self.configs))
        object.__setattr__(self, "reviewers", tuple(check_reviewer(r) for r in self.reviewers))
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            raise ValueError(f"study name {self.name!r}: use letters, digits, '-', '_' or '.'")
        if self.group_by not in GROUP_BY:
            raise ValueError(f"group_by {self.group_by!r}: expected one of {', '.join(GROUP_BY)}")
        if not 1 <= self.judge_bins <= 100:
            raise ValueError(f"judge_bins must be 1 to 100 bins of the judge's score, got {self.judge_bins}")
        if self.per_group is not None and self.per_group < 1:
            raise ValueError(f"per_group must be a positive number of samples, got {self.per_group}")
        ids = [q.id for q in self.questions]
        if len(set(ids)) != len(ids):
            raise ValueError(f"a question is asked twice: {ids}")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["questions"] = [asdict(q) | {"answers": list(q.answers)} for q in self.questions]
        data["configs"] = list(self.configs)
        data["reviewers"] = list(self.reviewers)
        if not self.reviewers:
            del data["reviewers"]  # the spec of a study without a list is the one stored before lists existed
        if self.group_by != "judge_class_p" and self.judge_bins == Study.judge_bins:
            del data["judge_bins"]  # likewise for the studies stored before judge bins existed
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "study") -> Study:
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a mapping of study settings")
        known = set(cls.__dataclass_fields__)
        unknown = sorted((str(k) for k in set(data) - known), key=str)
        if unknown:
            shown = [repr(u)[:40] for u in unknown[:5]]
            raise ValueError(f"{where}: unknown setting(s) {', '.join(shown)}; settings are {', '.join(sorted(known))}")
        values = _typed(data, where)
        values["questions"] = tuple(
            _question(q, f"{where}: questions.{i}")
            for i, q in enumerate(expect_list(data.get("questions") or [], f"{where}: questions"))
        )
        try:
            return cls(**values)
        except TypeError as err:
            raise ValueError(f"{where}: {err}") from err

    @classmethod
    def from_file(cls, path: Path) -> Study:
        data = read_yaml(path, max_bytes=MAX_STUDY_BYTES, what=f"study {path}")
        return cls.from_dict(data if data is not None else {}, where=f"study {path}")


def _typed(data: dict[str, Any], where: str) -> dict[str, Any]:
    """The study's settings with each one's type checked, none coerced (``seed: [1, 2]`` and ``blind: 1`` are
    refused, naming the setting)."""
    values = dict(data)
    for name in ("name", "group_by"):
        if name in values:
            expect_str(values[name], f"{where}: {name}", max_chars=MAX_TEXT)
    for name in ("blind", "shuffle", "show_original"):
        if name in values:
            expect_bool(values[name], f"{where}: {name}")
    if "seed" in values:
        expect_int(values["seed"], f"{where}: seed", minimum=0, maximum=2**63 - 1)
    if "judge_bins" in values:
        expect_int(values["judge_bins"], f"{where}: judge_bins", minimum=1, maximum=100)
    if values.get("per_group") is not None:
        expect_int(values["per_group"], f"{where}: per_group", minimum=1, maximum=2**31 - 1)
    for name in ("configs", "reviewers"):
        if name in values:
            items = expect_list(values[name], f"{where}: {name}")
            for i, item in enumerate(items):
                expect_str(item, f"{where}: {name}.{i}", max_chars=MAX_TEXT)
    return values


def _question(value: Any, where: str) -> Question:
    if isinstance(value, str):
        if value not in QUESTIONS:
            raise ValueError(f"{where}: unknown question {value!r}; built in: {', '.join(QUESTIONS)}, or give id+text")
        return QUESTIONS[value]
    if isinstance(value, dict) and {"id", "text"} <= set(value) and set(value) <= {"id", "text", "answers"}:
        answers = expect_list(value.get("answers") or ["yes", "no", "unsure"], f"{where}: answers")
        return Question(
            expect_str(value["id"], f"{where}: id", max_chars=64),
            expect_str(value["text"], f"{where}: text", max_chars=MAX_TEXT),
            tuple(expect_str(a, f"{where}: answers.{i}", max_chars=MAX_TEXT) for i, a in enumerate(answers)),
        )
    raise ValueError(f"{where}: a question is a built-in id or {{id, text, answers}}, got {repr(value)[:80]}")


def default_configs(index: ReleaseIndex) -> list[str]:
    """What a release kind's review looks at by default: the counterfactuals of a release that edits a source's
    images (LANCE's, ControlNet's); every generated config of a kind whose images are all generated
    (``ReleaseKind.generated``: interfaces, discovery)."""
    configs = index.configs()
    if not rf.release_kind(index.manifest).generated:
        return [c for c in configs if c == "counterfactual"] or [c for c in configs if c != "original"]
    return [c for c in configs if c not in ("original", "reconstructed")]


def group_of(sample: ReviewSample, group_by: str, bins: int = 5) -> str:
    if group_by == "config":
        return sample.config
    if group_by == JUDGE_CLASS_FIELD:
        return judge_bin(sample.meta.get(JUDGE_CLASS_FIELD), bins)
    value = sample.meta.get(group_by)
    return str(value) if value is not None else sample.config


def judge_bin(score: float | None, bins: int) -> str:
    """The bin of a judge score among ``bins`` equal-width bins of [0, 1] (the last one closed), named by its range;
    ``unscored`` where the judge did not score the sample."""
    if score is None:
        return "unscored"
    i = min(int(float(score) * bins), bins - 1)
    return f"{JUDGE_CLASS_FIELD} [{i / bins:.2f}, {(i + 1) / bins:.2f}{']' if i == bins - 1 else ')'}"


def _rng(*parts: Any) -> random.Random:
    digest = hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def select(study: Study, index: ReleaseIndex) -> list[tuple[str, str]]:
    """The study's samples, as (config, key) in config then key order: all of the configs, or ``per_group`` per group
    drawn with the study's seed (the same release and study always give the same samples)."""
    configs = list(study.configs) or default_configs(index)
    missing = [c for c in configs if c not in index.configs()]
    if missing:
        raise ValueError(f"config(s) {missing} are not in the release (it has {', '.join(index.configs())})")
    items = [(c, k) for c in configs for k in index.keys(c)]
    if study.group_by == JUDGE_CLASS_FIELD and not has_judge_scores(index.manifest.release_spec, configs):
        raise ValueError(
            f"group_by {JUDGE_CLASS_FIELD}: config(s) {', '.join(configs)} carry no judge score (run the judge stage "
            "first, or group by edit_type)"
        )
    if study.per_group is None:
        return items
    groups: dict[str, list[tuple[str, str]]] = {}
    for item in items:
        groups.setdefault(group_of(index.get(*item), study.group_by, study.judge_bins), []).append(item)
    chosen: set[tuple[str, str]] = set()
    for group, members in sorted(groups.items()):
        rng = _rng(study.seed, study.name, "select", group)
        chosen.update(rng.sample(members, min(study.per_group, len(members))))
    return [item for item in items if item in chosen]


def reviewer_order(study: Study, count: int, reviewer: str) -> list[int]:
    """The positions of the study's samples in the order ``reviewer`` sees them."""
    order = list(range(count))
    if study.shuffle:
        _rng(study.seed, study.name, "order", reviewer).shuffle(order)
    return order


# -- aggregation ------------------------------------------------------------------------------------------------------
@dataclass
class ItemReview:
    """What the reviewers said about one sample."""

    verdict: str  # accepted | rejected | flagged | unreviewed
    reasons: list[str] = field(default_factory=list)
    answers: dict[str, dict[str, int]] = field(default_factory=dict)  # question -> answer -> count (verdict too)
    raters: int = 0
    agreement: float | None = None  # share of rater pairs that gave the same verdict (Fleiss' P_i); None below 2


def pairwise_agreement(counts: list[int]) -> float | None:
    """Fleiss' per-item agreement P_i: the share of ordered rater pairs that agree (None with fewer than 2 raters)."""
    n = sum(counts)
    if n < 2:
        return None
    return round(sum(c * (c - 1) for c in counts) / (n * (n - 1)), 6)


def aggregate(latest: dict[tuple[str, str, str, str], Judgement], items: list[tuple[str, str]]) -> dict:
    """Per sample (config, key): the verdict of its reviewers (a strict majority accepts or rejects; anything else,
    a tie or a flag majority, is ``flagged`` for another look), their reasons, answer counts and agreement."""
    by_item: dict[tuple[str, str], list[Judgement]] = {}
    for (_, config, key, _), judgement in latest.items():
        by_item.setdefault((config, key), []).append(judgement)
    out: dict[tuple[str, str], ItemReview] = {}
    for item in items:
        rows = by_item.get(item, [])
        verdicts = {j.reviewer: j for j in rows if j.question == VERDICT}
        answers: dict[str, dict[str, int]] = {}
        for j in sorted(rows, key=lambda j: (j.question, j.answer)):
            counts = answers.setdefault(j.question, {})
            counts[j.answer] = counts.get(j.answer, 0) + 1
        if not verdicts:
            out[item] = ItemReview("unreviewed", answers=answers)
            continue
        counts = [sum(j.answer == v for j in verdicts.values()) for v in VERDICTS]
        n = len(verdicts)
        verdict = "accepted" if counts[0] * 2 > n else "rejected" if counts[1] * 2 > n else "flagged"
        reasons = sorted({j.reason for j in verdicts.values() if j.answer == "reject" and j.reason})
        out[item] = ItemReview(verdict, reasons, answers, n, pairwise_agreement(counts))
    return out


def agreement(
    latest: dict[tuple[str, str, str, str], Judgement], questions: list[str], items: list[tuple[str, str]]
) -> dict[str, dict[str, Any]]:
    """Per question (the verdict included): Fleiss' kappa over the items that every rater of the question answered,
    Cohen's kappa when there are exactly two raters, the observed agreement, and the numbers of items and raters."""
    import numpy as np
    from sklearn.metrics import cohen_kappa_score
    from statsmodels.stats.inter_rater import aggregate_raters, fleiss_kappa

    wanted = set(items)
    out: dict[str, dict[str, Any]] = {}
    for question in [VERDICT, *questions]:
        answers: dict[tuple[str, str], dict[str, str]] = {}
        for (reviewer, config, key, q), judgement in latest.items():
            if q == question and (config, key) in wanted:
                answers.setdefault((config, key), {})[reviewer] = judgement.answer
        raters = sorted({r for by in answers.values() for r in by})
        complete = sorted(item for item, by in answers.items() if len(by) == len(raters))
        entry: dict[str, Any] = {"raters": len(raters), "items": len(complete)}
        if len(raters) < 2 or not complete:
            out[question] = entry | {"fleiss_kappa": None, "cohen_kappa": None, "observed_agreement": None,
                                     "note": "needs two raters of the same items"}  # fmt: skip
            continue
        categories = sorted({a for item in complete for a in answers[item].values()})
        codes = np.array([[categories.index(answers[item][r]) for r in raters] for item in complete])
        table, _ = aggregate_raters(codes, n_cat=len(categories))
        observed = float(np.mean([pairwise_agreement(list(row)) for row in table]))
        if len(categories) < 2:
            entry |= {"fleiss_kappa": None, "cohen_kappa": None, "note": "undefined: every answer was the same"}
        else:
            entry["fleiss_kappa"] = round(float(fleiss_kappa(table, method="fleiss")), 6)
            entry["cohen_kappa"] = (
                round(float(cohen_kappa_score(codes[:, 0], codes[:, 1])), 6) if len(raters) == 2 else None
            )
        out[question] = entry | {"observed_agreement": round(observed, 6)}
    return out
