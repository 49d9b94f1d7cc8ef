"""Adversarial checks of the builder spine, as a sceptical user would run them.

Odd source layouts, mutated image files, malformed WebDataset and `datasets` sources, builds killed while they write
shards and the manifest, flipped bytes, and every subcommand's help and errors. The ``xfail(strict=True)`` cases are
known defects: each one starts passing (and so fails the suite) once the builder is fixed, and then loses its marker.
"""

from __future__ import annotations

import io
import json
import os
import random
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from builder_helpers import FAKE_STAGES, cli, env, make_imagefolder, photo, release_files, write_config
from PIL import Image

from builder.cli import build_parser, main
from builder.config import load_config
from builder.engine import build
from builder.images import ImageDecodeError, decode_image
from builder.ledger import Ledger
from builder.release_format import is_valid_key
from builder.release_format.verify import verify_release
from builder.sources import create_source


def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def _build(tmp_path: Path, source: str, name: str = "out", **fields) -> tuple[Path, dict]:
    cfg = write_config(tmp_path / f"{name}.yaml", source, **fields)
    out = tmp_path / name
    return out, build(load_config(str(cfg)), out, progress=False)


# -- imagefolder: names a real photo collection has ---------------------------------------------------------------------
def test_imagefolder_odd_names_keep_every_file_with_distinct_keys(tmp_path):
    src = tmp_path / "src"
    files = {
        "my cat": ["a b.png", "x.y.z.png", "ünïcødé 猫.png", "same.png", "same.jpg", "UPPER.JPG", "deep/er/same.png"],
        "dög.class": ["one.png"],
        "empty": [],
        "zebra": ["z.png"],
    }
    for seed, (cls, names) in enumerate(files.items()):
        (src / cls).mkdir(parents=True)
        for i, name in enumerate(names):
            path = src / cls / name
            path.parent.mkdir(parents=True, exist_ok=True)
            photo(seed * 100 + i).save(path, format="JPEG" if name.lower().endswith(".jpg") else "PNG")
    photo(999).save(tmp_path / "outside.png")
    os.symlink(tmp_path / "outside.png", src / "zebra" / "linked.png")  # a symlinked file is a sample like any other

    out, manifest = _build(tmp_path, f"imagefolder:{src}")
    # An empty class folder still takes its sorted index: labels do not shift when a class happens to be empty.
    assert manifest["label_space"]["names"] == ["dög.class", "empty", "my cat", "zebra"]
    assert manifest["failures"] == []
    assert manifest["counts"]["original"]["by_class"] == {"0": 1, "2": 7, "3": 2}
    assert verify_release(out) == []

    import datasets

    ds = datasets.load_dataset(str(out), "original", split="test", cache_dir=str(tmp_path / "hf"))
    keys = [row["__key__"] for row in ds]
    assert len(set(keys)) == len(keys) == 10 and all(is_valid_key(k) for k in keys)
    assert {row["json"]["label_name"] for row in ds} == {"dög.class", "my cat", "zebra"}
    # Same stem, different extension or folder: three distinct samples, none overwritten.
    assert sum(k.startswith("my_cat_same") for k in keys) == 3


def test_imagefolder_file_that_cannot_be_read_is_a_failure_not_a_silent_drop(tmp_path):
    src = make_imagefolder(tmp_path / "src", ["a"], per_class=2)
    os.symlink(tmp_path / "gone.png", src / "a" / "broken.png")
    _, manifest = _build(tmp_path, f"imagefolder:{src}")
    assert manifest["counts"]["original"]["total"] + len(manifest["failures"]) == 3


