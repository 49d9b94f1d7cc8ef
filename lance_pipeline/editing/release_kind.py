"""What a LANCE release is (``lance_pipeline.release_kinds``): originals, their reconstructions and counterfactual
edits made by an image editor (prompt-to-prompt by default, or any editor registered in ``EDITORS``), paired with their
originals through ``source_key``."""

from __future__ import annotations

from lance_pipeline.release_kinds import Paper, ReleaseKind

LANCE_PAPER = Paper(
    "prabhu2023lance",
    "2305.19164",
    "LANCE: Stress-testing Visual Models by Generating Language-guided Counterfactual Images",
    ("Prabhu, Viraj", "Yenamandra, Sriram", "Chattopadhyay, Prithvijit", "Hoffman, Judy"),
    2023,
    "Advances in Neural Information Processing Systems (NeurIPS)",
)

# The paired metrics compare each counterfactual with its own original; the insights cluster its edits.
PAIRED_METRICS = ("accuracy_drop", "paired_accuracy_drop", "true_class_confidence_drop", "flip_rate", "insights")

# After a build: check it, open it, score a model on it, and a zero-shot CLIP classifier (random weights here, so that
# it runs offline; drop --no-pretrained for the real ones, e.g. open_clip:ViT-B-32/laion2b_s34b_b79k).
EDIT_NEXT_COMMANDS = (
    "lance-cf verify {release}",
    "python -c \"import datasets; print(datasets.load_dataset('{release}', '{config}', split='test'))\"",
    "lance-cf eval --release {release} --model resnet50.a1_in1k{class_map} --output eval-out",
    "lance-cf eval --release {release} --model open_clip:ViT-B-32/openai --no-pretrained --templates simple "
    "--no-insights --output eval-out-zero-shot",
)

LANCE = ReleaseKind(
    name="lance",
    title="LANCE counterfactual edits",
    card_intro="dataset_cards.kind_sections:lance_intro",
    card_failure_modes="dataset_cards.kind_sections:edit_failure_modes",
    load_example='weather = ds.filter(lambda row: row["json"]["edit_type"] == "weather")',
    main_config="counterfactual",
    metrics=PAIRED_METRICS,
    next_commands=EDIT_NEXT_COMMANDS,
    papers=(LANCE_PAPER,),
    making=(
        "Each source image was captioned, a language model rewrote one part of the caption (subject, object, "
        "background, weather, adjective or domain), and the image was edited towards the new caption with Stable "
        "Diffusion, null-text inversion and prompt-to-prompt attention control (LANCE, Prabhu et al., NeurIPS 2023). "
        "Edits that would change the class or drift from the source image were filtered out; every counterfactual "
        "keeps its source image's label."
    ),
    collection_type="Synthetic data: text-guided edits of the images of a source dataset",
    # LANCE's pipeline may also run DILLEMA's text stages in front of its own editor; the perturber's table reaches
    # the docs and the adapter's model card only (it makes no release)
    deviations=(
        "lance_pipeline.editing.deviations:LANCE_DEVIATIONS",
        "lance_pipeline.dillema.deviations:DILLEMA_DEVIATIONS",
        "lance_pipeline.perturber.deviations:PERTURBER_DEVIATIONS",
    ),
    editor="prompt_to_prompt",
    unet_evaluations="lance_pipeline.editing.cost:unet_evaluations",
    stages={
        "blip2_captioner": "lance_pipeline.text.captioning:CaptionStage",
        "llm_perturber": "lance_pipeline.text.perturbation:PerturbStage",
        "label_check": "lance_pipeline.text.label_checks:LabelCheckStage",
        "random_word_edit": "lance_pipeline.text.random_edits:RandomEditStage",
        "null_text_inversion": "lance_pipeline.editing.stages:InversionStage",
        "reconstruction": "lance_pipeline.editing.stages:ReconstructionStage",
        "prompt_to_prompt_edit": "lance_pipeline.editing.stages:CounterfactualEditStage",
        "lance_r_edit": "lance_pipeline.editing.stages:LanceREditStage",
    },
    subcommands=("perturber",),  # training the caption perturber (lance-cf perturber collect|train)
    review_edit_fields=("edited_span",),
)
