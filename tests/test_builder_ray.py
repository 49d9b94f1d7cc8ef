"""The Ray engine gives the local engine's bytes: per-stage actor pools, per-stage batch sizes, both schedules, an
actor killed by pid and a whole node removed mid-build; a missing Ray extra is a one-line install hint.

One Ray cluster serves the module: a head node (``ray.cluster_utils.Cluster``) that holds every pool of the first
tests. The node-removal test adds a second node (its own raylet, on this machine) and removes it mid-build; nothing
else needs it, so it is not added back. The cluster runs without the autoscaler's monitor and the log monitors (no
test reads an actor's output on the driver: an actor's exception comes back with its result).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time

import pytest
from builder_helpers import (
    ALL_CONFIGS,
    FAKE_STAGES,
    REPO,
    build_killing_one_worker,
    build_while,
    cli,
    cmdline,
    demo_config,
    make_imagefolder,
    release_files,
    stored_stage_outputs,
    write_config,
)

from builder.config import load_config
from builder.engine import build
from builder.release_format.verify import verify_release

pytestmark = pytest.mark.slow  # starts Ray
# The tests on a cluster are end to end (marked e2e): a head node's daemons, a second node's raylet, actors in
# processes of their own. The missing extra's one-line hint needs no cluster and stays in `make test`.

HAS_RAY = importlib.util.find_spec("ray") is not None
needs_ray = pytest.mark.skipif(not HAS_RAY, reason="the [ray] extra is not installed")
HEAD_CPUS = 3  # logical CPUs of the head node: the pools of these tests need at most 3 actors of 1 CPU
NODE_CPUS = 2  # of the second node the node-removal test adds: one of its two actors lands there (SPREAD)
# Processes a node needs for none of these tests: the autoscaler's monitor (head) and a log monitor per node, which
# streams actors' output to the driver (log_to_driver is off) and polls their log files meanwhile.
LEAN_NODE = {"include_log_monitor": False}


@pytest.fixture(scope="module")
def ray_cluster():
    import ray
    from ray.cluster_utils import Cluster

    # A dead node is noticed within about a second (the default health check takes ~30 s). No worker processes are
    # started ahead of the driver's first task: the actors start their own, and the prestarted ones stayed idle.
    # Actors run at the driver's priority: Ray starts its workers at niceness 15, and on a machine busy with other
    # work (the other test worker, other jobs) they got about a hundredth of a core each, and one build ran for over
    # half an hour.
    system = {
        "worker_niceness": 0,
        "health_check_period_ms": 500,
        "health_check_failure_threshold": 2,
        "health_check_initial_delay_ms": 0,
        "prestart_worker_first_driver": False,
    }
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": HEAD_CPUS,
            "include_dashboard": False,
            "no_monitor": True,
            "_system_config": system,
            **LEAN_NODE,
        },
    )
    # Actors import the stages (tests.fake_stages, demo components) like the driver: same path, same caches.
    env_vars = {
        name: os.environ[name]
        for name in ("LANCE_CF_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
        if name in os.environ
    }
    ray.init(
        address=cluster.address,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO), **env_vars}},
        log_to_driver=False,
    )
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.e2e
@needs_ray
def test_ray_pools_and_stage_batch_sizes_give_the_local_bytes_with_errors_and_deferral(ray_cluster, tmp_path):
    """Fake stages whose edit output depends on a record's position in its call, with ``batch_size: 1`` on the edit
    stage and batches of two: the sub-batches are the same on Ray. The first batch breaks the caption stage on both
    samples: deferred until the stage has worked on another batch, then recorded as errors, as locally."""
    src = make_imagefolder(tmp_path / "src", ["a", "b", "c"], per_class=3)
    caption = FAKE_STAGES[0] | {"options": {"fail_keys": ["a_img_000", "a_img_001", "b_img_001"]}}
    stages = [caption, FAKE_STAGES[1] | {"batch_size": 1}]
    cfg = load_config(
        str(write_config(tmp_path / "c.yaml", f"imagefolder:{src}", stages=stages, configs=ALL_CONFIGS, batch_size=2))
    )
    build(cfg, tmp_path / "local", progress=False)
    build(cfg, tmp_path / "ray", progress=False, engine="ray", workers=2)  # one pool of two actors, whole batches
    assert verify_release(tmp_path / "ray") == []
    manifest = json.loads((tmp_path / "ray" / "manifest.json").read_text())
    assert [e["source_key"] for e in manifest["build"]["errors"]] == ["a_img_000", "a_img_001", "b_img_001"]
    assert release_files(tmp_path / "ray") == release_files(tmp_path / "local")


def test_missing_ray_extra_names_the_install_command(tmp_path):
    src = make_imagefolder(tmp_path / "src", ["a"], per_class=1)
    cfg = write_config(tmp_path / "c.yaml", f"imagefolder:{src}", stages=FAKE_STAGES, configs=ALL_CONFIGS)
    # Hide ray from the subprocess, whether or not it is installed here.
    (tmp_path / "shadow").mkdir()
    (tmp_path / "shadow" / "ray.py").write_text("raise ImportError('No module named ray')\n")

    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{tmp_path / 'shadow'}{os.pathsep}{env_path}"
    try:
        proc = cli(
            "build", str(cfg), "--output", str(tmp_path / "out"), "--engine", "ray", check=False, process=True
        )  # the shadowing PYTHONPATH acts on a new process only
    finally:
        os.environ["PYTHONPATH"] = env_path
    assert proc.returncode == 2
    assert "pip install 'lance-counterfactuals[ray]'" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.e2e
@needs_ray
def test_per_stage_pools_on_the_demo_stages_with_an_actor_killed_give_the_local_bytes(
    ray_cluster, local_demo, tmp_path, caplog
):
    """The demo preset's real tiny stages: the edit stage in a pool of two actors, the other seven stages in a pool of
    one (a pipeline: batches in different stages at once). An actor running a unit is killed by pid once a batch is
    done; its unit is retried on a new actor of its pool and the release is byte-identical to the local engine's."""
    out = tmp_path / "ray"
    caplog.set_level(logging.WARNING, logger="builder.dispatch")
    killed = build_killing_one_worker(
        out,
        # An actor running a unit now (Ray titles it so): not one being stopped, nor one that stays idle.
        lambda p: "ray::StageWorker.run" in cmdline(p),
        min_workers=1,
        engine="ray",
        workers=1,
        engine_options={"stage_workers": {"edit": 2}},
    )
    assert killed, "the build ended before an actor could be killed"
    assert any("died running batch" in r.getMessage() for r in caplog.records), "no unit was retried"
    assert verify_release(out) == []
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["build"]["torch_threads"] == 1
    assert "scheduler" in manifest["stages"]["invert"]  # described where it ran, with its models loaded
    assert release_files(out) == release_files(local_demo)


