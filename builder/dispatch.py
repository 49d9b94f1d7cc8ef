"""Stages of batches to pools of workers and their results back into the ledger: the multi-worker engines' loop.

The ``devices`` engine (processes, ``builder.multi_device``) and the ``ray`` engine (Ray actors,
``builder.ray_engine``) differ only in how a worker is started, fed and lost; this module owns everything that
decides what the release holds, exactly as the local engine does it (``builder.engine``): the driver decodes each
batch, replays what the ledger holds for it, sends the stages still to run to a worker, and commits each stage's
results and the batch's release samples as they come back, in whatever order. Batch composition is fixed by the plan
(and a stage's sub-batches by its ``batch_size``, ``builder.engine.run_stage``), so a result does not depend on which
worker computed it, and shards are written in key order from the ledger: any layout of workers gives the local
engine's bytes.

Worker pools (``PoolSpec``): each pool's workers load only the pool's stages, once. With no ``--stage-workers``
there is one pool holding every active stage (each worker runs whole batches). ``--stage-workers edit=4,caption=1``
gives the named stages pools of their own (``invert+edit=4`` one pool for both); the stages not named share one pool
of ``--workers`` workers. The unit of work is (batch, the run of consecutive stages its next pool holds): a batch goes
pool to pool, committed stage by stage, so different batches are in different stages at once (a pipeline).

Schedules: ``batch-major`` opens every pool at once (the pipeline above); ``stage-major`` opens one stage's pool at a
time (with that stage's worker count), runs every pending batch through it, closes it (its workers drop the stage's
models; the backend hands them to the next stage's pool or stops them), then the next stage; the release samples are
written at the end. Same units, same bytes.

Faults: a worker that dies (killed, out of memory, its node gone) loses only the unit it was running, which nothing
had committed yet; the unit goes back to the front of its pool's queue and the worker is replaced. A batch that loses
its worker ``MAX_WORKER_LOSSES`` times stops the build (probably the batch itself kills workers). A stage that fails
on every sample before it has worked anywhere (``StageNotWorking``) defers that batch until the stage works on
another batch. Everything committed stays committed: a build interrupted as a whole resumes from the ledger.

Progress on the driver: the engine's bar (done, per-stage counts, failed, errors, elapsed<remaining) and, every
``PROGRESS_EVERY_S`` seconds, one log line with done/total, failed, errors, rate and ETA (for logs of a cluster job
without a terminal).
"""

from __future__ import annotations

import difflib
import logging
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from builder.engine import StageNotWorking, StageWork, commit_stage, finish_batch, prepare_batch

logger = logging.getLogger(__name__)

MAX_WORKER_LOSSES = 3
PROGRESS_EVERY_S = 30.0


class WorkerLost(RuntimeError):
    """The worker running a unit died (its process or node is gone); the unit did not commit anything."""


@dataclass(frozen=True)
class PoolSpec:
    """Workers that each load ``stages`` once: how many, and the GPUs each reserves (``None``: the engine's default)."""

    stages: tuple[str, ...]
    workers: int
    gpus: float | None = None


class WorkerPool(Protocol):
    """The workers of one ``PoolSpec`` (``builder.ray_engine.StageWorker`` holding the pool's stages)."""

    slots: int

    def submit(self, slot: int, *args: Any) -> Any:
        """Run ``StageWorker.run(*args)`` on worker ``slot``; returns a handle."""

    def result(self, handle: Any) -> Any:
        """The worker's stage results; raises ``WorkerLost`` when the worker died, else the worker's exception."""

    def restart(self, slot: int) -> None:
        """Replace worker ``slot`` (after ``WorkerLost``)."""

    def close(self) -> None:
        """Stop every worker (their models and devices are freed)."""


