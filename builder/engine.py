"""The local build engine: source → plan → stages per batch → ledger → shards → manifest → card.

1. Plan: list the source (sorted keys, ``limit``), derive each sample's seed from (release seed, key), cut the plan
   into fixed batches. The plan is stored in the ledger; a resumed build checks the source still gives the same plan.
2. For each unfinished batch: decode images (the next batch decodes on a thread while this one computes), run each
   active stage on the batch's live records (or replay its stored outputs), then write the batch's release samples.
   Each of these steps is one ledger transaction, so ``kill -9`` at any moment loses at most the step in flight.
3. Write shards from the ledger in key order, then ``_info.json``, ``manifest.json`` and the card.

Per-sample problems (unreadable files, labels out of range, a stage failing on one sample) become recorded failures;
the build goes on and every good sample is released.
"""

from __future__ import annotations

import hashlib
import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builder import images
from builder.config import BuildConfig
from builder.ledger import Ledger
from builder.release_format import (
    WORK_DIR,
    empty_metadata,
    encode_metadata,
    is_valid_key,
)
from builder.sources import Source, SourceSample, create_source
from builder.validation import ValidatedBuild, ValidatedStage, validate_build
from lance_pipeline.stage import (
    SOURCE_FIELDS,
    DeclaredRecord,
    ReleaseOutput,
    SampleFailure,
    StageContractError,
    check_update,
)

logger = logging.getLogger(__name__)

LEDGER_NAME = "ledger.sqlite"


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
    decoded: dict[str, Any] = field(default_factory=dict)  # key -> PIL image
    failures: dict[str, tuple[str, str]] = field(default_factory=dict)  # key -> (stage, reason)


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
    def stage(self):
        if self._stage is None:
            from builder.models import resolve_model_references

            options, self._references = resolve_model_references(self.config.options)
            try:
                self._stage = self.validated.cls(**options)
            except TypeError as err:
                raise ValueError(f"stage {self.config.name!r} ({self.config.type}): bad options: {err}") from err
        return self._stage

    def ensure_loaded(self) -> None:
        if not self._loaded:
            logger.info("loading stage %s (%s) on %s", self.config.name, self.config.type, self.device)
            self.stage.load(self.device)
            self._loaded = True

    def describe(self) -> dict[str, Any]:
        stored = self.ledger.get_meta(f"describe:{self.config.name}")
        if stored is not None:
            return json.loads(stored)
        return self._description()

    def _description(self) -> dict[str, Any]:
        from builder.models import restore_model_references

        described = restore_model_references(self.stage.describe(), self._references)
        return {"type": self.config.type, "version": self.validated.contract.version, **described}

    def remember_description(self) -> None:
        self.ledger.set_meta(f"describe:{self.config.name}", json.dumps(self._description()))

    def run(self, records: list[dict[str, Any]], record_errors: bool = False) -> tuple[dict[str, dict], dict[str, str]]:
        """Run the stage over records; a sample that makes it fail becomes a failure, not a crash.

        If every record fails and the stage has never worked in this build, the cause is more likely the stage or
        its environment than the data: ``StageNotWorking`` is raised and nothing is recorded, so the engine can
        defer the batch until the stage has worked on another one (then ``record_errors=True`` records them), and
        stop with the error, recording nothing, if it never does.
        """
        self.ensure_loaded()
        name = self.config.name
        records = [DeclaredRecord(r, name, self._readable) for r in records]
        try:
            results = self.stage.process(records)
        except StageContractError:
            raise  # a programming error: it stops the build, never becomes a sample's failure
        except Exception as batch_error:  # isolate the sample(s) that break the batch
            logger.warning("stage %s failed on a batch (%s); retrying its samples one by one", name, batch_error)
            results = []
            errors = []
            for record in records:
                try:
                    results.extend(self.stage.process([record]))
                except StageContractError:
                    raise
                except Exception as err:
                    errors.append(err)
                    results.append(SampleFailure(f"stage {name} error: {type(err).__name__}: {err}"))
            if len(errors) == len(records) and not (record_errors or self.ever_succeeded):
                raise StageNotWorking(name, errors[0]) from errors[0]
        self.ever_succeeded = True
        if len(results) != len(records):
            raise RuntimeError(f"stage {name} returned {len(results)} results for {len(records)} records")
        updates, failures = {}, {}
        for record, result in zip(records, results, strict=True):
            if isinstance(result, SampleFailure):
                failures[record["key"]] = result.reason
            elif isinstance(result, dict):
                check_update(name, self.validated.contract.produces, result)
                updates[record["key"]] = result
            else:
                raise TypeError(f"stage {name} returned {type(result).__name__}; expected dict or SampleFailure")
        return updates, failures


