"""The zero-shot text classifier encodes each prompt only up to its end-of-text token (``evaluation.zero_shot``).

With a causal mask and the end-of-text token's feature pooled, the padding after it changes nothing but float rounding:
the features are compared here with open_clip's own ``encode_text`` on the padded ids, and a text tower that is not
causal keeps the padded path.
"""

from __future__ import annotations

import pytest
import torch

from evaluation.zero_shot import TemplateSet, _is_causal_clip, _prefix_tokenizer, _PrefixTextEncoder, text_classifier
from lance_pipeline.tiny.clip_components import TINY_OPEN_CLIP_MODEL_CFG, build_tiny_open_clip

PROMPTS = ["a photo of a cat.", "a photo of a fire truck.", "a blurry photo of the great grey owl in the snow."]


@pytest.fixture(scope="module")
def tiny(single_thread_torch):
    import open_clip  # here, not at collection: it brings timm, transformers and torchvision

    model = build_tiny_open_clip().eval()
    tokenizer = open_clip.SimpleTokenizer(context_length=TINY_OPEN_CLIP_MODEL_CFG["text_cfg"]["context_length"])
    return model, tokenizer


def test_prompts_up_to_their_end_of_text_token_give_the_padded_features(tiny):
    model, tokenizer = tiny
    padded = tokenizer(PROMPTS)
    cut = _prefix_tokenizer(tokenizer)(PROMPTS)
    longest = int((padded != 0).sum(-1).max())  # start, words, end-of-text: nothing after the longest prompt's end
    assert cut.shape == (len(PROMPTS), longest) < padded.shape and torch.equal(cut, padded[:, :longest])
    assert _is_causal_clip(model)
    with torch.inference_mode():
        expected = model.encode_text(padded, normalize=True)
        got = _PrefixTextEncoder(model).encode_text(cut, normalize=True)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_a_text_tower_without_a_causal_mask_keeps_the_padding(tiny, tmp_path, monkeypatch):
    import open_clip

    model, tokenizer = tiny
    monkeypatch.setenv("LANCE_CF_CACHE", str(tmp_path))
    templates = TemplateSet("simple", ("a photo of a {}.",))
    causal_weights, causal_key, _ = text_classifier(model, tokenizer, ["cat", "dog"], templates, "digest")
    full = build_tiny_open_clip().eval()
    full.attn_mask = torch.zeros_like(full.attn_mask)  # every position attends to every other: padding matters
    assert not _is_causal_clip(full)
    seen, encode_text = [], open_clip.model.CLIP.encode_text
    monkeypatch.setattr(full, "encode_text", lambda text, normalize=False: seen.append(text.shape) or
                        encode_text(full, text, normalize))  # fmt: skip
    weights, key, cached = text_classifier(full, tokenizer, ["cat", "dog"], templates, "digest")
    assert not cached and key != causal_key  # never served from the causal model's entry
    assert seen == [(2, TINY_OPEN_CLIP_MODEL_CFG["text_cfg"]["context_length"])]
    assert weights.shape == causal_weights.shape == (TINY_OPEN_CLIP_MODEL_CFG["embed_dim"], 2)
