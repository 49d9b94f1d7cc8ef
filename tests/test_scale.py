"""Scale: the devices engine (one process per device) and the Ray engine give the local engine's bytes, also when a
worker is killed mid-build; on fake stages and on the demo preset's real tiny stages."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import sqlite3
import threading
import time

import pytest
from builder_helpers import ALL_CONFIGS, FAKE_STAGES, REPO, cli, make_imagefolder, release_files, write_config

from builder.config import apply_overrides, load_config
from builder.engine import build
from builder.verify import verify_release

HAS_RAY = importlib.util.find_spec("ray") is not None
DEMO_LIMIT = 4  # four demo photos in batches of one: enough batches for two workers and a kill


def _demo_config():
    return apply_overrides(load_config("demo"), batch_size=1, limit=DEMO_LIMIT)


@pytest.fixture(scope="module")
def local_demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale-local") / "release"
    build(_demo_config(), out, device="cpu", progress=False)
    return out


def _done_batches(output) -> int:
    path = output / ".lance-cf" / "ledger.sqlite"
    if not path.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5) as db:
            return db.execute("SELECT COUNT(*) FROM done_batches").fetchone()[0]
    except sqlite3.Error:
        return 0  # tables not created yet


def _build_killing_one_worker(output, is_worker, **build_kwargs) -> list[int]:
    """Run build() on a thread; once a batch is done, SIGKILL one worker process (found by ``is_worker``) while
    later batches are still running. Returns the killed pids."""
    import psutil

    outcome: dict = {}

    def run():
        try:
            outcome["manifest"] = build(_demo_config(), output, device="cpu", progress=False, **build_kwargs)
        except BaseException as err:  # noqa: BLE001 - re-raised on the test's thread
            outcome["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    killed: list[int] = []
    while thread.is_alive() and not killed:
        time.sleep(0.5)
        if _done_batches(output) < 1:
            continue
        workers = [p for p in psutil.Process().children(recursive=True) if is_worker(p)]
        if len(workers) >= 2:
            os.kill(workers[0].pid, signal.SIGKILL)
            killed.append(workers[0].pid)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return killed


def _cmdline(process) -> str:
    import psutil

    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def test_devices_engine_gives_the_local_bytes_with_errors_and_deferral(tmp_path):
    src = make_imagefolder(tmp_path / "src", ["a", "b", "c"], per_class=3)
    # Batches of one; the caption stage raises on two samples: recorded errors, same as the local engine.
    stages = [FAKE_STAGES[0] | {"options": {"fail_keys": ["a_img_000", "b_img_001"]}}, FAKE_STAGES[1]]
    cfg = load_config(
        str(write_config(tmp_path / "c.yaml", f"imagefolder:{src}", stages=stages, configs=ALL_CONFIGS, batch_size=1))
    )
    build(cfg, tmp_path / "local", progress=False)
    build(cfg, tmp_path / "two", progress=False, engine="devices", engine_options={"devices": ["cpu", "cpu"]})
    assert verify_release(tmp_path / "two") == []
    manifest = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert [e["source_key"] for e in manifest["build"]["errors"]] == ["a_img_000", "b_img_001"]
    assert release_files(tmp_path / "two") == release_files(tmp_path / "local")


def test_device_lists_and_engine_options_are_checked_before_anything_is_written(tmp_path):
    src = make_imagefolder(tmp_path / "src", ["a"], per_class=1)
    cfg = write_config(tmp_path / "c.yaml", f"imagefolder:{src}", stages=FAKE_STAGES, configs=ALL_CONFIGS)
    out = tmp_path / "out"
    for flags, expected in (
        (["--devices", "cpu,,cpu"], "--devices 'cpu,,cpu': expected a comma-separated list"),
        (["--devices", "cuda:0,cuda:1"], "no CUDA GPU is visible"),
        (["--devices", "cpu,cpu", "--engine", "ray"], "--devices runs the devices engine, not ray"),
        (["--ray-address", "auto"], "--ray-address is for --engine ray"),
        (["--engine", "devices", "--gpus-per-worker", "1"], "--gpus-per-worker is for --engine ray"),
    ):
        proc = cli("build", str(cfg), "--output", str(out), "--no-progress", *flags, check=False)
        assert proc.returncode == 2, (flags, proc.stderr)
        assert expected in proc.stderr and "Traceback" not in proc.stderr, (flags, proc.stderr)
        assert not out.exists()
    with pytest.raises(ValueError, match="the local engine takes no option devices"):
        build(load_config(str(cfg)), out, progress=False, engine_options={"devices": ["cpu"]})
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
        build(_demo_config(), out, device="cpu", progress=False, schedule="stage-major")
    with sqlite3.connect(out / ".lance-cf" / "ledger.sqlite") as db:
        stored = dict(db.execute("SELECT stage, COUNT(*) FROM stage_outputs GROUP BY stage").fetchall())
    assert stored.get("caption") == stored.get("perturb") == DEMO_LIMIT and stored.get("label_check") == 1
    monkeypatch.setattr(label_check, "process", real_process)
    # ... resumes (stage-major again) from the ledger and writes the batch-major build's bytes.
    build(_demo_config(), out, device="cpu", progress=False, schedule="stage-major")
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
        build(_demo_config(), out, device="cpu", progress=False, keep_inversions=False)
    ledger = out / ".lance-cf" / "ledger.sqlite"
    query = "SELECT p.batch FROM stage_outputs s JOIN plan p USING (source_key) WHERE s.stage=? ORDER BY p.batch"
    with sqlite3.connect(ledger) as db:
        assert [r[0] for r in db.execute(query, ("invert",))] == [2]  # only the unfinished batch keeps its inversion
        assert [r[0] for r in db.execute(query, ("reconstruct",))] == [0, 1, 2]
    monkeypatch.setattr(edit, "process", real_process)
    build(_demo_config(), out, device="cpu", progress=False, keep_inversions=False)
    with sqlite3.connect(ledger) as db:
        assert db.execute(query, ("invert",)).fetchall() == []
    assert verify_release(out) == []
    assert release_files(out) == release_files(local_demo)


@pytest.mark.slow  # builds the demo preset's real tiny stages (minutes on a loaded 2-core machine)
def test_two_cpu_device_workers_give_the_local_bytes_on_the_demo_stages(local_demo, tmp_path):
    out = tmp_path / "two"
    build(_demo_config(), out, device="cpu", progress=False, engine="devices", engine_options={"devices": ["cpu"] * 2})
    assert verify_release(out) == []
    assert release_files(out) == release_files(local_demo)


@pytest.mark.slow  # builds the demo preset's real tiny stages (minutes on a loaded 2-core machine)
def test_a_device_worker_killed_mid_build_loses_nothing_and_the_bytes_match(local_demo, tmp_path, caplog):
    out = tmp_path / "killed"
    caplog.set_level(logging.WARNING, logger="builder.dispatch")
    killed = _build_killing_one_worker(
        out,
        lambda p: "multiprocessing" in _cmdline(p) and "spawn_main" in _cmdline(p),
        engine="devices",
        engine_options={"devices": ["cpu", "cpu"]},
    )
    assert killed, "the build ended before a worker could be killed"
    assert any("died running batch" in r.getMessage() for r in caplog.records), "no batch was retried"
    assert verify_release(out) == []
    assert release_files(out) == release_files(local_demo)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_RAY, reason="the [ray] extra is not installed")
def test_a_ray_actor_killed_mid_build_loses_nothing_and_the_bytes_match(local_demo, tmp_path, caplog):
    import ray

    out = tmp_path / "ray"
    caplog.set_level(logging.WARNING, logger="builder.dispatch")
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    try:
        killed = _build_killing_one_worker(
            out,
            lambda p: "ray::StageWorker" in _cmdline(p) or p.name().startswith("ray::StageWorker"),
            engine="ray",
            workers=2,
        )
    finally:
        ray.shutdown()
    assert killed, "the build ended before an actor could be killed"
    assert any("died running batch" in r.getMessage() for r in caplog.records), "no batch was retried"
    assert verify_release(out) == []
    assert release_files(out) == release_files(local_demo)
