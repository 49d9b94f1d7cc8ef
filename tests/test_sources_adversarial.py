"""Hostile sources: folder cycles, where the source sits, Unicode spellings,
unbounded labels, oversized and duplicate shard members, compressed shards, bad specs, and what a release publishes
about the machine it was built on.

Big inputs are never written: a tar header claims 2 GiB over a sparse file, a gzip stream of zeros expands in memory
only if the reader is wrong, and ``tracemalloc`` shows what the reader allocated.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
import tracemalloc
import unicodedata
from pathlib import Path

import pytest
from builder_helpers import REPO, cli, env, make_imagefolder, photo, release_files, write_config

from builder.cli import main
from builder.config import load_config
from builder.engine import build
from builder.release_format import is_valid_key
from builder.release_format.verify import verify_release
from builder.sources import MAX_IMAGE_BYTES, create_source, public_spec


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    photo(seed).save(buf, format="PNG")
    return buf.getvalue()


def _build(tmp_path: Path, source: str, name: str = "out", **fields) -> tuple[Path, dict]:
    cfg = write_config(tmp_path / f"{name}.yaml", source, **fields)
    out = tmp_path / name
    return out, build(load_config(str(cfg)), out, progress=False)


def _reasons(manifest: dict) -> dict[str, str]:
    return {f["source_key"]: f["reason"] for f in manifest["failures"]}


def _tar(path: Path, members: list[tuple[str, bytes]], mode: str = "w") -> Path:
    with tarfile.open(path, mode) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


# -- 1. folder cycles: every folder is listed once across the whole source ---------------------------------------------
def test_a_class_folder_linked_to_an_ancestor_does_not_release_images_twice(tmp_path):
    src = make_imagefolder(tmp_path / "src", ["apple", "pear"], per_class=2)
    os.symlink(src, src / "loop")  # a class folder that is the source root itself
    os.symlink(src / "apple", src / "pear" / "more")  # a sub-folder that is a sibling class
    os.symlink(src / "pear", src / "pear" / "self")  # a sub-folder that is its own ancestor
    out, manifest = _build(tmp_path, f"imagefolder:{src}")
    # Four photos, each once, under its own class; "loop" is no class (only a link to the root), yet it is reported.
    assert manifest["label_space"]["names"] == ["apple", "pear"]
    assert manifest["counts"]["original"]["by_class"] == {"0": 2, "1": 2}
    assert _reasons(manifest) == {
        "loop_loop": "folder is a symbolic link to the source root; its images are listed there, once",
        "pear_more": "folder is a symbolic link to 'apple'; its images are listed there, once",
        "pear_self": "folder is a symbolic link to 'pear'; its images are listed there, once",
    }
    assert verify_release(out) == []


def test_a_link_walked_before_the_real_folder_does_not_take_its_images(tmp_path):
    """Class 'aardvark' (walked first) links into 'zebra': the images stay zebra's, whatever the walking order."""
    src = make_imagefolder(tmp_path / "src", ["zebra"], per_class=1)
    photo(5).save((src / "zebra" / "sub").mkdir() or src / "zebra" / "sub" / "deep.png")
    (src / "aardvark").mkdir()
    os.symlink(src / "zebra" / "sub", src / "aardvark" / "borrowed")
    outside = make_imagefolder(tmp_path / "outside", ["shared"], per_class=2) / "shared"
    os.symlink(outside, src / "x_first")  # a folder outside the source, linked twice: listed once, under x_first
    os.symlink(outside, src / "y_second")
    source = create_source(f"imagefolder:{src}")
    names = source.label_space.names
    assert names == ["aardvark", "x_first", "zebra"]  # y_second, a second link to x_first's folder, is no class
    by_class = {}
    for sample in source.samples:
        if not sample.problem:
            by_class.setdefault(names[sample.label], []).append(sample.key)
    assert by_class == {
        "x_first": ["x_first_img_000", "x_first_img_001"],
        "zebra": ["zebra_deep", "zebra_img_000"],
    }
    problems = {s.key: s.problem for s in source.samples if s.problem}
    assert problems == {
        "aardvark_borrowed": "folder is a symbolic link to 'zebra/sub'; its images are listed there, once",
        "y_second_y_second": "folder is 'x_first' again (through a symbolic link); its images are listed once",
    }


