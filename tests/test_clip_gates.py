"""Tests of the CLIP gates (lance_pipeline/clip/gates.py) on a tiny open_clip model built locally."""

from __future__ import annotations

import math
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from PIL import Image

from lance_pipeline.clip.gates import (
    ClipGateThresholds,
    ClipScorer,
    clip_directional_similarity,
    edit_scores_from_embeddings,
    gate_failures,
    word_check_from_embeddings,
)
from lance_pipeline.clip.loader import ClipModelRef, needs_forced_quick_gelu
from lance_pipeline.tiny.clip_components import (
    TINY_OPEN_CLIP_MODEL_CFG,
    TINY_OPEN_CLIP_PREPROCESS_CFG,
    build_tiny_open_clip,
    create_tiny_open_clip,
)

CAPTIONS = ["a photo of a dog on grass", "a photo of a red car", "a photo of a bird in the sky"]
EDITED = ["a photo of a cat on grass", "a photo of a blue car", "a photo of a bird in the snow"]


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def _images(n: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8)) for _ in range(n)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return create_tiny_open_clip(tmp_path_factory.mktemp("tiny_open_clip"))


@pytest.fixture(scope="module")
def scorer(tiny_dir):
    s = ClipScorer(model=str(tiny_dir), batch_size=4)
    s.load("cpu")
    return s


@pytest.fixture(scope="module")
def reference():
    """Embeddings computed without ClipScorer: the in-memory tiny model, open_clip's own transform/tokenizer."""
    import open_clip

    model = build_tiny_open_clip()
    transform = open_clip.image_transform(
        TINY_OPEN_CLIP_MODEL_CFG["vision_cfg"]["image_size"],
        is_train=False,
        mean=tuple(TINY_OPEN_CLIP_PREPROCESS_CFG["mean"]),
        std=tuple(TINY_OPEN_CLIP_PREPROCESS_CFG["std"]),
    )
    tokenizer = open_clip.SimpleTokenizer(context_length=TINY_OPEN_CLIP_MODEL_CFG["text_cfg"]["context_length"])

    def images(ims):
        with torch.no_grad():
            return model.encode_image(torch.stack([transform(im) for im in ims])).double().numpy()

    def texts(ts):
        with torch.no_grad():
            return model.encode_text(tokenizer(ts)).double().numpy()

    return images, texts


# ------------------------------------------------------------------ directional similarity on known vectors


def test_directional_similarity_known_vectors():
    e1, e2, e3 = torch.eye(3)
    # The image moved from e1 to e2 and the caption moved from e1 to e2: same direction.
    assert clip_directional_similarity(e1, e2, e1, e2).item() == pytest.approx(1.0, abs=1e-6)
    # Caption moved the opposite way.
    assert clip_directional_similarity(e1, e2, e2, e1).item() == pytest.approx(-1.0, abs=1e-6)
    # (e2 - e1) . (e3 - e1) = 1, norms sqrt(2) each -> 1/2.
    assert clip_directional_similarity(e1, e2, e1, e3).item() == pytest.approx(0.5, abs=1e-6)
    # Inputs are L2-normalised first: scaling an embedding changes nothing.
    assert clip_directional_similarity(2 * e1, 5 * e2, e1, 3 * e3).item() == pytest.approx(0.5, abs=1e-6)
    # No image change: no direction, similarity 0 (fails any positive threshold).
    assert clip_directional_similarity(e1, e1, e1, e2).item() == 0.0

    rng = np.random.default_rng(1)
    ia, ib, ta, tb = (rng.normal(size=(6, 8)) for _ in range(4))
    expected = [_cos(_unit(ib[n]) - _unit(ia[n]), _unit(tb[n]) - _unit(ta[n])) for n in range(6)]
    got = clip_directional_similarity(*(torch.from_numpy(x) for x in (ia, ib, ta, tb)))
    assert got.shape == (6,)
    np.testing.assert_allclose(got.numpy(), expected, atol=1e-12)


