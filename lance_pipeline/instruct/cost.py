"""What an instruction-editor build costs, in denoiser forward-equivalents per source image
(``ReleaseKind.unet_evaluations``): LANCE's text and image stages as :mod:`lance_pipeline.editing.cost` counts them,
plus the instruction editor's ``edits x candidates x branches x S``, where a guided step runs its denoiser once per
guidance branch (InstructPix2Pix: 3, text and image guidance; a guided flow editor: 2; a distilled one: 1). The
editor counts the same sample-forwards with a hook when it runs (``InstructEditor.counts``)."""

from __future__ import annotations

from lance_pipeline.editing import cost


def guidance_branches(editor: str, guidance_scale: float, image_guidance_scale: float | None = None) -> int:
    """Denoiser samples per image and step: the branches of the editor's classifier-free guidance."""
    if editor == "instruct_pix2pix":  # StableDiffusionInstructPix2PixPipeline.do_classifier_free_guidance
        return 3 if guidance_scale > 1.0 and (image_guidance_scale or 1.0) >= 1.0 else 1
    return 2 if guidance_scale > 1.0 else 1


def unet_evaluations(stages: list[cost.PlannedStage]) -> dict[str, float]:
    """LANCE's counts for the stages it knows and the instruct_edit stage's."""
    edits = cost.edits_per_image(stages)
    counts = cost.unet_evaluations(stages, edits)
    for name, kind, options, _create in stages:
        if kind != "instruct_edit":
            continue
        scales = options.image_guidance_scales or (None,)
        per_edit = sum(
            options.images_per_edit * guidance_branches(options.editor, options.guidance_scale, scale)
            for scale in scales
        )
        counts[name] = max(edits, 1) * per_edit * options.num_inference_steps
    return counts
