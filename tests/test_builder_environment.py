"""Environment faults and concurrency: one line naming the input and the fix, nothing lost, one process per output.

Concurrency runs REAL processes (subprocess ``lance-cf build``), not threads. Disk-full and read-only cases mount a
small tmpfs / a read-only bind mount, so they need root; otherwise they are skipped with that reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest
from builder_helpers import (
    ALL_CONFIGS,
    FAKE_STAGES,
    REPO,
    cli,
    env,
    make_imagefolder,
    process_held_at,
    release_files,
    write_config,
)

from builder.cli import main
from builder.release_format.lock import lock_holder

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="mounting a tmpfs / read-only bind mount needs root")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_imagefolder(tmp_path_factory.mktemp("src"), ["cat", "dog"], per_class=4, size=(64, 64))


def _config(tmp_path, folder, delay: float = 0.0, hold: str | None = None):
    caption_options = {"delay": delay} if hold is None else {"delay": delay, "hold": hold}
    stages = [FAKE_STAGES[0] | {"options": caption_options}, FAKE_STAGES[1]]
    return str(
        write_config(tmp_path / "c.yaml", f"imagefolder:{folder}", stages=stages, configs=ALL_CONFIGS, batch_size=2)
    )


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


# -- the output-directory lock --------------------------------------------------------------------------------------
@pytest.mark.e2e  # runs lance-cf as a process
def test_a_second_build_verify_of_a_directory_in_use_is_refused_naming_the_pid(tmp_path, folder):
    hold = tmp_path / "hold"
    os.mkfifo(hold)
    config = _config(tmp_path, folder, hold=str(hold))  # the build waits in its first batch until the test is done
    out = tmp_path / "out"
    first = subprocess.Popen(
        [sys.executable, "-m", "builder.cli", "build", config, "--output", str(out), "--no-progress"],
        env=env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with process_held_at(hold, first):  # the first build holds the directory and is inside a batch
            assert lock_holder(out) == {"pid": first.pid, "command": "build"}
            for args in (["build", config, "--output", str(out)], ["verify", str(out)]):
                proc = cli(*args, check=False)
                assert proc.returncode == 2, proc.stderr
                assert f"is in use by lance-cf pid {first.pid} (build)" in proc.stderr
                assert len(proc.stderr.strip().splitlines()) == 1
    finally:
        stdout, stderr = first.communicate()
    assert first.returncode == 0, stderr
    assert lock_holder(out) is None
    cli("verify", str(out))  # free again


@pytest.mark.e2e  # runs lance-cf as a process
def test_concurrent_builds_of_one_directory_one_wins_the_other_is_refused(tmp_path, folder):
    """Two builds started together (same or different config): exactly one builds, the other exits 2 with the
    lock message, and the release verifies and equals a lone build."""
    other = tmp_path / "other"
    other.mkdir()
    same = _config(tmp_path, folder, delay=0.3)
    different = str(write_config(other / "c.yaml", f"imagefolder:{folder}", image_size=16, stages=[]))
    lone = tmp_path / "lone"
    cli("build", same, "--output", str(lone), "--no-progress")
    for second in (same, different):
        out = tmp_path / f"out-{uuid.uuid4().hex[:6]}"
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "builder.cli", "build", c, "--output", str(out), "--no-progress"],
                env=env(),
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for c in (same, second)
        ]
        results = [p.communicate(timeout=600) + (p.returncode,) for p in procs]
        codes = sorted(r[2] for r in results)
        refused = [r for r in results if r[2] != 0]
        if codes == [0, 0]:  # the second started after the first had finished: then it resumed (same) or ...
            assert second == same
        else:
            assert codes == [0, 2], results
            assert (
                "is in use by lance-cf pid" in refused[0][1] or "holds a build of a different config" in refused[0][1]
            )
        winner_config = same if results[0][2] == 0 else second
        cli("verify", str(out))
        if winner_config == same:
            assert release_files(out) == release_files(lone)


# -- one-line errors for the environment ----------------------------------------------------------------------------
def test_output_that_is_a_file(tmp_path, folder, capsys):
    target = tmp_path / "release.tar"
    target.write_bytes(b"keep me")
    assert main(["build", _config(tmp_path, folder), "--output", str(target), "--no-progress"]) == 2
    assert "is a file; give a directory" in _one_line(capsys)
    assert target.read_bytes() == b"keep me"


def test_device_cuda_without_a_gpu_is_one_line_before_anything_is_written(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "out"
    assert main(["build", "demo", "--output", str(out), "--device", "cuda", "--no-progress"]) == 2
    assert "--device cuda: no CUDA GPU is visible" in _one_line(capsys)
    assert not out.exists()
    assert main(["build", "demo", "--output", str(out), "--device", "cuda:zero"]) == 2
    assert "is not a torch device" in _one_line(capsys) and not out.exists()


@pytest.mark.parametrize(
    ("yaml_text", "expected"),
    [
        ("version: 1.0", "version 1.0: expected a semantic version such as 1.0.0 (quote it"),
        ("name: 123", "name 123: use a string"),
        ("configs: original", "configs 'original': expected a list of config names"),
        ("source_options: [classes, 3]", "source_options must be a mapping"),
        (
            "stages: [{name: caption, type: blip2_captioner, configs: [counterfactual], options: [model, x]}]",
            "stage 'caption': options must be a mapping",
        ),
        ("stages: {name: caption}", "stages must be a list"),
        ("limit: true", "limit True: expected an integer >= 1 or null"),
    ],
)
def test_mistyped_yaml_values_are_one_line_naming_the_key(tmp_path, capsys, yaml_text, expected):
    path = tmp_path / "c.yaml"
    given = yaml_text.split(":")[0]  # a key given twice is refused before its type is looked at
    base = [line for line in ("name: x", "source: demo", "configs: [original]") if not line.startswith(given + ":")]
    path.write_text("\n".join([*base, yaml_text]) + "\n")
    assert main(["validate", str(path)]) == 2
    assert expected in _one_line(capsys)
    assert main(["build", str(path), "--output", str(tmp_path / "out")]) == 2
    assert expected in _one_line(capsys) and not (tmp_path / "out").exists()


@needs_root
def test_read_only_output_is_one_line(tmp_path, folder, capsys):
    src, ro = tmp_path / "src-dir", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    subprocess.run(["mount", "--bind", str(src), str(ro)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], check=True)
        assert main(["build", _config(tmp_path, folder), "--output", str(ro / "out"), "--no-progress"]) == 2
        err = _one_line(capsys)
        assert "read-only" in err and "writable --output" in err
    finally:
        subprocess.run(["umount", str(ro)], check=True)


@pytest.mark.slow
@needs_root
def test_disk_full_then_freed_resumes_byte_identical(tmp_path, folder, capsys):
    """The build runs out of space (ledger or shards); after space is freed, the same command finishes and the
    release equals one built with room to spare."""
    config = _config(tmp_path, folder)
    roomy = tmp_path / "roomy"
    assert main(["build", config, "--output", str(roomy), "--no-progress"]) == 0
    capsys.readouterr()
    used = sum(p.stat().st_size for p in roomy.rglob("*") if p.is_file())
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={used // 2}", "tmpfs", str(mount)], check=True)
    try:
        out = mount / "out"
        assert main(["build", config, "--output", str(out), "--no-progress"]) == 2
        err = _one_line(capsys)
        assert "no space left on the device" in err and "re-run the same command" in err
        subprocess.run(["mount", "-o", f"remount,size={used * 4}", str(mount)], check=True)
        assert main(["build", config, "--output", str(out), "--no-progress"]) == 0
        capsys.readouterr()
        assert release_files(out) == release_files(roomy)
        cli("verify", str(out))
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["failures"] == [] and manifest["build"]["errors"] == []
    finally:
        shutil.rmtree(mount / "out", ignore_errors=True)
        subprocess.run(["umount", str(mount)], check=True)
