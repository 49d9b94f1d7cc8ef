"""Editors side by side: SSIM, edge SSIM, background PSNR, the per-editor table and plot, through `lance-cf eval` with
two releases and through `lance-cf compare-editors`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from PIL import Image
from release_fixture import write_manifest, write_release

from builder.cli import main
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


def _editor_release(root, name: str, stage_type: str, seed: int = 0, labels=(0, 1)):
    # The same source keys (src-LABEL-I) in every release of these labels; another seed draws other pixels, so that the
    # two editors' numbers differ and a mix-up between them shows.
    write_release(
        root, name=name, configs=("original", "counterfactual"), label_names=["a", "b", "c"], labels=labels, seed=seed
    )
    manifest = json.loads((root / "manifest.json").read_text())
    del manifest["manifest_sha256"]
    # what the edit stage records of its editor (an ``editor`` string in its description), as a real one does
    editor = {"prompt_to_prompt_edit": "prompt_to_prompt", "controlnet_edit": "controlnet"}[stage_type]
    manifest["stages"]["edit"] = {"type": stage_type, "editing": {"editor": editor}}
    write_manifest(root, manifest)
    return root


@pytest.fixture(scope="module")
def two_releases(tmp_path_factory):
    root = tmp_path_factory.mktemp("editors")
    p2p = _editor_release(root / "p2p", "lance-fixture", "prompt_to_prompt_edit")
    controlnet = _editor_release(root / "controlnet", "lance-fixture-controlnet", "controlnet_edit", seed=1)
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
    # a release built without the preservation stage: PSNR and SSIM computed here (the outside ones with the mask)
    from lance_pipeline import preservation as pv

    assert row["preservation_from"] == "computed" and row["lpips"] is None and row["lpips_outside"] is None
    assert row["psnr_outside"] == pytest.approx(background_psnr(original, edited, mask))
    assert row["ssim"] == pytest.approx(pv.ssim(original, edited))
    assert row["ssim_outside"] == pytest.approx(pv.ssim(original, edited, mask))
    assert all(r["background_psnr"] is None for r in rows if r["source_key"] != "src-0000-00")
    assert all(r["clip_image"] is None for r in rows)


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    from lance_pipeline.clip.gates import ClipScorer
    from lance_pipeline.tiny.clip_components import create_tiny_open_clip

    directory = create_tiny_open_clip(tmp_path_factory.mktemp("clip") / "clip")
    clip = ClipScorer(model=str(directory), pretrained=None)
    clip.load("cpu")
    return directory, clip


@pytest.mark.e2e
def test_compare_editors_table_plot_and_cli(two_releases, tiny_clip, tmp_path, capsys):
    p2p, controlnet, results = two_releases
    table = compare_editors([str(p2p), str(controlnet)], tmp_path / "out", results_paths=[results], clip=tiny_clip[1])
    editors = {r["editor"] for r in table}
    assert editors == {"prompt_to_prompt", "controlnet"}
    subject = next(r for r in table if r["editor"] == "controlnet" and r["edit_type"] == "subject")
    assert (subject["model"], subject["paired_delta_acc1"], subject["flip_rate"]) == ("m", -20.0, 40.0)
    overall = next(r for r in table if r["editor"] == "controlnet" and r["edit_type"] == "all")
    assert overall["n"] == 12 and overall["paired_delta_acc1"] == -12.5
    p2p_all = next(r for r in table if r["editor"] == "prompt_to_prompt" and r["edit_type"] == "all")
    assert p2p_all["model"] is None and p2p_all["paired_delta_acc1"] is None  # no eval results for that release
    assert -1.0 <= p2p_all["clip_image"] <= 1.0 and 0.0 < p2p_all["edge_ssim"] <= 1.0
    for name in ("fidelity.csv", "fidelity.md", "fidelity.png", "fidelity_samples.csv", "fidelity.json"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    assert "| subject | controlnet | m |" in (tmp_path / "out" / "fidelity.md").read_text()
    assert json.loads((tmp_path / "out" / "fidelity.json").read_text())["table"] == table
    argv = ["compare-editors", "--release", str(p2p), "--release", str(controlnet), "--no-clip"]
    assert main([*argv, "--results", str(results), "--output", str(tmp_path / "cli")]) == 0
    assert "| subject | controlnet | m |" in capsys.readouterr().out
    assert main(["compare-editors", "--release", str(p2p), "--no-clip", "--output", str(tmp_path / "x")]) == 2
    assert "at least two --release" in capsys.readouterr().err


def _eval_argv(releases, output, clip_dir, class_map) -> list[str]:
    argv = ["eval", "--model", "test_vit", "--no-pretrained", "--class-map", str(class_map), "--output", str(output)]
    argv += ["--no-insights", "--no-report", "--bootstrap", "0", "--workers", "0", "--device", "cpu"]
    argv += ["--clip-model", str(clip_dir), "--clip-pretrained", "none"]
    for release in releases:
        argv += ["--release", str(release)]
    return argv


@pytest.mark.e2e
def test_eval_of_two_releases_prints_and_writes_the_side_by_side(two_releases, tiny_clip, tmp_path, capsys):
    p2p, controlnet, _ = two_releases
    class_map = tmp_path / "map.txt"
    class_map.write_text("0\n1\n2\n")
    # One release: the same layout (OUTPUT/<release>/<model>/), no side by side.
    assert main(_eval_argv([p2p], tmp_path / "one", tiny_clip[0], class_map)) == 0
    assert "side by side" not in capsys.readouterr().out
    single = json.loads((tmp_path / "one" / "lance-fixture" / "test_vit__random" / "results.json").read_text())
    assert sorted(p.name for p in (tmp_path / "one").iterdir() if not p.name.startswith(".")) == ["lance-fixture"]

    out = tmp_path / "two"
    assert main(_eval_argv([p2p, controlnet], out, tiny_clip[0], class_map)) == 0
    printed = capsys.readouterr().out
    results = {
        label: json.loads((out / label / "test_vit__random" / "results.json").read_text())
        for label in ("lance-fixture", "lance-fixture-controlnet")
    }
    # Each release is evaluated as a one-release run would evaluate it.
    assert results["lance-fixture"]["metrics"] == single["metrics"]
    assert results["lance-fixture"]["sensitivity"] == single["sensitivity"]
    saved = json.loads((out / "side_by_side" / "fidelity.json").read_text())
    table = saved["table"]
    edit_types = {r["edit_type"] for r in release_fidelity(open_release(p2p))} & {
        r["edit_type"] for r in release_fidelity(open_release(controlnet))
    }
    assert len(edit_types) == 6
    for editor, label in (("prompt_to_prompt", "lance-fixture"), ("controlnet", "lance-fixture-controlnet")):
        for edit_type in edit_types:
            row = next(r for r in table if (r["editor"], r["edit_type"]) == (editor, edit_type))
            assert f"| {edit_type} | {editor} | test_vit (random weights) | 2 |" in printed
            stats = results[label]["sensitivity"]["by_edit_type"][edit_type]
            assert (row["paired_delta_acc1"], row["flip_rate"]) == (stats["paired_delta_acc1"], stats["flip_rate"])
            assert row["clip_image"] is not None and row["edge_ssim"] is not None
    # The same numbers as the fidelity module computes from the same releases and results (compare-editors' path).
    expected = compare_editors([str(p2p), str(controlnet)], tmp_path / "cmp", results_paths=[out], clip=tiny_clip[1])
    assert table == expected
    assert saved["shared_sources"] == 4 and saved["clip"]["model"]
    assert (out / "side_by_side" / "fidelity.png").stat().st_size > 0
    assert (out / "side_by_side" / "fidelity.md").read_text().count("\n| ") == len(table) + 1


def test_eval_of_releases_without_a_shared_source_is_one_line_before_any_output(two_releases, tmp_path, capsys):
    p2p, _, _ = two_releases
    other = _editor_release(tmp_path / "other", "lance-other", "controlnet_edit", labels=(2,))
    argv = ["eval", "--release", str(p2p), "--release", str(other), "--model", "test_vit", "--no-pretrained"]
    assert main([*argv, "--output", str(tmp_path / "out"), "--device", "cpu"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "lance-fixture, lance-other share no source image" in error
    assert "same --source" in error and not (tmp_path / "out").exists()
    # Side-by-side options on a one-release run are a mistake, said in one line.
    assert main([*argv[:3], *argv[5:], "--no-clip-similarity", "--output", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "apply to the side by side of several --release" in error
    assert not (tmp_path / "out").exists()


def test_fidelity_md_escapes_its_text_cells_and_the_printed_table_keeps_the_names():
    from evaluation.fidelity import table_markdown

    row = {"edit_type": "sub_ject", "editor": "<img src=x>", "release": "r", "model": "m|*x*", "n": 2}
    written = table_markdown([row], escaped=True).splitlines()[-1]
    assert written.startswith(r"| sub\_ject | &lt;img src=x&gt; | m\|\*x\* | 2 |"), written
    assert table_markdown([row]).splitlines()[-1].startswith(r"| sub_ject | <img src=x> | m\|*x* | 2 |")
