"""The ``devices`` engine: one worker process per device on one machine, without Ray.

``lance-cf build ... --devices cuda:0,cuda:1,cuda:2,cuda:3`` starts one process per listed device (a device may be
listed twice, e.g. ``cpu,cpu`` for two CPU workers, or ``cuda:0,cuda:0`` for two workers sharing a large GPU). Each
process loads every active stage once (or, with ``--stage-workers``, its pool's stages), on its device, under the
build's torch settings (``--torch-threads``, CUDA determinism: ``builder.runtime.torch_settings``), and runs those
stages over whole batches (``builder.dispatch``: pools, schedules, faults); the driver owns the plan,
the ledger and the shards (``builder.dispatch``), so the release is byte-identical to a one-device build with the
same thread settings on the same kind of device. A worker process that dies loses only the batch it was running,
which goes to the next free worker; the dead worker is replaced (one that dies between two batches is replaced before
its next batch, and no batch is charged with its death).

Processes are started from a fork server that imported torch once (``lance_pipeline.models.worker_processes``; CUDA
cannot be used in a child forked from the driver), or spawned where there is none, so the stage classes must be
importable by name (they are: a stage type is a registry name or a ``module:attr``).
"""

from __future__ import annotations

import functools
import logging
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from builder.dispatch import WorkerLost, check_pool_options, plan_pools, run_pools
from builder.engine import _drive
from builder.ray_engine import StageWorker
from lance_pipeline.models.devices import resolve_device
from lance_pipeline.models.worker_processes import worker_context, worker_entry

logger = logging.getLogger(__name__)

_WORKER = None  # the StageWorker of this worker process (set by _init_worker)


def parse_devices(text: str) -> list[str]:
    """``"cuda:0,cuda:1"`` -> ``["cuda:0", "cuda:1"]``, each checked against this machine (one-line errors)."""
    names = [part.strip() for part in str(text).split(",")]
    if not names or any(not name for name in names):
        raise ValueError(f"--devices {text!r}: expected a comma-separated list such as cuda:0,cuda:1 or cpu,cpu")
    resolved = []
    for name in names:
        try:
            resolved.append(resolve_device(name))
        except ValueError as err:
            raise ValueError(f"--devices {text}: {str(err).removeprefix('--device ')}") from None
    return resolved


def _init_worker(device: str, torch_threads: int) -> None:
    global _WORKER

    _WORKER = StageWorker(device, torch_threads)


def _run_on_worker(*args: Any) -> Any:
    return _WORKER.run(*args)


def _release_on_worker() -> None:
    _WORKER.release()


class DevicePool:
    """One single-process executor per worker (taken from the backend: reused across pools); a dead process breaks
    only its own executor, which is replaced."""

    def __init__(self, backend: DeviceBackend, devices: list[str], stages: list[Any], worked: list[bool]):
        self._backend = backend
        self.devices = list(devices)
        self.slots = len(self.devices)
        self._assignment = (stages, worked)
        self._executors = [backend.take(device) for device in self.devices]
        self._fresh = [True] * self.slots  # the slot's next unit carries the assignment

    def submit(self, slot: int, *args: Any) -> Any:
        try:
            return self._submit(slot, *args)
        except BrokenProcessPool as err:
            # The worker died while idle (after its last unit, before this one): no batch was running on it, so none
            # is charged with the loss; a fresh worker takes the unit.
            logger.warning("worker %d on %s died while idle (%s); replaced", slot, self.devices[slot], err)
            self.restart(slot)
            return self._submit(slot, *args)

    def _submit(self, slot: int, *args: Any) -> Any:
        assignment = self._assignment if self._fresh[slot] else None
        self._fresh[slot] = False
        return self._executors[slot].submit(_run_on_worker, assignment, *args)

    def result(self, handle: Any) -> Any:
        try:
            return handle.result()
        except BrokenProcessPool as err:
            raise WorkerLost(f"worker process gone ({err})") from err

    def restart(self, slot: int) -> None:
        self._executors[slot].shutdown(wait=False, cancel_futures=True)
        self._executors[slot] = self._backend.new_executor(self.devices[slot])
        self._fresh[slot] = True

    def close(self) -> None:
        for device, executor in zip(self.devices, self._executors, strict=True):
            self._backend.give_back(device, executor)


