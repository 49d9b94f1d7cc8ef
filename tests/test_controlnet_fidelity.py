"""Editors side by side: SSIM, edge SSIM, background PSNR, the per-editor table and plot, `lance-cf compare-editors`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from builder_helpers import cli
from PIL import Image
from release_fixture import write_manifest, write_release

from evaluation.fidelity import background_psnr, compare_editors, edge_ssim, release_fidelity, ssim
from evaluation.release_reader import open_release


def test_ssim_of_constant_images_is_the_luminance_term():
    # Constant images: zero variances and covariance, so SSIM = (2 mx my + C1) / (mx^2 + my^2 + C1) exactly.
    c1 = (0.01 * 255) ** 2
    for mx, my in ((100.0, 100.0), (100.0, 140.0), (0.0, 255.0)):
        expected = (2 * mx * my + c1) / (mx**2 + my**2 + c1)
        assert ssim(np.full((16, 16), mx), np.full((16, 16), my)) == pytest.approx(expected, rel=1e-12)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(32, 32)).astype(float)
    assert ssim(x, x) == pytest.approx(1.0)
    noisy = [ssim(x, np.clip(x + rng.normal(0, s, x.shape), 0, 255)) for s in (5, 20, 60)]
    assert noisy[0] > noisy[1] > noisy[2]
    with pytest.raises(ValueError, match="2-D arrays of one shape"):
        ssim(x, x[:8])


def test_edge_ssim_and_background_psnr():
    rng = np.random.default_rng(1)
    array = np.zeros((32, 32, 3), dtype=np.uint8)
    array[8:24, 8:24] = 200
    image = Image.fromarray(array)
    assert edge_ssim(image, image) == pytest.approx(1.0)
    shifted = Image.fromarray(np.roll(array, 6, axis=1))
    assert edge_ssim(image, shifted) < 0.9
    # Background differs by 10 everywhere (MSE 100); the object region differs wildly but is masked out.
    edited = array.astype(int) + 10
    edited[8:24, 8:24] = rng.integers(0, 256, size=(16, 16, 3))
    mask = np.zeros((32, 32), dtype=np.uint8)
    mask[8:24, 8:24] = 1
    psnr = background_psnr(image, Image.fromarray(edited.clip(0, 255).astype(np.uint8)), mask)
    assert psnr == pytest.approx(10 * math.log10(255**2 / 100))
    assert background_psnr(image, image, mask) == math.inf
    assert background_psnr(image, image, np.ones((32, 32))) is None
    with pytest.raises(ValueError, match="mask is"):
        background_psnr(image, image, np.ones((8, 8)))


def _editor_release(root, name: str, stage_type: str):
    write_release(root, name=name, configs=("original", "counterfactual"), label_names=["a", "b", "c"], labels=(0, 1))
    manifest = json.loads((root / "manifest.json").read_text())
    del manifest["manifest_sha256"]
    manifest["stages"]["edit"] = {"type": stage_type}
    write_manifest(root, manifest)
    return root


@pytest.fixture(scope="module")
def two_releases(tmp_path_factory):
    root = tmp_path_factory.mktemp("editors")
    p2p = _editor_release(root / "p2p", "lance-fixture", "prompt_to_prompt_edit")
    controlnet = _editor_release(root / "controlnet", "lance-fixture-controlnet", "controlnet_edit")
    results = root / "eval" / "m" / "results.json"
    results.parent.mkdir(parents=True)
    results.write_text(
        json.dumps(
            {
                "status": "ok",
                "release": {"name": "lance-fixture-controlnet"},
                "model": {"name": "m"},
                "sensitivity": {
                    "overall": {"paired_delta_acc1": -12.5, "flip_rate": 25.0},
                    "by_edit_type": {"subject": {"paired_delta_acc1": -20.0, "flip_rate": 40.0}},
                },
            }
        )
    )
    return p2p, controlnet, results.parent.parent


def test_release_fidelity_rows_match_direct_computation(two_releases, tmp_path):
    p2p, _, _ = two_releases
    masks = tmp_path / "masks"
    masks.mkdir()
    mask = np.zeros((48, 48), dtype=np.uint8)
    mask[10:30, 10:30] = 255
    Image.fromarray(mask).save(masks / "src-0000-00.png")
    rows = release_fidelity(open_release(p2p), masks_dir=masks)
    assert len(rows) == 2 * 2 * 3 and {r["editor"] for r in rows} == {"prompt_to_prompt"}
    row = next(r for r in rows if r["key"] == "src-0000-00-cf01")
    import tarfile

    def image(config, key):
        for shard in sorted((p2p / "data" / config).glob("*.tar")):
            with tarfile.open(shard) as tar:
                names = tar.getnames()
                if f"{key}.png" in names:
                    return Image.open(tar.extractfile(f"{key}.png")).convert("RGB")
        raise KeyError(key)

    original, edited = image("original", "src-0000-00"), image("counterfactual", "src-0000-00-cf01")
    assert row["edge_ssim"] == pytest.approx(edge_ssim(original, edited))
    assert row["background_psnr"] == pytest.approx(background_psnr(original, edited, mask))
    assert all(r["background_psnr"] is None for r in rows if r["source_key"] != "src-0000-00")
    assert all(r["clip_image"] is None for r in rows)


@pytest.mark.e2e
def test_compare_editors_table_plot_and_cli(two_releases, tmp_path):
    from lance_pipeline.clip_gates import ClipScorer
    from lance_pipeline.tiny_clip_components import create_tiny_open_clip

    p2p, controlnet, results = two_releases
    clip = ClipScorer(model=str(create_tiny_open_clip(tmp_path / "clip")), pretrained=None)
    clip.load("cpu")
    table = compare_editors([str(p2p), str(controlnet)], tmp_path / "out", results_paths=[results], clip=clip)
    editors = {r["editor"] for r in table}
    assert editors == {"prompt_to_prompt", "controlnet"}
    subject = next(r for r in table if r["editor"] == "controlnet" and r["edit_type"] == "subject")
    assert (subject["model"], subject["paired_delta_acc1"], subject["flip_rate"]) == ("m", -20.0, 40.0)
    overall = next(r for r in table if r["editor"] == "controlnet" and r["edit_type"] == "all")
    assert overall["n"] == 12 and overall["paired_delta_acc1"] == -12.5
    p2p_all = next(r for r in table if r["editor"] == "prompt_to_prompt" and r["edit_type"] == "all")
    assert p2p_all["model"] is None and p2p_all["paired_delta_acc1"] is None  # no eval results for that release
    assert -1.0 <= p2p_all["clip_image"] <= 1.0 and 0.0 < p2p_all["edge_ssim"] <= 1.0
    for name in ("fidelity.csv", "fidelity.md", "fidelity.png", "fidelity_samples.csv"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    assert "| controlnet | subject | m |" in (tmp_path / "out" / "fidelity.md").read_text()
    proc = cli(
        "compare-editors",
        "--release",
        str(p2p),
        "--release",
        str(controlnet),
        "--no-clip",
        "--results",
        str(results),
        "--output",
        str(tmp_path / "cli"),
    )
    assert "| controlnet | subject | m |" in proc.stdout
    refused = cli("compare-editors", "--release", str(p2p), "--no-clip", "--output", str(tmp_path / "x"), check=False)
    assert refused.returncode == 2 and "at least two --release" in refused.stderr
