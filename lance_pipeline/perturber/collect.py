"""Collect caption edits from a teacher LLM: the instruction data for finetuning the structured perturber.

Prabhu et al., NeurIPS 2023, "Stress-testing Visual Models by Generating Language-guided Counterfactual Images"
(arXiv 2305.19164), section 3.1: the authors asked a strong LLM for ~0.6k caption perturbations of the edit types
on COCO captions and LoRA-finetuned LLaMA-7B on them. Neither the data nor the script was released. This module
rebuilds the data step for any teacher:

* a local transformers causal LM (the perturb stage's own few-shot chat prompt, :class:`TransformersTeacher`), or
* any OpenAI-compatible chat-completions endpoint (:class:`OpenAIChatTeacher`; vLLM, TGI, llama.cpp's server and
  hosted APIs speak it), with URL and key from the environment.

Every (caption, edit type) gets one request. The answer is parsed with the perturber's own parser and each
variation is then judged by :func:`judge_variation`: the token-level span diff must show one contiguous change of
the requested aspect (per-type checks below) that keeps the class and the rest of the caption. Accepted and
rejected variations are both kept, the rejected ones with their reason, so the data documents its own filter.

Teachers fail in practice (HTTP 5xx, timeouts, a JSON body without ``choices``, an empty message): requests are
retried a bounded number of times and every failure is counted; a request that still fails becomes a row with
``teacher_error`` set and no variations, never an exception that loses the rest of the run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lance_pipeline.edit_types import CHECKS, validate_edit_types
from lance_pipeline.edit_types import edit_type as edit_type_row
from lance_pipeline.readers import load_json
from lance_pipeline.text.edit_spans import SpanDiff, diff_captions
from lance_pipeline.text.label_checks import label_names_of
from lance_pipeline.text.perturbation import (
    DEFAULT_PERTURBER,
    PromptPerturber,
    chat_messages,
    parse_perturber_output,
)

logger = logging.getLogger(__name__)

# Environment variables of an OpenAI-compatible teacher (the names the openai client and vLLM's docs use).
TEACHER_URL_ENV = "OPENAI_BASE_URL"
TEACHER_KEY_ENV = "OPENAI_API_KEY"

# Each edit type's span limit and checks are columns of the one table of edit types (lance_pipeline.edit_types).
# An edit must keep at least this fraction of the caption's words (the perturber parser's default).
MIN_SHARED_FRACTION = 0.5

# Words naming the kind of image: a domain edit must change or add one, other edits must leave them alone.
DOMAIN_WORDS = frozenset(
    "photo photograph photography snapshot picture image painting painted oil watercolor watercolour acrylic "
    "sketch sketched pencil charcoal drawing drawn cartoon comic anime manga illustration illustrated sculpture "
    "statue figurine render rendering 3d cgi mosaic origami embroidery tapestry graffiti mural tattoo engraving "
    "woodcut print poster pixel pixelated art artwork vector clay plasticine toy plush lego stained-glass "
    "infrared x-ray pastel silhouette claymation".split()
)
# Words naming weather: a weather edit must put one in.
WEATHER_WORDS = frozenset(
    "weather rain rainy raining rainfall rainstorm drizzle drizzly downpour shower showers snow snowy snowing "
    "snowfall snowstorm blizzard sleet hail hailstorm fog foggy mist misty haze hazy smog sun sunny sunshine "
    "sunlit cloud clouds cloudy overcast storm stormy thunderstorm thunder lightning wind windy breezy gale "
    "frost frosty icy freezing heatwave humid rainbow tornado hurricane dust sandstorm gloomy clear".split()
)

REJECT_REASONS = (
    "identical",  # no word changed
    "class_removed",  # the class name was in the caption and is not in the edit
    "changed_too_much",  # the change is longer than one aspect of its type, or too little of the caption stays
    *(reason for reason, _ in CHECKS.values()),  # a per-type check of the table failed
)


def _words(text: str) -> set[str]:
    return {w.strip(".,;:!?\"'()").casefold() for w in text.split()} - {""}


def _contains_phrase(text: str, phrase: str) -> bool:
    return re.search(r"(?<!\w)" + re.escape(phrase.casefold()) + r"(?!\w)", text.casefold()) is not None


def judge_variation(
    caption: str, edited: str, edit_type: str, label_name: str | None = None
) -> tuple[SpanDiff, str | None]:
    """Whether ``edited`` changes only the ``edit_type`` aspect of ``caption`` and keeps the class.

    The checks are textual and deliberately simple (the embedding-based class check of
    :mod:`lance_pipeline.text.label_checks` runs later on the spans); the per-type ones are columns of the table of
    edit types (:mod:`lance_pipeline.edit_types`):

    1. the span diff finds a change (``identical`` otherwise);
    2. a class name present in the caption is still present (``class_removed``);
    3. the type's ``one_place`` check, if it has it: the edit changes one place (``several_changes``);
    4. the change is at most the type's ``max_span_words`` words and keeps at least half the caption
       (``changed_too_much``);
    5. the type's other checks, in the order of :data:`lance_pipeline.edit_types.CHECKS`: ``changes_domain`` (a word
       of :data:`DOMAIN_WORDS` changed or added), ``keeps_domain`` (none touched), ``adds_weather`` (a word of
       :data:`WEATHER_WORDS` added), ``replaces`` (words replaced, not only added or dropped).

    Returns:
        The span diff and ``None`` when the variation is accepted, else the reason (one of :data:`REJECT_REASONS`).
    """
    row = edit_type_row(edit_type)
    diff = diff_captions(caption, edited)
    if diff.n_regions == 0:
        return diff, "identical"
    if label_name:
        present = [name for name in label_names_of(label_name) if _contains_phrase(caption, name)]
        if present and not any(_contains_phrase(edited, name) for name in present):
            return diff, "class_removed"
    if "one_place" in row.checks and diff.n_regions > 1:
        return diff, CHECKS["one_place"][0]
    n_words = max(1, len(caption.split()))
    if (
        max(diff.n_original_tokens, diff.n_edited_tokens) > row.max_span_words
        or diff.n_shared_tokens / n_words < MIN_SHARED_FRACTION
    ):
        return diff, "changed_too_much"
    original_words, edited_words = _words(diff.original_span), _words(diff.edited_span)
    touches_domain = bool((original_words | edited_words) & DOMAIN_WORDS)
    failed = {
        "changes_domain": not touches_domain,
        "keeps_domain": touches_domain,
        "adds_weather": not edited_words & WEATHER_WORDS,
        "replaces": not (diff.original_span and diff.edited_span),
    }
    for check in CHECKS:
        if check != "one_place" and check in row.checks and failed[check]:
            return diff, CHECKS[check][0]
    return diff, None


# -- teachers -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TeacherRequest:
    """One question to the teacher: ``n`` variations of ``caption`` of type ``edit_type``."""

    caption: str
    edit_type: str
    label_name: str | None
    n: int
    seed: int


@dataclass
class TeacherAnswer:
    """The teacher's text (``None`` when every attempt failed, then ``error`` says why)."""

    text: str | None
    truncated: bool = False
    error: str | None = None


