"""The local build engine: source → plan → stages per batch → ledger → shards → manifest → card.

0. Validate the config against the stage contract (``builder.validation``) before anything is loaded or written,
   then hold the output directory's lock (``builder.release_format.lock``) for the whole build.
1. Plan: list the source (sorted keys, ``limit``), derive each sample's seed from (release seed, key), cut the plan
   into fixed batches. The plan, the config hash and the environment (``builder.runtime``) are stored in the ledger
   in one transaction; a resumed build checks all three.
2. For each unfinished batch: decode images (the next batch decodes on a thread while this one computes), replay
   each sample's stored stage outputs, run the stages still to do, then write the batch's release samples. Each
   stage over a batch, and the batch's release samples, are one ledger transaction each, so ``kill -9`` at any moment
   loses at most the step in flight.
3. Write shards from the ledger in key order (checking each stored sample's checksum), then ``_info.json``,
   ``manifest.json`` and the card.

Per-sample outcomes: a ``SampleFailure`` a stage returns is final data; an exception a stage raises on a sample is
an *error* (recorded with its message, retried when the same command is re-run); a programming error (``KeyError``,
``TypeError``, a broken stage contract...) stops the build and records nothing.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import inspect
import json
import logging
import os
import re
import shutil
import sqlite3
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from builder import images
from builder.config import BuildConfig, explain_config_change, local_stage_inputs
from builder.ledger import Ledger
from builder.model_check import build_needs, check_cpu, models_ready, resolve_models
from builder.model_refs import local_path_references, resolve_model_references, restore_model_references
from builder.output_paths import output_problem
from builder.registry import ENGINES
from builder.release import write_release
from builder.release_format import WORK_DIR, empty_metadata, encode_metadata, is_valid_key
from builder.release_format.lock import output_lock
from builder.runtime import (
    DEFAULT_TORCH_THREADS,
    environment,
    environment_changes,
    quiet_third_party_progress,
    torch_settings,
)
from builder.sources import Source, SourceSample, create_source
from builder.stage_memory import format_bytes, measure_peak, merge, unmeasured_reason
from builder.validation import ValidatedBuild, ValidatedStage, check_stages_against_source, validate_build
from lance_pipeline.models.devices import free_accelerator_memory, resolve_device
from lance_pipeline.readers import read_json
from lance_pipeline.stage import (
    SAMPLE_INDEX,
    SOURCE_FIELDS,
    DeclaredRecord,
    SampleFailure,
    StageContractError,
    check_update,
    create_stage,
    option_values,
    with_values,
)

logger = logging.getLogger(__name__)

LEDGER_NAME = "ledger.sqlite"
# Exceptions that mean the stage's code (or its declarations) is wrong, not the sample: they stop the build.
PROGRAMMING_ERRORS = (KeyError, AttributeError, TypeError, NameError, AssertionError, NotImplementedError, ImportError)


class BuildRefused(ValueError):
    """The output directory cannot take this build (it holds something else)."""


class StageNotWorking(RuntimeError):
    """A stage failed on every sample it has seen so far: probably its environment or code, not the data."""

    def __init__(self, stage: str, error: BaseException):
        super().__init__(f"stage {stage} fails on every sample so far: {type(error).__name__}: {error}")
        self.stage = stage
        self.error = error

    def __reduce__(self):  # picklable, so it crosses from a Ray actor to the driver as itself
        return (StageNotWorking, (self.stage, self.error))


def derive_seed(release_seed: int, source_key: str) -> int:
    """Per-sample seed from (release seed, source key): independent of order, batch, machine and time."""
    digest = hashlib.sha256(f"lance-cf:{release_seed}:{source_key}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF  # fits every RNG's seed range (numpy needs < 2**32)


@dataclass
class _Batch:
    index: int
    samples: list[SourceSample]
    seeds: dict[str, int]
    decoded: dict[str, Any] = field(default_factory=dict)  # key -> PIL image (None: a generating source's sample)
    failures: dict[str, tuple[str, str]] = field(default_factory=dict)  # key -> (stage, reason)
    fields: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> a generating source's record fields


@dataclass
class StageResult:
    """One stage over some samples of one batch: new fields, final failures and (retryable) errors, by key."""

    stage: str
    updates: dict[str, dict[str, Any]]
    failures: dict[str, str]
    errors: dict[str, str]
    description: dict[str, Any] | None = None  # the stage's manifest entry, taken where it ran (loaded)
    # Peak memory of this run, measured where it ran: {device: entry} (builder.stage_memory), None if unmeasured.
    peak_memory: dict[str, dict[str, Any]] | None = None


@dataclass
class StageWork:
    """A batch's records on their way through stages (what a worker gets, and what the driver replays into).

    ``start``: key -> index of its first stage still to run (relative to the stages run over this work); ``out``: keys
    failed or errored at a stage, out of the running; ``record_errors``: record a stage's errors even if it has not
    worked yet in this build (see ``StageNotWorking``).
    """

    records: dict[str, dict[str, Any]]
    keys: list[str]
    start: dict[str, int]
    out: set[str]
    record_errors: bool = False


class _StageRunner:
    """A validated stage, created lazily and loaded on first use (a fully resumed build loads no model)."""

    def __init__(self, validated: ValidatedStage, device: str, ledger: Ledger | None):
        self.validated = validated
        self.config = validated.config
        self.device = device
        self.ledger = ledger
        self._stage = None
        self._loaded = False
        self._references: dict[str, str] = {}
        # What the stage may read: the source fields and what it declares (lance_pipeline.stage.DeclaredRecord).
        self._readable = frozenset(SOURCE_FIELDS) | frozenset(validated.contract.consumes)
        self.ever_succeeded = False  # the stage has processed at least one batch without failing on all of it

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def stage(self):
        if self._stage is None:
            # The typed options validation made, with demo:/pkg: model references resolved to their local directories.
            values = option_values(self.validated.options)
            resolved, self._references = resolve_model_references(values)
            changed = {k: v for k, v in resolved.items() if v is not values[k]}
            # Local model directories and token folders: described by the name the config records them by.
            paths = [path for path, _ in local_stage_inputs(self.config).values()]
            self._references.update(local_path_references(paths))
            try:
                self._stage = create_stage(self.validated.cls, with_values(self.validated.options, **changed))
            except TypeError as err:
                raise ValueError(f"stage {self.name!r} ({self.config.type}): bad options: {err}") from err
        return self._stage

    def ensure_loaded(self) -> None:
        if not self._loaded:
            # Only a stage that loads models meets the libraries' loading bars; silencing them imports transformers and
            # diffusers, seconds that a build whose stages load no model need not pay.
            if getattr(self.validated.cls, "model_options", ()):
                quiet_third_party_progress()
            logger.info("loading stage %s (%s) on %s", self.name, self.config.type, self.device)
            self.stage.load(self.device)
            self._loaded = True

    def release(self) -> None:
        """Drop the stage and its models (stage-major schedule: the next stage gets the memory)."""
        self._stage = None
        self._loaded = False

    def describe(self) -> dict[str, Any]:
        stored = self.ledger.get_meta(f"describe:{self.name}")
        if stored is not None:
            return json.loads(stored)
        return self._description()

    def _description(self) -> dict[str, Any]:
        described = restore_model_references(self.stage.describe(), self._references)
        return {"type": self.config.type, "version": self.validated.contract.version, **described}

    def run(self, records: list[dict[str, Any]], record_errors: bool = False) -> StageResult:
        """Run the stage over records, isolating the samples that make it raise.

        A batch that raises is retried one sample at a time: a sample that still raises gets an *error* (its
        message; retried on the next run), the others their results. A programming error is re-raised at once with
        the stage and sample named. If every record raises and the stage has never worked in this build, the cause
        is more likely the stage or its environment than the data: ``StageNotWorking`` is raised and nothing is
        recorded, so the engine can defer the batch until the stage has worked on another one (then
        ``record_errors=True`` records them), and stop with the error, recording nothing, if it never does.
        """
        self.ensure_loaded()
        name = self.name
        views = [DeclaredRecord(r, name, self._readable) for r in records]
        with measure_peak(self.device) as peak:
            results, errors = self._process(views, record_errors)
        if peak:
            logger.info(
                "stage %s: peak memory %s on %s (%s)",
                name,
                format_bytes(peak["peak_bytes"]),
                peak["device"],
                peak["measure"],
            )
        self.ever_succeeded = True
        if len(results) != len(records):
            raise RuntimeError(f"stage {name} returned {len(results)} results for {len(records)} records")
        updates, failures = {}, {}
        for record, result in zip(records, results, strict=True):
            key = record["key"]
            if key in errors:
                continue
            if isinstance(result, SampleFailure):
                failures[key] = result.reason
            elif isinstance(result, dict):
                check_update(name, self.validated.contract.produces, result)
                updates[key] = result
            else:
                raise StageContractError(
                    f"stage {name} returned {type(result).__name__}; expected dict or SampleFailure"
                )
        return StageResult(
            name, updates, failures, errors, self._description(), peak_memory={peak["device"]: peak} if peak else None
        )

    def _process(self, views: list[DeclaredRecord], record_errors: bool) -> tuple[list[Any], dict[str, str]]:
        """``stage.process`` over the batch, and one sample at a time if the batch raises: (results, errors)."""
        name = self.name
        errors: dict[str, str] = {}
        try:
            results = list(self.stage.process(views))
        except PROGRAMMING_ERRORS as err:
            keys = ", ".join(v["key"] for v in views)
            err.add_note(
                f"raised by stage {name} on the batch of {keys}: a programming error; the build stops, nothing recorded"
            )
            raise
        except Exception as batch_error:  # isolate the sample(s) that break the batch
            logger.warning("stage %s raised on a batch (%s); retrying its samples one by one", name, batch_error)
            results = []
            first_error: BaseException | None = None
            for view in views:
                try:
                    (result,) = self.stage.process([view])
                except PROGRAMMING_ERRORS as err:
                    err.add_note(
                        f"raised by stage {name} on sample {view['key']}: a programming error; the build "
                        "stops, nothing recorded"
                    )
                    raise
                except Exception as err:
                    first_error = first_error or err
                    errors[view["key"]] = f"{type(err).__name__}: {err}"
                    result = None
                results.append(result)
            if len(errors) == len(views) and not (record_errors or self.ever_succeeded):
                raise StageNotWorking(name, first_error) from first_error
        return results, errors


def _output_problem(output: Path) -> str | None:
    """Why ``output`` cannot hold a build (checked before anything is written or loaded), or None."""
    return output_problem(output)


def _check_output_dir(output: Path, validated: ValidatedBuild) -> None:
    """Refuse an output directory holding something else: a release holds this config's hash (by value; or as
    written, if it was made before options were hashed by value)."""
    ledger_path = output / WORK_DIR / LEDGER_NAME
    manifest_path = output / "manifest.json"
    if ledger_path.exists():
        return  # the ledger decides, inside the transaction that records or checks the config (see _claim_ledger)
    if manifest_path.exists():
        try:
            existing = read_json(manifest_path).get("config_hash")
        except (OSError, ValueError):
            existing = None
        if existing != validated.config_hash and existing != validated.config_hash_as_written:
            raise BuildRefused(f"{output} holds a release of a different config; use a new --output directory")
    elif output.exists() and any(p.name != WORK_DIR for p in output.iterdir()):
        raise BuildRefused(f"{output} is not empty and holds no lance-cf build; choose an empty or new directory")


def _claim_ledger(
    ledger: Ledger,
    validated: ValidatedBuild,
    plan: list[tuple[str, int, int, str, int]],
    env: dict[str, Any],
    allow_version_change: bool,
) -> list[dict[str, Any]]:
    """Record (new ledger) or check (resume) config hash, plan and environment, in one transaction.

    Returns every environment change accepted over the build's life (``--allow-version-change``). A ledger started
    before options were hashed by value holds the hash of the options as written: that hash of this config is
    accepted too, and the ledger then records the hash by value (a default written out no longer matters).
    """
    config, config_hash = validated.config, validated.config_hash
    with ledger.transaction():
        existing = ledger.get_meta("config_hash")
        if existing is None or (existing != config_hash and existing == validated.config_hash_as_written):
            ledger.set_meta("config_hash", config_hash)
            ledger.set_meta("config", json.dumps(config.to_dict(), sort_keys=True))
            ledger.set_meta("hashed_config", json.dumps(validated.hashed_view, sort_keys=True))
            ledger.set_meta("options_hashed", "by value")
        if existing is None:
            ledger.set_meta("environment", json.dumps(env, sort_keys=True))
            ledger.write_plan(plan)
            return []
        if existing != config_hash and existing != validated.config_hash_as_written:
            stored = json.loads(ledger.get_meta("config") or "{}")
            view = ledger.get_meta("hashed_config")  # absent in ledgers from before it was kept
            # A ledger from before options were hashed by value holds their view as written: compared with that.
            by_value = ledger.get_meta("options_hashed") == "by value"
            why = explain_config_change(
                stored,
                config,
                json.loads(view) if view else None,
                validated.written_options if by_value else None,
                validated.source_options if by_value else None,
            )
            raise BuildRefused(f"{ledger.path.parent.parent} holds a build of a different config: {why}")
        if ledger.plan() != sorted(plan, key=lambda r: (r[1], r[0])):
            raise BuildRefused(
                f"source {config.source!r} no longer gives the samples this build started with; "
                "use a new --output directory"
            )
        if existing != config_hash:
            logger.info("resuming a build whose ledger hashed the options as written; it now holds their values' hash")
        stored = ledger.get_meta("environment")
        before = json.loads(stored) if stored else {"tool": "unknown (a ledger from before environments were kept)"}
        accepted = json.loads(ledger.get_meta("environment_changes") or "[]")
        changes = environment_changes(before, env)
        if changes:
            listed = "; ".join(f"{c['name']} {c['from']} -> {c['to']}" for c in changes)
            if not allow_version_change:
                raise BuildRefused(
                    f"this build was started under other versions ({listed}), which can change its bytes; resume "
                    "with the original versions, or pass --allow-version-change to continue (both are recorded in "
                    "the manifest), or use a new --output directory"
                )
            logger.warning("continuing the build across version changes: %s", listed)
            accepted += changes
            ledger.set_meta("environment_changes", json.dumps(accepted))
            ledger.set_meta("environment", json.dumps(env, sort_keys=True))
        return accepted


def _plan(config: BuildConfig, source: Source) -> list[tuple[str, int, int, str, int]]:
    samples = source.samples[: config.limit] if config.limit else source.samples
    keys = [s.key for s in samples]
    if len(set(keys)) != len(keys) or not all(is_valid_key(k) for k in keys):
        raise RuntimeError(f"source {config.source!r} produced duplicate or invalid keys")  # a bug in the source
    return [
        (s.key, i // config.batch_size, s.label, s.origin, derive_seed(config.seed, s.key))
        for i, s in enumerate(samples)
    ]


def _decode_batch(batch: _Batch, source: Source, config: BuildConfig, num_classes: int) -> _Batch:
    generates = getattr(source, "generates", False)
    for sample in batch.samples:
        if sample.problem:
            batch.failures[sample.key] = ("source", sample.problem)
            continue
        if not 0 <= sample.label < num_classes:
            batch.failures[sample.key] = ("source", f"label {sample.label} out of range [0, {num_classes})")
            continue
        if hasattr(source, "record_fields"):  # fields the source declares, beside (or instead of) the image
            batch.fields[sample.key] = source.record_fields(sample)
        if generates:  # nothing to read: the record starts from the source's fields (a stage makes the image)
            batch.decoded[sample.key] = None
            continue
        try:
            data = source.read(sample)
        except (OSError, ValueError) as err:
            batch.failures[sample.key] = ("source", f"unreadable: {err}")
            continue
        try:
            batch.decoded[sample.key] = images.decode_image(
                data,
                image_size=config.image_size,
                min_side=config.min_image_side,
                max_pixels=config.max_image_pixels,
            )
        except images.ImageDecodeError as err:
            batch.failures[sample.key] = ("decode", str(err))
    return batch


# Metadata fields a ``many`` output's items carry into their samples (the rest come from the source record).
ITEM_METADATA_FIELDS = ("edit_type", "edited_caption", "original_span", "edited_span", "self_replace")


def _emit(
    validated: ValidatedBuild, record: dict[str, Any], label_name: str
) -> list[tuple[str, str, str, bytes, bytes]]:
    """A finished record's release samples, as its stages declared them: (config, key, source_key, metadata, image).

    Metadata is encoded against the build's release spec, so a declared extra field of the wrong type stops the
    build at the first sample instead of breaking ``load_dataset`` later.
    """
    key, fmt, spec = record["key"], validated.config.image_format, validated.release_spec
    rows = []

    def row(config_name: str, sample_key: str, image: Any, meta: dict[str, Any]) -> None:
        data = encode_metadata(meta, spec, config_name)
        rows.append((config_name, sample_key, key, data, images.encode_image(image, fmt)))

    base = empty_metadata(key, key, record["label"], label_name, record["seed"])
    base["caption"] = record.get("caption")
    for output in validated.outputs:
        value = record.get(output.field)
        if value is None:
            continue  # the sample failed before the stage that writes this config
        if output.config_field is not None and record.get(output.config_field) != output.config:
            continue  # routed to another config, or to none
        if not output.many:
            sample_key = output.sample_key(key)
            extras = {f.name: record.get(f.name) for f in output.fields}
            row(output.config, sample_key, value, {**base, **extras, "key": sample_key})
            continue
        for i, item in enumerate(value):
            sample_key = output.sample_key(key, item.get(SAMPLE_INDEX, i))  # kept by a screen that removed others
            meta = {**base, "key": sample_key}
            for name in (*ITEM_METADATA_FIELDS, *(f.name for f in output.fields)):
                meta[name] = item.get(name)
            meta["scores"] = {**base["scores"], **(item.get("scores") or {})}
            row(output.config, sample_key, item["image"], meta)
    return rows


class BuildEnvironmentError(ValueError):
    """The machine refused a write (disk full, read-only): one line naming the path and the fix; nothing is lost."""


_ENOSPC_WORDS = ("database or disk is full", "disk is full")
_READONLY_WORDS = ("readonly database", "read-only", "unable to open database file")


def _environment_error(err: BaseException, output: Path) -> BuildEnvironmentError | None:
    """A one-line error for a disk-full or read-only fault, or None if ``err`` is something else."""
    text = str(err).lower()
    code = getattr(err, "errno", None)
    where = getattr(err, "filename", None) or (output / WORK_DIR / LEDGER_NAME)
    if code in (errno.ENOSPC, errno.EDQUOT) or any(w in text for w in _ENOSPC_WORDS):
        return BuildEnvironmentError(
            f"no space left on the device writing {where}: free space (or use --output on another disk), then re-run "
            "the same command; the build resumes where it stopped"
        )
    if code in (errno.EROFS, errno.EACCES, errno.EPERM) or any(w in text for w in _READONLY_WORDS):
        return BuildEnvironmentError(
            f"cannot write {where} ({'read-only' if code == errno.EROFS or 'read' in text else 'permission denied'}): "
            "give a writable --output directory"
        )
    return None


SCHEDULES = ("batch-major", "stage-major")
PlanRow = tuple[str, int, int, str, int]  # (key, batch, label, origin, seed): one sample of the build's plan


@dataclass(frozen=True, kw_only=True)
class BuildOptions:
    """How to build (none of it changes what the release holds, except ``torch_threads``, which is recorded).

    ``device``: a torch device, or ``None``/``"auto"`` for cuda when available (``lance_pipeline.models.devices``); checked
    before anything is written. ``engine`` names an engine in ``builder.registry.ENGINES``: ``local``, ``devices``
    (one process per device) or ``ray`` (Ray actors, each loading the models once); the ledger, the shards and so the
    bytes are the same. ``workers``: worker count of the multi-worker engines. ``torch_threads``: torch's intra-op
    thread count in every worker (recorded: it changes float results). ``retry_failures`` also re-runs the stages of
    samples with final failures (errors are always retried). ``schedule``: ``batch-major`` (each batch through every
    stage) or ``stage-major`` (every pending sample through one stage, its models released, then the next stage);
    same bytes. ``engine_options``: keyword options of the engine (``devices`` for ``devices``, ``address`` and
    ``gpus_per_worker`` for ``ray``; ``stage_workers`` / ``stage_gpus`` for per-stage worker pools on both, see
    ``builder.dispatch``); see docs/scaling.md. ``keep_inversions=False`` drops each batch's stored inversions
    (outputs of the stages that produce ``inversion``) from the ledger once the batch is done: about 12 MB per image
    at 512 px; the release is unchanged, and a batch reopened later (errors, ``--retry-failures``) inverts again.
    ``record_memory``: write each stage's peak memory per device (always logged per batch and kept in the ledger;
    ``builder.stage_memory``) into the manifest's ``build.stage_memory``; off by default because it differs between
    otherwise identical builds, so the manifest would no longer be byte-identical.
    """

    device: str | None = "cpu"
    progress: bool = True
    engine: str = "local"
    workers: int = 1
    allow_code: bool | None = None
    torch_threads: int = DEFAULT_TORCH_THREADS
    retry_failures: bool = False
    allow_version_change: bool = False
    schedule: str = "batch-major"
    engine_options: dict[str, Any] | None = None
    keep_inversions: bool = True
    record_memory: bool = False


@dataclass
class BuildRun:
    """One build in progress: what every engine step reads, in one place.

    Set before the engine starts: the validated config, the source, the plan, the ledger, one runner per active stage
    and the options. Set by ``_drive`` when the engine starts: the batches still to do (``todo``) and the progress bar.
    """

    validated: ValidatedBuild
    source: Source
    plan: list[PlanRow]
    ledger: Ledger
    runners: list[_StageRunner]
    options: BuildOptions
    todo: list[int] = field(default_factory=list)
    bar: _Progress | None = None

    @property
    def config(self) -> BuildConfig:
        return self.validated.config

    @functools.cached_property
    def label_names(self) -> list[str]:
        return self.source.label_space.names

    @functools.cached_property
    def batches(self) -> dict[int, list[tuple[str, int]]]:
        """Batch index -> its (key, seed) pairs, in plan order."""
        batches: dict[int, list[tuple[str, int]]] = {}
        for key, batch, _label, _origin, seed in self.plan:
            batches.setdefault(batch, []).append((key, seed))
        return batches

    @functools.cached_property
    def _samples(self) -> dict[str, SourceSample]:
        return {s.key: s for s in self.source.samples}

    def decode(self, index: int) -> _Batch:
        """Batch ``index`` with its images decoded (or its decode failures recorded on it)."""
        entries = self.batches[index]
        batch = _Batch(index, [self._samples[k] for k, _ in entries], dict(entries))
        return _decode_batch(batch, self.source, self.config, self.source.label_space.num_classes)


def build(config: BuildConfig, output: Path, options: BuildOptions | None = None, /, **overrides: Any) -> dict:
    """Build (or resume) a release into ``output``; returns the manifest.

    ``options`` (``BuildOptions``), with ``overrides`` (its fields by name, e.g. ``progress=False``) replacing its
    values. Everything that can be checked (options, engine, device, output directory, source) is checked before
    anything is written.
    """
    options = replace(options or BuildOptions(), **overrides)
    validated = validate_build(config, allow_code=options.allow_code)
    run_engine = _engine(validated, options)  # an unknown engine or option fails here, before anything is written
    output = Path(output)
    problem = _output_problem(output)
    if problem:
        raise BuildRefused(problem)
    # The build's own inputs first, in the order users get them wrong: the output, then the source (it exists and has
    # images), then the models. A bad source leaves no half-made output behind and is not hidden behind a model.
    _check_output_dir(output, validated)  # before creating anything in a directory that is not ours
    source = create_source(config.source, validated.source_options)  # the typed options validation made
    check_stages_against_source(validated, source)  # e.g. a token for every class to generate, before any model
    plan = _plan(config, source)
    if not plan:
        raise ValueError(f"source {config.source!r} has no images")
    # Every model the stages will load is cached or reachable: checked in seconds, before torch is imported.
    needs = build_needs(validated)
    models = resolve_models(needs)
    requested_device = options.device
    if validated.active:  # a build of `original` alone never imports torch
        options = replace(options, device=resolve_device(options.device))
    if options.device == "cpu":  # a full-size build on the CPU only when asked for
        check_cpu(validated, needs, len(plan), requested_device, options.torch_threads)
    created = not output.exists()
    try:
        try:
            output.mkdir(parents=True, exist_ok=True)
        except OSError as err:  # what the checks above cannot foresee (a special file system, a race)
            if _environment_error(err, output) is not None:
                raise
            raise BuildRefused(f"cannot create --output {output}: {err.strerror or err}; choose another path") from err
        with output_lock(output, "build"), models_ready(models, progress=options.progress):
            return _build_locked(validated, source, plan, output, options, run_engine)
    except (OSError, sqlite3.OperationalError) as err:
        mapped = _environment_error(err, output)
        if mapped is None:
            raise
        raise mapped from err
    finally:
        _clean_refused_output(output, created)


def _engine(validated: ValidatedBuild, options: BuildOptions) -> Any:
    """The engine function, its options bound, after checking them (and the schedule and thread count)."""
    run_engine = ENGINES.resolve(options.engine)
    if options.schedule not in SCHEDULES:
        raise ValueError(f"schedule {options.schedule!r}: expected one of {', '.join(SCHEDULES)}")
    threads = options.torch_threads
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"torch threads {threads!r}: expected a positive integer")
    preflight = getattr(run_engine, "preflight", None)
    if preflight is not None:
        preflight()  # e.g. the Ray engine without Ray: the install hint, before anything is written
    engine_options = options.engine_options
    if not engine_options:
        return run_engine
    accepted = set(list(inspect.signature(run_engine).parameters)[1:])  # the first one is the run
    unknown = sorted(set(engine_options) - accepted)
    if unknown:
        raise ValueError(f"the {options.engine} engine takes no option {', '.join(unknown)} (see docs/scaling.md)")
    check_options = getattr(run_engine, "check_options", None)
    if check_options is not None:  # e.g. --stage-workers naming a stage the config lacks: before any write
        check_options(validated, engine_options)
    return functools.partial(run_engine, **engine_options)


def _clean_refused_output(output: Path, created: bool) -> None:
    """A build refused before any work leaves nothing behind (the directory it created, or its lock)."""
    if (output / WORK_DIR / LEDGER_NAME).exists():
        return
    if created:
        shutil.rmtree(output, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            (output / WORK_DIR / "lock").unlink()
            (output / WORK_DIR).rmdir()


def _build_locked(
    validated: ValidatedBuild,
    source: Source,
    plan: list[PlanRow],
    output: Path,
    options: BuildOptions,
    run_engine: Any,
) -> dict[str, Any]:
    """Steps 1 to 3 of the module docstring, holding the output's lock: claim the ledger, run the engine, write."""
    config = validated.config
    _check_output_dir(output, validated)  # again, now that no other process can change it
    _remove_dead_writers_temp_files(output)
    env = environment(options.torch_threads)
    ledger = Ledger(output / WORK_DIR / LEDGER_NAME)
    if not options.keep_inversions:
        ledger.drop_when_done = tuple(s.config.name for s in validated.active if "inversion" in s.contract.produces)
    try:
        accepted_changes = _claim_ledger(ledger, validated, plan, env, options.allow_version_change)
        run = BuildRun(validated, source, plan, ledger, _stage_runners(validated, ledger, options), options)
        determinism = _run_engine(run, run_engine)
        # Stage descriptions without loading models (a resumed build may have loaded none).
        stage_info = {r.name: r.describe() for r in run.runners}
        build_record = _build_record(run, env, accepted_changes, determinism)
        screens = {s.config.name: (s.cls, s.contract.screens) for s in validated.active if s.contract.screens}
        return write_release(
            output,
            config,
            validated.config_hash,
            source,
            ledger,
            stage_info,
            build_record,
            release_spec=validated.release_spec,
            screens=screens,
        )
    finally:
        ledger.close()


