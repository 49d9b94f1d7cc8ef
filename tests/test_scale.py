"""Scale: the devices engine (one process per device, per-stage pools, both schedules) gives the local engine's bytes,
also when a worker is killed mid-build; on fake stages and on the demo preset's real tiny stages. The Ray engine's
tests are in tests/test_builder_ray.py (one Ray cluster for all of them)."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import sqlite3
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import pytest
from builder_helpers import (
    ALL_CONFIGS,
    DEMO_LIMIT,
    FAKE_STAGES,
    build_killing_one_worker,
    cmdline,
    demo_config,
    make_imagefolder,
    release_files,
    stored_stage_outputs,
    write_config,
)

from builder import multi_device
from builder.config import load_config
from builder.engine import build
from builder.release_format.verify import verify_release


@pytest.mark.e2e  # starts worker processes (the devices engine)
def test_devices_engine_pools_stage_batch_sizes_and_stage_major_give_the_local_bytes(tmp_path):
    """Fake stages whose edit output depends on a record's position in its call: a stage's ``batch_size`` (records
    per call) changes the bytes, so it is config, and every engine, pool layout and schedule honours it identically.
    Batches of two; the caption stage raises on both samples of the first batch (deferred until the stage works on
    another batch, then recorded as errors) and on one more, as the local engine does."""
    src = make_imagefolder(tmp_path / "src", ["a", "b", "c"], per_class=3)
    caption = FAKE_STAGES[0] | {"options": {"fail_keys": ["a_img_000", "a_img_001", "b_img_001"]}}
    fields = {"configs": ALL_CONFIGS, "batch_size": 2}
    cfg = load_config(
        str(
            write_config(
                tmp_path / "c.yaml",
                f"imagefolder:{src}",
                stages=[caption, FAKE_STAGES[1] | {"batch_size": 1}],
                **fields,
            )
        )
    )
    whole = load_config(
        str(write_config(tmp_path / "w.yaml", f"imagefolder:{src}", stages=[caption, FAKE_STAGES[1]], **fields))
    )
    assert cfg.config_hash() != whole.config_hash() and "batch_size" not in whole.to_dict()["stages"][1]
    build(cfg, tmp_path / "local", progress=False)
    build(whole, tmp_path / "whole", progress=False)
    assert release_files(tmp_path / "whole") != release_files(tmp_path / "local")  # the sub-batches took effect
    # caption in a pool of one worker process, edit in a pool of two (a pipeline); then stage-major on one device.
    pools = {"devices": ["cpu", "cpu"], "stage_workers": {"caption": 1}}
    build(cfg, tmp_path / "pools", progress=False, engine="devices", engine_options=pools)
    build(
        cfg,
        tmp_path / "stage",
        progress=False,
        engine="devices",
        engine_options={"devices": ["cpu"]},
        schedule="stage-major",
    )
    for out in ("pools", "stage"):
        assert verify_release(tmp_path / out) == []
        manifest = json.loads((tmp_path / out / "manifest.json").read_text())
        assert [e["source_key"] for e in manifest["build"]["errors"]] == ["a_img_000", "a_img_001", "b_img_001"]
        assert manifest["config"]["stages"][1]["batch_size"] == 1
        assert release_files(tmp_path / out) == release_files(tmp_path / "local"), out


def test_device_lists_and_engine_options_are_checked_before_anything_is_written(tmp_path, capsys):
    from builder.cli import main

    src = make_imagefolder(tmp_path / "src", ["a"], per_class=1)
    cfg = write_config(tmp_path / "c.yaml", f"imagefolder:{src}", stages=FAKE_STAGES, configs=ALL_CONFIGS)
    out = tmp_path / "out"
    for flags, expected in (
        (["--devices", "cpu,,cpu"], "--devices 'cpu,,cpu': expected a comma-separated list"),
        (["--devices", "cuda:0,cuda:1"], "no CUDA GPU is visible"),
        (["--devices", "cpu,cpu", "--engine", "ray"], "--devices runs the devices engine, not ray"),
        (["--ray-address", "auto"], "--ray-address is for --engine ray"),
        (["--engine", "devices", "--gpus-per-worker", "1"], "--gpus-per-worker is for --engine ray"),
        (["--devices", "cpu,cpu", "--stage-workers", "edt=2"], "the config has no stage 'edt'; did you mean 'edit'?"),
        (["--devices", "cpu,cpu", "--stage-workers", "edit=0"], "'0' for edit is not a positive integer"),
        (["--devices", "cpu,cpu", "--stage-workers", "edit"], "expected STAGE=VALUE[,STAGE=VALUE...]"),
        (["--devices", "cpu,cpu", "--stage-workers", "edit=1,caption+edit=2"], "stage 'edit' is named twice"),
        (["--stage-workers", "edit=2"], "--stage-workers is for --engine ray or --devices"),
        (["--devices", "cpu,cpu", "--stage-gpus", "edit=1"], "--stage-gpus is for --engine ray"),
    ):
        code = main(["build", str(cfg), "--output", str(out), "--no-progress", *flags])
        err = capsys.readouterr().err
        assert code == 2, (flags, err)
        assert expected in err and err.count("\n") == 1, (flags, err)
        assert not out.exists()
    with pytest.raises(ValueError, match="the local engine takes no option devices"):
        build(load_config(str(cfg)), out, progress=False, engine_options={"devices": ["cpu"]})
    with pytest.raises(ValueError, match="--stage-workers: 0 for edit is not a positive integer"):
        build(
            load_config(str(cfg)),
            out,
            engine="devices",
            engine_options={"devices": ["cpu"], "stage_workers": {"edit": 0}},
        )
    assert not out.exists()


@pytest.mark.slow  # builds the demo preset's real tiny stages (minutes on a loaded 2-core machine)
def test_stage_major_gives_the_batch_major_bytes_on_the_demo_stages_and_resumes(local_demo, tmp_path, monkeypatch):
    from builder.registry import STAGES

    # A stage-major build interrupted in its third stage (every batch has passed the first two) ...
    label_check = STAGES.resolve("label_check")
    real_process = label_check.process
    calls = {"n": 0}

    def interrupted(self, records):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # like Ctrl-C: not a per-sample error, the build stops
        return real_process(self, records)

    monkeypatch.setattr(label_check, "process", interrupted)
    out = tmp_path / "stage-major"
    with pytest.raises(KeyboardInterrupt):
        build(demo_config(), out, device="cpu", progress=False, schedule="stage-major")
    with sqlite3.connect(out / ".lance-cf" / "ledger.sqlite") as db:
        stored = dict(db.execute("SELECT stage, COUNT(*) FROM stage_outputs GROUP BY stage").fetchall())
    assert stored.get("caption") == stored.get("perturb") == DEMO_LIMIT and stored.get("label_check") == 1
    monkeypatch.setattr(label_check, "process", real_process)
    # ... resumes (stage-major again) from the ledger and writes the batch-major build's bytes.
    build(demo_config(), out, device="cpu", progress=False, schedule="stage-major")
    assert verify_release(out) == []
    assert release_files(out) == release_files(local_demo)


@pytest.mark.slow  # builds the demo preset's real tiny stages (minutes on a loaded 2-core machine)
def test_keep_inversions_no_drops_done_batches_inversions_and_resumes_to_the_same_bytes(
    local_demo, tmp_path, monkeypatch
):
    from builder.registry import STAGES

    edit = STAGES.resolve("prompt_to_prompt_edit")
    real_process = edit.process
    calls = {"n": 0}

    def interrupted(self, records):
        if type(self) is edit:
            calls["n"] += 1
            if calls["n"] == 3:  # batches 0 and 1 are done, batch 2 is inverted but not edited
                raise KeyboardInterrupt
        return real_process(self, records)

    monkeypatch.setattr(edit, "process", interrupted)
    out = tmp_path / "dropped"
    with pytest.raises(KeyboardInterrupt):
        build(demo_config(), out, device="cpu", progress=False, keep_inversions=False)
    ledger = out / ".lance-cf" / "ledger.sqlite"
    query = "SELECT p.batch FROM stage_outputs s JOIN plan p USING (source_key) WHERE s.stage=? ORDER BY p.batch"
    with sqlite3.connect(ledger) as db:
        assert [r[0] for r in db.execute(query, ("invert",))] == [2]  # only the unfinished batch keeps its inversion
        assert [r[0] for r in db.execute(query, ("reconstruct",))] == [0, 1, 2]
    monkeypatch.setattr(edit, "process", real_process)
    build(demo_config(), out, device="cpu", progress=False, keep_inversions=False)
    with sqlite3.connect(ledger) as db:
        assert db.execute(query, ("invert",)).fetchall() == []
    assert verify_release(out) == []
    assert release_files(out) == release_files(local_demo)


def is_device_worker(process) -> bool:
    """A devices-engine worker process: one the fork server forked (the server is its parent, and it keeps the
    server's command line), or, where the platform has no fork server, a spawned one. A build whose workers were
    spawned where a fork server exists has no worker this finds."""
    import psutil

    line = cmdline(process)
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "multiprocessing" in line and "spawn_main" in line
    if "multiprocessing.forkserver" not in line:
        return False
    try:
        parent = process.parent()
    except psutil.Error:
        return False
    return parent is not None and "multiprocessing.forkserver" in cmdline(parent)


@pytest.mark.slow  # builds the demo preset's real tiny stages (minutes on a loaded 2-core machine)
def test_a_device_worker_killed_mid_build_stage_major_on_two_cpu_workers_loses_nothing_and_the_bytes_match(
    local_demo, tmp_path, caplog
):
    """Stage-major on two CPU device workers (each stage's pool of two at a time, the processes handed from stage to
    stage), one of them killed once the first stage results are committed: the release is the local engine's
    batch-major build, byte for byte. One build proves both that the devices engine's stage-major schedule gives the
    local bytes and that a killed worker loses nothing (a fault-free stage-major build on two workers was a second
    demo build proving the first half again). The batch-major devices engine on real stages with two workers:
    tests/test_instruct_editing.py; batch-major per-stage pools losing a worker on the demo stages (the same
    dispatcher): tests/test_builder_ray.py."""
    out = tmp_path / "killed"
    caplog.set_level(logging.WARNING, logger="builder.dispatch")
    caplog.set_level(logging.WARNING, logger="builder.multi_device")
    killed = build_killing_one_worker(
        out,
        is_device_worker,
        progress=stored_stage_outputs,  # stage-major finishes no batch before its last stage
        engine="devices",
        engine_options={"devices": ["cpu", "cpu"]},
        schedule="stage-major",
    )
    assert killed, "the build ended before a worker could be killed"
    # The worker may die under a unit (which is retried), between two (it is replaced before its next one) or after
    # its stage's last unit (it is not kept for the next stage): each is logged.
    replaced = [
        r.getMessage()
        for r in caplog.records
        if "died running batch" in r.getMessage() or "died while idle" in r.getMessage()
    ]
    assert replaced, "no worker was replaced"
    assert verify_release(out) == []
    assert release_files(out) == release_files(local_demo)


class _EchoWorker:
    def run(self, assignment, *args):
        return (assignment, *args)


def _start_echo_worker(device, torch_threads):
    multi_device._WORKER = _EchoWorker()


class _ForkBackend:
    """Executors as the devices engine makes them, forked instead of spawned so that the test's worker needs no
    import by name."""

    def take(self, device):
        return self.new_executor(device)

    def new_executor(self, device):
        return ProcessPoolExecutor(
            max_workers=1,
            mp_context=multiprocessing.get_context("fork"),
            initializer=_start_echo_worker,
            initargs=(device, 1),
        )


# A stage worker's release, in a process of its own (it freezes what survives, which the test process must not).
_RELEASE_SCRIPT = """
import gc, json, weakref
from builder.ray_engine import StageWorker

class Model:  # a model in a reference cycle (as a network whose attention processors point back at it)
    def __init__(self):
        self.me = self

class Runner:
    def __init__(self):
        self.model = Model()

    def release(self):
        self.model = None

worker = StageWorker("cpu", 1)
gc.disable()  # only the worker's own collections run
full = []
gc.callbacks.append(lambda phase, info: full.append(1) if phase == "start" and info["generation"] == 2 else None)
worker.release()
seen = {"idle": len(full)}
for stage in ("first", "second"):
    runner = Runner()
    model = weakref.ref(runner.model)
    worker.runners = {stage: runner}
    del runner
    worker.release()
    seen[stage] = {"freed": model() is None, "tracked": len(gc.get_objects()), "frozen": gc.get_freeze_count()}
seen["collections"] = len(full)
print(json.dumps(seen))
"""


@pytest.mark.slow  # a process importing torch
def test_a_released_worker_frees_each_stages_models_and_walks_the_libraries_once():
    """A worker's release collects the cyclic garbage its stages' models leave, then freezes the survivors (the
    libraries, the worker): the next stage's models are still collected at their release, and each later collection
    walks only what was made since. A worker holding nothing collects nothing."""
    import subprocess
    import sys

    from builder_helpers import REPO

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _RELEASE_SCRIPT], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen["idle"] == 0 and seen["collections"] == 2, seen
    assert seen["first"]["freed"] and seen["second"]["freed"], seen  # a frozen worker still frees the next models
    second = seen["second"]
    assert second["frozen"] > 10_000 and second["tracked"] < second["frozen"] / 10, seen  # torch is out of the walk


@pytest.mark.e2e  # starts worker processes
def test_a_worker_that_died_while_idle_is_replaced_before_its_next_unit_and_gets_the_assignment(caplog):
    caplog.set_level(logging.WARNING, logger="builder.multi_device")
    pool = multi_device.DevicePool(_ForkBackend(), ["cpu"], ["stage"], [False])
    try:
        assert pool.result(pool.submit(0, "first")) == ((["stage"], [False]), "first")
        died = pool._executors[0].submit(os._exit, 1)  # the worker dies between two units
        with pytest.raises(BrokenProcessPool):
            died.result()
        # The next unit runs on a fresh worker, which (like any fresh worker) receives the pool's assignment.
        assert pool.result(pool.submit(0, "second")) == ((["stage"], [False]), "second")
        assert pool.result(pool.submit(0, "third")) == (None, "third")
    finally:
        for executor in pool._executors:
            executor.shutdown(wait=True)
    assert any("died while idle" in r.getMessage() for r in caplog.records)


@pytest.mark.e2e  # starts a worker process
def test_a_worker_that_died_after_its_pools_last_unit_is_not_kept_for_the_next_stage_and_says_so(caplog):
    """Stage-major: a pool's workers go back to the backend when its stage ends, for the next stage's pool. One that
    died after its last unit is dropped there, and the build's log says so as it does for any lost worker."""
    caplog.set_level(logging.WARNING, logger="builder.multi_device")

    class ForkedDevices(multi_device.DeviceBackend):
        new_executor = _ForkBackend.new_executor

    backend = ForkedDevices(["cpu"], {}, torch_threads=1)
    pool = multi_device.DevicePool(backend, ["cpu"], ["stage"], [False])
    try:
        assert pool.result(pool.submit(0, "first")) == ((["stage"], [False]), "first")
        died = pool._executors[0].submit(os._exit, 1)  # the worker dies after its stage's last unit
        with pytest.raises(BrokenProcessPool):
            died.result()
        pool.close()  # the stage is over: its workers go back to the backend
        assert backend._idle == {}
    finally:
        for executor in pool._executors:
            executor.shutdown(wait=True)
        backend.close()
    assert any("died while idle" in r.getMessage() for r in caplog.records), caplog.text


def test_a_stage_batch_size_cuts_calls_in_key_order_and_merges_them_into_one_result():
    """``run_stage`` calls a stage with at most ``batch_size`` records (key order) and merges the parts into the one
    result the batch commits, keeping the largest peak memory per device (``builder.stage_memory``)."""
    from types import SimpleNamespace

    from builder.engine import StageResult, run_stage

    calls, peaks = [], iter([3 << 30, 5 << 30])

    def run(records, record_errors=False):
        calls.append([r["key"] for r in records])
        peak = {"cuda:0": {"device": "cuda:0", "peak_bytes": next(peaks)}}
        return StageResult("edit", {r["key"]: {"n": len(records)} for r in records}, {}, {}, {"type": "x"}, peak)

    runner = SimpleNamespace(name="edit", config=SimpleNamespace(batch_size=2), run=run)
    result = run_stage(runner, [{"key": k} for k in ("a", "b", "c")])
    assert calls == [["a", "b"], ["c"]]
    assert result.updates == {"a": {"n": 2}, "b": {"n": 2}, "c": {"n": 1}}
    assert result.peak_memory["cuda:0"]["peak_bytes"] == 5 << 30 and result.description == {"type": "x"}
    runner.config.batch_size = 3  # a batch no larger than the stage's batch_size is one call
    calls.clear()
    peaks = iter([1])
    run_stage(runner, [{"key": k} for k in ("a", "b", "c")])
    assert calls == [["a", "b", "c"]]


def test_a_stage_batch_size_is_validated_hashed_and_shown_by_presets_show(tmp_path):
    import dataclasses

    import yaml

    from builder.config_docs import commented_yaml

    stages = [FAKE_STAGES[0] | {"batch_size": 2}, FAKE_STAGES[1]]
    cfg = load_config(str(write_config(tmp_path / "c.yaml", "demo", stages=stages, configs=ALL_CONFIGS)))
    shown = commented_yaml(cfg.to_dict(), origin="test")
    assert "    batch_size: 2  # at most this many records per call" in shown
    # What presets --show prints is a config that loads back to the same one (keys recorded only when set are
    # printed unset, as null, so that every key can be found there).
    (tmp_path / "shown.yaml").write_text(shown)
    assert load_config(str(tmp_path / "shown.yaml")).to_dict() == cfg.to_dict()
    assert yaml.safe_load(shown)["release_date"] is None
    assert (
        cfg.config_hash()
        != dataclasses.replace(
            cfg, stages=[dataclasses.replace(cfg.stages[0], batch_size=None), cfg.stages[1]]
        ).config_hash()
    )
    for bad in (0, "2", True):
        broken = load_config(
            str(write_config(tmp_path / "b.yaml", "demo", stages=[FAKE_STAGES[0] | {"batch_size": bad}]))
        )
        with pytest.raises(ValueError, match=r"stage 'caption': batch_size .*: expected an integer >= 1"):
            broken.validate()
