"""A release read by CLIP_benchmark's own ``wds/`` loader (``clip_benchmark.datasets.builder.build_wds_dataset``)
after ``lance-cf export clip-benchmark``: every config, images and labels equal to what ``datasets`` reads."""

from __future__ import annotations

import numpy as np
import pytest
from release_fixture import write_release

pytest.importorskip("clip_benchmark")

NAMES = ["cat", "dog", "fire truck", "tree"]


def assert_clip_benchmark_reads_like_datasets(root, out, lance_cf, cache_dir) -> list[str]:
    """Export ``root`` to ``out`` and read every config with CLIP_benchmark's own builder: the same images and labels,
    in the same order, as ``datasets`` reads; returns the exported class names."""
    import json

    import datasets
    from clip_benchmark.datasets.builder import build_wds_dataset

    from evaluation.zero_shot import load_template_set

    code, printed, err = lance_cf("export", "clip-benchmark", str(root), str(out))
    assert code == 0, printed + err
    configs = [p.name for p in sorted(out.iterdir()) if p.is_dir() and (p / "nshards.txt").is_file()]
    manifest = json.loads((root / "manifest.json").read_text())
    assert set(configs) == set(manifest["configs"])
    classes = None
    for config in configs:
        ds = build_wds_dataset("wds/lance-release", transform=lambda im: im, split=config, data_dir=str(out))
        classes = ds.classes
        assert ds.templates == [t.replace("{}", "{c}") for t in load_template_set("openai").templates]
        theirs = [(np.asarray(im.convert("RGB")), int(label)) for im, label in ds]
        ours = datasets.load_dataset(str(root), config, split="test", cache_dir=str(cache_dir))
        assert len(theirs) == len(ours) > 0
        for (image, label), row in zip(theirs, ours, strict=True):
            assert label == row["cls"]
            image_column = next(k for k in ("png", "jpg", "webp") if k in row)
            assert np.array_equal(image, np.asarray(row[image_column].convert("RGB")))
    return classes


def test_clip_benchmark_reads_every_config_like_datasets(tmp_path, lance_cf):
    root = write_release(tmp_path / "rel", labels=(0, 1, 2, 3), label_names=NAMES, originals_per_class=2,
                         edits_per_original=2, shard_size=5)  # fmt: skip
    classes = assert_clip_benchmark_reads_like_datasets(root, tmp_path / "cb", lance_cf, tmp_path / "hf")
    assert classes == NAMES


def test_export_refuses_a_non_empty_output(tmp_path, lance_cf):
    root = write_release(tmp_path / "rel", labels=(0, 1), label_names=NAMES[:2], configs=("original",))
    out = tmp_path / "cb"
    out.mkdir()
    (out / "x").write_text("")
    code, printed, err = lance_cf("export", "clip-benchmark", str(root), str(out))
    assert code != 0 and "not an empty directory" in err
