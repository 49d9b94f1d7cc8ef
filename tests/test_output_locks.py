"""Every command that writes a directory holds its lock for its whole life, through one mechanism: its parser declares
what it writes (``builder.release_format.lock.declare_output``) and ``lance-cf`` takes the lock before the command
runs. A second writer is refused at once naming the first one's pid; a subcommand that declares nothing fails here.

The first writer is a real second process holding the lock (``builder_helpers.lock_held_by_another_process``): the
held lock is the barrier, nothing waits on a clock.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os

import pytest
from builder_helpers import lock_held_by_another_process, make_imagefolder
from release_fixture import write_release

from builder.cli import build_parser, main
from builder.release_format.lock import NO_OUTPUT, OutputLocked, WritesOutput, output_lock


def _leaves(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _leaves(sub, (*prefix, name))
            return
    yield " ".join(prefix), parser


def test_every_subcommand_declares_what_it_writes():
    undeclared = [name for name, parser in _leaves(build_parser()) if "writes" not in parser._defaults]
    assert undeclared == [], "declare each with builder.release_format.lock.declare_output"
    declared = {name: parser._defaults["writes"] for name, parser in _leaves(build_parser())}
    writers = {name for name, w in declared.items() if w is not NO_OUTPUT}
    assert all(isinstance(w, WritesOutput) for w in declared.values())
    # every command that writes a directory, and the commands that write one file (their folder is held)
    assert writers == {
        "build",
        "models download",
        "class-map",
        "perturber collect",
        "perturber train",
        "perturber eval",
        "interfaces calibrate",
        "interfaces learn-tokens",
        "eval",
        "leaderboard",
        "compare-editors",
        "add-comparison",
        "discover",
        "review",
        "export clip-benchmark",
    }


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lock-inputs")
    release = write_release(root / "release", labels=(0, 1), originals_per_class=1, edits_per_original=1, image_size=16)
    photos = make_imagefolder(root / "photos", ["cat", "dog"], 1)
    captions = root / "captions.jsonl"
    captions.write_text(json.dumps({"caption": "a cat", "label": "cat"}) + "\n")
    results = root / "results"
    results.mkdir()
    release2 = write_release(root / "release2", labels=(0, 1), originals_per_class=1, edits_per_original=1, seed=1)
    return {"release": release, "release2": release2, "photos": photos, "captions": captions, "results": results}


# (command, the directory it writes from the test's output folder D, its arguments)
WRITERS = {
    "build": lambda i, d: ["build", "demo", "--output", str(d)],
    "models download": lambda i, d: ["models", "download", "demo", "--local-dir", str(d)],
    "class-map": lambda i, d: ["class-map", str(i["release"]), "--output", str(d / "map.txt")],
    "perturber collect": lambda i, d: ["perturber", "collect", "--captions-file", str(i["captions"]), "--teacher", "t", "--output", str(d)],
    "perturber train": lambda i, d: ["perturber", "train", "--model", "m", "--data", str(i["captions"]), "--output", str(d)],
    "perturber eval": lambda i, d: ["perturber", "eval", "--captions-file", str(i["captions"]), "--model", "m", "--output", str(d / "e.json")],
    "interfaces calibrate": lambda i, d: ["interfaces", "calibrate", "--source", f"imagefolder:{i['photos']}", "--output", str(d / "t.json")],
    "interfaces learn-tokens": lambda i, d: ["interfaces", "learn-tokens", "--source", f"imagefolder:{i['photos']}", "--output", str(d)],
    "eval": lambda i, d: ["eval", "--release", str(i["release"]), "--model", "test_vit", "--no-pretrained", "--output", str(d)],
    "leaderboard": lambda i, d: ["leaderboard", str(i["results"]), "--output", str(d)],
    "compare-editors": lambda i, d: ["compare-editors", "--release", str(i["release"]), "--release", str(i["release2"]), "--output", str(d)],
    "add-comparison": lambda i, d: ["add-comparison", str(i["release"]), str(i["results"]), "--output", str(d)],
    "discover": lambda i, d: ["discover", "--release", str(i["release"]), "--model", "test_vit", "--output", str(d)],
    "review apply": lambda i, d: ["review", "apply", str(i["release"]), "--output", str(d)],
    "review export": lambda i, d: ["review", "export", str(i["release"]), "--output", str(d / "x.csv")],
}  # fmt: skip


@pytest.mark.parametrize("command", list(WRITERS))
def test_a_second_writer_is_refused_naming_the_first_ones_pid(command, inputs, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    before = sorted(p.name for p in out.iterdir())
    with lock_held_by_another_process(out, "build") as pid:
        code = main(WRITERS[command](inputs, out))
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{out} is in use by lance-cf pid {pid} (build)" in err, err
    assert sorted(p.name for p in out.iterdir() if p.name != ".lance-cf") == before  # nothing written


def test_the_folders_made_to_hold_the_lock_are_removed_when_the_command_leaves_them_empty(tmp_path, capsys):
    out = tmp_path / "new" / "out"
    # an option error inside the command (after the lock): the folders made to hold the lock go again
    assert main(["review", "apply", str(tmp_path / "nowhere"), "--output", str(out)]) == 2
    assert "nowhere" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def _locked(directory) -> bool:
    """Whether ``directory``'s lock is held: a new open file description asks the kernel for it (never waits)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def test_a_command_may_take_the_lock_its_cli_already_holds(tmp_path):
    with output_lock(tmp_path, "eval"):
        with output_lock(tmp_path, "eval"), output_lock(tmp_path, "verify", shared=True):
            assert _locked(tmp_path)
        assert _locked(tmp_path)  # the inner blocks did not release the outer one's hold
    assert not _locked(tmp_path)  # released by the outer block only
    with output_lock(tmp_path, "build"):
        pass