class DeviceBackend:
    """Starts ``DevicePool``s, dealing the listed devices to their workers in order (cycling when there are more
    workers than devices): pools opened together take consecutive devices, each opening starts again at the first.
    Worker processes are kept between pools (stage-major: the next stage's pool reuses the last one's processes on
    the same devices, after they dropped their models) and stopped when an opening does not need them or when the
    build's loop ends."""

    def __init__(self, devices: list[str], stages: dict[str, Any], torch_threads: int):
        self._devices = list(devices)
        self._stages = stages
        self._torch_threads = torch_threads
        self._context = worker_context()
        self._idle: dict[str, list[ProcessPoolExecutor]] = {}

    def new_executor(self, device: str) -> ProcessPoolExecutor:
        initializer, initargs = worker_entry(_init_worker, device, self._torch_threads)
        return ProcessPoolExecutor(max_workers=1, mp_context=self._context, initializer=initializer, initargs=initargs)

    def take(self, device: str) -> ProcessPoolExecutor:
        idle = self._idle.get(device)
        return idle.pop() if idle else self.new_executor(device)

    def give_back(self, device: str, executor: ProcessPoolExecutor) -> None:
        try:
            executor.submit(_release_on_worker)  # its models go now, not when it is reused
        except RuntimeError as err:  # a dead (BrokenProcessPool, a RuntimeError) or shut-down worker is not kept
            if isinstance(err, BrokenProcessPool):
                # It died after its pool's last unit: nothing was lost, and the next pool starts a fresh worker.
                logger.warning("worker on %s died while idle (%s); not kept for the next stage", device, err)
            executor.shutdown(wait=False, cancel_futures=True)
            return
        self._idle.setdefault(device, []).append(executor)

    def open_pools(self, specs, worked: dict[str, bool]) -> list[DevicePool]:
        pools, dealt = [], 0
        for spec in specs:
            devices = [self._devices[(dealt + i) % len(self._devices)] for i in range(spec.workers)]
            dealt += spec.workers
            logger.info("devices engine: %s on %s", "+".join(spec.stages), ", ".join(devices))
            pools.append(
                DevicePool(
                    self, devices, [self._stages[name] for name in spec.stages], [worked[name] for name in spec.stages]
                )
            )
        self.close()  # idle processes no pool took: free their devices
        return pools

    def wait(self, handles: list[Any]) -> list[Any]:
        done, _ = wait(handles, return_when=FIRST_COMPLETED)
        return list(done)

    def close(self) -> None:
        for executors in self._idle.values():
            for executor in executors:
                executor.shutdown(wait=True, cancel_futures=True)
        self._idle.clear()


def run_devices(run: Any, devices: list[str] | None = None, stage_workers: dict[str, int] | None = None) -> None:
    """The ``devices`` engine (``builder.registry.ENGINES``): ``devices`` lists one device per worker process
    (default: ``run.options.workers`` processes on the build's device); ``stage_workers`` gives stages pools of their
    own (``builder.dispatch.plan_pools``; the other stages share one pool of ``len(devices)`` workers)."""
    if not devices:
        devices = [run.runners[0].device if run.runners else "cpu"] * max(1, run.options.workers)
    _drive(run, functools.partial(_devices_loop, devices=list(devices), stage_workers=stage_workers))


run_devices.check_options = check_pool_options  # build() checks the options against the config first


def _devices_loop(run: Any, *, devices: list[str], stage_workers: dict[str, int] | None) -> None:
    runners = run.runners
    pools = plan_pools([r.name for r in runners], stage_workers, None, len(devices), None)
    backend = DeviceBackend(devices, {r.name: r.validated for r in runners}, run.options.torch_threads)
    counts = run_pools(run, backend, pools)
    if counts.get("worker_losses"):
        logger.warning("devices engine: %d unit(s) lost with their worker and run again", counts["worker_losses"])
