"""What a DILLEMA-style release is (``lance_pipeline.release_kinds``): LANCE's pipeline with the ControlNet editor,
which regenerates each image from its rewritten caption conditioned on the photo's edges; evaluated like a LANCE
release (paired with the originals)."""

from __future__ import annotations

from lance_pipeline.editing.release_kind import EDIT_NEXT_COMMANDS, PAIRED_METRICS
from lance_pipeline.release_kinds import ReleaseKind

CONTROLNET = ReleaseKind(
    name="controlnet",
    title="ControlNet (DILLEMA-style) counterfactuals",
    card_intro="dataset_cards.kind_sections:controlnet_intro",
    load_example='weather = ds.filter(lambda row: row["json"]["edit_type"] == "weather")',
    main_config="counterfactual",
    metrics=PAIRED_METRICS,
    next_commands=EDIT_NEXT_COMMANDS,
    stage_types=("controlnet_edit",),
    editors=("controlnet",),  # controlnet_editing.EDITOR_NAME (not imported: that module pulls in the editor)
)
