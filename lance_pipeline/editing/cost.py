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
from collections.abc import Iterator
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
