"""Tests of the dataset card renderer (dataset_cards/card.py) on a small release generated in tmp_path."""

from __future__ import annotations

import io
import json
import re

import pytest
from PIL import Image
from publish_fixture import make_release, make_results

from builder import release_format as rf
from dataset_cards import render_release_card
from dataset_cards.card import changelog, read_shard_samples, select_pairs
from evaluation.leaderboard import replace_leaderboard_section

HIGHLIGHT = (255, 221, 87)


def _front_matter(text: str) -> dict:
    import yaml

    match = re.match(r"^---\n(.*?)\n---\n", text, re.DOTALL)
    assert match, "card has no YAML front matter"
    return yaml.safe_load(match.group(1))


@pytest.fixture
def release(tmp_path):
    return make_release(tmp_path / "release")


def test_card_yaml_declares_every_config_and_parses_with_hub_and_datasets(release):
    from datasets.info import DatasetInfosDict
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard

    release_dir, manifest = release
    text = render_release_card(release_dir, manifest)
    assert (release_dir / "README.md").read_text(encoding="utf-8") == text
    meta = _front_matter(text)
    assert meta["configs"] == rf.card_configs(manifest["configs"])
    assert meta["dataset_info"] == rf.card_dataset_info(manifest)
    assert "webdataset" in meta["tags"] and meta["task_categories"] == ["image-classification"]
    assert meta["size_categories"] == ["n<1K"]
    assert meta["pretty_name"]
    front = text.split("\n---\n", 1)[0]
    last = manifest["label_space"]["num_classes"] - 1
    assert len(manifest["configs"]) >= 2 and last > 0
    # the class names written once (an anchor), the other configs an alias: a 1,000-class card stays readable
    assert front.count(f"'{last}': ") == 1 and front.count("names: *") == len(manifest["configs"]) - 1

    card = DatasetCard.load(release_dir / "README.md")
    # The card is written without huggingface_hub's YAML round trip (too slow for ImageNet's class list): the Hub's
    # card class reads it and writes back exactly this text.
    assert str(card) == text
    configs = MetadataConfigs.from_dataset_card_data(card.data)
    assert set(configs) == set(manifest["configs"])
    assert configs["counterfactual"]["data_files"] == [{"split": "test", "path": rf.shard_glob("counterfactual")}]
    infos = DatasetInfosDict.from_dataset_card_data(card.data)
    for config in manifest["configs"]:
        assert infos[config].splits["test"].num_examples == manifest["counts"][config]["total"]
        assert "png" in infos[config].features and "json" in infos[config].features


def test_licence_follows_source_terms(tmp_path):
    imagenet_dir, imagenet = make_release(tmp_path / "imagenet", imagenet_derived=True)
    meta = _front_matter(render_release_card(imagenet_dir, imagenet))
    assert (meta["license"], meta["license_name"]) == ("other", "imagenet")
    assert "ImageNet" in meta["extra_gated_prompt"] and meta["extra_gated_fields"]

    open_dir, open_manifest = make_release(tmp_path / "open", imagenet_derived=False)
    text = render_release_card(open_dir, open_manifest)
    meta = _front_matter(text)
    assert meta["license"] == "cc-by-4.0" and "extra_gated_prompt" not in meta and "license_name" not in meta


def test_card_passes_hub_metadata_validation(release, hub_env, monkeypatch):
    """``DatasetCard.validate`` posts to ``/api/validate-yaml``: served by the double, which can also reject."""
    from huggingface_hub import DatasetCard, constants

    release_dir, manifest = release
    text = render_release_card(release_dir, manifest)
    hub = hub_env
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)  # fixed when huggingface_hub was imported
    DatasetCard(text).validate(repo_type="dataset")
    broken = text.replace("- n<1K", "- tiny", 1)
    with pytest.raises(ValueError, match="size_categories"):
        DatasetCard(broken).validate(repo_type="dataset")
    assert any(path == "/api/validate-yaml" for _, path, _ in hub.log)


