"""The Ray engine: the same build, with the stages of several batches running at once on Ray actors.

The driver keeps everything that decides the release's bytes: the plan, decoding, the ledger and emission. Each
actor loads the stages' models once and runs the unfinished stages of whole batches (batch composition is fixed by
the plan, so results do not depend on which actor ran them). The driver commits each batch's stage outputs and
release samples as results arrive, in whatever order, so a killed Ray build resumes like a local one and the shards
(written in key order from the ledger) are byte-identical to a local build's.

Connects to the cluster named by ``RAY_ADDRESS`` when set, else starts a local one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

INSTALL_HINT = "the Ray engine needs Ray: pip install 'lance-counterfactuals[ray]'"


def _import_ray():
    try:
        import ray
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    return ray


class StageWorker:
    """One Ray actor: the active stages, loaded once on this actor's device."""

    def __init__(self, stages: list[Any], device: str):
        from builder.engine import _StageRunner

        self.runners = [_StageRunner(s, device, ledger=None) for s in stages]

    def run(
        self,
        records: dict[str, dict[str, Any]],
        keys: list[str],
        stage_failed: set[str],
        start: int,
        record_errors: bool,
    ):
        from builder.engine import run_stages

        return run_stages(self.runners[start:], records, keys, stage_failed, record_errors=record_errors)


def run_batches_on_ray(
    validated: Any,
    todo: list[int],
    decode: Callable[[int], Any],
    ledger: Any,
    runners: list[Any],
    label_names: list[str],
    workers: int,
    on_batch_done: Callable[[Any, int], None],
) -> None:
    from builder.engine import StageNotWorking, _prepare_batch, commit_stage, finish_batch

    ray = _import_ray()
    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
    device = runners[0].device if runners else "cpu"
    gpus = 1 if device.startswith("cuda") else 0
    actor_cls = ray.remote(num_gpus=gpus, num_cpus=1)(StageWorker)
    actors = [actor_cls.remote([r.validated for r in runners], device) for _ in range(max(1, workers))]
    by_name = {r.config.name: r for r in runners}
    idle = list(actors)
    in_flight: dict[Any, tuple[Any, Any, dict, set[str]]] = {}  # object ref -> (actor, batch, records, failed)
    queue: list[tuple[Any, bool]] = [(index, False) for index in todo]  # (batch index or decoded batch, record errors)
    deferred: list[tuple[Any, BaseException]] = []  # batches on which a stage has not worked yet (see StageNotWorking)
    any_success = False

    def submit() -> None:
        while idle and queue:
            item, record_errors = queue.pop(0)
            batch = decode(item) if isinstance(item, int) else item
            records, stage_failed, start = _prepare_batch(batch, ledger, runners, label_names)
            if start == len(runners) or not records:
                finish_batch(validated, batch, ledger, records, label_names)
                on_batch_done(batch, len(batch.failures) + len(stage_failed))
                continue
            actor = idle.pop()
            keys = [s.key for s in batch.samples]
            ref = actor.run.remote(records, keys, stage_failed, start, record_errors)
            in_flight[ref] = (actor, batch, records, stage_failed)

    submit()
    while in_flight:
        ready, _ = ray.wait(list(in_flight), num_returns=1)
        ref = ready[0]
        actor, batch, records, stage_failed = in_flight.pop(ref)
        idle.append(actor)
        try:
            results = ray.get(ref)  # a stage error that is not per-sample surfaces here, as in a local build
        except Exception as err:
            # Ray wraps the actor's exception; its cause tells a stage that has not worked yet from anything else.
            if not isinstance(err, StageNotWorking) and not isinstance(getattr(err, "cause", None), StageNotWorking):
                raise
            if any_success:
                queue.append((batch, True))
            else:
                deferred.append((batch, err))
            submit()
            continue
        any_success = True
        queue.extend((late, True) for late, _ in deferred)
        deferred.clear()
        for result in results:
            name, updates, failures, _ran = result
            commit_stage(ledger, batch.index, by_name[name], result)
            for key, update in updates.items():
                records[key].update(update)
            stage_failed |= set(failures)
        finish_batch(validated, batch, ledger, records, label_names)
        on_batch_done(batch, len(batch.failures) + len(stage_failed))
        submit()
    for actor in actors:
        ray.kill(actor)
    if deferred:
        raise deferred[0][1]