def _stage_runners(validated: ValidatedBuild, ledger: Ledger, options: BuildOptions) -> list[_StageRunner]:
    """One runner per active stage; the batches to retry reopened; each runner told whether it worked earlier."""
    runners = [_StageRunner(s, options.device, ledger) for s in validated.active]
    _reopen_for_retry(ledger, runners, options.retry_failures)
    for runner in runners:  # a stage that worked earlier in this build is not suspected when a retry raises
        runner.ever_succeeded = ledger.has_worked(runner.name)
    return runners


def _run_engine(run: BuildRun, run_engine: Any) -> dict[str, Any]:
    """Run the engine under the build's torch settings; returns the determinism settings to record."""
    if not run.runners:  # a build of `original` alone never imports torch
        run_engine(run)
        return {"device": str(run.options.device or "cpu").split(":")[0]}

    with torch_settings(run.options.torch_threads, run.options.device) as determinism:
        run_engine(run)
    return determinism


def _build_record(
    run: BuildRun, env: dict[str, Any], accepted_changes: list[dict[str, Any]], determinism: dict[str, Any]
) -> dict[str, Any]:
    """The manifest's ``build`` section: routing, code, threads, determinism, environment, errors (and memory)."""
    errors = [{"source_key": k, "stage": stage, "message": m} for k, stage, m in run.ledger.errors()]
    record = {
        **_routing_summary(run),
        "code": run.validated.code_targets,
        "torch_threads": run.options.torch_threads,
        "determinism": determinism,
        "environment": env,
        "version_changes": accepted_changes,
        "errors": errors,
    }
    if run.options.record_memory:
        record["stage_memory"] = _stage_memory(run.ledger, run.runners, run.options.device)
    return record


