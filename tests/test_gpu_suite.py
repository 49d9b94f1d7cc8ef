"""benchmarks/gpu_suite.py, the one command for the GPU figures: its CPU dry run end to end (so the script cannot rot
while no GPU is lent), its time budget, and the wheels it would carry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUITE = REPO / "benchmarks" / "gpu_suite.py"
# Every stage of the hardimagenet preset (the build section must reach each one on the random-weight models).
HARDIMAGENET_STAGES = {"caption", "perturb", "label_check", "random_edit", "invert", "reconstruct", "edit"}
HARDIMAGENET_STAGES |= {"lance_r_edit", "screen", "screen_lance_r", "safety_reconstruction", "safety", "safety_lance_r"}
HARDIMAGENET_STAGES |= {"preservation"}


def gpu_suite():
    """benchmarks/gpu_suite.py as a module."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_suite
    finally:
        sys.path.pop(0)
    return gpu_suite


def run_suite(tmp_path: Path, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SUITE), "--out", str(tmp_path / "out"), "--wheels", str(tmp_path / "no-wheels"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((tmp_path / "out" / "suite.json").read_text())


@pytest.mark.e2e
@pytest.mark.slow
def test_the_dry_run_runs_every_section_and_reports_what_the_gpu_run_reports(tmp_path):
    report = run_suite(tmp_path, "--dry-run")
    assert report["size"] == "small" and report["environment"]["device"] == "cpu"
    sections = {s["name"]: s for s in report["sections"]}
    assert list(sections) == [
        "matmul", "editor", "instruct", "eval_resnet50", "eval_vit_b16", "zero_shot", "models", "text", "build",
        "judge",
    ]  # fmt: skip
    assert {name: s["status"] for name, s in sections.items()} == dict.fromkeys(sections, "ok")
    # Every script section ran in a child of the launcher, which imported each module of its preload once.
    assert set(report["preloaded"]) == set(gpu_suite().PRELOAD)
    assert all(isinstance(seconds, float) for seconds in report["preloaded"].values()), report["preloaded"]
    assert all(s["cpu_s"] > 0 for name, s in sections.items() if name != "matmul")

    editor = sections["editor"]["data"]
    rows = {r["name"]: r for r in editor["rows"]}
    assert {"reference fp32", "ours null_text fp32", "ours direct bf16", "controlnet fp32"} <= set(rows)
    # Counted by the UNet hook: ours does fewer forward-equivalents than the reference, direct inversion fewer still.
    reference, ours = rows["reference fp32"], rows["ours null_text fp32"]
    assert ours["unet_fwd_eq_per_cf"] < reference["unet_fwd_eq_per_cf"]
    assert rows["ours direct fp32"]["unet_fwd_eq_per_cf"] < ours["unet_fwd_eq_per_cf"]
    flops = editor["unet_flops_per_sample_forward"]
    for row in rows.values():
        seconds = row["s_per_cf"] * editor["images"] * editor["edits_per_image"]
        fwd_eq = row["unet_fwd_eq_per_cf"] * editor["images"] * editor["edits_per_image"]
        assert row["unet_tflops_achieved"] == pytest.approx(fwd_eq * flops / seconds / 1e12, rel=1e-6)

    instruct = sections["instruct"]["data"]  # the tiny FLUX.2 [klein], through the product's editor and its hook
    assert instruct["denoiser_fwd_eq_per_image"] == instruct["steps"] == 4  # distilled: one sample per step
    assert instruct["flops_per_image"] > 0 and instruct["peak_gib"] is None

    for name in ("eval_resnet50", "eval_vit_b16"):
        data = sections[name]["data"]
        ips = data["images_per_second"]
        assert data["ratio_vs_forward"] == pytest.approx(ips["harness"] / ips["forward"])
        assert data["images"] == 4 * 6  # originals x (original + reconstructed + 3 edits + lance_r) of the fixture

    zero_shot = sections["zero_shot"]["data"]
    assert zero_shot["images"] == 4 * 2 * 4  # classes x originals x (original, reconstructed, 1 edit, lance_r)
    ips = zero_shot["images_per_second"]
    assert zero_shot["ratio"] == pytest.approx(ips["ours"] / ips["clip_benchmark"])

    text = sections["text"]["data"]
    assert {(s["stage"], s["mode"]) for s in text["stages"]} == {("caption", "batched"), ("perturb", "batched")}
    assert 0 < text["text_share_time_measured"]

    memory = sections["build"]["data"]["stage_memory"]
    assert set(memory) == HARDIMAGENET_STAGES  # every stage of the preset ran on the random-weight models
    assert all(per_device["cpu"]["measure"] == "rss_peak_growth" for per_device in memory.values())

    judge = sections["judge"]["data"]
    assert [r["batch"] for r in judge["rows"]] == [1, 2] and judge["visual_tokens"] == 4  # 56 px: 4x4 patches, merged
    for row in judge["rows"]:
        assert row["questions_per_second"] == pytest.approx(row["batch"] / row["seconds_per_batch"])

    markdown = (tmp_path / "out" / "suite.md").read_text()
    assert "questions / s" in markdown and "CLIP_benchmark's loop like for like" in markdown
    assert "| reference fp32 |" in markdown and "harness / validate.py" in markdown and "| edit | cpu:" in markdown
    assert "Instruction editor, tiny random FLUX.2 [klein]" in markdown
    assert (tmp_path / "out" / "suite.log").stat().st_size > 0


@pytest.mark.e2e
def test_a_section_that_outlives_its_slot_is_stopped_and_the_report_is_still_written(tmp_path):
    # No in-process section first: on a busy machine it could spend the whole budget before the editor starts.
    # The editor's slot is 6 s x 0.27 / 0.60 = 2.7 s; its imports alone take longer on any machine (the launcher
    # preloads nothing here, so the editor starts at once and is stopped while it runs).
    report = run_suite(tmp_path, "--dry-run", "--sections", "editor,models,build", "--budget-s", "6", "--preload", "")
    sections = {s["name"]: s for s in report["sections"]}
    assert sections["editor"]["status"].startswith("stopped: out of its time slot")
    assert sections["build"]["status"].startswith("skipped: ")  # budget spent, or its models never written
    assert (tmp_path / "out" / "suite.md").is_file()


@pytest.mark.slow  # waits out a 5 s slot by design
def test_a_stopped_section_keeps_what_it_had_written(tmp_path):
    """A section's JSON is read back after its process group is killed at the end of its slot."""
    suite = gpu_suite()
    partial = tmp_path / "partial.json"
    child = f"import json, time; open({str(partial)!r}, 'w').write(json.dumps({{'rows': [1]}})); time.sleep(3600)"
    with open(tmp_path / "log", "w") as log:
        launcher = suite.SectionLauncher(log, preload=())
        try:
            # The launcher is up before the slot starts (a first section has run), so the child is a fork of a ready
            # process: it writes within milliseconds of its slot's 5 s.
            first = suite.run_section({"name": "up", "argv": [sys.executable, "-c", "pass"]}, 3600, log, launcher)
            assert first["status"] == "ok"
            section = {"name": "x", "argv": [sys.executable, "-c", child], "json": partial}
            result = suite.run_section(section, 5, log, launcher)
        finally:
            launcher.close()
    assert result["status"].startswith("stopped: out of its time slot")
    assert result["data"] == {"rows": [1]}


def test_a_section_whose_launcher_is_gone_fails_in_its_status(tmp_path):
    suite = gpu_suite()
    with open(tmp_path / "log", "w") as log:
        launcher = suite.SectionLauncher(log, preload=())
        launcher._proc.kill()
        launcher._proc.wait()
        result = suite.run_section({"name": "x", "argv": [sys.executable, "-c", "pass"]}, 3600, log, launcher)
    assert result["status"].startswith("failed: RuntimeError: the section launcher exited (code -9")
    assert "data" not in result


def test_the_wheels_to_carry_are_the_dependencies_the_lent_machine_lacks():
    gpu_suite_module = gpu_suite()
    missing = gpu_suite_module.missing_packages()
    assert {"diffusers", "open-clip-torch", "datasets", "ftfy", "huggingface-hub", "clip-benchmark"} <= set(missing)
    assert not {"torch", "transformers", "timm", "numpy", "pandas", "pyarrow"} & set(missing)  # already there
    assert gpu_suite_module.pinned("diffusers").startswith("diffusers==")
