"""The first hour of a new user, after the demo: what the tool says when something is not as expected (a typo, a
changed config, an unfinished build, a label space of one's own), and progress that agrees with itself."""

from __future__ import annotations

import io
import logging
import re

import pytest
from builder_helpers import ALL_CONFIGS, FAKE_STAGES, make_imagefolder, write_config

from builder.cli import build_parser, main
from builder.config import list_presets, load_config
from builder.engine import BuildRefused, build
from tests.fake_stages import GatedCaptionStage


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_imagefolder(tmp_path_factory.mktemp("src"), ["cat", "dog"], per_class=3)


def test_a_top_level_typo_is_named_with_did_you_mean(tmp_path, capsys):
    config = write_config(tmp_path / "c.yaml", "demo", sead=1)
    assert main(["validate", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("unknown field 'sead'; did you mean 'seed'?") and len(err.splitlines()) == 1


def test_a_refused_resume_says_what_changed(tmp_path, folder):
    out = tmp_path / "out"
    stages = [{**FAKE_STAGES[0], "configs": ["reconstructed"]}, {**FAKE_STAGES[1], "configs": ["reconstructed"]}]
    first = write_config(tmp_path / "a.yaml", f"imagefolder:{folder}", stages=stages, configs=["reconstructed"])
    build(load_config(str(first)), out, progress=False)
    stages[0]["options"] = {"delay": 0.5}
    changed = write_config(tmp_path / "b.yaml", f"imagefolder:{folder}", stages=stages, configs=["reconstructed"],
                           seed=3)  # fmt: skip
    with pytest.raises(BuildRefused) as refused:
        build(load_config(str(changed)), out, progress=False)
    # Options are compared by their effective value: the first build's delay was its default, 0.0.
    assert "seed: 0 -> 3" in str(refused.value) and "stages[caption].options.delay: 0.0 -> 0.5" in str(refused.value)
    stages[0]["options"] = {}
    version = write_config(tmp_path / "v.yaml", f"imagefolder:{folder}", stages=stages, configs=["reconstructed"],
                           version="1.1.0")  # fmt: skip
    with pytest.raises(BuildRefused, match=r"only the release version differs \('1.0.0' -> '1.1.0'\)") as refused:
        build(load_config(str(version)), out, progress=False)
    assert "resume with the original --version" in str(refused.value)


def test_verify_of_an_unfinished_build_says_to_re_run_it(tmp_path, capsys):
    (tmp_path / "out" / ".lance-cf").mkdir(parents=True)  # a build that stopped before its manifest was written
    assert main(["verify", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert "this build has not finished" in err and "re-run" in err and len(err.splitlines()) == 1


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _bars(text: str) -> list[tuple[str, int, int, int]]:
    """Every progress bar tqdm drew: (label, percent, count, total)."""
    found = []
    for line in re.split(r"[\r\n]", text):
        match = re.search(r"(\w+)\s*:\s+(\d+)%\|.*?\| (\d+)/(\d+)", line)
        if match:
            found.append((match.group(1), int(match.group(2)), int(match.group(3)), int(match.group(4))))
    return found


def test_progress_on_a_terminal_is_one_bar_per_stage_whose_percent_matches_its_count(tmp_path, folder, monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    config = write_config(tmp_path / "c.yaml", f"imagefolder:{folder}", stages=FAKE_STAGES, configs=ALL_CONFIGS,
                          batch_size=4)  # fmt: skip
    build(load_config(str(config)), tmp_path / "out", progress=True)
    bars = _bars(terminal.getvalue())
    assert {label for label, *_ in bars} >= {"images", "caption", "edit"}
    for label, percent, count, total in bars:
        assert total == 6 and percent == round(100 * count / total), (label, percent, count, total)
    assert ("caption", 100, 6, 6) in bars and ("images", 100, 6, 6) in bars


def test_progress_elsewhere_is_plain_log_lines_and_a_resume_says_so(tmp_path, folder, caplog):
    trouble = tmp_path / "trouble"
    trouble.mkdir()
    (trouble / "dog_img_002").write_text("")  # this sample raises: its batch is retried by the next run
    caption = {"name": "caption", "type": "tests.fake_stages:FlakyCaptionStage", "configs": ["reconstructed"],
               "options": {"trouble_dir": str(trouble)}}  # fmt: skip
    stages = [caption, {**FAKE_STAGES[1], "configs": ["reconstructed"]}]
    config = load_config(str(write_config(tmp_path / "c.yaml", f"imagefolder:{folder}", stages=stages,
                                          configs=["reconstructed"], batch_size=3)))  # fmt: skip
    with caplog.at_level(logging.INFO, logger="builder.engine"):
        build(config, tmp_path / "out", progress=True)  # pytest's stderr is not a terminal
    plain = [r.getMessage() for r in caplog.records if "images done" in r.getMessage()]
    assert plain == [
        "build test-release: 3/6 images done (50%), batch 0 finished; failed 0, errors 0",
        "build test-release: 6/6 images done (100%), batch 1 finished; failed 0, errors 1",
    ]
    caplog.clear()
    (trouble / "dog_img_002").unlink()
    with caplog.at_level(logging.INFO, logger="builder.engine"):
        build(config, tmp_path / "out", progress=True)
    assert "resuming: 3 of 6 samples already done, 1 batch(es) to go" in caplog.text


def test_presets_show_comments_every_key_and_build_help_names_every_preset(capsys):
    for name in list_presets():
        assert main(["presets", "--show", name]) == 0
        for line in capsys.readouterr().out.splitlines():
            if line.strip() and not line.startswith("#"):
                assert "  # " in line, f"{name}: {line}"
    text = build_parser()._subparsers._group_actions[0].choices["build"].format_help()
    assert all(re.search(rf"^  {re.escape(name)}\s+\S", text, re.M) for name in list_presets())


def test_class_map_for_a_label_space_of_ones_own(tmp_path, capsys, monkeypatch):
    from evaluation.models import load_class_map

    photos = make_imagefolder(tmp_path / "photos", ["cat", "tabby cat", "golden retriever"], per_class=1)
    out = tmp_path / "pets"
    build(load_config(str(write_config(tmp_path / "c.yaml", f"imagefolder:{photos}"))), out, progress=False)
    class_map = tmp_path / "pets.classmap.txt"
    assert main(["class-map", str(out), "--output", str(class_map)]) == 0
    said = capsys.readouterr().out
    assert "2 of 3 classes matched" in said and "--class-map" in said
    lines = [line for line in class_map.read_text().splitlines() if not line.startswith("#")]
    assert lines == ["CHOOSE", "207", "281"]  # cat: a choice; golden retriever, tabby cat: by name
    assert "281 'tabby cat'" in class_map.read_text()  # among cat's candidates
    with pytest.raises(ValueError, match=r"entry 0 \('CHOOSE'\) is not a model output index"):
        load_class_map(class_map, 3)
    class_map.write_text(re.sub(r"^CHOOSE$", "285", class_map.read_text(), flags=re.M))  # the user's choice
    assert load_class_map(class_map, 3) == [285, 207, 281]
    # running it again never overwrites the edited map: refused for an --output that exists, a new name by default
    assert main(["class-map", str(out), "--output", str(class_map)]) == 2
    assert "exists (it may hold your edits)" in capsys.readouterr().err
    assert load_class_map(class_map, 3) == [285, 207, 281]
    monkeypatch.chdir(tmp_path)
    assert main(["class-map", str(out)]) == 0 and main(["class-map", str(out)]) == 0
    made = sorted(p.name for p in tmp_path.glob("*.classmap*.txt") if p != class_map)
    assert made == ["test-release.classmap-2.txt", "test-release.classmap.txt"], made
    capsys.readouterr()
    assert main(["class-map", str(out), "--output", str(class_map), "--force"]) == 0  # asked for: overwritten
    assert "CHOOSE" in class_map.read_text()

    synsets = make_imagefolder(tmp_path / "synsets", ["n02123045", "n02099601"], per_class=1)
    build(load_config(str(write_config(tmp_path / "s.yaml", f"imagefolder:{synsets}"))), tmp_path / "s",
          progress=False)  # fmt: skip
    assert main(["class-map", str(tmp_path / "s")]) == 0
    assert "eval needs no --class-map" in capsys.readouterr().out


class _SetOnHeartbeat(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if "stage caption running for" in record.getMessage() and "3/6 images done" in record.getMessage():
            GatedCaptionStage.GATE.set()  # the held (second) batch was named: let it go


def test_off_a_terminal_a_long_batch_says_what_runs_at_every_heartbeat(tmp_path, folder, monkeypatch, caplog):
    """The stage holds its batch until a heartbeat line has named it (a barrier, no clock): never silent."""
    import threading

    monkeypatch.setenv("LANCE_CF_HEARTBEAT_SECONDS", "0.01")
    monkeypatch.setattr(GatedCaptionStage, "GATE", threading.Event())
    caption = {"name": "caption", "type": "tests.fake_stages:GatedCaptionStage", "configs": ["reconstructed"],
               "options": {"hold_keys": ["dog_img_002"]}}  # fmt: skip
    stages = [caption, {**FAKE_STAGES[1], "configs": ["reconstructed"]}]
    config = load_config(str(write_config(tmp_path / "c.yaml", f"imagefolder:{folder}", stages=stages,
                                          configs=["reconstructed"], batch_size=3)))  # fmt: skip
    handler = _SetOnHeartbeat()
    logging.getLogger("builder.engine").addHandler(handler)
    try:
        with caplog.at_level(logging.INFO, logger="builder.engine"):
            build(config, tmp_path / "out", progress=True)  # pytest's stderr is not a terminal
    finally:
        logging.getLogger("builder.engine").removeHandler(handler)
    beats = [r.getMessage() for r in caplog.records if "stage caption running for" in r.getMessage()]
    pattern = r"build test-release: stage caption running for \d+ s; 3/6 images done \(50%\), \d+ s since start"
    assert any(re.fullmatch(pattern, beat) for beat in beats), beats


@pytest.mark.slow
def test_a_terminated_build_says_what_was_kept_and_how_to_resume(tmp_path, folder):
    """SIGTERM while a stage runs (known through a named pipe, no clock): one line says how many images are kept and
    that the same command resumes; the exit status is 143."""
    import os
    import signal
    import subprocess
    import sys

    from builder_helpers import REPO

    fifo = tmp_path / "running"
    os.mkfifo(fifo)
    caption = {"name": "caption", "type": "tests.fake_stages:GatedCaptionStage", "configs": ["reconstructed"],
               "options": {"hold_keys": ["dog_img_002"], "fifo": str(fifo)}}  # fmt: skip
    stages = [caption, {**FAKE_STAGES[1], "configs": ["reconstructed"]}]
    config = write_config(tmp_path / "c.yaml", f"imagefolder:{folder}", stages=stages, configs=["reconstructed"],
                          batch_size=3)  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}", "LANCE_CF_ALLOW_CODE": "1"}
    argv = [sys.executable, "-m", "builder.cli", "build", str(config), "--output", str(tmp_path / "out")]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    with open(fifo) as pipe:  # blocks until the stage holds the second batch
        assert pipe.readline() == "running\n"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate()
    assert proc.returncode == 143, err
    assert "stopped (SIGTERM): 3 of 6 images were finished and are kept in" in err, err
    assert "lance-cf build: stopped (SIGTERM); re-run the same command to resume" in err
