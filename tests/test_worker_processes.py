"""Device workers start warm: forked from a fork server that imported torch once, each in the environment of the
process that starts it now, not the server's (``lance_pipeline.models.worker_processes``). The engines that use them
prove the rest on real builds: tests/test_scale.py (a worker forked by the server killed mid-build) and
tests/test_eval_options.py (two evaluation workers)."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest
import worker_probe

from lance_pipeline.models.worker_processes import WARM_IMPORTS, worker_context, worker_entry

pytestmark = [
    pytest.mark.slow,  # the fork server's imports: about 10 CPU-seconds, once per test process
    pytest.mark.skipif(
        "forkserver" not in multiprocessing.get_all_start_methods(), reason="this platform has no fork server: spawn"
    ),
]

PROBED = ["LANCE_CF_WORKER_PROBE", "LANCE_CF_WORKER_PROBE_GONE"]


def start_and_report() -> dict:
    """One worker as the devices engine starts its workers (context, initializer through ``worker_entry``), and what it
    reports."""
    initializer, initargs = worker_entry(worker_probe.enter, list(WARM_IMPORTS))
    with ProcessPoolExecutor(
        max_workers=1, mp_context=worker_context(), initializer=initializer, initargs=initargs
    ) as pool:
        return pool.submit(worker_probe.report, PROBED).result()


def test_workers_are_forked_warm_by_one_server_in_the_environment_of_their_start(monkeypatch):
    monkeypatch.setenv("LANCE_CF_WORKER_PROBE", "first")
    monkeypatch.setenv("LANCE_CF_WORKER_PROBE_GONE", "set")
    first = start_and_report()
    # After the server is running: a changed variable and a removed one reach the next worker as they are now.
    monkeypatch.setenv("LANCE_CF_WORKER_PROBE", "second")
    monkeypatch.delenv("LANCE_CF_WORKER_PROBE_GONE")
    second = start_and_report()

    assert worker_context().get_start_method() == "forkserver"
    assert first["warm"] == second["warm"] == list(WARM_IMPORTS)  # imported before the worker's own first line
    assert first["parent"] == second["parent"] != os.getpid()  # both forked by one server, not by this process
    assert first["pid"] != second["pid"]
    assert first["environment"] == {"LANCE_CF_WORKER_PROBE": "first", "LANCE_CF_WORKER_PROBE_GONE": "set"}
    assert second["environment"] == {"LANCE_CF_WORKER_PROBE": "second", "LANCE_CF_WORKER_PROBE_GONE": None}
