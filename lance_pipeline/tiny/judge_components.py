"""A tiny, randomly initialised Qwen2.5-VL judge for tests and offline runs of the judge stage.

The judge (``lance_pipeline.screening.judge``) is Qwen2.5-VL-7B-Instruct (Bai et al., 2025, "Qwen2.5-VL Technical
Report"), loaded through transformers' ``Qwen2_5_VLForConditionalGeneration`` and ``AutoProcessor``. This module
writes the same classes at a tiny size with ``save_pretrained`` (``config.json``, ``model.safetensors``, the
processor's and tokenizer's files and a chat template that places the image between ``<|vision_start|>`` and
``<|vision_end|>`` as Qwen's does), so the stage loads it through the code that loads the pinned id. Weights are random
(``torch.manual_seed(0)``): its P(yes) is meaningless but every path runs for real (chat template, image patches and
their grid, the vision tower's windows and the 2x2 merge, multimodal rotary positions, left padding).
"""

from __future__ import annotations

import logging
from pathlib import Path

from lance_pipeline.tiny.text_components import _import_or_raise, _word_level_tokenizer, _write_license_note

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = [
    "<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip
# Words of the judge's questions and its answer tokens, matched case-sensitively (the others are lower-cased).
QUESTION_WORDS = ["\n", "Yes", "No", "Does", "show", "Please", "answer", "or", "yes", "no", "user", "assistant"]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The published architecture's vision tower: 14 px patches, 2 frames per temporal patch, 2x2 merge, 112 px windows.
PATCH, MERGE, TEMPORAL = 14, 2, 2


def tiny_judge_config(vocab_size: int, ids: dict[str, int]) -> dict:
    """The tiny ``Qwen2_5_VLConfig`` keyword arguments (the published layout at widths of 32)."""
    return {
        "text_config": {
            "vocab_size": vocab_size,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            # multimodal rotary sections (time, height, width) of the 8 rotary pairs of a head of 8
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 1, 1]},
            "bos_token_id": ids["<s>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<pad>"],
        },
        "vision_config": {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 32,
            "patch_size": PATCH,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": TEMPORAL,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        },
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "tie_word_embeddings": False,
    }


def create_tiny_judge(path: str | Path) -> Path:
    """Write a tiny random ``Qwen2_5_VLForConditionalGeneration`` and its processor to ``path``.

    Returns:
        The directory, loadable with ``Qwen2_5_VLForConditionalGeneration.from_pretrained`` / ``AutoProcessor``
        (the judge stage's ``model`` option takes it).
    """
    _import_or_raise()
    import torch
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    path = Path(path)
    tokenizer = _word_level_tokenizer(SPECIAL_TOKENS, extra_added=QUESTION_WORDS)
    image_processor = Qwen2VLImageProcessor(
        min_pixels=56 * 56, max_pixels=28 * 28 * 16, patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL
    )
    processor = Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE,
    )
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = Qwen2_5_VLConfig(**tiny_judge_config(len(tokenizer), ids))
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(path)
    _write_license_note(path, "tiny random Qwen2_5_VLForConditionalGeneration")
    return path
