"""Failures are data, errors are retried, bugs stop the build; the resume key covers versions; the ledger is checked."""

from __future__ import annotations

import json
import sqlite3

import pytest
from builder_helpers import ALL_CONFIGS, FAKE_STAGES, make_imagefolder, release_files, write_config

from builder.cli import main
from builder.config import load_config
from builder.engine import build
from builder.release_format.verify import verify_release

KEYS = [f"{c}_img_{i:03d}" for c in ("cat", "dog") for i in range(3)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_imagefolder(tmp_path_factory.mktemp("src"), ["cat", "dog"], per_class=3)


def _config(tmp_path, folder, trouble, **options):
    caption = {
        "name": "caption",
        "type": "tests.fake_stages:FlakyCaptionStage",
        "configs": ["reconstructed", "counterfactual", "lance_r"],
        "options": {"trouble_dir": str(trouble), **options},
    }
    path = write_config(
        tmp_path / "c.yaml", f"imagefolder:{folder}", stages=[caption, FAKE_STAGES[1]], configs=ALL_CONFIGS
    )
    return path


@pytest.fixture(scope="module")
def clean(tmp_path_factory, folder):
    """The same config built with nothing going wrong."""
    root = tmp_path_factory.mktemp("clean")
    (root / "trouble").mkdir()
    build(load_config(str(_config(root, folder, root / "trouble"))), root / "out", progress=False)
    return root / "out"


def _shards(out):
    return {k: v for k, v in release_files(out).items() if k.startswith("data/")}


def _ledger_count(out, table):
    with sqlite3.connect(out / ".lance-cf" / "ledger.sqlite") as db:
        return db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]


@pytest.mark.slow
def test_an_exception_is_an_error_retried_by_the_next_run(tmp_path, folder, clean, capsys):
    """Out of memory on 2 of 6 samples: recorded as errors (exit 1, summary names them); cause removed, the same
    command re-run retries exactly those, and the release equals a build where nothing went wrong."""
    trouble = tmp_path / "trouble"
    trouble.mkdir()
    for key in ("cat_img_001", "dog_img_002"):
        (trouble / key).touch()
    config = str(_config(tmp_path, folder, trouble))
    out = tmp_path / "out"
    command = ["build", config, "--output", str(out), "--no-progress"]
    assert main(command) == 1
    printed = capsys.readouterr().out
    assert "0 failure(s), 2 error(s)" in printed and "CUDA out of memory" in printed and "re-run the same" in printed
    manifest = json.loads((out / "manifest.json").read_text())
    assert [e["source_key"] for e in manifest["build"]["errors"]] == ["cat_img_001", "dog_img_002"]
    assert manifest["failures"] == [] and manifest["counts"]["original"]["total"] == 6
    assert manifest["counts"]["reconstructed"]["total"] == 4
    assert main(command) == 1  # the cause is still there: still errors, not failures
    capsys.readouterr()
    for path in trouble.iterdir():
        path.unlink()
    assert main(command) == 0
    assert "0 failure(s), 0 error(s)" in capsys.readouterr().out
    assert verify_release(out) == []
    assert _shards(out) == _shards(clean)  # the config differs only in the trouble_dir path


@pytest.mark.slow
def test_a_sample_failure_is_final_unless_retry_failures(tmp_path, folder, clean, capsys):
    trouble = tmp_path / "trouble"
    trouble.mkdir()
    (trouble / "dog_img_000").touch()
    calls = tmp_path / "calls.log"
    config = str(_config(tmp_path, folder, trouble, refuse=True, log_calls=str(calls)))
    out = tmp_path / "out"
    command = ["build", config, "--output", str(out), "--no-progress"]
    assert main(command) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert [(f["source_key"], f["reason"]) for f in manifest["failures"]] == [
        ("dog_img_000", "the caption model refused this image")
    ]
    (trouble / "dog_img_000").unlink()
    calls.write_text("")
    assert main(command) == 0  # final: not re-run
    assert calls.read_text() == ""
    assert json.loads((out / "manifest.json").read_text())["failures"] == manifest["failures"]
    assert main([*command, "--retry-failures"]) == 0
    # Its whole batch (batch size 4) runs the stage again, so the stage sees the batch a clean build gives it.
    assert [line.split()[0] for line in calls.read_text().splitlines()] == [*KEYS[:3], "dog_img_000"]
    assert json.loads((out / "manifest.json").read_text())["failures"] == []
    capsys.readouterr()
    assert _shards(out) == _shards(clean)  # the config differs (options), the samples do not


def test_a_programming_error_stops_the_build_and_is_not_data(tmp_path, folder):
    trouble = tmp_path / "trouble"
    trouble.mkdir()
    (trouble / "cat_img_002").touch()
    config = load_config(str(_config(tmp_path, folder, trouble, bug=True)))
    with pytest.raises(KeyError) as info:
        build(config, tmp_path / "out", progress=False)
    assert any("stage caption on the batch of" in n and "cat_img_002" in n for n in info.value.__notes__)
    assert _ledger_count(tmp_path / "out", "failures") == 0 and _ledger_count(tmp_path / "out", "errors") == 0