def _check_output_dir(output: Path, config_hash: str) -> None:
    ledger_path = output / WORK_DIR / LEDGER_NAME
    manifest_path = output / "manifest.json"
    if ledger_path.exists():
        ledger = Ledger(ledger_path)
        try:
            existing = ledger.get_meta("config_hash")
        finally:
            ledger.close()
        if existing is not None and existing != config_hash:
            raise BuildRefused(
                f"{output} holds a build of a different config ({existing[:19]}…, this one is {config_hash[:19]}…); "
                "use a new --output directory, or the original config to resume"
            )
    elif manifest_path.exists():
        try:
            existing = json.loads(manifest_path.read_text()).get("config_hash")
        except (OSError, ValueError):
            existing = None
        if existing != config_hash:
            raise BuildRefused(f"{output} holds a release of a different config; use a new --output directory")
    elif output.exists() and any(output.iterdir()):
        raise BuildRefused(f"{output} is not empty and holds no lance-cf build; choose an empty or new directory")


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
    for sample in batch.samples:
        if sample.problem:
            batch.failures[sample.key] = ("source", sample.problem)
            continue
        if not 0 <= sample.label < num_classes:
            batch.failures[sample.key] = ("source", f"label {sample.label} out of range [0, {num_classes})")
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
    config: BuildConfig, outputs: tuple[ReleaseOutput, ...], record: dict[str, Any], label_name: str
) -> list[tuple[str, str, str, bytes, bytes]]:
    """A finished record's release samples, as its stages declared them: (config, key, source_key, metadata, image)."""
    key, fmt = record["key"], config.image_format
    rows = []

    def row(config_name: str, sample_key: str, image: Any, meta: dict[str, Any]) -> None:
        rows.append((config_name, sample_key, key, encode_metadata(meta), images.encode_image(image, fmt)))

    base = empty_metadata(key, key, record["label"], label_name, record["seed"])
    base["caption"] = record.get("caption")
    for output in outputs:
        value = record.get(output.field)
        if value is None:
            continue  # the sample failed before the stage that writes this config
        if not output.many:
            sample_key = output.sample_key(key)
            row(output.config, sample_key, value, {**base, "key": sample_key})
            continue
        for i, item in enumerate(value):
            sample_key = output.sample_key(key, i)
            meta = {**base, "key": sample_key}
            for name in ITEM_METADATA_FIELDS:
                meta[name] = item.get(name)
            meta["scores"] = {**base["scores"], **(item.get("scores") or {})}
            row(output.config, sample_key, item["image"], meta)
    return rows