def _stage_memory(ledger: Ledger, runners: list[_StageRunner], device: str | None) -> dict[str, Any]:
    """Each stage's peak memory per device over the build (``builder.stage_memory``), or why it has none."""
    out: dict[str, Any] = {}
    for runner in runners:
        stored = ledger.get_meta(f"memory:{runner.name}")
        if stored:
            out[runner.name] = json.loads(stored)
        else:
            reason = unmeasured_reason(str(device or "cpu")) or "no batch of this stage was measured"
            out[runner.name] = {"unmeasured": reason}
    return out


def _routing_summary(run: BuildRun) -> dict[str, Any]:
    """Where each routed record went (``ReleaseOutput.config_field``): counts per group and class, nothing dropped
    silently. Groups are a generating source's ``shift`` field when it has one; ``None`` counts records that are
    not released (e.g. rejected by a filter without a ``rejected`` config)."""
    validated, source, plan, ledger = run.validated, run.source, run.plan, run.ledger
    routed = [(stage, o) for stage in validated.active for o in stage.contract.outputs if o.config_field]
    if not routed:
        return {}
    by_key = {s.key: s for s in source.samples}
    keys = sorted(row[0] for row in plan)
    summary: dict[str, Any] = {}
    for stage, output in routed:
        # The routing field is decided by the active stage that produces it (e.g. a filter after the generator).
        decider = next(s for s in reversed(validated.active) if output.config_field in s.contract.produces)
        stored, failed, errored = ledger.stage_outcomes(keys, decider.config.name)
        groups: dict[str, dict[str, dict[str, int]]] = {}
        for key, update in stored.items():
            sample = by_key[key]
            fields = source.record_fields(sample) if getattr(source, "generates", False) else {}
            group = str(fields.get("shift", "all"))
            target = update.get(output.config_field)
            per_class = groups.setdefault(group, {}).setdefault(str(sample.label), {})
            name = "not_released" if target is None or target not in validated.config.configs else str(target)
            per_class[name] = per_class.get(name, 0) + 1
        summary[stage.config.name] = {
            "field": output.config_field,
            "decided_by": decider.config.name,
            "groups": groups,
            "failed": len(failed),
            "errored": len(errored),
        }
    return {"routing": summary}