def test_a_very_deep_tree_is_walked_without_recursion(tmp_path):
    """A tree deeper than Python's recursion limit. The limit is lowered for the test instead of making the tree
    thousands deep: such a tree would also break pytest's own clean-up (shutil.rmtree recurses)."""
    deep = tmp_path / "src" / "cls" / Path(*["d"] * 250)
    deep.mkdir(parents=True)
    photo(1).save(deep / "bottom.png")
    frames, frame = 0, sys._getframe()
    while frame is not None:
        frames, frame = frames + 1, frame.f_back
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(frames + 150)  # room for the source's own calls, not for one frame per folder
    try:
        source = create_source(f"imagefolder:{tmp_path / 'src'}")
    finally:
        sys.setrecursionlimit(limit)
    assert [s.key for s in source.samples] == ["cls_bottom"] and source.samples[0].problem is None


def test_a_newline_in_a_file_name_stays_inside_one_reason_line(tmp_path):
    src = make_imagefolder(tmp_path / "src", ["cls"], per_class=1)
    photo(2).save(src / "cls" / "two\nlines.png", format="PNG")
    _, manifest = _build(tmp_path, f"imagefolder:{src}", source_options={"max_image_bytes": 100})
    reasons = list(_reasons(manifest).values())
    assert len(reasons) == 2 and all("\n" not in r for r in reasons)
    assert any("two\\nlines.png" in r for r in reasons)


# -- 1. keys, seeds and bytes do not depend on where the source sits or how its names are spelled ----------------------
def _photo_tree(root: Path, form: str) -> Path:
    """The same photos and names, spelled in Unicode normal form ``form``; two names collide (same stem)."""
    files = {"crème": ["café.png", "café.jpg", "plain.png"], "zebra": ["z.png"]}
    for c, (folder, names) in enumerate(files.items()):
        (root / unicodedata.normalize(form, folder)).mkdir(parents=True)
        for i, name in enumerate(names):
            path = root / unicodedata.normalize(form, folder) / unicodedata.normalize(form, name)
            photo(c * 10 + i).save(path, format="JPEG" if name.endswith(".jpg") else "PNG", quality=90)
    return root


def test_the_same_photos_at_two_locations_and_spellings_give_byte_identical_releases(tmp_path):
    one = _photo_tree(tmp_path / "first" / "deeper" / "photos", "NFC")
    two = _photo_tree(tmp_path / "second" / "photos", "NFD")
    assert {p.name for p in one.rglob("*")} != {p.name for p in two.rglob("*")}  # really spelled differently
    out1, m1 = _build(tmp_path, f"imagefolder:{one}", name="one")
    out2, m2 = _build(tmp_path, f"imagefolder:{two}", name="two")
    keys = sorted(m1["counts"]["original"]["by_class"])
    assert keys and m1["counts"] == m2["counts"] and m1["label_space"] == m2["label_space"]
    assert m1["label_space"]["names"] == ["crème", "zebra"]  # NFC in the release whatever the disk held
    assert m1["source"] == m2["source"] and m1["source"]["spec"] == "imagefolder:photos"
    files1, files2 = release_files(out1), release_files(out2)
    shards = [name for name in files1 if name.startswith("data/")]
    assert shards and all(files1[name] == files2[name] for name in shards)
    assert m1["config"]["source"] == "imagefolder:photos" and m1["config_hash"] == m2["config_hash"]
    assert files1 == files2  # shards, manifest, card, _info.json: every published byte


