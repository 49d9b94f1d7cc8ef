"""Tiny, randomly initialised text-stage models for tests and the offline ``demo`` preset.

The text stages of LANCE (Prabhu et al., NeurIPS 2023, section 3.1) use a BLIP-2 captioner, an
instruction-following causal LM (optionally with a LoRA adapter) and, for the LANCE-R baseline, a masked
LM. This module builds each of them as a *real* transformers / PEFT class at a tiny configuration, with
random weights drawn after ``torch.manual_seed(0)`` and tokenizers built locally (nothing downloads), and
writes them with ``save_pretrained`` (safetensors). The stages then load them from the directory through
their normal ``from_pretrained`` path, exactly as they load real model ids (diffusers'
``get_dummy_components`` pattern).

The outputs are meaningless text, but every code path (processor, chat template, beam search, sampling,
LoRA, fill-mask) runs for real. The same call writes the same bytes every time.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# Words the tiny tokenizers know; everything else maps to the unknown token. Caption-like words, so the
# random models emit caption-like strings.
_WORDS = (
    "a an the of in on at with and by to from near under over its their his her is are "
    "photo picture painting sketch drawing cartoon sculpture rendering image "
    "dog dogs husky huskies sled cat cats horse man woman boy girl person people child team "
    "monkey bird car bike ball hat jacket coat sunglasses helmet snow grass field street road city "
    "forest beach mountain river lake park house tree trees sky water desert room kitchen garden "
    "rain rainy snowy sunny foggy cloudy stormy night day morning evening "
    "red blue green yellow black white brown small large big old young happy wooden metal "
    "running pulling sitting standing walking riding holding playing looking wearing "
    "variation variations caption instruction input response subject object background weather "
    "adjective domain change changing only write one per line"
).split()
_PUNCT = (".", ",", ":", "-", '"', "'", "(", ")", "1", "2", "3", "4", "5", "#", "*")

_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _import_or_raise():
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        from tokenizers import Tokenizer  # noqa: F401
    except ImportError as error:  # pragma: no cover - the project depends on all three
        raise ImportError(
            "tiny components need torch, transformers and tokenizers: pip install torch transformers"
        ) from error


def _word_level_tokenizer(specials: list[str], extra_added: list[str]):
    """A word-level ``PreTrainedTokenizerFast`` over ``_WORDS``; ``\\n`` is a token so outputs have lines."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for token in [*specials, *_PUNCT, *_WORDS]:
        vocab.setdefault(token, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra_added])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )


def _word_piece_tokenizer():
    """A BERT-style ``PreTrainedTokenizerFast`` (WordPiece, [CLS]/[SEP]/[MASK]) over ``_WORDS``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab: dict[str, int] = {}
    for token in [
        *specials,
        *_PUNCT,
        *_WORDS,
        *(f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"),
        *"abcdefghijklmnopqrstuvwxyz",
    ]:
        vocab.setdefault(token, len(vocab))
    backend = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    backend.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        mask_token="[MASK]",
    )


def create_tiny_causal_lm(path: str | Path) -> Path:
    """Write a tiny random ``LlamaForCausalLM`` with a chat-template tokenizer to ``path``.

    Args:
        path: Output directory (created).

    Returns:
        The directory, loadable with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer``.
    """
    _import_or_raise()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    tokenizer = _word_level_tokenizer(specials, extra_added=["\n", "###"])
    tokenizer.chat_template = _CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|end|>"),
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    # The random model should end lines and answers by itself: make newline and end-of-turn likelier.
    with torch.no_grad():
        for token_id in (config.eos_token_id, tokenizer.convert_tokens_to_ids("\n")):
            model.lm_head.weight[token_id] *= 3.0
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    _write_license_note(path, "tiny random LlamaForCausalLM")
    return path


def create_tiny_lora_adapter(base_path: str | Path, path: str | Path) -> Path:
    """Write a PEFT LoRA adapter for the tiny causal LM at ``base_path`` to ``path``.

    The adapter uses the paper's perturber LoRA shape (rank 8, alpha 16, dropout 0.05 on the query and
    value projections; the authors' ``lance/edit_captions.py``) with *random* A and B matrices
    (``init_lora_weights=False``), so unlike a freshly initialised adapter it really changes the outputs.

    Args:
        base_path: Directory written by :func:`create_tiny_causal_lm`.
        path: Output directory for the adapter.

    Returns:
        The adapter directory, loadable with ``peft.PeftModel.from_pretrained(base, path)``.
    """
    _import_or_raise()
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = Path(path)
    base = AutoModelForCausalLM.from_pretrained(base_path)
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.05,
        target_modules=["q_proj", "v_proj"],
        task_type="CAUSAL_LM",
        init_lora_weights=False,
    )
    torch.manual_seed(0)
    peft_model = get_peft_model(base, config)
    with torch.no_grad():  # a strong random adapter, so its effect on greedy decoding is certain
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(20.0)
    peft_model.save_pretrained(path, safe_serialization=True)
    # PEFT writes target_modules from a set (order varies with PYTHONHASHSEED) and a model card naming the
    # absolute base path: normalise both so the bytes are reproducible.
    config_file = path / "adapter_config.json"
    adapter_config = json.loads(config_file.read_text())
    adapter_config["target_modules"] = sorted(adapter_config["target_modules"])
    adapter_config["base_model_name_or_path"] = Path(base_path).name  # not the absolute (temporary) path
    config_file.write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
    (path / "README.md").unlink(missing_ok=True)
    _write_license_note(path, "tiny random LoRA adapter")
    return path


def create_tiny_lora(path: str | Path) -> Path:
    """Write the tiny LoRA adapter of :func:`create_tiny_lora_adapter` to ``path`` without a base directory.

    The base model is rebuilt in a temporary directory; it is byte-identical to :func:`create_tiny_causal_lm`'s,
    so the adapter applies to a ``tiny-causal-lm`` built anywhere else (single-argument form for registries).
    """
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        base = create_tiny_causal_lm(Path(tmp) / "tiny-causal-lm")
        return create_tiny_lora_adapter(base, path)


def create_tiny_masked_lm(path: str | Path) -> Path:
    """Write a tiny random ``BertForMaskedLM`` with a locally built WordPiece tokenizer to ``path``.

    Args:
        path: Output directory (created).

    Returns:
        The directory, loadable with ``pipeline("fill-mask", model=path)``.
    """
    _import_or_raise()
    import torch
    from transformers import BertConfig, BertForMaskedLM

    path = Path(path)
    tokenizer = _word_piece_tokenizer()
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = BertForMaskedLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    _write_license_note(path, "tiny random BertForMaskedLM")
    return path


def create_tiny_blip2(path: str | Path) -> Path:
    """Write a tiny random ``Blip2ForConditionalGeneration`` (OPT decoder) plus its processor to ``path``.

    Args:
        path: Output directory (created).

    Returns:
        The directory, loadable with ``AutoProcessor`` / ``AutoModelForImageTextToText.from_pretrained``.
    """
    _import_or_raise()
    import torch
    from transformers import Blip2Config, Blip2ForConditionalGeneration, Blip2Processor, BlipImageProcessor

    path = Path(path)
    num_query_tokens = 4
    specials = ["<pad>", "<s>", "</s>", "<unk>", "<image>"]
    tokenizer = _word_level_tokenizer(specials, extra_added=[])
    tokenizer.padding_side = "left"
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    image_processor = BlipImageProcessor(
        size={"height": 32, "width": 32},
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    )
    processor = Blip2Processor(image_processor=image_processor, tokenizer=tokenizer, num_query_tokens=num_query_tokens)
    config = Blip2Config(
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "image_size": 32,
            "patch_size": 16,
        },
        qformer_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "encoder_hidden_size": 32,
            "vocab_size": 64,
        },
        text_config={
            "model_type": "opt",
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "ffn_dim": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "word_embed_proj_dim": 32,
            "max_position_embeddings": 512,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        num_query_tokens=num_query_tokens,
        image_token_index=image_token_id,
    )
    torch.manual_seed(0)
    model = Blip2ForConditionalGeneration(config).eval()
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(path)
    _write_license_note(path, "tiny random Blip2ForConditionalGeneration")
    return path


def _write_license_note(path: Path, what: str) -> None:
    (path / "TINY_MODEL.json").write_text(
        json.dumps({"what": what, "weights": "random, torch.manual_seed(0)", "purpose": "tests and offline demo"})
        + "\n"
    )