_TEMP_FILE = re.compile(r"^\..+\.(\d+)\.tmp$")  # builder.release._atomic_write: .NAME.PID.tmp


def _remove_dead_writers_temp_files(output: Path) -> None:
    """Temporary files are removed by their writer; one killed mid-write (``kill -9``) cannot, so the next build,
    holding the directory's exclusive lock, removes those whose writing process no longer exists."""
    for path in output.iterdir():
        match = _TEMP_FILE.match(path.name)
        if match is None or not path.is_file():
            continue
        pid = int(match.group(1))
        try:
            os.kill(pid, 0)
            alive = pid != os.getpid()
        except ProcessLookupError:
            alive = False
        except PermissionError:
            alive = True  # another user's live process: not ours to touch
        if not alive:
            path.unlink(missing_ok=True)


def _reopen_for_retry(ledger: Ledger, runners: list[_StageRunner], retry_failures: bool) -> None:
    """Make the batches with errors (and, with ``retry_failures``, with stage failures) run again from the first
    stage that raised (failed) in them, for all their samples (see ``Ledger.reopen``)."""
    order = {r.name: i for i, r in enumerate(runners)}
    troubled = [(k, stage) for k, stage, _message in ledger.errors()]
    if retry_failures:
        troubled += [(k, stage) for k, stage, _reason in ledger.failures() if stage in order]
    troubled = [(k, stage) for k, stage in troubled if stage in order]
    if not troubled:
        return
    batches = ledger.key_batches(sorted({k for k, _ in troubled}))
    first: dict[int, int] = {}
    for key, stage in troubled:
        batch = batches[key]
        first[batch] = min(first.get(batch, len(runners)), order[stage])
    with ledger.transaction():
        for batch, index in first.items():
            ledger.reopen(batch, [r.name for r in runners[index:]])
    logger.info(
        "retrying %d sample(s): %d batch(es) run again from their first troubled stage", len(troubled), len(first)
    )


