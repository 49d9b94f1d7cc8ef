"""Prompt-to-prompt attention control as diffusers attention processors.

Hertz, Mokady, Tenenbaum, Aberman, Pritch, Cohen-Or, "Prompt-to-Prompt Image Editing with Cross Attention
Control", ICLR 2023 (arXiv 2208.01626), as used by LANCE (Prabhu et al., NeurIPS 2023, section 3.2).

A batch holds one *source* prompt (index 0) and any number of *target* prompts (the edits). While the batch is
denoised from the same inverted latent, every target borrows the source's attention maps:

* cross-attention (``AttentionReplace`` for in-place token swaps, where the alignment maps every unchanged token to
  its own position; ``AttentionRefine`` with token alignment for other edits) during the first
  ``cross_replace_steps`` steps;
* self-attention (layers with at most ``self_replace_max_tokens`` query tokens) during the first
  ``self_replace_steps`` steps, the fraction LANCE sweeps;
* ``AttentionReweight``: the edited tokens' cross-attention (only tokens the alignment marks as new) is multiplied
  by a factor (2.0 in LANCE) while cross-attention is injected.

Each target carries its own schedule, so one UNet call can evaluate several sweep values and several edits
against one shared source branch. Only the conditional half of a classifier-free-guidance batch is edited, as in
the prompt-to-prompt code. The processors are installed with ``unet.set_attn_processor`` inside the
``attention_control`` context manager, which restores the UNet's original processors on exit, also on error.
This replaces the original code's monkey-patching of modules named ``CrossAttention``, which silently matches
nothing on diffusers >= 0.15 (the edit becomes plain regeneration); here a run in which no layer reached the
controller raises.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

# Prompt-to-prompt replaces self-attention only in the low-resolution layers: the null-text notebook that LANCE
# ports uses 32**2 query tokens (the original prompt-to-prompt notebook 16**2).
DEFAULT_SELF_REPLACE_MAX_TOKENS = 32**2


@dataclass
class TokenAlignment:
    """How the tokens of a target prompt map onto the tokens of the source prompt.

    Attributes:
        mapper: ``[max_len]`` long tensor, for each target position the source position it copies attention from.
        alphas: ``[max_len]`` float tensor, 1 where the target token is aligned to a source token, 0 where it is new
            (a new token keeps its own cross-attention map).
        new_tokens: target positions of tokens without a source counterpart.
        equal_length: whether source and target have the same number of tokens.
        positional: whether every aligned target token maps to its own position (equal length, and only
            in-place substitutions): the only case where ``AttentionReplace``'s positional copy is the right map.
            "black dog on a couch" -> "dog on a black couch" has equal length but is not positional.
    """

    mapper: torch.Tensor
    alphas: torch.Tensor
    new_tokens: list[int]
    equal_length: bool
    positional: bool = False


# How ``AttentionRefine`` maps the padding positions after the target prompt's end (see ``align_tokens``).
REFINE_PADDINGS = ("source_order", "same_position")


def align_tokens(
    source_ids: list[int], target_ids: list[int], max_len: int, padding: str = "source_order"
) -> TokenAlignment:
    """Align two token sequences (each with BOS and EOS, without padding) for ``AttentionRefine``.

    Matching runs are found with ``difflib.SequenceMatcher`` on token ids; tokens in an ``equal`` run copy the
    source map, every other target token is new. Padding positions after the target's end:

    * ``"source_order"`` (ours, default): the k-th padding position of the target copies the k-th padding position
      of the source, so padding always copies padding (the EOS/padding maps carry a lot of attention mass in CLIP)
      and never a word's map, whatever the length difference;
    * ``"same_position"`` (prompt-to-prompt's ``seq_aligner.get_mapper`` and the authors' code): position ``j``
      copies source position ``j``; after a deletion the target's first padding positions copy the source's last
      words and its EOS.

    Args:
        source_ids: Token ids of the source prompt, BOS ... EOS.
        target_ids: Token ids of the target prompt, BOS ... EOS.
        max_len: The padded length (the tokenizer's ``model_max_length``).
        padding: One of ``REFINE_PADDINGS``.

    Returns:
        The ``TokenAlignment``.
    """
    if len(source_ids) > max_len or len(target_ids) > max_len:
        raise ValueError(
            f"token sequences must be at most max_len={max_len} long, got {len(source_ids)}, {len(target_ids)}"
        )
    if padding not in REFINE_PADDINGS:
        raise ValueError(f"padding must be one of {REFINE_PADDINGS}, got {padding!r}")
    mapper = torch.zeros(max_len, dtype=torch.long)
    alphas = torch.zeros(max_len)
    matcher = difflib.SequenceMatcher(None, source_ids, target_ids, autojunk=False)
    for tag, i1, _i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            mapper[j1:j2] = torch.arange(i1, i1 + (j2 - j1))
            alphas[j1:j2] = 1.0
    new_tokens = [j for j in range(len(target_ids)) if alphas[j] == 0]
    equal_length = len(source_ids) == len(target_ids)
    positional = equal_length and all(int(mapper[j]) == j for j in range(len(target_ids)) if alphas[j] == 1.0)
    for j in range(len(target_ids), max_len):
        source_j = len(source_ids) + (j - len(target_ids)) if padding == "source_order" else j
        if source_j < max_len:
            mapper[j] = source_j
            alphas[j] = 1.0
    return TokenAlignment(
        mapper=mapper, alphas=alphas, new_tokens=new_tokens, equal_length=equal_length, positional=positional
    )


def find_span_tokens(span_ids: list[int], prompt_ids: list[int], new_tokens: list[int] | None = None) -> list[int]:
    """Positions of the span's tokens in the prompt, or [] if absent.

    Both inputs are token ids without BOS/EOS for the span. CLIP's BPE tokenises word by word (lower-cased), so a
    span that occurs in the caption has the same ids there; matching on ids avoids the original code's silent no-op
    when case or punctuation differ between the diff output and the caption.

    A span can occur more than once ("a cat next to a dog house" -> "a dog next to a dog house"). The occurrence
    with the most positions among ``new_tokens`` (the target tokens the alignment found no source counterpart for,
    i.e. where the edit is) wins, so the edited word and not an unchanged repeat of it is reweighted; ties, and
    calls without ``new_tokens``, take the last occurrence (an inserted phrase is usually appended).
    """
    n = len(span_ids)
    if n == 0:
        return []
    new = set(new_tokens or ())
    best: list[int] = []
    best_overlap = -1
    for start in range(len(prompt_ids) - n, -1, -1):
        if prompt_ids[start : start + n] == span_ids:
            overlap = len(new.intersection(range(start, start + n)))
            if overlap > best_overlap:
                best, best_overlap = list(range(start, start + n)), overlap
    return best


@dataclass
class EditTarget:
    """The attention schedule of one target prompt in a prompt-to-prompt batch.

    Attributes:
        alignment: Token alignment to the source prompt.
        mode: ``"replace"`` (copy every source cross-attention map; needs equal token counts) or ``"refine"``.
        cross_replace_steps: Inject cross-attention for steps ``0 .. cross_replace_steps - 1``.
        self_replace_steps: Inject self-attention for steps ``0 .. self_replace_steps - 1``.
        equalizer: ``[max_len]`` factors applied to the injected cross-attention (reweighting), or None.
    """

    alignment: TokenAlignment
    mode: str
    cross_replace_steps: int
    self_replace_steps: int
    equalizer: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("replace", "refine"):
            raise ValueError(f"mode must be 'replace' or 'refine', got {self.mode!r}")
        if self.mode == "replace" and not self.alignment.positional:
            raise ValueError(
                "mode='replace' needs a positional alignment (same number of tokens, every unchanged token at its "
                "own position); use 'refine'"
            )


@dataclass
class AttentionStore:
    """Records the attention maps each layer sees (``AttentionStore`` of prompt-to-prompt), for inspection/tests.

    Attributes:
        max_tokens: Maps with more query tokens than this are not stored (memory).
        maps: ``(step, place, is_cross) -> list of [batch, heads, q, k] tensors`` (CPU copies).
    """

    max_tokens: int = 32**2
    maps: dict[tuple[int, str, bool], list[torch.Tensor]] = field(default_factory=dict)


class PromptToPromptController:
    """Edits attention probabilities of a batch ``[uncond x n, cond x n]`` where cond index 0 is the source.

    The caller sets ``cur_step`` before each UNet call (the denoising step index). ``layer_calls`` counts attention
    layer calls that went through a prompt-to-prompt processor (``calls``: those that reached the controller), so
    a run in which the processors were not used can be detected.

    The per-target tables (token mappers, alphas, equalisers) are stacked and moved to the attention's device and
    dtype once (``_tables``), not per layer call; ``set_targets`` replaces the targets (a sweep that forks a new
    branch) and rebuilds them. Replace is refine with the identity mapper and alphas 1, so one gather serves both.
    """

    def __init__(
        self,
        targets: list[EditTarget],
        self_replace_max_tokens: int = DEFAULT_SELF_REPLACE_MAX_TOKENS,
        classifier_free_guidance: bool = True,
        store: AttentionStore | None = None,
    ) -> None:
        self.self_replace_max_tokens = self_replace_max_tokens
        self.classifier_free_guidance = classifier_free_guidance
        self.store = store
        self.cur_step = 0
        self.calls = 0
        self.layer_calls = 0
        self.set_targets(targets)

    def set_targets(self, targets: list[EditTarget]) -> None:
        """Use these targets from now on (rows ``1 .. len(targets)`` of the conditional half)."""
        self.targets = list(targets)
        self._table_key: tuple | None = None
        self._table: tuple | None = None
        self._row_index: dict[tuple, torch.Tensor] = {}

    def _tables(self, device, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(mapper [n, K] long, alphas [n, K], equalizer [n, K])`` on ``device``/``dtype``, built once."""
        key = (device, dtype)
        if self._table_key != key:
            mappers, alphas, equalizers = [], [], []
            for target in self.targets:
                length = target.alignment.mapper.shape[0]
                if target.mode == "replace":
                    mappers.append(torch.arange(length))
                    alphas.append(torch.ones(length))
                else:
                    mappers.append(target.alignment.mapper)
                    alphas.append(target.alignment.alphas)
                equalizers.append(target.equalizer if target.equalizer is not None else torch.ones(length))
            self._table = (
                torch.stack(mappers).to(device),
                torch.stack(alphas).to(device, dtype),
                torch.stack(equalizers).to(device, dtype),
            )
            self._table_key = key
            self._row_index = {}
        return self._table

    def _rows(self, rows: tuple[int, ...], device) -> torch.Tensor:
        index = self._row_index.get(rows)
        if index is None:
            index = self._row_index[rows] = torch.tensor(rows, dtype=torch.long, device=device)
        return index

    def needs_probabilities(self, is_cross: bool, query_tokens: int) -> bool:
        """Whether a layer must materialise its attention probabilities (else it may use fused attention)."""
        if self.store is not None and query_tokens <= self.store.max_tokens:
            return True
        if is_cross:
            return any(self.cur_step < t.cross_replace_steps for t in self.targets)
        return query_tokens <= self.self_replace_max_tokens and any(
            self.cur_step < t.self_replace_steps for t in self.targets
        )

    def __call__(self, probs: torch.Tensor, is_cross: bool, place: str) -> torch.Tensor:
        """Return edited attention probabilities.

        Args:
            probs: ``[batch, heads, query_tokens, key_tokens]``.
            is_cross: Whether this is a cross-attention layer.
            place: The layer's name (for the store).

        Returns:
            A tensor of the same shape (a new tensor; ``probs`` is not modified).
        """
        self.calls += 1
        batch = probs.shape[0]
        half = batch // 2 if self.classifier_free_guidance else 0
        n_prompts = batch - half
        if n_prompts != len(self.targets) + 1:
            raise ValueError(
                f"attention batch holds {n_prompts} prompts, the controller expects {len(self.targets) + 1}"
            )
        if self.store is not None and probs.shape[2] <= self.store.max_tokens:
            self.store.maps.setdefault((self.cur_step, place, is_cross), []).append(probs.detach().cpu().clone())
        out = probs.clone()
        source = probs[half]
        step = self.cur_step
        if is_cross:
            active = tuple(k for k, t in enumerate(self.targets) if step < t.cross_replace_steps)
            if not active:
                return out
            mapper, alphas, equalizer = self._tables(probs.device, probs.dtype)
            index = self._rows(active, probs.device)
            rows = index + (half + 1)
            # source[..., mapper[k]] for every active target k: [heads, q, n, K] -> [n, heads, q, K]
            mapped = source[..., mapper.index_select(0, index)].permute(2, 0, 1, 3)
            blend = alphas.index_select(0, index)[:, None, None, :]
            new = mapped * blend + probs.index_select(0, rows) * (1 - blend)
            out[rows] = new * equalizer.index_select(0, index)[:, None, None, :]
        elif probs.shape[2] <= self.self_replace_max_tokens:
            active = tuple(k for k, t in enumerate(self.targets) if step < t.self_replace_steps)
            if active:
                out[self._rows(active, probs.device) + (half + 1)] = source
        return out


class PromptToPromptAttnProcessor:
    """A diffusers attention processor that hands attention probabilities to a ``PromptToPromptController``.

    When the controller does not need this layer's probabilities at the current step it delegates to the
    layer's original processor (fused SDPA), so untouched layers cost nothing extra.
    """

    def __init__(self, controller: PromptToPromptController, place: str, original) -> None:
        self.controller = controller
        self.place = place
        self.original = original

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, **kwargs):
        self.controller.layer_calls += 1
        is_cross = encoder_hidden_states is not None
        query_tokens = (
            hidden_states.shape[1] if hidden_states.ndim == 3 else hidden_states.shape[2] * hidden_states.shape[3]
        )
        if not self.controller.needs_probabilities(is_cross, query_tokens):
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, temb, **kwargs)
        if attn.spatial_norm is not None or attn.group_norm is not None or hidden_states.ndim != 3:
            raise ValueError(f"prompt-to-prompt supports plain transformer attention only (layer {self.place})")
        residual = hidden_states
        batch_size = hidden_states.shape[0]
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        if is_cross and attn.norm_cross:
            context = attn.norm_encoder_hidden_states(context)
        attention_mask = attn.prepare_attention_mask(attention_mask, context.shape[1], batch_size)
        query = attn.head_to_batch_dim(attn.to_q(hidden_states))
        key = attn.head_to_batch_dim(attn.to_k(context))
        value = attn.head_to_batch_dim(attn.to_v(context))
        probs = attn.get_attention_scores(query, key, attention_mask)
        probs = probs.view(batch_size, attn.heads, *probs.shape[1:])
        probs = self.controller(probs, is_cross, self.place)
        probs = probs.reshape(batch_size * attn.heads, *probs.shape[2:]).to(value.dtype)
        hidden_states = attn.batch_to_head_dim(torch.bmm(probs, value))
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


