"""What a discovery release is (``lance_pipeline.release_kinds``): generated images of failures that ``lance-cf
discover`` found for one model (after Wiles et al., arXiv 2208.08831), one config per failure; other models are scored
on it to see whether a failure transfers."""

from __future__ import annotations

from lance_pipeline.release_kinds import ReleaseKind

DISCOVERY = ReleaseKind(
    name="discovery",
    title="discovered failures",
    card_intro="dataset_cards.kind_sections:discovery_intro",
    card_section="dataset_cards.discovery_section:discovery_section",
    # the images on which the probed model did fail (the failure rate says how many there are)
    load_example='failed = ds.filter(lambda row: row["json"]["probe_prediction"] != row["cls"])',
    next_commands=(
        "lance-cf verify {release}",
        # the paper's transfer experiment: does a failure found for one model hold for another?
        "lance-cf eval --release {release} --model resnet50.a1_in1k{class_map} --output eval-out",
    ),
    source_kinds=("discovery",),
)