# Off a terminal, a line at least this often while a batch runs (what runs, how far): never silent for a minute.
HEARTBEAT_ENV = "LANCE_CF_HEARTBEAT_SECONDS"
HEARTBEAT_SECONDS = 30.0


def heartbeat_seconds() -> float:
    """The heartbeat interval: ``LANCE_CF_HEARTBEAT_SECONDS`` (a positive number), else 30 s."""
    value = os.environ.get(HEARTBEAT_ENV, "").strip()
    if not value:
        return HEARTBEAT_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{HEARTBEAT_ENV}={value!r}: expected a number of seconds, e.g. 30") from None
    if not seconds > 0:
        raise ValueError(f"{HEARTBEAT_ENV}={value!r}: expected a positive number of seconds")
    return seconds


class _Heartbeat:
    """A thread that logs ``describe()`` every ``interval`` seconds until stopped (off a terminal, where no bar moves).
    ``beat`` (an ``threading.Event``, for tests) is set after each line."""

    def __init__(self, describe: Any, interval: float) -> None:
        self.describe, self.interval = describe, interval
        self.stopped = threading.Event()
        self.beat = threading.Event()
        self.thread = threading.Thread(target=self._run, name="build-heartbeat", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(self.interval):
            logger.info("%s", self.describe())
            self.beat.set()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()


class _Progress:
    """The build's progress: on a terminal, one bar for the images and one per stage, each counting whole images
    (so its percentage and its count agree); elsewhere (a log file, a pipe), one plain log line per finished batch,
    and between them a heartbeat line at least every ``LANCE_CF_HEARTBEAT_SECONDS`` (30 s): the stage that runs, for
    how long, and how many images are done.

    A stage's bar advances by a batch's images when the stage is done with the batch (a sample that failed earlier
    counts as passed through). Log records go through the bars (``logging_redirect_tqdm``), never onto their lines.
    """

    def __init__(self, total: int, done: int, stages: list[str], desc: str, enabled: bool, ledger: Ledger):
        self.ledger = ledger
        self.stages = stages
        self.total, self.done, self.desc = total, done, desc
        self.terminal = enabled and sys.stderr.isatty()
        self.plain = enabled and not self.terminal
        self.stage_counts = dict.fromkeys(stages, done)
        self._advanced: dict[int, set[str]] = {}
        self.bars: dict[str, Any] = {}
        if self.terminal:
            from tqdm.auto import tqdm

            width = max([len(s) for s in stages] + [len("images")])
            form = "{desc}: {percentage:3.0f}%|{bar}| {n}/{total} [{elapsed}<{remaining}]{postfix}"
            for position, name in enumerate(["images", *stages]):
                self.bars[name] = tqdm(
                    total=total, initial=done, unit="img", position=position, leave=True, bar_format=form,
                    desc=f"{desc} {name:<{width}}" if name == "images" else f"{' ' * len(desc)} {name:<{width}}",
                )  # fmt: skip
        self.stage: str | None = None  # the stage running now, and since when (monotonic seconds)
        self.stage_since = self.started = time.monotonic()
        self.heartbeat = _Heartbeat(self.describe_now, heartbeat_seconds()) if self.plain else None
        self._refresh()

    def describe_now(self) -> str:
        """What runs and how far: the heartbeat's line (read from another thread: no ledger query here)."""
        now = time.monotonic()
        doing = (
            f"stage {self.stage} running for {now - self.stage_since:.0f} s"
            if self.stage
            else "reading images, waiting for a stage or writing results"
        )
        return (
            f"{self.desc}: {doing}; {self.done}/{self.total} images done "
            f"({100 * self.done // max(1, self.total)}%), {now - self.started:.0f} s since start"
        )

    def _counts(self) -> tuple[int, int]:
        failed = self.ledger.db.execute("SELECT COUNT(DISTINCT source_key) FROM failures").fetchone()[0]
        errors = self.ledger.db.execute("SELECT COUNT(DISTINCT source_key) FROM errors").fetchone()[0]
        return failed, errors

    def _refresh(self) -> None:
        if self.terminal:
            failed, errors = self._counts()
            self.bars["images"].set_postfix_str(f"failed {failed}, errors {errors}")

    def stage_started(self, stage: str) -> None:
        self.stage, self.stage_since = stage, time.monotonic()
        if self.terminal:
            self.bars[stage].set_postfix_str("running")

    def stage_done(self, batch: _Batch, stage: str, samples: int) -> None:
        self._advance(batch, stage)

    def _advance(self, batch: _Batch, stage: str) -> None:
        advanced = self._advanced.setdefault(batch.index, set())
        if stage in advanced:
            return
        advanced.add(stage)
        self.stage_counts[stage] += len(batch.samples)
        if self.terminal:
            self.bars[stage].set_postfix_str("")
            self.bars[stage].update(len(batch.samples))

    def batch_done(self, batch: _Batch) -> None:
        self.stage = None
        for stage in self.stages:  # a stage that had no sample left in this batch is done with it too
            self._advance(batch, stage)
        self._advanced.pop(batch.index, None)
        self.done += len(batch.samples)
        if self.terminal:
            self.bars["images"].update(len(batch.samples))
            self._refresh()
        elif self.plain:
            failed, errors = self._counts()
            logger.info(
                "%s: %d/%d images done (%d%%), batch %d finished; failed %d, errors %d",
                self.desc, self.done, self.total, 100 * self.done // max(1, self.total), batch.index, failed, errors,
            )  # fmt: skip

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        for bar in self.bars.values():
            bar.close()


def run_local(run: BuildRun) -> None:
    """The local engine: one process, batches in plan order (``run.options.workers`` is for engines with several)."""
    _drive(run, _run_stage_major if run.options.schedule == "stage-major" else _run_batch_major)


def _drive(run: BuildRun, loop: Any) -> None:
    """Find the unfinished batches, start the progress bar and hand the run to ``loop`` (an engine's batch loop)."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    done = run.ledger.done_batches()
    run.todo = [b for b in sorted(run.batches) if b not in done]
    finished = sum(len(run.batches[b]) for b in done if b in run.batches)
    names = [r.name for r in run.runners]
    if finished:
        logger.info(
            "resuming: %d of %d samples already done, %d batch(es) to go", finished, len(run.plan), len(run.todo)
        )
    run.bar = _Progress(len(run.plan), finished, names, f"build {run.config.name}", run.options.progress, run.ledger)
    try:
        # Log records through the bars (root logger: ours propagate to it), never onto a bar's line.
        with logging_redirect_tqdm() if run.bar.terminal else contextlib.nullcontext():
            loop(run)
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (lance-cf turns it into this): say what was kept
        how = getattr(stop, "signal_name", None) or "interrupted"
        logger.warning(
            "build %s stopped (%s): %d of %d images were finished and are kept in %s (every finished stage of the "
            "batch in flight too); re-run the same command to resume from there",
            run.config.name, how, run.bar.done, run.bar.total, run.ledger.path,
        )  # fmt: skip
        raise
    finally:
        run.bar.close()


def _run_deferring(batches: Any, run: Any) -> None:
    """``run(batch, record_errors)`` over ``batches``; a batch on which a stage has not worked yet
    (``StageNotWorking``) waits until the stage works on another batch, then runs again with its errors recorded (they
    belong to its samples); if the stage never works, its first error stops the build."""
    deferred: list[tuple[_Batch, StageNotWorking]] = []
    for batch in batches:
        try:
            run(batch, False)
        except StageNotWorking as err:
            logger.warning("%s; deferring batch %d until the stage works on another batch", err, batch.index)
            deferred.append((batch, err))
            continue
        while deferred:
            late, _ = deferred.pop(0)
            run(late, True)
    if deferred:
        raise deferred[0][1]


def _run_batch_major(run: BuildRun) -> None:
    _run_deferring(
        _decoded(run.todo, run.decode),
        lambda batch, record_errors: _run_batch(run, batch, run.runners, record_errors),
    )


def _run_stage_major(run: BuildRun) -> None:
    """Every pending sample through one stage (batch by batch, the same batches), release its models, next stage.

    Batches are the plan's, so each stage sees exactly the inputs it would see batch-major: the same bytes. Each
    stage's results commit per batch as they come, so a killed build resumes from the ledger like a batch-major one.
    """
    for position, runner in enumerate(run.runners):
        upto = run.runners[: position + 1]
        _run_deferring(
            _decoded(run.todo, run.decode),  # decoded again per stage: memory stays one batch, not the dataset
            lambda batch, record_errors, upto=upto: _run_batch(run, batch, upto, record_errors, finish=False),
        )
        logger.info("stage %s done for every pending sample; releasing its models", runner.name)
        runner.release()
        free_accelerator_memory()
    for batch in _decoded(run.todo, run.decode):  # every stage is done: replay, write the release samples
        _run_batch(run, batch, run.runners)


def _decoded(todo: list[int], decode: Any):
    """The batches of ``todo``, decoded; the next one decodes on a thread while the caller computes this one."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode") as pool:
        pending: Future | None = pool.submit(decode, todo[0]) if todo else None
        for position in range(len(todo)):
            batch = pending.result()
            pending = pool.submit(decode, todo[position + 1]) if position + 1 < len(todo) else None
            yield batch


