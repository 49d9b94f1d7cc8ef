"""The prompt-to-prompt editor: counterfactuals of an inverted image, swept over the self-attention fraction.

LANCE (Prabhu et al., NeurIPS 2023, section 3.2 and Algorithm 1) renders every edited caption from the inverted
latent with prompt-to-prompt attention control (Hertz et al., ICLR 2023; ``attention_control.py``) for each
self-attention injection fraction ``f`` of the sweep {0.4, ..., 0.9}. The inversion itself is one of the
registered inversion methods (``inversion.py``; null-text inversion, Mokady et al., CVPR 2023, by default).

The editor owns its Stable Diffusion components (``sd_components``); editors of one process with the same model
share one loaded copy. It draws no random numbers: VAE encoding takes the posterior mean, and DDIM sampling with
eta = 0 is deterministic given the inverted latent, so the same inputs give the same images.
"""

from __future__ import annotations

import logging
from typing import Any

from lance_pipeline.candidate_selection import Candidate, EditRequest, SweepResult
from lance_pipeline.editing_options import ImageEditorOptions, steps_of
from lance_pipeline.sd_components import StableDiffusionComponents, load_stable_diffusion_components
from lance_pipeline.stage import Record

logger = logging.getLogger(__name__)


class PromptToPromptEditor:
    """Inversion, reconstruction and prompt-to-prompt editing with one set of Stable Diffusion components.

    Implements ``candidate_selection.Editor``.

    Args:
        components: Loaded components.
        options: The options (steps, guidance, inversion method, attention-control settings, batch size).
    """

    name = "prompt_to_prompt"

    def __init__(self, components: StableDiffusionComponents, options: ImageEditorOptions) -> None:
        self.components = components
        self.options = options
        if options.image_size % components.latent_multiple:
            raise ValueError(
                f"image_size must be a multiple of {components.latent_multiple} for {components.model}, "
                f"got {options.image_size}"
            )

    @classmethod
    def load(cls, options: ImageEditorOptions, device: str) -> PromptToPromptEditor:
        """Load (or share) the components named by ``options`` on ``device`` and build the editor."""
        components = load_stable_diffusion_components(
            options.model, options.revision, options.dtype, device, options.cache_dir
        )
        return cls(components, options)

    @property
    def device(self):
        return self.components.unet.device

    @property
    def dtype(self):
        return self.components.unet.dtype

    @property
    def max_prompt_tokens(self) -> int:
        return self.components.tokenizer.model_max_length

    def count_tokens(self, text: str) -> int:
        return len(self.components.tokenizer(text).input_ids)

    # ------------------------------------------------------------------------------------------ inversion

    def inversion_method(self):
        from lance_pipeline.inversion import make_inversion_method

        return make_inversion_method(self.options.inversion, self.components, self.options)

    def invert(self, image, caption: str) -> dict[str, Any]:
        """Invert one image with the configured method; returns the ``inversion`` record (tensors on CPU)."""
        (inversion,) = self.inversion_method().invert([image], [caption])
        return inversion

    def check_inversion(self, inversion: Any, caption: str) -> str | None:
        """Why a stored inversion cannot be used with these options and caption (None if it can)."""
        if not isinstance(inversion, dict) or not {"latent", "null_embeddings", "caption"} <= set(inversion):
            return "record's 'inversion' lacks latent/null_embeddings/caption"
        steps = inversion["null_embeddings"].shape[0]
        if steps != self.options.num_inference_steps:
            return f"inversion has {steps} null embeddings, the editor runs {self.options.num_inference_steps} steps"
        size = self.options.image_size // self.components.vae_scale_factor
        if tuple(inversion["latent"].shape[-2:]) != (size, size):
            return f"inversion latent is {tuple(inversion['latent'].shape)}, expected spatial size {size}x{size}"
        if inversion["caption"] != caption:
            return f"inversion was made for caption {inversion['caption']!r}, the record's caption is {caption!r}"
        return None

    def check_source(self, record: Record) -> str | None:
        return self.check_inversion(record.get("inversion"), record.get("caption"))

    # ------------------------------------------------------------------------------------------ sampling

    def _embed(self, prompts: list[str]):
        from lance_pipeline.inversion import encode_prompts

        return encode_prompts(self.components.tokenizer, self.components.text_encoder, prompts).to(self.dtype)

    def reconstruct(self, inversion: dict[str, Any]):
        """Regenerate the inverted image with its own caption (PIL image)."""
        from lance_pipeline.inversion import ddim_sample, decode_latents

        latents = ddim_sample(
            self.components.unet,
            self.components.scheduler_config,
            inversion["latent"].to(self.device, self.dtype),
            self._embed([inversion["caption"]]),
            inversion["null_embeddings"].to(self.device, self.dtype),
            self.options.guidance_scale,
        )
        return decode_latents(self.components.vae, latents)[0]

    def build_target(self, caption: str, request: EditRequest, self_replace: float):
        """The prompt-to-prompt schedule of one (edit, sweep value) target."""
        from lance_pipeline.attention_control import EditTarget, align_tokens, find_span_tokens, make_equalizer
        from lance_pipeline.inversion import prompt_token_ids

        tokenizer = self.components.tokenizer
        max_len = tokenizer.model_max_length
        source_ids = prompt_token_ids(tokenizer, caption)
        target_ids = prompt_token_ids(tokenizer, request.edited_caption)
        alignment = align_tokens(source_ids, target_ids, max_len, padding=self.options.refine_padding)
        # Replace copies maps position by position: right only where every unchanged token kept its position.
        mode = "replace" if self.options.attention_edit == "auto" and alignment.positional else "refine"
        positions: list[int] = []
        new_tokens = [j for j in alignment.new_tokens if 0 < j < len(target_ids) - 1]
        if request.edited_span.strip():
            span_ids = tokenizer(request.edited_span, add_special_tokens=False).input_ids
            span = find_span_tokens(span_ids, target_ids, alignment.new_tokens)
            if span:
                # A span can cover unchanged words ("dogs sitting on the sandy beach" around "sandy beach"): only
                # the tokens the alignment marks as new are the edit, so only they are reweighted.
                positions = [j for j in span if j in new_tokens]
            else:
                # The span is not a token run of the caption (e.g. cut by truncation): reweight the new tokens.
                positions = new_tokens
                logger.debug("edited span %r not found in %r; reweighting new tokens", request.edited_span, target_ids)
        equalizer = make_equalizer(max_len, positions, self.options.edit_word_weight) if positions else None
        steps = self.options.num_inference_steps
        target = EditTarget(
            alignment=alignment,
            mode=mode,
            cross_replace_steps=steps_of(self.options.cross_replace, steps),
            self_replace_steps=steps_of(self_replace, steps),
            equalizer=equalizer,
        )
        return target, len(positions)

    def render(self, record: Record, requests: list[EditRequest]) -> SweepResult:
        return self.sweep(record["inversion"], requests)

    def sweep(self, inversion: dict[str, Any], requests: list[EditRequest]) -> SweepResult:
        """Render every request at every sweep value; ``edit_batch_size`` targets share each sampling run.

        Every run puts the source caption first, so its output (identical in each run) is the reconstruction the
        gates compare against.
        """
        from lance_pipeline.attention_control import PromptToPromptController
        from lance_pipeline.inversion import ddim_sample, decode_latents

        o = self.options
        caption = inversion["caption"]
        jobs = [(index, f) for index in range(len(requests)) for f in o.self_replace_sweep]
        latent = inversion["latent"].to(self.device, self.dtype)
        nulls = inversion["null_embeddings"].to(self.device, self.dtype)
        result = SweepResult(reconstruction=None)
        for start in range(0, len(jobs), o.edit_batch_size):
            chunk = jobs[start : start + o.edit_batch_size]
            built = [self.build_target(caption, requests[i], f) for i, f in chunk]
            controller = PromptToPromptController(
                [target for target, _ in built], self_replace_max_tokens=o.self_replace_max_tokens
            )
            cond = self._embed([caption] + [requests[i].edited_caption for i, _ in chunk])
            latents = ddim_sample(
                self.components.unet,
                self.components.scheduler_config,
                latent,
                cond,
                nulls,
                o.guidance_scale,
                controller=controller,
            )
            images = decode_latents(self.components.vae, latents)
            if result.reconstruction is None:
                result.reconstruction = images[0]
            for (index, f), image, (target, reweighted) in zip(chunk, images[1:], built, strict=True):
                result.candidates.append(Candidate(index, f, image, reweighted, target.mode))
        return result

    def describe(self) -> dict[str, Any]:
        o = self.options
        return {
            "editor": self.name,
            "cross_replace": o.cross_replace,
            "self_replace_sweep": list(o.self_replace_sweep),
            "edit_word_weight": o.edit_word_weight,
            "attention_edit": o.attention_edit,
            "refine_padding": o.refine_padding,
            "self_replace_max_tokens": o.self_replace_max_tokens,
            "edit_batch_size": o.edit_batch_size,
        }


# The name this class had before the editor was split out of image_editing.py.
ImageEditor = PromptToPromptEditor
