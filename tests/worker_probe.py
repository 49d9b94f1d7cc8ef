"""A worker process's first moments, for tests/test_worker_processes.py: which libraries it had before it imported
anything, whose environment it runs in, and which process started it. Imports nothing at the top, so what it reports
as already imported came with the process."""

import os
import sys

WARM_AT_START: list[str] = []


def enter(names: list[str]) -> None:
    """The worker's initializer: note which of ``names`` it has already."""
    WARM_AT_START[:] = [name for name in names if name in sys.modules]


def report(variables: list[str]) -> dict:
    return {
        "warm": list(WARM_AT_START),
        "environment": {name: os.environ.get(name) for name in variables},
        "pid": os.getpid(),
        "parent": os.getppid(),
    }