class TeacherError(ValueError):
    """The teacher refuses every request (bad key, unknown model): stop instead of failing each row alike."""


class TransformersTeacher:
    """A local transformers causal LM as teacher, prompted exactly like the perturb stage (few-shot chat).

    Args:
        model: Hub id or local directory of an instruction-tuned causal LM.
        revision: Hub revision of ``model``.
        n_per_type: Variations requested per (caption, edit type).
        device: Torch device.
        options: Further :class:`~lance_pipeline.text.perturbation.PromptPerturber` options (``do_sample``,
            ``temperature``, ``max_new_tokens``, ``batch_size``, ``dtype``).
    """

    def __init__(
        self,
        model: str = DEFAULT_PERTURBER,
        revision: str | None = None,
        n_per_type: int = 3,
        device: str = "cpu",
        **options: Any,
    ) -> None:
        self.perturber = PromptPerturber(model=model, revision=revision, n_per_type=n_per_type, **options)
        self.device = device
        self.counts: Counter = Counter()
        self._loaded = False

    def describe(self) -> dict[str, Any]:
        described = self.perturber.describe()
        model = self.perturber.model_id
        model = Path(model).name if os.path.isdir(model) else model  # a local directory: its name, not the path
        return {"kind": "transformers", "model": model, "revision": self.perturber.revision,
                "do_sample": described["do_sample"], "temperature": described["temperature"],
                "max_new_tokens": described["max_new_tokens"]}  # fmt: skip

    def answer(self, requests: list[TeacherRequest]) -> list[TeacherAnswer]:
        if not self._loaded:
            self.perturber.load(self.device)
            self._loaded = True
        prompts = [self.perturber.build_prompt(r.caption, r.edit_type, r.label_name) for r in requests]
        self.counts["requests"] += len(prompts)
        answers = self.perturber.generate(prompts, [r.seed for r in requests])
        return [TeacherAnswer(text, truncated) for text, truncated in answers]


