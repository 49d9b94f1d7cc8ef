"""Dataset cards for LANCE counterfactual releases, rendered from a release's manifest (and evaluation results).

Cards import nothing from ``builder`` but the release format (``builder.release_format``).
"""

from dataset_cards.card import render_release_card
from dataset_cards.gallery import write_gallery
from evaluation.editors_section import write_comparison_plot

__all__ = ["render_release_card", "write_comparison_plot", "write_gallery"]
