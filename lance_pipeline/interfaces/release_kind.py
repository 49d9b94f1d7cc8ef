"""What a dataset-interfaces release is (``lance_pipeline.release_kinds``): images generated under named shifts
(Vendrow et al., arXiv 2302.07865), one config per shift plus ``base``, with no pairing between images; scored by the
per-shift accuracy drop, not by LANCE's paired metrics."""

from __future__ import annotations

from lance_pipeline.release_kinds import ReleaseKind

INTERFACES = ReleaseKind(
    name="interfaces",
    title="dataset-interfaces shifts",
    card_intro="dataset_cards.kind_sections:interfaces_intro",
    card_section="dataset_cards.interfaces_section:interfaces_section",
    load_example='kept = ds.filter(lambda row: row["json"]["passed"])',
    main_config="base",
    metrics=("shift_accuracy_drop",),
    results_sections={"interfaces": "evaluation.interfaces.shift_results:validate_interfaces"},
    leaderboard="evaluation.interfaces.shift_results:SHIFT_LEADERBOARD",
    report_section="evaluation.interfaces.shift_results:report_section",
    next_commands=(
        "lance-cf verify {release}",
        "python -c \"import datasets; print(datasets.load_dataset('{release}', '{config}', split='test'))\"",
        "lance-cf eval --release {release} --model resnet50.a1_in1k{class_map} --output eval-out",
    ),
    source_kinds=("generate",),
    stage_types=("shift_generation",),
    results_configs=("base",),
)