def test_unreadable_class_folder_is_an_error_not_a_silent_drop(tmp_path, monkeypatch):
    src = make_imagefolder(tmp_path / "src", ["a", "b"], per_class=2)
    real_scandir = os.scandir

    def denied(path="."):  # as root chmod 000 does not deny; this is what a non-root user gets
        if Path(path) == src / "b":
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", denied)
    try:
        source = create_source(f"imagefolder:{src}")
    except (ValueError, OSError) as err:  # refusing the source, naming the folder, is fine too
        assert str(src / "b") in str(err)
        return
    # Its images cannot be listed, but the folder itself becomes an entry whose problem is recorded as a failure.
    problems = {s.origin: s.problem for s in source.samples if s.problem}
    assert problems == {str(src / "b"): "unreadable folder: Permission denied"}
    assert len(source.samples) == 3


# -- decoding: every odd mode converts, every mutated file fails cleanly -----------------------------------------------
def test_every_pillow_mode_and_exif_orientation_decodes_to_rgb():
    base = photo(3, (40, 24))
    variants = {
        "1": _encode(base.convert("1"), "PNG"),
        "L": _encode(base.convert("L"), "PNG"),
        "LA": _encode(base.convert("LA"), "PNG"),
        "P": _encode(base.convert("P"), "PNG"),
        "P-gif": _encode(base.convert("P"), "GIF"),
        "RGBA": _encode(base.convert("RGBA"), "PNG"),
        "I;16": _encode(Image.fromarray(np.full((24, 40), 50000, dtype=np.uint16)), "PNG"),
        "I": _encode(Image.fromarray(np.full((24, 40), 70000, dtype=np.int32)), "TIFF"),
        "F": _encode(Image.fromarray(np.full((24, 40), 0.5, dtype=np.float32)), "TIFF"),
        "CMYK-jpeg": _encode(base.convert("CMYK"), "JPEG"),
        "CMYK-tiff": _encode(base.convert("CMYK"), "TIFF"),
        "bmp": _encode(base, "BMP"),
        "webp": _encode(base, "WEBP", lossless=True),
        "ppm": _encode(base, "PPM"),
    }
    for name, data in variants.items():
        img = decode_image(data, image_size=None)
        assert img.mode == "RGB" and img.size == (40, 24), name
    # EXIF orientations 5-8 swap width and height on display; 1-4 do not.
    for orientation in range(1, 9):
        exif = Image.Exif()
        exif[0x0112] = orientation
        img = decode_image(_encode(base, "JPEG", exif=exif.tobytes()), image_size=None)
        assert img.size == ((24, 40) if orientation >= 5 else (40, 24)), orientation


def test_mutated_files_of_every_format_fail_only_with_a_reason():
    """Random byte flips, cuts and insertions: decoding either works or raises ImageDecodeError, never anything else."""
    exif = Image.Exif()
    exif[0x0112] = 6
    seeds = {
        "PNG": _encode(photo(1), "PNG"),
        "JPEG": _encode(photo(2), "JPEG", exif=exif.tobytes()),
        "GIF": _encode(photo(3), "GIF"),
        "TIFF": _encode(photo(4), "TIFF"),
        "BMP": _encode(photo(5), "BMP"),
        "WEBP": _encode(photo(6), "WEBP"),
    }
    rng = random.Random(0)
    failed = 0
    for _ in range(600):
        fmt = rng.choice(sorted(seeds))
        data = bytearray(seeds[fmt])
        for _ in range(rng.randint(1, 4)):
            position = rng.randrange(len(data))
            roll = rng.random()
            if roll < 0.6:
                data[position] = rng.randrange(256)
            elif roll < 0.8:
                del data[position:]
            else:
                data[position:position] = rng.randbytes(rng.randint(1, 8))
            if not data:
                break
        try:
            decode_image(bytes(data), image_size=16)
        except ImageDecodeError:
            failed += 1
    assert failed > 50  # the mutations do break files; the point is how


