"""What starting a device worker costs: spawned from nothing, or forked by the fork server that imported torch once
(``lance_pipeline.models.worker_processes``, what the devices engine and ``lance-cf eval --devices`` use).

Each worker, once started, imports the libraries a worker of the demo preset's stages loads (torch, torchvision,
diffusers, transformers, sentence-transformers, open_clip, timm) and reports the CPU seconds its process used
(``getrusage``: a forked process starts at zero). The fork server's own imports are paid once per process that starts
workers (a build, an evaluation, a test session): measured as the same imports in a fresh interpreter. CPU seconds
do not depend on how busy the machine is the way wall seconds do; both are printed.

    python benchmarks/bench_worker_start.py               # 3 workers each way
    python benchmarks/bench_worker_start.py --workers 8
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORKER_LIBRARIES = ("torch", "torchvision", "diffusers", "transformers", "sentence_transformers", "open_clip", "timm")


def _cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def ready_worker(libraries: tuple[str, ...]) -> float:
    """In a worker: import ``libraries`` and return this process's CPU seconds so far."""
    for name in libraries:
        __import__(name)
    return _cpu_seconds(resource.RUSAGE_SELF)


def start_workers(context, count: int) -> tuple[list[float], float]:
    """Start ``count`` one-process pools in ``context`` one after another, as a build replacing workers does; return
    each worker's CPU seconds when ready and the wall seconds of all of them."""
    start = time.perf_counter()
    cpu = []
    for _ in range(count):
        with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
            cpu.append(pool.submit(ready_worker, WORKER_LIBRARIES).result())
    return cpu, time.perf_counter() - start


def server_imports_cpu() -> float:
    """CPU seconds of the fork server's imports, in a fresh interpreter."""
    from lance_pipeline.models.worker_processes import WARM_IMPORTS

    before = _cpu_seconds(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", f"import {', '.join(WARM_IMPORTS)}"], check=True)
    return _cpu_seconds(resource.RUSAGE_CHILDREN) - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=3)
    args = parser.parse_args()
    from lance_pipeline.models.worker_processes import worker_context

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.workers} workers each way")
    spawned, spawned_wall = start_workers(multiprocessing.get_context("spawn"), args.workers)
    server = server_imports_cpu()
    forked, forked_wall = start_workers(worker_context(), args.workers)
    spawned_total, forked_total = sum(spawned), server + sum(forked)
    print(
        f"spawned: {sum(spawned) / len(spawned):.1f} CPU-s per worker, {spawned_total:.1f} in all, {spawned_wall:.1f} s"
    )
    print(
        f"forked by the fork server: {sum(forked) / len(forked):.1f} CPU-s per worker + {server:.1f} once for the "
        f"server = {forked_total:.1f} in all, {forked_wall:.1f} s (server start included)"
    )
    print(f"CPU ratio spawned / forked: {spawned_total / forked_total:.2f}x")


if __name__ == "__main__":
    main()