def test_edit_scores_and_word_check_on_known_embeddings():
    s = math.sqrt(0.5)
    i1 = torch.tensor([[1.0, 0.0, 0.0]])
    i2 = torch.tensor([[s, s, 0.0]])
    t1 = torch.tensor([[1.0, 0.0, 0.0]])
    t2 = torch.tensor([[0.0, 1.0, 0.0]])
    (scores,) = edit_scores_from_embeddings(i1, i2, t1, t2)
    assert scores["clip_image"] == pytest.approx(s)
    assert scores["clip_text_original"] == pytest.approx(1.0)
    assert scores["clip_text_edited"] == pytest.approx(s)
    assert scores["edited_vs_original_caption"] == pytest.approx(0.0, abs=1e-7)  # equidistant from both captions
    # direction (s - 1, s, 0) vs (-1, 1, 0): cos = (1 - s + s) / (sqrt((s-1)^2 + s^2) * sqrt(2))
    assert scores["clip_directional"] == pytest.approx(1.0 / (math.sqrt((s - 1) ** 2 + s**2) * math.sqrt(2)))

    image = torch.tensor([[0.8, 0.6, 0.0], [0.8, 0.6, 0.0], [s, s, 0.0]])
    old = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    new = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    results = word_check_from_embeddings(image, old, new)
    assert [r["passes"] for r in results] == [False, True, False]  # the last is a tie: not better, fails
    assert results[0]["new_word_similarity"] == pytest.approx(0.6)
    assert results[0]["old_word_similarity"] == pytest.approx(0.8)


# ---------------------------------------------------------------------------- tiny model through the product


def test_tiny_model_saves_and_loads_back_identically(tiny_dir, scorer, reference, tmp_path):
    ref_images, ref_texts = reference
    images = _images(3)
    np.testing.assert_allclose(
        scorer.encode_images(images).numpy(), _l2(ref_images(images)), rtol=0, atol=1e-6
    )  # same batch, same weights
    np.testing.assert_allclose(scorer.encode_texts(CAPTIONS).numpy(), _l2(ref_texts(CAPTIONS)), rtol=0, atol=1e-6)

    loaded = scorer._model.state_dict()
    for key, tensor in build_tiny_open_clip().state_dict().items():
        assert torch.equal(loaded[key], tensor), key

    info = scorer.describe()
    assert info["model"] == tiny_dir.name and info["source"] == "local-dir" and info["pretrained"] is None
    assert info["quick_gelu"] is True and info["embed_dim"] == TINY_OPEN_CLIP_MODEL_CFG["embed_dim"]
    # The weights hash identifies the weights: a second save of the same model hashes the same, a changed one not.
    again = ClipScorer(model=create_tiny_open_clip(tmp_path / "again"))
    again.load("cpu")
    assert again.describe()["weights_sha256"] == info["weights_sha256"]
    from safetensors.torch import load_file, save_file

    changed_dir = tmp_path / "changed"
    shutil.copytree(tiny_dir, changed_dir)
    weights = load_file(str(changed_dir / "open_clip_model.safetensors"))
    weights["logit_scale"] = weights["logit_scale"] + 1.0
    save_file(weights, str(changed_dir / "open_clip_model.safetensors"))
    changed = ClipScorer(model=f"local-dir:{changed_dir}")
    changed.load("cpu")
    assert changed.describe()["weights_sha256"] != info["weights_sha256"]