def test_colliding_keys_are_told_apart_by_the_relative_path(tmp_path):
    one = _photo_tree(tmp_path / "a" / "photos", "NFC")
    two = _photo_tree(tmp_path / "elsewhere" / "x" / "photos", "NFD")
    keys1 = [s.key for s in create_source(f"imagefolder:{one}").samples]
    keys2 = [s.key for s in create_source(f"imagefolder:{two}").samples]
    assert keys1 == keys2
    assert sum("caf" in k for k in keys1) == 2 and len(set(keys1)) == 4


def test_nfc_and_nfd_spellings_side_by_side_stay_two_samples(tmp_path):
    folder = tmp_path / "src" / "cls"
    folder.mkdir(parents=True)
    photo(1).save(folder / unicodedata.normalize("NFC", "café.png"))
    photo(2).save(folder / unicodedata.normalize("NFD", "café.png"))
    if len(list(folder.iterdir())) != 2:
        pytest.skip("this file system normalises names itself")
    keys = [s.key for s in create_source(f"imagefolder:{tmp_path / 'src'}").samples]
    assert len(set(keys)) == 2


def test_keys_stay_short_whatever_the_names(tmp_path):
    import datasets

    feats = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=["a"]), "id": datasets.Value("string")}
    )
    ids = ["x" * 5000, "x" * 5000 + "y", "é" * 300]
    images = [{"bytes": _png(i), "path": None} for i in range(3)]
    datasets.Dataset.from_dict({"image": images, "label": [0, 0, 0], "id": ids}, features=feats).save_to_disk(
        str(tmp_path / "d")
    )
    keys = [s.key for s in create_source(f"hf:{tmp_path / 'd'}", {"key_column": "id"}).samples]
    assert len(set(keys)) == 3 and all(len(k) <= 96 for k in keys)
    assert all(is_valid_key(k) for k in keys)


def test_webdataset_keys_do_not_depend_on_where_the_shards_sit(tmp_path):
    keys = []
    for place in ("a", "b/c"):
        shards = tmp_path / place / "shards"
        shards.mkdir(parents=True)
        for i in range(2):  # the same member name in both shards: keys need the (relative) shard name
            _tar(shards / f"s-{i}.tar", [("x.png", _png(i)), ("x.cls", b"1")])
        keys.append([s.key for s in create_source(f"wds:{shards}/s-{{0..1}}.tar").samples])
    assert keys[0] == keys[1] and len(set(keys[0])) == 2


# -- 2. hf: labels are bounded, typed and checked ----------------------------------------------------------------------
def _hf_dataset(tmp_path: Path, labels: list, dtype: str = "int64", **features) -> Path:
    import datasets

    feats = datasets.Features({"image": datasets.Image(), "label": datasets.Value(dtype), **features})
    images = [{"bytes": _png(i), "path": None} for i in range(len(labels))]
    path = tmp_path / "hfds"
    datasets.Dataset.from_dict({"image": images, "label": labels}, features=feats).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("big", [2**62, 10**7])
def test_hf_a_huge_label_is_refused_up_front_naming_the_column(tmp_path, big):
    path = _hf_dataset(tmp_path, [0, 1, big, 2])
    with pytest.raises(ValueError) as err:
        create_source(f"hf:{path}")
    message = str(err.value)
    assert "label column 'label'" in message and f"label {big} (row 2)" in message and "num_classes" in message
    assert "\n" not in message


def test_hf_declared_label_space_makes_outliers_per_sample_failures(tmp_path):
    path = _hf_dataset(tmp_path, [0, 2, 2**62, -1, 1])
    out, manifest = _build(tmp_path, f"hf:{path}", source_options={"num_classes": 3})
    assert manifest["label_space"]["names"] == ["0", "1", "2"]
    assert manifest["counts"]["original"]["by_class"] == {"0": 1, "1": 1, "2": 1}
    reasons = _reasons(manifest)
    assert reasons["test_00000002"].startswith("label 4611686018427387904 out of range [0, 3)")
    assert reasons["test_00000003"].startswith("label -1 out of range [0, 3)")
    assert verify_release(out) == []
    with pytest.raises(ValueError, match=r"num_classes declares 200000 classes, over max_classes 100000"):
        create_source(f"hf:{path}", {"num_classes": 200_000})
    with pytest.raises(ValueError, match=r"class_names declares 3 classes, over max_classes 2"):
        create_source(f"hf:{path}", {"class_names": ["a", "b", "c"], "max_classes": 2})