def prepare_batch(run: BuildRun, batch: _Batch, runners: list[_StageRunner]) -> StageWork:
    """Record the batch's decode failures, build its records and replay what the ledger holds for them.

    Each sample's stored outcomes form a prefix of the stages (a stage commits whole; a retried sample resumes at
    the stage that raised). Returns the batch's work: its records, the index of each sample's first stage still to
    run, and the samples out of the running (failed or errored at a stored stage).
    """
    ledger = run.ledger
    with ledger.transaction():
        for key, (stage, reason) in batch.failures.items():
            ledger.record_failure(key, stage, reason)
    records = {}
    for s in batch.samples:
        if s.key not in batch.decoded:
            continue
        record = {"key": s.key, "label": s.label, "label_name": run.label_names[s.label], "seed": batch.seeds[s.key]}
        if batch.decoded[s.key] is not None:
            record["image"] = batch.decoded[s.key]
        record.update(batch.fields.get(s.key, {}))
        records[s.key] = record
    start: dict[str, int] = {}
    out: set[str] = set()
    walking = set(records)
    for index, runner in enumerate(runners):
        if not walking:
            break
        stored, failed, errored = ledger.stage_outcomes(sorted(walking), runner.name)
        for key, update in stored.items():
            records[key].update(update)
        out |= failed | errored
        for key in walking - set(stored) - failed - errored:
            start[key] = index
        walking = set(stored)
    return StageWork(records, [s.key for s in batch.samples], start, out)


