"""Batches to a pool of workers and their results back into the ledger: the loop the multi-worker engines share.

The ``devices`` engine (one process per device, ``builder.multi_device``) and the ``ray`` engine (Ray actors,
``builder.ray_engine``) differ only in how a worker is started, fed and lost; this module owns everything that
decides what the release holds, exactly as the local engine does it (``builder.engine``): the driver decodes each
batch, replays what the ledger holds for it, sends the stages still to run to an idle worker, and commits each
stage's results and the batch's release samples as they come back, in whatever order. Batch composition is fixed by
the plan, so a result does not depend on which worker computed it, and shards are written in key order from the
ledger: any number of workers gives the local engine's bytes.

Faults: a worker that dies (killed, out of memory, its node gone) loses only the batch it was running, which nothing
had committed yet; that batch goes back to the front of the queue and the worker is restarted. A batch that loses
its worker ``MAX_WORKER_LOSSES`` times stops the build (probably the batch itself kills workers). Everything
committed stays committed: a build interrupted as a whole resumes from the ledger like a local one.

Progress on the driver: the engine's bar (done, per-stage counts, failed, errors, elapsed<remaining) and, every
``PROGRESS_EVERY_S`` seconds, one log line with done/total, failed, errors, rate and ETA (for logs of a cluster job
without a terminal).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any, Protocol

logger = logging.getLogger(__name__)

MAX_WORKER_LOSSES = 3
PROGRESS_EVERY_S = 30.0


class WorkerLost(RuntimeError):
    """The worker running a batch died (its process or node is gone); the batch did not commit anything."""


class WorkerPool(Protocol):
    """Workers that each hold every active stage, loaded once (``builder.ray_engine.StageWorker``)."""

    slots: int

    def submit(self, slot: int, *args: Any) -> Any:
        """Run ``StageWorker.run(*args)`` on worker ``slot``; returns a handle."""

    def wait(self, handles: list[Any]) -> list[Any]:
        """Block until at least one handle is finished; return the finished ones."""

    def result(self, handle: Any) -> Any:
        """The worker's stage results; raises ``WorkerLost`` when the worker died, else the worker's exception."""

    def restart(self, slot: int) -> None:
        """Replace worker ``slot`` (after ``WorkerLost``)."""

    def close(self) -> None:
        """Stop every worker."""


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


def dispatch(
    validated: Any,
    todo: list[int],
    decode: Callable[[int], Any],
    ledger: Any,
    runners: list[Any],
    label_names: list[str],
    bar: Any,
    pool_factory: Callable[[], WorkerPool],
) -> dict[str, int]:
    """Run the ``todo`` batches on the pool ``pool_factory()`` makes; returns counts (batches, worker losses)."""
    from builder.engine import StageNotWorking, _prepare_batch, commit_stage, finish_batch

    for runner in runners:
        runner.stage  # resolve model references (e.g. build a demo component) once, before workers race for it  # noqa: B018
    sizes = Counter(row[1] for row in ledger.plan())
    meter = ProgressLog(ledger, sum(sizes[b] for b in todo))
    by_name = {r.name: r for r in runners}
    queue: deque[tuple[Any, bool]] = deque((index, False) for index in todo)  # (batch index or batch, record errors)
    deferred: list[tuple[Any, BaseException]] = []  # batches on which a stage has not worked yet (StageNotWorking)
    in_flight: dict[Any, tuple[int, Any, dict, bool]] = {}  # handle -> (slot, batch, records, record errors)
    losses: Counter[int] = Counter()
    any_success = False
    pool = pool_factory()
    idle = list(range(pool.slots))

    def submit() -> None:
        while idle and queue:
            item, record_errors = queue.popleft()
            batch = decode(item) if isinstance(item, int) else item
            records, start, out = _prepare_batch(batch, ledger, runners, label_names)
            if not start:  # everything stored already (a resumed batch): just write its samples
                finish_batch(validated, batch, ledger, records, label_names)
                bar.batch_done(batch)
                meter.batch_done(len(batch.samples))
                continue
            slot = idle.pop(0)
            handle = pool.submit(slot, records, [s.key for s in batch.samples], start, out, record_errors)
            in_flight[handle] = (slot, batch, records, record_errors)

    try:
        submit()
        while in_flight:
            for handle in pool.wait(list(in_flight)):
                slot, batch, records, record_errors = in_flight.pop(handle)
                try:
                    results = pool.result(handle)
                except WorkerLost as err:
                    losses[batch.index] += 1
                    keys = ", ".join(s.key for s in batch.samples)
                    if losses[batch.index] >= MAX_WORKER_LOSSES:
                        raise RuntimeError(
                            f"batch {batch.index} ({keys}) lost its worker {losses[batch.index]} times (last: {err}); "
                            "the batch itself probably kills workers (e.g. out of memory): lower --batch-size, then "
                            "re-run the same command (finished samples are kept)"
                        ) from err
                    logger.warning(
                        "worker %d died running batch %d (%s): %s; the batch goes to the next worker",
                        slot,
                        batch.index,
                        keys,
                        err,
                    )
                    pool.restart(slot)
                    idle.append(slot)
                    queue.appendleft((batch, record_errors))
                    continue
                except StageNotWorking as err:
                    idle.append(slot)
                    if any_success:
                        queue.append((batch, True))
                    else:
                        logger.warning(
                            "%s; deferring batch %d until the stage works on another batch", err, batch.index
                        )
                        deferred.append((batch, err))
                    continue
                idle.append(slot)
                any_success = True
                queue.extend((late, True) for late, _ in deferred)
                deferred.clear()
                for result in results:
                    # The result carries the stage's description from the worker that loaded it (the manifest's).
                    commit_stage(ledger, batch.index, by_name[result.stage], result)
                    for key, message in result.errors.items():
                        logger.warning(
                            "stage %s raised on %s: %s (recorded; re-run the build to retry it)",
                            result.stage,
                            key,
                            message,
                        )
                    for key, update in result.updates.items():
                        records[key].update(update)
                    bar.stage_done(batch, result.stage, len(result.updates) + len(result.failures) + len(result.errors))
                finish_batch(validated, batch, ledger, records, label_names)
                bar.batch_done(batch)
                meter.batch_done(len(batch.samples))
            submit()
    finally:
        pool.close()
    if deferred:
        raise deferred[0][1]
    return {"batches": len(todo), "worker_losses": sum(losses.values())}