def test_hf_float_labels_are_not_truncated(tmp_path):
    path = _hf_dataset(tmp_path, [0.0, 1.5, 2.0, None, float("nan")], dtype="float64")
    source = create_source(f"hf:{path}", {"num_classes": 3})
    by_row = {s.origin.rsplit("[", 1)[1].rstrip("]"): s for s in source.samples}
    assert (by_row["0"].label, by_row["0"].problem) == (0, None)
    assert (by_row["2"].label, by_row["2"].problem) == (2, None)
    assert (
        by_row["1"].label == -1
        and by_row["1"].problem == "label 1.5 (label column 'label') is not an integer class index"
    )
    assert by_row["3"].problem == "no label (label column 'label' is empty)"
    assert "nan" in by_row["4"].problem and by_row["4"].label == -1


@pytest.mark.e2e  # runs lance-cf as a process
def test_hf_string_labels_are_refused_naming_the_column(tmp_path):
    import datasets

    feats = datasets.Features({"image": datasets.Image(), "species": datasets.Value("string")})
    ds = datasets.Dataset.from_dict({"image": [{"bytes": _png(1), "path": None}], "species": ["cat"]}, features=feats)
    ds.save_to_disk(str(tmp_path / "hfds"))
    cfg = write_config(tmp_path / "c.yaml", f"hf:{tmp_path / 'hfds'}", source_options={"label_column": "species"})
    proc = cli("build", str(cfg), "--output", str(tmp_path / "out"), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "label column 'species' holds string values, not integer class indices" in proc.stderr
    assert "class_encode_column('species')" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_hf_image_column_of_strings_and_missing_columns_are_one_line(tmp_path):
    import datasets

    feats = datasets.Features({"file": datasets.Value("string"), "label": datasets.ClassLabel(names=["a"])})
    datasets.Dataset.from_dict({"file": ["x.png"], "label": [0]}, features=feats).save_to_disk(str(tmp_path / "d"))
    with pytest.raises(ValueError, match=r"image column 'file' holds string values, not images; cast it first"):
        create_source(f"hf:{tmp_path / 'd'}", {"image_column": "file"})
    with pytest.raises(ValueError, match=r"no column 'lbl' .*; set source_options.label_column to one of them"):
        create_source(f"hf:{tmp_path / 'd'}", {"image_column": "file", "label_column": "lbl"})


def test_hf_failure_reasons_and_spec_carry_no_machine_path(tmp_path, monkeypatch):
    """A local image-folder dataset keeps absolute file paths in its cells; one file vanishes before it is read."""
    import builder.engine

    for i, cls in enumerate(["ant", "bee"]):
        (tmp_path / "my_data" / "test" / cls).mkdir(parents=True)
        photo(i).save(tmp_path / "my_data" / "test" / cls / f"{cls}.png")
    create = builder.engine.create_source

    def create_then_lose_a_file(spec, options=None):
        source = create(spec, options)
        (tmp_path / "my_data" / "test" / "bee" / "bee.png").unlink()
        return source

    monkeypatch.setattr(builder.engine, "create_source", create_then_lose_a_file)
    out, manifest = _build(tmp_path, f"hf:{tmp_path / 'my_data'}:test")
    assert manifest["source"]["spec"] == "hf:my_data:test"
    (reason,) = _reasons(manifest).values()
    assert reason == "unreadable: my_data[test][1] (bee.png): cannot read the file: No such file or directory"
    assert str(tmp_path) not in json.dumps(manifest["source"]) + json.dumps(manifest["failures"])
    assert str(tmp_path) not in (out / "README.md").read_text()


# -- 2. wds: members are size-checked before reading, labels range-checked, shards streamed once -----------------------
def _sparse_tar_with_huge_member(path: Path, huge_size: int) -> Path:
    """A plain tar whose member ``huge.png`` claims ``huge_size`` bytes, written sparse (nothing is allocated)."""
    good = _png(3)
    with open(path, "wb") as f:
        for name, size in (("good.png", len(good)), ("good.cls", 1), ("huge.png", huge_size), ("huge.cls", 1)):
            info = tarfile.TarInfo(name)
            info.size = size
            f.write(info.tobuf(tarfile.GNU_FORMAT))
            padded = -(-size // 512) * 512
            if name == "huge.png":
                f.seek(padded, os.SEEK_CUR)
            else:
                data = {"good.png": good, "good.cls": b"4", "huge.cls": b"5"}[name]
                f.write(data + b"\0" * (padded - size))
        f.write(b"\0" * 1024)
    return path


def test_wds_a_2gib_member_is_refused_unread(tmp_path):
    shard = _sparse_tar_with_huge_member(tmp_path / "s.tar", 2 << 30)
    tracemalloc.start()
    try:
        source = create_source(f"wds:{shard}")
        data = [source.read(s) for s in source.samples if not s.problem]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20  # the member is 2 GiB
    problems = {s.key: s.problem for s in source.samples}
    assert problems["good"] is None and data == [_png(3)]
    assert problems["huge"] == (
        f"image member huge.png is {2 << 30} bytes, over the {MAX_IMAGE_BYTES}-byte limit "
        "(source option max_image_bytes)"
    )


def test_wds_compressed_oversized_member_is_skipped_without_holding_it(tmp_path):
    zeros = 64 << 20
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in [("a.png", _png(1)), ("a.cls", b"1")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("bomb.png")
        info.size = zeros
        tar.addfile(info, io.BytesIO(bytes(zeros)))
        info = tarfile.TarInfo("bomb.cls")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"2"))
    shard = tmp_path / "s.tar.gz"
    shard.write_bytes(gzip.compress(buf.getvalue(), compresslevel=1))
    del buf
    assert shard.stat().st_size < 1 << 20
    tracemalloc.start()
    try:
        source = create_source(f"wds:{shard}", {"max_image_bytes": 1 << 20})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20  # the member is 64 MiB
    problems = {s.key: s.problem for s in source.samples}
    assert problems["a"] is None and source.read(next(s for s in source.samples if s.key == "a")) == _png(1)
    assert "bomb.png is 67108864 bytes, over the 1048576-byte limit" in problems["bomb"]


def test_wds_huge_cls_values_are_failures_not_ledger_crashes(tmp_path):
    shard = _tar(
        tmp_path / "s.tar",
        [
            ("ok.png", _png(1)),
            ("ok.cls", b"7"),
            ("huge.png", _png(2)),
            ("huge.cls", b"99999999999999999999"),
            ("float.png", _png(3)),
            ("float.cls", b"1.5"),
            ("long.png", _png(4)),
            ("long.cls", b"1" * 5000),
            ("arabic.png", _png(5)),
            ("arabic.cls", "٣".encode()),
        ],
    )
    out, manifest = _build(tmp_path, f"wds:{shard}")
    reasons = _reasons(manifest)
    assert reasons["huge"] == "label 99999999999999999999 out of range [0, 1000) of the imagenet-1k label space"
    assert reasons["float"] == "label member .cls holds '1.5', not an integer"
    assert reasons["long"] == "label member long.cls is 5000 bytes, not one integer"
    assert reasons["arabic"].startswith("label member .cls holds")
    assert manifest["counts"]["original"]["by_class"] == {"7": 1}
    assert verify_release(out) == []


def test_wds_duplicate_and_non_file_members_are_reported(tmp_path):
    shard = tmp_path / "s.tar"
    _tar(shard, [("a.png", _png(1)), ("a.cls", b"1"), ("a.png", _png(2)), ("b.png", _png(3)), ("b.cls", b"2")])
    with tarfile.open(shard, "a") as tar:
        link = tarfile.TarInfo("c.png")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
        info = tarfile.TarInfo("c.cls")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"3"))
    source = create_source(f"wds:{shard}")
    problems = {s.key: s.problem for s in source.samples}
    assert problems == {
        "a": "member a.png appears more than once in s.tar",
        "b": None,
        "c": "member c.png is not a regular file",
    }


