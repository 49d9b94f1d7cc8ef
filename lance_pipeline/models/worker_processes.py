"""Worker processes that start warm: one per device, for the devices build engine and ``lance-cf eval --devices``.

A worker spawned from nothing imports torch and the libraries around it again, 10 to 15 CPU-seconds on a 2-core
machine before its first model loads, and so does every worker started to replace a dead one. Where the platform
has it, workers are started by multiprocessing's fork server instead: one process that imported ``WARM_IMPORTS``
once and forks each worker from there (CUDA-safe: the server never touches a GPU, and a fork, unlike the parent's own,
copies no CUDA context). The server lives as long as the process that started it, so every later build or evaluation
of that process starts its workers from it.

Only libraries that read none of the settings a build depends on when they are imported are warmed: the Hub clients
(huggingface_hub, transformers, diffusers, timm, open_clip) read ``HF_HUB_OFFLINE``, ``HF_HOME`` and the like at
import, and the server's copy would keep the values of the moment it started. Each worker also takes the environment
of the process that starts it, as a spawned one does (``worker_entry``): the fork server's own environment is that of
its start.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

# Imported once by the fork server. torch._dynamo comes with torchvision's operators and with diffusers; scipy,
# scikit-learn and pandas with sentence-transformers (the label check's encoder).
WARM_IMPORTS = ("torch", "torch._dynamo", "torchvision", "scipy.stats", "sklearn.metrics", "pandas")


def worker_context() -> Any:
    """The multiprocessing context device workers start in: the fork server with ``WARM_IMPORTS`` where the platform
    has one (Linux, macOS), else ``spawn``. Start each worker's function through ``worker_entry``."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    # Only read when the server starts (the first worker); a server already running keeps what it imported. The server
    # skips a library that is not installed.
    context.set_forkserver_preload(list(WARM_IMPORTS))
    return context


def worker_entry(function: Callable, *args: Any) -> tuple[Callable, tuple]:
    """``(target, args)`` that run ``function(*args)`` in a worker of ``worker_context()`` (a process's target, or a
    pool's initializer and its arguments) after the worker has taken this process's environment as it is now."""
    return _in_environment, (dict(os.environ), function, *args)


def _in_environment(environment: dict[str, str], function: Callable, *args: Any) -> Any:
    """In the worker: make ``environment`` its own (``os.environ`` and the C library's, which CUDA reads when it
    starts), then run ``function``."""
    for name in set(os.environ) - set(environment):
        del os.environ[name]
    for name, value in environment.items():
        if os.environ.get(name) != value:
            os.environ[name] = value
    return function(*args)
