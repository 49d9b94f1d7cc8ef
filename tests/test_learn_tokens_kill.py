"""`interfaces learn-tokens` killed with SIGKILL between a class's token file and the index that lists it, in a real
process: the resumed run's folder equals an uninterrupted run's, and a second learn-tokens into the same folder at
the same time is refused with the holder's pid. The killed run (the lock's holder) is a process; the uninterrupted,
refused and resumed runs are the same command in this process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from builder_helpers import cli, env, make_imagefolder

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _command(photos, out, tiny_sd_dir):
    return [sys.executable, "-m", "builder.cli", "interfaces", "learn-tokens", "--source", f"imagefolder:{photos}",
            "--output", str(out), "--model", str(tiny_sd_dir), "--steps", "2", "--resolution", "32", "--no-progress",
            "--device", "cpu"]  # fmt: skip


def _folder(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file() and not p.name.startswith(".")}


@pytest.mark.e2e  # runs lance-cf as a process
def test_kill_between_token_file_and_index_resumes_to_the_uninterrupted_folder(tiny_sd_dir, tmp_path):
    photos = make_imagefolder(tmp_path / "photos", ["n01440764", "n01443537", "n01484850"], 2)
    clean = tmp_path / "clean"
    from builder.cli import main

    assert main(_command(photos, clean, tiny_sd_dir)[3:]) == 0  # the uninterrupted run, in this process

    out = tmp_path / "killed"
    out.mkdir()
    # The index is written to this temporary name and then renamed. As a FIFO with no reader, opening it blocks: the
    # process stops right after writing the first class's token file, before its index entry exists.
    fifo = out / ".tokens.json.tmp"
    os.mkfifo(fifo)
    proc = subprocess.Popen(_command(photos, out, tiny_sd_dir), env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)  # fmt: skip
    while proc.poll() is None and not (out / "0.safetensors").exists():
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    # A second run into the folder while the first holds it is refused at once, naming the holder.
    second = cli(*_command(photos, out, tiny_sd_dir)[3:], check=False)
    assert second.returncode == 2 and f"pid {proc.pid}" in second.stderr
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (out / "0.safetensors").exists() and not (out / "tokens.json").exists()  # between the two writes
    fifo.unlink()

    resumed = cli(*_command(photos, out, tiny_sd_dir)[3:], check=False)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming with 2" in resumed.stderr  # class 0 was kept, not learned again
    assert _folder(out) == _folder(clean)
    assert sorted(json.loads((out / "tokens.json").read_text())["classes"]) == ["0", "1", "2"]
