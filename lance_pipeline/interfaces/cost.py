"""What a dataset-interfaces build costs, in UNet forward-equivalents per planned image
(``ReleaseKind.unet_evaluations``): one guided generation of S steps (2 S) per image."""

from __future__ import annotations

from lance_pipeline.editing.cost import PlannedStage


def unet_evaluations(stages: list[PlannedStage]) -> dict[str, float]:
    counts: dict[str, float] = {}
    for name, kind, options, _create in stages:
        steps = getattr(options, "num_inference_steps", None)
        if kind == "shift_generation" and steps:
            counts[name] = 2 * steps
    return counts