class WorkerBackend(Protocol):
    """How an engine starts pools and waits on their handles (handles of several pools at once)."""

    def open_pools(self, specs: Sequence[PoolSpec], worked: dict[str, bool]) -> list[WorkerPool]:
        """Start one pool per spec; ``worked``: stage name -> it has worked in this build (for ``StageNotWorking``)."""

    def wait(self, handles: list[Any]) -> list[Any]:
        """Block until at least one handle is finished; return the finished ones."""

    def close(self) -> None:
        """Stop the workers the closed pools handed back (a backend may keep them for the next pools)."""


# --- per-stage pool settings (--stage-workers / --stage-gpus) ------------------------------------------------------


def parse_stage_settings(text: str, flag: str, kind: type = int) -> dict[str, Any]:
    """``"edit=4,caption=1"`` (or ``invert+edit=4`` for one pool holding both) -> ``{"edit": 4, "caption": 1}``
    (keys keep the ``+``). Syntax only; the names are checked against the config by ``check_pool_options``."""
    what = "a positive integer" if kind is int else "a number >= 0"
    settings: dict[str, Any] = {}
    for part in str(text).split(","):
        name, sep, value = part.strip().partition("=")
        stages = [s.strip() for s in name.split("+")]
        if not sep or not all(stages) or not value.strip():
            raise ValueError(f"{flag} {text!r}: expected STAGE=VALUE[,STAGE=VALUE...], e.g. {flag} edit=4,caption=1")
        try:
            number = kind(value)
        except ValueError:
            number = None
        if number is None or (kind is int and number < 1) or number < 0:
            raise ValueError(f"{flag} {text!r}: {value.strip()!r} for {name.strip()} is not {what}")
        key = "+".join(stages)
        if key in settings:
            raise ValueError(f"{flag} {text!r}: {key} is given twice")
        settings[key] = number
    return settings


