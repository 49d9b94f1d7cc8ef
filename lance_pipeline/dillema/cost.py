"""What a ControlNet build costs, in UNet forward-equivalents per source image (``ReleaseKind.unet_evaluations``):
LANCE's image stages as :mod:`lance_pipeline.editing.cost` counts them, plus the ControlNet editor's 2 S per image
and conditioning scale for each of DILLEMA's ``n_counterfactuals`` rewrites."""

from __future__ import annotations

from lance_pipeline.editing import cost


def unet_evaluations(stages: list[cost.PlannedStage]) -> dict[str, float]:
    """LANCE's counts (with the rewrites as its edits when no perturb stage ran) and the ControlNet stage's."""
    edits = cost.edits_per_image(stages)
    if not edits:
        edits = next(
            (options.n_counterfactuals for _, kind, options, _ in stages if kind == "dillema_counterfactual"), 0
        )
    counts = cost.unet_evaluations(stages, edits)
    for name, kind, options, _create in stages:
        steps = getattr(options, "num_inference_steps", None)
        if kind == "controlnet_edit" and steps:
            scales = len(getattr(options, "conditioning_scales", (1.0,)))
            counts[name] = max(edits, 1) * options.images_per_edit * scales * 2 * steps
    return counts
