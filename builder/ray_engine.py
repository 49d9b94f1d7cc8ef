"""The Ray engine: the same build, with the stages of several batches running at once on Ray actors.

The driver keeps everything that decides the release's bytes: the plan, decoding, the ledger and emission. Each
actor loads the stages' models once, with the same torch settings as a local build (intra-op threads, CUDA
determinism: ``builder.runtime.torch_settings``), and runs the unfinished stages of whole batches (batch composition
is fixed by the plan, so results do not depend on which actor ran them). The driver commits each batch's stage
outputs and release samples as results arrive, in whatever order, so a killed Ray build resumes like a local one and
the shards (written in key order from the ledger) are byte-identical to a local build's.

Connects to the cluster named by ``RAY_ADDRESS`` when set, else starts a local one.
"""

from __future__ import annotations

import functools
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
    """One Ray actor: the active stages, loaded once on this actor's device, under the build's torch settings."""

    def __init__(self, stages: list[Any], device: str, torch_threads: int, worked: list[bool]):
        from builder.engine import _StageRunner
        from builder.runtime import torch_settings

        # Entered for the actor's life (it runs nothing else); the driver records the same settings.
        self._settings = torch_settings(torch_threads, device)
        self._settings.__enter__()
        self.runners = [_StageRunner(s, device, ledger=None) for s in stages]
        for runner, has_worked in zip(self.runners, worked, strict=True):
            runner.ever_succeeded = has_worked

    def run(self, records, keys, start, out, record_errors: bool):
        from builder.engine import run_stages

        return run_stages(self.runners, records, keys, start, out, record_errors=record_errors)


def run_ray(
    validated: Any,
    source: Any,
    plan: list,
    ledger: Any,
    runners: list[Any],
    progress: bool,
    workers: int = 1,
    torch_threads: int = 1,
    schedule: str = "batch-major",
) -> None:
    """The ``ray`` engine (``builder.registry.ENGINES``): plans like the local engine, runs batches on actors."""
    from builder.engine import _drive

    remote = functools.partial(_ray_loop, workers=workers, torch_threads=torch_threads)
    _drive(validated, source, plan, ledger, runners, progress, schedule, remote=remote)


run_ray.preflight = _import_ray  # build() calls an engine's preflight before it writes anything


def _ray_loop(
    validated: Any,
    todo: list[int],
    decode: Callable[[int], Any],
    ledger: Any,
    runners: list[Any],
    label_names: list[str],
    bar: Any,
    *,
    workers: int,
    torch_threads: int,
) -> None:
    from builder.engine import StageNotWorking, _prepare_batch, commit_stage, finish_batch

    ray = _import_ray()
    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
    device = runners[0].device if runners else "cpu"
    gpus = 1 if device.startswith("cuda") else 0
    actor_cls = ray.remote(num_gpus=gpus, num_cpus=1)(StageWorker)
    worked = [r.ever_succeeded for r in runners]
    stages = [r.validated for r in runners]
    actors = [actor_cls.remote(stages, device, torch_threads, worked) for _ in range(max(1, workers))]
    by_name = {r.name: r for r in runners}
    idle = list(actors)
    in_flight: dict[Any, tuple[Any, Any, dict, dict]] = {}  # object ref -> (actor, batch, records, live counts)
    queue: list[tuple[Any, bool]] = [(index, False) for index in todo]  # (batch index or decoded batch, record errors)
    deferred: list[tuple[Any, BaseException]] = []  # batches on which a stage has not worked yet (see StageNotWorking)
    any_success = False

    def submit() -> None:
        while idle and queue:
            item, record_errors = queue.pop(0)
            batch = decode(item) if isinstance(item, int) else item
            records, start, out = _prepare_batch(batch, ledger, runners, label_names)
            if not start:
                finish_batch(validated, batch, ledger, records, label_names)
                bar.batch_done(batch)
                continue
            actor = idle.pop()
            keys = [s.key for s in batch.samples]
            ref = actor.run.remote(records, keys, start, out, record_errors)
            in_flight[ref] = (actor, batch, records, out)

    try:
        submit()
        while in_flight:
            ready, _ = ray.wait(list(in_flight), num_returns=1)
            ref = ready[0]
            actor, batch, records, out = in_flight.pop(ref)
            idle.append(actor)
            try:
                results = ray.get(ref)  # a stage error that is not per-sample surfaces here, as in a local build
            except Exception as err:
                # Ray wraps the actor's exception; its cause tells a stage that has not worked yet from the rest.
                if not isinstance(err, StageNotWorking) and not isinstance(
                    getattr(err, "cause", None), StageNotWorking
                ):
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
                commit_stage(ledger, batch.index, by_name[result.stage], result)
                for key, update in result.updates.items():
                    records[key].update(update)
                n = len(result.updates) + len(result.failures) + len(result.errors)
                bar.stage_done(batch, result.stage, n)
            finish_batch(validated, batch, ledger, records, label_names)
            bar.batch_done(batch)
            submit()
    finally:
        for actor in actors:
            ray.kill(actor)
    if deferred:
        raise deferred[0][1]