def _check_names(settings: dict[str, Any], flag: str, configured: list[str]) -> None:
    seen: set[str] = set()
    for key in settings:
        for name in key.split("+"):
            if name not in configured:
                close = difflib.get_close_matches(name, configured, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f" (stages: {', '.join(configured)})"
                raise ValueError(f"{flag}: the config has no stage {name!r}{hint}")
            if name in seen:
                raise ValueError(f"{flag}: stage {name!r} is named twice")
            seen.add(name)


def check_pool_options(validated: Any, options: dict[str, Any]) -> None:
    """Check ``stage_workers`` / ``stage_gpus`` against the config before anything is written (one-line errors)."""
    configured = [s.name for s in validated.config.stages]
    active = [s.config.name for s in validated.active]
    workers = options.get("stage_workers") or {}
    gpus = options.get("stage_gpus") or {}
    for flag, settings, low in (("--stage-workers", workers, 1), ("--stage-gpus", gpus, 0)):
        for key, value in settings.items():
            if isinstance(value, bool) or not isinstance(value, int if low else (int, float)) or value < low:
                what = "a positive integer" if low else "a number >= 0"
                raise ValueError(f"{flag}: {value!r} for {key} is not {what}")
    _check_names(workers, "--stage-workers", configured)
    _check_names(gpus, "--stage-gpus", configured)
    plan_pools(active, workers, gpus, default_workers=1, default_gpus=None)  # raises on a conflicting layout


def plan_pools(
    active: list[str],
    stage_workers: dict[str, int] | None,
    stage_gpus: dict[str, float] | None,
    default_workers: int,
    default_gpus: float | None,
) -> list[PoolSpec]:
    """The pools of a build, in stage order of their first stage: one per ``stage_workers`` key (its active stages),
    and one for the active stages no key names (``default_workers`` workers). Stages named but not active (their
    configs are not built) are left out."""
    stage_workers = stage_workers or {}
    stage_gpus = stage_gpus or {}
    groups: list[tuple[tuple[str, ...], int]] = []
    named: set[str] = set()
    for key, count in stage_workers.items():
        members = tuple(s for s in active if s in key.split("+"))
        named.update(key.split("+"))
        if members:
            groups.append((members, count))
    rest = tuple(s for s in active if s not in named)
    if rest:
        groups.append((rest, default_workers))
    gpus_of = {name: value for key, value in stage_gpus.items() for name in key.split("+")}
    pools = []
    for members, count in groups:
        given = {gpus_of[s] for s in members if s in gpus_of}
        if len(given) > 1:
            raise ValueError(
                f"--stage-gpus: stages {', '.join(members)} share one pool but are given different GPUs "
                f"({', '.join(str(g) for g in sorted(given))}); give the pool one value"
            )
        pools.append(PoolSpec(members, count, given.pop() if given else default_gpus))
    pools.sort(key=lambda p: active.index(p.stages[0]))
    return pools


# --- the loop ---------------------------------------------------------------------------------------------------------


class ProgressLog:
    """Done / total images, failed, errors, rate and ETA, logged at most every ``every_s`` seconds."""

    def __init__(self, ledger: Any, total: int, every_s: float = PROGRESS_EVERY_S):
        self.ledger = ledger
        self.total = total
        self.done = 0
        self.every_s = every_s
        self.started = time.monotonic()
        self._last = self.started

    def batch_done(self, samples: int) -> None:
        self.done += samples
        now = time.monotonic()
        if now - self._last >= self.every_s or self.done >= self.total:
            self._last = now
            logger.info("%s", self.line(now))

    def line(self, now: float | None = None) -> str:
        elapsed = max(1e-9, (now or time.monotonic()) - self.started)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        failed = len({key for key, _stage, _reason in self.ledger.failures()})
        errors = len({key for key, _stage, _message in self.ledger.errors()})
        eta_text = f"{eta:.0f} s" if eta != float("inf") else "?"
        return (
            f"done {self.done}/{self.total} images this run, failed {failed}, errors {errors}, "
            f"{rate:.3f} img/s, ETA {eta_text}"
        )


@dataclass
class _BatchState:
    """A decoded batch on its way through the stages: its work (stage outputs merged in as they commit)."""

    batch: Any
    work: Any  # builder.engine.StageWork
    position: int = 0  # the next stage to consider


@dataclass
class _Unit:
    """Stages ``first..last`` (indices into the runners, all held by one pool) of one batch."""

    state: _BatchState
    pool: int
    first: int
    last: int
    record_errors: bool = False


class _Dispatcher:
    """The loop of ``dispatch``: admit batches, route each to the pool holding its next stages, submit units to idle
    workers, and handle each unit's outcome (committed, worker lost, stage not working yet)."""

    def __init__(self, run: Any, backend: WorkerBackend, pools: Sequence[PoolSpec], runners: list[Any], finish: bool):
        self.run = run
        self.backend = backend
        self.runners = runners
        self.finish = finish
        sizes = Counter(row[1] for row in run.ledger.plan())
        self.meter = ProgressLog(run.ledger, sum(sizes[b] for b in run.todo))
        self.by_name = {r.name: r for r in runners}
        self.pool_of = {name: i for i, spec in enumerate(pools) for name in spec.stages}
        self.pending: deque[int] = deque(run.todo)  # batch indices not decoded yet
        self.queues: list[deque[_Unit]] = [deque() for _ in pools]
        self.deferred: dict[str, list[tuple[_Unit, BaseException]]] = {}  # stage -> units waiting for it to work
        self.in_flight: dict[Any, tuple[int, _Unit]] = {}  # handle -> (slot, unit)
        self.losses: Counter[int] = Counter()
        self.counts = {"units": 0, "worker_losses": 0}
        self.live_batches = 0  # decoded, not finished, not deferred: bounded so that decoded images stay few
        self.workers = backend.open_pools(pools, {r.name: r.ever_succeeded for r in runners}) if pools else []
        self.idle = [list(range(pool.slots)) for pool in self.workers]
        self.max_live = sum(pool.slots for pool in self.workers) + len(self.workers)

    def loop(self) -> dict[str, int]:
        """Submit until every unit is done; then check that nothing is left behind."""
        try:
            self.submit()
            while self.in_flight:
                for handle in self.backend.wait(list(self.in_flight)):
                    self.collect(handle)
                self.submit()
        finally:
            for pool in self.workers:
                pool.close()
        if any(self.queues) or self.pending:  # a bug here, not bad input: work left that no worker will ever take
            raise RuntimeError("the dispatcher stopped with units still queued")
        if self.deferred:
            raise next(iter(self.deferred.values()))[0][1]
        return self.counts

    def live_at(self, state: _BatchState, index: int) -> bool:
        work = state.work
        return any(work.start.get(k, len(self.runners)) <= index and k not in work.out for k in work.keys)

    def route(self, state: _BatchState) -> None:
        """Queue the batch's next run of stages on the pool holding them, or finish it."""
        runners = self.runners
        index = state.position
        while index < len(runners) and not self.live_at(state, index):
            index += 1
        if index == len(runners):
            self.live_batches -= 1
            if self.finish:
                finish_batch(self.run, state.batch, state.work.records)
                self.run.bar.batch_done(state.batch)
                self.meter.batch_done(len(state.batch.samples))
            return
        pool = self.pool_of.get(runners[index].name)
        if pool is None:  # a bug in the caller: a stage to run that no pool holds
            raise RuntimeError(f"batch {state.batch.index} needs stage {runners[index].name}, which no pool holds")
        last = index
        while last + 1 < len(runners) and self.pool_of.get(runners[last + 1].name) == pool:
            last += 1
        self.queues[pool].append(_Unit(state, pool, index, last))

    def admit(self) -> None:
        """Decode and route pending batches while fewer than the workers (plus one per pool) are live."""
        while self.pending and self.live_batches < max(1, self.max_live):
            batch = self.run.decode(self.pending.popleft())
            work = prepare_batch(self.run, batch, self.runners)
            self.live_batches += 1
            self.route(_BatchState(batch, work))

    def submit(self) -> None:
        """Hand queued units to idle workers; only the records the unit's stages read travel."""
        self.admit()
        for pool, queue in enumerate(self.queues):
            while self.idle[pool] and queue:
                unit = queue.popleft()
                work = unit.state.work
                names = [r.name for r in self.runners[unit.first : unit.last + 1]]
                keys = [k for k in work.keys if work.start.get(k, len(self.runners)) <= unit.last]
                keys = [k for k in keys if k not in work.out]
                # Stage indices relative to the unit's first stage.
                start = {k: max(0, work.start[k] - unit.first) for k in keys}
                sent = StageWork({k: work.records[k] for k in keys}, keys, start, set(), unit.record_errors)
                slot = self.idle[pool].pop(0)
                handle = self.workers[pool].submit(slot, names, sent)
                self.in_flight[handle] = (slot, unit)
                self.counts["units"] += 1

    def collect(self, handle: Any) -> None:
        """One finished handle: commit its results, or requeue its unit (worker lost), or defer it."""
        slot, unit = self.in_flight.pop(handle)
        try:
            results = self.workers[unit.pool].result(handle)
        except WorkerLost as err:
            self.lost(slot, unit, err)
            self.idle[unit.pool].append(slot)
            return
        except StageNotWorking as err:
            self.idle[unit.pool].append(slot)
            self.not_working(unit, err)
            return
        self.idle[unit.pool].append(slot)
        self.commit(unit, results)

    def lost(self, slot: int, unit: _Unit, err: WorkerLost) -> None:
        batch = unit.state.batch
        self.losses[batch.index] += 1
        self.counts["worker_losses"] += 1
        keys = ", ".join(s.key for s in batch.samples)
        stages = ", ".join(r.name for r in self.runners[unit.first : unit.last + 1])
        if self.losses[batch.index] >= MAX_WORKER_LOSSES:
            raise RuntimeError(
                f"batch {batch.index} ({keys}) lost its worker {self.losses[batch.index]} times (last: {err}); "
                "the batch itself probably kills workers (e.g. out of memory): lower --batch-size (or the stage's "
                "batch_size), then re-run the same command (finished samples are kept)"
            ) from err
        logger.warning(
            "worker %d of the %s pool died running batch %d (%s): %s; the batch goes to the next worker",
            slot,
            stages,
            batch.index,
            keys,
            err,
        )
        self.workers[unit.pool].restart(slot)
        self.queues[unit.pool].appendleft(unit)

    def not_working(self, unit: _Unit, err: StageNotWorking) -> None:
        if self.by_name[err.stage].ever_succeeded:  # it works elsewhere: this batch's errors are its samples'
            unit.record_errors = True
            self.queues[unit.pool].append(unit)
            return
        logger.warning("%s; deferring batch %d until the stage works on another batch", err, unit.state.batch.index)
        self.deferred.setdefault(err.stage, []).append((unit, err))
        self.live_batches -= 1

    def commit(self, unit: _Unit, results: list[Any]) -> None:
        state = unit.state
        for result in results:
            # The result carries the stage's description from the worker that loaded it (the manifest's).
            runner = self.by_name[result.stage]
            commit_stage(self.run.ledger, state.batch.index, runner, result)
            for key, message in result.errors.items():
                logger.warning(
                    "stage %s raised on %s: %s (recorded; re-run the build to retry it)", result.stage, key, message
                )
            for key, update in result.updates.items():
                state.work.records[key].update(update)
            state.work.out |= set(result.failures) | set(result.errors)
            count = len(result.updates) + len(result.failures) + len(result.errors)
            self.run.bar.stage_done(state.batch, result.stage, count)
            runner.ever_succeeded = True
            for late, _err in self.deferred.pop(result.stage, []):  # the stage works: their errors are their samples'
                late.record_errors = True
                self.queues[late.pool].append(late)
                self.live_batches += 1
        state.position = unit.last + 1
        self.route(state)


def dispatch(
    run: Any,
    backend: WorkerBackend,
    pools: Sequence[PoolSpec],
    runners: list[Any] | None = None,
    *,
    finish: bool = True,
) -> dict[str, int]:
    """Run the stages of ``runners`` (default: the run's) over the run's pending batches on ``pools``; returns counts
    (units, worker losses).

    Every stage a batch still needs must be held by one of ``pools``, except the stages already done for every batch
    (stage-major passes the earlier stages, done, and one pool). ``finish``: write each batch's release samples once
    its stages are done (stage-major writes them after the last stage).
    """
    runners = run.runners if runners is None else runners
    for runner in runners:
        runner.stage  # resolve model references (e.g. build a demo component) once, before workers race for it  # noqa: B018
    return _Dispatcher(run, backend, pools, runners, finish).loop()


def run_pools(run: Any, backend: WorkerBackend, pools: Sequence[PoolSpec]) -> dict[str, int]:
    """Run a build's pending batches on ``pools`` under the run's schedule; returns counts (units, worker losses)."""
    try:
        if run.options.schedule != "stage-major":
            return dispatch(run, backend, pools)
        return _stage_major(run, backend, pools)
    finally:
        backend.close()


def _stage_major(run: Any, backend: WorkerBackend, pools: Sequence[PoolSpec]) -> dict[str, int]:
    """One stage's pool at a time (its workers reused from the last stage's where the backend can), then emit."""
    totals: Counter[str] = Counter()
    for position, runner in enumerate(run.runners):
        spec = next(p for p in pools if runner.name in p.stages)
        only = PoolSpec((runner.name,), spec.workers, spec.gpus)
        logger.info("stage-major: stage %s on %d worker(s)", runner.name, only.workers)
        totals.update(dispatch(run, backend, [only], run.runners[: position + 1], finish=False))
        logger.info("stage %s done for every pending sample; its workers dropped its models", runner.name)
    # Every stage is done: replay each batch from the ledger and write its release samples (no worker needed).
    totals.update(dispatch(run, backend, [], finish=True))
    return dict(totals)
