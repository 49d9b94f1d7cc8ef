"""A worker process's first moments, for tests/test_worker_processes.py: which libraries it had before it imported
anything, whose environment it runs in, and which process started it. Imports nothing at the top, so what it reports
as already imported came with the process."""

import os
import sys

WARM_AT_START: list[str] = []


def enter(environment: dict[str, str], names: list[str]) -> None:
    """The worker's initializer: note which of ``names`` it has already, then take ``environment``."""
    WARM_AT_START[:] = [name for name in names if name in sys.modules]
    from lance_pipeline.models.worker_processes import enter_worker_environment

    enter_worker_environment(environment)


def report(variables: list[str]) -> dict:
    return {
        "warm": list(WARM_AT_START),
        "environment": {name: os.environ.get(name) for name in variables},
        "pid": os.getpid(),
        "parent": os.getppid(),
    }