def test_wds_compressed_shard_is_decompressed_once(tmp_path):
    members = []
    for i in range(1000):
        members += [(f"k{i:04d}.png", f"image {i}".encode()), (f"k{i:04d}.cls", str(i % 10).encode())]
    plain = _tar(tmp_path / "plain.tar", members)
    packed = tmp_path / "packed.tar.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    source = create_source(f"wds:{packed}")
    packed.rename(tmp_path / "moved.tar.gz")  # every read below must come from the one pass made at listing
    data = {s.key: source.read(s) for s in source.samples}
    assert len(data) == 1000 and data["k0123"] == b"image 123"
    reference = create_source(f"wds:{plain}")
    assert {s.key: reference.read(s) for s in reference.samples} == data
    source.close()


def test_wds_full_temporary_disk_is_one_line_naming_the_fix(tmp_path, monkeypatch):
    import builder.sources

    class FullDisk(io.BytesIO):
        def write(self, data):
            raise OSError(28, "No space left on device")

    shard = tmp_path / "s.tar.gz"
    shard.write_bytes(gzip.compress(_tar(tmp_path / "s.tar", [("a.png", _png(1)), ("a.cls", b"1")]).read_bytes()))
    monkeypatch.setattr(builder.sources.tempfile, "TemporaryFile", lambda **kw: FullDisk())
    with pytest.raises(ValueError) as err:
        create_source(f"wds:{shard}")
    message = str(err.value)
    assert "No space left on device" in message and "set TMPDIR" in message and "\n" not in message