def run_stages(
    runners: list[_StageRunner], work: StageWork, on_stage_done=None, on_stage_start=None
) -> list[StageResult]:
    """Run stages in order over the samples of ``work`` that still need them, merging each stage's updates into its
    records (and its failed or errored samples into ``work.out``) before the next."""
    results = []
    for index, runner in enumerate(runners):
        live = [work.records[k] for k in work.keys if k in work.start and work.start[k] <= index and k not in work.out]
        if not live:
            continue
        if on_stage_start is not None:
            on_stage_start(runner.name)
        result = run_stage(runner, live, work.record_errors)
        if on_stage_done is not None:
            on_stage_done(result, len(live))
        for key, update in result.updates.items():
            work.records[key].update(update)
        work.out |= set(result.failures) | set(result.errors)
        results.append(result)
    return results


def run_stage(runner: _StageRunner, live: list[dict[str, Any]], record_errors: bool = False) -> StageResult:
    """One stage over the live records of a batch, in calls of at most the stage's ``batch_size`` records (key order).

    Every engine runs stages through here, so the sub-batches, and so the bytes, are the same on each. The parts
    merge into one result, committed as one: a stage commits whole per build batch, as without sub-batches.
    """
    size = runner.config.batch_size
    if not size or size >= len(live):
        return runner.run(live, record_errors)

    parts = [runner.run(live[i : i + size], record_errors) for i in range(0, len(live), size)]
    result = StageResult(runner.name, {}, {}, {}, parts[-1].description)
    for part in parts:
        result.updates.update(part.updates)
        result.failures.update(part.failures)
        result.errors.update(part.errors)
        if part.peak_memory:
            result.peak_memory = merge(result.peak_memory, part.peak_memory)
    return result


