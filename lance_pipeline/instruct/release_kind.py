"""What an instruction-editor release is (``lance_pipeline.release_kinds``): LANCE's pipeline (captions, perturbed
captions, label check, CLIP gates) with an instruction editor in place of prompt-to-prompt: each kept edit becomes an
instruction by its edit type's rule, and a diffusers instruction-editing pipeline edits the source image with it;
evaluated like a LANCE release (paired with the originals)."""

from __future__ import annotations

from lance_pipeline.editing.release_kind import EDIT_NEXT_COMMANDS, LANCE_PAPER, PAIRED_METRICS
from lance_pipeline.release_kinds import Paper, ReleaseKind

INSTRUCT_PIX2PIX_PAPER = Paper(
    "brooks2023instructpix2pix",
    "2211.09800",
    "InstructPix2Pix: Learning to Follow Image Editing Instructions",
    ("Brooks, Tim", "Holynski, Aleksander", "Efros, Alexei A."),
    2023,
    "Proceedings of the IEEE/CVF Conference on Computer Vision and Pattern Recognition (CVPR)",
)

# The editors' names (lance_pipeline.instruct.editing.FAMILIES; not imported: that module pulls in the editor).
INSTRUCT_EDITORS = ("instruct_pix2pix", "flux2_klein", "longcat_edit", "longcat_edit_turbo", "qwen_image_edit")

INSTRUCT = ReleaseKind(
    name="instruct",
    title="Instruction-editor counterfactuals",
    card_intro="dataset_cards.kind_sections:instruct_intro",
    card_failure_modes="dataset_cards.kind_sections:edit_failure_modes",
    load_example='weather = ds.filter(lambda row: row["json"]["edit_type"] == "weather")',
    main_config="counterfactual",
    metrics=PAIRED_METRICS,
    next_commands=EDIT_NEXT_COMMANDS,
    stage_types=("instruct_edit",),
    editors=INSTRUCT_EDITORS,
    papers=(LANCE_PAPER, INSTRUCT_PIX2PIX_PAPER),
    making=(
        "Each source image was captioned, a language model rewrote one part of the caption (LANCE, Prabhu et al., "
        "NeurIPS 2023), the rewrite became a written instruction by its edit type's rule, and an instruction editor "
        "(a diffusers image-editing pipeline such as InstructPix2Pix or FLUX.2 [klein]) edited the image with it. "
        "LANCE's label check and CLIP gates filtered the results; every counterfactual keeps its source image's label."
    ),
    collection_type="Synthetic data: instruction-guided edits of the images of a source dataset",
    deviations=("lance_pipeline.editing.deviations:LANCE_DEVIATIONS",),
    editor="instruct_pix2pix",
    unet_evaluations="lance_pipeline.instruct.cost:unet_evaluations",
    stages={"instruct_edit": "lance_pipeline.instruct.editing:InstructEditStage"},
    review_edit_fields=("edited_span",),
)
