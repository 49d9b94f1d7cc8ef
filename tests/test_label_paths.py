"""Class names shaped like paths are data, not machine paths: Open Images names its classes ``/m/01g317``.

A release built by the real builder from a ``datasets`` source with such class names is published (``lance-cf
publish``, against the Hub double) without ``--allow-local-paths``, and results naming those classes are published
(``lance-cf publish-results``) with the names unchanged, while a real machine path beside them is still removed.
"""

from __future__ import annotations

import json

import datasets
import pytest
from builder_helpers import photo, write_config
from publish_fixture import make_results
from test_publish import REPO
from test_publish_adversarial import write_results

from builder import release_format as rf
from builder.config import load_config
from builder.engine import build
from builder.release_format.hub_client import local_paths, local_paths_in_text, scrub_local_paths

OPEN_IMAGES = ["/m/01g317", "/m/09j2d"]  # "Person", "Clothing" in Open Images' class descriptions


def _open_images_release(tmp_path):
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=OPEN_IMAGES)})
    rows = {"image": [photo(i) for i in range(4)], "label": [0, 1, 0, 1]}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "hfds"))
    config = write_config(tmp_path / "c.yaml", f"hf:{tmp_path / 'hfds'}", name="open-images-slice")
    release = tmp_path / "release"
    manifest = build(load_config(str(config)), release, progress=False)
    return release, manifest


@pytest.mark.e2e  # publishes over real HTTP against the local Hub double
def test_path_shaped_class_names_are_published_as_they_are(hub_env, tmp_path, caplog, cli):
    import logging

    double = hub_env
    release, manifest = _open_images_release(tmp_path)
    assert manifest["label_space"]["names"] == OPEN_IMAGES
    assert "/m/01g317" in (release / rf.CARD_NAME).read_text()  # the card's class table names them
    assert cli("publish", str(release), "--repo-id", REPO) == 0  # no --allow-local-paths needed

    result = make_results(manifest, "resnet18", 50.0)
    result["metrics"]["original"]["by_class"] = {"0": {"label_name": "/m/01g317", "n": 6, "acc1": 80.0, "acc5": 95.0}}
    result["model"]["class_map"] = "/home/alice/maps/open-images.txt"  # a real machine path: removed
    caplog.set_level(logging.WARNING)
    assert cli("publish-results", str(write_results(tmp_path / "out", result)), "--repo-id", REPO) == 0
    assert "machine paths removed before publishing from model.class_map" in caplog.text
    stored = double.entries("datasets", REPO, "main")
    published = json.loads(double.read_file("datasets", REPO, stored["results/v1.0.0/resnet18.json"]))
    assert published["metrics"]["original"]["by_class"]["0"]["label_name"] == "/m/01g317"
    assert published["model"]["class_map"] == "open-images.txt"


def test_the_guard_tells_labels_from_paths():
    manifest = {"label_space": {"names": OPEN_IMAGES}, "source": {"spec": "imagefolder:/home/alice/photos"}}
    assert local_paths(manifest, labels=set(OPEN_IMAGES)) == [("source.spec", "imagefolder:/home/alice/photos")]
    card = "| /m/01g317 (0) | 2 |\n| /m/09j2d (1) | 2 |\nbuilt from /home/alice/photos\n"
    assert local_paths_in_text(card, set(OPEN_IMAGES)) == ["/home/alice/photos"]
    clean, changed = scrub_local_paths({"label_name": "/m/01g317", "checkpoint": "/srv/ckpt/m.safetensors"})
    assert clean == {"label_name": "/m/01g317", "checkpoint": "m.safetensors"} and changed == ["checkpoint"]
