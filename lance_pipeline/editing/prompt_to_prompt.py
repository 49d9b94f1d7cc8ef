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
import os
from typing import Any

from lance_pipeline.editing.candidate_selection import Candidate, EditRequest, SweepResult
from lance_pipeline.editing.options import ImageEditorOptions, steps_of
from lance_pipeline.editing.sd_components import StableDiffusionComponents, load_stable_diffusion_components
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
        self._auto_batch: int | None = None
        if options.image_size % components.latent_multiple:
            raise ValueError(
                f"image_size must be a multiple of {components.latent_multiple} for {components.model}, "
                f"got {options.image_size}"
            )

    @classmethod
    def load(cls, options: ImageEditorOptions, device: str) -> PromptToPromptEditor:
        """Load (or share) the components named by ``options`` on ``device`` and build the editor.

        On CUDA this also applies the arithmetic settings of the options: TF32 matmuls and convolutions
        (``allow_tf32``; the authors' code enabled TF32 too) and ``cudnn.benchmark`` (``cudnn_benchmark``, off by
        default: it picks convolution algorithms by timing, so bytes can differ between runs). ``compile`` other than
        ``"none"`` loads (or shares) components whose UNet blocks are compiled (``sd_components.compile_unet``).
        """
        import torch

        if str(device).startswith("cuda"):
            torch.backends.cuda.matmul.allow_tf32 = options.allow_tf32
            torch.backends.cudnn.allow_tf32 = options.allow_tf32
            torch.backends.cudnn.benchmark = options.cudnn_benchmark
        components = load_stable_diffusion_components(
            options.model, options.revision, options.dtype, device, options.cache_dir, compile=options.compile
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
        # lazy: imports torch
        from lance_pipeline.editing.inversion import make_inversion_method

        return make_inversion_method(self.options.inversion, self.components, self.options)

    def invert(self, image, caption: str) -> dict[str, Any]:
        """Invert one image with the configured method; returns the ``inversion`` record (tensors on CPU)."""
        (inversion,) = self.invert_batch([image], [caption])
        return inversion

    def invert_batch(self, images: list, captions: list[str]) -> list[dict[str, Any]]:
        """Invert several images together with the configured method."""
        return self.inversion_method().invert(list(images), list(captions)) if images else []

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
        # lazy: imports torch
        from lance_pipeline.editing.inversion import encode_prompts

        return encode_prompts(self.components.tokenizer, self.components.text_encoder, prompts).to(self.dtype)

    def reconstruct(self, inversion: dict[str, Any]):
        """The inverted image regenerated with its own caption (PIL image).

        When the inversion method already ran the source branch (``reconstruction_latent``), it is only decoded.
        """
        # lazy: imports torch
        from lance_pipeline.editing.inversion import decode_latents

        final = inversion.get("reconstruction_latent")
        if final is not None:
            return decode_latents(self.components.vae, final.to(self.device, self.dtype))[0]
        return self.render_reconstruction(inversion)

    def render_reconstruction(self, inversion: dict[str, Any]):
        """The reconstruction by a separate guided sampling pass (PIL image)."""
        # lazy: imports torch
        from lance_pipeline.editing.inversion import ddim_sample, decode_latents

        trajectory = inversion.get("source_trajectory")
        with self.autocast():
            latents = ddim_sample(
                self.components.unet,
                self.components.scheduler_config,
                inversion["latent"].to(self.device, self.dtype),
                self._embed([inversion["caption"]]),
                inversion["null_embeddings"].to(self.device, self.dtype),
                self.options.guidance_scale,
                source_trajectory=None if trajectory is None else trajectory.to(self.device, self.dtype),
            )
        return decode_latents(self.components.vae, latents)[0]

    def autocast(self):
        """bfloat16 autocast for forward-only sampling when ``precision`` is ``bf16`` (inversion stays at dtype)."""
        import torch

        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.options.precision == "bf16")

    def build_target(self, caption: str, request: EditRequest, self_replace: float):
        """The prompt-to-prompt schedule of one (edit, sweep value) target."""
        # lazy: imports torch
        from lance_pipeline.editing.attention_control import EditTarget, align_tokens, find_span_tokens, make_equalizer

        # lazy: imports torch
        from lance_pipeline.editing.inversion import prompt_token_ids

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

    def plan_runs(self, requests: list[EditRequest]) -> list[list[tuple[int, int]]]:
        """The sampling runs of a sweep: lists of ``(request index, self-replace steps)`` jobs.

        Sweep values that cover the same number of steps render the same image, so each is one job. A run holds at
        most ``edit_batch_size`` target rows (the rows it has at its end). Edits are kept whole (all their cut-offs
        in one run, so they share a trunk) as long as one edit fits; several edits share each run's source.
        """
        steps = sorted({steps_of(f, self.options.num_inference_steps) for f in self.options.self_replace_sweep})
        size = self.edit_batch_size
        if len(steps) > size:  # one edit does not fit: split its cut-offs over runs
            jobs = [(index, s) for index in range(len(requests)) for s in steps]
            return [jobs[start : start + size] for start in range(0, len(jobs), size)]
        per_run = size // len(steps)
        return [
            [(index, s) for index in range(start, min(start + per_run, len(requests))) for s in steps]
            for start in range(0, len(requests), per_run)
        ]

    @property
    def edit_batch_size(self) -> int:
        """Target rows per sampling run: the option, or (``None``) as many as the memory budget holds."""
        if self.options.edit_batch_size is not None:
            return self.options.edit_batch_size
        if self._auto_batch is None:
            self._auto_batch = auto_edit_batch_size(self.components, self.options)
            logger.info("edit_batch_size: %d target rows per run (from the memory budget)", self._auto_batch)
        return self._auto_batch

    def sweep(self, inversion: dict[str, Any], requests: list[EditRequest]) -> SweepResult:
        """Render every request at every sweep value, sharing what is provably identical.

        * One source branch per run, shared by all the run's edits and sweep values (several edits per run).
        * Per edit, a *trunk* runs with the largest self-attention cut-off of the run; the branch of a smaller
          cut-off ``s`` forks from the trunk at step ``s``, where its schedule first differs (until then both inject
          self-attention and everything else is equal, so the fork is exact).
        * The source image is decoded once (first run), and later runs drop the source row once no target needs its
          attention maps any more.

        The source branch's output is the reconstruction the gates compare against.
        """
        import torch

        # lazy: imports torch
        from lance_pipeline.editing.inversion import decode_latents

        o = self.options
        caption = inversion["caption"]
        latent = inversion["latent"].to(self.device, self.dtype)
        nulls = inversion["null_embeddings"].to(self.device, self.dtype)
        trajectory = inversion.get("source_trajectory")
        if trajectory is not None:
            trajectory = trajectory.to(self.device, self.dtype)
        source_cond = self._embed([caption])
        conds = self._embed([r.edited_caption for r in requests]) if requests else None
        base = {index: self.build_target(caption, request, 1.0) for index, request in enumerate(requests)}
        images: dict[tuple[int, int], Any] = {}
        result = SweepResult(reconstruction=None)
        for run_index, jobs in enumerate(self.plan_runs(requests) or [[]]):
            per_edit: dict[int, list[int]] = {}
            for index, s in jobs:
                per_edit.setdefault(index, []).append(s)
            with self.autocast():
                source_latent, latents = sample_sweep(
                    self.components.unet,
                    self.components.scheduler_config,
                    latent,
                    source_cond,
                    {index: conds[index : index + 1] for index in per_edit},
                    {index: base[index][0] for index in per_edit},
                    per_edit,
                    nulls,
                    o.guidance_scale,
                    o.self_replace_max_tokens,
                    keep_source_to_end=run_index == 0,
                    source_trajectory=trajectory,
                )
            keys = list(latents)
            decoded = decode_latents(
                self.components.vae,
                torch.cat(([source_latent] if source_latent is not None else []) + [latents[k] for k in keys]),
            )
            if source_latent is not None:
                result.reconstruction, decoded = decoded[0], decoded[1:]
            images.update(zip(keys, decoded, strict=True))
        for index in range(len(requests)):
            target, reweighted = base[index]
            for f in o.self_replace_sweep:
                image = images[(index, steps_of(f, o.num_inference_steps))]
                result.candidates.append(Candidate(index, f, image, reweighted, target.mode))
        return result

    def describe_components(self) -> dict[str, Any]:
        """What the stage records of the loaded Stable Diffusion components: the DDIM scheduler's config (betas read
        from the checkpoint, never literals) and the VAE's scaling factor."""
        config = self.components.scheduler_config
        keys = ("beta_start", "beta_end", "beta_schedule", "num_train_timesteps", "steps_offset", "clip_sample",
                "set_alpha_to_one", "prediction_type")  # fmt: skip
        return {
            "scheduler": {"class": "DDIMScheduler", **{k: config.get(k) for k in keys}},
            "vae_scaling_factor": self.components.vae.config.scaling_factor,
        }

    def describe(self) -> dict[str, Any]:
        o = self.options
        return {
            "editor": self.name,
            "cross_replace": o.cross_replace,
            "self_replace_sweep": list(o.self_replace_sweep),
            "edit_word_weight": o.edit_word_weight,
            "attention_edit": o.attention_edit,
            "refine_padding": o.refine_padding,
            "precision": o.precision,
            "allow_tf32": o.allow_tf32,
            "cudnn_benchmark": o.cudnn_benchmark,
            "self_replace_max_tokens": o.self_replace_max_tokens,
            "edit_batch_size": o.edit_batch_size if o.edit_batch_size is not None else f"auto ({self.edit_batch_size})",
        }