def test_card_links_resolve_and_gallery_pairs_are_joined_by_source_key(release):
    release_dir, manifest = release
    text = render_release_card(release_dir, manifest)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    images = [link for link in links if link.startswith("assets/")]
    assert images, "the card shows no gallery"
    for link in links:
        if not re.match(r"^https?://", link):
            assert (release_dir / link).is_file(), f"broken link {link}"

    originals = {}
    for shard in manifest["shards"]:
        if shard["config"] == "original":
            originals.update(read_shard_samples(release_dir / shard["path"]))
    counterfactuals = {}
    for shard in manifest["shards"]:
        if shard["config"] == "counterfactual":
            counterfactuals.update(read_shard_samples(release_dir / shard["path"]))
    pairs = select_pairs(originals, counterfactuals, limit=len(images))
    assert len(pairs) == len(images) == min(6, len(counterfactuals))
    # One of each edit type before any repeat.
    edit_types = [meta["edit_type"] for meta, _, _ in pairs]
    assert len(set(edit_types)) == len(edit_types)
    for (meta, original, counterfactual), link in zip(pairs, images, strict=True):
        assert original == originals[meta["source_key"]]["png"]
        assert counterfactual == counterfactuals[meta["key"]]["png"]
        picture = Image.open(release_dir / link).convert("RGB")
        source = Image.open(io.BytesIO(original))
        scaled_width = round(source.width * 224 / source.height)
        # Left half: the original, scaled; the edited span is highlighted in the caption strip below.
        assert picture.getpixel((scaled_width // 2, 112)) == Image.open(io.BytesIO(original)).convert("RGB").resize(
            (scaled_width, 224), Image.Resampling.BICUBIC
        ).getpixel((scaled_width // 2, 112))
        strip = picture.crop((0, 224, picture.width, picture.height))
        assert HIGHLIGHT in {c for _, c in strip.getcolors(maxcolors=1 << 16)}
        assert f"**{meta['edited_span']}**" in text


def test_counts_and_changelog_against_previous_release(tmp_path):
    v1_dir, v1 = make_release(tmp_path / "v1")
    v2_dir, v2 = make_release(tmp_path / "v2", version="2.0.0", num_sources=9, drop_classes=(1,))
    text = render_release_card(v2_dir, v2, previous_manifest=v1)
    changelog = text[text.index("## Changelog") :]
    rows = re.findall(r"^\| `(\w+)` \| ([\w ]+) \| ([^|]+) \| (\d+) \| (\d+) \| ([+-]\d+) \|$", changelog, re.MULTILINE)
    assert rows
    expected = set()
    for config in v2["configs"]:
        old, new = v1["counts"][config], v2["counts"][config]
        if old["total"] != new["total"]:
            expected.add((config, "total", "all", old["total"], new["total"]))
        for label in set(old["by_class"]) | set(new["by_class"]):
            a, b = old["by_class"].get(label, 0), new["by_class"].get(label, 0)
            if a != b:
                expected.add((config, "class", f"{v2['label_space']['names'][int(label)]} ({label})", a, b))
        for edit in set(old["by_edit_type"]) | set(new["by_edit_type"]):
            a, b = old["by_edit_type"].get(edit, 0), new["by_edit_type"].get(edit, 0)
            if a != b:
                expected.add((config, "edit type", edit, a, b))
    got = {(c, g, v.strip(), int(a), int(b)) for c, g, v, a, b, d in rows}
    assert got == expected
    assert all(int(d) == int(b) - int(a) for _, _, _, a, b, d in rows)
    # Goldfish (class 1) was dropped: it is reported as lost, and absent from the per-class counts.
    assert any(v.startswith("goldfish") and b == "0" for _, _, v, _, b, _ in rows)
    counts_section = text[text.index("### Counts by class") : text.index("## Gallery")]
    assert "goldfish" not in counts_section
    first = render_release_card(v1_dir, v1)
    assert "First release (v1.0.0)" in first


def test_leaderboard_is_evaluations_table_and_refreshes_in_place(release):
    """The card embeds evaluation's one leaderboard (ranked by paired delta), failed runs left out."""
    from evaluation.leaderboard import leaderboard_markdown

    release_dir, manifest = release
    failed = make_results(manifest, "broken", 0.0, status="error", error="OOM")
    results = [make_results(manifest, "resnet18", 55.0), make_results(manifest, "convnext_atto", 72.5), failed]
    plain = render_release_card(release_dir, manifest)
    assert "## Leaderboard" not in plain
    text = render_release_card(release_dir, manifest, results=results)
    board = text[text.index("## Leaderboard") : text.index("## How it was built")]
    assert leaderboard_markdown(results) in board
    ranked = [line.split("|")[2].strip() for line in board.splitlines() if re.match(r"^\| \d+ \|", line)]
    assert ranked == ["convnext\\_atto", "resnet18"]  # failed run left out
    # Refreshing a rendered card's leaderboard gives exactly the card rendered with those results.
    assert replace_leaderboard_section(plain, results) == text
    assert replace_leaderboard_section(text, []) == plain
    assert json.loads((release_dir / rf.MANIFEST_NAME).read_text()) == manifest  # the manifest is never rewritten


def test_render_rejects_a_non_manifest(tmp_path, release):
    with pytest.raises(ValueError, match="format_version None is not one this tool reads"):
        render_release_card(tmp_path, {"name": "x"})
    release_dir, manifest = release
    for field in ("version", "seed", "stages", "failures"):
        broken = {k: v for k, v in manifest.items() if k != field}
        with pytest.raises(ValueError, match=f"required field '{field}' is missing"):
            render_release_card(release_dir, broken)
    broken = {**manifest, "source": {k: v for k, v in manifest["source"].items() if k != "spec"}}
    with pytest.raises(ValueError, match="required field 'source.spec' is missing"):
        render_release_card(release_dir, broken)


def test_rendering_is_reproducible(release):
    release_dir, manifest = release
    first = render_release_card(release_dir, manifest)
    pngs = {p.name: p.read_bytes() for p in (release_dir / "assets").glob("*.png")}
    assert render_release_card(release_dir, manifest) == first
    assert {p.name: p.read_bytes() for p in (release_dir / "assets").glob("*.png")} == pngs


def test_leaderboard_tells_weights_apart(release):
    """The same architecture with pretrained, random and checkpoint weights gives three distinguishable rows."""
    release_dir, manifest = release
    pretrained = make_results(manifest, "resnet18", 60.0)
    random_weights = make_results(manifest, "resnet18", 0.5)
    random_weights["model"].update(weights={"id": "random"}, slug="resnet18-random")
    checkpoint = make_results(manifest, "resnet18", 40.0)
    checkpoint["model"].update(weights={"id": "checkpoint:sha256:" + "ab12" * 16}, slug="resnet18-ckpt")
    text = render_release_card(release_dir, manifest, results=[pretrained, random_weights, checkpoint])
    board = text[text.index("## Leaderboard") : text.index("## How it was built")]
    models = [line.split("|")[2].strip() for line in board.splitlines() if re.match(r"^\| \d+ \|", line)]
    assert len(models) == len(set(models)) == 3 and models[0] == "resnet18", models


def test_licence_text_ends_with_one_full_stop(tmp_path):
    release_dir, manifest = make_release(tmp_path / "open", imagenet_derived=False)
    manifest["source"]["license"] = "Photos under their own terms; see SOURCES.md."
    text = render_release_card(release_dir, manifest)
    assert "Source data terms: Photos under their own terms; see SOURCES.md.\n" in text


def _counts_manifest(version: str, names: list[str], by_class: dict[str, int]) -> dict:
    total = sum(by_class.values())
    counts = {"counterfactual": {"total": total, "by_edit_type": {"subject": total}, "by_class": by_class}}
    return {"version": version, "label_space": {"names": names}, "counts": counts}


def test_changelog_matches_classes_by_name_when_the_label_space_changes():
    """An imagefolder release that lost its 'dog' folder renumbers 'zebra' from 2 to 1: zebra did not change."""
    v1 = _counts_manifest("1.0.0", ["cat", "dog", "zebra"], {"0": 2, "1": 2, "2": 2})
    v2 = _counts_manifest("2.0.0", ["cat", "zebra"], {"0": 3, "1": 2})
    rows = {(r["group"], r["value"]): (r["before"], r["after"]) for r in changelog(v2, v1)["rows"]}
    assert rows == {
        ("total", "all"): (6, 5),
        ("edit type", "subject"): (6, 5),
        ("class", "cat (0)"): (2, 3),
        ("class", "dog (1 in v1.0.0)"): (2, 0),
    }


def test_changelog_matches_classes_by_index_in_one_label_space():
    """ImageNet-1k has two classes named 'crane' (134 and 517): one label space is compared index by index."""
    names = ["crane", "tench", "crane"]
    v1 = _counts_manifest("1.0.0", names, {"0": 2, "2": 2})
    v2 = _counts_manifest("1.1.0", names, {"0": 2, "2": 5})
    rows = [(r["group"], r["value"], r["before"], r["after"]) for r in changelog(v2, v1)["rows"]]
    assert ("class", "crane (2)", 2, 5) in rows and not any(v == "crane (0)" for _, v, _, _ in rows)


def test_gallery_spreads_over_source_images():
    """Three sources with one edit of each of three types: the gallery shows each type and each source once."""
    originals, counterfactuals = {}, {}
    for s in range(3):
        originals[f"src{s}"] = {"png": b"o%d" % s}
        for t, edit_type in enumerate(("subject", "background", "weather")):
            meta = {"source_key": f"src{s}", "edit_type": edit_type, "key": f"src{s}_cf{t}"}
            counterfactuals[f"src{s}_cf{t}"] = {"json": json.dumps(meta).encode(), "png": b"c%d%d" % (s, t)}
    pairs = select_pairs(originals, counterfactuals, limit=3)
    assert sorted(m["edit_type"] for m, _, _ in pairs) == ["background", "subject", "weather"]
    assert sorted(m["source_key"] for m, _, _ in pairs) == ["src0", "src1", "src2"]
    assert len(select_pairs(originals, counterfactuals, limit=20)) == 9  # every pair once when the limit allows


def test_hostile_class_names_and_captions_stay_inert(tmp_path):
    """Newlines, headings, images, links and HTML in class names reach the card (tables, gallery, alt text) escaped."""
    from release_fixture import write_release

    hostile = [
        "evil\n# Injected heading",
        "![x](https://evil.example/x.png)",
        "<script>alert(1)</script>",
        "pipe | cell\r\n- list",
    ]
    root = write_release(tmp_path / "hostile", label_names=hostile, labels=(0, 1, 2, 3), edits_per_original=1)
    text = render_release_card(root, json.loads((root / rf.MANIFEST_NAME).read_text()))
    body = text[text.index("\n---\n", 4) :]
    assert not re.search(r"^#+ Injected", body, re.MULTILINE)
    # No external image, in the text or inside an alt text (a backslash-escaped bracket does not close one).
    assert not re.search(r"!\[(?:\\.|[^\]\\])*\]\(https?://", body)
    assert "\\!\\[x\\](https://evil.example/x.png)" in body
    assert "<script>" not in body and "&lt;script&gt;" in body
    assert not re.search(r"^- list", body, re.MULTILINE)
    class_rows = [line for line in body.splitlines() if line.startswith("| ") and "(2)" in line]
    assert class_rows and all(line.count(" | ") == class_rows[0].count(" | ") for line in class_rows)
    gallery = re.findall(r"^!\[(.*)\]\((assets/[^)]+)\)$", body, re.MULTILINE)
    assert gallery and not [alt for alt, _ in gallery if re.search(r"(?<!\\)[\[\]]", alt)]  # brackets escaped
    assert rf.verify_release(root) == []


def test_thresholds_list_nested_stage_options_and_the_clip_gate_model(release):
    release_dir, manifest = release
    manifest = json.loads(json.dumps(manifest))
    manifest["config"]["stages"] = [
        {
            "name": "edit",
            "type": "prompt_to_prompt_edit",
            "configs": ["counterfactual"],
            "options": {
                "model": "CompVis/stable-diffusion-v1-4",
                "revision": "133a221b",
                "clip_model": "ViT-L-14",
                "clip_pretrained": "openai",
                "self_replace_sweep": [0.4, 0.6, 0.8],
                "cross_replace": 0.8,
                "gates": {"clip_directional_min": 0.2, "clip_image_min": 0.75},
                "null_text": {"num_inner_steps": 10},
                "local_model_dir": "/home/someone/models/sd",
            },
        },
        {"name": "label_check", "type": "label_check", "configs": ["counterfactual"],
         "options": {"label_threshold": 0.5}},
    ]  # fmt: skip
    manifest["stages"]["edit"] = {"model": "CompVis/stable-diffusion-v1-4", "clip": {"model": "ViT-L-14-quickgelu"}}
    text = render_release_card(release_dir, manifest)
    built = text[text.index("## How it was built") : text.index("## Known failure modes")]
    for expected in (
        "`edit.self_replace_sweep` = `[0.4, 0.6, 0.8]`",
        "`edit.cross_replace` = `0.8`",
        "`edit.gates.clip_directional_min` = `0.2`",
        "`edit.null_text.num_inner_steps` = `10`",
        "`label_check.label_threshold` = `0.5`",
    ):
        assert expected in built, expected
    edit_row = next(line for line in built.splitlines() if line.startswith("| edit |"))
    assert "`ViT-L-14`" in edit_row and "`ViT-L-14-quickgelu`" in edit_row and "`openai`" in edit_row
    assert "/home/someone" not in text


def test_the_card_and_manifest_publish_no_machine_path(tmp_path):
    from builder_helpers import make_imagefolder, write_config

    from builder.config import load_config
    from builder.engine import build
    from builder.sources import public_spec

    src = make_imagefolder(tmp_path / "deep" / "private" / "myphotos", ["cat", "dog"], per_class=1)
    cfg = write_config(tmp_path / "c.yaml", f"imagefolder:{src}")
    out = tmp_path / "out"
    manifest = build(load_config(str(cfg)), out, progress=False)
    assert manifest["source"]["spec"] == manifest["config"]["source"] == "imagefolder:myphotos"
    assert "- Source: `imagefolder:myphotos`" in (out / "README.md").read_text()
    for name in ("manifest.json", "README.md", "_info.json"):
        assert str(tmp_path) not in (out / name).read_text(), name
    assert public_spec("hf:user/dataset:test") == "hf:user/dataset:test"


def test_cards_import_only_the_release_format_from_builder():
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, dataset_cards.card\n"
        "print(','.join(sorted(m for m in sys.modules if m.startswith('builder.')"
        " and not m.startswith('builder.release_format'))))\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True)
    assert out.stdout.strip() == ""


def test_the_leaderboard_config_joins_the_card_yaml_once_and_the_rest_is_unchanged(release):
    import pandas as pd
    from huggingface_hub import DatasetCard

    from evaluation.publish_results import LEADERBOARD_CONFIG, with_leaderboard_config

    release_dir, manifest = release
    text = render_release_card(release_dir, manifest)
    table = pd.DataFrame({"model": ["resnet50", "vit"], "accuracy": [0.75, 0.5]})
    once = with_leaderboard_config(text, table)
    assert with_leaderboard_config(once, table) == once  # re-publishing replaces the config, never adds a second
    before, after = _front_matter(text), _front_matter(once)
    names = [c["config_name"] for c in after["configs"]]
    assert names == [c["config_name"] for c in before["configs"]] + [LEADERBOARD_CONFIG]
    assert {k: v for k, v in after.items() if k not in ("configs", "dataset_info")} == {
        k: v for k, v in before.items() if k not in ("configs", "dataset_info")
    }
    assert once.split("\n---\n", 1)[1] == text.split("\n---\n", 1)[1]  # the Markdown is untouched
    assert str(DatasetCard(once)) == once  # what the Hub's card class writes for the same data
    # A README someone wrote without YAML gets the block; a broken block is refused, naming the card.
    bare = with_leaderboard_config("# Our data\n", table)
    assert _front_matter(bare)["configs"][0]["config_name"] == LEADERBOARD_CONFIG and bare.endswith("---\n# Our data\n")
    with pytest.raises(ValueError, match="the card on the Hub: YAML front matter is not a mapping"):
        with_leaderboard_config("---\n- a list\n---\n# Our data\n", table)