# -- WebDataset and datasets sources with bad rows --------------------------------------------------------------------
def test_webdataset_bad_members_are_recorded_and_good_ones_kept(tmp_path):
    members = [
        ("good.png", _encode(photo(1), "PNG")),
        ("good.cls", b"5"),
        ("noimage.cls", b"3"),
        ("noimage.txt", b"a caption, no picture"),
        ("textimage.jpg", b"not a jpeg"),
        ("textimage.cls", b"3"),
        ("badcls.png", _encode(photo(2), "PNG")),
        ("badcls.cls", b"three"),
        ("nocls.png", _encode(photo(3), "PNG")),
        ("zero.png", b""),
        ("zero.cls", b"1"),
        ("dir/sub/twin.PNG", _encode(photo(4), "PNG")),  # upper-case extension, nested path
        ("dir/sub/twin.cls", b" 7\n"),
        ("other/twin.png", _encode(photo(5), "PNG")),  # same base name in another folder: a second sample
        ("other/twin.cls", b"8"),
    ]
    shard = tmp_path / "src-000000.tar"
    with tarfile.open(shard, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        folder = tarfile.TarInfo("dir")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
    out, manifest = _build(tmp_path, f"wds:{tmp_path}/src-{{000000..000000}}.tar")
    failed = {f["source_key"] for f in manifest["failures"]}
    assert failed == {"noimage", "textimage", "badcls", "nocls", "zero"}
    assert manifest["counts"]["original"]["by_class"] == {"5": 1, "7": 1, "8": 1}
    assert manifest["source"]["num_samples"] == manifest["counts"]["original"]["total"] + len(failed)
    assert verify_release(out) == []


def test_webdataset_bad_cls_reason_names_the_cls_member(tmp_path):
    shard = tmp_path / "s.tar"
    with tarfile.open(shard, "w") as tar:
        for name, data in [("a.png", _encode(photo(1), "PNG")), ("a.cls", b"three")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    _, manifest = _build(tmp_path, f"wds:{shard}")
    assert "cls" in manifest["failures"][0]["reason"] and "-1" not in manifest["failures"][0]["reason"]


def test_hf_source_plain_int_labels_minus_one_missing_and_garbage_images(tmp_path):
    import datasets

    features = datasets.Features(
        {"img": datasets.Image(), "y": datasets.Value("int64"), "id": datasets.Value("string")}
    )
    good = [{"bytes": _encode(photo(i), "PNG"), "path": None} for i in range(4)]
    ds = datasets.Dataset.from_dict(
        {
            "img": [*good, None, {"bytes": b"garbage", "path": None}],
            "y": [0, 3, -1, 2, 1, 1],
            "id": ["a/1", "a.1", "b", "c", "d", "e"],  # a/1 and a.1 sanitise alike but must stay two samples
        },
        features=features,
    )
    ds.save_to_disk(str(tmp_path / "hfds"))
    out, manifest = _build(
        tmp_path, f"hf:{tmp_path / 'hfds'}", source_options={"label_column": "y", "key_column": "id"}
    )
    assert manifest["label_space"]["names"] == ["0", "1", "2", "3"]
    reasons = {f["source_key"]: f["reason"] for f in manifest["failures"]}
    assert set(reasons) == {"b", "d", "e"}
    assert "out of range" in reasons["b"] and "NoneType" in reasons["d"] and "not an image" in reasons["e"]
    assert manifest["counts"]["original"]["by_class"] == {"0": 1, "2": 1, "3": 1}
    assert verify_release(out) == []


def test_a_config_where_every_edit_was_refused_is_left_out_and_named(tmp_path):
    """No shard can hold an empty split that `datasets` and timm open, so the release leaves the config out of its
    configs (card, _info.json) and names it in manifest.empty_configs; the rest loads as usual."""
    src = make_imagefolder(tmp_path / "src", ["a", "b"], per_class=2)
    refuse_all = [f"{c}_img_{i:03d}" for c in "ab" for i in range(2)]
    stages = [FAKE_STAGES[0], FAKE_STAGES[1] | {"options": {"refuse_keys": refuse_all}}]
    out, manifest = _build(tmp_path, f"imagefolder:{src}", stages=stages, configs=["original", "counterfactual"])
    assert manifest["configs"] == ["original"] and manifest["empty_configs"] == ["counterfactual"]
    assert verify_release(out) == []
    assert "counterfactual" not in json.loads((out / "_info.json").read_text())["splits"]
    import datasets

    assert len(datasets.load_dataset(str(out), "original", split="test", cache_dir=str(tmp_path / "hf"))) == 4
    with pytest.raises(ValueError, match="counterfactual"):
        datasets.load_dataset(str(out), "counterfactual", split="test", cache_dir=str(tmp_path / "hf"))


# -- stage failures and kills ---------------------------------------------------------------------------------------
def test_stage_error_in_a_batch_of_one_is_an_error_not_a_crash(tmp_path):
    src = make_imagefolder(tmp_path / "src", ["a", "b"], per_class=2)
    stages = [FAKE_STAGES[0] | {"options": {"fail_keys": ["a_img_001"]}}, FAKE_STAGES[1]]
    _, manifest = _build(
        tmp_path, f"imagefolder:{src}", stages=stages, configs=["original", "counterfactual"], batch_size=1
    )
    assert manifest["failures"] == []
    assert [e["source_key"] for e in manifest["build"]["errors"]] == ["a_img_001"]  # retried on the next run
    assert manifest["counts"]["original"]["total"] == 4


def test_a_build_interrupted_while_writing_its_plan_resumes(tmp_path, monkeypatch):
    """Interrupted after two of six plan rows: the ledger must hold the config and the plan both or neither."""
    src = make_imagefolder(tmp_path / "src", ["a", "b"], per_class=3)
    config = load_config(str(write_config(tmp_path / "cfg.yaml", f"imagefolder:{src}")))
    write_plan = Ledger.write_plan

    def interrupted(self, rows):
        write_plan(self, rows[:2])
        raise KeyboardInterrupt  # a kill here leaves what SQLite recovers: the open transaction is rolled back

    monkeypatch.setattr(Ledger, "write_plan", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build(config, tmp_path / "out", progress=False)
    monkeypatch.setattr(Ledger, "write_plan", write_plan)
    assert build(config, tmp_path / "out", progress=False)["counts"]["original"]["total"] == 6


# Run the CLI with every rename of a finished temporary file (shards, _info.json, manifest.json, card) held until the
# test says go (a line on stdin; the file's name goes out on fd 3 first): a kill lands while a temporary file is
# complete but not yet in place, inside the release-writing phase, at a moment the test chose, on any machine speed.
HELD_WRITES = """
import os, sys
replace = os.replace
to_test = os.fdopen(int(sys.argv[1]), "w")
def held_replace(src, dst, *a, **k):
    if str(src).endswith(".tmp"):
        to_test.write(os.fspath(dst) + "\\n")
        to_test.flush()
        sys.stdin.readline()
    return replace(src, dst, *a, **k)
os.replace = held_replace
from builder.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_kills_while_writing_shards_and_manifest_resume_to_the_clean_bytes(tmp_path):
    src = make_imagefolder(tmp_path / "src", ["a", "b", "c"], per_class=4)
    cfg = write_config(
        tmp_path / "cfg.yaml",
        f"imagefolder:{src}",
        stages=FAKE_STAGES,
        configs=["original", "reconstructed", "counterfactual", "lance_r"],
        shard_max_samples=3,
    )
    clean = tmp_path / "clean"
    build(load_config(str(cfg)), clean, progress=False)
    out = tmp_path / "killed"
    arguments = ["build", str(cfg), "--output", str(out), "--no-progress"]

    def names() -> set[str]:
        return {p.name for p in out.rglob("*")} if out.exists() else set()

    # Kill when a shard is half written, after a few shards are in place, and while the manifest is being replaced.
    moments = [
        lambda n: any(x.endswith(".tar.tmp") for x in n),
        lambda n: sum(x.endswith(".tar") for x in n) >= 5,
        lambda n: any(x.startswith(".manifest.json.") and x.endswith(".tmp") for x in n),
    ]
    for moment in moments:
        read_end, write_end = os.pipe()
        command = [sys.executable, "-c", HELD_WRITES, str(write_end), *arguments]
        proc = subprocess.Popen(command, env=env(), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, pass_fds=(write_end,), text=True)  # fmt: skip
        os.close(write_end)
        with os.fdopen(read_end) as held:
            for _ in held:  # the build holds a finished temporary file until it reads a line
                if moment(names()):
                    break
                proc.stdin.write("\n")
                proc.stdin.flush()
            else:
                raise AssertionError("the build finished before the kill moment")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdin.close()
    final = cli(*arguments, check=False)  # the resume: the same command, in this process (no kill to survive)
    assert final.returncode == 0, final.stderr
    assert verify_release(out) == []
    assert release_files(out) == release_files(clean)


# -- verify --------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_verify_catches_flips_spread_over_every_shard_and_the_whole_manifest(tmp_path):
    src = make_imagefolder(tmp_path / "src", ["a", "b"], per_class=2, size=(20, 20))
    out, _ = _build(
        tmp_path,
        f"imagefolder:{src}",
        stages=FAKE_STAGES,
        configs=["original", "counterfactual"],
        image_size=16,
        shard_max_samples=3,
    )
    assert verify_release(out) == []
    targets = sorted(out.glob("data/*/*.tar")) + [out / "manifest.json"]
    assert len(targets) == 2 + 3 + 1  # originals 3+1, counterfactuals 3+3+2, the manifest
    for target in targets:
        original = target.read_bytes()
        step = max(1, len(original) // 60)  # ~60 evenly spread positions: tar headers, member data, padding, end
        for position in [*range(0, len(original), step), len(original) - 1]:
            flipped = bytearray(original)
            flipped[position] ^= 0x80
            target.write_bytes(bytes(flipped))
            assert verify_release(out, check_images=False), f"{target.name} byte {position} flipped went unnoticed"
        target.write_bytes(original)
    assert verify_release(out) == []


# -- CLI --------------------------------------------------------------------------------------------------------------
def _subcommands() -> list[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return sorted(action.choices)


def test_there_are_the_subcommands_the_issue_names():
    assert {"build", "verify", "publish", "eval", "leaderboard", "perturber"} <= set(_subcommands())


@pytest.mark.parametrize("command", _subcommands())
def test_every_subcommand_help_explains_itself(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: lance-cf {command}") and len(text.splitlines()) > 4


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["nosuch"], "invalid choice: 'nosuch'"),
        (
            ["build", "demo", "--output", "x", "--seed", "abc"],
            "--seed: expected an integer of at most 18 digits, got 'abc'",
        ),
        (["build", "demo", "--output", "x", "--shard-size", "-3"], "expected a positive integer, got '-3'"),
        (["build", "demo", "--output", "x", "--engine", "spark"], "invalid choice: 'spark'"),
        (["build", "demo", "--output", "x", "--configs", ","], "expected a comma-separated list"),
        (["build", "demo", "--output", "x", "--configs", "original", "--seed", "-1"], "seed -1: expected an integer"),
        (["build", "demo", "--output", "x", "--configs", "original", "--version", "1.0"], "semantic version"),
        (["build", "demo", "--output", "x", "--configs", "original,original"], "listed twice"),
        (["build", "demo", "--output", "x", "--configs", "original", "--source", "imagefolder"], "SCHEME:ARG"),
        (["build", "demo", "--output", "x", "--configs", "original", "--source", "wds:/no/s-{0..1}.tar"], "not found"),
        (["build", "/no/such.yaml", "--output", "x"], "does not exist"),
        (["verify"], "required: DIR"),
    ],
)
def test_wrong_flags_and_values_give_one_line_errors(args, expected, capsys):
    try:
        code = main(args)
    except SystemExit as exit_info:
        code = exit_info.code
    err = capsys.readouterr().err
    assert code == 2 and expected in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
