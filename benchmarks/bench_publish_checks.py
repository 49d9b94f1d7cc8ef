"""What ``lance-cf publish``'s local checks cost: ``verify`` against the staged ``load_dataset`` check.

Builds a synthetic release (tests/release_fixture.py: 15 classes x 10 originals x 3 edits, 128 px PNGs, 64 samples a
shard), stages it as ``publish`` does (links to the listed files, the card rendered for a repo) and times, in one
process: ``verify_release``, the staging with the card rendering, and ``check_loadable`` (``datasets`` opening every
config and reading every row in batches) three times (the first pays ``datasets``' one-time set-up). No network.

    PYTHONPATH=. OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/bench_publish_checks.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    from release_fixture import write_release

    from builder import publish
    from builder.release_format.verify import verify_release
    from dataset_cards import render_release_card

    with tempfile.TemporaryDirectory() as tmp:
        release = write_release(
            Path(tmp) / "release",
            labels=tuple(range(0, 150, 10)),
            label_names=[f"class{i}" for i in range(150)],
            originals_per_class=10,
            edits_per_original=3,
            image_size=128,
            shard_size=64,
        )
        manifest = json.loads((release / "manifest.json").read_text())
        render_release_card(release, manifest)
        samples = sum(c["total"] for c in manifest["counts"].values())
        size = sum(s["bytes"] for s in manifest["shards"]) / 1e6
        print(f"release: {samples} samples, {len(manifest['shards'])} shards, {size:.1f} MB")
        start = time.perf_counter()
        assert verify_release(release) == []
        print(f"verify: {time.perf_counter() - start:.2f} s")
        staging = Path(tmp) / "staging" / "release"
        staging.mkdir(parents=True)
        start = time.perf_counter()
        publish.stage_release(release, staging, manifest, "org/name")
        print(f"stage (links + card rendered for the repo): {time.perf_counter() - start:.2f} s")
        for run in range(1, 4):
            start = time.perf_counter()
            publish.check_loadable(staging, manifest, release)
            print(f"load_dataset check, run {run}: {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