def test_a_waiting_hold_takes_the_lock_when_the_holder_leaves_and_a_plain_one_is_refused(tmp_path):
    """``wait=True`` (one shared build that several processes need) blocks at the kernel lock instead of refusing;
    it gets the directory only after the other process has let go."""
    import threading

    from builder_helpers import lock_held_by_another_process

    taken: list[bool] = []
    leaving = threading.Event()  # set just before the holder is told to let go

    def take() -> None:
        with output_lock(tmp_path, "build", wait=True):  # an OutputLocked here leaves `taken` empty
            taken.append(leaving.is_set())

    with lock_held_by_another_process(tmp_path, "build"):
        with pytest.raises(OutputLocked, match="in use by lance-cf pid"):
            with output_lock(tmp_path, "build"):
                pass
        waiter = threading.Thread(target=take)
        waiter.start()
        leaving.set()
    waiter.join()
    # The waiter got the lock, and not while the other process held it (it would have recorded False).
    assert taken == [True]


def test_a_shared_test_release_is_built_once_and_a_write_into_it_is_named(tmp_path):
    """The suite's ``shared_release`` (tests/conftest.py): a second request finds the first build (under the lock's
    waiting mode), and a file changed afterwards is named by the end-of-session check."""
    from conftest import SharedReleases

    builds = []

    def build_into(folder):
        builds.append(folder)
        folder.mkdir()
        (folder / "data").mkdir()
        (folder / "data" / "shard.tar").write_bytes(b"shard")
        (folder / "manifest.json").write_text("{}")  # written last, as the engine does

    releases = SharedReleases(tmp_path)
    first = releases._once("r", build_into)
    assert releases._once("r", build_into) == first and len(builds) == 1
    assert releases.check_unchanged() == []
    (first / "data" / "shard.tar").write_bytes(b"changed")
    assert releases.check_unchanged() == ["r/data/shard.tar"]


def test_a_writer_refused_before_the_holder_wrote_its_note_still_names_the_holders_pid(tmp_path):
    """The holder writes its note (pid, command) just after it takes the kernel lock; a second writer refused in that
    moment finds no note. The pid comes from the kernel's lock table then: the note is removed here while the other
    process holds the lock, which is that moment held still."""
    from builder.release_format.layout import WORK_DIR
    from builder.release_format.lock import LOCK_INFO, lock_holder

    with lock_held_by_another_process(tmp_path, "build") as pid:
        (tmp_path / WORK_DIR / LOCK_INFO).unlink()
        with pytest.raises(OutputLocked, match=f"in use by lance-cf pid {pid};"):
            with output_lock(tmp_path, "build"):
                pass
        assert lock_holder(tmp_path) == {"pid": pid, "command": None}
        # a note left by an earlier holder (another pid) is not believed: the kernel's pid wins
        (tmp_path / WORK_DIR / LOCK_INFO).write_text(json.dumps({"pid": pid + 1, "command": "eval"}))
        with pytest.raises(OutputLocked, match=f"in use by lance-cf pid {pid};"):
            with output_lock(tmp_path, "build"):
                pass