@contextlib.contextmanager
def attention_control(unet, controller: PromptToPromptController | None) -> Iterator[None]:
    """Install prompt-to-prompt processors on every attention layer of ``unet`` for the ``with`` block.

    The UNet's original processors are restored on exit, also when the block raises. With ``controller=None``
    nothing is installed (plain sampling). If the block finishes without any layer reaching the controller, a
    ``RuntimeError`` is raised rather than silently returning an unedited image.

    Args:
        unet: A diffusers ``UNet2DConditionModel``.
        controller: The controller, or None.
    """
    if controller is None:
        yield
        return
    originals = dict(unet.attn_processors)
    processors = {
        name: PromptToPromptAttnProcessor(controller, name.removesuffix(".processor"), processor)
        for name, processor in originals.items()
    }
    calls_before = controller.layer_calls
    unet.set_attn_processor(processors)
    try:
        yield
    finally:
        unet.set_attn_processor(originals)
    if controller.layer_calls == calls_before:
        raise RuntimeError("prompt-to-prompt controller was never called: the attention processors were not used")


def make_equalizer(max_len: int, token_positions: list[int], weight: float) -> torch.Tensor:
    """``AttentionReweight``'s equalizer: ``weight`` at ``token_positions``, 1 elsewhere."""
    equalizer = torch.ones(max_len)
    if token_positions:
        equalizer[torch.tensor(token_positions)] = weight
    return equalizer