class OpenAIChatTeacher:
    """A teacher behind an OpenAI-compatible ``/chat/completions`` endpoint.

    The URL and key come from the environment (:data:`TEACHER_URL_ENV`, :data:`TEACHER_KEY_ENV`) unless given;
    the key is sent as a bearer token and never logged, printed or written (``describe`` names only the model).

    Args:
        model: The model name the server expects.
        base_url: e.g. ``http://127.0.0.1:8000/v1`` (default: ``$OPENAI_BASE_URL``).
        api_key: Bearer token (default: ``$OPENAI_API_KEY``; local servers often need none).
        n_per_type: Variations requested per (caption, edit type).
        temperature: Sampling temperature sent with each request; the request's seed is sent too.
        max_tokens: Token budget per answer.
        max_retries: Further attempts after a server error, a timeout or a malformed body.
        backoff_s: Wait before retry ``k`` is ``backoff_s * 2**(k-1)`` seconds.
        timeout_s: Per-request timeout.
        concurrency: Requests in flight at once.
        few_shot: Put the edit type's example into the conversation.
    """

    def __init__(
        self,
        model: str,
        base_url: str | None = None,
        api_key: str | None = None,
        n_per_type: int = 3,
        temperature: float = 0.7,
        max_tokens: int = 256,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        timeout_s: float = 60.0,
        concurrency: int = 4,
        few_shot: bool = True,
    ) -> None:
        base_url = base_url or os.environ.get(TEACHER_URL_ENV, "")
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"the teacher endpoint needs a URL: set {TEACHER_URL_ENV} (e.g. http://127.0.0.1:8000/v1), "
                f"got {base_url!r}"
            )
        if max_retries < 0 or concurrency < 1 or max_tokens < 1:
            raise ValueError(
                f"need max_retries >= 0, concurrency >= 1 and max_tokens >= 1, got {max_retries}, {concurrency}, "
                f"{max_tokens}"
            )
        self.model = str(model)
        self.url = base_url.rstrip("/") + "/chat/completions"
        self._api_key = api_key if api_key is not None else os.environ.get(TEACHER_KEY_ENV)
        self.n_per_type = n_per_type
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.concurrency = concurrency
        self.few_shot = few_shot
        self.counts: Counter = Counter()

    def describe(self) -> dict[str, Any]:
        return {"kind": "openai-chat", "model": self.model, "temperature": self.temperature,
                "max_tokens": self.max_tokens, "few_shot": self.few_shot}  # fmt: skip

    def answer(self, requests: list[TeacherRequest]) -> list[TeacherAnswer]:
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(self._ask, requests))

    def _ask(self, request: TeacherRequest) -> TeacherAnswer:
        messages = chat_messages(
            edit_type_row(request.edit_type).instruction, request.caption, request.edit_type, request.label_name, request.n,
            self.few_shot,
        )  # fmt: skip
        body = json.dumps(
            {"model": self.model, "messages": messages, "temperature": self.temperature,
             "max_tokens": self.max_tokens, "seed": request.seed, "n": 1}
        ).encode()  # fmt: skip
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        error = "no attempt"
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.counts["retries"] += 1
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            self.counts["requests"] += 1
            try:
                with urllib.request.urlopen(
                    urllib.request.Request(self.url, data=body, headers=headers, method="POST"), timeout=self.timeout_s
                ) as response:
                    payload = response.read()
            except urllib.error.HTTPError as exc:
                detail = exc.read()[:200].decode("utf-8", "replace").strip()
                if exc.code in (408, 409, 429) or exc.code >= 500:
                    self.counts["server_errors"] += 1
                    error = f"HTTP {exc.code}: {detail}"
                    logger.warning("teacher answered HTTP %d (attempt %d): %s", exc.code, attempt + 1, detail)
                    continue
                if exc.code in (401, 403, 404):  # wrong key, model or URL: every request would fail alike
                    hint = f" (check {TEACHER_KEY_ENV})" if exc.code in (401, 403) else f" (check {TEACHER_URL_ENV})"
                    raise TeacherError(
                        f"the teacher at {_redact(self.url)} refused the request: HTTP {exc.code} {detail}{hint}"
                    ) from None
                # Another client error concerns this request (too long, rejected content): no retry, next row.
                self.counts["client_errors"] += 1
                self.counts["failed_requests"] += 1
                return TeacherAnswer(None, error=f"HTTP {exc.code}: {detail}")
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
                self.counts["server_errors"] += 1
                error = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
                logger.warning("teacher unreachable (attempt %d): %s", attempt + 1, error)
                continue
            text, finish_reason = _chat_content(payload)
            if text is None:
                self.counts["malformed_responses"] += 1
                error = f"malformed response: {payload[:120].decode('utf-8', 'replace')!r}"
                logger.warning("teacher sent a malformed response (attempt %d)", attempt + 1)
                continue
            return TeacherAnswer(text, truncated=finish_reason == "length")
        self.counts["failed_requests"] += 1
        return TeacherAnswer(None, error=f"gave up after {self.max_retries + 1} attempt(s): {error}")