@pytest.mark.e2e
@needs_ray
def test_stage_major_on_two_nodes_with_one_node_removed_gives_the_local_bytes(
    ray_cluster, local_demo, tmp_path, caplog
):
    """Stage-major on Ray (one stage's pool of two actors at a time, spread over the two nodes): once the first stage
    results are committed the second node is removed (its raylet and every actor on it killed, no drain); the lost
    units run again on the head node and the release is byte-identical to the local engine's batch-major build."""
    import ray

    out = tmp_path / "ray"
    caplog.set_level(logging.WARNING, logger="builder.dispatch")
    node = ray_cluster.add_node(num_cpus=NODE_CPUS, **LEAN_NODE)
    ray_cluster.wait_for_nodes()
    # Every CPU free before the build asks for its two actors (the actors of an earlier test are killed asynchronously):
    # SPREAD then puts one on each node, so removing the second node loses a running unit.
    while ray.available_resources().get("CPU", 0) < HEAD_CPUS + NODE_CPUS:
        time.sleep(0.2)  # a polling interval, not a limit: a busy machine only makes the earlier actors slower to go

    def remove_node() -> bool:
        if stored_stage_outputs(out) < 1:
            return False
        ray_cluster.remove_node(node, allow_graceful=False)
        return True

    try:
        removed = build_while(demo_config(), out, remove_node, engine="ray", workers=2, schedule="stage-major")
    finally:
        if node in ray_cluster.worker_nodes:
            ray_cluster.remove_node(node)  # the build ended first: the next test gets the head node alone
    assert removed, "the build ended before the node could be removed"
    assert any("died running batch" in r.getMessage() for r in caplog.records), "no unit was retried"
    assert verify_release(out) == []
    assert release_files(out) == release_files(local_demo)