# Upper bound of target rows per run, and the share of free memory a run may plan for.
MAX_AUTO_EDIT_BATCH = 64
MEMORY_BUDGET_SHARE = 0.5


def estimate_row_bytes(components: StableDiffusionComponents, options: ImageEditorOptions) -> int:
    """Rough peak bytes one target row adds to a guided sampling run (two UNet samples: with and without text).

    Two terms: the attention probabilities materialised in the layers prompt-to-prompt edits (heads x q^2, three
    live copies: scores, the controller's output, the source rows it reads), and the UNet's widest activations
    (about 64 live tensors of the first block's width at latent resolution). An estimate, not a measurement: on CUDA
    the budget it is compared with is the free memory reported by the driver, and the chosen size is recorded.
    """
    element = {"float32": 4, "bfloat16": 2, "float16": 2}[options.dtype]
    latent = options.image_size // components.vae_scale_factor
    config = components.unet.config
    heads = config.attention_head_dim if isinstance(config.attention_head_dim, int) else max(config.attention_head_dim)
    query = min(options.self_replace_max_tokens, (latent // 2) ** 2)
    attention = 3 * heads * query * query * element
    activations = 64 * config.block_out_channels[0] * latent * latent * element
    return 2 * (attention + activations)


def auto_edit_batch_size(components: StableDiffusionComponents, options: ImageEditorOptions) -> int:
    """Target rows per run that fit ``MEMORY_BUDGET_SHARE`` of the free memory of the UNet's device."""
    import torch

    device = components.unet.device
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            free = 8 * 2**30
    rows = int(free * MEMORY_BUDGET_SHARE // estimate_row_bytes(components, options))
    return max(1, min(MAX_AUTO_EDIT_BATCH, rows))


def sample_sweep(
    unet,
    scheduler_config: dict,
    latent,
    source_cond,
    edit_conds: dict,
    edit_targets: dict,
    self_steps: dict[int, list[int]],
    null_embeddings,
    guidance_scale: float,
    self_replace_max_tokens: int,
    keep_source_to_end: bool = True,
    source_trajectory=None,
):
    """Guided DDIM sampling of a source and several edits x self-attention cut-offs under prompt-to-prompt control.

    Row 0 of every UNet call is the source; per edit, a trunk row runs with the edit's largest cut-off and the row of
    each smaller cut-off ``s`` is forked from the trunk just before step ``s`` (the first step whose schedule
    differs). Rows never interact except through the source's attention maps, so every row's result equals a
    separate run of that (edit, cut-off) within float tolerance (batch composition changes the arithmetic order).

    Args:
        unet: The UNet.
        scheduler_config: The DDIM scheduler config.
        latent: ``x_T`` ``[1, C, h, w]``, shared by all rows.
        source_cond: Source caption embedding ``[1, tokens, dim]``.
        edit_conds: ``edit -> [1, tokens, dim]`` embedding of its edited caption.
        edit_targets: ``edit -> EditTarget`` (its ``self_replace_steps`` is ignored: set per row).
        self_steps: ``edit -> self-attention cut-offs`` (steps) to render, distinct.
        null_embeddings: ``[steps, tokens, dim]``; the number of steps is taken from here.
        guidance_scale: Classifier-free guidance scale.
        self_replace_max_tokens: Self-attention is injected only in layers with at most this many query tokens.
        keep_source_to_end: Run the source branch to the last step (its result is the reconstruction); otherwise
            the source row is dropped once no target needs its attention maps.
        source_trajectory: ``[steps, C, h, w]``: pin the source row to it after every step (direct inversion).

    Returns:
        ``(final source latent [1, C, h, w] or None, {(edit, cut-off): final latent [1, C, h, w]})``.
    """
    import dataclasses

    import torch

    # lazy: imports torch
    from lance_pipeline.editing.attention_control import PromptToPromptController, attention_control

    # lazy: imports torch
    from lance_pipeline.editing.inversion import make_schedulers, progress

    num_steps = null_embeddings.shape[0]
    sampler, _ = make_schedulers(scheduler_config, num_steps, latent.device)
    rows: list[tuple[int, int]] = []  # (edit, cut-off) of target rows 1..n
    forks: dict[int, list[tuple[int, int]]] = {}
    for edit, cutoffs in self_steps.items():
        ordered = sorted(cutoffs)
        if len(set(ordered)) != len(ordered):
            raise ValueError(f"self-attention cut-offs of edit {edit} must be distinct, got {cutoffs}")
        rows.append((edit, ordered[-1]))  # the trunk
        for s in ordered[:-1]:
            forks.setdefault(s, []).append((edit, s))
    targets = {
        (edit, s): dataclasses.replace(edit_targets[edit], self_replace_steps=s)
        for edit, cutoffs in self_steps.items()
        for s in cutoffs
    }
    # The source's maps are needed while any target injects cross- or self-attention.
    source_needed_until = max([max(t.cross_replace_steps, t.self_replace_steps) for t in targets.values()] or [0])
    latents = latent.expand(1 + len(rows), *latent.shape[1:]).clone()
    conds = [source_cond] + [edit_conds[edit] for edit, _ in rows]
    controller = PromptToPromptController([targets[r] for r in rows], self_replace_max_tokens=self_replace_max_tokens)
    has_source = True
    with torch.no_grad(), attention_control(unet, controller if rows else None):
        for i, t in enumerate(progress(sampler.timesteps, f"prompt-to-prompt {len(self_steps)} edits")):
            if has_source and not keep_source_to_end and i >= source_needed_until and rows:
                latents, conds, has_source = latents[1:], conds[1:], False
            new_rows = forks.get(i, [])
            if new_rows:
                offset = 1 if has_source else 0
                trunk_row: dict[int, int] = {}
                for k, (edit, _) in enumerate(rows):
                    trunk_row.setdefault(edit, offset + k)  # an edit's first row is its trunk
                latents = torch.cat([latents] + [latents[trunk_row[edit]][None] for edit, _ in new_rows])
                conds = conds + [edit_conds[edit] for edit, _ in new_rows]
                rows = rows + new_rows
                controller.set_targets([targets[r] for r in rows])
            controller.cur_step = i
            n = latents.shape[0]
            context = torch.cat([null_embeddings[i : i + 1].expand(n, -1, -1).to(source_cond.dtype), *conds])
            noise_uncond, noise_cond = (
                unet(torch.cat([latents, latents]), t, encoder_hidden_states=context).sample.to(latents.dtype).chunk(2)
            )
            noise = noise_uncond + guidance_scale * (noise_cond - noise_uncond)
            latents = sampler.step(noise, t, latents).prev_sample
            if source_trajectory is not None and has_source:
                latents[0] = source_trajectory[i]
    offset = 1 if has_source else 0
    finals = {row: latents[offset + k : offset + k + 1] for k, row in enumerate(rows)}
    return (latents[0:1] if has_source else None), finals


# The name this class had before the editor was split out of image_editing.py.
ImageEditor = PromptToPromptEditor
