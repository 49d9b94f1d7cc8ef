"""What a LANCE release is (``lance_pipeline.release_kinds``): originals, their reconstructions and counterfactual
edits made by an image editor (prompt-to-prompt by default, or any editor registered in ``EDITORS``), paired with their
originals through ``source_key``."""

from __future__ import annotations

from lance_pipeline.release_kinds import ReleaseKind

# The paired metrics compare each counterfactual with its own original; the insights cluster its edits.
PAIRED_METRICS = ("accuracy_drop", "paired_accuracy_drop", "true_class_confidence_drop", "flip_rate", "insights")

# After a build: check it, open it, score a model on it.
EDIT_NEXT_COMMANDS = (
    "lance-cf verify {release}",
    "python -c \"import datasets; print(datasets.load_dataset('{release}', '{config}', split='test'))\"",
    "lance-cf eval --release {release} --model resnet50.a1_in1k{class_map} --output eval-out",
)

LANCE = ReleaseKind(
    name="lance",
    title="LANCE counterfactual edits",
    card_intro="dataset_cards.kind_sections:lance_intro",
    load_example='weather = ds.filter(lambda row: row["json"]["edit_type"] == "weather")',
    main_config="counterfactual",
    metrics=PAIRED_METRICS,
    next_commands=EDIT_NEXT_COMMANDS,
)