# -- ImageNet class names are package data ------------------------------------------------------------------------------
def test_imagenet_class_list_matches_timm_and_open_clip():
    from builder import imagenet

    timm_data = pytest.importorskip("timm.data")
    metadata = pytest.importorskip("open_clip.zero_shot_metadata")
    assert imagenet.synsets() == tuple(timm_data.ImageNetInfo("imagenet-1k").label_names())
    assert imagenet.class_names() == tuple(metadata.IMAGENET_CLASSNAMES)


def test_pyproject_ships_the_class_list():
    import tomllib

    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "imagenet_classes.json" in data["tool"]["setuptools"]["package-data"]["builder"]


BUILD_AND_LIST_MODULES = """
import json, sys
from builder.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "modules": sorted(m for m in ("torch", "timm", "open_clip") if m in sys.modules)}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["imagenet", "imagefolder"])
def test_building_original_imports_no_model_library(tmp_path, scheme):
    src = make_imagefolder(tmp_path / "val", ["n01440764", "n03218198"], per_class=1)
    args = ["build", "demo", "--configs", "original", "--source", f"{scheme}:{src}", "--output", str(tmp_path / "o")]
    proc = subprocess.run(
        [sys.executable, "-c", BUILD_AND_LIST_MODULES, *args, "--no-progress"],
        capture_output=True,
        text=True,
        env=env(),
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"code": 0, "modules": []}


# -- bad specs and options are one line naming the input and the fix ---------------------------------------------------
def _error_line(tmp_path: Path, source: str, options: dict | None = None) -> str:
    """``lance-cf build`` in process (an unexpected exception fails the test with its traceback): one line, rc 2."""
    cfg = write_config(tmp_path / "c.yaml", source, source_options=options or {})
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = main(["build", str(cfg), "--output", str(tmp_path / "out")])
    assert code == 2, stderr.getvalue()
    assert len(stderr.getvalue().strip().splitlines()) == 1, stderr.getvalue()
    assert not (tmp_path / "out").exists()
    return stderr.getvalue().strip()


@pytest.fixture
def synset_folder(tmp_path):
    return make_imagefolder(tmp_path / "val", ["n01440764"], per_class=1)


def test_bad_specs_give_one_line(tmp_path, synset_folder):
    (tmp_path / "junk.tar").write_bytes(b"this is not a tar archive\n")
    cases = {
        "demo:photos": "demo takes no argument; write --source demo",
        "wds:s-{000..001.tar": "Unbalanced braces",
        f"wds:{tmp_path / 'junk.tar'}": "is not a readable tar archive",
        "hf::test": "expected hf:NAME_OR_PATH[:SPLIT]",
        "imagefolder:": "expected SCHEME:ARG",
        f"imagefolder:{tmp_path / 'nowhere'}": "is not a directory",
        f"wds:{tmp_path}": "is a folder; name the shards in it, e.g. wds:",
    }
    for spec, expected in cases.items():
        assert expected in _error_line(tmp_path, spec), spec


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"classes": 5}, "option classes = 5: expected a list (of strings or integers) (at least 1 item) or null"),
        ({"classes": "tench"}, "option classes = 'tench': expected a list (of strings or integers) (at least 1 item)"),
        ({"per_class": "x"}, "option per_class = 'x': expected an integer >= 1 or null"),
        ({"per_class": 0}, "option per_class = 0: expected an integer >= 1 or null"),
        ({"per_class": True}, "option per_class = True: expected an integer >= 1 or null"),
        ({"max_image_bytes": -1}, "option max_image_bytes = -1: expected an integer >= 1"),
        ({"classes": []}, "option classes = []: expected a list (of strings or integers) (at least 1 item) or null"),
        ({"classes": ["tenchh"]}, "class 'tenchh': not an ImageNet-1k synset, index or class name; did you mean"),
        ({"per_clas": 2}, "unknown option 'per_clas'; did you mean 'per_class'?"),
    ],
)
def test_bad_source_options_give_one_line(tmp_path, synset_folder, options, expected):
    line = _error_line(tmp_path, f"imagenet:{synset_folder}", options)
    assert expected in line and "imagenet:" in line


def test_wds_label_space_options_contradicting_are_refused(tmp_path):
    shard = _tar(tmp_path / "s.tar", [("a.png", _png(1)), ("a.cls", b"0")])
    with pytest.raises(ValueError, match="contradict"):
        create_source(f"wds:{shard}", {"label_space": "imagenet-1k", "class_names": ["x"]})
    with pytest.raises(ValueError, match="expected one of .imagenet-1k., .custom. or null"):
        create_source(f"wds:{shard}", {"label_space": "imagenet-21k"})
    source = create_source(f"wds:{shard}", {"class_names": ["cat", "dog"]})  # class names alone mean custom
    assert source.label_space.names == ["cat", "dog"]


# -- nothing about the machine in what a release records about its source ----------------------------------------------
@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("imagefolder:/home/me/my photos/", "imagefolder:my photos"),
        ("imagenet:/data/imagenet/val", "imagenet:val"),
        ("hf:/srv/data/ds:validation", "hf:ds:validation"),
        ("hf:user/dataset:test", "hf:user/dataset:test"),  # a Hub id is what a reader needs
        ("wds:/data/shards/val-{000000..000009}.tar", "wds:val-{000000..000009}.tar"),
        ("demo", "demo"),
    ],
)
def test_public_spec_drops_machine_paths(spec, expected):
    assert public_spec(spec) == expected


def test_release_records_the_folder_name_not_its_path(tmp_path):
    src = make_imagefolder(tmp_path / "private" / "my_photos", ["a", "b"], per_class=1)
    out, manifest = _build(tmp_path, f"imagefolder:{src}")
    assert manifest["source"]["spec"] == "imagefolder:my_photos"
    assert "Source: `imagefolder:my_photos`" in (out / "README.md").read_text()
    assert str(tmp_path) not in json.dumps(manifest["source"]) + json.dumps(manifest["failures"])
    assert manifest["config"]["source"] == "imagefolder:my_photos"
    from builder.release_format.hub_client import local_paths  # what `publish` refuses to upload

    assert local_paths(manifest) == [] and str(tmp_path) not in (out / "manifest.json").read_text()
