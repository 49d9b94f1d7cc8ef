"""The format's small pieces: the published schema, key sanitising, per-sample seeds, the payload codec."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from builder_helpers import photo

from builder.engine import derive_seed
from builder.ledger import decode_payload, encode_payload
from builder.release_format import is_valid_key, metadata_json_schema, sanitize_key

REPO = Path(__file__).resolve().parents[1]


def test_published_schema_matches_code():
    assert json.loads((REPO / "docs" / "metadata.schema.json").read_text()) == metadata_json_schema()


def test_sanitize_key_is_valid_and_collision_free():
    names = ["a.b", "a_b", "a b", "ünï", "x/y", "plain-key_1"]
    keys = [sanitize_key(n) for n in names]
    assert all(is_valid_key(k) for k in keys)
    assert len(set(keys)) == len(keys)
    assert sanitize_key("plain-key_1") == "plain-key_1"


def test_seeds_depend_on_release_seed_and_key_only():
    assert derive_seed(0, "k1") == derive_seed(0, "k1")
    assert derive_seed(0, "k1") != derive_seed(1, "k1") != derive_seed(0, "k2")
    assert 0 <= derive_seed(123, "x") < 2**31


def test_payload_codec_round_trips_images_tensors_and_json():
    img = photo(3)
    tensor = torch.randn(2, 3, dtype=torch.float32)
    update = {"caption": "a photo", "n": 3, "x": 0.1, "none": None, "nested": [{"image": img, "t": tensor}]}
    back = decode_payload(encode_payload(update))
    assert back["caption"] == "a photo" and back["n"] == 3 and back["x"] == 0.1 and back["none"] is None
    assert list(back["nested"][0]["image"].getdata()) == list(img.getdata())
    assert torch.equal(back["nested"][0]["t"], tensor)
