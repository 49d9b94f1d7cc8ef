"""What ``lance-cf verify`` must not call OK, and what a release's label space must not hold, attacked as a user
would: a build whose every image is broken (accepted with ``--allow-empty``), a hand-edited manifest whose shard path
leaves the release or passes through a link, a class folder that is only a link.

Each release is built by the real builder, then checked with the commands a user runs (``lance-cf verify``, in
process); a changed manifest is re-sealed (canonical bytes, digest) so that only the attacked field is wrong.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from builder_helpers import make_imagefolder, write_config

from builder import release_format as rf
from builder.cli import main


def _verify(capsys, release: Path) -> tuple[int, str]:
    code = main(["verify", str(release)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _build(capsys, tmp_path: Path, source: str, *extra: str) -> Path:
    config = write_config(tmp_path / "c.yaml", source)
    out = tmp_path / "release"
    main(["build", str(config), "--output", str(out), "--no-progress", *extra])
    capsys.readouterr()
    return out


def _reseal(release: Path, change) -> None:
    manifest = json.loads((release / rf.MANIFEST_NAME).read_text())
    change(manifest)
    rf.seal_manifest(manifest)
    (release / rf.MANIFEST_NAME).write_bytes(rf.canonical_json(manifest))


def test_verify_fails_a_release_with_no_samples(tmp_path, capsys):
    folder = tmp_path / "broken" / "cat"
    folder.mkdir(parents=True)
    for i in range(3):
        (folder / f"img_{i}.png").write_bytes(b"not an image at all")
    release = _build(capsys, tmp_path, f"imagefolder:{folder.parent}", "--allow-empty")
    assert (release / rf.MANIFEST_NAME).is_file()  # the build wrote it: the user accepted an empty build
    code, text = _verify(capsys, release)
    assert code != 0
    assert "the release holds no samples" in text


@pytest.mark.parametrize("path", ["../x.tar", "/tmp/x.tar", "data/../../x.tar", "data/./original/x.tar"])
def test_verify_fails_a_manifest_entry_outside_the_release(tmp_path, capsys, path):
    release = _build(capsys, tmp_path, f"imagefolder:{make_imagefolder(tmp_path / 'photos', ['cat', 'dog'], 2)}")
    assert _verify(capsys, release)[0] == 0
    shard = json.loads((release / rf.MANIFEST_NAME).read_text())["shards"][0]
    # The same bytes outside the release: a verifier that followed the path would find them intact.
    outside = (release / path) if not path.startswith("/") else Path(path)
    outside.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(release / shard["path"], outside)
    try:
        _reseal(release, lambda m: m["shards"][0].update(path=path))
        code, text = _verify(capsys, release)
    finally:
        if path.startswith("/"):
            outside.unlink()
    assert code != 0
    assert f"manifest lists {path!r}, which is not a plain path inside the release" in text


def test_verify_fails_a_shard_that_is_a_symbolic_link(tmp_path, capsys):
    release = _build(capsys, tmp_path, f"imagefolder:{make_imagefolder(tmp_path / 'photos', ['cat', 'dog'], 2)}")
    shard = release / json.loads((release / rf.MANIFEST_NAME).read_text())["shards"][0]["path"]
    moved = tmp_path / "elsewhere.tar"
    shard.rename(moved)
    os.symlink(moved, shard)  # the same bytes, through a link that could point anywhere
    code, text = _verify(capsys, release)
    assert code != 0 and "is a symbolic link" in text


def test_a_class_folder_that_is_only_a_link_is_no_class_and_its_entry_is_reported(tmp_path, capsys):
    photos = make_imagefolder(tmp_path / "photos", ["cat", "dog"], 2)
    os.symlink(photos, photos / "loop")  # a link loop: the root inside itself
    release = _build(capsys, tmp_path, f"imagefolder:{photos}")
    manifest = json.loads((release / rf.MANIFEST_NAME).read_text())
    assert manifest["label_space"]["names"] == ["cat", "dog"]
    assert manifest["counts"]["original"]["by_class"] == {"0": 2, "1": 2}
    reasons = {f["source_key"]: f["reason"] for f in manifest["failures"]}
    assert reasons == {"loop_loop": "folder is a symbolic link to the source root; its images are listed there, once"}
    assert _verify(capsys, release)[0] == 0


def test_a_class_left_with_no_sample_is_stated_on_the_card(tmp_path, capsys):
    """An empty class folder, and one whose only image is broken: classes of the label space, named on the card."""
    photos = make_imagefolder(tmp_path / "photos", ["cat", "dog"], 2)
    (photos / "empty").mkdir()
    (photos / "gnu").mkdir()
    (photos / "gnu" / "broken.png").write_bytes(b"not an image")
    release = _build(capsys, tmp_path, f"imagefolder:{photos}")
    manifest = json.loads((release / rf.MANIFEST_NAME).read_text())
    assert manifest["label_space"]["names"] == ["cat", "dog", "empty", "gnu"]
    card = (release / rf.CARD_NAME).read_text()
    assert "(4 classes; 2 of them have no sample in this release: empty, gnu)" in card
    assert _verify(capsys, release)[0] == 0