def _l2(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def test_batched_and_one_by_one_encoding_agree(tiny_dir, scorer):
    one = ClipScorer(model=tiny_dir, batch_size=1)
    one.load("cpu")
    images = _images(7, seed=3)  # 7 with batch_size 4: a full and a partial batch
    texts = CAPTIONS + EDITED + ["a dog"]
    torch.testing.assert_close(scorer.encode_images(images), one.encode_images(images), rtol=0, atol=1e-5)
    torch.testing.assert_close(scorer.encode_texts(texts), one.encode_texts(texts), rtol=0, atol=1e-5)
    assert scorer.encode_images([]).shape == (0, TINY_OPEN_CLIP_MODEL_CFG["embed_dim"])


def test_hub_id_loads_through_the_local_directory_path(tiny_dir, scorer, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someone--tiny-clip"
    shutil.copytree(tiny_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    hub = ClipScorer(model="hf-hub:someone/tiny-clip", pretrained=None, cache_dir=str(tmp_path / "hub"))
    hub.load("cpu")
    images = _images(2, seed=5)
    torch.testing.assert_close(hub.encode_images(images), scorer.encode_images(images), rtol=0, atol=0)
    info = hub.describe()
    assert info["revision"] == commit and info["model"] == "hf-hub:someone/tiny-clip"
    assert info["weights_sha256"] == scorer.describe()["weights_sha256"]
    pinned = ClipScorer(model="hf-hub:someone/tiny-clip", revision=commit, cache_dir=str(tmp_path / "hub"))
    pinned.load("cpu")
    assert pinned.describe()["revision"] == commit


def test_builtin_openai_tag_gets_quick_gelu():
    # open_clip 3.x builds "ViT-B-32" with plain GELU even under the QuickGELU-trained OpenAI weights.
    assert ClipModelRef("ViT-B-32", "openai").resolve() == ("ViT-B-32", "openai", True, None)
    assert ClipModelRef("ViT-L-14", "openai").resolve() == ("ViT-L-14", "openai", True, None)
    assert ClipModelRef("ViT-B-32-quickgelu", "openai").resolve()[2] is False  # already in the config
    assert ClipModelRef("ViT-B-32", "laion2b_s34b_b79k").resolve()[2] is False  # trained with GELU
    assert ClipScorer().describe()["model"] == "ViT-L-14" and ClipScorer().describe()["pretrained"] == "openai"
    assert needs_forced_quick_gelu("ViT-L-14", "openai") and not needs_forced_quick_gelu("ViT-L-14", None)


@pytest.mark.slow
def test_openai_weights_path_builds_quick_gelu_activations(monkeypatch):
    """The loader's real build path for OpenAI weights makes a model with QuickGELU, and open_clip does not warn.

    No weights can be downloaded here, so the download returns a placeholder path and the checkpoint load is a
    no-op: everything else (config, the QuickGELU rule, the model class open_clip instantiates) is the real path.
    """
    import warnings

    import open_clip.factory

    monkeypatch.setattr(open_clip.factory, "download_pretrained", lambda cfg, cache_dir=None: "openai-weights.pt")
    monkeypatch.setattr(open_clip.factory, "load_checkpoint", lambda model, path, **kwargs: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # open_clip's "QuickGELU mismatch" warning would fail the test
        loaded = ClipModelRef("ViT-B-32", "openai").load("cpu")
    activations = {type(m).__name__ for m in loaded.model.modules()}
    assert "QuickGELU" in activations and "GELU" not in activations
    assert loaded.info["quick_gelu"] is True
    # The same architecture with GELU-trained weights keeps plain GELU.
    gelu = ClipModelRef("ViT-B-32", "laion2b_s34b_b79k").load("cpu")
    assert "QuickGELU" not in {type(m).__name__ for m in gelu.model.modules()} and gelu.info["quick_gelu"] is False


# ------------------------------------------------------------------------------------------------ the gates


def _independent_scores(reference, originals, edited, captions, edited_captions) -> list[dict[str, float]]:
    ref_images, ref_texts = reference
    i1, i2 = _l2(ref_images(originals)), _l2(ref_images(edited))
    t1, t2 = _l2(ref_texts(captions)), _l2(ref_texts(edited_captions))
    return [
        {
            "clip_directional": _cos(i2[n] - i1[n], t2[n] - t1[n]),
            "clip_image": float(i1[n] @ i2[n]),
            "clip_text_original": float(i1[n] @ t1[n]),
            "clip_text_edited": float(i2[n] @ t2[n]),
            "edited_vs_original_caption": float(i2[n] @ t2[n] - i2[n] @ t1[n]),
        }
        for n in range(len(originals))
    ]


SCORE_KEYS_ALL = (
    "clip_directional",
    "clip_image",
    "clip_text_original",
    "clip_text_edited",
    "edited_vs_original_caption",
)
GATES = {  # threshold field -> the score keys it bounds
    "directional": ("clip_directional",),
    "image": ("clip_image",),
    "text": ("clip_text_original", "clip_text_edited"),
}


def test_scores_match_independent_computation(scorer, reference):
    original = _images(1, seed=7)[0]
    edited = _images(3, seed=8)
    # The same original object for every candidate, as in a self-replace sweep.
    got = scorer.edit_scores([original] * 3, edited, [CAPTIONS[0]] * 3, EDITED)
    expected = _independent_scores(reference, [original] * 3, edited, [CAPTIONS[0]] * 3, EDITED)
    for g, e in zip(got, expected, strict=True):
        assert set(g) == set(e) and all(type(v) is float for v in g.values())
        for key in e:
            assert g[key] == pytest.approx(e[key], abs=1e-5), key


def _failed_keys(scores: dict[str, float], thresholds: ClipGateThresholds) -> set[str]:
    return {key for key in SCORE_KEYS_ALL for reason in gate_failures(scores, thresholds) if f"{key}=" in reason}


def test_gates_reject_exactly_at_each_threshold_boundary(scorer, reference):
    originals, edited = _images(3, seed=11), _images(3, seed=12)
    expected = _independent_scores(reference, originals, edited, CAPTIONS, EDITED)
    got = scorer.edit_scores(originals, edited, CAPTIONS, EDITED)
    others_open = dict.fromkeys(GATES, -1.0)
    for scores, independent in zip(got, expected, strict=True):
        for field, keys in GATES.items():
            for key in keys:
                value = scores[key]
                assert value == pytest.approx(independent[key], abs=1e-5)
                # A score exactly at its threshold passes; one float step above the score, it fails.
                for threshold in (value, float(np.nextafter(value, 2.0))):
                    thresholds = ClipGateThresholds(**{**others_open, field: threshold}, require_edited_closer=False)
                    assert _failed_keys(scores, thresholds) == {k for k in keys if scores[k] < threshold}
                    assert (key in _failed_keys(scores, thresholds)) == (threshold > value)
        # The default thresholds reject exactly the gates the independent scores miss.
        defaults = ClipGateThresholds()
        missed = {key for field, keys in GATES.items() for key in keys if independent[key] < getattr(defaults, field)}
        if independent["edited_vs_original_caption"] <= 0:
            missed.add("edited_vs_original_caption")
        assert _failed_keys(scores, defaults) == missed


def test_edited_closer_gate_follows_the_caption_order(scorer):
    original, edited = _images(2, seed=21)
    open_gates = ClipGateThresholds(directional=-1.0, image=-1.0, text=-1.0)
    forward = scorer.edit_scores([original], [edited], [CAPTIONS[1]], [EDITED[1]])[0]
    backward = scorer.edit_scores([original], [edited], [EDITED[1]], [CAPTIONS[1]])[0]
    # Swapping the captions negates cos(I2, T2) - cos(I2, T1): exactly one order passes.
    assert backward["edited_vs_original_caption"] == pytest.approx(-forward["edited_vs_original_caption"], abs=1e-6)
    assert forward["edited_vs_original_caption"] != 0
    passed = [gate_failures(forward, open_gates) == [], gate_failures(backward, open_gates) == []]
    assert sorted(passed) == [False, True]
    assert passed[0] == (forward["edited_vs_original_caption"] > 0)
    no_closer = ClipGateThresholds(directional=-1.0, image=-1.0, text=-1.0, require_edited_closer=False)
    assert gate_failures(forward, no_closer) == gate_failures(backward, no_closer) == []


def test_gate_edge_values():
    scores = dict.fromkeys(SCORE_KEYS_ALL, 0.9)
    assert gate_failures(scores, ClipGateThresholds()) == []
    # NaN never passes, whatever the threshold.
    failures = gate_failures({**scores, "clip_image": float("nan")}, ClipGateThresholds(image=-1.0))
    assert len(failures) == 1 and "clip_image=" in failures[0]
    # "Closer" is strict: equidistant from both captions fails; the smallest positive margin passes.
    assert _failed_keys({**scores, "edited_vs_original_caption": 0.0}, ClipGateThresholds()) == {
        "edited_vs_original_caption"
    }
    assert gate_failures({**scores, "edited_vs_original_caption": 5e-324}, ClipGateThresholds()) == []
    assert _failed_keys({**scores, "edited_vs_original_caption": float("nan")}, ClipGateThresholds()) == {
        "edited_vs_original_caption"
    }


def test_word_check_on_the_tiny_model(scorer, reference):
    ref_images, ref_texts = reference
    images = _images(4, seed=31)
    old, new = ["dog", "car", "bird", "tree"], ["cat", "truck", "plane", "house"]
    got = scorer.word_check(images, old, new)
    i, to, tn = _l2(ref_images(images)), _l2(ref_texts(old)), _l2(ref_texts(new))
    for n, result in enumerate(got):
        assert result["new_word_similarity"] == pytest.approx(float(i[n] @ tn[n]), abs=1e-5)
        assert result["old_word_similarity"] == pytest.approx(float(i[n] @ to[n]), abs=1e-5)
        assert result["passes"] == (result["new_word_similarity"] > result["old_word_similarity"])
    swapped = scorer.word_check(images, new, old)
    assert [r["passes"] for r in swapped] == [not r["passes"] for r in got]


# ---------------------------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_clear_value_errors(tiny_dir, scorer, tmp_path):
    images = _images(2)
    with pytest.raises(ValueError, match="same length.*edited_images=1"):
        scorer.edit_scores(images, images[:1], CAPTIONS[:2], EDITED[:2])
    with pytest.raises(ValueError, match="same length"):
        scorer.word_check(images, ["dog"], ["cat", "cow"])
    with pytest.raises(ValueError, match=r"old_words\[0\] must be a non-empty str"):
        scorer.word_check(images[:1], [" "], ["cat"])
    with pytest.raises(ValueError, match=r"images\[1\] must be a PIL"):
        scorer.encode_images([images[0], np.zeros((4, 4, 3))])
    with pytest.raises(ValueError, match=r"texts\[0\] must be a str"):
        scorer.encode_texts([3])
    with pytest.raises(ValueError, match="unknown open_clip model 'ViT-L-15'.*did you mean.*ViT-L-14"):
        ClipScorer(model="ViT-L-15")
    with pytest.raises(ValueError, match="unknown pretrained tag 'opnai'.*did you mean openai"):
        ClipScorer(model="ViT-L-14", pretrained="opnai")
    with pytest.raises(ValueError, match="pretrained='laion2b_s34b_b79k' cannot be used"):
        ClipScorer(model=tiny_dir, pretrained="laion2b_s34b_b79k")
    with pytest.raises(ValueError, match="revision.*only applies to 'hf-hub:'"):
        ClipScorer(model="ViT-L-14", revision="main")
    with pytest.raises(ValueError, match="expected 'hf-hub:ORG/NAME'"):
        ClipScorer(model="hf-hub:no-org")
    with pytest.raises(ValueError, match="model directory not found"):
        ClipScorer(model=str(tmp_path / "missing" / "dir"))
    assert ClipScorer(model="ViT-L/14").describe()["model"] == "ViT-L/14"  # OpenAI spelling accepted
    assert ClipModelRef(model="ViT-L/14").resolve()[0] == "ViT-L-14"
    with pytest.raises(ValueError, match="batch_size"):
        ClipScorer(model=tiny_dir, batch_size=0)
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    with pytest.raises(ValueError, match="has no open_clip_config.json"):
        ClipScorer(model=no_config).load("cpu")
    pickle_only = tmp_path / "pickle_only"
    shutil.copytree(tiny_dir, pickle_only)
    (pickle_only / "open_clip_model.safetensors").rename(pickle_only / "open_clip_pytorch_model.bin")
    with pytest.raises(ValueError, match="no .safetensors weights"):
        ClipScorer(model=pickle_only).load("cpu")
    with pytest.raises(ValueError, match="ClipGateThresholds.image must be a number in"):
        ClipGateThresholds(image=1.5)
    with pytest.raises(ValueError, match="require_edited_closer must be a bool"):
        ClipGateThresholds(require_edited_closer="yes")
    with pytest.raises(ValueError, match="missing 'edited_vs_original_caption'"):
        gate_failures(dict.fromkeys(SCORE_KEYS_ALL[:4], 0.5), ClipGateThresholds())
    with pytest.raises(ValueError, match="share one shape"):
        clip_directional_similarity(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3, 3))
    with pytest.raises(RuntimeError, match="load"):
        ClipScorer(model=tiny_dir).encode_texts(["a dog"])
    assert scorer.edit_scores([], [], [], []) == []


def test_scorers_of_the_same_model_share_one_loaded_copy(tiny_dir, tmp_path):
    first, second = ClipScorer(model=str(tiny_dir)), ClipScorer(model=str(tiny_dir))
    first.load("cpu")
    second.load("cpu")
    assert first._model is second._model  # the edit and LANCE-R stages gate with one CLIP in memory
    other = ClipScorer(model=str(create_tiny_open_clip(tmp_path / "other")))
    other.load("cpu")
    assert other._model is not first._model
