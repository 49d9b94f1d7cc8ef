"""Each stage's peak memory is measured where it runs, logged, kept per stage in the ledger, and (opt-in) written to
the manifest (builder.stage_memory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from builder_helpers import FAKE_STAGES, make_imagefolder, write_config

from builder.stage_memory import CPU_MEASURE, merge, unmeasured_reason

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
ALLOCATING = {
    "name": "alloc",
    "type": "tests.fake_stages:FakeAllocatingStage",
    "configs": ["reconstructed", "counterfactual", "lance_r"],
    "options": {"mebibytes": 4, "big_mebibytes": 96, "big_key": "b_img_001"},
}


# The builds whose memory is measured run in a fresh process: the CPU figure is how far the process's resident set
# rose above its start, and in a test worker late in a long session, threads and collections left by earlier tests
# free memory while the stage takes its own, so the rise read 0 (seen in full-suite runs, never alone).
_MEASURED_BUILDS = """
import json, logging, sqlite3, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
from builder.config import load_config
from builder.engine import build
config, out, quiet = sys.argv[1:4]
cfg = load_config(config)
memory = build(cfg, out, progress=False, record_memory=True)["build"]["stage_memory"]
# Off by default: the manifest stays byte-identical between identical builds; the ledger keeps it anyway.
unrecorded = "stage_memory" in build(cfg, quiet, progress=False)["build"]
with sqlite3.connect(quiet + "/.lance-cf/ledger.sqlite") as db:
    (stored,) = db.execute("SELECT value FROM meta WHERE name = 'memory:alloc'").fetchone()
print(json.dumps({"memory": memory, "quiet_manifest_has_it": unrecorded, "quiet_ledger": json.loads(stored)}))
"""


@pytest.mark.slow
@pytest.mark.skipif(unmeasured_reason("cpu") is not None, reason=str(unmeasured_reason("cpu")))
def test_stage_peak_memory_is_the_max_over_batches_and_recorded_on_request(tmp_path):
    folder = make_imagefolder(tmp_path / "src", ["a", "b"], 2)
    stages = [FAKE_STAGES[0], ALLOCATING, FAKE_STAGES[1]]
    config = write_config(
        tmp_path / "c.yaml",
        f"imagefolder:{folder}",
        stages=stages,
        batch_size=2,
        configs=["original", "counterfactual"],
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURED_BUILDS, str(config), str(tmp_path / "out"), str(tmp_path / "quiet")],
        capture_output=True, text=True, cwd=ROOT, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    memory = got["memory"]
    assert set(memory) == {"caption", "alloc", "edit"}
    alloc = memory["alloc"]["cpu"]
    assert alloc["measure"] == CPU_MEASURE and alloc["device"] == "cpu"
    # Batch a (4 MiB held) and batch b (96 MiB held, key b_img_001): the stage's entry is the larger one.
    assert 90 * MiB <= alloc["peak_bytes"] < 200 * MiB
    assert memory["caption"]["cpu"]["peak_bytes"] < 32 * MiB  # allocates nothing of its own
    logged = [line for line in proc.stderr.splitlines() if line.startswith("builder.engine stage alloc: peak memory")]
    assert len(logged) == 2 * 2  # one line per batch, in each of the two builds
    assert not got["quiet_manifest_has_it"]
    assert got["quiet_ledger"]["cpu"]["peak_bytes"] >= 90 * MiB


def test_merge_keeps_the_largest_peak_per_device():
    def entry(device, peak):
        return {"device": device, "measure": "m", "peak_bytes": peak, "start_bytes": 0}

    merged = merge({"cuda:0": entry("cuda:0", 5)}, {"cuda:0": entry("cuda:0", 3), "cuda:1": entry("cuda:1", 7)})
    assert merged == {"cuda:0": entry("cuda:0", 5), "cuda:1": entry("cuda:1", 7)}
    assert merge(merged, {"cuda:0": entry("cuda:0", 9)})["cuda:0"]["peak_bytes"] == 9
    assert merge(None, None) == {}
    assert unmeasured_reason("mps") == "peak memory is measured on cuda and cpu devices, not mps"
