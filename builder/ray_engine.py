"""The Ray engine: the same build, with the stages of several batches running at once on Ray actors.

The driver keeps everything that decides the release's bytes: the plan, decoding, the ledger and emission. Each
actor loads the stages' models once, with the same torch settings as a local build (intra-op threads, CUDA
determinism: ``builder.runtime.torch_settings``), and runs the unfinished stages of whole batches (batch composition
is fixed by the plan, so results do not depend on which actor ran them). The driver commits each batch's stage
outputs and release samples as results arrive, in whatever order, so a killed Ray build resumes like a local one and
the shards (written in key order from the ledger) are byte-identical to a local build's.

Connects to ``--ray-address`` (or the cluster named by ``RAY_ADDRESS``) when set, else starts a local one. The\nloop that feeds actors and commits their results, with retries of batches whose actor died, is\n``builder.dispatch`` (shared with the ``devices`` engine).
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
    address: str | None = None,
    gpus_per_worker: float | None = None,
) -> None:
    """The ``ray`` engine (``builder.registry.ENGINES``): plans like the local engine, runs batches on actors.

    ``address``: the Ray cluster to join (else ``RAY_ADDRESS``, else a local one); ``gpus_per_worker``: GPUs each
    actor reserves (default 1 on cuda, 0 on cpu).
    """
    from builder.engine import _drive

    remote = functools.partial(
        _ray_loop, workers=workers, torch_threads=torch_threads, address=address, gpus_per_worker=gpus_per_worker
    )
    _drive(validated, source, plan, ledger, runners, progress, schedule, remote=remote)


run_ray.preflight = _import_ray  # build() calls an engine's preflight before it writes anything


class RayActorPool:
    """``workers`` StageWorker actors; a dead actor (``RayActorError``) is replaced by a new one."""

    def __init__(
        self,
        ray: Any,
        stages: list[Any],
        device: str,
        torch_threads: int,
        worked: list[bool],
        workers: int,
        gpus: float,
    ):
        self._ray = ray
        self._make = lambda: ray.remote(num_gpus=gpus, num_cpus=1, max_restarts=0)(StageWorker).remote(
            stages, device, torch_threads, worked
        )
        self.actors = [self._make() for _ in range(max(1, workers))]
        self.slots = len(self.actors)

    def submit(self, slot: int, *args: Any) -> Any:
        return self.actors[slot].run.remote(*args)

    def wait(self, handles: list[Any]) -> list[Any]:
        ready, _ = self._ray.wait(handles, num_returns=1)
        return ready

    def result(self, handle: Any) -> Any:
        from ray.exceptions import RayActorError, RayTaskError, WorkerCrashedError

        from builder.dispatch import WorkerLost
        from builder.engine import StageNotWorking

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
        self.actors[slot] = self._make()

    def close(self) -> None:
        for actor in self.actors:
            self._ray.kill(actor)


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
    address: str | None = None,
    gpus_per_worker: float | None = None,
) -> None:
    from builder.dispatch import dispatch

    ray = _import_ray()
    if not ray.is_initialized():
        ray.init(address=address, ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
    device = runners[0].device if runners else "cpu"
    gpus = gpus_per_worker if gpus_per_worker is not None else (1 if device.startswith("cuda") else 0)
    stages = [r.validated for r in runners]
    worked = [r.ever_succeeded for r in runners]
    counts = dispatch(
        validated,
        todo,
        decode,
        ledger,
        runners,
        label_names,
        bar,
        lambda: RayActorPool(ray, stages, device, torch_threads, worked, workers, gpus),
    )
    if counts["worker_losses"]:
        logger.warning("ray engine: %d batch run(s) lost with their actor and run again", counts["worker_losses"])