def commit_stage(ledger: Ledger, batch_index: int, runner: _StageRunner, result: StageResult) -> None:
    with ledger.transaction():
        ledger.record_stage(batch_index, result.stage, result.updates, result.failures, result.errors)
        if result.description is not None:  # from the process that ran the stage (a Ray actor, say), models loaded
            ledger.set_meta(f"describe:{runner.name}", json.dumps(result.description))
        if result.peak_memory:  # the stage's maximum per device over every batch, resume and worker
            stored = ledger.get_meta(f"memory:{runner.name}")
            merged = merge(json.loads(stored) if stored else None, result.peak_memory)
            ledger.set_meta(f"memory:{runner.name}", json.dumps(merged, sort_keys=True))


def finish_batch(run: BuildRun, batch: _Batch, records: dict[str, dict[str, Any]]) -> None:
    """Write the batch's release samples and mark it done, in one transaction."""
    rows = []
    for sample in batch.samples:
        if sample.key in records:
            record = records[sample.key]
            rows += _emit(run.validated, record, run.label_names[record["label"]])
    with run.ledger.transaction():
        run.ledger.record_outputs(batch.index, rows)


def _run_batch(
    run: BuildRun, batch: _Batch, runners: list[_StageRunner], record_errors: bool = False, *, finish: bool = True
) -> None:
    """The local engine's step: replay the batch, run its stages still to do (each committed), write its samples."""
    work = prepare_batch(run, batch, runners)
    work.record_errors = record_errors
    by_name = {r.name: r for r in runners}

    def done(result: StageResult, samples: int) -> None:
        commit_stage(run.ledger, batch.index, by_name[result.stage], result)
        for key, message in result.errors.items():
            logger.warning(
                "stage %s raised on %s: %s (recorded; re-run the build to retry it)", result.stage, key, message
            )
        run.bar.stage_done(batch, result.stage, samples)

    run_stages(runners, work, on_stage_done=done, on_stage_start=run.bar.stage_started)
    if finish:
        finish_batch(run, batch, work.records)
        run.bar.batch_done(batch)
