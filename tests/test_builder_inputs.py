"""Malformed inputs, every source kind, verify's corruption detection, and CLI errors."""

from __future__ import annotations

import io
import json
import random
import tarfile
from pathlib import Path

import numpy as np
import pytest
from builder_helpers import FAKE_STAGES, cli, make_imagefolder, photo, write_config
from PIL import Image

from builder.config import load_config
from builder.engine import build
from builder.images import ImageDecodeError, decode_image
from builder.release_format.verify import verify_release


def _png(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", **kw)
    return buf.getvalue()


def _jpeg(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", **kw)
    return buf.getvalue()


# -- decoding: unusual-but-valid images are converted faithfully ---------------------------------------------------
def test_sixteen_bit_grayscale_is_scaled_not_clipped():
    ramp = (np.arange(64 * 64, dtype=np.uint32).reshape(64, 64) * 16).astype(np.uint16)  # 0..65520
    img = decode_image(_png(Image.fromarray(ramp)), image_size=None)
    arr = np.asarray(img)
    assert img.mode == "RGB" and arr.shape == (64, 64, 3)
    expected = np.round(ramp.astype(np.float64) / 257).astype(np.uint8)
    assert np.array_equal(arr[..., 0], expected)  # clipping would give 255 almost everywhere


def test_rgba_and_palette_transparency_composite_on_white():
    rgba = Image.new("RGBA", (20, 20), (255, 0, 0, 0))
    rgba.paste((0, 0, 255, 255), (0, 0, 10, 20))
    arr = np.asarray(decode_image(_png(rgba), image_size=None))
    assert tuple(arr[5, 5]) == (0, 0, 255) and tuple(arr[5, 15]) == (255, 255, 255)
    palette = Image.new("P", (20, 20), 1)
    palette.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    palette.paste(0, (0, 0, 10, 20))
    arr = np.asarray(decode_image(_png(palette, transparency=0), image_size=None))
    assert tuple(arr[5, 5]) == (255, 255, 255) and tuple(arr[5, 15]) == (10, 200, 30)


def test_cmyk_grayscale_and_exif_rotation():
    cmyk = Image.new("CMYK", (30, 20), (0, 255, 255, 0))  # pure red in CMYK
    red = np.asarray(decode_image(_jpeg(cmyk, quality=95), image_size=None))
    assert red.shape == (20, 30, 3) and red[..., 0].mean() > 200 and red[..., 1].mean() < 60
    gray = decode_image(_png(Image.new("L", (30, 20), 77)), image_size=None)
    assert gray.mode == "RGB" and tuple(np.asarray(gray)[0, 0]) == (77, 77, 77)
    wide = Image.new("RGB", (40, 20), (0, 128, 0))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90° clockwise on display
    rotated = decode_image(_jpeg(wide, exif=exif.tobytes()), image_size=None)
    assert rotated.size == (20, 40)


def test_unusable_images_raise_with_reasons():
    good = _png(photo(1))
    cases = {
        b"": "zero-byte",
        good[: len(good) // 2]: "truncated or corrupt",
        b"this is a text file, not a JPEG\n" * 10: "not an image",
        _png(Image.new("RGB", (4, 4))): "too small",
    }
    for data, reason in cases.items():
        with pytest.raises(ImageDecodeError, match=reason):
            decode_image(data, image_size=32)
    with pytest.raises(ImageDecodeError, match="too large"):
        decode_image(_png(Image.new("RGB", (200, 200))), image_size=32, max_pixels=10_000)


# -- a build with every kind of malformed input -------------------------------------------------------------------
@pytest.fixture(scope="module")
def messy_release(tmp_path_factory):
    root = tmp_path_factory.mktemp("messy")
    src = make_imagefolder(root / "src", ["apple", "pear"], per_class=3)
    bad = src / "pear"
    good_png = _png(photo(7))
    (bad / "zero.png").write_bytes(b"")
    (bad / "truncated.png").write_bytes(good_png[: len(good_png) // 3])
    (bad / "text.jpg").write_bytes(b"not an image at all\n" * 20)
    (bad / "tiny.png").write_bytes(_png(Image.new("RGB", (3, 5))))
    (bad / "huge.png").write_bytes(_png(Image.new("RGB", (300, 300))))
    (bad / "cmyk.jpg").write_bytes(_jpeg(Image.new("CMYK", (40, 40), (0, 255, 255, 0))))
    (bad / "sixteen.png").write_bytes(_png(Image.fromarray(np.full((40, 40), 40000, dtype=np.uint16))))
    (bad / "alpha.png").write_bytes(_png(Image.new("RGBA", (40, 40), (0, 0, 0, 0))))
    stages = [FAKE_STAGES[0] | {"options": {"fail_keys": ["apple_img_001"]}}, FAKE_STAGES[1]]
    cfg = write_config(
        root / "cfg.yaml",
        f"imagefolder:{src}",
        stages=stages,
        configs=["original", "counterfactual"],
        max_image_pixels=50_000,
    )
    out = root / "release"
    proc = cli("build", str(cfg), "--output", str(out), "--no-progress", check=False)
    assert proc.returncode == 1, proc.stderr  # the stage's exception is an error: retried by the next run
    return out, proc


def test_malformed_inputs_are_recorded_and_never_stop_the_build(messy_release):
    out, proc = messy_release
    manifest = json.loads((out / "manifest.json").read_text())
    reasons = {f["source_key"]: f["reason"] for f in manifest["failures"]}
    assert "zero-byte" in reasons["pear_zero"]
    assert "truncated" in reasons["pear_truncated"]
    assert "not an image" in reasons["pear_text"]
    assert "too small" in reasons["pear_tiny"]
    assert "too large" in reasons["pear_huge"]
    errors = manifest["build"]["errors"]
    assert [(e["source_key"], e["stage"]) for e in errors] == [("apple_img_001", "caption")]
    assert "cannot caption apple_img_001" in errors[0]["message"]
    assert len(reasons) == 5
    # Every good sample is in the release; the stage failure still has its original but no counterfactual.
    originals = manifest["counts"]["original"]["total"]
    assert originals == 6 + 3  # 6 plain photos + cmyk, 16-bit, alpha
    assert manifest["counts"]["counterfactual"]["total"] == 2 * (originals - 1)
    assert "failed pear_zero" in proc.stdout and "error  apple_img_001 [caption]" in proc.stdout
    assert verify_release(out) == []


def test_label_out_of_range_from_webdataset_source(tmp_path):
    shard = tmp_path / "src-000000.tar"
    with tarfile.open(shard, "w") as tar:
        for key, label in [("a1", 3), ("a2", 5000), ("a3", -1), ("a4", 999)]:
            for ext, data in [("jpg", _jpeg(photo(hash(key) % 100))), ("cls", str(label).encode())]:
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    cfg = write_config(tmp_path / "cfg.yaml", f"wds:{shard}")
    manifest = build(load_config(str(cfg)), tmp_path / "out", progress=False)
    reasons = {f["source_key"]: f["reason"] for f in manifest["failures"]}
    assert set(reasons) == {"a2", "a3"} and all("out of range" in r for r in reasons.values())
    assert manifest["counts"]["original"]["by_class"] == {"3": 1, "999": 1}
    assert verify_release(tmp_path / "out") == []


def test_compressed_webdataset_shards_read_the_same(tmp_path):
    for name, mode in [("plain.tar", "w"), ("packed.tar.gz", "w:gz")]:
        with tarfile.open(tmp_path / name, mode) as tar:
            for key, label in [("b1", 7), ("b2", 8)]:
                for ext, data in [("png", _png(photo(label))), ("cls", str(label).encode())]:
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    results = {}
    for name in ("plain.tar", "packed.tar.gz"):
        cfg = write_config(tmp_path / f"{name}.yaml", f"wds:{tmp_path / name}")
        manifest = build(load_config(str(cfg)), tmp_path / f"out-{name}", progress=False)
        assert manifest["failures"] == [] and manifest["counts"]["original"]["total"] == 2
        results[name] = [s["sha256"] for s in manifest["shards"]]
    assert results["plain.tar"] == results["packed.tar.gz"]


# -- sources --------------------------------------------------------------------------------------------------------
def test_imagefolder_with_synsets_maps_to_imagenet_indices(tmp_path):
    make_imagefolder(tmp_path / "src", ["n01440764", "n03218198"], per_class=2)
    cfg = write_config(tmp_path / "cfg.yaml", f"imagefolder:{tmp_path / 'src'}")
    manifest = build(load_config(str(cfg)), tmp_path / "out", progress=False)
    assert manifest["label_space"]["name"] == "imagenet-1k"
    assert manifest["counts"]["original"]["by_class"] == {"0": 2, "537": 2}
    import datasets

    ds = datasets.load_dataset(str(tmp_path / "out"), "original", split="test", cache_dir=str(tmp_path / "hf"))
    assert {r["json"]["label_name"] for r in ds} == {"tench", "dog sled"}


@pytest.mark.e2e  # runs lance-cf as a process
def test_imagenet_source_class_subset_by_synset_index_and_name(tmp_path):
    make_imagefolder(tmp_path / "val", ["n01440764", "n01443537", "n03218198"], per_class=3)
    cfg = write_config(tmp_path / "cfg.yaml", f"imagenet:{tmp_path / 'val'}")
    out = tmp_path / "out"
    cli("build", str(cfg), "--output", str(out), "--classes", "dog sled,1", "--no-progress")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["original"]["by_class"] == {"1": 3, "537": 3}
    assert manifest["source"]["imagenet_derived"] is True
    proc = cli("build", str(cfg), "--output", str(tmp_path / "o2"), "--classes", "dog sleigh ride", check=False)
    assert proc.returncode == 2 and "not an ImageNet-1k synset, index or class name" in proc.stderr


def test_hf_dataset_source_from_disk(tmp_path):
    import datasets

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["ant", "bee"])})
    ds = datasets.Dataset.from_dict(
        {"image": [photo(i) for i in range(5)], "label": [0, 1, 1, 0, 1]}, features=features
    )
    ds.save_to_disk(str(tmp_path / "hfds"))
    cfg = write_config(tmp_path / "cfg.yaml", f"hf:{tmp_path / 'hfds'}")
    manifest = build(load_config(str(cfg)), tmp_path / "out", progress=False)
    assert manifest["label_space"]["names"] == ["ant", "bee"]
    assert manifest["counts"]["original"]["by_class"] == {"0": 2, "1": 3}
    assert verify_release(tmp_path / "out") == []


@pytest.mark.e2e  # runs lance-cf as a process
def test_demo_preset_original_offline(tmp_path):
    out = tmp_path / "demo"
    cli("build", "demo", "--output", str(out), "--configs", "original", "--no-progress")
    cli("verify", str(out))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["original"]["by_class"] == {"281": 1, "652": 1, "657": 1, "698": 1, "967": 1}


# -- verify catches corruption -----------------------------------------------------------------------------------------
@pytest.fixture
def small_release(tmp_path):
    src = make_imagefolder(tmp_path / "src", ["a", "b"], per_class=3)
    cfg = write_config(tmp_path / "cfg.yaml", f"imagefolder:{src}")
    build(load_config(str(cfg)), tmp_path / "out", progress=False)
    return tmp_path / "out"


def _flip(path: Path, position: int) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= 0x01
    path.write_bytes(bytes(data))


def test_verify_catches_any_flipped_byte(small_release):
    rng = random.Random(0)
    targets = [small_release / "manifest.json", next((small_release / "data" / "original").glob("*.tar"))]
    for target in targets:
        original = target.read_bytes()
        for position in rng.sample(range(len(original)), 12) + [0, len(original) - 1]:
            _flip(target, position)
            problems = verify_release(small_release)
            assert problems, f"flipping byte {position} of {target.name} went unnoticed"
            target.write_bytes(original)
    assert verify_release(small_release) == []


@pytest.mark.e2e  # runs lance-cf as a process
def test_verify_cli_names_the_first_mismatch(small_release):
    shard = next((small_release / "data" / "original").glob("*.tar"))
    _flip(shard, 700)
    proc = cli("verify", str(small_release), check=False)
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"verify: FAILED: data/original/{shard.name}: sha256")


def test_verify_catches_bad_metadata_even_with_fixed_up_hashes(small_release):
    """A metadata file edited and the hashes recomputed: the schema and counts still catch it."""
    from builder.release import canonical_json, manifest_digest
    from builder.release_format.shards import file_sha256

    shard = next((small_release / "data" / "original").glob("*.tar"))
    members = []
    edited = False
    with tarfile.open(shard) as tar:
        for info in tar:
            data = tar.extractfile(info).read()
            if info.name.endswith(".json") and not edited:
                edited = True
                meta = json.loads(data)
                meta["edit_type"] = "mood"  # not an edit type
                data = json.dumps(meta).encode()
            members.append((info, data))
    with tarfile.open(shard, "w", format=tarfile.GNU_FORMAT) as tar:
        for info, data in members:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    manifest = json.loads((small_release / "manifest.json").read_text())
    manifest["shards"][0]["sha256"], manifest["shards"][0]["bytes"] = file_sha256(shard)
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (small_release / "manifest.json").write_bytes(canonical_json(manifest))
    problems = verify_release(small_release)
    assert problems and "edit_type" in problems[0] and "mood" in problems[0]


# -- CLI ----------------------------------------------------------------------------------------------------------------
@pytest.mark.e2e  # runs lance-cf as a process
@pytest.mark.parametrize("command", [[], ["build"], ["verify"], ["presets"]])
def test_help_explains_itself(command):
    proc = cli(*command, "--help")
    assert "usage: lance-cf" in proc.stdout and len(proc.stdout.splitlines()) > 3


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["build", "demo", "--output", "x", "--limit", "0"], "expected a positive integer"),
        (["build", "demo", "--output", "x", "--configs", "original,counterfactuals"], "expected one of"),
        (["build", "dmeo", "--output", "x"], "did you mean 'demo'"),
        (
            ["build", "demo", "--output", "x", "--configs", "original", "--source", "nosuch:/x"],
            "unknown source 'nosuch'",
        ),
        (["build", "demo", "--output", "x", "--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["verify", "/nonexistent/release"], "is not a directory"),
    ],
)
@pytest.mark.e2e  # runs lance-cf as a process
def test_wrong_values_get_one_line_errors(args, expected, tmp_path):
    proc = cli(*args, check=False)
    assert proc.returncode == 2
    assert expected in proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 2 and "Traceback" not in proc.stderr
