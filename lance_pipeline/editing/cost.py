"""Measuring what editing costs, and the reference algorithm it is measured against.

* ``count_unet_evaluations(unet)``: counts UNet *sample-forwards* (one latent through the network; a batch of n is n)
  and the sample-backwards of null-text optimisation, with a forward hook, so the cost of an editor is exact and
  machine-independent. ``forward_equivalents`` weighs a backward w.r.t. the null embedding only as
  ``BACKWARD_FORWARD_EQUIVALENT`` forwards (0.866 of 0.803 TFLOP, measured with torch's FLOP counter on the SD 1.x
  UNet at 512², shared/reference/editing-2026.md).
* ``reference_sweep`` / ``reference_reconstruction``: the algorithm as the authors ran it, one prompt-to-prompt run
  of ``[caption, edited caption]`` per (edit, sweep value) and a separate reconstruction pass, built from the same
  primitives as the editor so tests and ``benchmarks/bench_edit.py`` can compare outputs and counts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

BACKWARD_FORWARD_EQUIVALENT = 1.08


@dataclass
class UnetCount:
    """Sample-forwards (``forwards``) and sample-backwards (``backwards``) seen since the counter was installed."""

    forwards: int = 0
    backwards: int = 0

    @property
    def forward_equivalents(self) -> float:
        return self.forwards + BACKWARD_FORWARD_EQUIVALENT * self.backwards


@contextlib.contextmanager
def count_unet_evaluations(unet) -> Iterator[UnetCount]:
    """Count the UNet's sample-forwards (and the backwards that follow forwards run with gradients) in the block.

    A forward under ``torch.is_grad_enabled()`` whose inputs require gradients (null-text optimisation's) is counted
    as one forward plus one backward per sample.
    """
    import torch

    count = UnetCount()

    def hook(module, args, kwargs, output):
        sample = args[0] if args else kwargs["sample"]
        batch = int(sample.shape[0])
        count.forwards += batch
        inputs = list(args) + list(kwargs.values())
        if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs):
            count.backwards += batch

    handle = unet.register_forward_hook(hook, with_kwargs=True)
    try:
        yield count
    finally:
        handle.remove()


def reference_reconstruction(editor, inversion: dict[str, Any]):
    """The reconstruction as a separate guided sampling pass of the caption (what the authors ran)."""
    return editor.render_reconstruction(inversion)


def reference_sweep(editor, inversion: dict[str, Any], requests) -> dict[tuple[int, float], Any]:
    """One prompt-to-prompt run of ``[caption, edited caption]`` per (request, sweep value), nothing shared.

    Returns:
        ``(request index, sweep value) -> final latents [2, C, h, w]`` (the run's source, then the target).
    """
    # lazy: imports torch
    from lance_pipeline.editing.attention_control import PromptToPromptController

    # lazy: imports torch
    from lance_pipeline.editing.inversion import ddim_sample

    o = editor.options
    latent = inversion["latent"].to(editor.device, editor.dtype)
    nulls = inversion["null_embeddings"].to(editor.device, editor.dtype)
    caption = inversion["caption"]
    out = {}
    for index, request in enumerate(requests):
        cond = editor._embed([caption, request.edited_caption])
        for f in o.self_replace_sweep:
            target, _ = editor.build_target(caption, request, f)
            controller = PromptToPromptController([target], self_replace_max_tokens=o.self_replace_max_tokens)
            latents = ddim_sample(
                editor.components.unet,
                editor.components.scheduler_config,
                latent,
                cond,
                nulls,
                o.guidance_scale,
                controller=controller,
            )
            out[(index, f)] = latents
    return out


# ---------------------------------------------------------------------------------------------- a build's estimate
# A build's active stages as the estimate sees them: (stage name, stage type, typed options, a function making the
# stage object, nothing loaded).
PlannedStage = tuple[str, str, Any, Callable[[], Any]]


def edits_per_image(stages: list[PlannedStage]) -> int:
    """Edits the perturb stage asks for per source image (``n_per_type`` x edit types, before the label check drops
    any); 0 without one."""
    for _name, kind, options, create in stages:
        if kind == "llm_perturber":
            return len(create().edit_types) * options.n_per_type
    return 0


def unet_evaluations(stages: list[PlannedStage], edits: int | None = None) -> dict[str, float]:
    """UNet forward-equivalents per source image of LANCE's image stages (``ReleaseKind.unet_evaluations``).

    The counts follow docs/performance.md ("At the issue's scale", counted with :func:`count_unet_evaluations`):
    null-text inversion runs S steps with I optimisation iterations each (S x (4 + 2.08 I)); prompt-to-prompt renders
    each edit as a trunk and forked branches (6 S per edit with guidance) plus a source row of 2 S per sampling run;
    the reconstruction one guided pass (2 S); LANCE-R one edit. ``edits`` per image default to the perturb stage's.
    Text stages are left out (under 1 % of editing, docs/performance.md).
    """
    edits = edits_per_image(stages) if edits is None else edits
    counts: dict[str, float] = {}
    for name, kind, options, _create in stages:
        steps = getattr(options, "num_inference_steps", None)
        if not steps:
            continue
        if kind == "null_text_inversion":
            inner = getattr(options, "num_inner_steps", 0) if options.inversion == "null_text" else 0
            counts[name] = steps * (4 + (1 + BACKWARD_FORWARD_EQUIVALENT) * inner) if inner else steps
        elif kind == "reconstruction":
            counts[name] = 2 * steps
        elif kind == "prompt_to_prompt_edit":
            counts[name] = edits * 6 * steps + 2 * steps * max(1, -(-edits // 10))
        elif kind == "lance_r_edit":
            counts[name] = 6 * steps + 2 * steps
    return counts