def _redact(url: str) -> str:
    """``url`` without user info, query or fragment (where keys hide), for messages."""
    parts = urllib.parse.urlsplit(url)
    netloc = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _chat_content(payload: bytes) -> tuple[str | None, str | None]:
    """The message text and finish reason of a chat-completions body, or ``(None, None)`` if it has none."""
    try:
        choice = json.loads(payload)["choices"][0]
        content = choice["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None, None
    if not isinstance(content, str):
        return None, None
    return content, choice.get("finish_reason") if isinstance(choice, dict) else None


# -- collection ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CaptionItem:
    """A caption to perturb and the class it must keep (``None`` when unknown)."""

    caption: str
    label_name: str | None = None


@dataclass
class CollectResult:
    """Rows (one per caption and edit type) and counts of what happened."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)


def _norm_caption(text: str) -> str:
    return " ".join(text.split())


def row_key(caption: str, label_name: str | None, edit_type: str) -> str:
    """A location-independent key of one (caption, class, edit type)."""
    digest = hashlib.sha256(f"{caption.casefold()}\x00{label_name or ''}\x00{edit_type}".encode()).hexdigest()
    return digest[:16]


def split_of(caption: str, test_fraction: float) -> str:
    """``"test"`` for a stable ``test_fraction`` of captions (by hash, so all edit types of a caption agree)."""
    bucket = int.from_bytes(hashlib.sha256(caption.casefold().encode()).digest()[:8], "big") / 2**64
    return "test" if bucket < test_fraction else "train"


def dedupe_captions(items: list[CaptionItem]) -> tuple[list[CaptionItem], int]:
    """Drop empty captions and repeats (same words up to case and spacing, same class); keeps first occurrences."""
    seen: set[tuple[str, str | None]] = set()
    kept: list[CaptionItem] = []
    for item in items:
        caption = _norm_caption(item.caption)
        if not caption:
            continue
        key = (caption.casefold(), item.label_name)
        if key in seen:
            continue
        seen.add(key)
        kept.append(CaptionItem(caption, item.label_name))
    return kept, len(items) - len(kept)


def collect_edits(
    items: list[CaptionItem],
    teacher: TransformersTeacher | OpenAIChatTeacher,
    edit_types: list[str] | tuple[str, ...] | str | None = None,
    n_per_type: int = 3,
    test_fraction: float = 0.1,
    seed: int = 0,
    batch_size: int = 32,
    answer_log: str | Path | None = None,
) -> CollectResult:
    """Ask ``teacher`` for edits of every caption and judge each variation.

    Args:
        items: Captions with their class names (deduplicated here).
        teacher: Where the answers come from.
        edit_types: Edit types to request per caption.
        n_per_type: Variations requested per (caption, edit type).
        test_fraction: Share of captions held out as the ``test`` split (by caption hash).
        seed: Mixed into each request's seed (sent to the teacher, used when it samples).
        batch_size: Requests handed to the teacher at once.
        answer_log: A JSON-lines file of the teacher's answers, appended after every batch. Answers already in it
            for the same teacher settings and request are reused instead of asked again, so an interrupted or
            repeated collection costs no second request (failed requests are asked again).

    Returns:
        A :class:`CollectResult`; rows are in caption order, then edit-type order.
    """
    types = validate_edit_types(edit_types)
    if not 0 <= test_fraction < 1:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    captions, n_duplicates = dedupe_captions(items)
    if not captions:
        raise ValueError("no captions to perturb (the input is empty after dropping blanks and duplicates)")
    jobs = [
        TeacherRequest(
            item.caption, edit_type, item.label_name, n_per_type,
            int(row_key(item.caption, item.label_name, edit_type), 16) % 2**31 ^ seed,
        )
        for item in captions
        for edit_type in types
    ]  # fmt: skip
    teacher_id = json.dumps(teacher.describe(), sort_keys=True)
    answer_ids = {job: _answer_id(teacher_id, job) for job in jobs}
    known = _read_answer_log(answer_log)
    reasons: Counter = Counter()
    result = CollectResult()
    reused = 0
    for start in range(0, len(jobs), batch_size):
        batch = jobs[start : start + batch_size]
        todo = [job for job in batch if answer_ids[job] not in known]
        fresh = dict(zip(todo, teacher.answer(todo), strict=True)) if todo else {}
        if answer_log is not None and fresh:
            with open(answer_log, "a", encoding="utf-8") as log:
                for job, answer in fresh.items():
                    if answer.text is not None:
                        record = {"id": answer_ids[job], "text": answer.text, "truncated": answer.truncated}
                        log.write(json.dumps(record, sort_keys=True) + "\n")
        reused += len(batch) - len(todo)
        for request in batch:
            answer = fresh.get(request) or known[answer_ids[request]]
            row = _judge_answer(request, answer, test_fraction)
            reasons.update(r["reason"] for r in row["rejected"])
            result.rows.append(row)
        logger.info("collected %d / %d (caption, edit type) answers", len(result.rows), len(jobs))
    accepted = sum(len(r["variations"]) for r in result.rows)
    result.stats = {
        "captions_in": len(items),
        "duplicate_captions_dropped": n_duplicates,
        "captions": len(captions),
        "requests": len(jobs),
        "answers_reused": reused,
        "failed_requests": sum(1 for r in result.rows if r["teacher_error"]),
        "variations_accepted": accepted,
        "variations_rejected": sum(reasons.values()),
        "rejected_by_reason": dict(sorted(reasons.items())),
        "rows_with_variations": sum(1 for r in result.rows if r["variations"]),
        "teacher": dict(sorted(teacher.counts.items())),
    }
    return result


def _answer_id(teacher_id: str, request: TeacherRequest) -> str:
    fields = [teacher_id, request.caption, request.label_name, request.edit_type, request.n, request.seed]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()


def _read_answer_log(path: str | Path | None) -> dict[str, TeacherAnswer]:
    """Answers recorded by an earlier run; a line cut off by a crash is skipped."""
    known: dict[str, TeacherAnswer] = {}
    if path is None or not Path(path).is_file():
        return known
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            record = load_json(line, f"{Path(path).name}: a line")
            known[record["id"]] = TeacherAnswer(str(record["text"]), bool(record.get("truncated", False)))
        except (ValueError, KeyError, TypeError):
            logger.warning("skipping an unreadable line of the answer log %s", Path(path).name)
    return known


def _judge_answer(request: TeacherRequest, answer: TeacherAnswer, test_fraction: float) -> dict[str, Any]:
    variations: list[str] = []
    spans: list[dict[str, str]] = []
    rejected: list[dict[str, str]] = []
    if answer.text is not None:
        parsed = parse_perturber_output(answer.text, request.caption, truncated=answer.truncated)
        rejected.extend({"variation": line, "reason": f"parse_{reason}"} for line, reason in parsed.rejected)
        for edited in parsed.captions:
            diff, reason = judge_variation(request.caption, edited, request.edit_type, request.label_name)
            if reason is not None:
                rejected.append({"variation": edited, "reason": reason})
            elif len(variations) >= request.n:
                rejected.append({"variation": edited, "reason": "extra"})
            else:
                variations.append(edited)
                spans.append({"original_span": diff.original_span, "edited_span": diff.edited_span})
    return {
        "key": row_key(request.caption, request.label_name, request.edit_type),
        "split": split_of(request.caption, test_fraction),
        "caption": request.caption,
        "label_name": request.label_name,
        "edit_type": request.edit_type,
        "instruction": edit_type_row(request.edit_type).instruction,
        "n_requested": request.n,
        "variations": variations,
        "spans": spans,
        "rejected": rejected,
        "raw_answer": answer.text,
        "teacher_error": answer.error,
    }


# -- the dataset on disk ------------------------------------------------------------------------------------


def load_dataset_split(name: str, split: str, revision: str | None = None):
    """One split of a `datasets` dataset from a local directory or the Hub.

    A local directory is read through a throw-away cache: ``datasets`` keys its cache of local folders by the
    folder's name and configuration, so two different folders called ``data`` would otherwise share (stale) rows.

    Raises:
        ValueError: naming the dataset and split when it cannot be loaded.
    """
    import tempfile

    import datasets

    try:
        if os.path.isdir(name):
            with tempfile.TemporaryDirectory(prefix="lance-cf-datasets-") as cache:
                return datasets.load_dataset(name, split=split, cache_dir=cache, keep_in_memory=True)
        return datasets.load_dataset(name, split=split, revision=revision)
    except (FileNotFoundError, ValueError, KeyError) as error:
        raise ValueError(f"cannot load split {split!r} of dataset {name!r}: {error}") from error


CARD_NAME = "README.md"
STATS_NAME = "collect_stats.json"


def write_instruction_dataset(
    result: CollectResult,
    output: str | Path,
    teacher: dict[str, Any],
    captions_from: str,
    versions: dict[str, str],
    license: str = "other",  # noqa: A002 - the Hub card field's name
) -> Path:
    """Write the rows as a Hub-ready ``datasets`` folder: Parquet per split, a card, the collection stats.

    ``datasets.load_dataset(str(output))`` (or the Hub id once uploaded) loads the ``train`` and ``test`` splits.

    Args:
        result: What :func:`collect_edits` returned.
        output: Directory (created; existing data files in it are replaced).
        teacher: The teacher's ``describe()`` (never contains the key or URL).
        captions_from: A short public description of where the captions came from (no local paths).
        versions: Package versions to record.
        license: The card's licence (a Hub licence id such as ``cc-by-4.0``); ``other`` points at the captions'
            and the teacher's terms.
    """
    import datasets

    output = Path(output)
    (output / "data").mkdir(parents=True, exist_ok=True)
    for stale in (output / "data").glob("*.parquet"):
        stale.unlink()
    features = datasets.Features(
        {
            "key": datasets.Value("string"),
            "split": datasets.Value("string"),
            "caption": datasets.Value("string"),
            "label_name": datasets.Value("string"),
            "edit_type": datasets.Value("string"),
            "instruction": datasets.Value("string"),
            "n_requested": datasets.Value("int32"),
            "variations": datasets.List(datasets.Value("string")),
            "spans": datasets.List(
                {"original_span": datasets.Value("string"), "edited_span": datasets.Value("string")}
            ),
            "rejected": datasets.List({"variation": datasets.Value("string"), "reason": datasets.Value("string")}),
            "raw_answer": datasets.Value("string"),
            "teacher_error": datasets.Value("string"),
        }
    )
    splits = {}
    for split in ("train", "test"):
        rows = [r for r in result.rows if r["split"] == split]
        if rows:
            columns = {name: [r[name] for r in rows] for name in features}
            datasets.Dataset.from_dict(columns, features=features).to_parquet(
                str(output / "data" / f"{split}-00000-of-00001.parquet")
            )
            splits[split] = len(rows)
    stats = {**result.stats, "splits": splits, "teacher_config": teacher, "captions_from": captions_from,
             "versions": versions, "license": license}  # fmt: skip
    (output / STATS_NAME).write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")
    (output / CARD_NAME).write_text(render_dataset_card(stats, splits))
    return output


def render_dataset_card(stats: dict[str, Any], splits: dict[str, int]) -> str:
    """The dataset card (YAML header the Hub reads, then what the data is and how it was filtered)."""
    config_lines = "".join(f"  - split: {s}\n    path: data/{s}-*.parquet\n" for s in splits)
    teacher = stats["teacher_config"]
    reasons = "".join(f"| `{k}` | {v} |\n" for k, v in stats["rejected_by_reason"].items()) or "| (none) | 0 |\n"
    license_lines = f"license: {stats['license']}\n"
    if stats["license"] == "other":
        license_lines += "license_name: caption-source-and-teacher-terms\n"
    return (
        "---\n" + license_lines + "task_categories:\n- text-generation\ntags:\n- lance\n- counterfactual\n"
        "- caption-editing\nconfigs:\n- config_name: default\n  data_files:\n"
        f"{config_lines}---\n\n"
        "# Caption perturbations for finetuning a LANCE perturber\n\n"
        "Instruction data for the structured caption perturber of LANCE (Prabhu et al., NeurIPS 2023, section 3.1), "
        "collected with `lance-cf perturber collect`. One row per (caption, edit type): the instruction, the "
        "teacher's accepted `variations` with their edit `spans`, and the `rejected` ones with the reason.\n\n"
        f"- Teacher: `{teacher.get('model')}` ({teacher.get('kind')})\n"
        f"- Captions: {stats['captions_from']} ({stats['captions']} distinct, "
        f"{stats['duplicate_captions_dropped']} duplicates dropped)\n"
        f"- Rows: {', '.join(f'{k} {v}' for k, v in splits.items())}; {stats['rows_with_variations']} with at "
        "least one accepted variation\n"
        f"- Variations: {stats['variations_accepted']} accepted, {stats['variations_rejected']} rejected; "
        f"{stats['failed_requests']} request(s) failed after retries\n\n"
        "## Validation\n\nEach variation is diffed against its caption at the word level. It is accepted when the "
        "change is one contiguous aspect of the requested type, short enough for that type, keeps the class name "
        "and at least half of the caption (see `lance_pipeline/perturber/collect.py::judge_variation`). "
        "Reasons prefixed `parse_` come from the perturber's output parser.\n\n"
        "| reason | rejected |\n|---|---|\n" + reasons + "\n"
        "## Licence\n\nThe captions keep their source's terms and the edits the teacher's terms of use; check both "
        "before redistributing.\n"
    )
