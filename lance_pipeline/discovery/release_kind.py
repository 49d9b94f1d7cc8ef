"""What a discovery release is (``lance_pipeline.release_kinds``): generated images of failures that ``lance-cf
discover`` found for one model (after Wiles et al., arXiv 2208.08831), one config per failure; other models are scored
on it to see whether a failure transfers."""

from __future__ import annotations

from lance_pipeline.release_kinds import ReleaseKind

DISCOVERY = ReleaseKind(
    name="discovery",
    title="discovered failures",
    card_intro="dataset_cards.kind_sections:discovery_intro",
    next_commands=(
        "lance-cf verify {release}",
        "lance-cf eval --release {release} --model OTHER_MODEL{class_map} --output eval-out",
    ),
    source_kinds=("discovery",),
)