def build(
    config: BuildConfig,
    output: Path,
    *,
    device: str = "cpu",
    progress: bool = True,
    engine: str = "local",
    workers: int = 1,
    allow_code: bool | None = None,
) -> dict[str, Any]:
    """Build (or resume) a release into ``output``; returns the manifest.

    ``engine="ray"`` runs the stages of several batches at once on ``workers`` Ray actors (each loads the models
    once, on one GPU when ``device`` is cuda); the ledger, the shards and so the bytes are the same as a local build.
    """
    from builder.release import write_release

    validated = validate_build(config, allow_code=allow_code)
    output = Path(output)
    config_hash = config.config_hash()
    _check_output_dir(output, config_hash)
    source = create_source(config.source, config.source_options)
    plan = _plan(config, source)
    if not plan:
        raise ValueError(f"source {config.source!r} has no images")

    ledger = Ledger(output / WORK_DIR / LEDGER_NAME)
    try:
        if ledger.get_meta("config_hash") is None:
            with ledger.transaction():
                ledger.set_meta("config_hash", config_hash)
                ledger.set_meta("config", json.dumps(config.to_dict(), sort_keys=True))
                ledger.write_plan(plan)
        elif ledger.plan() != sorted(plan, key=lambda r: (r[1], r[0])):
            raise BuildRefused(
                f"source {config.source!r} no longer gives the samples this build started with; "
                "use a new --output directory"
            )
        runners = [_StageRunner(s, device, ledger) for s in validated.active]
        _run_batches(validated, source, plan, ledger, runners, progress, engine, workers)
        # Stage descriptions without loading models (a resumed build may have loaded none).
        stage_info = {r.config.name: r.describe() for r in runners}
        build_record = {"code": validated.code_targets}
        return write_release(output, config, config_hash, source, ledger, stage_info, build_record)
    finally:
        ledger.close()


def _run_batches(
    validated: ValidatedBuild,
    source: Source,
    plan: list[tuple[str, int, int, str, int]],
    ledger: Ledger,
    runners: list[_StageRunner],
    progress: bool,
    engine: str = "local",
    workers: int = 1,
) -> None:
    from tqdm.auto import tqdm

    config = validated.config
    by_key = {s.key: s for s in source.samples}
    batches: dict[int, list[tuple[str, int]]] = {}
    for key, batch, _label, _origin, seed in plan:
        batches.setdefault(batch, []).append((key, seed))
    done = ledger.done_batches()
    todo = [b for b in sorted(batches) if b not in done]
    finished = sum(len(batches[b]) for b in done if b in batches)
    num_classes = source.label_space.num_classes
    label_names = source.label_space.names
    failures = len(ledger.failures())
    bar = tqdm(total=len(plan), initial=finished, unit="img", desc=f"build {config.name}", disable=not progress)
    bar.set_postfix(failures=failures)

    def make(index: int) -> _Batch:
        entries = batches[index]
        return _Batch(index, [by_key[k] for k, _ in entries], dict(entries))

    if engine == "ray":
        from builder.ray_engine import run_batches_on_ray

        def decode(index: int) -> _Batch:
            return _decode_batch(make(index), source, config, num_classes)

        def on_batch_done(batch: _Batch, failed: int) -> None:
            nonlocal failures
            failures += failed
            bar.update(len(batch.samples))
            bar.set_postfix(failures=failures)

        run_batches_on_ray(validated, todo, decode, ledger, runners, label_names, workers, on_batch_done)
        bar.close()
        return
    if engine != "local":
        raise ValueError(f"engine {engine!r}: expected local or ray")
    # Decode the next batch on a worker thread while the stages compute on this one (I/O overlaps compute).
    deferred: list[tuple[_Batch, StageNotWorking]] = []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode") as pool:
        pending: Future | None = (
            pool.submit(_decode_batch, make(todo[0]), source, config, num_classes) if todo else None
        )
        for position in range(len(todo)):
            batch = pending.result()
            pending = (
                pool.submit(_decode_batch, make(todo[position + 1]), source, config, num_classes)
                if position + 1 < len(todo)
                else None
            )
            try:
                failures += _run_batch(validated, batch, ledger, runners, label_names)
            except StageNotWorking as err:
                logger.warning("%s; deferring batch %d until the stage works on another batch", err, batch.index)
                deferred.append((batch, err))
                continue
            bar.update(len(batch.samples))
            bar.set_postfix(failures=failures)
            # The stage works: the deferred batches' errors belong to their samples.
            while deferred:
                late, _ = deferred.pop(0)
                failures += _run_batch(validated, late, ledger, runners, label_names, record_errors=True)
                bar.update(len(late.samples))
                bar.set_postfix(failures=failures)
    if deferred:
        bar.close()
        raise deferred[0][1]
    bar.close()