def test_stages_run_with_the_configured_torch_threads(tmp_path, folder):
    import torch

    trouble = tmp_path / "trouble"
    trouble.mkdir()
    calls = tmp_path / "calls.log"
    config = load_config(str(_config(tmp_path, folder, trouble, log_calls=str(calls))))
    before = torch.get_num_threads()
    manifest = build(config, tmp_path / "out", progress=False, torch_threads=2)
    assert {line.split()[1] for line in calls.read_text().splitlines()} == {"threads=2"}
    assert manifest["build"]["torch_threads"] == 2 and torch.get_num_threads() == before
    assert manifest["build"]["determinism"]["device"] == "cpu"


@pytest.mark.slow
def test_resume_across_a_version_change_is_refused_unless_allowed(tmp_path, folder, capsys):
    trouble = tmp_path / "trouble"
    trouble.mkdir()
    config = str(_config(tmp_path, folder, trouble))
    out = tmp_path / "out"
    command = ["build", config, "--output", str(out), "--no-progress"]
    assert main(command) == 0
    with sqlite3.connect(out / ".lance-cf" / "ledger.sqlite") as db:
        env = json.loads(db.execute("SELECT value FROM meta WHERE name='environment'").fetchone()[0])
        now = env["packages"]["torch"]
        env["packages"]["torch"] = "1.13.0"
        db.execute("UPDATE meta SET value=? WHERE name='environment'", (json.dumps(env),))
    capsys.readouterr()
    assert main(command) == 2
    err = capsys.readouterr().err
    assert f"torch 1.13.0 -> {now}" in err and "--allow-version-change" in err and len(err.strip().splitlines()) == 1
    assert main([*command, "--torch-threads", "2", "--allow-version-change"]) == 0
    changes = json.loads((out / "manifest.json").read_text())["build"]["version_changes"]
    assert {"name": "torch", "from": "1.13.0", "to": now} in changes
    assert {"name": "torch_threads", "from": 1, "to": 2} in changes


def test_one_changed_byte_in_a_stored_label_is_caught(tmp_path, folder, capsys):
    trouble = tmp_path / "trouble"
    trouble.mkdir()
    config = str(_config(tmp_path, folder, trouble))
    out = tmp_path / "out"
    command = ["build", config, "--output", str(out), "--no-progress"]
    assert main(command) == 0
    with sqlite3.connect(out / ".lance-cf" / "ledger.sqlite") as db:
        key, meta = db.execute("SELECT key, metadata FROM outputs WHERE config='original' ORDER BY key").fetchone()
        assert b'"label":0' in meta
        db.execute("UPDATE outputs SET metadata=? WHERE key=?", (meta.replace(b'"label":0', b'"label":1'), key))
    before = (out / "manifest.json").read_bytes()
    capsys.readouterr()
    assert main(command) == 2
    err = capsys.readouterr().err
    assert f"stored sample original/{key} does not match its checksum" in err and len(err.strip().splitlines()) == 1
    assert (out / "manifest.json").read_bytes() == before  # nothing released from it


def test_a_changed_stored_stage_output_is_caught_when_replayed(tmp_path, folder, capsys):
    trouble = tmp_path / "trouble"
    trouble.mkdir()
    config = str(_config(tmp_path, folder, trouble))
    out = tmp_path / "out"
    command = ["build", config, "--output", str(out), "--no-progress"]
    assert main(command) == 0
    with sqlite3.connect(out / ".lance-cf" / "ledger.sqlite") as db:
        payload = db.execute("SELECT payload FROM stage_outputs WHERE source_key='cat_img_000'").fetchone()[0]
        changed = payload.replace(b"photo", b"phato")
        db.execute("UPDATE stage_outputs SET payload=? WHERE source_key='cat_img_000' AND stage='caption'", (changed,))
        db.execute("DELETE FROM done_batches")  # the batch replays its stored outputs
    capsys.readouterr()
    assert main(command) == 2
    assert "stored output of stage caption for cat_img_000 does not match its checksum" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"this is not a database at all" * 200, "is not a lance-cf ledger"),
        ("sqlite-foreign", "is a SQLite database of something else"),
    ],
)
def test_corrupt_or_foreign_ledger_is_one_line(tmp_path, folder, capsys, content, expected):
    ledger = tmp_path / "out" / ".lance-cf" / "ledger.sqlite"
    ledger.parent.mkdir(parents=True)
    if content == "sqlite-foreign":
        with sqlite3.connect(ledger) as db:
            db.execute("CREATE TABLE photos (path TEXT)")
    else:
        ledger.write_bytes(content)
    before = ledger.read_bytes()
    config = str(_config(tmp_path, folder, tmp_path))
    assert main(["build", config, "--output", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert expected in err and "move" in err and len(err.strip().splitlines()) == 1
    assert ledger.read_bytes() == before  # nothing lost
