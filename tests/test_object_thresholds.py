"""Per-class object-presence thresholds (dataset interfaces, Appendix A.3): `interfaces calibrate` against an
independent computation, the filter that applies them, and the build's refusal to filter without them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from builder_helpers import make_imagefolder, photo

pytestmark = pytest.mark.usefixtures("single_thread_torch")
CLASSES = {"n01440764": "tench", "n01443537": "goldfish"}
LABELS = {"tench": 0, "goldfish": 1}  # their ImageNet-1k indices


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    from lance_pipeline.tiny.clip_components import create_tiny_open_clip

    return create_tiny_open_clip(tmp_path_factory.mktemp("clip") / "tiny-clip")


def independent_scores(clip_dir, images, text):
    """Cosine similarities by open_clip's own calls, not the project's scorer."""
    import open_clip

    model, preprocess = open_clip.create_model_from_pretrained("local-dir:" + str(clip_dir))
    tokenizer = open_clip.get_tokenizer("local-dir:" + str(clip_dir))
    model.eval()
    with torch.no_grad():
        img = model.encode_image(torch.stack([preprocess(i.convert("RGB")) for i in images]))
        txt = model.encode_text(tokenizer([text]))
    img = img / img.norm(dim=-1, keepdim=True)
    txt = txt / txt.norm(dim=-1, keepdim=True)
    return (img @ txt[0]).tolist()


def hand_percentile(values, p):
    """The linear-interpolation percentile, written out."""
    ordered = sorted(values)
    rank = p / 100 * (len(ordered) - 1)
    low = int(np.floor(rank))
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@pytest.fixture(scope="module")
def calibrated(clip_dir, tmp_path_factory):
    from builder.cli import main

    root = tmp_path_factory.mktemp("cal")
    photos = make_imagefolder(root / "photos", list(CLASSES), 7)
    out = root / "thresholds.json"
    args = ["interfaces", "calibrate", "--source", f"imagefolder:{photos}", "--output", str(out),
            "--percentile", "40", "--clip-model", str(clip_dir), "--clip-pretrained", "none", "--device", "cpu"]  # fmt: skip
    assert main(args) == 0
    return photos, out


@pytest.mark.slow
def test_calibrate_writes_each_class_percentile_of_its_real_images(clip_dir, calibrated):
    from PIL import Image

    photos, out = calibrated
    data = json.loads(out.read_text())
    assert data["percentile"] == 40 and data["percentile_is_default"] is False
    assert data["clip"]["model"] == "tiny-clip" and data["clip"]["weights_sha256"]
    assert data["source"] == "imagefolder:photos"  # the source's name, never a machine path
    assert data["format_version"] == 2
    assert {k: v["name"] for k, v in data["classes"].items()} == {"0": "tench", "1": "goldfish"}
    for synset, name in CLASSES.items():
        images = [Image.open(p) for p in sorted((photos / synset).iterdir())]
        entry = data["classes"][str(LABELS[name])]
        assert entry["images"] == 7 and entry["label"] == LABELS[name]
        photo_scores = independent_scores(clip_dir, images, f"a photo of a {name}")
        style_scores = independent_scores(clip_dir, images, f"a {name}")
        assert entry["photo"] == pytest.approx(hand_percentile(photo_scores, 40), abs=1e-5)
        assert entry["style"] == pytest.approx(hand_percentile(style_scores, 40), abs=1e-5)


def test_calibrate_default_percentile_is_flagged_as_ours_and_existing_output_kept(
    clip_dir, calibrated, tmp_path, capsys, lance_cf
):
    photos, out = calibrated
    again = tmp_path / "t.json"
    base = ["interfaces", "calibrate", "--source", f"imagefolder:{photos}", "--classes", "n01440764",
            "--clip-model", str(clip_dir), "--clip-pretrained", "none", "--device", "cpu"]  # fmt: skip
    assert lance_cf(*base, "--output", str(again))[0] == 0
    data = json.loads(again.read_text())
    assert data["percentile"] == 5 and data["percentile_is_default"] is True
    assert "lance-cf's choice" in data["percentile_note"]
    before = out.read_bytes()
    code, _, err = lance_cf(*base, "--output", str(out))
    assert code == 2 and "--force" in err and len(err.strip().splitlines()) == 1
    assert out.read_bytes() == before
    code, _, err = lance_cf(*base, "--output", str(tmp_path / "x.json"), "--percentile", "101")
    assert code == 2 and "percentile 101" in err


@pytest.mark.slow
def test_the_filter_rejects_exactly_what_an_independent_per_class_percentile_says(clip_dir, calibrated):
    from lance_pipeline.interfaces.generation import ShiftFilterStage

    _, out = calibrated
    thresholds = json.loads(out.read_text())["classes"]
    stage = ShiftFilterStage(clip_model=str(clip_dir), clip_pretrained=None, object_thresholds=str(out))
    stage.load("cpu")
    records, expected = [], []
    for i in range(12):
        name = list(CLASSES.values())[i % 2]
        style = i % 3 == 0
        image = photo(5000 + i)
        caption = f"a {name}" if style else f"a photo of a {name}"
        records.append({"generated": image, "label": LABELS[name], "label_name": name, "shift": "base",
                        "object_caption": caption, "shift_caption": None, "shift_threshold": None})  # fmt: skip
        threshold = thresholds[str(LABELS[name])]["style" if style else "photo"]
        expected.append(independent_scores(clip_dir, [image], caption)[0] >= threshold)
    verdicts = stage.process(records)
    assert [v["passed"] for v in verdicts] == expected
    assert any(expected) and not all(expected)  # the comparison means something only with both outcomes
    assert [v["release_config"] for v in verdicts] == ["base" if e else None for e in expected]
    described = stage.describe()
    assert described["object_rule"] == "per_class" and described["object_thresholds"] == "thresholds.json"
    assert described["object_thresholds_data"]["classes"]["0"]["images"] == 7


def _star_config(tmp_path, clip_dir, **filter_options):
    data = {
        "name": "star-test",
        "safety": False,  # the object filter is what is tested here
        "source": "generate:imagenet",
        "source_options": {"classes": list(CLASSES), "per_class": 2, "shifts": ["base", "in_the_snow"]},
        "configs": ["base", "in_the_snow"],
        "stages": [
            {"name": "generate", "type": "shift_generation", "configs": ["base", "in_the_snow"],
             "options": {"model": "demo:tiny-stable-diffusion", "plain_prompt": True}},
            {"name": "filter", "type": "shift_filter", "configs": ["base", "in_the_snow"],
             "options": {"clip_model": str(clip_dir), "clip_pretrained": None, **filter_options}},
        ],
    }  # fmt: skip
    path = tmp_path / "star.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_build_refuses_the_object_filter_without_thresholds_for_its_classes(
    clip_dir, calibrated, tmp_path, capsys, lance_cf
):
    _, out = calibrated
    code, _, err = lance_cf("validate", str(_star_config(tmp_path, clip_dir)))
    assert code == 2 and "needs per-class thresholds" in err and "interfaces calibrate" in err
    assert len(err.strip().splitlines()) == 1
    # explicit choices are accepted
    assert lance_cf("validate", str(_star_config(tmp_path, clip_dir, object_filter=False)))[0] == 0
    assert lance_cf("validate", str(_star_config(tmp_path, clip_dir, object_threshold=0.2)))[0] == 0
    assert lance_cf("validate", str(_star_config(tmp_path, clip_dir, object_thresholds=str(out))))[0] == 0
    # thresholds for one class only: refused before any model runs, naming the file and the missing class
    partial = json.loads(out.read_text())
    del partial["classes"]["1"]
    partial_file = tmp_path / "partial.json"
    partial_file.write_text(json.dumps(partial))
    config = _star_config(tmp_path, clip_dir, object_thresholds=str(partial_file))
    code, _, err = lance_cf("validate", str(config))
    assert code == 2 and str(partial_file) in err and "'goldfish'" in err and len(err.strip().splitlines()) == 1
    code, _, err = lance_cf("build", str(config), "--output", str(tmp_path / "out"), "--device", "cpu")
    assert code == 2 and "'goldfish'" in err and not (tmp_path / "out").exists()
    # thresholds of another CLIP model
    other = json.loads(out.read_text())
    other["clip"]["model"] = "ViT-L-14"
    other_file = tmp_path / "other.json"
    other_file.write_text(json.dumps(other))
    code, _, err = lance_cf("validate", str(_star_config(tmp_path, clip_dir, object_thresholds=str(other_file))))
    assert code == 2 and "ViT-L-14" in err and "calibrate with the filter's CLIP model" in err
    # a file that is not a thresholds file
    bad = tmp_path / "bad.json"
    bad.write_text('{"classes": {}}')
    code, _, err = lance_cf("validate", str(_star_config(tmp_path, clip_dir, object_thresholds=str(bad))))
    assert code == 2 and str(bad) in err and len(err.strip().splitlines()) == 1


def test_same_named_imagenet_classes_keep_their_own_thresholds(clip_dir, tmp_path):
    """ImageNet-1k's readable names repeat (two 'missile', two 'sunglasses'): a file keyed by name kept one threshold
    of each pair. Keyed by index, all 1,000 classes of the real list survive a write and a read, each its own."""
    from builder.imagenet import class_names
    from lance_pipeline.interfaces.generation import ShiftFilterStage
    from lance_pipeline.interfaces.object_thresholds import ClassThreshold, ObjectThresholds

    names = list(class_names())
    assert len(names) == 1000
    repeated = {n: [i for i, m in enumerate(names) if m == n] for n in names if names.count(n) > 1}
    assert repeated == {"missile": [657, 744], "sunglasses": [836, 837]}  # the test means something only with these
    # distinct values per class, so that any overwrite shows
    classes = {i: ClassThreshold(i, 10 + i, round(-0.5 + i / 1000, 6), round(0.5 - i / 2000, 6), n)
               for i, n in enumerate(names)}  # fmt: skip
    path = ObjectThresholds({"model": "tiny-clip", "pretrained": None}, 5.0, True, "imagenet:val", classes).write(
        tmp_path / "thresholds.json"
    )
    back = ObjectThresholds.read(path)
    assert len(back.classes) == 1000
    for i in range(1000):
        assert back.classes[i] == classes[i]
        assert back.threshold(i, style=False) == classes[i].photo and back.threshold(i, style=True) == classes[i].style
    assert back.threshold(657, style=False) != back.threshold(744, style=False)
    assert back.threshold(836, style=True) != back.threshold(837, style=True)
    # the filter looks a record's threshold up by its label, never its name
    stage = ShiftFilterStage(clip_model=str(clip_dir), clip_pretrained=None, object_thresholds=str(path))
    stage.check_classes(dict(enumerate(names)))
    for label in (657, 744, 836, 837):
        record = {"label": label, "label_name": names[label], "object_caption": f"a photo of a {names[label]}"}
        assert stage._object_threshold(record) == classes[label].photo
    # a build whose label space names an index differently was calibrated elsewhere: refused, naming the class
    with pytest.raises(ValueError, match="class 744 is 'cruise missile' in this build but 'missile' in the file"):
        stage.check_classes({**dict(enumerate(names)), 744: "cruise missile"})


def test_a_name_keyed_thresholds_file_is_refused_with_the_fix(tmp_path):
    from lance_pipeline.interfaces.object_thresholds import ObjectThresholds

    old = tmp_path / "old.json"
    old.write_text(json.dumps({"format": "lance-cf object thresholds", "format_version": 1, "clip": {"model": "m"},
                               "percentile": 5, "classes": {"missile": {"label": 744, "images": 3, "photo": 0.2,
                                                                        "style": 0.1}}}))  # fmt: skip
    with pytest.raises(ValueError, match="format version 1 keyed thresholds by class name.*recalibrate"):
        ObjectThresholds.read(old)