def _prepare_batch(
    batch: _Batch, ledger: Ledger, runners: list[_StageRunner], label_names: list[str]
) -> tuple[dict[str, dict[str, Any]], set[str], int]:
    """Record the batch's decode failures, build its records and replay the stages already done for it.

    Stages commit in order, so the finished ones form a prefix; returns (records, keys failed in a stage, index of
    the first stage still to run).
    """
    with ledger.transaction():
        for key, (stage, reason) in batch.failures.items():
            ledger.record_failure(key, stage, reason)
    records = {
        s.key: {
            "key": s.key,
            "image": batch.decoded[s.key],
            "label": s.label,
            "label_name": label_names[s.label],
            "seed": batch.seeds[s.key],
        }
        for s in batch.samples
        if s.key in batch.decoded
    }
    stage_failed: set[str] = set()
    start = 0
    for runner in runners:
        name = runner.config.name
        if not ledger.stage_done(batch.index, name):
            break
        for key, update in ledger.stage_outputs(list(records), name).items():
            records[key].update(update)
        stage_failed |= {k for k, (stage, _) in ledger.failed_keys(list(records)).items() if stage == name}
        start += 1
    return records, stage_failed, start


StageResult = tuple[str, dict[str, dict[str, Any]], dict[str, str], bool]  # name, updates, failures, ran


def run_stages(
    runners: list[_StageRunner],
    records: dict[str, dict[str, Any]],
    keys: list[str],
    stage_failed: set[str],
    on_stage_done=None,
    record_errors: bool = False,
) -> list[StageResult]:
    """Run stages in order over the live records, merging each stage's updates before the next one runs."""
    results = []
    for runner in runners:
        live = [records[k] for k in keys if k in records and k not in stage_failed]
        updates, failures = runner.run(live, record_errors) if live else ({}, {})
        result = (runner.config.name, updates, failures, bool(live))
        if on_stage_done is not None:
            on_stage_done(result)
        for key, update in updates.items():
            records[key].update(update)
        stage_failed |= set(failures)
        results.append(result)
    return results


def commit_stage(ledger: Ledger, batch_index: int, runner: _StageRunner, result: StageResult) -> None:
    name, updates, failures, ran = result
    with ledger.transaction():
        ledger.record_stage(batch_index, name, updates, failures)
        if ran:
            runner.remember_description()


def finish_batch(
    validated: ValidatedBuild, batch: _Batch, ledger: Ledger, records: dict[str, dict[str, Any]], label_names: list[str]
) -> None:
    """Write the batch's release samples and mark it done, in one transaction."""
    rows = []
    for sample in batch.samples:
        if sample.key in records:
            record = records[sample.key]
            rows += _emit(validated.config, validated.outputs, record, label_names[record["label"]])
    with ledger.transaction():
        ledger.record_outputs(batch.index, rows)


def _run_batch(
    validated: ValidatedBuild,
    batch: _Batch,
    ledger: Ledger,
    runners: list[_StageRunner],
    label_names: list[str],
    record_errors: bool = False,
) -> int:
    records, stage_failed, start = _prepare_batch(batch, ledger, runners, label_names)
    by_name = {r.config.name: r for r in runners}
    run_stages(
        runners[start:],
        records,
        [s.key for s in batch.samples],
        stage_failed,
        on_stage_done=lambda result: commit_stage(ledger, batch.index, by_name[result[0]], result),
        record_errors=record_errors,
    )
    finish_batch(validated, batch, ledger, records, label_names)
    return len(batch.failures) + len(stage_failed)
