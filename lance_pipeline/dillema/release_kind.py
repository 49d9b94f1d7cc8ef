"""What a DILLEMA-style release is (``lance_pipeline.release_kinds``): LANCE's pipeline with the ControlNet editor,
which regenerates each image from its rewritten caption conditioned on the photo's edges; evaluated like a LANCE
release (paired with the originals)."""

from __future__ import annotations

from lance_pipeline.editing.release_kind import EDIT_NEXT_COMMANDS, LANCE_PAPER, PAIRED_METRICS
from lance_pipeline.release_kinds import Paper, ReleaseKind

DILLEMA_PAPER = Paper(
    "baresi2025dillema",
    "2502.04378",
    "DILLEMA: Diffusion and Large Language Models for Multi-Modal Augmentation",
    ("Baresi, Luciano", "Hu, Davide Yi Xian", "Mas'udi, Muhammad Irfan", "Quattrocchi, Giovanni"),
    2025,
)

CONTROLNET = ReleaseKind(
    name="controlnet",
    title="ControlNet (DILLEMA-style) counterfactuals",
    card_intro="dataset_cards.kind_sections:controlnet_intro",
    card_failure_modes="dataset_cards.kind_sections:edit_failure_modes",
    load_example='weather = ds.filter(lambda row: row["json"]["edit_type"] == "weather")',
    main_config="counterfactual",
    metrics=PAIRED_METRICS,
    next_commands=EDIT_NEXT_COMMANDS,
    stage_types=("controlnet_edit",),
    editors=("controlnet",),  # controlnet_editing.EDITOR_NAME (not imported: that module pulls in the editor)
    # DILLEMA's way of regenerating images, inside LANCE's pipeline (its label check and CLIP gates)
    papers=(DILLEMA_PAPER, LANCE_PAPER),
    making=(
        "Each source image was captioned, a language model chose words that can change without changing the class and "
        "alternatives for them, and Stable Diffusion with ControlNet regenerated the image from the rewritten caption, "
        "conditioned on the photo's structure (DILLEMA, Baresi et al.), inside LANCE's pipeline: LANCE's label check "
        "and CLIP gates filtered the results; every counterfactual keeps its source image's label."
    ),
    collection_type="Synthetic data: structure-conditioned regenerations of the images of a source dataset",
    deviations=(
        "lance_pipeline.editing.deviations:LANCE_DEVIATIONS",
        "lance_pipeline.dillema.deviations:DILLEMA_DEVIATIONS",
    ),
    editor="controlnet",
    unet_evaluations="lance_pipeline.dillema.cost:unet_evaluations",
    stages={
        "dillema_keywords": "lance_pipeline.dillema.text_stages:KeywordStage",
        "dillema_alternatives": "lance_pipeline.dillema.text_stages:AlternativesStage",
        "dillema_counterfactual": "lance_pipeline.dillema.text_stages:CounterfactualStage",
        "controlnet_edit": "lance_pipeline.dillema.controlnet_editing:ControlNetEditStage",
    },
    review_edit_fields=("edited_span",),
)
