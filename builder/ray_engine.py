"""The Ray engine: the same build, with its stages running on pools of Ray actors, on any nodes.

The driver keeps everything that decides the release's bytes: the plan, decoding, the ledger and emission. Each
actor loads its pool's stages once (every active stage by default; one stage or a group with ``--stage-workers``),
with the same torch settings as a local build (intra-op threads, CUDA determinism: ``builder.runtime.torch_settings``),
and runs those stages over whole batches (batch composition is fixed by the plan, so results do not depend on which
actor ran them). The driver commits each stage's outputs and each batch's release samples as results arrive, in
whatever order, so a killed Ray build resumes like a local one and the shards (written in key order from the ledger)
are byte-identical to a local build's.

Connects to ``--ray-address`` (or the cluster named by ``RAY_ADDRESS``) when set, else starts a local one. The loop
that feeds the pools and commits their results, with retries of units whose actor died, and the schedules, are
``builder.dispatch`` (shared with the ``devices`` engine).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from builder.dispatch import WorkerLost, check_pool_options, plan_pools, run_pools
from builder.engine import StageNotWorking, _drive, _StageRunner, run_stages
from builder.runtime import torch_settings
from lance_pipeline.models.devices import free_accelerator_memory

logger = logging.getLogger(__name__)

INSTALL_HINT = "the Ray engine needs Ray: pip install 'lance-counterfactuals[ray]'"


def _import_ray():
    try:
        import ray
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    return ray


class StageWorker:
    """One worker (a Ray actor or a ``devices`` process) on one device, under the build's torch settings. It holds the
    stages of the pool it serves, each loaded once; a worker handed to another pool (the next stage, stage-major)
    drops its stages and their models first, so a process is started once per build, not once per stage."""

    def __init__(self, device: str, torch_threads: int):
        self.device = device
        # Entered for the worker's life (it runs nothing else); the driver records the same settings.
        self._settings = torch_settings(torch_threads, device)
        self._settings.__enter__()
        self.runners: dict[str, Any] = {}

    def assign(self, stages: list[Any], worked: list[bool]) -> None:
        """Serve a pool holding ``stages`` (models load on first use); ``worked``: each has worked in this build."""
        self.release()
        self.runners = {s.config.name: _StageRunner(s, self.device, ledger=None) for s in stages}
        for runner, has_worked in zip(self.runners.values(), worked, strict=True):
            runner.ever_succeeded = has_worked

    def release(self) -> None:
        """Drop the stages and their models (and the CUDA cache): the worker waits for its next pool. A worker that
        holds no stage (a fresh one, or one released already) has nothing to free."""
        if not self.runners:
            return
        for runner in self.runners.values():
            runner.release()
        self.runners = {}
        free_accelerator_memory(worker_process=True)

    def run(self, assignment, names: list[str], work):
        """Stages ``names`` (consecutive in the build, all of this worker's pool) over a batch's ``work``
        (``builder.engine.StageWork``); ``assignment`` (stages, worked) comes with the first unit a worker gets from a
        pool."""
        if assignment is not None:
            self.assign(*assignment)
        runners = [self.runners[name] for name in names]
        return run_stages(runners, work)


def run_ray(
    run: Any,
    address: str | None = None,
    gpus_per_worker: float | None = None,
    stage_workers: dict[str, int] | None = None,
    stage_gpus: dict[str, float] | None = None,
) -> None:
    """The ``ray`` engine (``builder.registry.ENGINES``): plans like the local engine, runs stages on actor pools.

    ``address``: the Ray cluster to join (else ``RAY_ADDRESS``, else a local one); ``gpus_per_worker``: GPUs each
    actor reserves (default 1 on cuda, 0 on cpu); ``stage_workers`` / ``stage_gpus``: per-stage pools
    (``builder.dispatch.plan_pools``; ``{"edit": 4}``, ``{"invert+edit": 4}``), the other stages sharing one pool of
    ``run.options.workers`` actors.
    """
    loop = functools.partial(
        _ray_loop,
        address=address,
        gpus_per_worker=gpus_per_worker,
        stage_workers=stage_workers,
        stage_gpus=stage_gpus,
    )
    _drive(run, loop)


run_ray.preflight = _import_ray  # build() calls an engine's preflight before it writes anything
run_ray.check_options = check_pool_options  # and checks its options against the config


class RayActorPool:
    """``workers`` StageWorker actors serving ``stages`` (taken from the backend: reused across pools); a dead actor
    (``RayActorError``) is replaced by a new one."""

    def __init__(self, backend: RayBackend, stages: list[Any], worked: list[bool], workers: int, gpus: float):
        self._backend = backend
        self._ray = backend.ray
        self.gpus = gpus
        self._assignment = (stages, worked)
        self.actors = [backend.take(gpus) for _ in range(max(1, workers))]
        self.slots = len(self.actors)
        self._fresh = [True] * self.slots  # the slot's next unit carries the assignment

    def submit(self, slot: int, *args: Any) -> Any:
        assignment = self._assignment if self._fresh[slot] else None
        self._fresh[slot] = False
        return self.actors[slot].run.remote(assignment, *args)

    def result(self, handle: Any) -> Any:
        from ray.exceptions import RayActorError, RayTaskError, WorkerCrashedError

        try:
            return self._ray.get(handle)
        except (RayActorError, WorkerCrashedError) as err:
            raise WorkerLost(str(err).splitlines()[0] if str(err) else type(err).__name__) from err
        except RayTaskError as err:
            # Ray wraps the actor's exception; a stage that has not worked yet is handled by the dispatcher.
            if isinstance(getattr(err, "cause", None), StageNotWorking):
                raise err.cause from None
            raise

    def restart(self, slot: int) -> None:
        self._ray.kill(self.actors[slot])
        self.actors[slot] = self._backend.new_actor(self.gpus)
        self._fresh[slot] = True

    def close(self) -> None:
        for actor in self.actors:
            self._backend.give_back(self.gpus, actor)


class RayBackend:
    """Starts ``RayActorPool``s on the connected cluster and waits on the handles of all of them at once. Actors are
    kept between pools (stage-major: the next stage's pool reuses the last one's actors, same GPU reservation) and
    killed when an opening does not need them (their GPUs go to the new pools) or when the build's loop ends.

    Actors are spread over the cluster's nodes (``SPREAD``), so losing a node loses as few of a pool's actors as can be.
    """

    def __init__(self, ray: Any, stages: dict[str, Any], device: str, torch_threads: int, default_gpus: float):
        self.ray = ray
        self._stages = stages
        self._device = device
        self._torch_threads = torch_threads
        self._default_gpus = default_gpus
        self._idle: dict[float, list[Any]] = {}

    def new_actor(self, gpus: float) -> Any:
        actor = self.ray.remote(num_gpus=gpus, num_cpus=1, max_restarts=0, scheduling_strategy="SPREAD")(StageWorker)
        return actor.remote(self._device, self._torch_threads)

    def take(self, gpus: float) -> Any:
        idle = self._idle.get(gpus)
        return idle.pop() if idle else self.new_actor(gpus)

    def give_back(self, gpus: float, actor: Any) -> None:
        actor.release.remote()  # its models go now, not when it is reused
        self._idle.setdefault(gpus, []).append(actor)

    def open_pools(self, specs, worked: dict[str, bool]) -> list[RayActorPool]:
        _warn_if_the_cluster_is_too_small(self.ray, specs, self._default_gpus)
        pools = [
            RayActorPool(
                self,
                [self._stages[name] for name in spec.stages],
                [worked[name] for name in spec.stages],
                spec.workers,
                spec.gpus if spec.gpus is not None else self._default_gpus,
            )
            for spec in specs
        ]
        self.close()  # idle actors no pool took: free their CPUs and GPUs
        return pools

    def wait(self, handles: list[Any]) -> list[Any]:
        ready, _ = self.ray.wait(handles, num_returns=1)
        return ready

    def close(self) -> None:
        for actors in self._idle.values():
            for actor in actors:
                self.ray.kill(actor)
        self._idle.clear()


def _warn_if_the_cluster_is_too_small(ray: Any, specs, default_gpus: float) -> None:
    """Actors that do not fit wait for resources forever (or for an autoscaler): say so instead of hanging quietly."""
    cpus = sum(spec.workers for spec in specs)
    gpus = sum(spec.workers * (spec.gpus if spec.gpus is not None else default_gpus) for spec in specs)
    have = ray.cluster_resources()
    if cpus > have.get("CPU", 0) or gpus > have.get("GPU", 0) + 1e-9:
        logger.warning(
            "the worker pools need %d CPU(s) and %g GPU(s) (1 CPU per actor) but the Ray cluster has %g and %g: "
            "the actors that do not fit wait until resources appear (lower --workers / --stage-workers, or add nodes)",
            cpus,
            gpus,
            have.get("CPU", 0),
            have.get("GPU", 0),
        )


def _ray_loop(
    run: Any,
    *,
    address: str | None,
    gpus_per_worker: float | None,
    stage_workers: dict[str, int] | None,
    stage_gpus: dict[str, float] | None,
) -> None:
    ray = _import_ray()
    if not ray.is_initialized():
        ray.init(address=address, ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
    runners = run.runners
    device = runners[0].device if runners else "cpu"
    gpus = gpus_per_worker if gpus_per_worker is not None else (1 if device.startswith("cuda") else 0)
    pools = plan_pools([r.name for r in runners], stage_workers, stage_gpus, max(1, run.options.workers), gpus)
    logger.info(
        "ray engine: %s",
        "; ".join(f"{'+'.join(p.stages)}: {p.workers} actor(s), {p.gpus} GPU each" for p in pools),
    )
    backend = RayBackend(ray, {r.name: r.validated for r in runners}, device, run.options.torch_threads, gpus)
    counts = run_pools(run, backend, pools)
    if counts.get("worker_losses"):
        logger.warning("ray engine: %d unit(s) lost with their actor and run again", counts["worker_losses"])
