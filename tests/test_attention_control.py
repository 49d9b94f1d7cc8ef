"""Prompt-to-prompt attention control: token alignment, the controller's injection schedule, processor restore."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lance_pipeline.editing.attention_control import (  # noqa: E402
    AttentionStore,
    EditTarget,
    PromptToPromptController,
    align_tokens,
    attention_control,
    find_span_tokens,
    make_equalizer,
)

# Tiny models gain nothing from intra-op threads; on a shared 2-core machine they oversubscribe badly.
pytestmark = pytest.mark.usefixtures("single_thread_torch")

MAX_LEN = 12


def test_align_tokens_refine_mapping():
    # BOS a photo of a dog EOS  ->  BOS a photo of a big dog EOS
    source = [100, 1, 2, 3, 1, 4, 101]
    target = [100, 1, 2, 3, 1, 9, 4, 101]
    alignment = align_tokens(source, target, MAX_LEN)
    assert alignment.new_tokens == [5]
    assert not alignment.equal_length
    assert alignment.mapper[:8].tolist() == [0, 1, 2, 3, 4, 0, 5, 6]
    assert alignment.alphas[:8].tolist() == [1, 1, 1, 1, 1, 0, 1, 1]
    # Padding after the target's EOS follows the source's padding positions.
    assert alignment.mapper[8:].tolist() == [7, 8, 9, 10]
    assert alignment.alphas[8:].tolist() == [1, 1, 1, 1]


def test_align_tokens_equal_length_swap_and_bad_input():
    alignment = align_tokens([100, 1, 4, 101], [100, 1, 7, 101], MAX_LEN)
    assert alignment.equal_length
    assert alignment.new_tokens == [2]
    with pytest.raises(ValueError, match="max_len"):
        align_tokens(list(range(20)), [1], MAX_LEN)
    assert alignment.positional
    with pytest.raises(ValueError, match="positional alignment"):
        EditTarget(align_tokens([1, 2, 3], [1, 3], MAX_LEN), "replace", 1, 1)
    with pytest.raises(ValueError, match="padding must be one of"):
        align_tokens([1, 2], [1, 2], MAX_LEN, padding="authors")


def test_equal_length_reorders_are_not_positional():
    # BOS black dog on couch EOS -> BOS dog on black couch EOS: same length, but "dog" and "on" moved.
    reorder = align_tokens([100, 5, 6, 7, 8, 101], [100, 6, 7, 5, 8, 101], MAX_LEN)
    assert reorder.equal_length and not reorder.positional
    with pytest.raises(ValueError, match="positional alignment"):
        EditTarget(reorder, "replace", 1, 1)
    # A two-for-two substitution in place is positional.
    assert align_tokens([100, 1, 2, 3, 101], [100, 1, 8, 9, 101], MAX_LEN).positional


def test_refine_padding_rules():
    # A deletion: BOS a big dog EOS -> BOS a dog EOS.
    source, target = [100, 1, 9, 4, 101], [100, 1, 4, 101]
    ours = align_tokens(source, target, MAX_LEN)
    authors = align_tokens(source, target, MAX_LEN, padding="same_position")
    assert ours.mapper[:4].tolist() == authors.mapper[:4].tolist() == [0, 1, 3, 4]
    # Ours: the target's padding copies the source's padding, in order (source padding starts at 5).
    assert ours.mapper[4:].tolist() == [5, 6, 7, 8, 9, 10, 11, 0]
    assert ours.alphas[4:].tolist() == [1, 1, 1, 1, 1, 1, 1, 0]  # the last one has no source padding left
    # Prompt-to-prompt's rule: position j copies source j, so the first padding copies the source's EOS (4).
    assert authors.mapper[4:].tolist() == list(range(4, MAX_LEN))
    assert authors.alphas[4:].tolist() == [1] * (MAX_LEN - 4)


def test_find_span_tokens():
    assert find_span_tokens([7, 8], [100, 1, 7, 8, 3, 101]) == [2, 3]
    assert find_span_tokens([7, 9], [100, 1, 7, 8, 3, 101]) == []
    assert find_span_tokens([], [100, 101]) == []
    # the last occurrence wins (the edit is usually appended)
    assert find_span_tokens([7], [7, 7, 101]) == [1]
    # ... unless another occurrence is where the edit is: a repeated word reweights the edited occurrence
    # ("a cat next to a dog house" -> "a dog next to a dog house" reweights the first "dog", not the unchanged one).
    assert find_span_tokens([7], [100, 1, 7, 3, 1, 7, 9, 101], new_tokens=[2]) == [2]
    assert find_span_tokens([7], [100, 1, 7, 3, 1, 7, 9, 101], new_tokens=[]) == [5]


def _synthetic_probs(prompts: int, query: int, key: int = MAX_LEN) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.rand(2 * prompts, 2, query, key, generator=generator).softmax(-1)


def test_controller_replace_refine_reweight_schedule():
    source_ids = [100, 1, 2, 3, 4, 101]
    swap = align_tokens(source_ids, [100, 1, 2, 3, 8, 101], MAX_LEN)
    insert = align_tokens(source_ids, [100, 1, 2, 3, 9, 4, 101], MAX_LEN)
    equalizer = make_equalizer(MAX_LEN, [4], 2.0)
    targets = [
        EditTarget(swap, "replace", cross_replace_steps=3, self_replace_steps=1, equalizer=equalizer),
        EditTarget(insert, "refine", cross_replace_steps=2, self_replace_steps=2),
    ]
    controller = PromptToPromptController(targets, self_replace_max_tokens=16)
    probs = _synthetic_probs(3, query=16)
    half = 3
    for step in range(5):
        controller.cur_step = step
        cross = controller(probs, True, "layer")
        self_attn = controller(_synthetic_probs(3, 16, 16), False, "layer")
        big_self = _synthetic_probs(3, 64, 64)
        assert torch.equal(controller(big_self, False, "layer"), big_self)  # above max tokens: never injected
        assert torch.equal(cross[:half], probs[:half])  # unconditional half untouched
        assert torch.equal(cross[half], probs[half])  # the source itself is untouched
        # replace: the full source map, times the equalizer, while step < 3; its own map afterwards
        expected = probs[half] * equalizer if step < 3 else probs[half + 1]
        assert torch.allclose(cross[half + 1], expected)
        # refine: aligned tokens copy the source map, the new token (position 4) keeps its own
        if step < 2:
            mapped = probs[half][..., insert.mapper]
            assert torch.allclose(cross[half + 2][..., insert.alphas == 1], mapped[..., insert.alphas == 1])
            assert torch.equal(cross[half + 2][..., 4], probs[half + 2][..., 4])
        else:
            assert torch.equal(cross[half + 2], probs[half + 2])
        self_probs = _synthetic_probs(3, 16, 16)
        for row, n_self in ((half + 1, 1), (half + 2, 2)):
            expected_self = self_probs[half] if step < n_self else self_probs[row]
            assert torch.equal(self_attn[row], expected_self)
    with pytest.raises(ValueError, match="prompts"):
        controller(_synthetic_probs(2, 16), True, "layer")


class RecordingController(PromptToPromptController):
    """Records what each attention call received and returned (the test observes, the controller decides)."""

    def __init__(self, *args, fail_at_step: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.log: list[tuple[int, bool, torch.Tensor, torch.Tensor]] = []
        self.fail_at_step = fail_at_step

    def __call__(self, probs, is_cross, place):
        if self.fail_at_step is not None and self.cur_step == self.fail_at_step:
            raise RuntimeError("boom")
        out = super().__call__(probs, is_cross, place)
        self.log.append((self.cur_step, is_cross, probs.detach().clone(), out.detach().clone()))
        return out


def _run(tiny_sd, controller, prompts, steps):
    from lance_pipeline.editing.inversion import ddim_sample, encode_prompts

    cond = encode_prompts(tiny_sd.tokenizer, tiny_sd.text_encoder, prompts)
    nulls = encode_prompts(tiny_sd.tokenizer, tiny_sd.text_encoder, [""]).expand(steps, -1, -1)
    latent = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    return ddim_sample(tiny_sd.unet, tiny_sd.scheduler_config, latent, cond, nulls, 7.5, controller=controller)


def test_controller_injects_source_maps_in_the_unet_only_while_scheduled(tiny_sd):
    from lance_pipeline.editing.inversion import prompt_token_ids

    steps, n_cross, n_self = 6, 3, 2
    source, edited = "a photo of a dog", "a photo of a big dog"
    alignment = align_tokens(
        prompt_token_ids(tiny_sd.tokenizer, source), prompt_token_ids(tiny_sd.tokenizer, edited), 77
    )
    target = EditTarget(alignment, "refine", cross_replace_steps=n_cross, self_replace_steps=n_self)
    controller = RecordingController([target], self_replace_max_tokens=64)
    originals = dict(tiny_sd.unet.attn_processors)
    _run(tiny_sd, controller, [source, edited], steps)

    # The processors were really used (prompt-to-prompt is not a silent no-op), and restored afterwards.
    assert controller.layer_calls > 0
    assert {k: id(v) for k, v in tiny_sd.unet.attn_processors.items()} == {k: id(v) for k, v in originals.items()}
    cross_steps = {step for step, is_cross, _, _ in controller.log if is_cross}
    self_steps = {step for step, is_cross, _, _ in controller.log if not is_cross}
    # Layers materialise attention only while something is injected; afterwards they use the fused kernel.
    assert cross_steps == set(range(n_cross))
    assert self_steps == set(range(n_self))
    keep = alignment.alphas == 1
    for step, is_cross, before, after in controller.log:
        assert step < (n_cross if is_cross else n_self)
        source_map, target_out = before[2], after[3]  # cond half: row 2 is the source, row 3 the target
        if is_cross:
            assert torch.allclose(target_out[..., keep], source_map[..., alignment.mapper][..., keep])
            assert torch.equal(target_out[..., ~keep], before[3][..., ~keep])
        elif before.shape[2] <= 64:
            assert torch.equal(target_out, source_map)
        else:
            assert torch.equal(target_out, before[3])
        assert torch.equal(after[:2], before[:2])  # unconditional half never edited


def test_processors_restored_on_error_and_missing_processors_detected(tiny_sd):
    alignment = align_tokens([1, 2, 3], [1, 2, 3], 77)
    controller = RecordingController([EditTarget(alignment, "replace", 2, 2)], fail_at_step=1)
    originals = dict(tiny_sd.unet.attn_processors)
    with pytest.raises(RuntimeError, match="boom"):
        _run(tiny_sd, controller, ["a dog", "a dog"], 3)
    assert {k: id(v) for k, v in tiny_sd.unet.attn_processors.items()} == {k: id(v) for k, v in originals.items()}

    # A block that never runs the UNet through the processors is an error, not a silent unedited image.
    with pytest.raises(RuntimeError, match="never called"):
        with attention_control(tiny_sd.unet, PromptToPromptController([])):
            pass


def test_attention_store_records_maps(tiny_sd):
    store = AttentionStore(max_tokens=64)
    controller = PromptToPromptController([], store=store)
    _run(tiny_sd, controller, ["a photo of a dog"], 2)
    assert {step for step, _, _ in store.maps} == {0, 1}
    assert any(is_cross for _, _, is_cross in store.maps)
    for maps in store.maps.values():
        for probs in maps:
            assert torch.allclose(probs.sum(-1), torch.ones(()), atol=1e-5)
