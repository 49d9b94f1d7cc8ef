"""Each stage's peak memory is measured where it runs, logged, kept per stage in the ledger, and (opt-in) written to
the manifest (builder.stage_memory)."""

from __future__ import annotations

import gc
import json
import sqlite3

import pytest
from builder_helpers import FAKE_STAGES, make_imagefolder, write_config

from builder.config import load_config
from builder.engine import build
from builder.stage_memory import CPU_MEASURE, merge, unmeasured_reason

MiB = 2**20
ALLOCATING = {
    "name": "alloc",
    "type": "tests.fake_stages:FakeAllocatingStage",
    "configs": ["reconstructed", "counterfactual", "lance_r"],
    "options": {"mebibytes": 4, "big_mebibytes": 96, "big_key": "b_img_001"},
}


@pytest.mark.skipif(unmeasured_reason("cpu") is not None, reason=str(unmeasured_reason("cpu")))
def test_stage_peak_memory_is_the_max_over_batches_and_recorded_on_request(tmp_path, caplog):
    folder = make_imagefolder(tmp_path / "src", ["a", "b"], 2)
    stages = [FAKE_STAGES[0], ALLOCATING, FAKE_STAGES[1]]
    cfg = load_config(
        str(
            write_config(
                tmp_path / "c.yaml",
                f"imagefolder:{folder}",
                stages=stages,
                batch_size=2,
                configs=["original", "counterfactual"],
            )
        )
    )
    caplog.set_level("INFO", logger="builder.engine")
    # The CPU figure is how far this process's resident set rose above its start. Late in a long session, a cyclic
    # garbage collection inside the measured stage frees earlier tests' memory as the stage takes its own, and the
    # rise reads 0 (seen in full-suite runs, never alone): collect first, and keep the collector out of the build.
    gc.collect()
    gc.disable()
    try:
        manifest = build(cfg, tmp_path / "out", progress=False, record_memory=True)
    finally:
        gc.enable()
    memory = manifest["build"]["stage_memory"]
    assert set(memory) == {"caption", "alloc", "edit"}
    alloc = memory["alloc"]["cpu"]
    assert alloc["measure"] == CPU_MEASURE and alloc["device"] == "cpu"
    # Batch a (4 MiB held) and batch b (96 MiB held, key b_img_001): the stage's entry is the larger one.
    assert 90 * MiB <= alloc["peak_bytes"] < 200 * MiB
    assert memory["caption"]["cpu"]["peak_bytes"] < 32 * MiB  # allocates nothing of its own
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stage alloc: peak memory")]
    assert len(logged) == 2  # one line per batch
    # Off by default: the manifest stays byte-identical between identical builds; the ledger keeps it anyway.
    manifest = build(cfg, tmp_path / "quiet", progress=False)
    assert "stage_memory" not in manifest["build"]
    db = sqlite3.connect(tmp_path / "quiet" / ".lance-cf" / "ledger.sqlite")
    (stored,) = db.execute("SELECT value FROM meta WHERE name = 'memory:alloc'").fetchone()
    db.close()
    assert json.loads(stored)["cpu"]["peak_bytes"] >= 90 * MiB


def test_merge_keeps_the_largest_peak_per_device():
    def entry(device, peak):
        return {"device": device, "measure": "m", "peak_bytes": peak, "start_bytes": 0}

    merged = merge({"cuda:0": entry("cuda:0", 5)}, {"cuda:0": entry("cuda:0", 3), "cuda:1": entry("cuda:1", 7)})
    assert merged == {"cuda:0": entry("cuda:0", 5), "cuda:1": entry("cuda:1", 7)}
    assert merge(merged, {"cuda:0": entry("cuda:0", 9)})["cuda:0"]["peak_bytes"] == 9
    assert merge(None, None) == {}
    assert unmeasured_reason("mps") == "peak memory is measured on cuda and cpu devices, not mps"
